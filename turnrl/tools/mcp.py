"""MCP tool servers as tools of the tool agent (`pip install 'turnrl[mcp]'`; docs/ecosystems.md):

    --tools 'mcp:COMMAND [ARGS...]'     a stdio server, started once per run (per event loop); its one MCP session
                                        serves every trajectory (calls are concurrent JSON-RPC requests)
    --tools mcp+http://HOST:PORT/mcp    a streamable-HTTP server: one MCP session per trajectory (a server that
                                        keeps state per session keeps it per trajectory)

and in a tool-config YAML, beside verl-style classes: `tools: [{mcp: "python server.py"}, {mcp: "http://..."}]`.

At start-up the server's tools are listed (`tools/list`); each becomes a tool of the run's `ToolSet` with the
server's JSON schema, beside Python and verl tools (a name defined twice is an error naming both sources). A call
is `tools/call`; its result comes back as the tool message: text content joined, structured content as JSON when
there is no text, images (base64 content) as image parts; a result with `isError` and a protocol error both come
back as `Error: ...` text. A server that fails to start, or answers nothing within `start_timeout_s`, fails the
start-up with its stderr; one that hangs on a call times out that call (the tool agent's tool_timeout_s); one that
dies fails the calls after it with a message naming it, never the batch. Works with the `mcp` SDK 1.x (openenv's
pin) and 2.x.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import shlex
import tempfile
import threading
import weakref
from typing import Any

from turnrl.tools.function_tool import ToolExecutionError, ToolResult, normalize_tool_schema

START_TIMEOUT_S = 60.0


def is_mcp_source(source: str) -> bool:
    """Whether a `--tools` value names an MCP server (`mcp:COMMAND ...`, `mcp+http(s)://...`)."""
    return source.startswith(("mcp:", "mcp+http://", "mcp+https://"))


def mcp_server(source: str, where: str | None = None) -> MCPServer:
    """The server a `--tools` value (or a tool config's `mcp:` entry) names."""
    target = source.removeprefix("mcp+") if source.startswith("mcp+") else source.removeprefix("mcp:")
    if target.startswith(("http://", "https://")):
        return MCPServer(url=target, where=where or source)
    argv = shlex.split(target)
    if not argv:
        raise ValueError(f"{where or source}: expected mcp:COMMAND [ARGS...] or mcp+http://HOST:PORT/PATH")
    return MCPServer(argv=argv, where=where or source)


def tool_result(result: Any) -> ToolResult:
    """An MCP `CallToolResult` (SDK 1.x or 2.x objects, fastmcp's, or its JSON) as a `ToolResult`."""
    data = _wire(result)
    if not isinstance(data, dict):
        return ToolResult(text="" if data is None else str(data))
    texts, images = [], []
    for block in data.get("content") or []:
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "image" and block.get("data"):
            images.append(_image(block["data"]))
        else:  # audio, resource links and embedded resources: what they are, as text
            texts.append(json.dumps({k: v for k, v in block.items() if k not in ("data", "blob")}, default=str))
    structured = data.get("structuredContent", data.get("structured_content"))
    text = "\n".join(texts) if texts else (json.dumps(structured, default=str) if structured is not None else "")
    if data.get("isError", data.get("is_error")):
        text = f"Error: {text}"
    return ToolResult(text=text, images=images)


def _wire(value: Any) -> Any:
    """A result as its JSON (camelCase) fields: pydantic models dumped by alias, fastmcp's dataclass read."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", by_alias=True, exclude_none=True)
    if hasattr(value, "content") and not isinstance(value, dict):  # fastmcp's CallToolResult dataclass
        return {"content": [_wire(c) for c in value.content], "isError": getattr(value, "is_error", False),
                "structuredContent": getattr(value, "structured_content", None)}
    return value


def _image(data: str) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")


# ---- the client ------------------------------------------------------------------------------------
class _Connection:
    """One MCP client session, owned by a task of its own: anyio's transports must be entered and left in one
    task, while tool calls come from every trajectory's tasks."""

    def __init__(self, server: MCPServer):
        self.server = server
        self.session: Any = None
        self.error: BaseException | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def open(self) -> _Connection:
        self._task = asyncio.ensure_future(self._own())
        try:
            await asyncio.wait_for(self._ready.wait(), self.server.start_timeout_s)
        except TimeoutError:
            await self.close()
            raise ToolExecutionError(f"MCP server {self.server.where} did not answer initialize within "
                                     f"{self.server.start_timeout_s:g} s{self.server.stderr_tail()}") from None
        if self.session is None:
            raise ToolExecutionError(f"MCP server {self.server.where} failed to start: {_cause(self.error)}"
                                     f"{self.server.stderr_tail()}")
        return self

    async def _own(self) -> None:
        from mcp import ClientSession

        try:
            async with contextlib.AsyncExitStack() as stack:
                streams = await stack.enter_async_context(self.server.transport())
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                self.session = session
                self._ready.set()
                await self._stop.wait()
        except BaseException as e:  # the server died or never started: the calls after it say so
            self.error, self.session = e, None
            self._ready.set()
            if isinstance(e, asyncio.CancelledError):
                raise

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        if self.session is None or self.error is not None:
            raise ToolExecutionError(f"MCP server {self.server.where} is gone: {_cause(self.error)}"
                                     f"{self.server.stderr_tail()}")
        try:
            return tool_result(await self.session.call_tool(name, arguments))
        except Exception as e:  # a protocol error (unknown tool, bad arguments) or a dead transport
            dead = self.error is not None or "closed" in f"{type(e).__name__} {e}".lower()  # 1.x: ClosedResourceError
            raise ToolExecutionError(f"MCP tool {name!r} ({self.server.where}): {_cause(e)}"
                                     f"{self.server.stderr_tail() if dead else ''}") from e

    async def list_tools(self) -> list[dict[str, Any]]:
        result = _wire(await self.session.list_tools())
        return result.get("tools", [])

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._task, 10)


