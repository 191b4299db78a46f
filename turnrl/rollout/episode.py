"""The turn loop (`drive`) and the `Episode` whose steps it runs.

`drive` is THE turn loop: every agent style (slime env, verl tool agent, ms-swift scheduler, custom
agent) goes through it or through the same `Episode` and `TrajectoryBuilder`. One turn:

    generate(prompt + response so far)  → model segment (mask 1, sampling logprobs)
    env.step(reply text)                → observation messages, reward, done   (token-aware envs: the Turn)
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
- token edits that break the invariants          → FAILED / invalid_output
- cancelled (shutdown)                           → ABORTED / cancelled
Each ends only its own trajectory; the batch goes on. Inside an episode every ending is an `EpisodeEnd`
raised by the step that found it and caught once, in `drive`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from turnrl.data import prompt_messages
from turnrl.engines.base import Engine
from turnrl.envs.base import (
    Env,
    EnvError,
    EnvFactory,
    EnvStepError,
    EnvThreads,
    EpisodeEnv,
    TurnEnv,
    error_with_frames,
)
from turnrl.moe import merge_routing
from turnrl.multimodal import check_parity, image_ref
from turnrl.observe.watchdog import Detail, Watchdog, abandon_after, engine_label
from turnrl.render import ChatRenderer, SanityMode
from turnrl.rollout.builder import TokenEditError, TrajectoryBuilder
from turnrl.rollout.context import ContextPolicy, Strategy, after_summary, drop_observations
from turnrl.rollout.tree import branch
from turnrl.types import (
    BranchKind,
    EnvSpan,
    FinishReason,
    GenerateOutput,
    GenerateSpan,
    Message,
    SamplingParams,
    SegmentSource,
    StepResult,
    TerminationReason,
    Trajectory,
    Turn,
    TurnRecord,
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
    cleanup_timeout_s: float = 10.0
    """Bound on each cleanup call of a finished trajectory (env.close, engine.release): a hung env or engine
    never holds a finished trajectory, or a cancelled one, forever."""
    context: ContextPolicy = field(default_factory=ContextPolicy)
    """The context window of one branch and what to do when it is full (`rollout.context`, turnrl.rollout.context)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1 or None, got {self.token_budget}")


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
    sanity_check_every: int = 1
    """Check every trajectory (1), or N > 1: the first `SANITY_CHECK_FIRST` of the process, then those whose id
    hashes to 0 mod N (`should_check`; rollout.sanity_check_every)."""
    env_threads: EnvThreads | None = None
    """Where sync env methods run (the RolloutManager's, sized to its concurrency)."""
    partial: Trajectory | None = None
    """Set by `drive` when the trajectory is cancelled, so a timeout keeps the content produced so far."""
    branches: list[Trajectory] = field(default_factory=list)
    """The episode's finished earlier branches (compactions), in order: the RolloutManager returns them with what the
    agent returns."""
    watchdog: Watchdog | None = None
    """The run's watchdog (turnrl.observe.watchdog): engine and env calls report to it through `watch`."""

    def watch(self, component: str, detail: Detail = "") -> contextlib.AbstractContextManager[None]:
        """A call in progress: shown by the watchdog's report if nothing progresses, progress when it ends."""
        return self.watchdog.busy(component, detail) if self.watchdog is not None else contextlib.nullcontext()

    def new_trajectory(self, prompt_ids: list[int], messages: list[Message], trajectory_id: str | None = None
                       ) -> TrajectoryBuilder:
        traj = Trajectory(
            id=trajectory_id or self.trajectory_id, group_id=self.group_id, sample_index=self.sample_index,
            prompt_ids=list(prompt_ids), messages=messages, sample=self.sample, agent=self.agent_name,
        )
        self.partial = traj
        return TrajectoryBuilder(traj)

    def failed(self, reason: TerminationReason, error: BaseException | str) -> Trajectory:
        """A trajectory that failed before it had a prompt (the agent or env factory raised)."""
        message = error if isinstance(error, str) else error_with_frames(error)
        traj = Trajectory(id=self.trajectory_id, group_id=self.group_id, sample_index=self.sample_index,
                          prompt_ids=[], sample=self.sample, agent=self.agent_name)
        traj.finish(reason, message)
        return traj


