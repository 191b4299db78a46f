"""`turnrl serve`: one HTTP server for a token-level engine, the chat APIs agents speak, and the rollout server.

    turnrl serve --model tiny-qwen3                        # 127.0.0.1:8000, no token needed
    turnrl serve --model M --host 0.0.0.0 --token SECRET   # any other bind address requires a token

Token level, what `HttpEngine` speaks (wire format in turnrl/engines/http.py; a field that fails validation is a
422 naming it, `{"error": {"message", "type", "param", "code"}}`):
    POST /generate          {prompt_ids, sampling, request_id, images?} -> {token_ids, logprobs, finish_reason,
                            policy_version, cached_prompt_tokens}; a max_new_tokens beyond the context after the
                            prompt is capped, and the answer then holds `max_new_tokens` and `warnings`
    POST /update_weights    safetensors bytes (?version=N&final=false), or {"path": "...", "version": N?} -> {policy_version}
    POST /sleep | /wake_up  -> {"ok": true}
    POST /release           {request_id} -> {"ok": true}
    GET  /health            -> {status, model, policy_version, sessions}

The chat APIs (turnrl/serve/sessions.py records exact tokens; turnrl/serve/chat_apis.py converts the Responses and Anthropic
APIs), at the root and per session, streaming with `stream: true` (docs/serving.md):
    POST /v1/chat/completions, /v1/responses, /v1/messages       the session rule names the episode
    POST /sessions/{id}/v1/chat/completions, .../responses, .../messages
    GET  /v1/models, /sessions/{id}/v1/models, /v1/models/{model}, /sessions/{id}/v1/models/{model}
    POST /v1/messages/count_tokens, /sessions/{id}/v1/messages/count_tokens   -> {"input_tokens": N}
    POST /v1/completions                      legacy text completions: the raw prompt's tokens, not recorded
    GET  /sessions                            -> {sessions: [{id, status, calls, reward, ...}]}, open and finished
    GET  /sessions/{id}, DELETE /sessions/{id}, GET /sessions/{id}/trajectories
    POST /sessions/{id}/reward                {"reward": number | [one per call], "done": true}
A session id is also the engine request id, so every call of the session goes to the same replica and reuses its
KV cache. The session routes are one dispatcher that matches the known forms at the end of the path, so an
unknown form is a 404 listing the URL forms, never another route. Errors are OpenAI's shape, or Anthropic's
`{"type": "error", "error": {"type", "message"}}` under /v1/messages; client errors are 400 there.

Rollout server (only when started with a rollout configuration: `--scheduler`, `--env`, `--agent`, `--plugin`,
`--tools` or `--rollout-config`; ms-swift's `swift rollout --multi_turn_scheduler`). The server builds a
RolloutManager over its engine with `turnrl.build.build_stack`, as `turnrl rollout` does, so plugins are imported
and the scheduler resolved in this process; the client is `turnrl.rollout.remote.RemoteRollout`:
    GET  /rollout           -> {model, policy_version, agent, agent_loop, agents, sampling, limits, concurrency,
                            chat_template_kwargs}
    POST /rollout           {rows: [...], n: 1, id_prefix: "", sampling?: {SamplingParams fields, over the
                            server's}} -> application/x-ndjson: one Trajectory JSON per line as each finishes,
                            blank heartbeat lines, then {"done": true, "trajectories": N}, or
                            {"error": {message, type}} if the server failed mid-stream. No rewards here (the
                            client scores); a failing trajectory arrives as a FAILED trajectory.

Bodies over `--max-body-mb` (8 by default; /update_weights exempt) get a 413 before they are read; bodies over
1 MB are parsed, and conversations tokenised, off the event loop. Authentication: with a token (`--token` or
TURNRL_SERVE_TOKEN) every request needs `Authorization: Bearer <token>` (401 otherwise; OpenAI and Anthropic clients
send their api_key this way; `X-Api-Key: <token>`, as older Anthropic clients send it, is accepted too). Binding
to an address other than loopback without a token is refused: the server runs the model for anyone who can reach
it. CORS allows any origin unless `--cors-origin` narrows it (its preflight needs no token); HEAD is answered on
every GET route. The X-Session-Id response header is the session id percent-encoded outside printable ASCII.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations, and `Request` is imported
# inside the functions that build the app (fastapi stays an optional dependency: `turnrl[serve]`).

import asyncio
import dataclasses
import hmac
import ipaddress
import json
import logging
import socket
import threading
import time
import unicodedata
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any
from urllib.parse import quote

from turnrl.engines.base import Engine, EngineError, InvalidRequest
from turnrl.engines.http import (
    TOKEN_ENV,
    output_to_json,
    sampling_from_json,
    sampling_to_json,
    tensors_from_safetensors_bytes,
)
from turnrl.serve.chat_apis import (
    AnthropicEvents,
    ChatEvents,
    CompletionEvents,
    ResponsesEvents,
    anthropic_body,
    call_from_anthropic,
    call_from_responses,
    completion_body,
    completion_logprobs,
    completion_request,
    responses_body,
)
from turnrl.serve.sessions import (
    ChatCall,
    ChatProxy,
    ChatRequestError,
    RecordedCall,
    SessionNotFound,
    chat_call_from_openai,
    chat_response,
)
from turnrl.types import SamplingParams

log = logging.getLogger(__name__)


class BindError(ValueError):
    """The server must not start with these host/token settings."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname other than localhost may resolve to anything
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse a non-loopback bind without a token (raises BindError saying how to fix it)."""
    if not token and not is_loopback(host):
        raise BindError(
            f"refusing to serve on {host!r} without a token: anyone who can reach it could run the model and read "
            f"sessions. Pass --token SECRET (or set {TOKEN_ENV}); clients then send 'Authorization: Bearer SECRET' "
            "(OpenAI clients: api_key=SECRET). Or bind to 127.0.0.1."
        )


# ---------------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------------
DEFAULT_MAX_BODY_MB = 8.0
"""`--max-body-mb`: larger bodies get a 413 before they are read (a chat body rarely passes 1 MB)."""


def create_app(engine: Engine, proxy: ChatProxy | None = None, *, token: str | None = None,
               model_name: str = "turnrl", token_level: bool = True, rollout: Any = None,
               heartbeat_s: float = 15.0, max_body_mb: float = DEFAULT_MAX_BODY_MB,
               cors_origins: list[str] | None = None) -> Any:
    """The FastAPI app serving `engine` (token level, unless `token_level=False`), `proxy` (the OpenAI chat,
    Responses and Anthropic APIs, at the root and per session) and `rollout` (a RolloutManager over `engine`:
    `/rollout`, streaming a heartbeat line after each `heartbeat_s` without a finished trajectory). Bodies over
    `max_body_mb` are refused with a 413 before they are read. CORS allows `cors_origins` (None: any); its
    preflight needs no token. HEAD is answered on every GET route. Endpoints in the module docstring."""
    try:
        from fastapi import FastAPI
    except ImportError:
        raise ImportError("turnrl's HTTP server needs fastapi and uvicorn: pip install 'turnrl[serve]'") from None

    app = FastAPI(title="turnrl", docs_url=None, redoc_url=None, openapi_url=None)
    forms = _url_forms(token_level, proxy is not None, rollout is not None)
    _add_auth_and_errors(app, token, forms)
    app.add_middleware(BodyLimit, max_bytes=int(max_body_mb * 2**20))
    _add_cors_and_head(app, cors_origins or ["*"])

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "policy_version": getattr(engine, "policy_version", None),
                "sessions": len(proxy.session_ids()) if proxy else 0, "rollout": rollout is not None}

    @app.get("/v1/models")
    async def models():
        return _models(model_name)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return _model(model_id)

    if token_level:
        _add_token_routes(app, engine)
    if proxy is not None:
        _add_api_routes(app, engine, proxy, model_name, forms)
    if rollout is not None:
        _add_rollout_routes(app, rollout, model_name, heartbeat_s)
    return app


def _url_forms(token_level: bool, sessions: bool, rollout: bool) -> list[str]:
    """The URL forms this server answers, for 404s."""
    forms = ["GET /health", "GET /v1/models", "GET /v1/models/<model>"]
    if sessions:
        forms += ["POST /v1/chat/completions", "POST /v1/responses", "POST /v1/messages",
                  "POST /v1/messages/count_tokens", "POST /v1/completions",
                  "POST /sessions/<id>/v1/chat/completions", "POST /sessions/<id>/v1/responses",
                  "POST /sessions/<id>/v1/messages", "POST /sessions/<id>/v1/messages/count_tokens",
                  "GET /sessions/<id>/v1/models", "GET /sessions/<id>/v1/models/<model>", "GET /sessions",
                  "GET /sessions/<id>", "DELETE /sessions/<id>", "GET /sessions/<id>/trajectories",
                  "POST /sessions/<id>/reward"]
    if token_level:
        forms += ["POST /generate", "POST /update_weights", "POST /sleep", "POST /wake_up", "POST /release"]
    if rollout:
        forms += ["GET /rollout", "POST /rollout"]
    return forms


# ---- errors, each API in its own shape -------------------------------------------------------------
_TOKEN_PATHS = {"/generate", "/update_weights", "/release", "/sleep", "/wake_up"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                    413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error"}


def _is_anthropic(path: str) -> bool:
    return path.rstrip("/").endswith(("/v1/messages", "/v1/messages/count_tokens"))


def error_body(path: str, status: int, message: str, kind: str, param: str | None = None,
               code: Any = None) -> dict[str, Any]:
    """OpenAI's `{"error": {message, type, param, code}}`, or Anthropic's `{"type": "error", "error": {type,
    message}}` under /v1/messages."""
    if _is_anthropic(path):
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def _error(path: str, status: int, message: str, kind: str, param: str | None = None, code: Any = None,
           headers: dict[str, str] | None = None) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(path, status, message, kind, param, code), status_code=status, headers=headers)


def classify(exc: BaseException, path: str) -> tuple[int, str, str, str | None, Any]:
    """(status, type, message, param, code) of an exception raised while serving `path`."""
    if isinstance(exc, ChatRequestError):
        return exc.status, "invalid_request_error", str(exc), exc.param, exc.code
    if isinstance(exc, InvalidRequest):  # turnrl's own token-level routes: 422; the OpenAI/Anthropic APIs: 400
        if path in _TOKEN_PATHS:
            return 422, "invalid_request_error", str(exc), exc.param, None
        param = "messages" if exc.param == "prompt_ids" else exc.param  # the chat client sent messages, not ids
        return 400, "invalid_request_error", str(exc), param, "context_length_exceeded" if param == "messages" else None
    if isinstance(exc, SessionNotFound):
        return 404, "not_found_error", f"no session {exc.args[0]!r} (GET /sessions lists them)", None, None
    if isinstance(exc, EngineError):
        return 502, "engine_error", f"engine error: {exc}", None, None
    if isinstance(exc, ValueError):
        return 400, "invalid_request_error", str(exc), getattr(exc, "param", None), None
    return 500, "server_error", f"{type(exc).__name__}: {exc}", None, None


def _add_auth_and_errors(app: Any, token: str | None, forms: list[str]) -> None:
    from fastapi import Request
    from starlette.exceptions import HTTPException

    if token:
        expected, expected_key = f"Bearer {token}".encode(), token.encode()

        @app.middleware("http")
        async def require_token(request: Request, call_next):
            given = request.headers.get("authorization", "").encode()
            key = request.headers.get("x-api-key", "").encode()  # Anthropic clients before 2.x send api_key so
            if not (hmac.compare_digest(given, expected) or hmac.compare_digest(key, expected_key)):
                return _error(request.url.path, 401, "missing or wrong bearer token (send 'Authorization: Bearer "
                              "<token>')", "authentication_error")
            return await call_next(request)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        path = request.url.path
        if exc.status_code == 404:
            message = f"no route {request.method} {path}; this server answers: {', '.join(forms)}"
            return _error(path, 404, message, "not_found_error")
        if exc.status_code == 405:
            return _error(path, 405, f"{request.method} is not allowed on {path} (allowed: "
                          f"{(exc.headers or {}).get('Allow', '?')})", "invalid_request_error", headers=dict(exc.headers or {}))
        kind = "request_too_large" if exc.status_code == 413 else "invalid_request_error"
        return _error(path, exc.status_code, str(exc.detail), kind)

    for cls in (ChatRequestError, InvalidRequest, SessionNotFound, EngineError, ValueError):
        @app.exception_handler(cls)
        async def handle(request: Request, exc: Exception):
            status, kind, message, param, code = classify(exc, request.url.path)
            return _error(request.url.path, status, message, kind, param, code)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return _error(request.url.path, 500, f"{type(exc).__name__}: {exc}", "server_error")


def _add_cors_and_head(app: Any, origins: list[str]) -> None:
    """Outermost, so a CORS preflight is answered before the token check (browsers send it without the
    Authorization header; the request that follows still needs it), and HEAD reaches the GET routes."""
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
                       expose_headers=[SESSION_HEADER])
    app.add_middleware(HeadAsGet)


class HeadAsGet:
    """ASGI middleware: HEAD is routed as GET and answered with its status and headers, without the body
    (RFC 9110 §9.3.2; FastAPI's GET routes would answer it with a 405)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def without_body(message: dict) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, without_body)


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` gets a 413 at once, by its Content-Length before anything is
    read, or, without one (chunked), as soon as the bytes received pass the limit. `/update_weights` is exempt:
    its body is a model's weights (the trainer's, behind the token)."""

    EXEMPT = frozenset({"/update_weights"})

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.EXEMPT:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"").decode() or None
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            from fastapi.responses import JSONResponse

            message = (f"request body of {length} bytes is over the server's limit of {self.max_bytes} bytes "
                       "(turnrl serve --max-body-mb)")
            response = JSONResponse(error_body(scope["path"], 413, message, "request_too_large"), status_code=413,
                                    headers={"connection": "close"})
            return await response(scope, receive, send)
        received = 0

        async def limited() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                from starlette.exceptions import HTTPException

                raise HTTPException(413, f"request body over the server's limit of {self.max_bytes} bytes "
                                         "(turnrl serve --max-body-mb)")
            return message

        await self.app(scope, limited, send)


_BIG_BODY = 1 << 20


async def _json_body(request: Any) -> dict[str, Any]:
    raw = await request.body()
    try:  # a large body is parsed off the event loop, which goes on serving /health and the other sessions
        body = await asyncio.to_thread(json.loads, raw) if len(raw) > _BIG_BODY else json.loads(raw)
    except ValueError:
        raise ValueError("the request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# ---- token level -------------------------------------------------------------------------------------
_GENERATE_FIELDS = {"prompt_ids", "sampling", "request_id", "images"}


def _generate_request(body: dict[str, Any], engine: Engine) -> tuple[list[int], SamplingParams, str, list | None,
                                                                     list[str]]:
    """(prompt_ids, sampling, request_id, images, warnings) of a /generate body; InvalidRequest (422) names the
    field. `max_new_tokens` beyond what fits the engine's context after the prompt is capped, with a warning."""
    unknown = set(body) - _GENERATE_FIELDS
    if unknown:
        raise InvalidRequest(f"/generate: unknown field(s) {sorted(unknown)}; known: {sorted(_GENERATE_FIELDS)}",
                             sorted(unknown)[0])
    prompt_ids, request_id, images = body.get("prompt_ids"), body.get("request_id"), body.get("images")
    if not isinstance(prompt_ids, list) or not prompt_ids:
        raise InvalidRequest("prompt_ids must be a non-empty list of token ids", "prompt_ids")
    for i, t in enumerate(prompt_ids):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise InvalidRequest(f"prompt_ids[{i}] must be a token id (an integer >= 0), got {t!r}", "prompt_ids")
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequest("request_id must be a non-empty string (the trajectory id)", "request_id")
    if images is not None and not (isinstance(images, list) and all(isinstance(im, str) for im in images)):
        raise InvalidRequest("images must be a list of strings (paths, URLs or data URIs)", "images")
    params = sampling_from_json(body.get("sampling") or {})
    warnings = []
    context = getattr(engine, "max_context", None)
    if isinstance(context, int) and len(prompt_ids) + params.max_new_tokens > context > len(prompt_ids):
        room = context - len(prompt_ids)
        warnings.append(f"sampling.max_new_tokens={params.max_new_tokens} capped to {room}: the prompt's "
                        f"{len(prompt_ids)} tokens leave {room} of the context's {context}")
        params = dataclasses.replace(params, max_new_tokens=room)
    return prompt_ids, params, request_id, images or None, warnings


def _add_token_routes(app: Any, engine: Engine) -> None:
    from fastapi import Request

    @app.post("/generate")
    async def generate(request: Request):
        prompt_ids, params, request_id, images, warnings = _generate_request(await _json_body(request), engine)
        out = await engine.generate(prompt_ids, params, request_id=request_id, images=images)
        body = output_to_json(out)
        if warnings:
            body["max_new_tokens"], body["warnings"] = params.max_new_tokens, warnings
        return body

    @app.post("/update_weights")
    async def update_weights(request: Request):
        if request.headers.get("content-type", "").startswith("application/json"):
            body = await _json_body(request)
            tensors = await asyncio.to_thread(_load_safetensors_path, body.get("path"))
            version = body.get("version")
        else:
            tensors = tensors_from_safetensors_bytes(await request.body())
            version = request.query_params.get("version")
        # final=false: one bucket of a streamed update, pause=...: what requests in flight do (each passed on only
        # when given, so any engine takes a default push)
        options: dict[str, Any] = {"final": False} if request.query_params.get("final", "").lower() == "false" else {}
        if request.query_params.get("pause", "keep") != "keep":
            options["pause"] = request.query_params["pause"]
        new_version = await engine.update_weights(tensors, None if version is None else int(version), **options)
        return {"policy_version": new_version}

    @app.post("/sleep")
    async def sleep():
        await engine.sleep()
        return {"ok": True}

    @app.post("/wake_up")
    async def wake_up():
        await engine.wake_up()
        return {"ok": True}

    @app.post("/release")
    async def release(request: Request):
        await engine.release(str((await _json_body(request)).get("request_id", "")))
        return {"ok": True}


# ---- the chat APIs: at the root and per session ------------------------------------------------------
SESSION_HEADER = "X-Session-Id"
_HEADER_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")
_NAMING_FIELDS = {"path": "the session id in the path", "header": SESSION_HEADER, "user": "user",
                  "metadata": "metadata.session_id"}


def session_header(session_id: str) -> str:
    """The X-Session-Id value of a session: its id, percent-encoded (UTF-8) outside printable ASCII and for
    `%` itself, so that any id (用户-42) fits an HTTP header and decodes back with `urllib.parse.unquote`."""
    return quote(session_id, safe=_HEADER_SAFE)


def check_session_id(session_id: str, rule: str) -> None:
    """Refuse an id holding control characters (CR/LF would break the response header, and no log or URL shows
    them), naming the field it came from; before anything runs."""
    bad = [c for c in session_id if unicodedata.category(c) == "Cc"]
    if bad:
        where = _NAMING_FIELDS.get(rule, "the session id")
        raise ChatRequestError(f"{where} must not hold control characters (got {session_id!r}); a session id is "
                               "text such as a user name or an episode id", param=where)


def _named_session(request: Any, body: dict[str, Any]) -> tuple[str | None, str]:
    """(session id, the rule that named it) of a call to a root endpoint: X-Session-Id, then `user`, then
    `metadata.session_id`; (None, "") when none names one (docs/serving.md: the session rule)."""
    header = request.headers.get(SESSION_HEADER)
    if header:
        return header, "header"
    if isinstance(body.get("user"), str) and body["user"]:
        return body["user"], "user"
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("session_id"), str) and metadata["session_id"]:
        return metadata["session_id"], "metadata"
    return None, ""


class _Api:
    """What differs between the three APIs: parsing a body, answering it, streaming it."""

    def __init__(self, proxy: ChatProxy, model_name: str):
        self.proxy, self.model_name = proxy, model_name
        self.responses: OrderedDict[str, tuple[str, list[dict]]] = OrderedDict()
        """Responses API: response id -> (session id, its conversation), for `previous_response_id`."""

    def parse(self, api: str, body: dict[str, Any]) -> tuple[ChatCall, str | None]:
        """(the call, the session id that `previous_response_id` names)."""
        if api == "chat":
            return chat_call_from_openai(body), None
        if api == "messages":
            return call_from_anthropic(body), None
        previous = body.get("previous_response_id")
        if previous is None:
            return call_from_responses(body), None
        if previous not in self.responses:
            raise ChatRequestError(f"previous_response_id {previous!r} is unknown here (responses are kept in "
                                   "memory; send the whole input instead)", param="previous_response_id")
        session_id, history = self.responses[previous]
        return call_from_responses(body, history), session_id

    def answer(self, api: str, body: dict[str, Any], call: RecordedCall, finish: str, session_id: str
               ) -> dict[str, Any]:
        model = body.get("model") or self.model_name
        if api == "chat":
            return chat_response(call, finish, model, bool(body.get("logprobs")), self.proxy.renderer)
        if api == "messages":
            return anthropic_body(call, finish, model, f"msg_{uuid.uuid4().hex[:24]}")
        response_id = f"resp_{uuid.uuid4().hex}"
        self._remember(response_id, call, session_id)
        return responses_body(call, finish, body, response_id, model)

    def events(self, api: str, body: dict[str, Any]) -> Any:
        model = body.get("model") or self.model_name
        if api == "chat":
            options = body.get("stream_options") or {}
            return ChatEvents(model, bool(isinstance(options, dict) and options.get("include_usage")),
                              self.proxy.renderer if body.get("logprobs") else None)
        if api == "messages":
            return AnthropicEvents(model, f"msg_{uuid.uuid4().hex[:24]}")
        return ResponsesEvents(body, model, f"resp_{uuid.uuid4().hex}")

    def _remember(self, response_id: str, call: RecordedCall, session_id: str) -> None:
        self.responses[response_id] = (session_id, [*call.messages, call.reply])
        while len(self.responses) > 10_000:
            self.responses.popitem(last=False)


def _add_api_routes(app: Any, engine: Engine, proxy: ChatProxy, model_name: str, forms: list[str]) -> None:
    from fastapi import Request, Response
    from fastapi.responses import JSONResponse

    apis = _Api(proxy, model_name)

    async def serve_call(api: str, request: Request, session_id: str | None):
        await _reap(proxy, engine)
        body = await _json_body(request)
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            raise ChatRequestError(f"stream must be a boolean, got {body['stream']!r}", param="stream")
        chat, previous = apis.parse(api, body)
        named, rule = (session_id, "path") if session_id else (previous, "previous_response_id") if previous else (
            _named_session(request, body))
        if named:
            check_session_id(named, rule)
        session = proxy.resolve(named, rule, chat.messages)
        log.info("%s call on session %s (%s)", api, session.id, rule or "continued or new")
        headers = {SESSION_HEADER: session_header(session.id)}
        if body.get("stream"):
            return await _stream(proxy, apis, api, body, session, chat, request.url.path, headers)
        call, finish = await proxy.complete(session, chat)
        return JSONResponse(apis.answer(api, body, call, finish, session.id), headers=headers)

    for api, suffix in _API_SUFFIXES.items():
        app.post(f"/v1{suffix}")(_bind(serve_call, api))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await _count_tokens(proxy, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _text_completion(proxy, model_name, request)

    @app.get("/sessions")
    async def sessions():
        await _reap(proxy, engine)
        return {"sessions": [s.summary() for s in proxy.sessions()]}

    @app.api_route("/sessions/{rest:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH", "OPTIONS"])
    async def session_route(rest: str, request: Request):
        session_id, form = _split_session_path(rest)
        allowed = _SESSION_FORMS.get(form) if session_id else None
        if allowed is None:
            message = f"no route {request.method} {request.url.path}; this server answers: {', '.join(forms)}"
            return _error(request.url.path, 404, message, "not_found_error")
        if request.method == "OPTIONS":  # not a CORS preflight (the middleware answers those): the methods
            return Response(status_code=204, headers={"Allow": f"{allowed}, OPTIONS"})
        if request.method not in allowed.split(", "):
            return _error(request.url.path, 405, f"{request.method} is not allowed on {request.url.path} (allowed: "
                          f"{allowed})", "invalid_request_error", headers={"Allow": allowed})
        if form in _API_FORMS:
            return await serve_call(_API_FORMS[form], request, session_id)
        return await _session_action(form, session_id, request, proxy, engine, model_name)


_MODEL_FORM = "/v1/models/<model>"
_API_SUFFIXES = {"chat": "/chat/completions", "responses": "/responses", "messages": "/messages"}
_API_FORMS = {"/v1" + suffix: api for api, suffix in _API_SUFFIXES.items()}
_SESSION_FORMS = {**{form: "POST" for form in _API_FORMS}, "/v1/messages/count_tokens": "POST", "/v1/models": "GET",
                  _MODEL_FORM: "GET", "/trajectories": "GET", "/reward": "POST", "": "GET, DELETE"}
"""URL form after /sessions/<id> -> its method (GET and DELETE on the session itself)."""


def _split_session_path(rest: str) -> tuple[str, str]:
    """(session id, form) of the path after /sessions/: the longest known form it ends with; an id holding
    `/v1/` with no known form after it is an unknown route, never a session of that name."""
    session_id, _, model = rest.partition("/v1/models/")
    if session_id and model:
        return session_id, _MODEL_FORM
    for form in sorted((f for f in _SESSION_FORMS if f and f != _MODEL_FORM), key=len, reverse=True):
        if rest.endswith(form) and len(rest) > len(form):
            return rest[: -len(form)], form
    if "/v1/" in rest or rest.endswith("/v1"):
        return rest, "unknown"
    return rest.rstrip("/"), ""


def _bind(handler: Any, api: str) -> Any:
    from fastapi import Request

    async def endpoint(request: Request):
        return await handler(api, request, None)

    endpoint.__name__ = f"{api}_root"
    return endpoint


async def _session_action(form: str, session_id: str, request: Any, proxy: ChatProxy, engine: Engine,
                          model_name: str) -> Any:
    await _reap(proxy, engine)
    if form == "/v1/models":
        return _models(model_name)
    if form == _MODEL_FORM:
        return _model(request.path_params["rest"].partition("/v1/models/")[2])
    if form == "/v1/messages/count_tokens":
        return await _count_tokens(proxy, request)
    if form == "/trajectories":
        return {"session_id": session_id, "trajectories": [t.to_json() for t in proxy.trajectories(session_id)]}
    if form == "/reward":
        body = await _json_body(request)
        unknown = set(body) - {"reward", "done"}
        if unknown or "reward" not in body:
            raise ChatRequestError('a reward body is {"reward": number or [one per model call], "done": true}; '
                                   f"got fields {sorted(body)}", param="reward")
        done = body.get("done", True)
        if not isinstance(done, bool):
            raise ChatRequestError(f"done must be a boolean, got {done!r}", param="done")
        session = proxy.set_reward(session_id, body["reward"], done=done)
        if done:
            await _release(engine, session_id)
        return {"ok": True, **session.summary()}
    if request.method == "DELETE":
        closed = proxy.close_session(session_id)
        if closed is None:
            raise SessionNotFound(session_id)
        await engine.release(session_id)
        return {"ok": True, "calls": len(closed.calls)}
    return proxy.session(session_id).summary()


async def _count_tokens(proxy: ChatProxy, request: Any) -> dict[str, int]:
    """Anthropic's `messages.count_tokens`: the prompt tokens of the body rendered with the chat template."""
    body = await _json_body(request)
    chat = call_from_anthropic({**body, "max_tokens": body.get("max_tokens") or 1})  # not required here
    return {"input_tokens": await asyncio.to_thread(proxy.count_tokens, chat)}


async def _text_completion(proxy: ChatProxy, model_name: str, request: Any) -> Any:
    """OpenAI's legacy `completions.create`: the prompt's tokens (no chat template), not recorded."""
    body = await _json_body(request)
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise ChatRequestError(f"stream must be a boolean, got {body['stream']!r}", param="stream")
    prompt, sampling, logprobs = completion_request(body)
    prompt_ids = await asyncio.to_thread(proxy.renderer.encode, prompt)
    model = body.get("model") or model_name
    if body.get("stream"):
        options = body.get("stream_options") or {}
        events = CompletionEvents(model, bool(isinstance(options, dict) and options.get("include_usage")))
        return await _stream_text(proxy, prompt_ids, sampling, events, request.url.path)
    out, text, _ = await proxy.text_completion(prompt_ids, sampling)
    return completion_body(out, text, len(prompt_ids), model,
                           completion_logprobs(out, proxy.renderer.decode) if logprobs else None)


async def _stream_text(proxy: ChatProxy, prompt_ids: list[int], sampling: dict[str, Any], events: Any,
                       path: str) -> Any:
    """A text completion as server-sent events; nothing is sent before its first text, as in `_stream`."""
    from fastapi.responses import StreamingResponse

    queue: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(proxy.text_completion(prompt_ids, sampling, lambda text: queue.put_nowait(text)))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    first = await queue.get()
    if first is None and not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]

    async def lines():
        text = first
        try:
            while text is not None:
                yield events.delta(text)
                text = await queue.get()
            try:
                out = task.result()[0]
            except Exception as e:  # after the stream started: an error event ends it
                status, kind, message, param, _ = classify(e, path)
                yield events.error(status, message, kind, param)
                return
            yield events.finish(out, len(prompt_ids))
        finally:
            if not task.done():
                task.cancel()

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _reap(proxy: ChatProxy, engine: Engine) -> None:
    for session in proxy.reap():
        await _release(engine, session.id)


async def _release(engine: Engine, session_id: str) -> None:
    try:
        await engine.release(session_id)
    except Exception as e:  # a cache entry that was not dropped must not fail the request
        log.warning("session %s: engine.release raised %r", session_id, e)


async def _stream(proxy: ChatProxy, apis: _Api, api: str, body: dict[str, Any], session: Any, chat: ChatCall,
                  path: str, headers: dict[str, str]) -> Any:
    """The call as server-sent events in the API's protocol. Until its first text (or its end) nothing is sent,
    so a request the engine refuses still gets an HTTP error, not a broken stream. A client that goes away
    cancels the engine call."""
    from fastapi.responses import StreamingResponse

    queue: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(proxy.complete(session, chat, lambda kind, value: queue.put_nowait((kind, value))))
    task.add_done_callback(lambda _: queue.put_nowait(("done", None)))
    first: list[tuple[str, Any]] = []
    while not first or first[-1][0] == "start":
        first.append(await queue.get())
    error = None if task.cancelled() or first[-1][0] != "done" else task.exception()
    if error is not None:
        raise error
    events = apis.events(api, body)

    async def lines():
        pending = first
        try:
            while True:
                for kind, value in pending:
                    if kind == "done":
                        yield _finish_stream(apis, api, events, task, session, path)
                        return
                    yield events.start(value) if kind == "start" else events.delta(kind, value)
                pending = [await queue.get()]
        finally:
            if not task.done():
                task.cancel()

    return StreamingResponse(lines(), media_type="text/event-stream",
                             headers={**headers, "Cache-Control": "no-cache"})


def _finish_stream(apis: _Api, api: str, events: Any, task: asyncio.Task, session: Any, path: str) -> str:
    try:
        call, finish = task.result()
    except Exception as e:  # after the stream started: the API's error event ends it
        status, kind, message, param, _ = classify(e, path)
        log.warning("streamed call on session %s failed: %s", session.id, message)
        return events.error(status, message, kind, param)
    if api == "responses":
        apis._remember(events.id, call, session.id)
    return events.finish(call, finish)


def _add_rollout_routes(app: Any, manager: Any, model_name: str, heartbeat_s: float) -> None:
    from fastapi import Request
    from fastapi.responses import StreamingResponse

    @app.get("/rollout")
    async def describe():
        agent = manager.agents[manager.default_agent]
        return {
            "model": model_name, "policy_version": getattr(manager.engine, "policy_version", None),
            "agent": manager.default_agent, "agent_loop": getattr(agent, "__name__", manager.default_agent),
            "agents": sorted(manager.agents), "sampling": sampling_to_json(manager.sampling),
            "limits": dataclasses.asdict(manager.limits), "concurrency": manager.concurrency,
            "chat_template_kwargs": getattr(manager.renderer, "chat_template_kwargs", {}),
        }

    @app.post("/rollout")
    async def rollout(request: Request):
        rows, n, id_prefix, sampling = _rollout_request(await _json_body(request), manager)
        return StreamingResponse(_rollout_lines(manager, rows, n, id_prefix, sampling, heartbeat_s),
                                 media_type="application/x-ndjson")


def _rollout_request(body: dict[str, Any], manager: Any) -> tuple[list[dict[str, Any]], int, str, Any]:
    """Validate a /rollout body (ValueError -> 400 before anything streams)."""
    from turnrl.rollout.manager import group_ids

    unknown = set(body) - {"rows", "n", "id_prefix", "sampling"}
    if unknown:
        raise ValueError(f"/rollout: unknown field(s) {sorted(unknown)}; known: id_prefix, n, rows, sampling")
    rows, n, id_prefix = body.get("rows"), body.get("n", 1), body.get("id_prefix", "")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError("/rollout: rows must be a list of JSON objects (dataset rows)")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"/rollout: n must be an integer >= 1, got {n!r}")
    if not isinstance(id_prefix, str):
        raise ValueError(f"/rollout: id_prefix must be a string, got {id_prefix!r}")
    given = body.get("sampling") or {}
    if not isinstance(given, dict):
        raise ValueError("/rollout: sampling must be a JSON object of SamplingParams fields")
    sampling = sampling_from_json({**sampling_to_json(manager.sampling), **given})
    for row, group in zip(rows, group_ids(rows, id_prefix), strict=True):
        manager.context(row, f"{group}-0", group, 0)  # an unknown agent_name fails the request now, with a 400
    return rows, n, id_prefix, sampling


_STREAM_END = object()


async def _rollout_lines(manager: Any, rows: list[dict[str, Any]], n: int, id_prefix: str, sampling: Any,
                         heartbeat_s: float):
    """NDJSON lines of `manager.stream` (module docstring). Leaving early (the client went away) cancels the
    rollout: its trajectories are cancelled and their engine caches released."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for traj in manager.stream(rows, n, id_prefix=id_prefix, sampling=sampling):
                queue.put_nowait(traj)
            queue.put_nowait(_STREAM_END)
        except Exception as e:  # trajectories fail on their own; this is a bug or a dead engine
            log.exception("/rollout failed after it started streaming")
            queue.put_nowait(e)

    task = asyncio.create_task(pump())
    count = 0
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), heartbeat_s)
            except TimeoutError:
                yield "\n"  # keeps proxies and the client's read timeout from closing an idle stream
                continue
            if item is _STREAM_END:
                yield json.dumps({"done": True, "trajectories": count}) + "\n"
                return
            if isinstance(item, Exception):
                error = {"message": f"{type(item).__name__}: {item}", "type": "server_error"}
                yield json.dumps({"error": error}) + "\n"
                return
            count += 1
            yield json.dumps(item.to_json(), ensure_ascii=False, default=_json_default) + "\n"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _json_default(obj: Any) -> Any:  # what TrajectoryWriter writes for values JSON has no type for
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, set | tuple):
        return list(obj)
    return str(obj)


def _model(name: str) -> dict[str, Any]:
    """A model object in OpenAI's shape and Anthropic's (both SDKs' `models.retrieve` read the same URL)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "turnrl",
            "type": "model", "display_name": name, "created_at": "1970-01-01T00:00:00Z"}


def _models(model_name: str) -> dict[str, Any]:
    return {"object": "list", "data": [_model(model_name)], "has_more": False, "first_id": model_name,
            "last_id": model_name}


def _load_safetensors_path(path: Any) -> dict[str, Any]:
    from safetensors.torch import load_file

    if not isinstance(path, str) or not path:
        raise ValueError('update_weights JSON needs "path": a .safetensors file or a folder of them on the server')
    where = Path(path)
    files = sorted(where.glob("*.safetensors")) if where.is_dir() else [where]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"update_weights: no safetensors file at {path}")
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


# ---------------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------------
class ServerThread:
    """Serves an ASGI app with uvicorn in a daemon thread (its own event loop), on a free port by default.

        server = ServerThread(app); base_url = server.start(); ...; server.stop()
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app, self.host, self.port, self.log_level = app, host, port, log_level
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> str:
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=self.log_level, access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[sock])),
                                        name=f"turnrl-http-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.host}:{self.port} did not start")
            time.sleep(0.01)
        return self.base_url

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)


def run_server(engine: Engine, tokenizer: Any, rollout: Any = None, *, model_name: str, host: str = "127.0.0.1",
               port: int = 8000, token: str | None = None, tool_parser: str = "hermes", sampling: Any = None,
               chat_template_kwargs: dict[str, Any] | None = None, log_level: str = "info",
               max_body_mb: float = DEFAULT_MAX_BODY_MB, session_ttl_s: float | None = None,
               cors_origins: list[str] | None = None) -> None:
    """Serve `engine`, the chat APIs over it (chat template of `tokenizer` with `chat_template_kwargs`; sessions
    idle past `session_ttl_s` are aborted) and, with `rollout` (a RolloutManager over `engine`), `/rollout`,
    until interrupted. `turnrl serve` builds the three with `turnrl.build.build_stack`; closing them is the
    caller's."""
    import uvicorn

    from turnrl.render import ChatRenderer

    check_bind(host, token)
    proxy = ChatProxy(engine, ChatRenderer(tokenizer, chat_template_kwargs), model_name=model_name,
                      tool_parser=tool_parser, sampling=sampling, session_ttl_s=session_ttl_s)
    app = create_app(engine, proxy, token=token, model_name=model_name, rollout=rollout, max_body_mb=max_body_mb,
                     cors_origins=cors_origins)
    log.info("serving %s on http://%s:%d (/v1 and /sessions/<id>/v1: chat, responses, messages%s)", model_name,
             host, port, f"; rollouts: /rollout, agent {rollout.default_agent}" if rollout is not None else "")
    uvicorn.run(app, host=host, port=port, log_level=log_level)
