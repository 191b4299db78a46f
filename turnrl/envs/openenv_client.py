"""The OpenEnv wire protocol, spoken to a server without openenv installed here (`--env openenv+http://HOST:PORT`).

A server made by `openenv.core.env_server.create_app` serves `GET /schema` (the action's JSON schema) and a
WebSocket `/ws` where each connection is its own environment instance: messages `{"type": "reset", "data":
{seed, episode_id, ...}}`, `{"type": "step", "data": action}`, `{"type": "close"}`; answers `{"type":
"observation", "data": {observation, reward, done, metadata}}` or `{"type": "error", "data": {message, code}}`.
Its HTTP `/reset` and `/step` build a fresh environment per request (simulation mode), so they serve only envs
whose step needs no state from reset: they are the fallback when a server has no WebSocket.

A server refuses sessions beyond its `max_concurrent_envs` (error code CAPACITY_REACHED, with `max_sessions`):
the first refusal teaches this client the limit, and trajectories then wait for a free session (at most
`session_wait_s`). A server that dies mid-episode fails that trajectory with a message naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import weakref
from typing import Any

from turnrl.envs.base import EnvError

_CONNECT_TIMEOUT_S = 30.0


class ServerInfo:
    """What every trajectory shares about one server: its schema and how many sessions it takes."""

    def __init__(self, url: str):
        self.url = url
        self.ws_url = "ws" + url.removeprefix("http") + "/ws"
        self.schema: dict[str, Any] | None = None
        self.limit: int | None = None
        """Sessions the server takes (None until it refuses one)."""
        self.websocket = True
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Condition] = \
            weakref.WeakKeyDictionary()
        self._active: dict[asyncio.AbstractEventLoop, int] = {}

    async def action_schema(self) -> dict[str, Any]:
        if self.schema is None:
            import httpx

            try:
                async with httpx.AsyncClient(timeout=_CONNECT_TIMEOUT_S) as client:
                    answer = await client.get(f"{self.url}/schema")
                    answer.raise_for_status()
            except httpx.HTTPError as e:
                raise EnvError(f"OpenEnv server at {self.url}: GET /schema failed ({type(e).__name__}: {e}); is it "
                               "running (uvicorn MODULE:app --port PORT in its own venv)?") from None
            self.schema = answer.json()["action"]
        return self.schema

    def _gate(self) -> asyncio.Condition:
        loop = asyncio.get_running_loop()
        return self._gates.setdefault(loop, asyncio.Condition())

    async def acquire(self, wait_s: float) -> None:
        """A session slot: immediately while the server's limit is unknown or not reached, else wait."""
        loop, gate = asyncio.get_running_loop(), self._gate()
        async with gate:
            await asyncio.wait_for(gate.wait_for(lambda: self.limit is None or self._active.get(loop, 0) < self.limit),
                                   wait_s)
            self._active[loop] = self._active.get(loop, 0) + 1

    async def release(self) -> None:
        loop, gate = asyncio.get_running_loop(), self._gate()
        async with gate:
            self._active[loop] = max(self._active.get(loop, 0) - 1, 0)
            gate.notify_all()

    async def refused(self, max_sessions: int | None) -> None:
        """The server was at capacity: learn its limit (at least one session must be possible)."""
        loop = asyncio.get_running_loop()
        self.limit = max(1, max_sessions if max_sessions else self._active.get(loop, 1) - 1)


