"""The groups between rollout and trainer, and the one rule that bounds their staleness in both training modes.

Policy versions count weight updates: the engine samples with version v after v updates, and training step s
(1-based) updates policy version s - 1. A group (one prompt's n trajectories) is *admitted* at the version the
engine has then, `admitted_version`; every segment it samples carries that version or a later one (in-flight
trajectories go on under new weights: partial rollout), so its oldest segment is never older than its admission.

The guarantee, for `max_staleness = K` and `batch_size = B` groups per step:

    every admitted group is trained, at a step s with  s - 1 - admitted_version <= K.

Two rules give it:
- **Admission**: group number j (0-based, in admission order) may start only while j < (v + K + 1) * B, where v
  is the engine's version. So at most (d + 1) * B groups ever have a deadline step <= d + 1, where a group's
  deadline is `admitted_version + K + 1`.
- **Earliest deadline first over every pending group, waiting rather than dropping**: a step trains the B
  admitted-and-untrained groups with the earliest deadlines, finished ones first among equal deadlines, and waits
  until those B have finished. So after s steps the s * B earliest deadlines are trained, and at most s * B
  groups have a deadline <= s: each is trained by its deadline. (Taking whatever finished first would let a fast
  group of a later version overtake a slow one that is due, and break the bound.)

Nothing is ever discarded for being stale, so the trained episodes have the length distribution of the sampled
ones: a long episode is waited for when its deadline comes, not starved (tinker-cookbook PR #822's complaint
about drop-stale policies). Staleness counts time in this buffer too (prime-rl #3313): it is measured at the
step that trains the group. K = 0 is synchronous on-policy training: B groups are admitted per version and the
step waits for all of them — sync mode is this same buffer with K = 0, not a second loop.

A checkpoint records `state_dict()`: finished groups not yet trained (their trajectories) and groups in flight
(their rows). On resume the former are trained as if nothing happened and the latter are re-issued (counted in
`reissued`): every admitted prompt is trained, buffered, or re-issued; none is lost.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnrl.rollout.manager import Rollout
from turnrl.types import SegmentSource, Trajectory


@dataclass
class Group:
    """One prompt's trajectories on their way to the trainer."""

    index: int
    """Admission order: 0, 1, 2, ... over the whole run (the trajectory ids derive from it)."""
    row_index: int
    """The prompt's index in the training rows."""
    admitted_version: int
    """The engine's policy version when the group was admitted."""
    deadline: int
    """The last training step allowed to train it: admitted_version + max_staleness + 1."""
    trajectories: list[Trajectory] | None = None
    """Set when every trajectory of the group has finished."""
    reissued: bool = False
    """Admitted before a resume and started again after it (its partial trajectories were not kept)."""

    @property
    def oldest_version(self) -> int:
        """The oldest policy version any of its model segments was sampled with (its staleness anchor)."""
        versions = [s.policy_version for t in self.trajectories or [] for s in t.segments
                    if s.source == SegmentSource.MODEL and s.policy_version is not None]
        return min(versions, default=self.admitted_version)


@dataclass
class BufferStats:
    """What the buffer saw, for metrics (`async/*` in metrics.jsonl)."""

    staleness: Counter = field(default_factory=Counter)
    """Trained groups by staleness (step - 1 - oldest version)."""
    versions_per_trajectory: Counter = field(default_factory=Counter)
    """Trained trajectories by how many policy versions sampled them (> 1: it went on across an update)."""
    wait_s: float = 0.0
    """Time the trainer spent waiting for groups."""
    reissued: int = 0
    dropped: int = 0
    """Always 0 under this policy (nothing is discarded); kept so runs can be compared with ones that drop."""


