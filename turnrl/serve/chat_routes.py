"""The chat APIs' routes, at the root (`/v1/...`) and per session (`/sessions/<id>/v1/...`), and the session rule.

The APIs are a table of modules (`APIS`), each with the same small surface (`ChatApi`): its URL, parse a body into
the proxy's `ChatCall`, answer a recorded call, stream one as the API's events, shape an error. Adding an API is
one module and a line in the table; a tool type of an API is a change in its module. The session routes are one
dispatcher that matches the known forms at the end of the path, so an unknown form is a 404 listing the URL forms,
never another route. Each answer carries the session in the X-Session-Id header (percent-encoded outside printable
ASCII). docs/serving.md has the endpoints, the session rule and the streams.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations, and `Request` is imported
# inside the functions that add the routes (fastapi stays an optional dependency: `turnrl[serve]`).

import asyncio
import json
import logging
import unicodedata
from collections.abc import Awaitable, Callable
from typing import Any, Protocol
from urllib.parse import quote

from turnrl.engines.base import Engine, InvalidRequest
from turnrl.serve import anthropic, inference, openai, responses
from turnrl.serve.http import classify, json_body, model_object, models_list, stream_flag
from turnrl.serve.sessions import (
    ChatCall,
    ChatProxy,
    ChatRequestError,
    RecordedCall,
    Session,
    SessionNotFound,
)

log = logging.getLogger(__name__)


class Events(Protocol):
    """One streamed call as an API's server-sent events, fed the proxy's stream (`ChatProxy.complete(on_delta=)`)."""

    def start(self, prompt_tokens: int) -> str: ...
    def delta(self, kind: str, text: str) -> str: ...
    def finish(self, call: RecordedCall, finish: str) -> str: ...
    def error(self, status: int, message: str, kind: str, param: str | None) -> str: ...


class ChatApi(Protocol):
    """What an API module (openai.py, responses.py, anthropic.py) gives the routes."""

    PATH: str
    """The call's URL after /v1, at the root and per session ("/chat/completions")."""
    PATHS: tuple[str, ...]
    """URL forms after /v1 whose errors take this API's shape."""

    def parse(self, body: dict[str, Any], proxy: ChatProxy) -> tuple[ChatCall, str | None]:
        """The call, and the session the body names by its history (Responses' previous_response_id), if any."""
        ...

    def answer(self, call: RecordedCall, finish: str, body: dict[str, Any], model: str, proxy: ChatProxy,
               session_id: str) -> dict[str, Any]: ...
    def events(self, body: dict[str, Any], model: str, proxy: ChatProxy, session_id: str) -> Events: ...
    def error_body(self, status: int, message: str, kind: str, param: str | None = None,
                   code: Any = None) -> dict[str, Any]: ...


APIS: dict[str, ChatApi] = {"openai": openai, "responses": responses, "anthropic": anthropic}


def api_of(path: str) -> ChatApi:
    """The API whose shape an error on `path` takes: the one with a URL form `path` ends with; OpenAI's for every
    other route (turnrl's own token-level routes too)."""
    end = path.rstrip("/")
    return next((api for api in APIS.values() if end.endswith(tuple("/v1" + p for p in api.PATHS))), APIS["openai"])


def error_body(path: str, status: int, message: str, kind: str, param: str | None = None,
               code: Any = None) -> dict[str, Any]:
    """The error in the shape of the API that `path` belongs to (OpenAI's `{"error": {message, type, param,
    code}}`, or Anthropic's `{"type": "error", "error": {type, message}}` under /v1/messages)."""
    return api_of(path).error_body(status, message, kind, param, code)


def error_response(path: str, status: int, message: str, kind: str, param: str | None = None, code: Any = None,
                   headers: dict[str, str] | None = None) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(path, status, message, kind, param, code), status_code=status, headers=headers)


# ---- the session rule ---------------------------------------------------------------------------------
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


