"""@function_tool: schema inference, decorator forms, argument checks, result normalisation, loading."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Literal, Optional

import pytest

from turnrl.tools import (
    FunctionTool,
    ToolArgumentError,
    ToolResponse,
    ToolResult,
    function_tool,
    load_function_tools,
    normalize_result,
)


def params_of(tool: FunctionTool) -> dict[str, Any]:
    return tool.schema["function"]["parameters"]


# ---- schema inference ------------------------------------------------------------------------------


def test_full_schema_of_a_documented_function():
    @function_tool
    def add(a: int, b: float = 0.0) -> float:
        """Add two numbers.

        The second one is optional.

        Args:
            a: The first number.
            b (float): The second number,
                which may be a fraction.
        """
        return a + b

    assert add.name == "add"
    assert add.schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.\n\nThe second one is optional.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "number", "description": "The second number, which may be a fraction."},
                },
                "required": ["a"],
            },
        },
    }


@pytest.mark.parametrize(
    ("hint", "expected"),
    [
        (str, {"type": "string"}),
        (int, {"type": "integer"}),
        (float, {"type": "number"}),
        (bool, {"type": "boolean"}),
        (Any, {}),
        (list[int], {"type": "array", "items": {"type": "integer"}}),
        (list, {"type": "array"}),
        (list[list[str]], {"type": "array", "items": {"type": "array", "items": {"type": "string"}}}),
        (dict[str, float], {"type": "object", "additionalProperties": {"type": "number"}}),
        (dict, {"type": "object"}),
        (Optional[int], {"type": "integer", "nullable": True}),  # noqa: UP045 - the typing spelling on purpose
        (int | None, {"type": "integer", "nullable": True}),
        (list[str] | None, {"type": "array", "items": {"type": "string"}, "nullable": True}),
        (int | float, {"type": ["integer", "number"]}),
        (int | str | None, {"type": ["integer", "string"], "nullable": True}),
        (list[int] | str, {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "string"}]}),
        (Literal["a", "b"], {"type": "string", "enum": ["a", "b"]}),
        (Literal[1, 2], {"type": "integer", "enum": [1, 2]}),
        (Literal["x", None], {"type": "string", "enum": ["x"], "nullable": True}),
    ],
)
def test_type_hint_to_schema(hint, expected):
    def fn(x):
        return x

    fn.__annotations__ = {"x": hint}
    assert params_of(function_tool(fn))["properties"]["x"] == expected


def test_required_follows_defaults_and_an_empty_required_list_is_omitted():
    @function_tool
    def f(a: str, b: int = 1, c: bool | None = None) -> None:
        """F."""

    @function_tool
    def g(a: str = "") -> None:
        """G."""

    assert params_of(f)["required"] == ["a"]
    assert "required" not in params_of(g)


def test_parameter_without_args_entry_gets_no_description_and_no_docstring_gives_empty_description():
    @function_tool
    def f(a: int, b: int) -> int:
        """Sum.

        Args:
            a: First.
        """
        return a + b

    def g(x: int) -> int:
        return x

    assert params_of(f)["properties"]["b"] == {"type": "integer"}
    assert function_tool(g).schema["function"]["description"] == ""


def test_decorator_forms():
    @function_tool("renamed")
    def f1(x: int) -> int:
        return x

    @function_tool(name="renamed2")
    def f2(x: int) -> int:
        return x

    def f3(x: int) -> int:
        return x

    schema = {"name": "custom", "description": "given", "parameters": {"type": "object", "properties": {"x": {}}}}

    @function_tool(schema=schema)
    def f4(x, *args, **kwargs):  # no hints at all: schema= bypasses inference
        return x

    assert f1.name == "renamed" and f1.schema["function"]["name"] == "renamed"
    assert f2.name == "renamed2"
    assert function_tool(f3).name == "f3"
    assert f4.name == "custom"
    assert f4.schema == {"type": "function", "function": schema}
    assert f1(3) == 3  # the tool still calls like the function


def test_schema_bypass_accepts_the_full_openai_form_and_checks_the_signature():
    full = {"type": "function", "function": {"name": "t", "parameters": {"type": "object", "properties": {"q": {}}}}}
    tool = function_tool(lambda q: q, schema=full)
    assert tool.name == "t" and tool.schema["function"]["description"] == ""
    with pytest.raises(TypeError, match=r"schema properties \['q'\] are not parameters"):
        function_tool(lambda other: other, schema=full)


def test_varargs_and_kwargs_are_rejected_naming_function_and_parameter():
    def with_args(a: int, *rest: int) -> None: ...

    def with_kwargs(a: int, **extra: int) -> None: ...

    with pytest.raises(TypeError, match=r"function tool 'with_args': parameter \*rest is not allowed"):
        function_tool(with_args)
    with pytest.raises(TypeError, match=r"function tool 'with_kwargs': parameter \*\*extra is not allowed"):
        function_tool(with_kwargs)


def test_missing_type_hint_names_the_parameter():
    def f(a: int, b) -> None: ...

    with pytest.raises(TypeError, match=r"function tool 'f': parameter 'b' has no type hint"):
        function_tool(f)


def test_unsupported_hint_stale_docstring_and_bad_name_are_clear_errors():
    def f(a: set[int]) -> None: ...

    def g(a: int) -> None:
        """G.

        Args:
            a: A.
            b: Gone.
        """

    def h(a: dict[int, str]) -> None: ...

    with pytest.raises(TypeError, match=r"parameter 'a'.*unsupported type hint"):
        function_tool(f)
    with pytest.raises(ValueError, match=r"documents \['b'\], which are not parameters"):
        function_tool(g)
    with pytest.raises(TypeError, match="dict keys must be str"):
        function_tool(h)
    with pytest.raises(ValueError, match="must be 1-64 characters"):
        function_tool(lambda: None, name="has space")


# ---- argument checking -----------------------------------------------------------------------------


@function_tool
def pick(kind: Literal["a", "b"], n: int, tags: list[str] | None = None) -> str:
    """Pick.

    Args:
        kind: Which.
        n: How many.
        tags: Labels.
    """
    return f"{kind}{n}{tags or ''}"


async def test_valid_arguments_run_the_function():
    assert (await pick.call({"kind": "a", "n": 2})).text == "a2"
    assert (await pick.call({"kind": "b", "n": 1, "tags": None})).text == "b1"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"kind": "a", "n": 1, "extra": 1}, "unknown argument 'extra'"),
        ({"kind": "a"}, "missing required argument 'n'"),
        ({"kind": "c", "n": 1}, 'argument \'kind\' must be one of ["a", "b"], got "c"'),
        ({"kind": "a", "n": "3"}, "argument 'n' must be integer, got string"),
        ({"kind": "a", "n": True}, "argument 'n' must be integer, got boolean"),
        ({"kind": "a", "n": 1, "tags": ["x", 2]}, "argument 'tags' item 1 must be string, got integer"),
        ("not a dict", "arguments must be a JSON object, got string"),
    ],
)
async def test_bad_arguments_raise_a_message_for_the_model(arguments, message):
    with pytest.raises(ToolArgumentError) as info:
        await pick.call(arguments)
    assert message in str(info.value)
    if isinstance(arguments, dict):
        assert "Expected arguments: kind (string, required), n (integer, required), tags (array)" in str(info.value)


# ---- execution -------------------------------------------------------------------------------------


async def test_sync_function_runs_off_the_event_loop_thread():
    seen = []

    @function_tool
    def where() -> str:
        """Record the thread."""
        seen.append(threading.get_ident())
        return "ok"

    assert (await where.call({})).text == "ok"
    assert seen and seen[0] != threading.get_ident()


async def test_async_function_is_awaited_on_the_loop():
    seen = []

    @function_tool
    async def slow(x: int) -> int:
        """Slow.

        Args:
            x: Value.
        """
        seen.append(threading.get_ident())
        await asyncio.sleep(0)
        return x * 2

    assert slow.is_async
    assert (await slow.call({"x": 21})).text == "42"
    assert seen == [threading.get_ident()]


# ---- normalisation ---------------------------------------------------------------------------------


class Point:
    def __str__(self) -> str:
        return "Point(1, 2)"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("plain", ToolResult("plain")),
        ({"ü": 1, "b": [1, 2]}, ToolResult('{"ü": 1, "b": [1, 2]}')),
        ([1, "x"], ToolResult('[1, "x"]')),
        (ToolResponse(text="t", images=["a.png"]), ToolResult("t", images=["a.png"])),
        (("r", 0.5), ToolResult("r", reward=0.5)),
        (("r", 1, {"m": 2}), ToolResult("r", reward=1.0, metrics={"m": 2})),
        (("r", None), ToolResult("r", reward=0.0)),
        (("r",), ToolResult("r")),
        (({"a": 1}, -1.0), ToolResult('{"a": 1}', reward=-1.0)),
        ((ToolResponse("x", ["i"]), 0.0, None), ToolResult("x", images=["i"])),
        (None, ToolResult("")),
        (42, ToolResult("42")),
        (2.5, ToolResult("2.5")),
        (True, ToolResult("True")),
        (Point(), ToolResult("Point(1, 2)")),
        (ToolResult("given", reward=3.0), ToolResult("given", reward=3.0)),
    ],
)
def test_normalisation_table(value, expected):
    assert normalize_result(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ((), "tuple of length 0"),
        (("a", 1, {}, "x"), "tuple of length 4"),
        (("a", "high"), "reward 'high'"),
        (("a", True), "reward True"),
        (("a", 1.0, ["m"]), "metrics of type list"),
        ((("a", 1), 1), "response is itself a tuple"),
    ],
)
def test_bad_tuples_raise_type_error(value, message):
    with pytest.raises(TypeError, match=message):
        normalize_result(value)


async def test_call_normalises_the_returned_value():
    @function_tool
    def scored(x: int) -> tuple[str, float, dict[str, int]]:
        """Scored.

        Args:
            x: Input.
        """
        return f"got {x}", 0.25, {"calls": 1}

    assert await scored.call({"x": 3}) == ToolResult("got 3", reward=0.25, metrics={"calls": 1})


# ---- loading from a file ---------------------------------------------------------------------------


def test_load_function_tools_collects_module_level_tools(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(
        "from turnrl.tools import function_tool\n"
        "@function_tool\n"
        "def a(x: int) -> int:\n    return x\n"
        "@function_tool('bee')\n"
        "def b(y: str) -> str:\n    return y\n"
        "alias = a\n"
        "def not_a_tool(z: int) -> int:\n    return z\n"
    )
    tools = load_function_tools(path)
    assert [t.name for t in tools] == ["a", "bee"]
    assert load_function_tools(str(path))[0] is tools[0]  # imported once


def test_load_function_tools_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_function_tools(missing)
    empty = tmp_path / "empty_tools.py"
    empty.write_text("X = 1\n")
    with pytest.raises(ValueError, match=r"empty_tools.py: no function tools found"):
        load_function_tools(empty)
