"""A CPU harness for rollout scheduling: an accelerator and tools whose latencies you control.

- `LatencyEngine`: an `Engine` that models a continuous-batching server without computing anything.
- `LatencyToolEnv` (+ `build_env`, `latency_rows`): an episode of 1 to 6 turns whose tool answers after a
  heavy-tailed latency drawn in advance, so two schedules can be compared on the same draws.
- `LockstepEngine`: wraps any engine so that concurrent trajectories run in the *synchronous batched*
  schedule of TRL and ms-swift's colocate mode (every live trajectory's turn is generated as one batch,
  then that turn's tools run, then the next turn). Same turn loop, same tokens, only the schedule differs.

- `simulate_training`: the trainer's side of asynchronous training (`turnrl.train.buffer`) with an update of fixed cost,
  so staleness policies can be measured where generation, tools and the update are separate resources.

`bench/async_rollout.py`, `bench/async_train.py` and the tests use them; `turnrl.testing.latency` is also an env module
(`--env turnrl.testing.latency`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from turnrl.engines.base import Engine, KVStats, NamedTensors
from turnrl.train.buffer import Group, TrajectoryBuffer, produce
from turnrl.types import FinishReason, GenerateOutput, SamplingParams, StepResult, TerminationReason, Turn


# ---------------------------------------------------------------------------------------------------
# A fake accelerator
# ---------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Pending:
    ids: list[int]
    done: asyncio.Future
    versions: list[int] = field(default_factory=list)
    """The policy version of each token produced so far."""
    request_id: str = ""
    prompt_len: int = 0
    kv: int = 0
    """KV tokens it holds (0: waiting for room, never admitted or preempted)."""


class LatencyEngine:
    """An engine whose cost is time, modelled like a continuous-batching server on an accelerator.

    Decoding proceeds in steps of `per_token_s` seconds. Each step gives one token to every running request,
    up to `max_batch` of them (decode is memory-bound: a batch costs what one row costs); requests beyond
    that wait in FIFO order and join as rows finish. So one call of k tokens takes k * per_token_s, B <=
    max_batch concurrent calls of k tokens take the same, and 2 * max_batch calls take twice as long.
    Prefill is free. Every call returns `reply_ids` cut at `params.max_new_tokens` (finish `length` when
    cut, else `stop`) with logprob -0.5 per token. Weight updates honour the pause modes like the embedded
    engine: `keep` (running calls go on; later tokens carry the new version), `wait` (the update waits for the
    running calls; new ones wait for the update), `abort` (running calls return their tokens so far, preempted).

    With a KV budget (`kv_tokens`) it also models a paged KV cache as vLLM manages it. A request holds its prompt
    and the tokens it produced; a finished turn's KV stays cached for the trajectory's next turn (LRU, evicted
    first when room is needed, dropped by `release`). A waiting request joins the batch only when its KV fits;
    when the running requests grow past the budget, the one admitted last is preempted: it loses its KV, waits
    again and recomputes prompt and tokens when it rejoins. Recomputing (any prompt token not cached) costs
    `prefill_per_token_s` per token in that step. `kv_stats()` reports the occupancy (KV held by running
    requests and cached for live trajectories, over the budget) and the preemptions so far (evictions of a live
    trajectory's cached prefix count too: it is recomputed the same way).
    """

    def __init__(self, reply_ids: Sequence[int], *, per_token_s: float = 0.01, max_batch: int = 64,
                 kv_tokens: int | None = None, prefill_per_token_s: float = 0.0):
        if not reply_ids:
            raise ValueError("LatencyEngine.reply_ids must not be empty")
        if per_token_s <= 0 or max_batch < 1:
            raise ValueError(f"LatencyEngine: per_token_s must be > 0 and max_batch >= 1, got {per_token_s}, {max_batch}")
        if kv_tokens is not None and kv_tokens < 1:
            raise ValueError(f"LatencyEngine: kv_tokens must be >= 1 or None, got {kv_tokens}")
        self.reply_ids, self.per_token_s, self.max_batch = list(reply_ids), per_token_s, max_batch
        self.kv_tokens, self.prefill_per_token_s = kv_tokens, prefill_per_token_s
        self.policy_version = 0
        self.stats = {"steps": 0, "tokens": 0, "requests": 0, "max_running": 0, "preemptions": 0,
                      "recomputed_tokens": 0}
        self._cached: OrderedDict[str, int] = OrderedDict()  # request id -> KV tokens of its last turn, LRU first
        self._queue: list[_Pending] = []
        self._stepper: asyncio.Task | None = None
        self._open = asyncio.Event()  # cleared while a `wait` update drains the running calls
        self._open.set()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str,
                       images: list[Any] | None = None) -> GenerateOutput:
        await self._open.wait()
        ids = self.reply_ids[: params.max_new_tokens]
        pending = _Pending(list(ids), asyncio.get_running_loop().create_future(), request_id=request_id,
                           prompt_len=len(prompt_ids))
        self._queue.append(pending)
        self.stats["requests"] += 1
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.create_task(self._run())
        preempted = await pending.done
        done = ids[: len(pending.versions)]
        finish = (FinishReason.ABORT if preempted else FinishReason.LENGTH if len(ids) < len(self.reply_ids)
                  else FinishReason.STOP)
        versions = pending.versions if len(set(pending.versions)) > 1 else None
        last = pending.versions[-1] if pending.versions else self.policy_version  # the version of its last token
        return GenerateOutput(list(done), [-0.5] * len(done), finish, policy_version=last, token_versions=versions,
                              preempted=preempted)

    async def _run(self) -> None:
        while self._queue:
            if self.kv_tokens is None:
                running, prefill = self._queue[: self.max_batch], 0
            else:
                running, prefill = self._schedule(self.kv_tokens)
            await asyncio.sleep(self.per_token_s + self.prefill_per_token_s * prefill)
            self.stats["steps"] += 1
            self.stats["tokens"] += len(running)
            self.stats["max_running"] = max(self.stats["max_running"], len(running))
            for p in running:
                if p in self._queue:  # not aborted by an update meanwhile
                    p.versions.append(self.policy_version)
                    p.kv += 1
            for p in [p for p in running if p in self._queue and len(p.versions) >= len(p.ids)]:
                self._finish(p, preempted=False)

    def _schedule(self, budget: int) -> tuple[list[_Pending], int]:
        """This step's batch under the KV budget, and the prompt tokens it recomputes (module docstring)."""
        running = [p for p in self._queue if p.kv]
        prefill = 0
        for p in self._queue:  # FIFO: a request that does not fit holds up the ones behind it
            if p.kv or len(running) >= self.max_batch:
                continue
            need = p.prompt_len + len(p.versions)
            cached = min(self._cached.pop(p.request_id, 0), p.prompt_len)
            if not self._make_room(need + 1, budget, running):
                if cached:
                    self._cached[p.request_id] = cached
                break
            p.kv = need
            prefill += need - cached
            self.stats["recomputed_tokens"] += len(p.versions)
            running.append(p)
        # every running request needs one more slot for the token of this step: preempt the latest admitted
        while running and not self._make_room(len(running), budget, running):
            victim = running.pop()
            victim.kv = 0
            self.stats["preemptions"] += 1
        return running, prefill

    def _make_room(self, need: int, budget: int, running: list[_Pending]) -> bool:
        """Evict cached prefixes (oldest first) until `need` more tokens fit beside the running requests."""
        held = sum(p.kv for p in running)
        while held + sum(self._cached.values()) + need > budget and self._cached:
            self._cached.popitem(last=False)
            self.stats["preemptions"] += 1  # a live trajectory's prefix, to be recomputed at its next turn
        return held + need <= budget

    def kv_stats(self) -> KVStats | None:
        if self.kv_tokens is None:
            return None
        held = sum(p.kv for p in self._queue) + sum(self._cached.values())
        return KVStats(min(held / self.kv_tokens, 1.0), self.stats["preemptions"])

    def _finish(self, pending: _Pending, *, preempted: bool) -> None:
        self._queue.remove(pending)
        if self.kv_tokens is not None and pending.kv and not preempted:  # kept for the trajectory's next turn
            self._cached.pop(pending.request_id, None)
            self._cached[pending.request_id] = pending.kv
        pending.kv = 0
        if not pending.done.done():  # a cancelled caller
            pending.done.set_result(preempted)

    async def update_weights(self, named_tensors: NamedTensors, version: int | None = None, *,
                             final: bool = True, pause: str = "keep") -> int:
        if pause == "wait":  # the running calls finish on the old weights; new ones wait for the update
            self._open.clear()
            while self._queue:
                await asyncio.sleep(self.per_token_s)
        elif pause == "abort":
            for pending in list(self._queue):
                self._finish(pending, preempted=True)
        if final:
            self.policy_version = self.policy_version + 1 if version is None else version
        self._open.set()
        return self.policy_version

    async def sleep(self) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    async def release(self, request_id: str) -> None:
        self._cached.pop(request_id, None)

    def close(self) -> None:
        return None  # nothing to stop: the stepper task ends with the calls it serves


# ---------------------------------------------------------------------------------------------------
# The synchronous batched schedule, as a wrapper
# ---------------------------------------------------------------------------------------------------
class _Barrier:
    """Every live party waits until all live parties arrived; a party that leaves stops counting."""

    def __init__(self, parties: int):
        self.parties, self.arrived = parties, 0
        self.sizes: list[int] = []
        """Parties let through at each opening."""
        self._open = asyncio.Event()

    async def wait(self) -> None:
        self.arrived += 1
        opened = self._open
        if self.arrived >= self.parties:
            self._release()
        else:
            await opened.wait()

    def leave(self) -> None:
        self.parties -= 1
        if self.arrived and self.arrived >= self.parties:
            self._release()

    def _release(self) -> None:
        self.sizes.append(self.arrived)
        self._open.set()
        self._open, self.arrived = asyncio.Event(), 0


class LockstepEngine:
    """Runs `parties` concurrent trajectories in lockstep, the synchronous batched turn loop:

        for turn in 1, 2, ...:
            outputs = generate(every live trajectory's prompt, submitted together, awaited together)
            await asyncio.gather(every live trajectory's tool step)

    A generate call waits until every live trajectory has asked (so the inner engine gets them as one batch)
    and returns when every one of them has its answer; the next turn's calls therefore wait for the slowest
    tool of this turn. A trajectory stops counting when the driver releases it (`drive` always does).
    The RolloutManager's concurrency must be >= `parties`, or the first barrier never opens.
    """

    def __init__(self, inner: Engine, parties: int):
        self.inner, self.parties = inner, parties
        self._submitted, self._answered = _Barrier(parties), _Barrier(parties)
        self._released: set[str] = set()

    @property
    def batches(self) -> list[int]:
        """Trajectories in each generate batch (the live count at each turn)."""
        return self._submitted.sizes

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str,
                       images: list[Any] | None = None) -> GenerateOutput:
        await self._submitted.wait()
        try:
            return await self.inner.generate(prompt_ids, params, request_id=request_id, images=images)
        finally:
            await self._answered.wait()

    async def update_weights(self, named_tensors: NamedTensors, version: int | None = None, *,
                             final: bool = True, **options: Any) -> int:
        return await self.inner.update_weights(named_tensors, version, final=final, **options)

    async def sleep(self) -> None:
        await self.inner.sleep()

    async def wake_up(self) -> None:
        await self.inner.wake_up()

    async def release(self, request_id: str) -> None:
        if request_id not in self._released:
            self._released.add(request_id)
            self._submitted.leave()
            self._answered.leave()
        await self.inner.release(request_id)

    def close(self) -> None:
        self.inner.close()