def _cause(error: BaseException | None) -> str:
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}" if error is not None else "no session"


class MCPServer:
    """An MCP server named by `--tools` (module docstring): its tools as `ToolSpec`s sharing one connection."""

    def __init__(self, *, argv: list[str] | None = None, url: str | None = None, where: str,
                 start_timeout_s: float = START_TIMEOUT_S):
        self.argv, self.url, self.where, self.start_timeout_s = argv, url, where, start_timeout_s
        # the server's stderr, kept for the error that names a server that failed (a file: the pipe never fills)
        self._stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") if argv else None  # noqa: SIM115
        self._shared: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Future] = weakref.WeakKeyDictionary()

    def transport(self) -> Any:
        if self.url is not None:
            from mcp.client import streamable_http

            names = vars(streamable_http)  # SDK 2.x's name, else 1.x's older one
            client: Any = names.get("streamable_http_client") or names["streamablehttp_client"]
            return client(self.url)
        from mcp.client.stdio import StdioServerParameters, stdio_client

        assert self.argv is not None
        errlog: Any = self._stderr
        return stdio_client(StdioServerParameters(command=self.argv[0], args=self.argv[1:]), errlog=errlog)

    def stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        tail = self._stderr.read()[-800:].strip()
        return f"; its stderr ends: {tail}" if tail else ""

    async def connection(self) -> _Connection:
        """stdio: the run's one connection (per event loop); HTTP: a new one (a session per trajectory)."""
        if self.url is not None:
            return await _Connection(self).open()
        loop = asyncio.get_running_loop()
        if loop not in self._shared:
            self._shared[loop] = asyncio.ensure_future(_Connection(self).open())
        return await asyncio.shield(self._shared[loop])

    def tools(self) -> list[dict[str, Any]]:
        """The server's tools as `ToolSpec` fields (turnrl.tools.stateful builds the specs), listed once at start-up
        (in a thread: the caller may be inside an event loop). Every tool of the server shares one instance per
        trajectory (`group`)."""
        listed: list[Any] = []

        def run() -> None:
            async def list_once() -> list[dict[str, Any]]:
                connection = await _Connection(self).open()
                try:
                    return await connection.list_tools()
                finally:
                    await connection.close()

            try:
                listed.append(asyncio.run(list_once()))
            except BaseException as e:
                listed.append(e)

        thread = threading.Thread(target=run, daemon=True, name="turnrl-mcp-list")
        thread.start()
        thread.join(self.start_timeout_s + 15)
        if not listed:
            raise RuntimeError(f"MCP server {self.where}: listing its tools hung{self.stderr_tail()}")
        if isinstance(listed[0], BaseException):
            raise RuntimeError(f"MCP server {self.where}: {_cause(listed[0])}") from None
        return [self._fields(tool) for tool in listed[0]]

    def _fields(self, tool: dict[str, Any]) -> dict[str, Any]:
        schema = normalize_tool_schema({"name": tool["name"], "description": tool.get("description") or "",
                                        "parameters": tool.get("inputSchema") or tool.get("input_schema")},
                                       f"MCP server {self.where}, tool {tool['name']!r}")
        return {"name": tool["name"], "cls": lambda config, schema: MCPToolSession(self), "config": {},
                "schema": schema, "source": f"MCP server {self.where}", "group": f"mcp:{self.where}"}


class MCPToolSession:
    """One trajectory's use of an MCP server (every tool of the server shares it: `ToolSpec.group`). The
    connection opens on the first call, shielded: a call that times out while the server starts leaves the start
    going on for the next call (a create() that failed would fail every later call of the trajectory)."""

    def __init__(self, server: MCPServer):
        self.server = server
        self._opening: asyncio.Future | None = None

    async def create(self, **create_kwargs: Any) -> None:
        if create_kwargs:
            raise ValueError(f"MCP server {self.server.where} takes no create_kwargs, got {sorted(create_kwargs)}")

    async def execute_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        if self._opening is None:
            self._opening = asyncio.ensure_future(self.server.connection())
        connection = await asyncio.shield(self._opening)
        return await connection.call(name, arguments)

    async def release(self) -> None:
        opening, self._opening = self._opening, None
        if opening is None or self.server.url is None:  # stdio's connection is the run's
            return
        with contextlib.suppress(BaseException):
            connection = await asyncio.wait_for(opening, self.server.start_timeout_s)
            await connection.close()