# ---------------------------------------------------------------------------------------------------
# The turn loop
# ---------------------------------------------------------------------------------------------------
async def drive(ctx: RolloutContext, env: Env | TurnEnv | EpisodeEnv, messages: list[Message] | None = None
                ) -> Trajectory:
    """Run one episode of `env` on `ctx.engine` and return the validated trajectory (see module docstring)."""
    episode = Episode(ctx)
    try:
        limits = ctx.limits
        await episode.start(EpisodeEnv.of(env, limits.env_timeout_s, limits.env_retries, ctx.env_threads), messages)
        episode.end(await _turn_loop(episode))
    except EpisodeEnd as end:
        episode.end(end.reason, end.message)
    except asyncio.CancelledError:  # no error text: a trajectory timeout that cancelled us will give its own
        episode.end(TerminationReason.CANCELLED)
        raise
    except Exception as e:  # env.reset, env factory output, rendering: this trajectory fails, never the batch
        log.info("trajectory %s: %s raised", ctx.trajectory_id, type(e).__name__, exc_info=True)  # -v
        episode.end(TerminationReason.ENV_ERROR, error_with_frames(e))
    finally:
        await episode.close()
    return episode.result()


async def _turn_loop(ep: Episode) -> TerminationReason:
    for n in range(1, ep.limits.max_turns + 1):
        turn = await ep.generate(n)
        if turn.finish_reason == FinishReason.LENGTH and not ep.env.token_aware:
            return ep.length_reason  # plain envs never see a cut-off reply; token-aware ones decide themselves
        step = await ep.step_env(turn)
        ep.apply(step)
        if step.done:
            return ep.done_reason(step)
        if n < ep.limits.max_turns:
            await ep.observe(step)
    return TerminationReason.MAX_TURNS


class EpisodeEnd(Exception):
    """Ends an episode with a reason: raised by the `Episode` step that found it, caught once by its driver."""

    def __init__(self, reason: TerminationReason, message: str | None = None):
        super().__init__(message or reason)
        self.reason, self.message = reason, message


