"""Adaptive admission (`rollout.concurrency: auto`) on the latency harness with a KV budget: the limit follows the
engine's KV cache, a preemption or the hard cap cuts it, the staleness bound and the ledger still hold, and a
fixed limit behaves as the old semaphore did."""

from __future__ import annotations

import asyncio

import pytest

from turnrl.agents import AGENTS
from turnrl.config import RolloutConfig
from turnrl.engines.base import KVStats
from turnrl.engines.router import Router
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutLimits, RolloutManager
from turnrl.rollout.admission import Admission, AdmissionSettings, admission_cost
from turnrl.testing.latency import LatencyDraw, LatencyEngine, build_env, latency_rows, simulate_training
from turnrl.train.buffer import TrajectoryBuffer


class Reports:
    """An engine stand-in whose KV report the test sets (only `kv_stats` is read by admission)."""

    def __init__(self):
        self.occupancy, self.preemptions = 0.1, 0

    def kv_stats(self):
        return KVStats(self.occupancy, self.preemptions)


async def test_auto_grows_with_headroom_and_cuts_on_preemption_and_the_caps():
    engine, now = Reports(), [0.0]
    gate = Admission(AdmissionSettings("auto", kv_soft_cap=0.8, kv_hard_cap=0.9, initial=2), engine,
                     clock=lambda: now[0])
    for _ in range(2):
        await gate.acquire()
    gate.tick()  # reads 10% occupancy
    assert gate.limit == 2
    gate.release(1, held_s=1.0)  # slow start: each finished trajectory adds slots (clocked by completions):
    assert gate.limit == 3 and gate.round_trip(now[0]) == 1.0  # 2 - 0.1 / (0.8 / 2) = 1.75 of them at 10%
    for _ in range(2):
        await gate.acquire()
    gate.release(1, held_s=1.0)
    assert gate.limit == 5  # 0.75 + 1.75 credit
    for _ in range(2):
        await gate.acquire()
    assert gate.in_flight == 4
    engine.preemptions = 1  # a preemption cuts to 0.7 of what is in flight
    now[0] = 0.5
    gate.tick()
    assert gate.limit == 2 and gate.preemptions == 1  # floor(4 * 0.7)
    engine.preemptions = 2
    now[0] = 1.0
    gate.tick()  # one cut per round trip
    assert gate.limit == 2 and gate.preemptions == 2
    gate.release(1, held_s=1.0)
    assert gate.limit == 2  # and no growth within a round trip of a preemption
    for _ in range(2):
        gate.release(1, held_s=1.0)
    engine.occupancy = 0.95  # past the hard cap nothing is admitted at all
    now[0] = 2.3
    gate.tick()
    assert gate.limit == 1  # and it halves
    waiter = asyncio.ensure_future(gate.acquire())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    engine.occupancy = 0.2
    gate.release(1, held_s=1.0)
    now[0] = 2.4
    gate._maybe_tick()
    gate._wake()
    await asyncio.wait_for(waiter, 1)  # back under the cap: admitted
    stats = gate.stats()
    assert stats["concurrency"] >= 1 and stats["kv_occupancy"] == pytest.approx(0.2) and stats["preemptions"] == 2
    gate.limit = 10
    for _ in range(9):
        await gate.acquire()
    engine.occupancy = 0.85  # past the soft cap: cut by a tenth
    now[0] = 4.0
    gate.tick()
    assert gate.limit == 9


async def test_after_a_cut_auto_closes_half_the_gap_to_the_capacity_estimate_per_round_trip():
    """Past slow start the limit grows toward in_flight * soft cap / occupancy (prime-rl's n = kappa * C / G) by half
    the gap per round trip (a round trip: as many finished trajectories as the limit), at least a twentieth."""
    now = [0.0]
    gate = Admission(AdmissionSettings("auto", kv_soft_cap=0.8, kv_hard_cap=0.9, initial=32), None,
                     clock=lambda: now[0])

    class Cache:  # each trajectory holds 1/80 of the KV cache: the estimate is 0.8 * 80 = 64 trajectories
        def kv_stats(self):
            return KVStats(gate.in_flight / 80, 0)

    gate.engine, gate.cuts = Cache(), 1  # after a cut: no slow start

    async def round_trip() -> None:  # as many trajectories finish as the limit, each replaced at once
        for _ in range(gate.limit):
            now[0] += 0.01
            gate.release(1, held_s=0.001)
            while gate.in_flight < gate.limit:
                await gate.acquire()

    while gate.in_flight < gate.limit:
        await gate.acquire()
    seen = []
    for _ in range(8):
        await round_trip()
        seen.append(gate.limit)
    assert 40 <= seen[0] <= 48  # about half the gap of 64 - 32 (a twentieth would be + 1)
    assert seen[1] - seen[0] >= (64 - seen[0]) // 4 and seen == sorted(seen)
    assert seen[-1] >= 62 and max(seen) <= 66, seen  # there, and not past the estimate (read a tick ago: +-1 or 2)


