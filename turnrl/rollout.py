"""The turn loop (`drive`), the trajectory builder that enforces the invariants, and the RolloutManager.

`drive` is THE turn loop: every agent style (slime env, verl tool agent, ms-swift scheduler, custom
agent) goes through it or through the same `TrajectoryBuilder`. One turn:

    generate(prompt + response so far)  → model segment (mask 1, sampling logprobs)
    env.step(reply text)                → observation messages, reward, done
    closing + observation delta tokens  → template/env segments (mask 0)

Limits and how a trajectory ends (status / termination reason):
- env says done                                  → COMPLETED / env_done (or the reason the env gives)
- `max_turns` model turns                        → COMPLETED / max_turns
- whole-trajectory `token_budget` used up        → TRUNCATED / token_budget
  (each generate asks for min(max_new_tokens, budget left); an observation that does not fit ends it)
- engine stopped at the per-turn max_new_tokens  → TRUNCATED / length
- env.step raised (after `env_retries` retries)  → FAILED / env_error, message kept
- env.step exceeded `env_timeout_s`              → FAILED / timeout
- engine raised                                  → FAILED / engine_error
- cancelled (shutdown)                           → ABORTED / cancelled
Each ends only its own trajectory; the batch goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import traceback
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from turnrl.data import prompt_messages
from turnrl.engines.base import Engine
from turnrl.envs.base import EnvFactory, as_messages, call, normalise_step, observation_messages
from turnrl.multimodal import ImageBuffer, check_parity, image_ref
from turnrl.render import ChatRenderer, SanityMode
from turnrl.types import (
    FinishReason,
    GenerateOutput,
    Message,
    SamplingParams,
    Segment,
    SegmentSource,
    StepResult,
    TerminationReason,
    Trajectory,
    Turn,
    validate_segment,
)

log = logging.getLogger(__name__)


@dataclass
class RolloutLimits:
    """Per-trajectory limits the driver enforces whatever the env or agent does."""

    max_turns: int = 8
    """Model turns (generate calls) per trajectory."""
    max_new_tokens: int = 256
    """Tokens per generate call."""
    token_budget: int | None = None
    """Tokens after the prompt for the whole trajectory (model tokens + observations); None = unlimited."""
    env_timeout_s: float | None = 60.0
    """Time limit of one env.step (a sync env keeps running in its thread; its result is discarded)."""
    env_retries: int = 0
    """Extra attempts of a failing env.step within one turn (only for envs whose step is safe to repeat)."""
    trajectory_timeout_s: float | None = None
    """Wall-clock limit of a whole trajectory (FAILED/timeout, content so far kept)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1 or None, got {self.token_budget}")