# ---------------------------------------------------------------------------------------------------
# A tool env with controlled latency and episode length
# ---------------------------------------------------------------------------------------------------
class LatencyToolEnv:
    """An episode of `len(latencies_s)` turns; the tool of turn t answers after `latencies_s[t - 1]` seconds.

    Turn-aware (`step_turn`): the episode length does not depend on what the model wrote or whether its
    turn was cut at max_new_tokens, so every schedule and every model does the same number of turns.
    `fail_on_turn` makes that turn's tool raise (the trajectory ends FAILED / env_error).
    """

    def __init__(self, latencies_s: Sequence[float], fail_on_turn: int | None = None):
        if not latencies_s:
            raise ValueError("LatencyToolEnv needs at least one turn (latencies_s is empty)")
        self.latencies_s, self.fail_on_turn = list(latencies_s), fail_on_turn

    async def step_turn(self, turn: Turn) -> StepResult:
        await asyncio.sleep(self.latencies_s[turn.turn - 1])
        if turn.turn == self.fail_on_turn:
            raise RuntimeError(f"tool failed on turn {turn.turn} (fail_on_turn)")
        if turn.turn >= len(self.latencies_s):  # done whatever the model did: COMPLETED even after a cut turn
            return StepResult(reward=1.0, done=True, termination_reason=TerminationReason.ENV_DONE)
        return StepResult(f"Tool result {turn.turn}: {len(turn.token_ids)} tokens received. Continue.")