async def test_a_fixed_limit_is_a_gate_of_that_many_slots_and_costs_count():
    gate = Admission(AdmissionSettings(3), Reports())
    await gate.acquire(2)
    second = asyncio.ensure_future(gate.acquire(2))
    await asyncio.sleep(0.01)
    assert not second.done() and gate.in_flight == 2
    gate.release(2)
    await asyncio.wait_for(second, 1)
    big = asyncio.ensure_future(gate.acquire(5))  # more than the limit: runs alone once the gate is empty
    await asyncio.sleep(0.01)
    assert not big.done()
    gate.release(2)
    await asyncio.wait_for(big, 1)
    gate.tick()
    assert gate.limit == 3  # a fixed limit never moves


def test_settings_and_costs_are_checked():
    with pytest.raises(ValueError, match="concurrency"):
        AdmissionSettings(0)
    with pytest.raises(ValueError, match="kv_soft_cap"):
        AdmissionSettings("auto", kv_soft_cap=0.9, kv_hard_cap=0.5)
    with pytest.raises(ValueError, match="kv_soft_cap"):
        RolloutConfig(concurrency="auto", kv_soft_cap=0.9, kv_hard_cap=0.5)
    assert RolloutConfig(concurrency="auto").concurrency == "auto"

    def fan_out(ctx, row): ...
    fan_out.admission_cost = lambda row: row["agents"]  # type: ignore[attr-defined]
    assert admission_cost(fan_out, {"agents": 3}) == 3 and admission_cost(AGENTS["env_agent"], {}) == 1
    with pytest.raises(ValueError, match="admission_cost"):
        admission_cost(fan_out, {"agents": 0})


def test_a_router_reports_its_fullest_replica():
    a, b = Reports(), Reports()
    a.occupancy, b.occupancy, b.preemptions = 0.3, 0.7, 2
    report = Router({"a": a, "b": b}).kv_stats()  # type: ignore[dict-item]
    assert report == KVStats(0.7, 2)


def kv_harness(tokenizer, concurrency, *, kv_tokens=1500):
    reply = tokenizer("It is done, and here is the answer in a few more words.", add_special_tokens=False)["input_ids"]
    engine = LatencyEngine(reply, per_token_s=0.002, max_batch=32, kv_tokens=kv_tokens, prefill_per_token_s=1e-5)
    manager = RolloutManager(engine, ChatRenderer(tokenizer), agents=AGENTS, env_factory=build_env,
                             limits=RolloutLimits(max_turns=8, max_new_tokens=16), sanity_mode="disable",
                             admission=AdmissionSettings(concurrency, kv_soft_cap=0.7, kv_hard_cap=0.9))
    return engine, manager


async def test_latency_engine_kv_budget_preempts_when_overfilled(qwen3_tokenizer):
    rows = latency_rows(48, LatencyDraw(mean_s=0.02, sigma=1.0, seed=5))
    engine, manager = kv_harness(qwen3_tokenizer, 48, kv_tokens=1200)
    trajs = [t async for t in manager.stream(rows)]
    assert len(trajs) == 48 and all(t.status.value == "completed" for t in trajs)
    assert engine.stats["preemptions"] > 0  # 48 trajectories' KV does not fit in 1200 tokens
    assert manager.stats()["preemptions"] == engine.stats["preemptions"]


@pytest.mark.parametrize("staleness", [0, 2])
async def test_auto_keeps_the_staleness_bound_and_the_ledger(qwen3_tokenizer, staleness):
    rows = latency_rows(24, LatencyDraw(mean_s=0.03, sigma=1.5, seed=3))
    engine, manager = kv_harness(qwen3_tokenizer, "auto")
    buffer = TrajectoryBuffer(4, staleness)
    run = await simulate_training(manager, engine, rows, steps=6, update_s=0.02, n=2, buffer=buffer)
    for step, groups in run.steps:
        assert len(groups) == 4
        for g in groups:
            assert 0 <= step - 1 - g.oldest_version <= staleness
            assert len(g.trajectories) == 2
    assert max(buffer.stats.staleness) <= staleness and buffer.stats.dropped == 0
    assert buffer.trained == 24  # every admitted group trained once: nothing lost, nothing twice
    assert sorted(g.index for _, groups in run.steps for g in groups) == list(range(24))
    stats = manager.stats()
    assert stats["concurrency"] >= 1 and 0 <= stats["kv_occupancy"] <= 1


async def test_the_embedded_engine_reports_its_prefix_cache(tiny_qwen3):
    from turnrl.engines.embedded import EmbeddedEngine
    from turnrl.types import SamplingParams

    engine = EmbeddedEngine(tiny_qwen3, prefix_cache_tokens=64)
    try:
        for i in range(4):  # four live trajectories of ~33 KV tokens each into a cache of 64
            await engine.generate(list(range(10, 40)), SamplingParams(max_new_tokens=4), request_id=f"r{i}")
        report = engine.kv_stats()
        assert report is not None and 0 < report.occupancy <= 1 and report.preemptions == 3  # three pushed out
        await engine.release("r3")
        assert engine.kv_stats() == KVStats(0.0, 3)  # released: freed, not counted as a preemption
    finally:
        engine.close()
    no_cache = EmbeddedEngine(tiny_qwen3, prefix_cache_tokens=0)
    try:
        assert no_cache.kv_stats() is None
    finally:
        no_cache.close()