# ---------------------------------------------------------------------------------------------------
# Building a trajectory
# ---------------------------------------------------------------------------------------------------
class TrajectoryBuilder:
    """Appends segments to a trajectory, checking each one as it arrives (masks are born with tokens)."""

    def __init__(self, trajectory: Trajectory):
        self.trajectory = trajectory
        self._ids = list(trajectory.prompt_ids)
        self._response_len = 0
        self.images = ImageBuffer()
        """Both image stores (inference list, training tensors per chunk) of a VLM trajectory."""

    @property
    def token_ids(self) -> list[int]:
        """Prompt + response so far: exactly what the next generate call receives. Do not mutate."""
        return self._ids

    @property
    def response_len(self) -> int:
        return self._response_len

    def add(self, segment: Segment) -> Segment:
        validate_segment(segment, f"trajectory {self.trajectory.id!r} new segment ({segment.source})")
        self.trajectory.segments.append(segment)
        self._ids.extend(segment.token_ids)
        self._response_len += len(segment.token_ids)
        return segment

    def add_model(self, out: GenerateOutput, turn: int, *, extend: bool = False) -> Segment:
        """Append the engine's tokens (mask 1, its logprobs); `extend` continues the last model segment."""
        last = self.trajectory.segments[-1] if self.trajectory.segments else None
        if extend and last is not None and last.source == SegmentSource.MODEL:
            last.token_ids.extend(out.token_ids)
            last.loss_mask.extend([1] * len(out.token_ids))
            if last.logprobs is not None:
                last.logprobs.extend(out.logprobs)
            last.policy_version = out.policy_version
            self._ids.extend(out.token_ids)
            self._response_len += len(out.token_ids)
            return last
        return self.add(Segment(
            SegmentSource.MODEL, list(out.token_ids), [1] * len(out.token_ids), list(out.logprobs), turn,
            out.policy_version,
        ))

    def replace_last_model_tokens(self, n_old: int, token_ids: list[int], loss_mask: list[int],
                                  logprobs: list[float | None] | None) -> None:
        """Swap the last `n_old` tokens of the last model segment for edited ones (a scheduler's `step`)."""
        last = self.trajectory.segments[-1]
        if last.source != SegmentSource.MODEL or n_old > len(last.token_ids):
            raise ValueError(f"trajectory {self.trajectory.id!r}: no model turn of {n_old} tokens to replace")
        keep = len(last.token_ids) - n_old
        old_logprobs = last.logprobs
        last.token_ids[keep:] = token_ids
        last.loss_mask[keep:] = loss_mask
        last.logprobs = None if logprobs is None or old_logprobs is None else old_logprobs[:keep] + list(logprobs)
        validate_segment(last, f"trajectory {self.trajectory.id!r} edited model segment")
        del self._ids[len(self._ids) - n_old:]
        self._ids.extend(token_ids)
        self._response_len += len(token_ids) - n_old

    def add_injected(self, token_ids: Sequence[int], source: SegmentSource, turn: int) -> Segment | None:
        if not token_ids:
            return None
        return self.add(Segment(source, list(token_ids), [0] * len(token_ids), [None] * len(token_ids), turn))

    def extend_model_segment(self, token_ids: Sequence[int], turn: int) -> None:
        """Continuation: injected tokens (mask 0) appended to the current model segment, e.g. a tip."""
        last = self.trajectory.segments[-1] if self.trajectory.segments else None
        if last is None or last.source != SegmentSource.MODEL:
            self.add_injected(token_ids, SegmentSource.TEMPLATE, turn)
            return
        last.token_ids.extend(token_ids)
        last.loss_mask.extend([0] * len(token_ids))
        if last.logprobs is not None:
            last.logprobs.extend([None] * len(token_ids))
        self._ids.extend(token_ids)
        self._response_len += len(token_ids)

    def finish(self, reason: TerminationReason, error: str | None = None) -> Trajectory:
        self.trajectory.finish(reason, error)
        self.trajectory.validate()
        return self.trajectory


@dataclass
class RolloutContext:
    """What an agent gets for one trajectory: shared components plus this trajectory's identity."""

    engine: Engine
    renderer: ChatRenderer
    sampling: SamplingParams
    limits: RolloutLimits
    trajectory_id: str
    group_id: str
    sample_index: int
    sample: dict[str, Any]
    agent_name: str = "env_agent"
    env_factory: EnvFactory | None = None
    env_config: dict[str, Any] = field(default_factory=dict)
    tools: Any = None
    """The agent's ToolSet (turnrl.tools), if any."""
    sanity_mode: SanityMode = SanityMode.STRICT
    partial: Trajectory | None = None
    """Set by `drive` when the trajectory is cancelled, so a timeout keeps the content produced so far."""

    def new_trajectory(self, prompt_ids: list[int], messages: list[Message]) -> TrajectoryBuilder:
        traj = Trajectory(
            id=self.trajectory_id, group_id=self.group_id, sample_index=self.sample_index,
            prompt_ids=list(prompt_ids), messages=messages, sample=self.sample, agent=self.agent_name,
        )
        self.partial = traj
        return TrajectoryBuilder(traj)


class _End(Exception):
    """Ends the turn loop with a reason (raised from helpers deep in a turn)."""

    def __init__(self, reason: TerminationReason, message: str | None = None):
        super().__init__(message or reason)
        self.reason, self.message = reason, message


