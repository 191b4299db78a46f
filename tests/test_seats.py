"""turnrl.envs.seats: a Table's seats take turns, see only what the game shows them, end together; a game that
fails, or a seat that leaves, stops the others with a message, never a hang."""

from __future__ import annotations

import asyncio
import time

import pytest

from turnrl.envs.base import EnvError, EpisodeEnv
from turnrl.envs.seats import Table
from turnrl.types import BranchKind, RolloutStatus, TerminationReason


class Count(Table):
    """Two seats say numbers in turn; the game ends when the sum reaches `to`: the seat that reached it wins."""

    def __init__(self, to=5, broken_at=None, pad=0):
        super().__init__("count", 2, call_timeout_s=5)
        self.to, self.broken_at, self.pad, self.total, self.turn, self.shut = to, broken_at, pad, 0, 0, 0

    def start(self):
        self.total = 0

    def to_move(self):
        return self.turn % 2

    def observation(self, seat, first):
        return [{"role": "user", "content": f"seat {seat}: total {self.total}" if first
                 else f"total {self.total}" + " go on" * self.pad}]

    def play(self, seat, reply):
        if self.broken_at is not None and self.turn == self.broken_at:
            raise RuntimeError("the game broke")
        self.total += int(reply)
        self.turn += 1
        return self.total >= self.to, {"said": reply}

    def outcome(self):
        winner = (self.turn - 1) % 2
        return {winner: 1.0, 1 - winner: -1.0}, {"total": self.total}

    def shutdown(self):
        self.shut += 1


async def play(table, replies, stop_after=None):
    async def seat(k):
        env = table.seats()[k]
        seen = [await env.reset()]
        try:
            for n, reply in enumerate(replies[k], 1):
                step = await env.step(reply)
                seen.append(step)
                if step.done or n == stop_after:
                    return seen
            return seen
        finally:
            await env.close()

    return await asyncio.wait_for(asyncio.gather(seat(0), seat(1), return_exceptions=True), 10)


def test_turns_rewards_and_shutdown():
    table = Count(to=5)
    s0, s1 = asyncio.run(play(table, [["1", "1", "1"], ["1", "1", "1"]]))
    assert s0[0] == [{"role": "user", "content": "seat 0: total 0"}]
    assert s1[0] == [{"role": "user", "content": "seat 1: total 1"}]
    assert s0[1].observation == [{"role": "user", "content": "total 2"}] and s0[1].info == {"said": "1"}
    assert s0[-1].done and s1[-1].done and len(s0) == 4 and len(s1) == 3  # seat 0 said the fifth
    assert (s0[-1].reward, s1[-1].reward) == (1.0, -1.0)
    assert s1[-1].rollout_infos == {"total": 5, "seat": 1}
    assert table.shut == 1


def test_a_failing_game_stops_every_seat():
    table = Count(to=9, broken_at=2)
    s0, s1 = asyncio.run(play(table, [["1"] * 5, ["1"] * 5]))
    assert isinstance(s0, RuntimeError) and "the game broke" in str(s0)
    assert isinstance(s1, EnvError) and "the game failed on seat 0's move" in str(s1)
    assert table.rewards is None and table.shut == 1


def test_a_seat_that_leaves_stops_the_others():
    table = Count(to=9)
    s0, s1 = asyncio.run(play(table, [["1"] * 5, ["1"] * 5], stop_after=1))
    assert not isinstance(s0, BaseException) and len(s0) == 2 and not s0[-1].done
    assert isinstance(s1, EnvError) and "seat 0's trajectory ended before the game did" in str(s1)


def test_a_table_needs_two_seats():
    with pytest.raises(EnvError, match="at least 2 seats"):
        Table("solo", 1)