class Episode:
    """One trajectory being driven: the steps `drive` loops over, and that a scheduler's `run()` takes one by one
    (turnrl.agents.scheduler). It owns the builder, the conversation as the token stream holds it, and the
    budget arithmetic (`room`)."""

    def __init__(self, ctx: RolloutContext):
        self.ctx, self.limits = ctx, ctx.limits
        self._env: EpisodeEnv | None = None
        self._builder: TrajectoryBuilder | None = None
        self.messages: list[Message] = []
        """The conversation exactly as the token stream holds it (the trajectory's `messages`)."""
        self.continuing = False
        self.length_reason = TerminationReason.LENGTH
        """How a length stop of the last turn ends the episode: length, or token_budget when the budget cut it."""
        self._last: Turn | None = None
        self._early: Trajectory | None = None  # a trajectory that ended before its prompt was rendered
        self._stop_ids = tuple(sorted(set(ctx.sampling.stop_token_ids) | ctx.renderer.end_of_turn_ids))
        self._params: tuple[tuple, SamplingParams] | None = None  # the last turn's call settings, reused while they apply
        self._metrics = {"gen_time_s": 0.0, "env_time_s": 0.0, "env_retries": 0, "cached_prompt_tokens": 0}
        self._t0 = time.perf_counter()
        self._first_messages: list[Message] = []  # the episode's prompt messages (a summary branch starts from them)
        self._offset = 0  # model turns of the episode before this branch (its turn n is the episode's offset + n)
        self._spent = 0  # response tokens of the episode's earlier branches (the token budget counts across them)

    @property
    def started(self) -> bool:
        return self._builder is not None

    @property
    def builder(self) -> TrajectoryBuilder:
        assert self._builder is not None, "Episode.start() first"
        return self._builder

    @property
    def env(self) -> EpisodeEnv:
        assert self._env is not None, "Episode.start() first"
        return self._env

    @property
    def trajectory(self) -> Trajectory:
        return self.builder.trajectory

    @property
    def last_turn(self) -> Turn:
        assert self._last is not None, "Episode.generate() first"
        return self._last

    async def start(self, env: EpisodeEnv, messages: list[Message] | None = None) -> None:
        """Reset the env and render the prompt (its messages, the env's extra ones, its tools)."""
        self._env = env
        self.messages = list(messages) if messages is not None else \
            prompt_messages(self.ctx.sample, required=not env.opens_episode)
        self.messages += await env.reset()
        if not self.messages:
            raise EnvError(f"{env.name}: the row has no prompt and reset() gave no message to open the episode with")
        self._first_messages = list(self.messages)
        prompt = self.ctx.renderer.initial(self.messages, env.tools)
        self._builder = self.ctx.new_trajectory(prompt.ids, self.messages)
        self.builder.images.add(prompt)

    def room(self, window: bool = True) -> int | None:
        """Tokens the stream may still grow by: what is left of the episode's token budget (across its branches) and,
        with `window`, of the branch's context window (`rollout.context.max_tokens`); None: no limit."""
        budget = self.limits.token_budget
        left = [budget - self._spent - self.builder.response_len] if budget is not None else []
        window_left = self.limits.context.room(len(self.builder.token_ids)) if window else None
        return min(left + ([] if window_left is None else [window_left]), default=None)

    async def generate(self, n: int, *, window: bool = True) -> Turn:
        """Model turn `n` of the episode (turn n - offset of this branch): asks for min(max_new_tokens, room), appends
        its tokens (mask 1) and its text. A summary turn (`window` False) is bounded by the token budget only."""
        n_episode, n = n, n - self._offset
        room = self.room(window)
        if room is not None and room <= 0:
            raise EpisodeEnd(TerminationReason.TOKEN_BUDGET)
        max_new = self.limits.max_new_tokens if room is None else min(self.limits.max_new_tokens, room)
        self.length_reason = (TerminationReason.LENGTH if max_new == self.limits.max_new_tokens
                              else TerminationReason.TOKEN_BUDGET)
        seed = derive_seed(self.ctx.sampling.seed, self.trajectory.id, n)
        key = (self.ctx.sampling, max_new, seed)
        if self._params is None or self._params[0] != key:  # else the last turn's (frozen: shared safely)
            self._params = key, dataclasses.replace(self.ctx.sampling, max_new_tokens=max_new,
                                                    stop_token_ids=self._stop_ids, seed=seed)
        params = self._params[1]
        traj = self.trajectory
        traj.turns.append(TurnRecord(n))
        traj.sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
        out = await self._call_engine(params, traj.turns[-1])
        prefill = "" if self.continuing else self.ctx.renderer.prefill_of(self.builder.token_ids)  # e.g. "<think>\n"
        self.builder.add_model(out, n, extend=self.continuing)
        traj.num_turns = n
        text = self.ctx.renderer.assistant_text(out.token_ids)
        if self.continuing:
            self.messages[-1]["content"] += text
        else:  # the message holds what the template pre-filled too: the re-render check sees the same stream
            self.messages.append({"role": "assistant", "content": prefill + text})
        if out.finish_reason == FinishReason.ABORT:
            raise EpisodeEnd(TerminationReason.CANCELLED, "the engine aborted the request")
        self._last = Turn(n_episode, text, out.token_ids, out.logprobs, out.finish_reason, self.messages,
                          self.continuing)
        return self._last

    async def _call_engine(self, params: SamplingParams, record: TurnRecord) -> GenerateOutput:
        ids, images = self.builder.token_ids, list(self.builder.images.images) or None
        span = record.generate = GenerateSpan(time.time_ns(), prompt_tokens=len(ids), seed=params.seed,
                                              max_new_tokens=params.max_new_tokens,
                                              stop_token_ids=list(params.stop_token_ids))
        t0 = time.perf_counter()
        try:
            where = functools.partial(engine_label, self.ctx.engine, self.trajectory.id)  # read only on a stall
            with self.ctx.watch("engine.generate", where):
                out = await self._generate_through_updates(ids, params, images)
        except Exception as e:
            span.error = f"{type(e).__name__}: {e}"
            raise EpisodeEnd(TerminationReason.ENGINE_ERROR, span.error) from e
        finally:
            span.end_ns = time.time_ns()
            self._metrics["gen_time_s"] += time.perf_counter() - t0
        span.cached_prompt_tokens, span.tokens = out.cached_prompt_tokens, len(out.token_ids)
        span.finish_reason, span.policy_version = out.finish_reason, out.policy_version
        if not out.token_ids:
            raise EpisodeEnd(TerminationReason.ENGINE_ERROR, "engine returned no tokens")
        self._metrics["cached_prompt_tokens"] += out.cached_prompt_tokens
        return out

    async def _generate_through_updates(self, ids: list[int], params: SamplingParams, images: list | None
                                        ) -> GenerateOutput:
        """One turn's generate call. A weight update in pause mode `abort` preempts it: the tokens so far are kept
        and prompt + tokens is resubmitted (re-prefilled under the new weights) for the rest of the turn."""
        parts: list[GenerateOutput] = []
        for _ in range(_MAX_RESUBMITS):
            done = sum(len(p.token_ids) for p in parts)
            prompt = ids + [t for p in parts for t in p.token_ids]
            out = await self.ctx.engine.generate(
                prompt, dataclasses.replace(params, max_new_tokens=params.max_new_tokens - done) if done else params,
                request_id=self.trajectory.id, images=images)
            if out.preempted and done + len(out.token_ids) >= params.max_new_tokens:  # it got to its limit anyway
                out = dataclasses.replace(out, finish_reason=FinishReason.LENGTH, preempted=False)
            parts.append(out)
            if not out.preempted:
                return _joined(parts)
        raise EpisodeEnd(TerminationReason.ENGINE_ERROR, f"preempted {_MAX_RESUBMITS} times in one turn")

    async def step_env(self, turn: Turn) -> StepResult:
        """The env's answer to `turn` (retried and timed by the EpisodeEnv), recorded in the turn's trace."""
        span = self.trajectory.turns[-1].env = EnvSpan(time.time_ns())
        t0 = time.perf_counter()
        try:
            with self.ctx.watch("env.step", self.env.name):
                step, span.attempts = await self.env.step(turn)
        except EnvStepError as e:
            span.attempts, span.error = e.attempts, error_with_frames(e.cause) if e.cause is not None else str(e)
            if e.cause is not None and e.cause.__traceback__ is not None:  # the env's own traceback, at -v
                log.info("trajectory %s: %s.step raised", self.ctx.trajectory_id, self.env.name, exc_info=e.cause)
            reason = TerminationReason.TIMEOUT if e.timed_out else TerminationReason.ENV_ERROR
            raise EpisodeEnd(reason, span.error) from None
        finally:
            span.end_ns = time.time_ns()
            self._metrics["env_time_s"] += time.perf_counter() - t0
            self._metrics["env_retries"] += max(span.attempts - 1, 0)
        span.reward, span.done, span.info = step.reward, step.done, step.info
        return step

    def apply(self, step: StepResult) -> None:
        """What a step says about the turn just made: its token edits, rollout infos and reward."""
        traj = self.trajectory
        if step.rollout_infos:
            traj.rollout_infos.update(step.rollout_infos)
        if step.edit is not None:
            try:
                ids = self.builder.apply_edit(step.edit, self.last_turn.token_ids, self.last_turn.logprobs)
            except TokenEditError as e:
                raise EpisodeEnd(TerminationReason.INVALID_OUTPUT, str(e)) from None
            traj.turns[-1].edited = True
            content, text = self.messages[-1]["content"], self.last_turn.text  # the message shows the edited tokens
            self.messages[-1]["content"] = content[: len(content) - len(text)] + self.ctx.renderer.assistant_text(ids)
        if step.reward is not None:
            traj.turn_rewards.append(float(step.reward))

    def done_reason(self, step: StepResult) -> TerminationReason:
        if step.termination_reason is None and self.last_turn.finish_reason == FinishReason.LENGTH:
            return self.length_reason
        return step.termination_reason or TerminationReason.ENV_DONE

    async def observe(self, step: StepResult) -> None:
        """Append what the env answered: a continuation of the reply, or an observation delta (mask 0)."""
        self.continuing = step.continuation
        if step.continuation:
            self._continue(step.observation)
            return
        observation = await self.env.observation(step.observation)
        if not observation:
            raise EpisodeEnd(TerminationReason.ENV_ERROR, "env.step returned done=False without an observation")
        closing = self.ctx.renderer.turn_closing_ids(self.trajectory.segments[-1].token_ids)
        rendered = self.ctx.renderer.observation(observation, self.env.tools, history=self.messages)
        strategy = self.limits.context.full(len(self.builder.token_ids) + len(closing) + len(rendered.ids),
                                            self.limits.max_new_tokens, step.compact)
        if strategy is not None:
            await self._compact(strategy, observation, closing, rendered)
            return
        self._append_observation(observation, closing, rendered)

    def _append_observation(self, observation: list[Message], closing: list[int], rendered: Any, fit: bool = True
                            ) -> None:
        b, turn = self.builder, self.trajectory.num_turns
        if fit:
            self._fit(len(closing) + len(rendered.ids))
        source = SegmentSource.TOOL if any(m.get("role") == "tool" for m in observation) else SegmentSource.ENV
        obs_ids = rendered.ids[: len(rendered.ids) - len(rendered.prefill_ids)]
        b.add_injected(closing, SegmentSource.TEMPLATE, turn)
        b.add_injected(obs_ids, source, turn)
        b.add_injected(rendered.prefill_ids, SegmentSource.TEMPLATE, turn)  # what the template opens the turn with
        b.images.add(rendered)
        self.trajectory.turns[-1].observation_tokens = len(closing) + len(rendered.ids)
        self.messages.extend(observation)

    async def _compact(self, strategy: Strategy, observation: list[Message], closing: list[int], rendered: Any
                       ) -> None:
        """Go on in a `compaction` branch (turnrl.rollout.context): after a summary turn of this branch, from the first
        messages, the summary and `observation`; or from the conversation with older outputs dropped. When there is nothing to
        drop, the observation (`closing`, `rendered`: as `observe` rendered it) is appended here (the token budget and
        context window still bound it)."""
        policy, tools = self.limits.context, self.env.tools
        if strategy == Strategy.DROP_OBSERVATIONS:
            messages = drop_observations([*self.messages, *observation], policy.keep_last_turns)
            if messages is None:
                self._append_observation(observation, closing, rendered)
                return
        else:  # the summary of the work before this observation; the next branch gets it whole after the summary
            asked = [policy.request()]
            request = self.ctx.renderer.observation(asked, tools, history=self.messages)
            self._fit(len(closing) + len(request.ids), window=False)
            self._append_observation(asked, closing, request, fit=False)
            summary = await self.generate(self._offset + self.trajectory.num_turns + 1, window=False)
            self.trajectory.turns[-1].extra["compaction"] = "summary"
            messages = after_summary(self._first_messages, summary.text, observation)
        await self._branch_off(messages, BranchKind.COMPACTION)

    async def _branch_off(self, messages: list[Message], kind: BranchKind) -> None:
        """End this branch (TerminationReason.SPLIT) and go on in a new trajectory of the episode rendered from
        `messages`, a `kind` branch of this one (its id `<episode's first id>.c<k>`)."""
        old = self.trajectory
        self.end(TerminationReason.SPLIT)
        self._seal()
        self.ctx.branches.append(old)
        await self._release(old.id)
        self._offset += old.num_turns - (1 if old.turns and old.turns[-1].extra.get("compaction") else 0)
        self._spent += old.num_response_tokens
        self.messages, self.continuing = messages, False
        prompt = self.ctx.renderer.initial(messages, self.env.tools)
        new_id = f"{self.ctx.trajectory_id}.c{len(self.ctx.branches)}"
        self._builder = self.ctx.new_trajectory(prompt.ids, messages, new_id)
        self.builder.images.add(prompt)
        branch(self.trajectory, old, kind)
        log.info("trajectory %s: context compacted (%s tokens) into %s", old.id, len(old.stream), new_id)

    def _continue(self, tip: Any) -> None:
        """A tip appended to the assistant message: mask 0, same segment, same message, no generation prompt."""
        if not isinstance(tip, str):
            raise EpisodeEnd(TerminationReason.INVALID_OUTPUT, "a continuation observation must be a string")
        tip_ids = self.ctx.renderer.encode(tip) if tip else []
        self._fit(len(tip_ids))
        self.builder.continue_model(tip_ids, self.trajectory.num_turns)
        self.trajectory.turns[-1].observation_tokens = len(tip_ids)
        self.messages[-1]["content"] += tip

    def _fit(self, n_tokens: int, window: bool = True) -> None:
        room = self.room(window)
        if room is not None and n_tokens >= room:  # nothing would be left for the model to answer with
            raise EpisodeEnd(TerminationReason.TOKEN_BUDGET)

    # ---- the end ---------------------------------------------------------------------------------
    def end(self, reason: TerminationReason, error: str | None = None) -> None:
        """Finish the trajectory (once: a cancellation after the end changes nothing)."""
        if self._builder is None:
            self._early = self._early or self.ctx.failed(reason, error or str(reason))
        elif self.trajectory.termination_reason is None:
            self.builder.finish(reason, error)

    async def close(self) -> None:
        """Close the env and release the engine's cache of this trajectory; failures become warnings. Shielded:
        a second cancellation (a server's cancel scope repeats it) returns at once but never skips the release,
        which goes on, bounded, in the background."""
        problems = await asyncio.shield(asyncio.ensure_future(self._cleanup()))
        for problem in problems:
            log.warning("trajectory %s: %s", self.ctx.trajectory_id, problem)
        if self._builder is not None:
            self.trajectory.warnings += problems
            self._count()

    def _count(self) -> None:
        """The branch's metrics: its times and token counts (the times restart for the next branch)."""
        traj = self.trajectory
        traj.metrics.update(self._metrics, total_time_s=time.perf_counter() - self._t0,
                            model_tokens=traj.num_model_tokens,
                            injected_tokens=traj.num_response_tokens - traj.num_model_tokens)
        self._metrics = dict.fromkeys(self._metrics, 0.0)
        self._t0 = time.perf_counter()

    def _seal(self) -> None:
        """A finished branch before the next one starts: its metrics, images and the sanity check (as `result`)."""
        self._count()
        self.result()

    async def _release(self, request_id: str) -> None:
        try:  # releasing a cache entry must never fail, or hold, the episode
            await abandon_after(self.ctx.engine.release(request_id), self.limits.cleanup_timeout_s, "engine.release")
        except Exception as e:
            self.trajectory.warnings.append(f"engine.release raised {type(e).__name__}: {e}")

    async def _cleanup(self) -> list[str]:
        problems, bound = [], self.limits.cleanup_timeout_s
        if self._env is not None and self._env.closes:  # an env without close(): no task to bound
            try:
                await abandon_after(self._env.close(), bound, "env.close")
            except Exception as e:
                problems.append(f"env.close raised {type(e).__name__}: {e}")
        try:  # releasing a cache entry must never fail, or hold, a finished trajectory
            request_id = self.trajectory.id if self._builder is not None else self.ctx.trajectory_id
            await abandon_after(self.ctx.engine.release(request_id), bound, "engine.release")
        except Exception as e:
            problems.append(f"engine.release raised {type(e).__name__}: {e}")
        return problems

    def result(self) -> Trajectory:
        """The finished trajectory, with its images merged and checked and its token stream sanity-checked."""
        if self._builder is None:
            assert self._early is not None, "Episode.end() first"
            return self._early
        if self.builder.images.chunks:
            _attach_images(self.ctx, self.builder)
        _sanity_check(self.ctx, self.trajectory, self.messages, self.env.tools)
        return self.trajectory