# ---------------------------------------------------------------------------------------------------
# The turn loop
# ---------------------------------------------------------------------------------------------------
async def drive(ctx: RolloutContext, env: Any, messages: list[Message] | None = None) -> Trajectory:
    """Run one episode of `env` on `ctx.engine` and return the validated trajectory (see module docstring)."""
    t_start = time.perf_counter()
    messages = list(messages) if messages is not None else prompt_messages(ctx.sample)
    tools = getattr(env, "tools", None)
    timing = {"gen_time_s": 0.0, "env_time_s": 0.0, "env_retries": 0, "cached_prompt_tokens": 0}
    builder: TrajectoryBuilder | None = None
    try:
        if hasattr(env, "reset"):
            extra = await call(env.reset)
            if isinstance(extra, dict | list):  # slime's reset returns (obs, info), which it ignores
                messages += as_messages(extra, "env.reset")
        prompt = ctx.renderer.initial(messages, tools)
        builder = ctx.new_trajectory(prompt.ids, messages)
        builder.images.add(prompt)
        try:
            reason = await _turn_loop(ctx, env, builder, messages, tools, timing)
            traj = builder.finish(reason)
        except _End as end:
            traj = builder.finish(end.reason, end.message)
        except asyncio.CancelledError:
            builder.finish(TerminationReason.CANCELLED, "cancelled")
            raise
    except asyncio.CancelledError:
        raise
    except Exception as e:  # env.reset, rendering: this trajectory fails, never the batch
        traj = _failed(ctx, builder, TerminationReason.ENV_ERROR, e)
    finally:
        await _cleanup(ctx, env)
        if builder is not None:
            _record(builder.trajectory, timing, t_start)
    if builder is not None and builder.images.chunks:
        _attach_images(ctx, builder)
    _sanity_check(ctx, traj, messages, tools)
    return traj


def _attach_images(ctx: RolloutContext, b: TrajectoryBuilder) -> None:
    """Merge the training tensors once per key and run the parity checks; a violation fails the trajectory."""
    traj = b.trajectory
    merged = b.images.merged()
    problem = check_parity(b.token_ids, b.images, merged, ctx.renderer)
    traj.images = [image_ref(im) for im in b.images.images]
    if problem is not None:
        log.warning("trajectory %s: multimodal parity check failed: %s", traj.id, problem)
        traj.finish(TerminationReason.PARITY_ERROR, problem)
        return
    traj.mm_train_inputs = merged


async def _turn_loop(
    ctx: RolloutContext, env: Any, b: TrajectoryBuilder, messages: list[Message], tools: Any, timing: dict
) -> TerminationReason:
    limits, traj = ctx.limits, b.trajectory
    stop_ids = tuple(sorted(set(ctx.sampling.stop_token_ids) | ctx.renderer.end_of_turn_ids))
    continuing = False
    for turn in range(1, limits.max_turns + 1):
        budget_left = None if limits.token_budget is None else limits.token_budget - b.response_len
        if budget_left is not None and budget_left <= 0:
            return TerminationReason.TOKEN_BUDGET
        max_new = limits.max_new_tokens if budget_left is None else min(limits.max_new_tokens, budget_left)
        params = dataclasses.replace(ctx.sampling, max_new_tokens=max_new, stop_token_ids=stop_ids,
                                     seed=derive_seed(ctx.sampling.seed, ctx.trajectory_id, turn))
        record: dict[str, Any] = {"turn": turn}
        traj.info.setdefault("turns", []).append(record)  # the trace of this turn (docs/trajectory-format.md)
        out = await _generate(ctx, b, params, timing, record)
        prefill = "" if continuing else ctx.renderer.prefill_of(b.token_ids)  # issue 15: e.g. "<think>\n" opens the turn
        b.add_model(out, turn, extend=continuing)
        traj.num_turns = turn
        text = ctx.renderer.assistant_text(out.token_ids)
        if continuing:
            messages[-1]["content"] += text
        else:
            messages.append({"role": "assistant", "content": prefill + text})
        if out.finish_reason == FinishReason.ABORT:
            return TerminationReason.CANCELLED
        length_reason = TerminationReason.LENGTH if max_new == limits.max_new_tokens else TerminationReason.TOKEN_BUDGET
        turn_aware = hasattr(env, "step_turn")  # schedulers see tokens and decide themselves on a length stop
        if out.finish_reason == FinishReason.LENGTH and not turn_aware:
            return length_reason
        step = await _env_step(env, Turn(turn, text, out.token_ids, out.logprobs, out.finish_reason) if turn_aware
                               else text, limits, timing, record)
        edited = _apply_step_edits(b, out, step)
        if edited is not None:  # the assistant message shows the edited tokens
            content = messages[-1]["content"]
            messages[-1]["content"] = content[: len(content) - len(text)] + ctx.renderer.assistant_text(edited)
        if step.reward is not None:
            traj.turn_rewards.append(float(step.reward))
        if step.done:
            if step.termination_reason is None and out.finish_reason == FinishReason.LENGTH:
                return length_reason
            return step.termination_reason or TerminationReason.ENV_DONE
        if turn == limits.max_turns:
            return TerminationReason.MAX_TURNS
        continuing = step.continuation
        if continuing:  # e.g. a tip appended to the assistant message: mask 0, same segment, same message
            tip = step.observation or ""
            if not isinstance(tip, str):
                raise _End(TerminationReason.INVALID_OUTPUT, "a continuation observation must be a string")
            tip_ids = ctx.renderer.encode(tip) if tip else []
            if limits.token_budget is not None and b.response_len + len(tip_ids) >= limits.token_budget:
                return TerminationReason.TOKEN_BUDGET
            b.extend_model_segment(tip_ids, turn)
            messages[-1]["content"] += tip
            continue
        observation = await observation_messages(env, step.observation)
        if not observation:
            raise _End(TerminationReason.ENV_ERROR, "env.step returned done=False without an observation")
        closing = ctx.renderer.turn_closing_ids(b.trajectory.segments[-1].token_ids)
        rendered = ctx.renderer.observation(observation, tools, history=messages)  # issue 15: stateful templates
        obs_ids = rendered.ids
        if limits.token_budget is not None and b.response_len + len(closing) + len(obs_ids) >= limits.token_budget:
            return TerminationReason.TOKEN_BUDGET
        source = SegmentSource.TOOL if any(m.get("role") == "tool" for m in observation) else SegmentSource.ENV
        b.add_injected(closing, SegmentSource.TEMPLATE, turn)
        b.add_injected(obs_ids[: len(obs_ids) - len(rendered.prefill_ids)], source, turn)
        b.add_injected(rendered.prefill_ids, SegmentSource.TEMPLATE, turn)  # issue 15: the pre-fill, its own segment
        b.images.add(rendered)
        record["observation_tokens"] = len(closing) + len(obs_ids)
        messages.extend(observation)
    return TerminationReason.MAX_TURNS