class TrajectoryBuffer:
    """Finished groups waiting for the trainer, the admission rule, and earliest-deadline-first batches."""

    def __init__(self, batch_size: int, max_staleness: int = 0):
        if batch_size < 1 or max_staleness < 0:
            raise ValueError(f"TrajectoryBuffer: batch_size must be >= 1 and max_staleness >= 0, got "
                             f"{batch_size}, {max_staleness}")
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.admitted = 0
        """Groups admitted so far (trained + buffered + in flight)."""
        self.trained = 0
        self.pending: dict[int, Group] = {}
        """Admitted and not yet trained, by index: in flight (no trajectories yet) or finished."""
        self.stats = BufferStats()
        self.error: BaseException | None = None
        """Set by `fail`: the trainer's next `take` raises it."""
        self._changed = asyncio.Event()

    # ---- the rollout side ------------------------------------------------------------------------------
    def can_admit(self, version: int) -> bool:
        return self.admitted < (version + self.max_staleness + 1) * self.batch_size

    def admit(self, row_index: int, version: int) -> Group:
        if not self.can_admit(version):
            raise RuntimeError(f"admission closed at version {version}: {self.admitted} groups admitted for "
                               f"batch size {self.batch_size} and max_staleness {self.max_staleness}")
        group = Group(self.admitted, row_index, version, version + self.max_staleness + 1)
        self.admitted += 1
        self.pending[group.index] = group
        return group

    def finish(self, group: Group, trajectories: list[Trajectory]) -> None:
        group.trajectories = trajectories
        self._notify()

    def fail(self, error: BaseException) -> None:
        """The rollout cannot go on (its server died, say): the trainer stops instead of waiting forever."""
        self.error = self.error or error
        self._notify()

    async def admission(self, version_of: Any) -> None:
        """Wait until a group may be admitted at the version `version_of()` returns (it changes at updates)."""
        while not self.can_admit(version_of()):
            await self._wait()

    # ---- the trainer side ------------------------------------------------------------------------------
    async def take(self, step: int) -> list[Group]:
        """The `batch_size` pending groups with the earliest deadlines (finished ones first among equal deadlines)
        for training step `step`, once all of them have finished."""
        t0 = time.perf_counter()
        while (batch := self._next_batch()) is None:
            if self.error is not None:
                raise self.error
            await self._wait()
        self.stats.wait_s += time.perf_counter() - t0
        for group in batch:
            del self.pending[group.index]
            self.stats.staleness[step - 1 - group.oldest_version] += 1
            for traj in group.trajectories or []:
                self.stats.versions_per_trajectory[len(traj.policy_versions)] += 1
        self.trained += len(batch)
        self._notify()  # admission may open once versions move on
        return batch

    def _next_batch(self) -> list[Group] | None:
        order = sorted(self.pending.values(), key=lambda g: (g.deadline, g.trajectories is None, g.index))
        batch = order[: self.batch_size]
        if len(batch) < self.batch_size or any(g.trajectories is None for g in batch):
            return None
        return batch

    @property
    def depth(self) -> int:
        """Finished groups waiting to be trained."""
        return sum(g.trajectories is not None for g in self.pending.values())

    @property
    def in_flight(self) -> int:
        return sum(g.trajectories is None for g in self.pending.values())

    @property
    def lost(self) -> int:
        """Admitted groups that are neither in flight, buffered nor trained (`async/lost`): 0, always; anything
        else is a bug that lost prompts (the module docstring's guarantee)."""
        return self.admitted - self.trained - len(self.pending)

    def version_changed(self) -> None:
        """Call after a weight update: admission may open."""
        self._notify()

    def _notify(self) -> None:
        self._changed.set()

    async def _wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    # ---- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything admitted and not trained: finished groups with their trajectories, in-flight ones by row."""
        return {
            "admitted": self.admitted, "trained": self.trained, "reissued": self.stats.reissued,
            "groups": [{"index": g.index, "row_index": g.row_index, "admitted_version": g.admitted_version,
                        "deadline": g.deadline,
                        "trajectories": None if g.trajectories is None else [t.to_json() for t in g.trajectories]}
                       for g in sorted(self.pending.values(), key=lambda g: g.index)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> list[Group]:
        """Restore the buffer; returns the groups that were in flight, to be re-issued by the caller."""
        self.admitted, self.trained = state["admitted"], state["trained"]
        self.stats.reissued = state.get("reissued", 0)
        self.pending, reissue = {}, []
        for g in state["groups"]:
            trajs = g["trajectories"]
            group = Group(g["index"], g["row_index"], g["admitted_version"], g["deadline"],
                          None if trajs is None else [Trajectory.from_json(t) for t in trajs])
            self.pending[group.index] = group
            if trajs is None:
                group.reissued = True
                reissue.append(group)
        self.stats.reissued += len(reissue)
        return reissue


# ---------------------------------------------------------------------------------------------------
# The rollout side: admit, roll out, hand over
# ---------------------------------------------------------------------------------------------------
async def produce(rollout: Rollout, buffer: TrajectoryBuffer, rows: Sequence[dict[str, Any]], n: int,
                  next_row: Callable[[], int], version_of: Callable[[], int], reissue: Sequence[Group] = ()) -> None:
    """Keep the buffer fed until cancelled: re-issue `reissue`, then admit a group whenever the buffer's rule
    allows (`next_row()` picks its prompt, `version_of()` is the engine's version) and roll it out as its own
    task, so slow groups never hold up fast ones. A rollout that raises stops training (`buffer.fail`): a group
    that can never finish must not leave the trainer waiting for it."""
    running: set[asyncio.Task] = set()

    def start(group: Group) -> None:
        task = asyncio.create_task(_roll_out(rollout, buffer, group, rows[group.row_index], n))
        running.add(task)
        task.add_done_callback(running.discard)

    try:
        for group in reissue:
            start(group)
        while True:
            await buffer.admission(version_of)
            start(buffer.admit(next_row(), version_of()))
    finally:
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def _roll_out(rollout: Rollout, buffer: TrajectoryBuffer, group: Group, row: dict[str, Any], n: int) -> None:
    try:
        trajectories = [t async for t in rollout.stream([row], n, id_prefix=f"g{group.index}-")]
    except asyncio.CancelledError:
        raise
    except Exception as e:
        buffer.fail(RuntimeError(f"the rollout of group {group.index} (row {group.row_index}) raised "
                                 f"{type(e).__name__}: {e}"))
        return
    buffer.finish(group, sorted(trajectories, key=lambda t: (t.sample_index, t.id)))
