"""Admission: how many trajectories a rollout lets run at once (`rollout.concurrency: auto | N`).

A fixed N is a gate of N slots. Too low idles the engines; too high overfills their KV cache, which then
preempts requests (or evicts the cached prefixes of trajectories between turns) and recomputes them: the same
work done twice. With `auto` the limit follows the engines' KV cache (`Engine.kv_stats()`: the occupancy and
the preemptions so far; a Router reports its fullest replica):

- headroom (occupancy under `kv_soft_cap`, no preemption or cut in the last round trip: how long a trajectory
  holds its slot) and the limit in use: grow, clocked by finished trajectories (as TCP's window is by
  acknowledgements: a slow engine or a loaded machine slows the growth too). Until the first cut and while the
  occupancy is under half the soft cap each finished trajectory adds one slot (doubling per round trip: slow
  start); after, half the gap to the capacity estimate per round trip (at least a twentieth of the limit: it
  slows as it nears the estimate, which lags the KV young trajectories will still grow). Either way never past the capacity estimate
  in_flight * kv_soft_cap / occupancy (prime-rl's n = kappa * C / G: G the KV a trajectory holds on average,
  C the cache), nor past `max_concurrency`.
- a new preemption: cut to 0.7 of what is in flight; occupancy past `kv_hard_cap`: by half; past `kv_soft_cap`:
  by a tenth. One cut per round trip (what a cut does shows only once the trajectories it held back would have
  finished), and no growth in the round trip after a cut or a preemption (a preempted request holds no KV:
  the occupancy reads low while the cache thrashes).
- past `kv_hard_cap` nothing new is admitted at all until the occupancy is back under it.

An engine that reports no KV (an HTTP server without a metrics flag) gives no signal: `auto` then grows to
`max_concurrency` (said once in the log). A row's agent may declare what one of its trajectories costs
(`admission_cost`: a harness or a sub-agent fan-out that holds several engine requests at once): it takes that
many slots. The rollout's staleness bound (turnrl.train.buffer) is applied before this: admission only ever
holds back groups the buffer admitted, never adds any.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from turnrl.engines.base import kv_stats

log = logging.getLogger(__name__)

Concurrency = int | Literal["auto"]


@dataclass
class AdmissionSettings:
    """How a rollout admits trajectories (config: rollout.concurrency, kv_soft_cap, kv_hard_cap)."""

    concurrency: Concurrency = 64
    """Trajectories in flight: a number, or `auto` (follow the engines' KV cache)."""
    kv_soft_cap: float = 0.85
    """auto: the KV occupancy it aims under; past it the limit is cut by a tenth."""
    kv_hard_cap: float = 0.95
    """auto: past this occupancy nothing new is admitted and the limit is halved."""
    max_concurrency: int = 4096
    """auto: the limit never grows past this."""
    initial: int = 16
    """auto: the limit it starts from."""
    interval_s: float = 0.05
    """auto: how often it reads the engines' KV report while trajectories run or wait."""

    def __post_init__(self) -> None:
        if self.concurrency != "auto" and (isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int)
                                           or self.concurrency < 1):
            raise ValueError(f"rollout.concurrency must be 'auto' or an integer >= 1, got {self.concurrency!r}")
        if not 0 < self.kv_soft_cap <= self.kv_hard_cap <= 1:
            raise ValueError(f"rollout.kv_soft_cap and kv_hard_cap must satisfy 0 < soft <= hard <= 1, got "
                             f"{self.kv_soft_cap} and {self.kv_hard_cap}")

    @property
    def auto(self) -> bool:
        return self.concurrency == "auto"