class RemoteBackend:
    """One trajectory's session on an OpenEnv server."""

    def __init__(self, info: ServerInfo, settings: dict[str, Any]):
        self.info, self.settings = info, settings
        self.action_schema: dict[str, Any] = {}
        self.is_mcp = False
        self._ws: Any = None
        self._held = False
        self._http_episode: dict[str, Any] | None = None

    async def reset(self, **kwargs: Any) -> dict[str, Any]:
        self.action_schema = await self.info.action_schema()
        props = self.action_schema.get("properties", {})
        self.is_mcp = "tool_name" in props and props.get("type", {}).get("const", props.get("type", {}).get(
            "default")) == "call_tool"
        if self.info.websocket:
            return await self._ws_reset(kwargs)
        return await self._http("reset", kwargs)

    async def _ws_reset(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        wait_s = float(self.settings.get("session_wait_s", 300))
        deadline = time.monotonic() + wait_s
        while True:
            await self.info.acquire(max(deadline - time.monotonic(), 0.001))
            self._held = True
            if not await self._connect():
                return await self._http("reset", kwargs)
            answer = await self._send({"type": "reset", "data": kwargs})
            if answer.get("type") != "error" or answer["data"].get("code") != "CAPACITY_REACHED":
                return self._observation(answer, "reset")
            await self.info.refused(answer["data"].get("max_sessions"))
            await self.close()
            if time.monotonic() >= deadline:
                raise EnvError(f"OpenEnv server at {self.info.url} stayed at capacity ({self.info.limit} sessions) "
                               f"for session_wait_s={wait_s:g}")

    async def _connect(self) -> bool:
        """Open this trajectory's WebSocket; False when the server has none (HTTP from then on)."""
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidStatus

        try:
            self._ws = await connect(self.info.ws_url, open_timeout=_CONNECT_TIMEOUT_S, max_size=None)
        except InvalidStatus as e:
            if e.response.status_code in (403, 404):
                self.info.websocket = False
                return False
            raise EnvError(f"OpenEnv server at {self.info.url}: WebSocket refused ({e})") from None
        except (OSError, TimeoutError) as e:
            raise EnvError(f"OpenEnv server at {self.info.url} is not reachable: {type(e).__name__}: {e}") from None
        return True

    async def _send(self, message: dict[str, Any]) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed

        with contextlib.suppress(ConnectionClosed):  # a refused session is answered, then closed: read the answer
            await self._ws.send(json.dumps(message, default=str))
        try:
            return json.loads(await self._ws.recv())
        except ConnectionClosed as e:
            raise EnvError(f"OpenEnv server at {self.info.url} closed the session during {message['type']} "
                           f"(the server died or dropped it: {e})") from None

    def _observation(self, answer: dict[str, Any], what: str) -> dict[str, Any]:
        if answer.get("type") == "observation":
            return answer["data"]
        data = answer.get("data") or {}
        if what == "step" and data.get("code") == "VALIDATION_ERROR" and data.get("errors"):
            return {"invalid_action": validation_problem(data["errors"])}
        raise EnvError(f"OpenEnv server at {self.info.url}: {what} failed: {data.get('code', '?')}: "
                       f"{data.get('message', answer)}")

    async def step(self, action: dict[str, Any]) -> dict[str, Any]:
        if self._ws is None:
            return await self._http("step", {"action": action})
        return self._observation(await self._send({"type": "step", "data": action}), "step")

    async def list_tools(self) -> list[dict]:
        result = await self.step({"type": "list_tools"})
        return [openai_tool(t) for t in result["observation"].get("tools", [])]

    def rubric_scores(self) -> dict[str, float]:
        return {}  # a server does not send its rubric; its scores are in each step's metadata when it puts them there

    async def _http(self, route: str, payload: dict[str, Any]) -> dict[str, Any]:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=_CONNECT_TIMEOUT_S) as client:
                answer = await client.post(f"{self.info.url}/{route}", json=payload)
        except httpx.HTTPError as e:
            raise EnvError(f"OpenEnv server at {self.info.url}: POST /{route} failed: {type(e).__name__}: {e}") from None
        if answer.status_code == 422 and route == "step":
            return {"invalid_action": validation_problem(answer.json().get("detail") or [{"msg": answer.text}])}
        if answer.status_code >= 400:
            raise EnvError(f"OpenEnv server at {self.info.url}: POST /{route} → {answer.status_code}: {answer.text[:200]}")
        return answer.json()

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        try:
            if ws is not None:
                with contextlib.suppress(Exception):  # a dead server: nothing to tell it
                    await asyncio.wait_for(ws.send(json.dumps({"type": "close"})), 5)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ws.close(), 5)
        finally:
            if self._held:
                self._held = False
                await self.info.release()


def validation_problem(errors: Any) -> str:
    """The first of pydantic's (or an OpenEnv server's) validation errors, naming the field."""
    first = errors[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "action"))
    got = f" (got {first['input']!r:.60})" if "input" in first and not isinstance(first["input"], dict) else ""
    return f"field {where!r}: {first.get('msg')}{got}" if where else f"{first.get('msg')}{got}"


def openai_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """An MCP tool (as OpenEnv lists it) as an OpenAI function-tool schema."""
    schema = tool.get("input_schema") or tool.get("inputSchema") or {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "",
                                             "parameters": schema}}