def _manager(tok, script, to=4, pad=0, **limits):
    from fakes import ScriptedEngine

    from turnrl.agents import AGENTS
    from turnrl.render import ChatRenderer
    from turnrl.rollout import RolloutLimits, RolloutManager

    return RolloutManager(ScriptedEngine(tok, script), ChatRenderer(tok), agents={"env_agent": AGENTS["env_agent"]},
                          env_factory=lambda sample, config: Count(to, pad=pad), limits=RolloutLimits(max_turns=4, **limits))


async def test_env_agent_plays_every_seat_of_a_table_as_one_episode(qwen3_tokenizer):
    manager = _manager(qwen3_tokenizer, lambda rid, turn, prompt: "1")
    trajs = {t.id: t for t in [t async for t in manager.stream([{"id": "q"}], n=2)]}
    assert sorted(trajs) == ["q-0", "q-0.s1", "q-1", "q-1.s1"]
    for k in (0, 1):
        first, second = trajs[f"q-{k}"], trajs[f"q-{k}.s1"]
        assert first.parent is None and first.episode_id == second.episode_id == first.id
        assert second.parent.id == first.id and second.parent.kind == BranchKind.SEAT
        assert (first.reward, second.reward) == (-1.0, 1.0)  # 1+1+1+1: seat 1 said the fourth
        assert first.num_turns == second.num_turns == 2 and first.status == second.status == RolloutStatus.COMPLETED
        assert first.messages[0]["content"] == "seat 0: total 0" and second.messages[0]["content"] == "seat 1: total 1"


async def test_a_trajectory_timeout_keeps_every_seat(qwen3_tokenizer):
    def slow(rid, turn, prompt):
        if rid.endswith(".s1") and turn == 2:
            time.sleep(1.0)
        return "1"

    manager = _manager(qwen3_tokenizer, slow, trajectory_timeout_s=0.5)
    trajs = {t.id: t for t in [t async for t in manager.stream([{"id": "q"}])]}
    assert sorted(trajs) == ["q-0", "q-0.s1"]
    assert trajs["q-0"].termination_reason == TerminationReason.TIMEOUT
    assert trajs["q-0.s1"].termination_reason == TerminationReason.CANCELLED
    assert trajs["q-0.s1"].parent.kind == BranchKind.SEAT and trajs["q-0.s1"].episode_id == "q-0"
    assert trajs["q-0.s1"].num_turns == 2 and trajs["q-0.s1"].reward is None


def test_a_seat_step_is_bounded_by_the_table_not_by_env_timeout_s():
    assert EpisodeEnv.of(Count().seats()[0], timeout_s=60).timeout_s is None
    with pytest.raises(EnvError, match="the env_agent drives its seats"):
        EpisodeEnv.of(Count())
    plain = type("Plain", (), {"step": lambda self, text: None})()
    assert EpisodeEnv.of(plain, timeout_s=60).timeout_s == 60


async def test_a_seat_that_compacts_stays_in_its_seat_and_the_episode(qwen3_tokenizer):
    from turnrl.rollout.context import ContextPolicy

    manager = _manager(qwen3_tokenizer, lambda rid, turn, prompt: "1", to=6, pad=30, max_new_tokens=8,
                       context=ContextPolicy(max_tokens=100, strategy="drop_observations", keep_last_turns=0))
    trajs = {t.id: t for t in [t async for t in manager.stream([{"id": "q"}])]}
    compacted = sorted(i for i in trajs if ".c" in i)
    assert compacted == ["q-0.c1", "q-0.s1.c1"], sorted(trajs)  # each seat compacted once, under its own id
    for i in compacted:
        assert trajs[i].parent.kind == BranchKind.COMPACTION and trajs[i].parent.id.split(".c")[0] == i.split(".c")[0]
    assert {t.episode_id for t in trajs.values()} == {"q-0"}
    assert trajs["q-0.s1"].parent.kind == BranchKind.SEAT and trajs["q-0.s1"].parent.id == "q-0"
    for t in trajs.values():  # every branch of a seat has that seat's game reward
        assert t.reward == (1.0 if t.id.startswith("q-0.s1") else -1.0), (t.id, t.reward, t.error)
