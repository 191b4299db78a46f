"""Stateful tools: per-trajectory lifecycle, YAML configs, ToolSet registry and ToolSession."""

from __future__ import annotations

import asyncio
import textwrap
from typing import Any

import pytest

from turnrl.tools import (
    StatefulToolBase,
    ToolArgumentError,
    ToolError,
    ToolExecutionError,
    ToolLifecycleError,
    ToolResult,
    ToolSet,
    ToolSpec,
    ToolTimeout,
    function_tool,
    load_tool_config,
)
from turnrl.types import ToolCall

events: list[tuple[Any, ...]] = []


class Counter(StatefulToolBase):
    """Counts calls; the reward is the count times the `weight` from create_kwargs."""

    schema = {
        "type": "function",
        "function": {
            "name": "counter",
            "description": "Count.",
            "parameters": {"type": "object", "properties": {"step": {"type": "integer"}}, "required": ["step"]},
        },
    }

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any] | None = None) -> None:
        super().__init__(config, tool_schema)
        self.total = 0
        events.append(("init", id(self)))

    async def create(self, weight: float = 1.0, **kwargs: Any) -> None:
        self.weight = weight
        events.append(("create", id(self), weight))

    async def execute(self, arguments: dict[str, Any]) -> Any:
        if arguments["step"] < 0:
            raise ValueError("negative step")
        self.total += arguments["step"]
        events.append(("execute", id(self), arguments["step"]))
        return f"total {self.total}", 0.1

    async def calc_reward(self) -> float:
        events.append(("calc_reward", id(self)))
        return self.total * self.weight

    async def release(self) -> None:
        events.append(("release", id(self)))


class BadRelease(StatefulToolBase):
    schema = {"name": "bad_release", "parameters": {"type": "object", "properties": {}}}

    async def execute(self, arguments: dict[str, Any]) -> str:
        return "ok"

    async def release(self) -> None:
        events.append(("release", "bad_release"))
        raise OSError("disk gone")


class Sleeper(StatefulToolBase):
    schema = {"name": "sleeper", "parameters": {"type": "object", "properties": {"s": {"type": "number"}}}}

    async def execute(self, arguments: dict[str, Any]) -> str:
        await asyncio.sleep(arguments.get("s", 0))
        return "woke"


@function_tool
def echo(text: str) -> str:
    """Echo.

    Args:
        text: What to echo.
    """
    return text


@pytest.fixture(autouse=True)
def clear_events():
    events.clear()


def call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name=name, arguments=arguments, id="call_0")


# ---- lifecycle -------------------------------------------------------------------------------------


async def test_lifecycle_create_once_then_reward_then_release_once():
    toolset = ToolSet([Counter, echo])
    session = toolset.session({"counter": {"create_kwargs": {"weight": 2.0}}})
    assert await session.call(call("counter", step=2)) == ToolResult("total 2", reward=0.1)
    assert await session.call(call("counter", step=3)) == ToolResult("total 5", reward=0.1)
    assert (await session.call(call("echo", text="hi"))).text == "hi"
    assert await session.calc_rewards() == {"counter": 10.0}
    await session.close()
    await session.close()  # idempotent
    instance = events[0][1]
    assert events == [
        ("init", instance),
        ("create", instance, 2.0),
        ("execute", instance, 2),
        ("execute", instance, 3),
        ("calc_reward", instance),
        ("release", instance),
    ]


async def test_each_session_gets_its_own_instance():
    toolset = ToolSet([Counter])
    async with toolset.session() as a, toolset.session() as b:
        await a.call(call("counter", step=1))
        await b.call(call("counter", step=5))
        assert await a.calc_rewards() == {"counter": 1.0}
        assert await b.calc_rewards() == {"counter": 5.0}
    assert len({e[1] for e in events if e[0] == "create"}) == 2
    assert [e[0] for e in events].count("release") == 2


async def test_concurrent_first_calls_create_once():
    session = ToolSet([Counter]).session()
    await asyncio.gather(*(session.call(call("counter", step=1)) for _ in range(5)))
    assert [e[0] for e in events].count("create") == 1
    assert await session.calc_rewards() == {"counter": 5.0}
    await session.close()


async def test_uncalled_tools_are_never_created_or_released():
    session = ToolSet([Counter, echo]).session()
    await session.call(call("echo", text="x"))
    assert await session.calc_rewards() == {}
    await session.close()
    assert events == []


