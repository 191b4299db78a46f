"""Many trajectories at once: the RolloutManager (rows × n, bounded concurrency, rewards streamed as each
trajectory finishes), the `Rollout` protocol every rollout implements (local, Ray, remote), `run_groups` and
`score`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import numbers
import os
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from turnrl.engines.base import Engine
from turnrl.envs.base import EnvFactory, EnvThreads, maybe_await
from turnrl.observe.watchdog import Watchdog
from turnrl.render import ChatRenderer, SanityMode
from turnrl.rollout.admission import Admission, AdmissionSettings, admission_cost
from turnrl.rollout.episode import RolloutContext, RolloutLimits
from turnrl.rollout.tree import episodes
from turnrl.types import (
    RolloutStatus,
    SamplingParams,
    TerminationReason,
    Trajectory,
)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# Many trajectories at once
# ---------------------------------------------------------------------------------------------------
_heap_frozen = False


def freeze_heap() -> None:
    """Once per process, before its first rollout: collect, then move every object alive now (modules, the model,
    the tokenizer, the data) to the garbage collector's permanent generation (`gc.freeze`, as vLLM does after its
    start-up), so the full collections that thousands of trajectories in flight trigger scan only what rollouts
    allocate, not the whole start-up heap (a third of the rollout's time at 10,000 in flight: docs/rollout.md).
    Those objects are then never collected as cyclic garbage (freed by reference counting as always).
    TURNRL_GC_FREEZE=0 turns the freeze off; `relax_gc_thresholds` runs with it."""
    global _heap_frozen
    if _heap_frozen:
        return
    relax_gc_thresholds()  # first: a malformed TURNRL_GC_THRESHOLD fails every rollout that starts, not only one
    if os.environ.get("TURNRL_GC_FREEZE", "1") != "0":
        gc.collect()
        gc.freeze()
    _heap_frozen = True


GC_THRESHOLDS = (50_000, 20, 20)
"""What `relax_gc_thresholds` sets: a young collection per 50,000 net allocations of container objects instead of
CPython's 700 (mypy sets 200,000, others 50,000-100,000), and a little more between the older ones."""
_DEFAULT_GC_THRESHOLDS = (700, 10, 10)


def relax_gc_thresholds() -> None:
    """Once per process, with `freeze_heap`: collect less often. A turn allocates ~50 small containers (records,
    segments, messages, coroutines), so with CPython's defaults a rollout process ran a young collection every ~16
    turns, a middle one every ~180 and full ones over every trajectory in flight: ~15-20% of the rollout's time at
    2,000 in flight (docs/rollout.md). Unreachable cycles then wait for 50,000 allocations (milliseconds at this
    rate) instead of 700; memory freed by reference counting, most of it, is freed at once as always. Only
    CPython's defaults are replaced (a process that set its own keeps them); TURNRL_GC_THRESHOLD="a,b,c" sets
    others, TURNRL_GC_THRESHOLD=0 keeps the defaults."""
    wanted = os.environ.get("TURNRL_GC_THRESHOLD", "")
    if wanted.strip() == "0":
        return
    thresholds = GC_THRESHOLDS
    if wanted.strip():
        try:
            thresholds = tuple(int(x) for x in wanted.split(","))  # type: ignore[assignment]
            if len(thresholds) != 3 or min(thresholds) < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"TURNRL_GC_THRESHOLD must be three positive integers \"a,b,c\" (gc.set_threshold) "
                             f"or 0, got {wanted!r}") from None
    elif gc.get_threshold() != _DEFAULT_GC_THRESHOLDS:
        return
    gc.set_threshold(*thresholds)


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
        concurrency: int | str = 64,
        sanity_mode: SanityMode | str = SanityMode.STRICT,
        sanity_check_every: int = 1,
        reward_fn: RewardFn | None = None,
        watchdog_s: float | None = None,
        admission: AdmissionSettings | None = None,
    ):
        if default_agent not in agents:
            raise ValueError(f"unknown default agent {default_agent!r}; registered: {sorted(agents)}")
        self.engine, self.renderer, self.agents, self.default_agent = engine, renderer, agents, default_agent
        self.sampling = sampling or SamplingParams()
        self.limits = limits or RolloutLimits()
        self.env_factory, self.env_config, self.tools = env_factory, dict(env_config or {}), tools
        self.sanity_mode, self.reward_fn = SanityMode(sanity_mode), reward_fn
        if sanity_check_every < 1:
            raise ValueError(f"sanity_check_every must be >= 1 (1 = every trajectory), got {sanity_check_every}")
        self.sanity_check_every = sanity_check_every
        self.admission = admission or AdmissionSettings(concurrency)  # type: ignore[arg-type]
        """`concurrency` (a number or auto) and the KV caps of auto (turnrl.rollout.admission)."""
        self.concurrency = self.admission.concurrency
        self.env_threads = EnvThreads(self.admission.max_concurrency if self.admission.auto
                                      else int(self.admission.concurrency))
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Admission] = (
            weakref.WeakKeyDictionary())  # across every stream of this manager (one per event loop)
        self._turns = 0
        self._t_turns = time.monotonic()
        self.watchdog = Watchdog(watchdog_s)
        """Fails `stream` (Stalled) when no trajectory, engine call or env call progresses for `watchdog_s`."""

    def context(self, row: dict[str, Any], trajectory_id: str, group_id: str, sample_index: int,
                sampling: SamplingParams | None = None) -> RolloutContext:
        agent_name = row.get("agent_name") or self.default_agent
        if agent_name not in self.agents:
            raise ValueError(f"row {group_id}: unknown agent_name {agent_name!r}; registered: {sorted(self.agents)}")
        return RolloutContext(
            engine=self.engine, renderer=self.renderer, sampling=sampling or self.sampling, limits=self.limits,
            trajectory_id=trajectory_id, group_id=group_id, sample_index=sample_index, sample=row,
            agent_name=agent_name, env_factory=self.env_factory, env_config=self.env_config, tools=self.tools,
            sanity_mode=self.sanity_mode, sanity_check_every=self.sanity_check_every, env_threads=self.env_threads,
            watchdog=self.watchdog,
        )

    async def stream(
        self, rows: Sequence[dict[str, Any]], n: int = 1, *, id_prefix: str = "",
        sampling: SamplingParams | None = None, row_group_ids: Sequence[str] | None = None,
    ) -> AsyncIterator[Trajectory]:
        """Yield trajectories as they finish (rewards already computed). `row_group_ids` replaces the ids
        derived from the rows: a Ray rollout worker gets its shard's ids from the driver, so trajectory ids
        (and the sampling seeds derived from them) are those of a single-process run."""
        async for batch in self.stream_batches(rows, n, id_prefix=id_prefix, sampling=sampling,
                                               row_group_ids=row_group_ids):
            for traj in batch:
                yield traj

    async def stream_batches(
        self, rows: Sequence[dict[str, Any]], n: int = 1, *, id_prefix: str = "",
        sampling: SamplingParams | None = None, row_group_ids: Sequence[str] | None = None,
    ) -> AsyncIterator[list[Trajectory]]:
        """`stream`, a batch at a time: each batch is every trajectory finished since the last one was taken
        (in the order they finished; never empty). A Ray rollout worker sends a batch as one object."""
        freeze_heap()
        gate = self._gate()
        groups = group_ids(rows, id_prefix) if row_group_ids is None else list(row_group_ids)
        contexts = [
            self.context(row, f"{group}-{k}", group, k, sampling)
            for row, group in zip(rows, groups, strict=True) for k in range(n)
        ]
        tasks = [asyncio.create_task(self._run_one(ctx, gate)) for ctx in contexts]
        finished: asyncio.Queue[asyncio.Task] = asyncio.Queue()
        for t in tasks:
            t.add_done_callback(finished.put_nowait)
        try:
            left = len(tasks)
            while left:
                done = [await self.watchdog.wait(finished.get())]
                while not finished.empty():
                    done.append(finished.get_nowait())
                left -= len(done)
                yield [traj for task in done for traj in task.result()]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _gate(self) -> Admission:
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = Admission(self.admission, self.engine)
        return gate

    def stats(self) -> dict[str, float]:
        """rollout/turns_per_s (model turns of finished trajectories per second since the last call), and this
        event loop's admission: rollout/concurrency, rollout/kv_occupancy, rollout/preemptions."""
        now = time.monotonic()
        out = {"turns_per_s": self._turns / max(now - self._t_turns, 1e-9)}
        self._turns, self._t_turns = 0, now
        gates = list(self._gates.values())
        if gates:
            out.update(gates[-1].stats())
        return out

    async def _run_one(self, ctx: RolloutContext, gate: Admission) -> list[Trajectory]:
        agent = self.agents[ctx.agent_name]
        try:
            cost = admission_cost(agent, ctx.sample)
        except ValueError as e:
            return [ctx.failed(TerminationReason.ENV_ERROR, f"{ctx.agent_name}: {e}")]
        async with gate.slot(cost), self.watchdog.busy("trajectory", ctx.agent_name):
            try:
                result = await asyncio.wait_for(agent(ctx, ctx.sample), ctx.limits.trajectory_timeout_s)
                trajs = result if isinstance(result, list) else [result]
            except TimeoutError:
                trajs = [_timed_out(ctx)]
            except Exception as e:  # a broken agent fails its trajectory, never the batch
                log.info("agent %s raised on %s", ctx.agent_name, ctx.trajectory_id, exc_info=True)  # -v
                trajs = [ctx.failed(TerminationReason.ENV_ERROR, e)]
            returned = {id(t) for t in trajs}
            trajs = [*(b for b in ctx.branches if id(b) not in returned), *trajs]  # compacted branches first
            await score_episodes(trajs, self.reward_fn)
            for traj in trajs:
                self._turns += traj.num_turns
                if traj.status == RolloutStatus.FAILED:  # one line each; tracebacks at -v (INFO)
                    log.warning("trajectory %s failed (%s): %.300s", traj.id, traj.termination_reason,
                                " ".join(str(traj.error).split()))
            return trajs


