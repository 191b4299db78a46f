"""The trajectory buffer's staleness rule on the latency harness: bounded staleness, nothing dropped or starved,
sync mode as K = 0, failures that stop the trainer instead of hanging it, checkpoints that lose no prompt."""

from __future__ import annotations

import asyncio
import json

import pytest

from turnrl.agents import AGENTS
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutLimits, RolloutManager
from turnrl.testing.latency import LatencyDraw, LatencyEngine, build_env, latency_rows, simulate_training
from turnrl.train.buffer import TrajectoryBuffer, produce


def harness(tokenizer, rows, *, per_token_s=0.002):
    engine = LatencyEngine(tokenizer("It is done.", add_special_tokens=False)["input_ids"], per_token_s=per_token_s)
    manager = RolloutManager(engine, ChatRenderer(tokenizer), agents=AGENTS, env_factory=build_env,
                             limits=RolloutLimits(max_turns=8, max_new_tokens=8), sanity_mode="disable")
    return engine, manager


async def train(manager, engine, rows, *, batch, staleness, steps, n=2, step_s=0.05, buffer=None, reissue=()):
    run = await simulate_training(manager, engine, rows, steps=steps, update_s=step_s, n=n, reissue=reissue,
                                  buffer=buffer or TrajectoryBuffer(batch, staleness))
    return run.buffer, run.steps


@pytest.mark.parametrize("staleness", [0, 1, 2])
async def test_staleness_never_exceeds_the_bound_and_every_group_is_trained_in_deadline_order(qwen3_tokenizer, staleness):
    rows = latency_rows(24, LatencyDraw(mean_s=0.05, sigma=1.5, seed=3))  # heavy-tailed tools, 1-6 turns
    engine, manager = harness(qwen3_tokenizer, rows)
    buffer, trained = await train(manager, engine, rows, batch=4, staleness=staleness, steps=6)
    for step, groups in trained:
        assert len(groups) == 4
        for g in groups:
            assert 0 <= step - 1 - g.oldest_version <= staleness  # measured at the step that trains it
            assert g.deadline >= step and g.admitted_version <= g.oldest_version
            assert all(len(t.policy_versions) >= 1 for t in g.trajectories)
    assert max(buffer.stats.staleness) <= staleness and buffer.stats.dropped == 0
    assert buffer.trained == 24 and sum(buffer.stats.staleness.values()) == 24
    if staleness == 0:  # synchronous: a step trains exactly the groups admitted at its version, all fresh
        assert [sorted(g.index for g in groups) for _, groups in trained] == [
            list(range(4 * k, 4 * k + 4)) for k in range(6)]
        assert set(buffer.stats.staleness) == {0}


async def test_long_episodes_are_waited_for_not_starved(qwen3_tokenizer):
    # one very slow group per batch; K=1 lets fast groups overtake it, but its deadline makes the trainer wait
    rows = [{"id": f"r{i}", "prompt": "Go.", "latencies_s": [0.6, 0.6] if i % 4 == 0 else [0.01]} for i in range(16)]
    engine, manager = harness(qwen3_tokenizer, rows)
    buffer, trained = await train(manager, engine, rows, batch=4, staleness=1, steps=4, n=1)
    slow = [g.row_index for _, groups in trained for g in groups if g.row_index % 4 == 0]
    assert sorted(slow) == [0, 4, 8, 12]  # every slow episode trained, none dropped
    assert max(buffer.stats.staleness) <= 1 and buffer.stats.wait_s > 0.3  # ... because the trainer waited


async def test_partial_rollouts_continue_across_updates_with_the_new_version(qwen3_tokenizer):
    rows = [{"id": f"r{i}", "prompt": "Go.", "latencies_s": [0.05] * 6} for i in range(8)]
    engine, manager = harness(qwen3_tokenizer, rows)
    _, trained = await train(manager, engine, rows, batch=2, staleness=2, steps=4, n=1, step_s=0.02)
    spanning = [t for _, groups in trained for g in groups for t in g.trajectories if len(t.policy_versions) > 1]
    assert spanning  # some trajectories went on under new weights ...
    for t in spanning:  # ... each model segment stamped with the version that sampled it, in order
        versions = [s.policy_version for s in t.segments if s.policy_version is not None]
        assert versions == sorted(versions)
        t.validate()


