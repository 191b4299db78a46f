"""The scheduling harness (turnrl.testing.latency): fake accelerator, latency tool env, lockstep (synchronous) schedule."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from turnrl.agents import AGENTS
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutLimits, RolloutManager, run_groups
from turnrl.testing.latency import LatencyDraw, LatencyEngine, LockstepEngine, build_env, latency_rows
from turnrl.types import SamplingParams, TerminationReason


def run(coro):
    return asyncio.run(coro)


def test_latency_engine_batches_like_a_continuous_batching_server():
    async def calls(k, max_new):
        engine = LatencyEngine([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], per_token_s=0.001, max_batch=8)
        params = SamplingParams(max_new_tokens=max_new)
        outs = await asyncio.gather(*(engine.generate([0], params, request_id=f"r{i}") for i in range(k)))
        return engine.stats, outs

    stats, outs = run(calls(1, 10))
    assert stats["steps"] == 10  # one call of 10 tokens: 10 steps
    assert outs[0].token_ids == list(range(1, 11)) and outs[0].finish_reason == "stop"
    stats, _ = run(calls(8, 10))
    assert (stats["steps"], stats["max_running"]) == (10, 8)  # 8 calls share every step
    stats, outs = run(calls(16, 4))
    assert (stats["steps"], stats["tokens"]) == (8, 64)  # 16 calls, batch limit 8: two waves of 4 steps
    assert outs[0].token_ids == [1, 2, 3, 4] and outs[0].finish_reason == "length"


def test_latency_rows_draw_heavy_tailed_latencies_with_the_given_mean():
    rows = latency_rows(4000, LatencyDraw(mean_s=0.5, sigma=1.0, seed=1))
    turns = [len(r["latencies_s"]) for r in rows]
    draws = [x for r in rows for x in r["latencies_s"]]
    assert set(turns) == {1, 2, 3, 4, 5, 6}
    assert statistics.mean(draws) == pytest.approx(0.5, rel=0.08)
    assert statistics.median(draws) < 0.5 * 0.7  # lognormal: median = mean * exp(-sigma^2 / 2) ~ 0.61 mean
    slow = latency_rows(4000, LatencyDraw(mean_s=1.0, sigma=1.0, seed=1))
    fixed = latency_rows(4000, LatencyDraw(mean_s=0.5, sigma=0.0, seed=1))
    assert [len(r["latencies_s"]) for r in slow] == turns == [len(r["latencies_s"]) for r in fixed]
    assert slow[0]["latencies_s"] == pytest.approx([2 * x for x in rows[0]["latencies_s"]])  # same normal draws
    assert all(x == pytest.approx(0.5) for r in fixed for x in r["latencies_s"])


def manager(tok, engine, concurrency=64):
    return RolloutManager(
        engine, ChatRenderer(tok), agents=AGENTS, env_factory=build_env, concurrency=concurrency,
        limits=RolloutLimits(max_turns=8, max_new_tokens=4), sanity_mode="disable",
    )


async def timed(mgr, rows):
    t0 = time.perf_counter()
    groups = await run_groups(mgr, rows)
    return time.perf_counter() - t0, [t for g in groups for t in g]


def test_lockstep_schedule_waits_for_the_slowest_tool_of_each_turn(qwen3_tokenizer):
    # a: slow tool on turn 1, b: slow tool on turn 2, c: one quick turn. Async: every chain is ~0.3 s.
    # Lockstep: turn 2 starts after a's 0.3 s tool, and b's 0.3 s tool comes after that: ~0.6 s.
    rows = [{"id": "a", "prompt": "a", "latencies_s": [0.3, 0.0]},
            {"id": "b", "prompt": "b", "latencies_s": [0.0, 0.3]},
            {"id": "c", "prompt": "c", "latencies_s": [0.0]}]
    reply = qwen3_tokenizer.encode("ok")

    async def both():
        async_s, async_trajs = await timed(manager(qwen3_tokenizer, LatencyEngine(reply, per_token_s=0.002)), rows)
        lockstep = LockstepEngine(LatencyEngine(reply, per_token_s=0.002), parties=len(rows))
        sync_s, sync_trajs = await timed(manager(qwen3_tokenizer, lockstep), rows)
        return async_s, async_trajs, sync_s, sync_trajs, lockstep.batches

    async_s, async_trajs, sync_s, sync_trajs, batches = run(both())
    assert batches == [3, 2]  # every live trajectory in each turn's batch
    assert [t.response_ids for t in async_trajs] == [t.response_ids for t in sync_trajs]  # same work
    assert [t.num_turns for t in sync_trajs] == [2, 2, 1]
    assert all(t.termination_reason == TerminationReason.ENV_DONE for t in async_trajs + sync_trajs)
    assert async_s < 0.45 and sync_s > 0.58, (async_s, sync_s)


def test_a_failing_tool_fails_only_its_trajectory_and_frees_the_lockstep(qwen3_tokenizer):
    rows = [{"id": "ok", "prompt": "p", "latencies_s": [0.0, 0.0, 0.0]},
            {"id": "bad", "prompt": "p", "latencies_s": [0.0, 0.0, 0.0], "fail_on_turn": 1}]
    engine = LockstepEngine(LatencyEngine(qwen3_tokenizer.encode("ok"), per_token_s=0.001), parties=2)
    _, (ok, bad) = run(asyncio.wait_for(timed(manager(qwen3_tokenizer, engine), rows), 10))
    assert (ok.num_turns, ok.termination_reason) == (3, TerminationReason.ENV_DONE)
    assert (bad.status, bad.termination_reason) == ("failed", TerminationReason.ENV_ERROR)
    assert "fail_on_turn" in bad.error
    assert engine.batches == [2, 1, 1]
