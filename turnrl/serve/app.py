"""`turnrl serve`: one HTTP server for a token-level engine, the chat APIs agents speak, and the rollout server.

    turnrl serve --model tiny-qwen3                        # 127.0.0.1:8000, no token needed
    turnrl serve --model M --host 0.0.0.0 --token SECRET   # any other bind address requires a token

This module builds the app (`create_app`: GET /health, GET /v1/models and /v1/models/<model>, the middleware) and
runs it (`run_server`, `ServerThread`); the routes live next to it (turnrl/serve/__init__.py lists the modules,
docs/serving.md every endpoint).

Bodies over `--max-body-mb` (8 by default; /update_weights exempt) get a 413 before they are read; bodies over
1 MB are parsed, and conversations tokenised, off the event loop. Authentication: with a token (`--token` or
TURNRL_SERVE_TOKEN) every request needs `Authorization: Bearer <token>` (401 otherwise; OpenAI and Anthropic clients
send their api_key this way; `X-Api-Key: <token>`, as older Anthropic clients send it, is accepted too). Binding
to an address other than loopback without a token is refused: the server runs the model for anyone who can reach
it. CORS allows any origin unless `--cors-origin` narrows it (its preflight needs no token); HEAD is answered on
every GET route. Errors are in the shape of the API a path belongs to (OpenAI's, or Anthropic's under
/v1/messages); turnrl's own token-level routes answer a bad field with a 422 naming it.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations, and `Request` is imported
# inside the functions that build the app (fastapi stays an optional dependency: `turnrl[serve]`).

import asyncio
import hmac
import ipaddress
import logging
import socket
import threading
import time
from typing import Any

from turnrl.engines.base import Engine, EngineError, InvalidRequest
from turnrl.engines.http import TOKEN_ENV
from turnrl.serve import engine_routes
from turnrl.serve.chat_routes import FORMS, SESSION_HEADER, add_chat_routes, error_body, error_response
from turnrl.serve.http import classify, model_object, models_list
from turnrl.serve.sessions import ChatProxy, ChatRequestError, SessionNotFound

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
        return models_list(model_name, getattr(engine, "max_context", None))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return model_object(model_id)

    if token_level:
        engine_routes.add_token_routes(app, engine)
    if proxy is not None:
        add_chat_routes(app, engine, proxy, model_name, forms)
    if rollout is not None:
        engine_routes.add_rollout_routes(app, rollout, model_name, heartbeat_s)
    return app


def _url_forms(token_level: bool, sessions: bool, rollout: bool) -> list[str]:
    """The URL forms this server answers, for 404s."""
    forms = ["GET /health", "GET /v1/models", "GET /v1/models/<model>"]
    if sessions:
        forms += FORMS
    if token_level:
        forms += engine_routes.FORMS
    if rollout:
        forms += engine_routes.ROLLOUT_FORMS
    return forms


# ---- middleware: the token, errors in each API's shape, CORS, HEAD, the body limit ----------------------
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
                return error_response(request.url.path, 401, "missing or wrong bearer token (send 'Authorization: "
                                      "Bearer <token>')", "authentication_error")
            return await call_next(request)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        path = request.url.path
        if exc.status_code == 404:
            message = f"no route {request.method} {path}; this server answers: {', '.join(forms)}"
            return error_response(path, 404, message, "not_found_error")
        if exc.status_code == 405:
            return error_response(path, 405, f"{request.method} is not allowed on {path} (allowed: "
                                  f"{(exc.headers or {}).get('Allow', '?')})", "invalid_request_error",
                                  headers=dict(exc.headers or {}))
        kind = "request_too_large" if exc.status_code == 413 else "invalid_request_error"
        return error_response(path, exc.status_code, str(exc.detail), kind)

    for cls in (ChatRequestError, InvalidRequest, SessionNotFound, EngineError, ValueError):
        @app.exception_handler(cls)
        async def handle(request: Request, exc: Exception):
            status, kind, message, param, code = classify(exc, request.url.path)
            return error_response(request.url.path, status, message, kind, param, code)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(request.url.path, 500, f"{type(exc).__name__}: {exc}", "server_error")


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