async def _generate(
    ctx: RolloutContext, b: TrajectoryBuilder, params: SamplingParams, timing: dict, record: dict
) -> GenerateOutput:
    t0, start_ns = time.perf_counter(), time.time_ns()
    try:
        out = await ctx.engine.generate(b.token_ids, params, request_id=ctx.trajectory_id,
                                        images=list(b.images.images) or None)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        record["generate"] = {"start_ns": start_ns, "end_ns": time.time_ns(), "error": f"{type(e).__name__}: {e}"}
        raise _End(TerminationReason.ENGINE_ERROR, f"{type(e).__name__}: {e}") from e
    finally:
        timing["gen_time_s"] += time.perf_counter() - t0
    record["generate"] = {
        "start_ns": start_ns, "end_ns": time.time_ns(), "prompt_tokens": len(b.token_ids),
        "cached_prompt_tokens": out.cached_prompt_tokens, "tokens": len(out.token_ids),
        "finish_reason": str(out.finish_reason), "policy_version": out.policy_version,
    }
    if not out.token_ids:
        raise _End(TerminationReason.ENGINE_ERROR, "engine returned no tokens")
    timing["cached_prompt_tokens"] += out.cached_prompt_tokens
    return out


async def _env_step(env: Any, text: str | Turn, limits: RolloutLimits, timing: dict, record: dict) -> StepResult:
    error: BaseException | None = None
    start_ns = time.time_ns()
    for attempt in range(limits.env_retries + 1):
        t0 = time.perf_counter()
        try:
            step_fn = env.step_turn if isinstance(text, Turn) else env.step  # turn-aware envs get the Turn
            step = normalise_step(await asyncio.wait_for(call(step_fn, text), limits.env_timeout_s))
            record["env"] = {"start_ns": start_ns, "end_ns": time.time_ns(), "attempts": attempt + 1,
                             "reward": step.reward, "done": step.done, "info": step.info}
            return step
        except TimeoutError:
            error = TimeoutError(f"env.step exceeded env_timeout_s={limits.env_timeout_s}")
        except Exception as e:
            error = e
        finally:
            timing["env_time_s"] += time.perf_counter() - t0
        if attempt < limits.env_retries:
            timing["env_retries"] += 1
            log.warning("env.step failed (%s); retry %d of %d", error, attempt + 1, limits.env_retries)
    message = f"{type(error).__name__}: {error}"
    record["env"] = {"start_ns": start_ns, "end_ns": time.time_ns(), "attempts": limits.env_retries + 1,
                     "error": message}
    reason = TerminationReason.TIMEOUT if isinstance(error, TimeoutError) else TerminationReason.ENV_ERROR
    raise _End(reason, message)