class Admission:
    """One event loop's gate: `async with admission.slot(cost)` around each trajectory. Fixed or auto
    (module docstring); `stats()` for the metrics."""

    def __init__(self, settings: AdmissionSettings, engine: Any = None, clock: Callable[[], float] = time.monotonic):
        self.settings, self.engine, self.clock = settings, engine, clock
        s = settings
        self.limit = min(s.initial, s.max_concurrency) if s.auto else int(s.concurrency)
        self.in_flight = 0
        self.occupancy: float | None = None
        self.preemptions = 0
        self.cuts = 0
        self._base_preemptions: int | None = None
        self._blocked = False  # past the hard cap
        self._rtt: float | None = None  # how long a trajectory holds its slot (moving average)
        self._t_first: float | None = None
        self._last_cut = self._last_preemption = -math.inf
        self._credit = 0.0
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self._ticker: asyncio.Task | None = None
        self._last_tick = 0.0
        self._warned = False
        self.admitted_past_hard_cap = 0
        """Trajectories admitted while the last KV report was past kv_hard_cap (auto: none, by construction)."""

    def slot(self, cost: int = 1) -> _Slot:
        return _Slot(self, max(1, int(cost)))

    async def acquire(self, cost: int = 1) -> None:
        if self._t_first is None:
            self._t_first = self.clock()
        self._maybe_tick()
        if not self._waiters and self._fits(cost):
            self._admit(cost)
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((cost, fut))
        self._ensure_ticker()
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():  # admitted just as we were cancelled: give it back
                self.release(cost)
            else:
                self._waiters = collections.deque(w for w in self._waiters if w[1] is not fut)
            raise

    def release(self, cost: int = 1, held_s: float | None = None) -> None:
        binding = self.in_flight >= self.limit or bool(self._waiters)
        self.in_flight -= cost
        if held_s is not None:
            self._rtt = held_s if self._rtt is None else 0.8 * self._rtt + 0.2 * held_s
        self._maybe_tick()
        if self.settings.auto and held_s is not None and binding:
            self._on_finished(cost)
        self._wake()

    def _on_finished(self, cost: int) -> None:
        """Growth, clocked by finished trajectories (as TCP's window is by acknowledgements, so a slow machine or
        engine slows it too): in slow start (no cut yet, occupancy under half the soft cap) each one adds its
        cost, doubling the limit per round trip; after, each adds what grows the limit per round trip by half its
        gap to the capacity estimate (at least a twentieth: a proportional approach that slows as it nears). Only
        with a KV report under the soft cap, a round trip after the last cut or preemption, and never past the
        capacity estimate in_flight * kv_soft_cap / occupancy or max_concurrency."""
        s, occ = self.settings, self.occupancy
        now = self.clock()
        rtt = self.round_trip(now)
        if occ is None or occ > s.kv_soft_cap or now - self._last_cut < rtt or now - self._last_preemption < rtt:
            return
        busy = self.in_flight + cost
        target = s.max_concurrency if occ <= 0 or busy == 0 else math.floor(busy * s.kv_soft_cap / occ)
        slow = self.cuts == 0 and occ < s.kv_soft_cap / 2
        per_round_trip = max(1, self.limit // 20, (target - self.limit) // 2)  # half the gap to the estimate
        # slow start: each finished trajectory adds its cost, twice that with an empty cache (doubling to tripling
        # per round trip, the more the farther the occupancy is under half the soft cap)
        self._credit += cost * (2 - occ / (s.kv_soft_cap / 2)) if slow else cost * per_round_trip / self.limit
        step = math.floor(self._credit)
        if step < 1:
            return
        self._credit -= step
        self.limit = max(self.limit, min(self.limit + step, target, s.max_concurrency))

    def _fits(self, cost: int) -> bool:
        if self._blocked:
            return False
        # a trajectory that costs more than the whole limit still runs, alone
        return self.in_flight + cost <= self.limit or self.in_flight == 0

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            cost, fut = self._waiters.popleft()
            if not fut.done():
                self._admit(cost)
                fut.set_result(None)

    def _admit(self, cost: int) -> None:
        self.in_flight += cost
        if self.occupancy is not None and self.occupancy >= self.settings.kv_hard_cap:
            self.admitted_past_hard_cap += 1

    def _ensure_ticker(self) -> None:
        if self.settings.auto and (self._ticker is None or self._ticker.done()):
            self._ticker = asyncio.get_running_loop().create_task(self._tick_while_waiting())

    async def _tick_while_waiting(self) -> None:
        while self._waiters:
            await asyncio.sleep(self.settings.interval_s)
            self._maybe_tick()
            self._wake()

    def _maybe_tick(self) -> None:
        now = self.clock()
        if now - self._last_tick >= self.settings.interval_s:
            self._last_tick = now
            self.tick()

    def tick(self) -> None:
        """Read the engines' KV report and move the limit (module docstring)."""
        s = self.settings
        report = kv_stats(self.engine) if self.engine is not None else None
        if report is None:
            if s.auto and not self._warned:
                self._warned = True
                log.info("rollout.concurrency auto: the engine reports no KV occupancy; admission grows to %d",
                         s.max_concurrency)
            if s.auto:
                self._grow(s.max_concurrency)
            return
        if self._base_preemptions is None:
            self._base_preemptions = report.preemptions
        new_preemptions = report.preemptions - self._base_preemptions - self.preemptions
        self.preemptions += max(new_preemptions, 0)
        self.occupancy = occ = report.occupancy
        if not s.auto:  # a fixed limit: the report is only shown (metrics)
            return
        self._blocked = occ >= s.kv_hard_cap
        now = self.clock()
        rtt = self.round_trip(now)
        if new_preemptions > 0:
            self._last_preemption = now
        if new_preemptions > 0 or occ >= s.kv_hard_cap:
            self._cut(0.5 if occ >= s.kv_hard_cap else 0.7, now, rtt)
        elif occ > s.kv_soft_cap:
            self._cut(0.9, now, rtt)

    def round_trip(self, now: float) -> float:
        """How long a trajectory holds its slot: the moving average of those finished, else (none yet) the time
        since the first was admitted, a lower bound."""
        if self._rtt is not None:
            return max(self._rtt, self.settings.interval_s)
        return max(now - (self._t_first if self._t_first is not None else now), self.settings.interval_s)

    def _grow(self, target: int) -> None:
        """No KV report: double toward `target` (max_concurrency) per tick."""
        self.limit = max(self.limit, min(2 * self.limit, target, self.settings.max_concurrency))

    def _cut(self, factor: float, now: float, rtt: float) -> None:
        """At most one cut per round trip: what the last cut did shows only once the trajectories it held back
        would have finished."""
        if now - self._last_cut < rtt:
            return
        self.limit = max(1, math.floor(min(self.limit, max(self.in_flight, 1)) * factor))
        self.cuts += 1
        self._last_cut = now

    def stats(self) -> dict[str, float]:
        """Read now: rollout/concurrency (the limit now), rollout/kv_occupancy (when reported), rollout/preemptions (since
        this gate started)."""
        self.tick()
        out = {"concurrency": float(self.limit), "in_flight": float(self.in_flight),
               "preemptions": float(self.preemptions)}
        if self.occupancy is not None:
            out["kv_occupancy"] = self.occupancy
        return out


class _Slot:
    def __init__(self, admission: Admission, cost: int):
        self.admission, self.cost = admission, cost

    async def __aenter__(self) -> None:
        await self.admission.acquire(self.cost)
        self.t0 = self.admission.clock()

    async def __aexit__(self, *exc: Any) -> None:
        self.admission.release(self.cost, self.admission.clock() - self.t0)


def admission_cost(agent: Any, row: dict[str, Any]) -> int:
    """What one trajectory of `agent` on `row` costs in admission slots: the agent's declared
    `admission_cost` (a number, or a function of the row), else 1."""
    declared = getattr(agent, "admission_cost", 1)
    cost = declared(row) if callable(declared) else declared
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
        raise ValueError(f"agent admission_cost must be an integer >= 1, got {cost!r}")
    return cost
