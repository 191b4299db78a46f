"""Tool-call parsers: model text in, `ToolCall`s plus readable errors out.

A parser never raises on model output, whatever the string. A malformed call becomes an entry in
`ParseResult.errors`, written to be shown to the model (verl drops such calls and ends the episode without
feedback). Reasoning is removed before parsing, so a call the model only thinks about is never executed.

JSON is read strictly (`loads_json`): nesting deeper than `MAX_JSON_DEPTH`, integers of more than
`MAX_INT_DIGITS` digits, numbers out of float range, `NaN` / `Infinity` (which Python's json accepts and
writes back as invalid JSON) and unpaired surrogates are refused with a message, never an exception, so
whatever a parser returns can be sent on as JSON and written as UTF-8.

    parser = get_parser("hermes")
    result = parser.parse(text)
    if result.calls: ...              # run them
    elif result.errors: ...           # tell the model what was wrong
    else: ...                         # a final answer: no tool call syntax at all
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from turnrl.reasoning import split_reasoning
from turnrl.types import ToolCall

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ParseResult:
    """What one assistant message contained."""

    content: str
    """The text outside reasoning and tool-call blocks, stripped."""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One message per malformed call, e.g. `invalid JSON in <tool_call> #1: Expecting ',' delimiter at
    char 23`. Blocks are numbered from 1 in the order they appear."""
    reasoning: str = ""
    """The reasoning text that was removed (without its markers; see turnrl.reasoning)."""


class ToolCallParser(Protocol):
    name: str

    def parse(self, text: str) -> ParseResult: ...

    def has_call_syntax(self, text: str) -> bool:
        """True when the text (outside reasoning) tries to call a tool, well-formed or not."""
        ...


def _call_blocks(text: str) -> tuple[list[str], list[str], list[str]]:
    """Split text into (contents outside blocks, bodies of complete <tool_call> blocks, errors)."""
    outside: list[str] = []
    bodies: list[str] = []
    errors: list[str] = []
    while (start := text.find(CALL_OPEN)) != -1:
        outside.append(text[:start])
        end = text.find(CALL_CLOSE, start)
        if end == -1:
            errors.append(f"unterminated {CALL_OPEN} #{len(bodies) + 1}: missing {CALL_CLOSE}")
            return outside, bodies, errors
        bodies.append(text[start + len(CALL_OPEN) : end])
        text = text[end + len(CALL_CLOSE) :]
    outside.append(text)
    return outside, bodies, errors


def _join_content(parts: list[str]) -> str:
    return "\n".join(p.strip() for p in parts if p.strip())


# ---- strict JSON -----------------------------------------------------------------------------------

MAX_JSON_DEPTH = 64
"""Arrays/objects nested deeper are refused (Python's json recurses per level: RecursionError past ~1000)."""
MAX_INT_DIGITS = 4300
"""Longer integers are refused (Python's int parsing raises ValueError past 4,300 digits by default)."""


class JsonRefused(ValueError):
    """Text that is not JSON a tool call can carry; the message says why, for the model."""


def loads_json(text: str) -> Any:
    """`json.loads` that refuses what cannot go out again as valid JSON (see the module docstring).
    Raises JsonRefused, and nothing else, on any string."""
    depth = _nesting_depth(text, MAX_JSON_DEPTH)
    if depth > MAX_JSON_DEPTH:
        raise JsonRefused(f"nesting deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_reject_constant)
    except JsonRefused:
        raise
    except json.JSONDecodeError as e:
        raise JsonRefused(f"{e.msg} at char {e.pos}") from None
    except (ValueError, RecursionError) as e:  # int limits set lower by the process; a deep stack already
        raise JsonRefused(f"{type(e).__name__}: {e}") from None
    _check_strings(value)
    return value


_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
"""A JSON string, or an unterminated one running to the end: it always matches from a quote, so removing
strings is linear whatever the text."""
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def _nesting_depth(text: str, limit: int) -> int:
    """The deepest array/object nesting outside strings; counting stops past `limit`. Linear in the text, and
    cheap for the usual call: only texts with more than `limit` brackets are looked at."""
    if text.count("[") + text.count("{") <= limit:
        return 0
    depth = deepest = 0
    for bracket in _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text)):
        if bracket in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        else:
            depth -= 1
    return deepest


def _parse_int(digits: str) -> int:
    n = len(digits) - digits.startswith("-")
    if n > MAX_INT_DIGITS:
        raise JsonRefused(f"an integer of {n} digits (at most {MAX_INT_DIGITS})")
    return int(digits)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonRefused(f"the number {text[:40]} is out of range")
    return value


def _reject_constant(name: str) -> Any:
    raise JsonRefused(f"{name} is not JSON (numbers must be finite)")