def _apply_step_edits(b: TrajectoryBuilder, out: GenerateOutput, step: StepResult) -> list[int] | None:
    """Apply a scheduler's token edits and rollout infos. Token rules (ms-swift's, but loud): ids and mask of
    equal length with values in {0, 1}, else the trajectory fails; one logprob per mask-1 token, else
    importance correction is switched off for this trajectory only, and the trajectory says so."""
    traj = b.trajectory
    if step.rollout_infos:
        traj.info.setdefault("rollout_infos", {}).update(step.rollout_infos)
    if step.response_token_ids is None and step.response_loss_mask is None and step.rollout_logprobs is None:
        return None
    ids = list(step.response_token_ids if step.response_token_ids is not None else out.token_ids)
    mask = list(step.response_loss_mask if step.response_loss_mask is not None else [1] * len(ids))
    if len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
        raise _End(TerminationReason.INVALID_OUTPUT,
                   f"trajectory {traj.id!r} turn {traj.num_turns}: response_token_ids has {len(ids)} tokens and "
                   f"response_loss_mask {len(mask)} values {sorted(set(mask))}; they must have equal length and "
                   "values in {0, 1}")
    n_trained = sum(mask)
    logprobs: list[float] | None = None
    issue = None
    if step.rollout_logprobs is not None:
        if len(step.rollout_logprobs) == n_trained:
            logprobs = list(step.rollout_logprobs)
        else:
            issue = f"rollout_logprobs has {len(step.rollout_logprobs)} values for {n_trained} mask-1 tokens"
    elif ids[:n_trained] == out.token_ids[:n_trained] and all(mask[:n_trained]):
        logprobs = list(out.logprobs[:n_trained])  # a cut of the engine's own tokens keeps their logprobs
    else:
        issue = f"{n_trained} mask-1 tokens are not the engine's own tokens and no rollout_logprobs were given"
    aligned = None
    if logprobs is not None:
        it = iter(logprobs)
        aligned = [next(it) if m else None for m in mask]
    if issue is not None:
        log.warning("trajectory %s turn %d: %s; importance-sampling correction is off for this trajectory",
                    traj.id, traj.num_turns, issue)
        traj.info.setdefault("logprob_issues", []).append(f"turn {traj.num_turns}: {issue}")
        traj.metrics["logprob_issues"] = traj.metrics.get("logprob_issues", 0) + 1
    b.replace_last_model_tokens(len(out.token_ids), ids, mask, aligned)
    return ids


def derive_seed(base: int | None, trajectory_id: str, turn: int) -> int | None:
    """A per-call seed from the run seed: the same trajectory id and turn always sample the same way."""
    return None if base is None else zlib.crc32(f"{base}/{trajectory_id}/{turn}".encode())


def _failed(ctx: RolloutContext, builder: TrajectoryBuilder | None, reason: TerminationReason, e: BaseException) -> Trajectory:
    log.warning("trajectory %s failed: %s", ctx.trajectory_id, e)
    message = f"{type(e).__name__}: {e}"
    if builder is None:
        traj = Trajectory(id=ctx.trajectory_id, group_id=ctx.group_id, sample_index=ctx.sample_index,
                          prompt_ids=[], sample=ctx.sample, agent=ctx.agent_name)
        traj.finish(reason, message)
        return traj
    return builder.finish(reason, message)


async def _cleanup(ctx: RolloutContext, env: Any) -> None:
    if hasattr(env, "close"):
        try:
            await call(env.close)
        except Exception as e:
            log.warning("trajectory %s: env.close raised %r", ctx.trajectory_id, e)
    try:
        await ctx.engine.release(ctx.trajectory_id)
    except Exception as e:  # releasing a cache entry must never fail a finished trajectory
        log.warning("trajectory %s: engine.release raised %r", ctx.trajectory_id, e)


def _record(traj: Trajectory, timing: dict, t_start: float) -> None:
    traj.metrics.update(timing)
    traj.metrics["total_time_s"] = time.perf_counter() - t_start
    traj.metrics["model_tokens"] = traj.num_model_tokens
    traj.metrics["injected_tokens"] = traj.num_response_tokens - traj.num_model_tokens