def _attach_images(ctx: RolloutContext, b: TrajectoryBuilder) -> None:
    """Merge the training tensors once per key and run the parity checks; a violation fails the trajectory."""
    traj = b.trajectory
    merged = b.images.merged()
    problem = check_parity(b.token_ids, b.images, merged, ctx.renderer)  # type: ignore[arg-type]  # images ⇒ VLM
    traj.images = [image_ref(im) for im in b.images.images]
    if problem is not None:
        log.warning("trajectory %s: multimodal parity check failed: %s", traj.id, problem)
        traj.finish(TerminationReason.PARITY_ERROR, problem)
        return
    traj.mm_train_inputs = merged


_MAX_RESUBMITS = 64  # one preemption per weight update: a turn would have to outlive 64 updates


def _joined(parts: list[GenerateOutput]) -> GenerateOutput:
    """The outputs of one turn's resubmitted calls as one (tokens, logprobs and versions in order)."""
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    kept = None if any(p.kept_counts is None for p in parts) else [k for p in parts for k in p.kept_counts or []]
    routed = [p for p in parts if p.routed_experts is not None]
    start = min((p.routed_start for p in routed), default=0)
    experts = None
    for p in routed:  # each resubmitted call routes from its own start (positions in the same stream)
        experts = merge_routing(experts, p.routed_start - start, p.routed_experts)
    return GenerateOutput(
        [t for p in parts for t in p.token_ids], [lp for p in parts for lp in p.logprobs], last.finish_reason,
        last.policy_version, sum(p.cached_prompt_tokens for p in parts),
        token_versions=[v for p in parts for v in p.versions()], kept_counts=kept, routed_experts=experts,
        routed_start=start)