def subagent_of(headers: Any, body: dict[str, Any]) -> dict[str, Any] | None:
    """What marks a call as a harness sub-agent's, or None: Codex's `x-openai-subagent` header (`collab_spawn`,
    `review`, ...) and its `x-codex-turn-metadata` (a header, or `client_metadata` in the body: JSON with
    `thread_source: subagent`, `subagent_kind`, `parent_thread_id`), or turnrl's own `X-Turnrl-Subagent` header (any
    agent can send it). The proxy records it in the call's notes (`turns[k].subagent`)."""
    found: dict[str, Any] = {}
    for name in ("x-turnrl-subagent", "x-openai-subagent"):
        value = headers.get(name)
        if value and value.lower() not in ("false", "0"):
            found["kind"] = value
    raw = headers.get("x-codex-turn-metadata")
    client = body.get("client_metadata")
    if raw is None and isinstance(client, dict):
        raw = client.get("x-codex-turn-metadata")
    try:
        meta = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError:
        meta = None
    if isinstance(meta, dict) and (meta.get("thread_source") == "subagent" or meta.get("subagent_kind")
                                   or meta.get("parent_thread_id")):
        found.setdefault("kind", str(meta.get("subagent_kind") or "subagent"))
        found.update({k: str(meta[k]) for k in ("thread_id", "parent_thread_id") if meta.get(k)})
    return found or None



# ---- the routes --------------------------------------------------------------------------------------
_COUNT_TOKENS = "/v1" + anthropic.COUNT_PATH
_MODEL_FORM = "/v1/models/<model>"
_API_FORMS = {"/v1" + api.PATH: name for name, api in APIS.items()}
_SESSION_FORMS = {**{form: "POST" for form in _API_FORMS}, _COUNT_TOKENS: "POST", "/v1/models": "GET",
                  _MODEL_FORM: "GET", "/trajectories": "GET", "/reward": "POST", inference.PATH: "POST",
                  "": "GET, DELETE"}
"""URL form after /sessions/<id> -> its method (GET and DELETE on the session itself)."""

FORMS = [*(f"POST {form}" for form in _API_FORMS), f"POST {_COUNT_TOKENS}", f"POST /v1{openai.COMPLETIONS_PATH}",
         *(f"POST /sessions/<id>{form}" for form in _API_FORMS), f"POST /sessions/<id>{_COUNT_TOKENS}",
         "GET /sessions/<id>/v1/models", "GET /sessions/<id>/v1/models/<model>", "GET /sessions",
         "GET /sessions/<id>", "DELETE /sessions/<id>", "GET /sessions/<id>/trajectories",
         "POST /sessions/<id>/reward", f"POST {inference.PATH}", f"POST /sessions/<id>{inference.PATH}"]
"""The URL forms of the chat APIs, for 404s."""


def add_chat_routes(app: Any, engine: Engine, proxy: ChatProxy, model_name: str, forms: list[str]) -> None:
    from fastapi import Request

    serve_call = _call_server(proxy, engine, model_name)
    actions = _session_actions(proxy, engine, model_name)
    for form, name in _API_FORMS.items():
        app.post(form)(_bind(serve_call, name))

    @app.post(_COUNT_TOKENS)
    async def count_tokens(request: Request):
        return await actions[_COUNT_TOKENS](request, None)

    @app.post("/v1" + openai.COMPLETIONS_PATH)
    async def completions(request: Request):
        return await _text_completion(proxy, model_name, request)

    @app.post(inference.PATH)
    async def generate_tokens(request: Request):
        await _reap(proxy, engine)
        return await _generate_tokens(proxy, request, None)

    @app.get("/sessions")
    async def sessions():
        await _reap(proxy, engine)
        return {"sessions": [s.summary() for s in proxy.sessions()]}

    @app.api_route("/sessions/{rest:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH", "OPTIONS"])
    async def session_route(rest: str, request: Request):
        session_id, form = _split_session_path(rest)
        allowed = _SESSION_FORMS.get(form) if session_id else None
        if allowed is None or request.method not in (*allowed.split(", "), "OPTIONS"):
            return _no_route(request, allowed, forms)
        if request.method == "OPTIONS":  # not a CORS preflight (the middleware answers those): the methods
            return _allow(allowed)
        if form in _API_FORMS:
            return await serve_call(_API_FORMS[form], request, session_id)
        await _reap(proxy, engine)
        return await actions[form](request, session_id)