def _sanity_check(ctx: RolloutContext, traj: Trajectory, messages: list[Message], tools: Any) -> None:
    if ctx.sanity_mode == SanityMode.DISABLE or not traj.prompt_ids:
        return
    check = ctx.renderer.check(traj.prompt_ids + traj.response_ids, messages, tools, ctx.sanity_mode)
    traj.metrics["render_mismatch"] = 0.0 if check.ok else 1.0
    if not check.ok:
        traj.info["render_check"] = {"mode": str(ctx.sanity_mode), "strippable": check.strippable, "diff": check.diff}
        _RENDER_WARNINGS["count"] += 1
        if _RENDER_WARNINGS["count"] <= _RENDER_WARNINGS["limit"]:
            log.warning(
                "trajectory %s: token stream differs from a full re-render (%s mode; %s)%s\n%s", traj.id,
                ctx.sanity_mode, "only reasoning/whitespace differs" if check.strippable else "content differs",
                "; further mismatches are only counted (metric render_mismatch, info.render_check)"
                if _RENDER_WARNINGS["count"] == _RENDER_WARNINGS["limit"] else "", check.diff,
            )


_RENDER_WARNINGS = {"count": 0, "limit": 3}


# ---------------------------------------------------------------------------------------------------
# Many trajectories at once
# ---------------------------------------------------------------------------------------------------
Agent = Callable[[RolloutContext, dict[str, Any]], Awaitable[Trajectory | list[Trajectory]]]
RewardFn = Callable[[Trajectory], Any]


class RolloutManager:
    """Runs rows × n trajectories concurrently (one task each, bounded), streaming them as they finish.

    Each row picks its agent by `agent_name` (else `default_agent`). Rewards are computed as each
    trajectory finishes, while the others are still generating. A failing agent, env or reward function
    ends only its own trajectory.
    """

    def __init__(
        self,
        engine: Engine,
        renderer: ChatRenderer,
        *,
        agents: dict[str, Agent],
        default_agent: str = "env_agent",
        sampling: SamplingParams | None = None,
        limits: RolloutLimits | None = None,
        env_factory: EnvFactory | None = None,
        env_config: dict[str, Any] | None = None,
        tools: Any = None,
        concurrency: int = 64,
        sanity_mode: SanityMode | str = SanityMode.STRICT,
        reward_fn: RewardFn | None = None,
    ):
        if default_agent not in agents:
            raise ValueError(f"unknown default agent {default_agent!r}; registered: {sorted(agents)}")
        self.engine, self.renderer, self.agents, self.default_agent = engine, renderer, agents, default_agent
        self.sampling = sampling or SamplingParams()
        self.limits = limits or RolloutLimits()
        self.env_factory, self.env_config, self.tools = env_factory, dict(env_config or {}), tools
        self.concurrency, self.sanity_mode, self.reward_fn = concurrency, SanityMode(sanity_mode), reward_fn

    def context(self, row: dict[str, Any], trajectory_id: str, group_id: str, sample_index: int,
                sampling: SamplingParams | None = None) -> RolloutContext:
        agent_name = row.get("agent_name") or self.default_agent
        if agent_name not in self.agents:
            raise ValueError(f"row {group_id}: unknown agent_name {agent_name!r}; registered: {sorted(self.agents)}")
        return RolloutContext(
            engine=self.engine, renderer=self.renderer, sampling=sampling or self.sampling, limits=self.limits,
            trajectory_id=trajectory_id, group_id=group_id, sample_index=sample_index, sample=row,
            agent_name=agent_name, env_factory=self.env_factory, env_config=self.env_config, tools=self.tools,
            sanity_mode=self.sanity_mode,
        )

    async def stream(
        self, rows: Sequence[dict[str, Any]], n: int = 1, *, id_prefix: str = "",
        sampling: SamplingParams | None = None, row_group_ids: Sequence[str] | None = None,
    ) -> AsyncIterator[Trajectory]:
        """Yield trajectories as they finish (rewards already computed). `row_group_ids` replaces the ids
        derived from the rows: a Ray rollout worker gets its shard's ids from the driver, so trajectory ids
        (and the sampling seeds derived from them) are those of a single-process run."""
        semaphore = asyncio.Semaphore(self.concurrency)
        groups = group_ids(rows, id_prefix) if row_group_ids is None else list(row_group_ids)
        contexts = [
            self.context(row, f"{group}-{k}", group, k, sampling)
            for row, group in zip(rows, groups, strict=True) for k in range(n)
        ]
        tasks = [asyncio.create_task(self._run_one(ctx, semaphore)) for ctx in contexts]
        try:
            for next_done in asyncio.as_completed(tasks):
                for traj in await next_done:
                    yield traj
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run_groups(
        self, rows: Sequence[dict[str, Any]], n: int = 1, *, id_prefix: str = "",
        sampling: SamplingParams | None = None, on_trajectory: Callable[[Trajectory], None] | None = None,
    ) -> list[list[Trajectory]]:
        """All trajectories grouped by prompt, in row order (each group sorted by sample index)."""
        return await collect_groups(self.stream(rows, n, id_prefix=id_prefix, sampling=sampling), rows, id_prefix,
                                    on_trajectory)

    async def _run_one(self, ctx: RolloutContext, semaphore: asyncio.Semaphore) -> list[Trajectory]:
        async with semaphore:
            agent = self.agents[ctx.agent_name]
            try:
                result = await asyncio.wait_for(agent(ctx, ctx.sample), ctx.limits.trajectory_timeout_s)
                trajs = result if isinstance(result, list) else [result]
            except TimeoutError:
                trajs = [_timed_out(ctx)]
            except Exception as e:  # a broken agent fails its trajectory, never the batch
                log.warning("agent %s raised on %s:\n%s", ctx.agent_name, ctx.trajectory_id, traceback.format_exc())
                trajs = [_failed(ctx, None, TerminationReason.ENV_ERROR, e)]
            for traj in trajs:
                await self._score(traj)
            return trajs

    async def _score(self, traj: Trajectory) -> None:
        if self.reward_fn is None or traj.reward is not None:
            return
        try:
            traj.reward = await _maybe_await(self.reward_fn(traj))
        except Exception as e:  # never score a crash as 0.0: leave it None and say so
            traj.info["reward_error"] = f"{type(e).__name__}: {e}"
            log.warning("reward function raised on %s: %r", traj.id, e)


