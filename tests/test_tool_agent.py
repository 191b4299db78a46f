"""The tool agent on a scripted engine with the real Qwen3 template: every error path, limits, lifecycle."""

from __future__ import annotations

import asyncio
import json

import pytest
from fakes import ScriptedEngine

from turnrl.agents import AGENTS
from turnrl.agents.tool_agent import ToolAgentSettings, truncate
from turnrl.render import ChatRenderer
from turnrl.rewards import bind_reward
from turnrl.rollout import RolloutLimits, RolloutManager, run_groups
from turnrl.tools import StatefulToolBase, ToolSet, function_tool
from turnrl.types import RolloutStatus, SegmentSource, TerminationReason


@function_tool
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: first number
        b: second number
    """
    return str(a + b)


@function_tool
def explode(x: str) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("kaboom")


@function_tool
async def slow(x: str) -> str:
    """Sleeps for a long time.

    Args:
        x: anything
    """
    await asyncio.sleep(5)
    return "late"


@function_tool
def echo(text: str) -> str:
    """Echo text back.

    Args:
        text: the text
    """
    return text


EVENTS: list[str] = []


class Counter(StatefulToolBase):
    """Counts its calls; reward = number of calls; records its lifecycle."""

    schema = {"type": "function", "function": {"name": "counter", "description": "count",
              "parameters": {"type": "object", "properties": {}, "required": []}}}

    async def create(self, start: int = 0) -> None:
        self.n = start
        EVENTS.append(f"create:{start}")

    async def execute(self, arguments):
        self.n += 1
        EVENTS.append("execute")
        return f"count={self.n}"

    async def calc_reward(self) -> float:
        EVENTS.append("calc_reward")
        return float(self.n)

    async def release(self) -> None:
        EVENTS.append("release")


def call(name, **args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def run(tokenizer, script, rows=None, options=None, tools=(add, explode, slow, echo, Counter), reward=None,
        max_turns=6, n=1, max_new_tokens=200):
    settings = ToolAgentSettings.build(ToolSet(tools), "hermes", {"tool_timeout_s": 0.2, **(options or {})})
    engine = ScriptedEngine(tokenizer, script)
    manager = RolloutManager(
        engine, ChatRenderer(tokenizer), agents=AGENTS, default_agent="tool_agent", tools=settings,
        limits=RolloutLimits(max_turns=max_turns, max_new_tokens=max_new_tokens), reward_fn=reward,
    )
    groups = asyncio.run(run_groups(manager, rows or [{"prompt": "What is 2+3?"}], n=n))
    return [t for g in groups for t in g], engine


def scripted(*replies):
    return lambda rid, turn, prompt: replies[min(turn, len(replies)) - 1]


def tool_texts(traj):
    return [m["content"] for m in traj.messages if m["role"] == "tool"]


THINK = "<think>\nLet me use the tool.\n</think>\n\n"


def test_tool_round_trip_masks_ids_and_strict_render(qwen3_tokenizer):
    [traj], engine = run(qwen3_tokenizer, scripted(THINK + call("add", a=2, b=3), THINK + "The answer is 5."))
    assert (traj.status, traj.termination_reason, traj.num_turns) == (
        RolloutStatus.COMPLETED, TerminationReason.NO_TOOL_CALL, 2)
    assert tool_texts(traj) == ["5"]
    tool_msg = [m for m in traj.messages if m["role"] == "tool"][0]
    assert tool_msg["tool_call_id"] == "call_0" and tool_msg["name"] == "add"
    sources = [s.source for s in traj.segments]
    assert sources == [SegmentSource.MODEL, SegmentSource.TEMPLATE, SegmentSource.TOOL, SegmentSource.MODEL]
    trained = qwen3_tokenizer.decode([t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m])
    assert "<tool_response>" not in trained and "5\n</tool_response>" in qwen3_tokenizer.decode(traj.segments[2].token_ids)
    # the tool schema is in the prompt, rendered by the real Qwen3 template
    assert '"name": "add"' in qwen3_tokenizer.decode(traj.prompt_ids)
    # one user query followed by tool rounds: Qwen3 keeps every reasoning block, so the strict check passes
    assert traj.metrics["render_mismatch"] == 0.0
    assert traj.turns[0].env.info["tool_calls"][0]["ok"] is True


def test_model_supplied_call_ids_round_trip(qwen3_tokenizer):
    reply = '<tool_call>\n{"id": "abc-1", "name": "echo", "arguments": {"text": "hi"}}\n</tool_call>'
    [traj], _ = run(qwen3_tokenizer, scripted(reply, "done"))
    assert [m["tool_call_id"] for m in traj.messages if m["role"] == "tool"] == ["abc-1"]


@pytest.mark.parametrize(("reply", "expected"), [
    (call("nope", a=1), "unknown tool 'nope'; available tools: add, explode, slow, echo, counter"),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', "invalid JSON"),
    (call("explode", x="y"), "raised RuntimeError: kaboom"),
    (call("slow", x="y"), "timed out after 0.2 s"),
    (call("add", a=1), "missing required argument 'b'"),
    # hostile JSON: a RecursionError / ValueError failed the trajectory before, and NaN reached the tool
    ('<tool_call>\n{"name": "add", "arguments": ' + "[" * 5000 + "]" * 5000 + "}\n</tool_call>",
     "invalid JSON in <tool_call> #1: nesting deeper than 64 levels"),
    ('<tool_call>\n{"name": "add", "arguments": {"a": ' + "9" * 5000 + ', "b": 1}}\n</tool_call>',
     "invalid JSON in <tool_call> #1: an integer of 5000 digits"),
    ('<tool_call>\n{"name": "add", "arguments": {"a": NaN, "b": 1}}\n</tool_call>', "NaN is not JSON"),
])
def test_tool_errors_come_back_as_text(qwen3_tokenizer, reply, expected):
    [traj], _ = run(qwen3_tokenizer, scripted(reply, "I give up."), max_new_tokens=12_000)
    assert traj.termination_reason == TerminationReason.NO_TOOL_CALL and traj.num_turns == 2
    [text] = tool_texts(traj)
    assert text.startswith("Error:") and expected in text, text


def test_call_inside_think_is_ignored(qwen3_tokenizer):
    reply = "<think>\nmaybe " + call("add", a=1, b=1) + "\n</think>\n\nNo tools needed: 2."
    [traj], _ = run(qwen3_tokenizer, scripted(reply))
    assert traj.termination_reason == TerminationReason.NO_TOOL_CALL and traj.num_turns == 1


def test_too_many_parallel_calls_are_reported_not_dropped(qwen3_tokenizer):
    reply = call("add", a=1, b=1) + call("add", a=2, b=2) + call("add", a=3, b=3)
    [traj], _ = run(qwen3_tokenizer, scripted(reply, "ok"), options={"max_parallel_calls": 2})
    texts = tool_texts(traj)
    assert texts[:2] == ["2", "4"] and "only 2 tool calls are executed per turn" in texts[2]
    assert [m["tool_call_id"] for m in traj.messages if m["role"] == "tool"] == ["call_0", "call_1", "call_2"]


def test_parallel_calls_run_concurrently(qwen3_tokenizer):
    reply = call("slow", x="a") + call("slow", x="b")
    [traj], _ = run(qwen3_tokenizer, scripted(reply, "ok"), options={"tool_timeout_s": 0.3})
    env = traj.turns[0].env
    assert (env.end_ns - env.start_ns) / 1e9 < 0.55  # two 0.3 s timeouts in parallel, not 0.6 s in series


def test_invalid_call_limit_ends_the_episode(qwen3_tokenizer):
    bad = "<tool_call>\n{not json}\n</tool_call>"
    [traj], _ = run(qwen3_tokenizer, scripted(bad), options={"max_invalid_calls": 2})
    assert (traj.status, traj.termination_reason, traj.num_turns) == (
        RolloutStatus.COMPLETED, TerminationReason.INVALID_CALLS, 2)
    # a valid call resets the consecutive count
    [traj], _ = run(qwen3_tokenizer, scripted(bad, call("add", a=1, b=1), bad, "fine"), options={"max_invalid_calls": 2})
    assert traj.termination_reason == TerminationReason.NO_TOOL_CALL and traj.num_turns == 4


def test_turn_limits(qwen3_tokenizer):
    [traj], _ = run(qwen3_tokenizer, scripted(call("add", a=1, b=1)), options={"max_user_turns": 2})
    assert (traj.termination_reason, traj.num_turns) == (TerminationReason.MAX_TURNS, 2)
    [traj], _ = run(qwen3_tokenizer, scripted(call("add", a=1, b=1)), options={"max_assistant_turns": 3})
    assert (traj.termination_reason, traj.num_turns) == (TerminationReason.MAX_TURNS, 3)


def test_truncation_sides():
    text = "0123456789" * 3
    assert truncate(text, 10, "right") == "0123456789...(20 characters truncated)..."
    assert truncate(text, 10, "left") == "...(20 characters truncated)...0123456789"
    assert truncate(text, 10, "middle") == "01234...(20 characters truncated)...56789"
    assert truncate("short", 10, "middle") == "short"


def test_truncation_in_tokens(qwen3_tokenizer):
    long_text = " ".join(f"w{i}" for i in range(100))
    out = truncate(long_text, 8, "right", qwen3_tokenizer)
    assert out.endswith("tokens truncated)...")
    assert len(qwen3_tokenizer(out.split("...(")[0], add_special_tokens=False)["input_ids"]) == 8
    shorter = " ".join(f"w{i}" for i in range(40))
    [traj], _ = run(qwen3_tokenizer, scripted(call("echo", text=shorter), "ok"),
                    options={"max_tool_response_length": 8, "truncate_unit": "tokens", "truncate_side": "left"})
    assert tool_texts(traj)[0].startswith("...(") and tool_texts(traj)[0].endswith("w39")


def test_stateful_lifecycle_and_tool_rewards(qwen3_tokenizer):
    EVENTS.clear()
    rows = [{"prompt": "count", "tools_kwargs": {"counter": {"create_kwargs": {"start": 10}}}}]
    seen = []

    def reward(tool_rewards, num_turns):
        seen.append(tool_rewards)
        return tool_rewards["counter"]

    [traj], _ = run(qwen3_tokenizer, scripted(call("counter"), call("counter"), "done"), rows=rows,
                    reward=bind_reward(reward))
    assert EVENTS == ["create:10", "execute", "execute", "calc_reward", "release"]
    assert traj.tool_rewards == {"counter": 12.0} and traj.reward == 12.0 and seen == [{"counter": 12.0}]


def test_release_runs_when_the_trajectory_fails(qwen3_tokenizer):
    EVENTS.clear()

    def script(rid, turn, prompt):
        return call("counter") if turn == 1 else None  # the engine fails on turn 2

    [traj], _ = run(qwen3_tokenizer, script)
    assert traj.termination_reason == TerminationReason.ENGINE_ERROR
    assert EVENTS.count("release") == 1 and EVENTS[0] == "create:0"


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="unknown option.*max_paralel_calls"):
        ToolAgentSettings.build(ToolSet([add]), "hermes", {"max_paralel_calls": 2})
    with pytest.raises(ValueError, match="hermes"):
        ToolAgentSettings.build(ToolSet([add]), "nope", {})


def test_rollout_stats_give_tool_call_and_invalid_call_rates(qwen3_tokenizer):
    from turnrl.observe.stats import RolloutStats

    replies = {"s-0": [call("add", a=1, b=2), "3"], "s-1": ['<tool_call>\n{"name": "add", "arguments": {"a": 1,}}'
                                                           '\n</tool_call>', call("nope"), "?"], "s-2": ["4"]}
    rows = [{"id": k, "prompt": "What is 1+2?"} for k in ("s-0", "s-1", "s-2")]
    trajs, _ = run(qwen3_tokenizer, lambda rid, turn, prompt: replies[rid.rsplit("-", 1)[0]][turn - 1], rows=rows)
    stats = RolloutStats()
    for t in trajs:
        stats.add(t)
    s = stats.summary()
    # s-0: one good call; s-1: a malformed call and an unknown tool; s-2: no call
    assert s["rollout/tool_call_rate"] == pytest.approx(2 / 3)
    assert s["rollout/tool_calls_mean"] == pytest.approx(1.0)
    assert s["rollout/tool_invalid_call_rate"] == pytest.approx(2 / 3)


# ---- templates that drop tool schemas (SmolLM2's): injected as the hermes block, or refused ------------------

def test_smollm2s_template_drops_tool_schemas_so_the_hermes_block_carries_them(smol_tokenizer, qwen3_tokenizer,
                                                                             caplog):
    from turnrl.render import TOOL_BLOCK, RenderError
    from turnrl.tools import get_parser

    schemas = ToolSet([add]).schemas
    user = [{"role": "user", "content": "What is 2+3?"}]
    raw = smol_tokenizer.apply_chat_template(user, tools=schemas, tokenize=False, add_generation_prompt=True)
    assert '"add"' not in raw and "Add two integers" not in raw  # the real template drops them, silently
    r = ChatRenderer(smol_tokenizer)
    assert not r.renders_tools and ChatRenderer(qwen3_tokenizer).renders_tools
    with caplog.at_level("WARNING"):
        r.require_tools("hermes")
        r.require_tools("hermes")
    [warning] = [rec.getMessage() for rec in caplog.records]  # said once, at start-up, naming the template
    assert "smollm2-135m-instruct" in warning
    assert "does not render the tool schemas" in warning and "hermes" in warning
    text = r.render_initial(user, schemas)
    block = TOOL_BLOCK.format(tools=json.dumps(schemas[0], ensure_ascii=False))
    assert text.startswith(f"<|im_start|>system\n{block}<|im_end|>\n<|im_start|>user\nWhat is 2+3?")
    system = [{"role": "system", "content": "Be brief."}, *user]  # an own system prompt keeps its text first
    assert r.render_initial(system, schemas).startswith(f"<|im_start|>system\nBe brief.\n\n{block}<|im_end|>")
    # the call format the block asks for is what the hermes parser reads
    parsed = get_parser("hermes", schemas).parse(call("add", a=2, b=3))
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": 2, "b": 3})]
    with pytest.raises(RenderError, match="only in the hermes format, which --tool-parser qwen3_coder does not "
                                          "read: use --tool-parser hermes"):
        r.require_tools("qwen3_coder")


def test_a_tool_agent_on_smollm2_sees_its_tools_and_runs_them(smol_tokenizer, tmp_path, caplog):
    from turnrl.build import build_rollout_manager
    from turnrl.config import RolloutConfig
    from turnrl.render import RenderError

    tools = tmp_path / "tools.py"
    tools.write_text("from turnrl.tools import function_tool\n\n@function_tool\ndef add(a: int, b: int) -> str:\n"
                     "    \"\"\"Add two integers.\n\n    Args:\n        a: first\n        b: second\n    \"\"\"\n"
                     "    return str(a + b)\n")
    engine = ScriptedEngine(smol_tokenizer, scripted(call("add", a=2, b=3), "The answer is 5."))
    with caplog.at_level("WARNING"):
        manager = build_rollout_manager(RolloutConfig(tools=[str(tools)], max_new_tokens=64), engine,
                                        ChatRenderer(smol_tokenizer))
    assert any("does not render the tool schemas" in rec.getMessage() for rec in caplog.records)  # at start-up
    [[traj]] = asyncio.run(run_groups(manager, [{"prompt": "What is 2+3?"}]))
    assert traj.status == RolloutStatus.COMPLETED and tool_texts(traj) == ["5"]
    prompt = smol_tokenizer.decode(traj.prompt_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in prompt and "Add two integers" in prompt
    assert traj.metrics["render_mismatch"] == 0.0  # the full re-render injects the same block
    with pytest.raises(RenderError, match="--tool-parser hermes"):
        build_rollout_manager(RolloutConfig(tools=[str(tools)], tool_parser="qwen3_coder"), engine,
                              ChatRenderer(smol_tokenizer))