def build_env(sample: dict[str, Any], config: dict[str, Any]) -> LatencyToolEnv:
    """`sample["latencies_s"]` (one per turn, see `latency_rows`), optional `sample["fail_on_turn"]`."""
    if "latencies_s" not in sample:
        raise ValueError("turnrl.testing.latency env: the row needs `latencies_s` (a list, one tool latency per turn)")
    return LatencyToolEnv(sample["latencies_s"], sample.get("fail_on_turn"))


@dataclass
class LatencyDraw:
    """How `latency_rows` draws tool latencies."""

    mean_s: float = 0.5
    """Mean tool latency."""
    sigma: float = 1.0
    """Log-space std of the lognormal (1.0: the slowest of 64 calls is ~6x the mean); 0 = every call takes mean_s."""
    min_turns: int = 1
    max_turns: int = 6
    seed: int = 0
    prompts: list[str] = field(default_factory=lambda: ["Look up the answer with the tool, then report it."])


def latency_rows(n: int, draw: LatencyDraw) -> list[dict[str, Any]]:
    """`n` rows with a uniform turn count and per-turn lognormal latencies of mean `draw.mean_s`.

    The turn counts and the underlying normal draws depend only on the seed, so rows drawn with different
    means (or sigma 0, fixed latency) have the same episode lengths and the same ranking of slow calls.
    """
    rng = random.Random(draw.seed)
    mu = math.log(draw.mean_s) - draw.sigma**2 / 2 if draw.mean_s > 0 else 0.0  # E[exp(mu + sigma z)] = mean
    rows = []
    for i in range(n):
        turns = rng.randint(draw.min_turns, draw.max_turns)
        z = [rng.gauss(0.0, 1.0) for _ in range(draw.max_turns)][:turns]
        latencies = [0.0 if draw.mean_s <= 0 else math.exp(mu + draw.sigma * zi) for zi in z]
        rows.append({"id": f"r{i}", "prompt": draw.prompts[i % len(draw.prompts)], "latencies_s": latencies})
    return rows