def _timed_out(ctx: RolloutContext) -> Trajectory:
    traj = ctx.partial
    message = f"trajectory exceeded trajectory_timeout_s={ctx.limits.trajectory_timeout_s}"
    if traj is None:
        return _failed(ctx, None, TerminationReason.TIMEOUT, TimeoutError(message))
    traj.finish(TerminationReason.TIMEOUT, message)
    return traj


async def _maybe_await(value: Any) -> Any:
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        return await value
    return value


class Rollout(Protocol):
    """What the trainer needs from whatever runs its rollouts: a local RolloutManager, a RayRollout
    (turnrl.dist.ray) or a RemoteRollout (turnrl.remote, a `turnrl serve` rollout server)."""

    engine: Engine
    renderer: ChatRenderer
    sampling: SamplingParams

    def stream(self, rows: Sequence[dict[str, Any]], n: int = 1, *, id_prefix: str = "",
               sampling: SamplingParams | None = None) -> AsyncIterator[Trajectory]: ...

    async def run_groups(self, rows: Sequence[dict[str, Any]], n: int = 1, *, id_prefix: str = "",
                         sampling: SamplingParams | None = None,
                         on_trajectory: Callable[[Trajectory], None] | None = None) -> list[list[Trajectory]]: ...


async def collect_groups(
    stream: AsyncIterator[Trajectory], rows: Sequence[dict[str, Any]], id_prefix: str = "",
    on_trajectory: Callable[[Trajectory], None] | None = None,
) -> list[list[Trajectory]]:
    """Trajectories of a stream grouped by prompt, in row order, each group sorted by sample index."""
    groups: dict[str, list[Trajectory]] = {}
    async for traj in stream:
        groups.setdefault(traj.group_id, []).append(traj)
        if on_trajectory is not None:
            on_trajectory(traj)
    return [sorted(groups.get(g, []), key=lambda t: (t.sample_index, t.id)) for g in group_ids(rows, id_prefix)]


def group_ids(rows: Sequence[dict[str, Any]], id_prefix: str = "") -> list[str]:
    """One id per row: its `id` column (else its index), with `#k` added when a row repeats in a batch."""
    seen: dict[str, int] = {}
    out = []
    for i, row in enumerate(rows):
        base = f"{id_prefix}{row.get('id', i)}"
        seen[base] = seen.get(base, 0) + 1
        out.append(base if seen[base] == 1 else f"{base}#{seen[base] - 1}")
    return out