def _call_server(proxy: ChatProxy, engine: Engine, model_name: str) -> Callable[..., Awaitable[Any]]:
    """What serves a call of the API named `name`, at the root (`session_id` None: the session rule) or in a
    session."""

    async def serve_call(name: str, request: Any, session_id: str | None) -> Any:
        await _reap(proxy, engine)
        body = await json_body(request)
        stream, api = stream_flag(body), APIS[name]
        chat, previous = api.parse(body, proxy)
        chat.subagent = subagent_of(request.headers, body)
        named, rule = (session_id, "path") if session_id else (previous, "previous_response_id") if previous else (
            _named_session(request, body))
        if named:
            check_session_id(named, rule)
        session = proxy.resolve(named, rule, chat.messages)
        log.info("%s call on session %s (%s)", name, session.id, rule or "continued or new")
        headers = {SESSION_HEADER: session_header(session.id)}
        model = body.get("model") or model_name
        if stream:
            events = api.events(body, model, proxy, session.id)
            return await _stream(proxy, events, session, chat, request.url.path, headers)
        call, finish = await proxy.complete(session, chat)
        return _json(api.answer(call, finish, body, model, proxy, session.id), headers)

    return serve_call


def _no_route(request: Any, allowed: str | None, forms: list[str]) -> Any:
    """404 for an unknown form (listing the known ones), 405 for a known form and another method."""
    path = request.url.path
    if allowed is None:
        message = f"no route {request.method} {path}; this server answers: {', '.join(forms)}"
        return error_response(path, 404, message, "not_found_error")
    return error_response(path, 405, f"{request.method} is not allowed on {path} (allowed: {allowed})",
                          "invalid_request_error", headers={"Allow": allowed})


def _allow(allowed: str) -> Any:
    from fastapi import Response

    return Response(status_code=204, headers={"Allow": f"{allowed}, OPTIONS"})


def _json(body: dict[str, Any], headers: dict[str, str]) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(body, headers=headers)


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


def _bind(handler: Any, name: str) -> Any:
    from fastapi import Request

    async def endpoint(request: Request):
        return await handler(name, request, None)

    endpoint.__name__ = f"{name}_root"
    return endpoint


Action = Callable[..., Awaitable[Any]]


def _session_actions(proxy: ChatProxy, engine: Engine, model_name: str) -> dict[str, Action]:
    """URL form after /sessions/<id> -> what answers it (`(request, session_id)`), the chat calls aside."""
    async def count_tokens(request: Any, session_id: str | None) -> dict[str, int]:
        return await anthropic.count_tokens(proxy, await json_body(request))  # no session is opened or used

    async def models(request: Any, session_id: str) -> dict[str, Any]:
        return models_list(model_name, getattr(engine, "max_context", None))

    async def model(request: Any, session_id: str) -> dict[str, Any]:
        return model_object(request.path_params["rest"].partition("/v1/models/")[2])

    async def trajectories(request: Any, session_id: str) -> dict[str, Any]:
        return {"session_id": session_id, "trajectories": [t.to_json() for t in proxy.trajectories(session_id)]}

    async def reward(request: Any, session_id: str) -> dict[str, Any]:
        return await _post_reward(proxy, engine, session_id, await json_body(request))

    async def session(request: Any, session_id: str) -> dict[str, Any]:
        if request.method != "DELETE":
            return proxy.session(session_id).summary()
        closed = proxy.close_session(session_id)
        if closed is None:
            raise SessionNotFound(session_id)
        await engine.release(session_id)
        return {"ok": True, "calls": len(closed.calls)}

    async def generate_tokens(request: Any, session_id: str) -> Any:
        return await _generate_tokens(proxy, request, session_id)

    return {_COUNT_TOKENS: count_tokens, "/v1/models": models, _MODEL_FORM: model, "/trajectories": trajectories,
            "/reward": reward, inference.PATH: generate_tokens, "": session}


