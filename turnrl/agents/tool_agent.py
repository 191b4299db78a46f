"""The tool agent (verl's ToolAgentLoop) as an environment on the one turn loop.

Each model turn: parse tool calls (reasoning blocks ignored) → run up to `max_parallel_calls` of them
concurrently, each under `tool_timeout_s` → return one `tool` message per call (its `tool_call_id` is the
model's own id when the format carries one) → the driver renders them as mask-0 delta tokens. The episode
ends when the model replies without a tool call (COMPLETED / no_tool_call), after `max_invalid_calls`
consecutive turns with malformed calls (COMPLETED / invalid_calls), or at `max_assistant_turns` /
`max_user_turns` (COMPLETED / max_turns).

What verl drops silently, this returns to the model as text: malformed JSON, unknown tools, bad
arguments, tool exceptions, timeouts and calls beyond `max_parallel_calls`. Tool output longer than
`max_tool_response_length` (characters or tokens) is truncated: `truncate_side` names the side that is
CUT (left keeps the tail, right keeps the head, middle keeps both ends), with a marker saying how much.

Stateful tools live for one trajectory: `create` on first use, `calc_reward` when the episode ends (the
rewards reach reward functions as `tool_rewards`), `release` always, also when the trajectory fails. A
`calc_reward` value that is not a number (verl's SearchTool returns its list of results) is no reward: it is
kept in `info["tool_reward_values"]`, with a warning, and the trajectory goes on to be scored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from turnrl.data import row_tool_selection, row_tools_kwargs
from turnrl.envs.base import error_with_frames
from turnrl.observe.tracing import collect_spans
from turnrl.rollout.episode import RolloutContext, drive
from turnrl.tools import ToolCallParser, ToolError, ToolSet, get_parser, split_tool_rewards
from turnrl.types import Message, StepResult, TerminationReason, ToolCall, Trajectory

log = logging.getLogger(__name__)


@dataclass
class ToolAgentSettings:
    """The tools an agent may call and the limits of the tool agent."""

    toolset: ToolSet
    parser: ToolCallParser
    max_parallel_calls: int = 4
    """Calls executed per turn; further calls get an error message instead of running."""
    tool_timeout_s: float | None = 30.0
    max_tool_response_length: int = 4096
    truncate_unit: Literal["chars", "tokens"] = "chars"
    truncate_side: Literal["left", "right", "middle"] = "middle"
    """The side that is cut: left keeps the tail, right keeps the head, middle keeps head and tail."""
    max_invalid_calls: int = 3
    """Consecutive turns whose tool calls are all malformed before the episode ends (invalid_calls)."""
    max_assistant_turns: int | None = None
    """Model turns (also bounded by the rollout's max_turns)."""
    max_user_turns: int | None = None
    """Tool-response rounds."""

    @classmethod
    def build(cls, toolset: ToolSet, parser: str, options: dict[str, Any]) -> ToolAgentSettings:
        allowed = {f.name for f in dataclasses.fields(cls)} - {"toolset", "parser"}
        unknown = set(options) - allowed
        if unknown:
            raise ValueError(f"rollout.tool_agent: unknown option(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
        settings = cls(toolset=toolset, parser=get_parser(parser, toolset.schemas), **options)
        if settings.truncate_side not in ("left", "right", "middle"):
            raise ValueError(f"rollout.tool_agent.truncate_side must be left, right or middle, got {settings.truncate_side!r}")
        if settings.truncate_unit not in ("chars", "tokens"):
            raise ValueError(f"rollout.tool_agent.truncate_unit must be chars or tokens, got {settings.truncate_unit!r}")
        return settings


def truncate(text: str, limit: int, side: str, tokenizer: Any = None) -> str:
    """Cut `text` to `limit` characters (or tokens with a tokenizer) on `side`, saying how much was cut."""
    units = tokenizer(text, add_special_tokens=False)["input_ids"] if tokenizer is not None else text
    if len(units) <= limit:
        return text
    cut = len(units) - limit
    unit = "tokens" if tokenizer is not None else "characters"
    join = tokenizer.decode if tokenizer is not None else "".join
    marker = f"...({cut} {unit} truncated)..."
    if side == "left":
        return marker + join(units[cut:])
    if side == "right":
        return join(units[:limit]) + marker
    head = limit - limit // 2
    return join(units[:head]) + marker + join(units[len(units) - limit // 2:])


class ToolEnv:
    """An environment whose observations are tool results (see the module docstring)."""

    def __init__(self, settings: ToolAgentSettings, session: Any, tokenizer: Any = None, toolset: ToolSet | None = None):
        self.settings, self.session, self.tokenizer = settings, session, tokenizer
        self.tools = (toolset or settings.toolset).schemas  # the driver renders these into the prompt
        self.invalid_streak = 0
        self.user_turns = 0
        self.stats: dict[str, Any] = {"calls": {}, "errors": 0, "invalid_turns": 0, "attempts": 0}

    def reset(self) -> None:
        return None

    async def step(self, text: str) -> StepResult:
        s = self.settings
        parsed = s.parser.parse(text)
        if not parsed.calls and not parsed.errors:
            return StepResult(done=True, termination_reason=TerminationReason.NO_TOOL_CALL,
                              info={"final_answer": parsed.content})
        self.invalid_streak = self.invalid_streak + 1 if not parsed.calls else 0
        if not parsed.calls:
            self.stats["invalid_turns"] += 1
        if self.invalid_streak >= s.max_invalid_calls:
            return StepResult(done=True, termination_reason=TerminationReason.INVALID_CALLS,
                              info={"parse_errors": parsed.errors})
        run, skipped = parsed.calls[: s.max_parallel_calls], parsed.calls[s.max_parallel_calls:]
        results = await asyncio.gather(*(self._run(call) for call in run))
        messages = [m for m, _ in results]
        records = [r for _, r in results]
        for call in skipped:
            messages.append(self._tool_message(call, f"Error: only {s.max_parallel_calls} tool calls are executed per "
                                                     f"turn; this call to {call.name!r} was skipped. Call it again."))
            records.append({"id": call.id, "name": call.name, "ok": False, "error": "skipped: max_parallel_calls"})
        for error in parsed.errors:
            messages.append({"role": "tool", "content": f"Error: {error}. Call a tool as "
                                                        f"{_call_example(s.parser, self.tools)}"})
            records.append({"ok": False, "error": error})
        self.stats["errors"] += sum(not r.get("ok") for r in records)
        self.stats["attempts"] += len(records)  # executed, skipped and malformed calls
        self.user_turns += 1
        done = s.max_user_turns is not None and self.user_turns >= s.max_user_turns
        reward = sum(r.get("reward", 0.0) for r in records)
        return StepResult(observation=messages, reward=reward, done=done,
                          termination_reason=TerminationReason.MAX_TURNS if done else None,
                          info={"tool_calls": records, "parse_errors": parsed.errors})

    async def _run(self, call: ToolCall) -> tuple[Message, dict[str, Any]]:
        start_ns = time.time_ns()
        record: dict[str, Any] = {"id": call.id, "name": call.name, "arguments": call.arguments, "start_ns": start_ns}
        self.stats["calls"][call.name] = self.stats["calls"].get(call.name, 0) + 1
        with collect_spans() as spans:  # what the tool's `traced` functions did (verl's rollout_trace_op)
            try:
                result = await self.session.call(call, timeout_s=self.settings.tool_timeout_s)
                text = result.text
                record.update(ok=True, reward=result.reward, metrics=result.metrics)
                images = result.images
            except ToolError as e:  # what the model should be told: unknown tool, bad arguments, raised, timed out
                text, images = f"Error: {e}", []
                record.update(ok=False, error=str(e))
        if spans:
            record["spans"] = spans
        record["end_ns"] = time.time_ns()
        record["latency_s"] = (record["end_ns"] - start_ns) / 1e9
        text = truncate(text, self.settings.max_tool_response_length, self.settings.truncate_side,
                        self.tokenizer if self.settings.truncate_unit == "tokens" else None)
        message = self._tool_message(call, text)
        if images:
            message["content"] = [*({"type": "image", "image": im} for im in images), {"type": "text", "text": text}]
            record["images"] = len(images)
        return message, record

    @staticmethod
    def _tool_message(call: ToolCall, text: str) -> Message:
        return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text}

    def format_observation(self, observation: list[Message]) -> list[Message]:
        return observation


def _call_example(parser: ToolCallParser, schemas: list[dict]) -> str:
    name = schemas[0]["function"]["name"] if schemas else "tool_name"
    if type(parser).__name__ == "Qwen3CoderParser":
        return f"<tool_call>\n<function={name}>\n<parameter=arg>\nvalue\n</parameter>\n</function>\n</tool_call>"
    return f'<tool_call>{{"name": "{name}", "arguments": {{...}}}}</tool_call>'


def record_tool_rewards(traj: Trajectory, values: dict[str, Any]) -> None:
    """The numbers among the tools' `calc_reward()` values become `traj.tool_rewards`; the others are kept in
    `traj.info["tool_reward_values"]` and named in a warning (module docstring)."""
    traj.tool_rewards, others = split_tool_rewards(values)
    if others:
        traj.info["tool_reward_values"] = others
        traj.warnings.append(
            f"calc_reward() of tool(s) {', '.join(map(repr, others))} returned no number "
            f"({', '.join(type(v).__name__ for v in others.values())}): not in tool_rewards; the values are in "
            "info.tool_reward_values (verl-signature rewards get them in extra_info['rollout_reward_scores'])")


async def tool_agent(ctx: RolloutContext, sample: dict[str, Any]) -> Trajectory:
    """Run the tool agent on one row. Rows may carry `tools_kwargs` and `tool_selection` (a list of names), as
    columns or under verl's `extra_info` (turnrl.data.row_tools_kwargs)."""
    settings: ToolAgentSettings | None = ctx.tools
    if settings is None:
        raise ValueError("agent 'tool_agent' needs tools: pass --tools FILE.py|FILE.yaml")
    toolset = settings.toolset
    selection = row_tool_selection(sample)
    if selection:
        toolset = toolset.subset(selection)
    session = toolset.session(row_tools_kwargs(sample))
    env = ToolEnv(settings, session, ctx.renderer.tokenizer, toolset)
    if settings.max_assistant_turns is not None:
        ctx.limits = dataclasses.replace(ctx.limits, max_turns=min(ctx.limits.max_turns, settings.max_assistant_turns))
    traj = None
    try:
        traj = await drive(ctx, env)
        record_tool_rewards(traj, await session.calc_rewards())
    except asyncio.CancelledError:
        raise
    except Exception as e:  # calc_reward raised: the reward would be wrong, so this trajectory fails
        if traj is None:
            raise
        log.info("trajectory %s: calc_reward raised", ctx.trajectory_id, exc_info=True)  # -v
        traj.finish(TerminationReason.ENV_ERROR, error_with_frames(e))
    finally:
        try:
            await session.close()
        except Exception as e:  # release failed: the episode is still valid; say so loudly
            log.warning("trajectory %s: %s", ctx.trajectory_id, e)
            if traj is not None:
                traj.warnings.append(str(e))
    traj.info["tool_stats"] = env.stats
    return traj