async def test_execute_exception_becomes_tool_execution_error_and_release_still_runs():
    session = ToolSet([Counter]).session()
    with pytest.raises(ToolExecutionError, match="tool 'counter' raised ValueError: negative step") as info:
        await session.call(call("counter", step=-1))
    assert isinstance(info.value.__cause__, ValueError)
    await session.close()
    assert [e[0] for e in events] == ["init", "create", "release"]


async def test_all_instances_released_even_when_one_release_raises():
    session = ToolSet([BadRelease, Counter]).session()
    await session.call(call("bad_release"))
    await session.call(call("counter", step=1))
    with pytest.raises(ToolLifecycleError, match=r"release\(\) failed for 1 tool\(s\): tool 'bad_release'") as info:
        await session.close()
    assert [name for name, _ in info.value.errors] == ["bad_release"]
    assert [e for e in events if e[0] == "release"] == [("release", "bad_release"), ("release", events[0][1])]
    await session.close()  # already closed: nothing released twice
    assert [e[0] for e in events].count("release") == 2


async def test_failed_create_is_released_and_not_retried():
    class FailingCreate(StatefulToolBase):
        schema = {"name": "fragile", "parameters": {"type": "object", "properties": {}}}
        creates = 0

        async def create(self, **kwargs: Any) -> None:
            type(self).creates += 1
            raise RuntimeError("no sandbox")

        async def execute(self, arguments: dict[str, Any]) -> str:
            return "never"

        async def release(self) -> None:
            events.append(("release", "fragile"))

    session = ToolSet([FailingCreate]).session()
    for _ in range(2):
        with pytest.raises(ToolLifecycleError, match=r"create\(\) of tool 'fragile'.*no sandbox"):
            await session.call(call("fragile"))
    assert FailingCreate.creates == 1
    await session.close()
    assert events == [("release", "fragile")]


# ---- session errors --------------------------------------------------------------------------------


async def test_unknown_tool_lists_available_tools():
    session = ToolSet([Counter, echo]).session()
    with pytest.raises(ToolError, match=r"unknown tool 'search'; available tools: counter, echo"):
        await session.call(call("search", q="x"))


async def test_bad_arguments_for_stateful_tool_never_create_it():
    session = ToolSet([Counter]).session()
    with pytest.raises(ToolArgumentError, match="missing required argument 'step'"):
        await session.call(call("counter"))
    assert events == []


async def test_timeout_raises_tool_timeout_and_release_still_runs():
    session = ToolSet([Sleeper]).session()
    with pytest.raises(ToolTimeout, match=r"tool 'sleeper' timed out after 0.05 s"):
        await session.call(call("sleeper", s=10), timeout_s=0.05)
    assert (await session.call(call("sleeper", s=0), timeout_s=1)).text == "woke"
    await session.close()


async def test_function_tool_timeout():
    @function_tool
    async def hang() -> str:
        """Hang."""
        await asyncio.sleep(10)
        return "late"

    session = ToolSet([hang]).session()
    with pytest.raises(ToolTimeout):
        await session.call(call("hang"), timeout_s=0.05)


async def test_tools_kwargs_validation():
    toolset = ToolSet([Counter, echo])
    with pytest.raises(ValueError, match="tools_kwargs names tool 'nope'"):
        toolset.session({"nope": {"create_kwargs": {}}})
    with pytest.raises(ValueError, match=r"tools_kwargs\['counter'\] must be \{'create_kwargs'"):
        toolset.session({"counter": {"execute_kwargs": {"x": 1}}})
    with pytest.raises(ValueError, match="'echo' is a function tool"):
        toolset.session({"echo": {"create_kwargs": {"a": 1}}})
    toolset.session({"echo": None, "counter": {"create_kwargs": None}})  # parquet padding is fine
    toolset.session({"counter": {"create_kwargs": {}, "execute_kwargs": {}, "release_kwargs": None}})  # verl's placeholders


async def test_call_after_close_is_an_error():
    session = ToolSet([echo]).session()
    await session.close()
    with pytest.raises(RuntimeError, match="after close"):
        await session.call(call("echo", text="x"))


# ---- registry and configs --------------------------------------------------------------------------