async def _generate_tokens(proxy: ChatProxy, request: Any, session_id: str | None) -> Any:
    """`POST [/sessions/<id>]/inference/v1/generate` (turnrl/serve/inference.py): token ids in, recorded in the
    session, token ids and logprobs out."""
    body = await json_body(request)
    prompt_ids, sampling, stop_token_ids = inference.parse(body)
    named, rule = (session_id, "path") if session_id else (request.headers.get(SESSION_HEADER), "header")
    if named:
        check_session_id(named, rule)
    session = proxy.resolve_tokens(named, rule, prompt_ids)
    try:
        call = await proxy.complete_tokens(session, prompt_ids, sampling, stop_token_ids)
    except InvalidRequest as e:  # a token id outside the vocabulary, a prompt longer than the context
        param = "token_ids" if e.param == "prompt_ids" else e.param
        raise ChatRequestError(str(e), param=param) from None
    given = body.get("request_id")
    request_id = given if isinstance(given, str) and given else f"gen-{session.id}-{call.index}"
    return _json(inference.answer(call, request_id, session.id), {SESSION_HEADER: session_header(session.id)})


async def _post_reward(proxy: ChatProxy, engine: Engine, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
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


async def _reap(proxy: ChatProxy, engine: Engine) -> None:
    for session in proxy.reap():
        await _release(engine, session.id)


async def _release(engine: Engine, session_id: str) -> None:
    try:
        await engine.release(session_id)
    except Exception as e:  # a cache entry that was not dropped must not fail the request
        log.warning("session %s: engine.release raised %r", session_id, e)


# ---- server-sent events ------------------------------------------------------------------------------
async def _stream(proxy: ChatProxy, events: Events, session: Session, chat: ChatCall, path: str,
                  headers: dict[str, str]) -> Any:
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

    async def lines():
        pending = first
        try:
            while True:
                for kind, value in pending:
                    if kind == "done":
                        yield _finish_stream(events, task, session, path)
                        return
                    yield events.start(value) if kind == "start" else events.delta(kind, value)
                pending = [await queue.get()]
        finally:
            if not task.done():
                task.cancel()

    return StreamingResponse(lines(), media_type="text/event-stream",
                             headers={**headers, "Cache-Control": "no-cache"})


def _finish_stream(events: Events, task: asyncio.Task, session: Session, path: str) -> str:
    try:
        call, finish = task.result()
    except Exception as e:  # after the stream started: the API's error event ends it
        status, kind, message, param, _ = classify(e, path)
        log.warning("streamed call on session %s failed: %s", session.id, message)
        return events.error(status, message, kind, param)
    return events.finish(call, finish)


async def _text_completion(proxy: ChatProxy, model_name: str, request: Any) -> Any:
    """OpenAI's legacy `completions.create`: the prompt's tokens (no chat template), not recorded."""
    body = await json_body(request)
    stream = stream_flag(body)
    prompt, sampling, logprobs = openai.completion_request(body)
    prompt_ids = await asyncio.to_thread(proxy.renderer.encode, prompt)
    model = body.get("model") or model_name
    if stream:
        options = body.get("stream_options") or {}
        events = openai.CompletionEvents(model, bool(isinstance(options, dict) and options.get("include_usage")))
        return await _stream_text(proxy, prompt_ids, sampling, events, request.url.path)
    out, text, _ = await proxy.text_completion(prompt_ids, sampling)
    return openai.completion_body(out, text, len(prompt_ids), model,
                                  openai.completion_logprobs(out, proxy.renderer.decode) if logprobs else None)


async def _stream_text(proxy: ChatProxy, prompt_ids: list[int], sampling: dict[str, Any],
                       events: openai.CompletionEvents, path: str) -> Any:
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