def _timed_out(ctx: RolloutContext) -> Trajectory:
    traj = ctx.partial
    message = f"trajectory exceeded trajectory_timeout_s={ctx.limits.trajectory_timeout_s}"
    if traj is None:
        return ctx.failed(TerminationReason.TIMEOUT, message)
    traj.finish(TerminationReason.TIMEOUT, message)
    return traj


class Rollout(Protocol):
    """Whatever runs the rollouts of a run: a local RolloutManager, a RayRollout (turnrl.rollout.ray) or a
    RemoteRollout (turnrl.rollout.remote, a `turnrl serve` rollout server). `stream` yields trajectories as they
    finish, rewards already computed (`score`); `run_groups` groups any of them."""

    @property
    def engine(self) -> Engine: ...
    @property
    def renderer(self) -> ChatRenderer: ...
    @property
    def sampling(self) -> SamplingParams: ...

    def stream(self, rows: Sequence[dict[str, Any]], n: int = 1, *, id_prefix: str = "",
               sampling: SamplingParams | None = None) -> AsyncIterator[Trajectory]: ...


async def run_groups(
    rollout: Rollout, rows: Sequence[dict[str, Any]], n: int = 1, *, id_prefix: str = "",
    sampling: SamplingParams | None = None, on_trajectory: Callable[[Trajectory], None] | None = None,
) -> list[list[Trajectory]]:
    """All trajectories of `rollout.stream(rows, n)` grouped by prompt, in row order, each group sorted by
    sample index; `on_trajectory` sees each one as it arrives."""
    groups: dict[str, list[Trajectory]] = {}
    async for traj in rollout.stream(rows, n, id_prefix=id_prefix, sampling=sampling):
        groups.setdefault(traj.group_id, []).append(traj)
        if on_trajectory is not None:
            on_trajectory(traj)
    return [sorted(groups.get(g, []), key=lambda t: (t.sample_index, t.id)) for g in group_ids(rows, id_prefix)]


