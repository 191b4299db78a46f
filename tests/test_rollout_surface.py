"""The one rollout surface: `run_groups` over any `Rollout.stream`, `score`, and `drain` (the queue that the
Ray and remote rollouts stream through)."""

from __future__ import annotations

import asyncio

import pytest

from turnrl.rollout import drain, run_groups, score
from turnrl.types import TerminationReason, Trajectory


def traj(group: str, k: int, reward: float | None = None) -> Trajectory:
    t = Trajectory(id=f"{group}-{k}", group_id=group, sample_index=k, prompt_ids=[1], sample={})
    t.finish(TerminationReason.ENV_DONE)
    t.reward = reward
    return t


class ReversedRollout:
    """A Rollout whose stream finishes trajectories in reverse order (any object with `stream` will do)."""

    engine = renderer = sampling = None

    async def stream(self, rows, n=1, *, id_prefix="", sampling=None):
        for i in reversed(range(len(rows))):
            for k in reversed(range(n)):
                yield traj(f"{id_prefix}{rows[i].get('id', i)}", k)


def test_run_groups_puts_groups_in_row_order_and_samples_in_index_order():
    seen = []
    groups = asyncio.run(run_groups(ReversedRollout(), [{"id": "a"}, {}], n=2, id_prefix="s1-",
                                    on_trajectory=lambda t: seen.append(t.id)))
    assert [[t.id for t in g] for g in groups] == [["s1-a-0", "s1-a-1"], ["s1-1-0", "s1-1-1"]]
    assert seen == ["s1-1-1", "s1-1-0", "s1-a-1", "s1-a-0"]  # as they arrived


def test_score_keeps_an_agent_reward_awaits_async_ones_and_records_errors():
    async def async_reward(t):
        return 0.5

    def broken(t):
        raise KeyError("answer")

    kept, awaited, failed = traj("g", 0, reward=1.0), traj("g", 1), traj("g", 2)
    asyncio.run(score(kept, broken))
    asyncio.run(score(awaited, async_reward))
    asyncio.run(score(failed, broken))
    assert (kept.reward, awaited.reward, failed.reward) == (1.0, 0.5, None)
    assert failed.reward_error == "KeyError: 'answer'" and kept.reward_error is None


def test_drain_yields_as_put_raises_after_what_came_first_and_cancels_the_rest():
    cancelled = []

    async def two(put):
        put(traj("a", 0))
        await asyncio.sleep(0.01)
        put(traj("a", 1))

    async def dies(put):
        await asyncio.sleep(0.02)
        put(traj("b", 0))
        raise RuntimeError("worker died")

    async def forever(put):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append("forever")
            raise

    async def collect(producers):
        got = []
        with pytest.raises(RuntimeError, match="worker died"):
            async for t in drain(producers):
                got.append(t.id)
        return got

    assert asyncio.run(collect([two, dies, forever])) == ["a-0", "a-1", "b-0"]
    assert cancelled == ["forever"]


def test_leaving_a_drain_early_cancels_its_producers():
    cancelled = []

    async def endless(put):
        try:
            while True:
                put(traj("a", 0))
                await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def first():
        stream = drain([endless, endless])
        async for t in stream:
            await stream.aclose()
            return t.id

    assert asyncio.run(first()) == "a-0" and cancelled == [True, True]
