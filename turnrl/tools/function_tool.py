"""Function tools: a plain Python function becomes a tool the model can call.

    @function_tool
    def add(a: int, b: int = 0) -> int:
        '''Add two integers.

        Args:
            a: The first number.
            b: The second number.
        '''
        return a + b

The schema shown to the model (OpenAI function-tool format) is inferred from the type hints and the
Google-style docstring (`infer_schema`); `@function_tool(schema={...})` skips inference. Arguments are
checked against the schema before the function runs (`check_arguments`), sync functions run in a worker
thread so they never block the event loop, and whatever the function returns is normalised into a
`ToolResult` (`normalize_result`).

This module also holds the vocabulary shared by every tool kind: `ToolResult`, `ToolResponse` and the
errors. `ToolError` and its subclasses are meant to be shown to the model; `ToolLifecycleError` and
`TypeError` from `normalize_result` are bugs of the tool's author and end the trajectory.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, overload

from turnrl.loading import load_module

# ---- results ---------------------------------------------------------------------------------------


@dataclass
class ToolResponse:
    """What a tool may return to send text and images back to the model."""

    text: str = ""
    images: list[Any] = field(default_factory=list)
    """PIL images or image file paths, shown to the model after the text."""


@dataclass
class ToolResult:
    """A tool call's outcome as the tool env sees it: the observation plus the tool's reward and metrics."""

    text: str
    images: list[Any] = field(default_factory=list)
    """PIL images or image file paths."""
    reward: float = 0.0
    """Step reward reported by the tool (0.0 when it reported none)."""
    metrics: dict[str, Any] = field(default_factory=dict)


def normalize_result(value: Any) -> ToolResult:
    """Turn whatever a tool returned into a `ToolResult`.

    | returned                                   | becomes                                        |
    |--------------------------------------------|------------------------------------------------|
    | `ToolResult`                               | itself                                         |
    | `ToolResponse(text, images)`               | `ToolResult(text, images)`                     |
    | `str`                                      | the text                                       |
    | `dict` / `list`                            | JSON text (`ensure_ascii=False`, `str()` for values JSON cannot encode) |
    | `None`                                     | empty text, reward 0.0 (a tool that only acts) |
    | `(response,)`, `(response, reward)`, `(response, reward, metrics)` | response normalised by this table, reward (None -> 0.0), metrics (None -> {}) |
    | anything else (int, float, bool, ...)      | `str(value)`                                   |

    A tuple of length 0 or more than 3, a tuple nested as the response, a non-numeric reward or
    non-dict metrics raise `TypeError`: that is a bug in the tool, not something to show the model.
    """
    if isinstance(value, tuple):
        return _normalize_tuple(value)
    if isinstance(value, ToolResult):
        return value
    if isinstance(value, ToolResponse):
        return ToolResult(text=value.text, images=list(value.images))
    if value is None:
        return ToolResult(text="")
    if isinstance(value, str):
        return ToolResult(text=value)
    if isinstance(value, dict | list):
        return ToolResult(text=json.dumps(value, ensure_ascii=False, default=str))
    return ToolResult(text=str(value))


def _normalize_tuple(value: tuple[Any, ...]) -> ToolResult:
    if not 1 <= len(value) <= 3:
        raise TypeError(
            f"a tool returned a tuple of length {len(value)}; expected (response,), (response, reward) "
            "or (response, reward, metrics)"
        )
    response, reward, metrics = (*value, None, None)[:3]
    if isinstance(response, tuple):
        raise TypeError("a tool returned a tuple whose response is itself a tuple; return (response, reward)")
    if reward is None:
        reward = 0.0
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TypeError(f"a tool returned reward {reward!r} ({type(reward).__name__}); expected a number")
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, dict):
        raise TypeError(f"a tool returned metrics of type {type(metrics).__name__}; expected a dict")
    result = normalize_result(response)
    return ToolResult(text=result.text, images=result.images, reward=float(reward), metrics=dict(metrics))


# ---- errors ----------------------------------------------------------------------------------------


class ToolError(Exception):
    """A failed tool call whose message is meant for the model (the tool env renders it as the observation)."""


class ToolArgumentError(ToolError):
    """The call's arguments do not match the tool's schema (unknown, missing or mistyped)."""


class ToolTimeout(ToolError):
    """The call exceeded its per-call time limit."""


class ToolExecutionError(ToolError):
    """The tool raised; the original exception is the `__cause__`."""


class ToolLifecycleError(RuntimeError):
    """A stateful tool's construction, create(), calc_reward() or release() failed: a bug on the tool's
    side, never shown to the model (the trajectory ends with env_error)."""

    def __init__(self, message: str, errors: list[tuple[str, BaseException]] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or []
        """(tool name, exception) for each failure when several were collected (release at close)."""


# ---- schema inference ------------------------------------------------------------------------------

_TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SCALAR_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_SUPPORTED_HINTS = "str, int, float, bool, Any, list[T], dict[str, V], Literal[...], X | None, unions of these"


def type_schema(hint: Any, where: str = "type hint") -> dict[str, Any]:
    """The JSON schema of one type hint.

    | hint                        | schema                                                   |
    |-----------------------------|----------------------------------------------------------|
    | `str` / `int` / `float` / `bool` | `{"type": "string" / "integer" / "number" / "boolean"}` |
    | `Any`                       | `{}` (any JSON value)                                    |
    | `list[T]` (bare `list`)     | `{"type": "array", "items": T}` (no `items`)             |
    | `dict[str, V]` (bare `dict`)| `{"type": "object", "additionalProperties": V}` (none)   |
    | `Literal["a", "b"]`         | `{"type": "string", "enum": ["a", "b"]}`                 |
    | `X | None`, `Optional[X]`   | X's schema plus `"nullable": true` (the OpenAPI form chat templates and transformers use) |
    | `int | float`               | `{"type": ["integer", "number"]}` (a list when every member is a plain type) |
    | `list[int] | str`           | `{"anyOf": [...]}` (members that are not plain types)    |
    """
    if hint in _SCALAR_TYPES:
        return {"type": _SCALAR_TYPES[hint]}
    if hint is Any:
        return {}
    if hint is None or hint is type(None):
        return {"type": "null"}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return _literal_schema(args, where)
    if origin in (Union, types.UnionType):
        return _union_schema(args, where)
    if hint is list or origin is list:
        return {"type": "array", "items": type_schema(args[0], where)} if args else {"type": "array"}
    if hint is dict or origin is dict:
        if not args:
            return {"type": "object"}
        if args[0] is not str:
            raise TypeError(f"{where}: dict keys must be str (JSON object keys), got {hint!r}")
        return {"type": "object", "additionalProperties": type_schema(args[1], where)}
    raise TypeError(f"{where}: unsupported type hint {hint!r}; supported: {_SUPPORTED_HINTS}")


def _literal_schema(values: tuple[Any, ...], where: str) -> dict[str, Any]:
    json_types = []
    for v in values:
        if v is None:
            continue
        t = _SCALAR_TYPES.get(type(v))
        if t is None:
            raise TypeError(f"{where}: Literal values must be str, int, float, bool or None, got {v!r}")
        if t not in json_types:
            json_types.append(t)
    schema: dict[str, Any] = {"type": json_types[0] if len(json_types) == 1 else json_types}
    schema["enum"] = [v for v in values if v is not None]
    if None in values:
        schema["nullable"] = True
    return schema


def _union_schema(members: tuple[Any, ...], where: str) -> dict[str, Any]:
    nullable = type(None) in members
    subs = [type_schema(m, where) for m in members if m is not type(None)]
    if len(subs) == 1:
        schema = subs[0]
    elif all(set(s) == {"type"} and isinstance(s["type"], str) for s in subs):
        schema = {"type": list(dict.fromkeys(s["type"] for s in subs))}
    else:
        schema = {"anyOf": subs}
    return {**schema, "nullable": True} if nullable else schema


_SECTION_RE = re.compile(
    r"^(Args|Arguments|Parameters|Params|Returns?|Yields?|Raises|Examples?|Notes?|Warnings?|"
    r"Attributes|References|See Also|Todo)\s*:\s*$"
)
_ARG_SECTIONS = {"Args", "Arguments", "Parameters", "Params"}
_ARG_LINE_RE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:(.*)$")


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {parameter: description}).

    The description is all text before the first section header (`Args:`, `Returns:`, ...): the summary
    plus any extended paragraphs. `Args:` entries are `name: text` or `name (type): text`; lines indented
    deeper than the entry continue it.
    """
    description: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    entry_indent: int | None = None
    for line in inspect.cleandoc(doc).splitlines():
        header = _SECTION_RE.match(line)
        if header:
            section, current, entry_indent = header.group(1), None, None
        elif section is None:
            description.append(line)
        elif section in _ARG_SECTIONS and line.strip():
            indent = len(line) - len(line.lstrip())
            entry = _ARG_LINE_RE.match(line.strip())
            if entry and (entry_indent is None or indent <= entry_indent):
                entry_indent, current = indent, entry.group(1)
                params[current] = entry.group(2).strip()
            elif current is not None:
                params[current] = f"{params[current]} {line.strip()}".strip()
            else:
                raise ValueError(f"docstring {section}: section: cannot parse line {line.strip()!r}")
    return "\n".join(description).strip(), params


