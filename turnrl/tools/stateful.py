"""Stateful tools, tool configs, and the per-trajectory tool session.

A stateful tool is a class constructed with `(config, tool_schema)`. Every trajectory gets its own
instance, which lives from the trajectory's first call of that tool to the end of the trajectory:

    create(**create_kwargs)  once, lazily, before the first execute (create_kwargs come from the sample)
    execute(arguments)       once per call; returns anything `normalize_result` accepts
    calc_reward()            at the end, for the trajectory's reward (a number; anything else is kept, not scored)
    release()                always, exactly once, also after failures

(verl's agent loop creates and releases a `BaseTool` around every single call, so state such as "the
answer did not improve" is lost between calls; its legacy path had this lifecycle.)

A `ToolSet` is the registry of tools an agent offers (function tools and stateful tool specs, from files
or objects); `ToolSet.session(tools_kwargs)` gives one trajectory's `ToolSession`.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import yaml

from turnrl.loading import load_object
from turnrl.tools.function_tool import (
    FunctionTool,
    ToolError,
    ToolExecutionError,
    ToolLifecycleError,
    ToolResult,
    ToolTimeout,
    check_arguments,
    function_tool,
    load_function_tools,
    normalize_result,
    normalize_tool_schema,
)
from turnrl.types import ToolCall

_LIFECYCLE = ("create", "execute", "calc_reward", "release")


@runtime_checkable
class StatefulTool(Protocol):
    """One trajectory's instance of a stateful tool. Constructed as `cls(config, tool_schema)`."""

    name: str
    schema: dict[str, Any]
    """OpenAI function-tool schema: `{"type": "function", "function": {name, description, parameters}}`."""

    async def create(self, **create_kwargs: Any) -> None:
        """Called once, before the trajectory's first call of this tool, with the sample's create_kwargs."""
        ...

    async def execute(self, arguments: dict[str, Any]) -> Any:
        """Run one call with schema-checked arguments. Return what `normalize_result` accepts."""
        ...

    async def calc_reward(self) -> float:
        """The tool's reward for the whole trajectory (collected by `ToolSession.calc_rewards`)."""
        ...

    async def release(self) -> None:
        """Free the instance's resources. Called exactly once, also when create or execute failed."""
        ...


class StatefulToolBase:
    """Defaults for `StatefulTool`: keeps `config` and `schema`, remembers `create_kwargs`, rewards 0.0.

    Subclasses set a class attribute `schema` (or a classmethod `get_schema(cls, config)`) unless every
    config gives a `tool_schema:`, and implement `execute`.
    """

    schema: dict[str, Any] | None = None

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any] | None = None) -> None:
        self.config = config
        schema = tool_schema if tool_schema is not None else _class_schema(type(self), config)
        self.schema = normalize_tool_schema(schema, f"class {_qualname(type(self))}")
        self.create_kwargs: dict[str, Any] = {}

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]  # type: ignore[index]

    async def create(self, **create_kwargs: Any) -> None:
        self.create_kwargs = create_kwargs

    async def execute(self, arguments: dict[str, Any]) -> Any:
        raise NotImplementedError(f"{_qualname(type(self))} must implement `async def execute(self, arguments)`")

    async def calc_reward(self) -> float:
        return 0.0

    async def release(self) -> None:
        return None


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _class_schema(cls: type, config: dict[str, Any]) -> dict[str, Any]:
    schema = getattr(cls, "schema", None)
    if isinstance(schema, dict):
        return schema
    get_schema = getattr(cls, "get_schema", None)
    if callable(get_schema):
        return get_schema(config)
    raise TypeError(
        f"class {_qualname(cls)} has no tool schema: give `tool_schema:` in the tool config, a class "
        "attribute `schema = {...}`, or a classmethod `get_schema(cls, config)`"
    )