def write_tools_package(tmp_path) -> None:
    (tmp_path / "calc_tools.py").write_text(
        textwrap.dedent(
            """
            from turnrl.tools import StatefulToolBase, function_tool

            class Calc(StatefulToolBase):
                async def execute(self, arguments):
                    return str(self.config["offset"] + arguments["x"])

            class WithSchema(StatefulToolBase):
                schema = {"name": "with_schema", "parameters": {"type": "object", "properties": {}}}

                async def execute(self, arguments):
                    return "own schema"

            class NoSchema(StatefulToolBase):
                async def execute(self, arguments):
                    return ""

            @function_tool
            def calc(x: int) -> int:
                return x
            """
        )
    )


CALC_SCHEMA = """
    tool_schema:
      type: function
      function:
        name: calc
        description: Add the offset.
        parameters: {type: object, properties: {x: {type: integer}}, required: [x]}
"""


async def test_yaml_config_with_dotted_and_file_class_names(tmp_path, monkeypatch):
    write_tools_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "tools.yaml"
    config.write_text(
        "tools:\n  - class_name: calc_tools.Calc\n    config: {offset: 10}\n"
        + CALC_SCHEMA
        + "  - class_name: calc_tools.py:WithSchema\n"
    )
    specs = load_tool_config(config)
    assert [s.name for s in specs] == ["calc", "with_schema"]
    assert specs[0].config == {"offset": 10}
    assert specs[0].schema["function"]["description"] == "Add the offset."
    toolset = ToolSet(specs)
    assert [s["function"]["name"] for s in toolset.schemas] == ["calc", "with_schema"]
    async with toolset.session() as session:
        assert (await session.call(call("calc", x=5))).text == "15"
        assert (await session.call(call("with_schema"))).text == "own schema"


@pytest.mark.parametrize(
    ("yaml_text", "error"),
    [
        ("tools:\n  - class_name: calc_tools.NoSchema\n", "class calc_tools.NoSchema has no tool schema"),
        ("tools:\n  - class_name: calc_tools.Missing\n", "has no attribute 'Missing'"),
        ("tools:\n  - class_name: no_such_module.X\n", "cannot import module 'no_such_module'"),
        ("tools:\n  - class_name: missing.py:X\n", "tool file missing.py not found"),
        ("tools:\n  - class_name: calc_tools.Calc\n    extra: 1\n", r"unknown keys \['extra'\]"),
        ("tools:\n  - config: {}\n", "expected a mapping with a string `class_name:`"),
        ("tool: []\n", "exactly one key, `tools:`"),
    ],
)
def test_yaml_config_errors_name_file_and_entry(tmp_path, monkeypatch, yaml_text, error):
    write_tools_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    with pytest.raises((ValueError, FileNotFoundError), match=error) as info:
        load_tool_config(config)
    assert "bad.yaml" in str(info.value)


def test_duplicate_names_across_sources_name_both(tmp_path, monkeypatch):
    write_tools_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    functions = tmp_path / "fn_tools.py"
    functions.write_text("from calc_tools import calc\n")
    config = tmp_path / "tools.yaml"
    config.write_text("tools:\n  - class_name: calc_tools.Calc\n    config: {offset: 1}\n" + CALC_SCHEMA)
    with pytest.raises(ValueError) as info:
        ToolSet.from_sources(function_tool_files=[str(functions)], tool_config_files=[str(config)])
    assert str(info.value) == (
        f"tool 'calc' defined twice: in {functions} (function tool) and {config} (class calc_tools.Calc)"
    )


def test_from_sources_merges_and_subset(tmp_path, monkeypatch):
    write_tools_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    functions = tmp_path / "fn_tools.py"
    functions.write_text("from calc_tools import calc\n")
    toolset = ToolSet.from_sources(function_tool_files=[functions], tools=[Counter, echo])
    assert toolset.names == ["calc", "counter", "echo"]
    assert toolset.source("calc") == f"{functions} (function tool)"
    assert toolset.subset(["echo"]).names == ["echo"]
    with pytest.raises(ValueError, match="tool 'echo' defined twice"):
        toolset.add(echo)


def test_class_without_async_lifecycle_is_rejected():
    class NotATool:
        schema = {"name": "x", "parameters": {"type": "object", "properties": {}}}

        def execute(self, arguments):
            return ""

    with pytest.raises(TypeError, match="must define async methods.*missing or not async: create, execute"):
        ToolSpec.from_class(NotATool)