def _check_strings(value: Any) -> None:
    """Refuse unpaired surrogates (`"\\ud800"` parses, but cannot be written as UTF-8). Depth is bounded."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise JsonRefused(f"a string holds an unpaired surrogate ({value[e.start]!r})") from None
    elif isinstance(value, list):
        for item in value:
            _check_strings(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key)
            _check_strings(item)


# ---- hermes ----------------------------------------------------------------------------------------


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Qwen3, Hermes...).

    `arguments` may be an object or a JSON string holding one (missing means `{}`; `parameters` is read
    when `arguments` is absent); `{"function": {"name", "arguments"}}` nesting is accepted; a model `id`
    is kept, otherwise ids are `call_<i>` with i the call's index in this message.
    """

    name = "hermes"

    def __init__(self, schemas: list[dict[str, Any]] | None = None) -> None:
        del schemas  # JSON already carries types

    def has_call_syntax(self, text: str) -> bool:
        return CALL_OPEN in split_reasoning(text)[1]

    def parse(self, text: str) -> ParseResult:
        reasoning, rest = split_reasoning(text)
        outside, bodies, block_errors = _call_blocks(rest)
        result = ParseResult(content=_join_content(outside), reasoning=reasoning or "")
        for number, body in enumerate(bodies, start=1):
            call_or_error = _hermes_call(body, number, f"call_{len(result.calls)}")
            if isinstance(call_or_error, ToolCall):
                result.calls.append(call_or_error)
            else:
                result.errors.append(call_or_error)
        result.errors += block_errors
        return result


def _hermes_call(body: str, number: int, default_id: str) -> ToolCall | str:
    where = f"{CALL_OPEN} #{number}"
    try:
        obj = loads_json(body)
    except JsonRefused as e:
        return f"invalid JSON in {where}: {e}"
    if not isinstance(obj, dict):
        return f'{where} must hold a JSON object {{"name": ..., "arguments": {{...}}}}, got {_json_kind(obj)}'
    call_id = obj.get("id")
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f'missing "name" in {where}: expected {{"name": ..., "arguments": {{...}}}}'
    arguments = obj.get("arguments", obj.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = loads_json(arguments) if arguments.strip() else {}
        except JsonRefused as e:
            return f'invalid JSON in the "arguments" string of {where}: {e}'
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return f'"arguments" in {where} must be a JSON object, got {_json_kind(arguments)}'
    return ToolCall(name=name.strip(), arguments=arguments, id=str(call_id) if call_id else default_id)


def _json_kind(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


# ---- qwen3_coder -----------------------------------------------------------------------------------

# names are bounded: unbounded, each of n unclosed `<function=` would scan to the end of the text (n² time)
_FUNCTION_RE = re.compile(r"<function=([^>\n]{0,256})>(.*?)(?:</function>|(?=<function=)|\Z)", re.DOTALL)
_PARAMETER_RE = re.compile(
    r"<parameter=([^>\n]{0,256})>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL
)


class Qwen3CoderParser:
    """Qwen3-Coder's XML calls:

        <tool_call>
        <function=name>
        <parameter=arg>
        value
        </parameter>
        </function>
        </tool_call>

    A value loses one leading and one trailing newline, then is read as JSON (numbers, arrays, objects,
    true/false/null) and kept as the raw string when that fails, or when the tool's schema says the
    parameter is a string. Nothing is ever `eval`-ed. A missing `</parameter>` or `</function>` is
    tolerated (the next tag ends it); a missing `</tool_call>` is an error.
    """

    name = "qwen3_coder"

    def __init__(self, schemas: list[dict[str, Any]] | None = None) -> None:
        self._string_params = _string_parameters(schemas or [])

    def has_call_syntax(self, text: str) -> bool:
        return CALL_OPEN in split_reasoning(text)[1]

    def parse(self, text: str) -> ParseResult:
        reasoning, rest = split_reasoning(text)
        outside, bodies, block_errors = _call_blocks(rest)
        result = ParseResult(content=_join_content(outside), reasoning=reasoning or "")
        for number, body in enumerate(bodies, start=1):
            functions = _FUNCTION_RE.findall(body)
            if not functions:
                result.errors.append(f"no <function=...> in {CALL_OPEN} #{number}")
            for name, inner in functions:
                call_or_error = self._call(name.strip(), inner, number, f"call_{len(result.calls)}")
                if isinstance(call_or_error, ToolCall):
                    result.calls.append(call_or_error)
                else:
                    result.errors.append(call_or_error)
        result.errors += block_errors
        return result

    def _call(self, name: str, inner: str, number: int, call_id: str) -> ToolCall | str:
        where = f"{CALL_OPEN} #{number}"
        if not name:
            return f"missing function name in {where}: expected <function=name>"
        arguments: dict[str, Any] = {}
        for key, raw in _PARAMETER_RE.findall(inner):
            key = key.strip()
            if not key:
                return f"missing parameter name in {where} (function {name!r}): expected <parameter=name>"
            if key in arguments:
                return f"parameter {key!r} given twice in {where} (function {name!r})"
            arguments[key] = self._value(name, key, raw)
        return ToolCall(name=name, arguments=arguments, id=call_id)

    def _value(self, function: str, key: str, raw: str) -> Any:
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        if (function, key) in self._string_params:
            return value
        try:
            return loads_json(value)
        except JsonRefused:  # not JSON (NaN, too deep, too long an integer...): the raw string
            return value


def _string_parameters(schemas: list[dict[str, Any]]) -> set[tuple[str, str]]:
    out = set()
    for schema in schemas:
        fn = schema.get("function", schema)
        for key, prop in ((fn.get("parameters") or {}).get("properties") or {}).items():
            if isinstance(prop, dict) and prop.get("type") == "string":
                out.add((fn.get("name"), key))
    return out


# ---- registry --------------------------------------------------------------------------------------

PARSERS: dict[str, Callable[[list[dict[str, Any]] | None], ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
}


def get_parser(name: str, schemas: list[dict[str, Any]] | None = None) -> ToolCallParser:
    """The parser registered as `name`. `schemas` (the tool set's) lets typed formats keep string
    parameters as strings."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; registered: {', '.join(sorted(PARSERS))}")
    return PARSERS[name](schemas)