# ---- specs and configs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolSpec:
    """A stateful tool class with its config: what a `ToolSet` instantiates once per trajectory."""

    name: str
    cls: Callable[[dict[str, Any], dict[str, Any]], Any]
    """The tool class, called `cls(config, tool_schema)` per trajectory (or any factory of that signature)."""
    config: dict[str, Any]
    schema: dict[str, Any]
    source: str = field(compare=False)
    """Where the spec came from, for error messages (e.g. `tools.yaml (class pkg.Calc)`)."""
    group: str | None = field(default=None, compare=False)
    """Specs of one group share one instance per trajectory, called `execute_tool(name, arguments)` (the tools of
    one MCP server share its session: turnrl.tools.mcp); None: an instance of its own, called `execute(arguments)`."""

    @classmethod
    def from_class(
        cls,
        tool_cls: type,
        config: dict[str, Any] | None = None,
        tool_schema: dict[str, Any] | None = None,
        source: str | None = None,
    ) -> ToolSpec:
        adapted = getattr(tool_cls, "__turnrl_tool_spec__", None)
        if adapted is not None:  # another framework's tool class (turnrl.compat.verl.BaseTool) brings its adapter
            return adapted(config or {}, tool_schema, source or f"class {_qualname(tool_cls)}")
        _check_tool_class(tool_cls)
        config = config or {}
        schema = tool_schema if tool_schema is not None else _class_schema(tool_cls, config)
        schema = normalize_tool_schema(schema, f"class {_qualname(tool_cls)}")
        return cls(
            name=schema["function"]["name"],
            cls=tool_cls,
            config=config,
            schema=schema,
            source=source or f"class {_qualname(tool_cls)}",
        )

    def instantiate(self) -> StatefulTool:
        """A fresh instance (config and schema deep-copied, so trajectories share nothing)."""
        try:
            instance = self.cls(copy.deepcopy(self.config), copy.deepcopy(self.schema))
        except Exception as e:
            raise ToolLifecycleError(f"constructing tool {self.name!r} ({self.source}) failed: {e!r}") from e
        if getattr(instance, "name", self.name) != self.name:
            raise ToolLifecycleError(
                f"tool {self.name!r} ({self.source}): instance reports name {instance.name!r}"
            )
        return instance


def _check_tool_class(tool_cls: Any) -> None:
    if not isinstance(tool_cls, type):
        raise TypeError(f"a stateful tool must be a class, got {tool_cls!r}")
    bad = [m for m in _LIFECYCLE if not inspect.iscoroutinefunction(getattr(tool_cls, m, None))]
    if bad:
        raise TypeError(
            f"class {_qualname(tool_cls)} must define async methods {', '.join(_LIFECYCLE)} (subclass "
            f"turnrl.tools.StatefulToolBase for defaults); missing or not async: {', '.join(bad)}"
        )


_CONFIG_KEYS = {"class_name", "config", "tool_schema"}


def load_tool_config(path: str | Path) -> list[ToolSpec]:
    """Read a verl-format tool config:

        tools:
          - class_name: my_pkg.tools.Calculator      # or path/to/file.py:Calculator (relative to this file)
            config: {max_calls: 5}                   # passed to the constructor
            tool_schema: {type: function, function: {name: calc, ...}}   # optional
          - mcp: python my_server.py                 # an MCP server's tools (stdio command, or an http(s) URL)
    """
    config_path = Path(path)
    if not config_path.is_file():
        raise FileNotFoundError(f"tool config {path} not found")
    data = yaml.safe_load(config_path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list) or set(data) != {"tools"}:
        raise ValueError(f"{path}: expected a mapping with exactly one key, `tools:`, holding a list of tools")
    return [spec for i, entry in enumerate(data["tools"]) for spec in _specs_from_entry(entry, f"{path}: tools[{i}]",
                                                                                         config_path)]


def _specs_from_entry(entry: Any, where: str, config_path: Path) -> list[ToolSpec]:
    """A `class_name:` entry's spec, or the tools of an `mcp:` entry's server (turnrl.tools.mcp)."""
    if isinstance(entry, dict) and set(entry) == {"mcp"}:
        target = entry["mcp"]
        if not isinstance(target, str):
            raise ValueError(f"{where}: `mcp:` must be a command line or an http(s) URL, got {target!r:.60}")
        return mcp_tool_specs(target if target.startswith("http") else f"mcp:{target}", where)
    return [_spec_from_entry(entry, where, config_path)]