def derive_seed(base: int | None, trajectory_id: str, turn: int) -> int | None:
    """A per-call seed from the run seed: the same trajectory id and turn always sample the same way."""
    return None if base is None else zlib.crc32(f"{base}/{trajectory_id}/{turn}".encode())


SANITY_CHECK_FIRST = 64
"""rollout.sanity_check_every N > 1: the first trajectories of the process checked whatever their id."""
_sampled = 0
"""Trajectories `should_check` has been asked about with N > 1 in this process (up to SANITY_CHECK_FIRST)."""


def should_check(trajectory_id: str, every: int) -> bool:
    """Whether the sanity check runs on this trajectory: always with `every` <= 1; else for the first
    `SANITY_CHECK_FIRST` trajectories this process asks about, then when zlib.crc32 of the id is 0 mod `every`
    (deterministic: the same id is checked or not in every run)."""
    global _sampled
    if every <= 1:
        return True
    if _sampled < SANITY_CHECK_FIRST:
        _sampled += 1
        return True
    return zlib.crc32(trajectory_id.encode()) % every == 0


def _sanity_check(ctx: RolloutContext, traj: Trajectory, messages: list[Message], tools: Any) -> None:
    """Compare the stream with a full re-render (ChatRenderer.check). A difference of a kind known to be harmless
    for this template counts in `render_harmless` (strict mode) and is explained at info level; any other counts
    in `render_mismatch` and is explained as a warning; each kind once per process (the metrics count the rest).
    `render_checked` says whether it ran (1) or the sample left this trajectory out (0: no render metrics)."""
    if ctx.sanity_mode == SanityMode.DISABLE or not traj.prompt_ids or not traj.response_ids:
        return  # no model turn: the stream ends in the generation prompt, which a re-render of the messages lacks
    checked = should_check(traj.id, ctx.sanity_check_every)
    traj.metrics["render_checked"] = 1.0 if checked else 0.0
    if not checked:
        return
    check = ctx.renderer.check(traj.prompt_ids + traj.response_ids, messages, tools, ctx.sanity_mode)
    traj.metrics["render_mismatch"] = 0.0 if check.ok or check.strippable else 1.0
    traj.metrics["render_harmless"] = 1.0 if not check.ok and check.strippable else 0.0
    if check.ok:
        return
    traj.info["render_check"] = {"mode": str(ctx.sanity_mode), "strippable": check.strippable, "diff": check.diff}
    kinds = [k for k in dict.fromkeys(check.reasons if check.strippable else ["content"]) if k not in _EXPLAINED]
    if not kinds:
        return
    _EXPLAINED.update(kinds)
    if not check.strippable:
        log.warning("trajectory %s: its token stream differs from a full chat-template re-render in content. Check "
                    "it: the model saw (and is trained on) something a fresh render of the conversation would not "
                    "give (docs/templates.md). Further mismatches are only counted (metric rollout/render_mismatch, "
                    "info.render_check).\n%s", traj.id, check.diff)
        return
    known = "; ".join(f"{kind}: {_HARMLESS[kind]}" for kind in kinds)
    log.info("trajectory %s: its token stream differs from a full re-render by %s only in ways known to be harmless "
             "for this template (%s). Training uses exactly the tokens the model saw. Counted in "
             "rollout/render_harmless (info.render_check has the diff); --sanity-check ignore_strippable "
             "(rollout.sanity_check) stops recording them.\n%s", traj.id, ctx.renderer.template_name, known, check.diff)


_EXPLAINED: set[str] = set()
"""The kinds of difference explained so far in this process."""

_HARMLESS = {
    "reasoning": "a reasoning block the template drops from earlier turns, or adds empty to the last one",
    "retokenised": "the same text in other tokens (a boundary the model did not merge across, Unicode NFC "
                   "normalisation)",
    "observation_rewrite": "the end of an observation, which the template renders differently once a reply follows",
}
"""The kinds of difference `ChatRenderer.check` names and knows to be harmless (`RenderCheck.reasons`)."""