def infer_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The OpenAI function-tool schema of `fn`, from its signature, type hints and docstring.

    Every parameter needs a type hint (see `type_schema` for the mapping); parameters without a default
    are `required`. `*args`, `**kwargs` and positional-only parameters are rejected: the model passes
    named JSON arguments. A parameter with no `Args:` entry gets no `"description"` key; the function's
    `"description"` is always present (empty without a docstring). An `Args:` entry naming no parameter
    is an error (a stale docstring misleads the model).
    """
    tool_name = name or getattr(fn, "__name__", None)
    if not tool_name:
        raise TypeError(f"cannot infer a tool name for {fn!r}; pass function_tool(fn, name=...)")
    where = f"function tool {tool_name!r}"
    description, arg_docs = parse_docstring(inspect.getdoc(fn) or "")
    hints = _resolved_hints(fn, where)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        _check_parameter_kind(p, where)
        if p.name not in hints:
            raise TypeError(f"{where}: parameter {p.name!r} has no type hint; annotate it (e.g. `{p.name}: str`)")
        schema = type_schema(hints[p.name], f"{where}, parameter {p.name!r}")
        if arg_docs.get(p.name):
            schema["description"] = arg_docs[p.name]
        properties[p.name] = schema
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    stale = sorted(set(arg_docs) - set(properties))
    if stale:
        raise ValueError(f"{where}: docstring Args: documents {stale}, which are not parameters")
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return _function_schema(tool_name, description, parameters, where)


def _resolved_hints(fn: Callable[..., Any], where: str) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception as e:  # a forward reference that does not resolve
        raise TypeError(f"{where}: cannot resolve the type hints: {e}") from e


def _check_parameter_kind(p: inspect.Parameter, where: str) -> None:
    if p.kind is inspect.Parameter.VAR_POSITIONAL:
        raise TypeError(f"{where}: parameter *{p.name} is not allowed; a tool takes named arguments only")
    if p.kind is inspect.Parameter.VAR_KEYWORD:
        raise TypeError(f"{where}: parameter **{p.name} is not allowed; declare each argument explicitly")
    if p.kind is inspect.Parameter.POSITIONAL_ONLY:
        raise TypeError(f"{where}: parameter {p.name!r} is positional-only; the model passes arguments by name")


def _function_schema(name: str, description: str, parameters: dict[str, Any], where: str) -> dict[str, Any]:
    if not _TOOL_NAME_RE.match(name):
        raise ValueError(f"{where}: tool name {name!r} must be 1-64 characters of [A-Za-z0-9_-]")
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def normalize_tool_schema(schema: dict[str, Any], where: str, name: str | None = None) -> dict[str, Any]:
    """Validate a user-given schema and return a copy in the canonical OpenAI form.

    Accepts `{"type": "function", "function": {"name", "description", "parameters"}}` or the inner
    `{"name", ...}` dict alone. `name`, when given, replaces the schema's name.
    """
    if not isinstance(schema, dict):
        raise TypeError(f"{where}: tool schema must be a dict, got {type(schema).__name__}")
    inner = schema.get("function", schema)
    if not isinstance(inner, dict):
        raise TypeError(f"{where}: tool schema 'function' must be a dict")
    tool_name = name or inner.get("name")
    if not isinstance(tool_name, str):
        raise ValueError(f"{where}: tool schema needs a string 'name' (schema['function']['name'])")
    parameters = copy.deepcopy(inner.get("parameters") or {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ValueError(f"{where}: tool schema 'parameters' must be a JSON schema of type 'object'")
    return _function_schema(tool_name, str(inner.get("description", "")), parameters, where)


# ---- argument checking -----------------------------------------------------------------------------

_JSON_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def check_arguments(schema: dict[str, Any], arguments: Any) -> None:
    """Raise `ToolArgumentError` (a message for the model) when `arguments` do not fit the tool's schema.

    Checks unknown names (unless the schema sets `additionalProperties`), missing required names, and
    the JSON type, `enum` and `nullable` of each given value (array items and object values too).
    """
    fn = schema["function"]
    params = fn.get("parameters") or {}
    props: dict[str, Any] = params.get("properties") or {}
    where = f"tool {fn['name']!r}"
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"{where}: arguments must be a JSON object, got {_json_type(arguments)}")
    problems = []
    if not params.get("additionalProperties"):
        problems += [f"unknown argument {k!r}" for k in arguments if k not in props]
    problems += [f"missing required argument {k!r}" for k in params.get("required", []) if k not in arguments]
    for key, value in arguments.items():
        mismatch = _type_mismatch(value, props[key]) if key in props else None
        if mismatch:
            problems.append(f"argument {key!r} {mismatch}")
    if problems:
        raise ToolArgumentError(f"{where}: {'; '.join(problems)}. Expected arguments: {_describe(params)}")


def _type_mismatch(value: Any, schema: dict[str, Any]) -> str | None:
    if value is None and schema.get("nullable"):
        return None
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {json.dumps(schema['enum'], ensure_ascii=False)}, got {json.dumps(value, default=str)}"
    if "anyOf" in schema:
        return None if any(_type_mismatch(value, s) is None for s in schema["anyOf"]) else "matches no allowed type"
    allowed = schema.get("type")
    if allowed is None:
        return None
    allowed = [allowed] if isinstance(allowed, str) else allowed
    if not any(_JSON_TYPE_CHECKS.get(t, lambda v: True)(value) for t in allowed):
        return f"must be {' or '.join(allowed)}, got {_json_type(value)}"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            if mismatch := _type_mismatch(item, schema["items"]):
                return f"item {i} {mismatch}"
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for k, item in value.items():
            if mismatch := _type_mismatch(item, schema["additionalProperties"]):
                return f"key {k!r} {mismatch}"
    return None


def _json_type(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _JSON_TYPE_CHECKS[name](value):
            return name
    return type(value).__name__


def _describe(params: dict[str, Any]) -> str:
    required = set(params.get("required", []))
    parts = []
    for key, prop in (params.get("properties") or {}).items():
        t = prop.get("type", "any")
        t = " or ".join(t) if isinstance(t, list) else t
        parts.append(f"{key} ({t}{', required' if key in required else ''})")
    return ", ".join(parts) or "none"


# ---- the tool --------------------------------------------------------------------------------------


class FunctionTool:
    """A Python function exposed to the model as a tool. Build it with `@function_tool`.

    Calling the object directly (`tool(...)`) calls the plain function, so decorated functions stay
    usable (and testable) as ordinary Python.
    """

    def __init__(
        self, fn: Callable[..., Any], name: str | None = None, schema: dict[str, Any] | None = None
    ) -> None:
        if not callable(fn):
            raise TypeError(f"function_tool expects a function, got {fn!r}")
        self.fn = fn
        if schema is None:
            self.schema = infer_schema(fn, name)
        else:
            where = f"function tool {name or getattr(fn, '__name__', fn)!r}"
            self.schema = normalize_tool_schema(schema, where, name)
            _check_signature_accepts(fn, self.schema, where)
        self.name: str = self.schema["function"]["name"]
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - an object with `async def __call__`
        )
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"FunctionTool(name={self.name!r}, fn={getattr(self.fn, '__qualname__', self.fn)!r})"

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Check `arguments` against the schema, run the function, normalise what it returns."""
        check_arguments(self.schema, arguments)
        return normalize_result(await self.invoke(arguments))

    async def invoke(self, arguments: dict[str, Any]) -> Any:
        """Run the function with already-checked arguments and return its raw value. Sync functions run
        in a worker thread (`asyncio.to_thread`); a timeout cannot stop such a thread, only stop waiting."""
        if self.is_async:
            value = await self.fn(**arguments)
        else:
            value = await asyncio.to_thread(self.fn, **arguments)
        if inspect.isawaitable(value):
            value = await value
        return value