def mcp_tool_specs(source: str, where: str | None = None) -> list[ToolSpec]:
    """The tools of the MCP server `source` names (`mcp:COMMAND ...`, `mcp+http://...`: turnrl.tools.mcp)."""
    from turnrl.tools.mcp import mcp_server

    return [ToolSpec(**fields) for fields in mcp_server(source, where).tools()]


def _spec_from_entry(entry: Any, where: str, config_path: Path) -> ToolSpec:
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise ValueError(f"{where}: expected a mapping with a string `class_name:` (or `mcp:` naming an MCP server)")
    unknown = sorted(set(entry) - _CONFIG_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(_CONFIG_KEYS)}")
    config, tool_schema = entry.get("config") or {}, entry.get("tool_schema")
    if not isinstance(config, dict):
        raise ValueError(f"{where}: `config:` must be a mapping, got {type(config).__name__}")
    if tool_schema is not None and not isinstance(tool_schema, dict):
        raise ValueError(f"{where}: `tool_schema:` must be a mapping, got {type(tool_schema).__name__}")
    class_name = entry["class_name"]
    tool_cls = _import_class(class_name, config_path.parent, where)
    try:
        return ToolSpec.from_class(tool_cls, config, tool_schema, f"{config_path} (class {class_name})")
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


def _import_class(ref: str, base_dir: Path, where: str) -> Any:
    """`pkg.mod.Class`, or `path/to/file.py:Class` (relative paths: the config's folder, then the cwd)."""
    if ".py:" in ref:
        file_ref, attr = ref.rsplit(":", 1)
        candidates = [base_dir / file_ref, Path(file_ref)] if not Path(file_ref).is_absolute() else [Path(file_ref)]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise FileNotFoundError(f"{where}: tool file {file_ref} not found (tried {', '.join(map(str, candidates))})")
        spec = f"{found}:{attr}"
    else:
        module_name, _, attr = ref.rpartition(".")
        if not module_name:
            raise ValueError(f"{where}: class_name {ref!r} must be `package.module.Class` or `file.py:Class`")
        spec = f"{module_name}:{attr}"
    try:
        return load_object(spec, what="tool")
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{where}: {e}") from e


# ---- the tool set ----------------------------------------------------------------------------------

Tool = FunctionTool | ToolSpec