# ---------------------------------------------------------------------------------------------------
# The trainer's side of asynchronous training, with an update of fixed cost
# ---------------------------------------------------------------------------------------------------
@dataclass
class SimulatedRun:
    buffer: TrajectoryBuffer
    steps: list[tuple[int, list[Group]]]
    """(step, the groups it trained)."""
    wall_s: float


async def simulate_training(rollout: Any, engine: LatencyEngine, rows: Sequence[dict[str, Any]], *, steps: int,
                            update_s: float, n: int = 1, buffer: TrajectoryBuffer | None = None,
                            reissue: Sequence[Group] = ()) -> SimulatedRun:
    """What `turnrl.train.loop.Trainer` does in either mode — `buffer.take`, update, push weights, repeat — with the
    update replaced by `update_s` seconds of waiting (an accelerator busy with the backward pass). Rows are used
    in order, cycling; `buffer` defaults to a synchronous one of batch 8."""
    buffer = buffer or TrajectoryBuffer(8, 0)
    order = itertools.cycle(range(len(rows)))
    t0 = time.perf_counter()
    producer = asyncio.create_task(produce(rollout, buffer, rows, n, lambda: next(order),
                                           lambda: engine.policy_version, reissue))
    trained: list[tuple[int, list[Group]]] = []
    try:
        for step in range(buffer.trained // buffer.batch_size + 1, steps + 1):
            trained.append((step, await buffer.take(step)))
            await asyncio.sleep(update_s)
            await engine.update_weights({}, version=step)
            buffer.version_changed()
    finally:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
    return SimulatedRun(buffer, trained, time.perf_counter() - t0)