async def test_a_rollout_that_raises_stops_the_trainer_instead_of_hanging_it(qwen3_tokenizer):
    class Broken:
        engine, renderer, sampling = None, None, None

        async def stream(self, rows, n=1, *, id_prefix="", sampling=None, row_group_ids=None):
            raise ConnectionError("rollout server went away")
            yield  # pragma: no cover

    buffer = TrajectoryBuffer(2, 1)
    producer = asyncio.create_task(produce(Broken(), buffer, [{"prompt": "x"}], 1, lambda: 0, lambda: 0))
    with pytest.raises(RuntimeError, match="rollout server went away"):
        await asyncio.wait_for(buffer.take(1), 5)
    producer.cancel()
    await asyncio.gather(producer, return_exceptions=True)


async def test_a_checkpoint_loses_no_admitted_prompt(qwen3_tokenizer):
    rows = latency_rows(16, LatencyDraw(mean_s=0.05, sigma=1.0, seed=5))
    engine, manager = harness(qwen3_tokenizer, rows)
    buffer, _ = await train(manager, engine, rows, batch=2, staleness=2, steps=3)
    # the run stops here (a checkpoint after step 3): some groups are buffered, some still in flight
    state = json.loads(json.dumps(buffer.state_dict()))
    assert state["admitted"] == 6 + len(state["groups"])  # 3 steps of 2 trained, the rest pending
    resumed = TrajectoryBuffer(2, 2)
    reissue = resumed.load_state_dict(state)
    buffered = [g for g in resumed.pending.values() if g.trajectories is not None]
    assert len(buffered) + len(reissue) == len(state["groups"]) and resumed.stats.reissued == len(reissue)
    engine2, manager2 = harness(qwen3_tokenizer, rows)
    await engine2.update_weights({}, version=3)
    resumed, trained = await train(manager2, engine2, rows, batch=2, staleness=2, steps=6, buffer=resumed,
                                   reissue=reissue)
    trained_ids = {g.index for _, groups in trained for g in groups}
    assert {g["index"] for g in state["groups"]} <= trained_ids  # buffered and re-issued groups were all trained
    assert resumed.trained == 12 and max(resumed.stats.staleness) <= 2
    assert buffer.lost == 0 and resumed.lost == 0  # every admitted group is in flight, buffered or trained
    resumed.pending.pop(next(iter(resumed.pending)))  # a group that vanished without being trained ...
    assert resumed.lost == 1  # ... is what async/lost counts


@pytest.mark.parametrize("pause", ["keep", "wait", "abort"])
async def test_a_weight_update_mid_turn_keeps_tokens_versions_and_masks(qwen3_tokenizer, pause):
    from turnrl.rollout import RolloutContext, drive
    from turnrl.testing.latency import LatencyToolEnv
    from turnrl.types import SamplingParams, SegmentSource

    reply = qwen3_tokenizer("one two three four five six seven eight nine ten", add_special_tokens=False)["input_ids"]
    engine = LatencyEngine(reply, per_token_s=0.02)
    ctx = RolloutContext(engine=engine, renderer=ChatRenderer(qwen3_tokenizer), sampling=SamplingParams(),
                         limits=RolloutLimits(max_turns=2, max_new_tokens=len(reply)), trajectory_id="t",
                         group_id="g", sample_index=0, sample={"prompt": "Go."}, sanity_mode="disable")
    task = asyncio.create_task(drive(ctx, LatencyToolEnv([0.0, 0.0])))
    while not (engine._queue and len(engine._queue[0].versions) >= 3):  # a few tokens into the first turn
        await asyncio.sleep(0.005)
    await engine.update_weights({}, version=1, pause=pause)
    traj = await task
    traj.validate()
    model = [s for s in traj.segments if s.source == SegmentSource.MODEL]
    turn1 = [s for s in model if s.turn == 1]
    assert sum(len(s) for s in turn1) == len(reply)  # no token lost in any mode: the turn got its full budget
    if pause == "wait":  # the update waited for the running turn: all of it is version 0
        assert [s.policy_version for s in turn1] == [0]
    else:  # keep: the turn went on in place; abort: it was resubmitted with its tokens; either way split by version
        assert [s.policy_version for s in turn1] == [0, 1] and 3 <= len(turn1[0]) < len(reply)
    assert [s.policy_version for s in model if s.turn == 2] == [1]
    assert all(lp is not None for s in model for lp in s.logprobs)  # every model token keeps its logprob