def _check_signature_accepts(fn: Callable[..., Any], schema: dict[str, Any], where: str) -> None:
    """With `schema=`, every schema property must be a parameter of `fn` (or `fn` takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = [k for k in schema["function"]["parameters"].get("properties", {}) if k not in params]
    if missing:
        raise TypeError(f"{where}: schema properties {missing} are not parameters of {fn!r}")


@overload
def function_tool(
    fn: Callable[..., Any], /, name: str | None = None, *, schema: dict[str, Any] | None = None
) -> FunctionTool: ...


@overload
def function_tool(
    fn: str | None = None, /, name: str | None = None, *, schema: dict[str, Any] | None = None
) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def function_tool(fn: Any = None, /, name: str | None = None, *, schema: dict[str, Any] | None = None) -> Any:
    """Make a `FunctionTool`: `@function_tool`, `@function_tool("name")`, `@function_tool(schema={...})`,
    or `function_tool(fn)` called directly. `schema=` skips inference and is used as given."""
    if isinstance(fn, str):
        if name is not None:
            raise TypeError("function_tool: give the tool name once (positionally or as name=)")
        fn, name = None, fn
    if fn is None:
        return lambda f: FunctionTool(f, name=name, schema=schema)
    return FunctionTool(fn, name=name, schema=schema)


# ---- loading from files ----------------------------------------------------------------------------


def load_function_tools(path: str | Path) -> list[FunctionTool]:
    """Import the .py file at `path` and return its module-level `FunctionTool`s, in definition order."""
    module = load_module(str(path), what="tool")
    tools: dict[str, tuple[str, FunctionTool]] = {}
    for attr, obj in vars(module).items():
        if not isinstance(obj, FunctionTool):
            continue
        if obj.name in tools and tools[obj.name][1] is not obj:
            raise ValueError(f"{path}: tool name {obj.name!r} used twice (by {tools[obj.name][0]!r} and {attr!r})")
        tools.setdefault(obj.name, (attr, obj))
    if not tools:
        raise ValueError(
            f"{path}: no function tools found; decorate functions with @function_tool "
            "(from turnrl.tools import function_tool)"
        )
    return [tool for _, tool in tools.values()]