class ToolSet:
    """The tools available to an agent, by name. Names are unique across every source."""

    def __init__(self, tools: Iterable[FunctionTool | ToolSpec | type | Callable[..., Any]] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        self._sources: dict[str, str] = {}
        for tool in tools:
            self.add(tool)

    @classmethod
    def from_sources(
        cls,
        function_tool_files: Iterable[str | Path] = (),
        tool_config_files: Iterable[str | Path] = (),
        tools: Iterable[FunctionTool | ToolSpec | type | Callable[..., Any]] = (),
        mcp_servers: Iterable[str] = (),
    ) -> ToolSet:
        """Function tools from .py files, stateful tools from YAML configs, the tools of MCP servers (`mcp:COMMAND
        ...`, `mcp+http://...`: turnrl.tools.mcp), and tool objects, merged."""
        toolset = cls()
        for source in mcp_servers:
            for spec in mcp_tool_specs(source):
                toolset.add(spec)
        for path in function_tool_files:
            for tool in load_function_tools(path):
                toolset.add(tool, f"{path} (function tool)")
        for path in tool_config_files:
            for spec in load_tool_config(path):
                toolset.add(spec)
        for extra in tools:
            toolset.add(extra)
        return toolset

    def add(self, tool: FunctionTool | ToolSpec | type | Callable[..., Any], source: str | None = None) -> None:
        """Register a FunctionTool, a ToolSpec, a stateful tool class, or a plain function."""
        entry: Tool
        if isinstance(tool, FunctionTool | ToolSpec):
            entry = tool
        elif isinstance(tool, type):
            entry = ToolSpec.from_class(tool)
        else:
            entry = function_tool(tool)
        if source is None:
            source = entry.source if isinstance(entry, ToolSpec) else f"function {_fn_qualname(entry.fn)} (function tool)"
        if entry.name in self._tools:
            raise ValueError(f"tool {entry.name!r} defined twice: in {self._sources[entry.name]} and {source}")
        self._tools[entry.name] = entry
        self._sources[entry.name] = source

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' OpenAI schemas (copies), in registration order: what the chat template renders."""
        return [copy.deepcopy(t.schema) for t in self._tools.values()]

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def get(self, name: str) -> Tool:
        """The tool called `name`; an unknown name raises `ToolError` listing the available tools."""
        if name not in self._tools:
            raise ToolError(f"unknown tool {name!r}; available tools: {', '.join(self._tools) or '(none)'}")
        return self._tools[name]

    def source(self, name: str) -> str:
        return self._sources[name]

    def subset(self, names: Iterable[str]) -> ToolSet:
        """A tool set with only `names` (e.g. a per-sample tool selection)."""
        sub = ToolSet()
        for name in names:
            sub.add(self.get(name), self._sources[name])
        return sub

    def session(self, tools_kwargs: dict[str, Any] | None = None) -> ToolSession:
        """One trajectory's session. `tools_kwargs` is verl's per-sample `{tool: {"create_kwargs": {...}}}`."""
        return ToolSession(self, tools_kwargs)


def _fn_qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def split_tool_rewards(values: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """`calc_reward()` values → (the rewards: numbers and bools as floats, the other values as returned).

    A value that is not a number is no error: verl's own SearchTool and SandboxFusionTool return the list of their
    results from `calc_reward`, and verl never scores it (its reward managers hand the values to the reward
    function as `extra_info["rollout_reward_scores"]`, as they are)."""
    rewards, others = {}, {}
    for name, value in values.items():
        if isinstance(value, int | float):  # bool is an int
            rewards[name] = float(value)
        else:
            others[name] = value
    return rewards, others


# ---- the per-trajectory session --------------------------------------------------------------------


class ToolSession:
    """The tools of one trajectory: stateful instances are created lazily (once) and released at close.

    Calls of one stateful tool are serialised (its instance sees them in order); function tools run
    concurrently. Use `async with toolset.session(kw) as session:` or call `close()` yourself.
    """

    def __init__(self, toolset: ToolSet, tools_kwargs: dict[str, Any] | None = None) -> None:
        self._toolset = toolset
        self._create_kwargs = _create_kwargs_by_tool(tools_kwargs or {}, toolset)
        self._instances: dict[str, StatefulTool] = {}
        self._to_release: list[tuple[str, StatefulTool]] = []
        self._create_errors: dict[str, ToolLifecycleError] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    async def __aenter__(self) -> ToolSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, call: ToolCall, timeout_s: float | None = None) -> ToolResult:
        """Run one tool call.

        Raises `ToolError` subclasses for what the model should be told (unknown tool, bad arguments,
        `ToolTimeout` after `timeout_s`, which covers a lazy create too, and `ToolExecutionError` when the
        tool raised), and `ToolLifecycleError` / `TypeError` for bugs on the tool's side.
        """
        if self._closed:
            raise RuntimeError("ToolSession.call() after close()")
        tool = self._toolset.get(call.name)
        check_arguments(tool.schema, call.arguments)
        try:
            value = await asyncio.wait_for(self._invoke(tool, call.arguments), timeout_s)
        except TimeoutError:
            raise ToolTimeout(f"tool {call.name!r} timed out after {timeout_s:g} s") from None
        return normalize_result(value)

    async def _invoke(self, tool: Tool, arguments: dict[str, Any]) -> Any:
        if isinstance(tool, FunctionTool):
            return await _run_wrapped(tool.name, tool.invoke(arguments))
        async with self._locks.setdefault(tool.name, asyncio.Lock()):
            instance: Any = await self._instance(tool)
            if tool.group is not None:
                return await _run_wrapped(tool.name, instance.execute_tool(tool.name, arguments))
            return await _run_wrapped(tool.name, instance.execute(arguments))

    async def _instance(self, spec: ToolSpec) -> StatefulTool:
        key = spec.group or spec.name
        async with self._locks.setdefault(f"create:{key}", asyncio.Lock()):  # a group's tools create it once
            if key in self._instances:
                return self._instances[key]
            if key in self._create_errors:
                raise self._create_errors[key]
            instance = spec.instantiate()
            self._to_release.append((key, instance))  # before create: release runs even if create fails
            try:
                await instance.create(**self._create_kwargs.get(spec.name, {}))
            except BaseException as e:  # also cancellation (a timeout): this trajectory never retries create
                error = ToolLifecycleError(f"create() of tool {spec.name!r} ({spec.source}) failed: {e!r}")
                self._create_errors[key] = error
                if isinstance(e, Exception):
                    raise error from e
                raise
            self._instances[key] = instance
            return instance

    async def calc_rewards(self) -> dict[str, Any]:
        """`calc_reward()` of every stateful tool this trajectory created (tools never called have none), each
        value as the tool returned it: `split_tool_rewards` tells the rewards from the rest."""
        values = {}
        for name, instance in self._instances.items():
            if getattr(instance, "calc_reward", None) is None:  # a group without rewards (an MCP server's session)
                continue
            try:
                values[name] = await instance.calc_reward()
            except Exception as e:
                raise ToolLifecycleError(f"calc_reward() of tool {name!r} failed: {e!r}") from e
        return values

    async def close(self) -> None:
        """Release every instance exactly once, in creation order, even when some releases raise; then
        raise one `ToolLifecycleError` listing every failure (`.errors`). Closing twice is a no-op."""
        if self._closed:
            return
        self._closed = True
        failures: list[tuple[str, BaseException]] = []
        to_release, self._to_release = self._to_release, []
        for name, instance in to_release:
            try:
                await instance.release()
            except BaseException as e:  # keep releasing the others, even when cancelled
                failures.append((name, e))
        cancelled = next((e for _, e in failures if isinstance(e, asyncio.CancelledError)), None)
        if cancelled is not None:
            raise cancelled
        if failures:
            detail = "; ".join(f"tool {name!r}: {e!r}" for name, e in failures)
            raise ToolLifecycleError(f"release() failed for {len(failures)} tool(s): {detail}", failures)


async def _run_wrapped(name: str, awaitable: Any) -> Any:
    """Await a tool's own code; its exceptions become `ToolExecutionError` (ToolErrors pass unchanged)."""
    try:
        return await awaitable
    except (ToolError, ToolLifecycleError):
        raise
    except Exception as e:
        raise ToolExecutionError(f"tool {name!r} raised {type(e).__name__}: {e}") from e


def _create_kwargs_by_tool(tools_kwargs: dict[str, Any], toolset: ToolSet) -> dict[str, dict[str, Any]]:
    """Validate verl's `{tool: {"create_kwargs": {...}}}`. Entries that are None (parquet struct padding)
    are skipped, and so are empty `execute_kwargs` / `calc_reward_kwargs` / `release_kwargs` (verl's
    placeholders); unknown tools, create_kwargs for function tools and any other non-empty key are errors."""
    if not isinstance(tools_kwargs, dict):
        raise TypeError(f"tools_kwargs must be a dict {{tool: {{'create_kwargs': {{...}}}}}}, got {tools_kwargs!r}")
    out = {}
    for name, entry in tools_kwargs.items():
        if entry is None:
            continue
        if name not in toolset:
            raise ValueError(f"tools_kwargs names tool {name!r}, which is not in the tool set ({', '.join(toolset.names)})")
        if not isinstance(entry, dict) or any(v for k, v in entry.items() if k != "create_kwargs"):
            raise ValueError(
                f"tools_kwargs[{name!r}] must be {{'create_kwargs': {{...}}}}, got {entry!r} "
                "(turnrl tools keep per-trajectory state on the instance; execute/release kwargs do not exist)"
            )
        create_kwargs = entry.get("create_kwargs") or {}
        if create_kwargs and isinstance(toolset.get(name), FunctionTool):
            raise ValueError(f"tools_kwargs[{name!r}]: {name!r} is a function tool, which takes no create_kwargs")
        out[name] = dict(create_kwargs)
    return out