async def score_episodes(trajs: list[Trajectory], reward_fn: RewardFn | None) -> None:
    """`score` each episode once: a trajectory alone, or the last branch of an episode with several (where it ended,
    its final answer); the episode's other branches take its reward (or its reward error) unless their agent gave
    them one of their own (docs/trees.md)."""
    for episode in episodes(trajs).values():
        last = episode[-1]
        await score(last, reward_fn)
        for traj in episode[:-1]:
            if traj.reward is None and traj.reward_error is None and traj.status != RolloutStatus.FAILED:
                traj.reward, traj.reward_error = last.reward, last.reward_error


async def score(traj: Trajectory, reward_fn: RewardFn | None) -> None:
    """Set `traj.reward` with `reward_fn` (sync or async), unless the agent set one or the trajectory FAILED (an
    env, engine or agent error, a timeout: there is no outcome to score, and a failure is not a zero reward; it is
    counted by its status and never trained). A raising reward function, or one returning anything but a finite
    number (a bool counts as 0/1; verl's `{"score": x, ...}` gives x, its other keys go to `info["reward_extra"]`),
    leaves the reward None and records `reward_error`: a crash is never scored 0.0, and a NaN or a string never
    reaches the group's advantages."""
    if reward_fn is None or traj.reward is not None or traj.status == RolloutStatus.FAILED:
        return
    try:
        value = await maybe_await(reward_fn(traj))
        if isinstance(value, dict) and "score" in value:
            traj.info["reward_extra"] = {k: v for k, v in value.items() if k != "score"}
            value = value["score"]
        traj.reward = _finite_reward(value)
    except Exception as e:
        traj.reward_error = f"{type(e).__name__}: {e}"
        log.warning("reward function failed on %s: %s", traj.id, traj.reward_error)


