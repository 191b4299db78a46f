"""`turnrl serve`: one HTTP server for a token-level engine and the per-session OpenAI-compatible proxy.

    turnrl serve --model tiny-qwen3                        # 127.0.0.1:8000, no token needed
    turnrl serve --model M --host 0.0.0.0 --token SECRET   # any other bind address requires a token

Endpoints (JSON; errors are `{"error": {"message", "type", "code"}}`):

Token level, what `HttpEngine` speaks (wire format in turnrl/engines/http.py):
    POST /generate          {prompt_ids, sampling, request_id, images?} -> {token_ids, logprobs, finish_reason,
                            policy_version, cached_prompt_tokens}
    POST /update_weights    safetensors bytes (?version=N&final=false), or {"path": "...", "version": N?} -> {policy_version}
    POST /sleep | /wake_up  -> {"ok": true}
    POST /release           {request_id} -> {"ok": true}
    GET  /health            -> {status, model, policy_version, sessions}

OpenAI-compatible, per session: an unmodified OpenAI client gets `base_url = http://HOST:PORT/sessions/<id>/v1`.
A session is created by its first request; its id is also the engine request id, so every call of the session
goes to the same replica and reuses its KV cache.
    POST /sessions/{id}/v1/chat/completions   a chat.completion (tool calls parsed into `tool_calls`)
    GET  /sessions/{id}/v1/models, GET /v1/models
    GET  /sessions/{id}/trajectories          -> {session_id, trajectories: [Trajectory JSON]}
    DELETE /sessions/{id}                     drop the session (and the engine's cache for it)
    GET  /sessions                            -> {sessions: [{id, calls}]}

Rollout server (only when started with a rollout configuration: `--scheduler`, `--env`, `--agent`, `--plugin`,
`--tools` or `--rollout-config`; ms-swift's `swift rollout --multi_turn_scheduler`). The server builds a
RolloutManager over its engine with `turnrl.build.build_stack`, as `turnrl rollout` does, so plugins are imported
and the scheduler resolved in this process; the client is `turnrl.remote.RemoteRollout`:
    GET  /rollout           -> {model, policy_version, agent, agent_loop, agents, sampling, limits, concurrency,
                            chat_template_kwargs}
    POST /rollout           {rows: [...], n: 1, id_prefix: "", sampling?: {SamplingParams fields, over the
                            server's}} -> application/x-ndjson: one Trajectory JSON per line as each finishes,
                            blank heartbeat lines, then {"done": true, "trajectories": N}, or
                            {"error": {message, type}} if the server failed mid-stream. No rewards here (the
                            client scores); a failing trajectory arrives as a FAILED trajectory.

Authentication: with a token (`--token` or TURNRL_SERVE_TOKEN) every request needs
`Authorization: Bearer <token>` (401 otherwise; OpenAI clients send their api_key this way). Binding to an
address other than loopback without a token is refused: the server runs the model for anyone who can reach it.
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
from pathlib import Path
from typing import Any

from turnrl.engines.base import Engine, EngineError
from turnrl.engines.http import (
    TOKEN_ENV,
    output_to_json,
    sampling_from_json,
    sampling_to_json,
    tensors_from_safetensors_bytes,
)
from turnrl.proxy import ChatProxy, ChatRequestError, SessionNotFound

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
def create_app(engine: Engine, proxy: ChatProxy | None = None, *, token: str | None = None,
               model_name: str = "turnrl", token_level: bool = True, rollout: Any = None,
               heartbeat_s: float = 15.0) -> Any:
    """The FastAPI app serving `engine` (token level, unless `token_level=False`), `proxy` (OpenAI, per
    session) and `rollout` (a RolloutManager over `engine`: `/rollout`, streaming a heartbeat line after each
    `heartbeat_s` without a finished trajectory). Endpoints in the module docstring."""
    try:
        from fastapi import FastAPI
    except ImportError:
        raise ImportError("turnrl's HTTP server needs fastapi and uvicorn: pip install 'turnrl[serve]'") from None

    app = FastAPI(title="turnrl", docs_url=None, redoc_url=None, openapi_url=None)
    _add_auth_and_errors(app, token)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "policy_version": getattr(engine, "policy_version", None),
                "sessions": len(proxy.session_ids()) if proxy else 0, "rollout": rollout is not None}

    @app.get("/v1/models")
    async def models():
        return _models(model_name)

    if token_level:
        _add_token_routes(app, engine)
    if proxy is not None:
        _add_session_routes(app, engine, proxy, model_name)
    if rollout is not None:
        _add_rollout_routes(app, rollout, model_name, heartbeat_s)
    return app


def _error(status: int, message: str, kind: str, code: Any = None) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": code or status}}, status_code=status)


def _add_auth_and_errors(app: Any, token: str | None) -> None:
    from fastapi import Request

    if token:
        expected = f"Bearer {token}".encode()

        @app.middleware("http")
        async def require_token(request: Request, call_next):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return _error(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')",
                              "authentication_error")
            return await call_next(request)

    handlers = [  # the most specific class wins (Starlette walks the exception's MRO)
        (ChatRequestError, 400, "invalid_request_error", lambda e: str(e)),
        (SessionNotFound, 404, "not_found_error", lambda e: f"no session {e.args[0]!r}"),
        (EngineError, 502, "engine_error", lambda e: f"engine error: {e}"),
        (ValueError, 400, "invalid_request_error", lambda e: str(e)),
    ]
    for cls, status, kind, message in handlers:
        async def handle(request: Request, exc: Exception, status=status, kind=kind, message=message):
            return _error(status, message(exc), kind, getattr(exc, "code", None))

        app.add_exception_handler(cls, handle)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return _error(500, f"{type(exc).__name__}: {exc}", "server_error")


async def _json_body(request: Any) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise ValueError("the request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _add_token_routes(app: Any, engine: Engine) -> None:
    from fastapi import Request

    @app.post("/generate")
    async def generate(request: Request):
        body = await _json_body(request)
        prompt_ids, request_id = body.get("prompt_ids"), body.get("request_id")
        if not isinstance(prompt_ids, list) or not all(isinstance(t, int) for t in prompt_ids):
            raise ValueError("prompt_ids must be a list of token ids (ints)")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string (the trajectory id)")
        params = sampling_from_json(body.get("sampling") or {})
        out = await engine.generate(prompt_ids, params, request_id=request_id, images=body.get("images") or None)
        return output_to_json(out)

    @app.post("/update_weights")
    async def update_weights(request: Request):
        if request.headers.get("content-type", "").startswith("application/json"):
            body = await _json_body(request)
            tensors = await asyncio.to_thread(_load_safetensors_path, body.get("path"))
            version = body.get("version")
        else:
            tensors = tensors_from_safetensors_bytes(await request.body())
            version = request.query_params.get("version")
        # final=false: one bucket of a streamed update (passed on only then, so any engine takes one-shot ones)
        streamed = {"final": False} if request.query_params.get("final", "").lower() == "false" else {}
        new_version = await engine.update_weights(tensors, None if version is None else int(version), **streamed)
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


def _add_session_routes(app: Any, engine: Engine, proxy: ChatProxy, model_name: str) -> None:
    from fastapi import Request

    @app.post("/sessions/{session_id:path}/v1/chat/completions")
    async def chat_completions(session_id: str, request: Request):
        return await proxy.chat_completion(session_id, await _json_body(request))

    @app.get("/sessions/{session_id:path}/v1/models")
    async def session_models(session_id: str):
        return _models(model_name)

    @app.get("/sessions/{session_id:path}/trajectories")
    async def trajectories(session_id: str):
        return {"session_id": session_id, "trajectories": [t.to_json() for t in proxy.trajectories(session_id)]}

    @app.get("/sessions")
    async def sessions():
        return {"sessions": [{"id": s, "calls": len(proxy.session(s).calls)} for s in proxy.session_ids()]}

    @app.delete("/sessions/{session_id:path}")
    async def close(session_id: str):
        session = proxy.close_session(session_id)
        if session is None:
            raise SessionNotFound(session_id)
        await engine.release(session_id)
        return {"ok": True, "calls": len(session.calls)}


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
    from turnrl.rollout import group_ids

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


def _models(model_name: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "turnrl"}]}


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
               chat_template_kwargs: dict[str, Any] | None = None, log_level: str = "info") -> None:
    """Serve `engine`, per-session OpenAI endpoints over it (chat template of `tokenizer` with
    `chat_template_kwargs`) and, with `rollout` (a RolloutManager over `engine`), `/rollout`, until interrupted.
    `turnrl serve` builds the three with `turnrl.build.build_stack`; closing them is the caller's."""
    import uvicorn

    from turnrl.render import ChatRenderer

    check_bind(host, token)
    proxy = ChatProxy(engine, ChatRenderer(tokenizer, chat_template_kwargs), model_name=model_name,
                      tool_parser=tool_parser, sampling=sampling)
    app = create_app(engine, proxy, token=token, model_name=model_name, rollout=rollout)
    log.info("serving %s on http://%s:%d (sessions: /sessions/<id>/v1%s)", model_name, host, port,
             f"; rollouts: /rollout, agent {rollout.default_agent}" if rollout is not None else "")
    uvicorn.run(app, host=host, port=port, log_level=log_level)