def _finite_reward(value: Any) -> float:
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):  # bools and numpy scalars too
        return float(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d numpy array or torch tensor
        return _finite_reward(value.item())
    raise ValueError(f"the reward function returned {value!r:.60} ({type(value).__name__}); expected a finite "
                     "number (or verl's {'score': number, ...})")


Producer = Callable[[Callable[[Trajectory], None]], Awaitable[None]]


"""`async (put) -> None`: puts trajectories as it gets them; returns when it has no more."""


async def drain(producers: Sequence[Producer]) -> AsyncIterator[Trajectory]:
    """Run `producers` concurrently and yield what they put, in arrival order, until all have returned.
    A producer that raises ends the stream with its error (after what was put before it) and cancels the
    others; leaving the stream early cancels them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def run(produce: Producer) -> None:
        try:
            await produce(queue.put_nowait)
            queue.put_nowait(done)
        except Exception as e:  # a dead worker or server: the caller's batch fails loudly
            queue.put_nowait(e)

    tasks = [asyncio.create_task(run(p)) for p in producers]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def group_ids(rows: Sequence[dict[str, Any]], id_prefix: str = "") -> list[str]:
    """One id per row: its `id` column (else its index), with `#k` added when a row repeats in a batch."""
    seen: dict[str, int] = {}
    out = []
    for i, row in enumerate(rows):
        base = f"{id_prefix}{row.get('id', i)}"
        seen[base] = seen.get(base, 0) + 1
        out.append(base if seen[base] == 1 else f"{base}#{seen[base] - 1}")
    return out

