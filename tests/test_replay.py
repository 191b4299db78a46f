"""`turnrl replay`: recorded multi-turn trajectories re-issued call by call on the real embedded engine."""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from turnrl.agents import AGENTS
from turnrl.cli import app
from turnrl.engines.embedded import EmbeddedEngine
from turnrl.models import load_model
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutLimits, RolloutManager
from turnrl.rollout.replay import replay
from turnrl.testing.latency import build_env
from turnrl.types import SamplingParams

ROWS = [{"id": i, "prompt": f"Look up item {i} with the tool.", "latencies_s": [0.0, 0.01 * (i % 3), 0.0]}
        for i in range(10)]


def record(tokenizer, batch: int, seed: int | None = 7):
    """20 three-turn trajectories of tiny-qwen3 at T=1 on the embedded engine (KV reused across turns)."""
    renderer = ChatRenderer(tokenizer)
    engine = EmbeddedEngine(load_model("tiny-qwen3"), eos_token_ids=sorted(renderer.end_of_turn_ids),
                            max_batch_size=batch)
    manager = RolloutManager(engine, renderer, agents=AGENTS, env_factory=build_env, sanity_mode="disable",
                             sampling=SamplingParams(temperature=1.0, seed=seed),
                             limits=RolloutLimits(max_turns=3, max_new_tokens=12))

    async def run():
        return [t async for t in manager.stream(ROWS, 2)]

    try:
        return asyncio.run(run()), renderer
    finally:
        engine.close()


def replayed(trajs, renderer, batch: int):
    engine = EmbeddedEngine(load_model("tiny-qwen3"), eos_token_ids=sorted(renderer.end_of_turn_ids),
                            max_batch_size=batch)
    try:
        return [asyncio.run(replay(t, engine)) for t in trajs]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def alone(qwen3_tokenizer):
    return record(qwen3_tokenizer, batch=1)  # every call computed alone: the batch-invariant setting


def test_twenty_batched_trajectories_replay_token_for_token(qwen3_tokenizer):
    trajs, renderer = record(qwen3_tokenizer, batch=16)
    assert len(trajs) == 20 and all(t.num_turns == 3 for t in trajs)
    reports = replayed(trajs, renderer, batch=16)
    assert all(r.tokens_equal for r in reports) and sum(len(r.calls) for r in reports) == 60
    # recorded in batches of up to 16, replayed one call at a time: same tokens, logprobs equal to float noise
    assert max(r.max_logprob_diff for r in reports) < 1e-4


def test_calls_recorded_alone_replay_bit_for_bit(alone):
    trajs, renderer = alone
    reports = replayed(trajs, renderer, batch=1)
    assert all(r.bitwise for r in reports)


def test_unseeded_sampling_does_not_replay_and_says_so(qwen3_tokenizer):
    trajs, renderer = record(qwen3_tokenizer, batch=1, seed=None)
    reports = replayed(trajs[:6], renderer, batch=1)
    assert not all(r.tokens_equal for r in reports)  # unseeded draws differ: replay reports it, never hides it


def test_the_replay_command_reports_a_match_and_a_mismatch(alone, tmp_path):
    trajs, _ = alone
    path = tmp_path / "trajs.jsonl"
    tampered = trajs[1].to_json()
    first_model = next(s for s in tampered["segments"] if s["source"] == "model")
    tampered["response_ids"][first_model["start"]] ^= 1  # one recorded token changed
    path.write_text(json.dumps(trajs[0].to_json()) + "\n" + json.dumps(tampered) + "\n")
    runner = CliRunner()
    ok = runner.invoke(app, ["replay", str(path), "--id", trajs[0].id, "--model", "tiny-qwen3"])
    assert ok.exit_code == 0, ok.output
    assert "3 of 3 calls" in ok.output and "bit for bit" in ok.output
    bad = runner.invoke(app, ["replay", str(path), "--id", trajs[1].id, "--model", "tiny-qwen3"])
    assert bad.exit_code == 1 and "differs" in bad.output
    missing = runner.invoke(app, ["replay", str(path), "--id", "nope", "--model", "tiny-qwen3"])
    assert missing.exit_code == 2 and "no trajectory with id 'nope'" in missing.output


@pytest.mark.parametrize("row", [{"id": "x", "group_id": "g", "prompt_ids": [1], "response_ids": [], "loss_mask": []}])
def test_a_trajectory_without_recorded_calls_is_refused(row):
    from turnrl.types import Trajectory

    with pytest.raises(ValueError, match="cannot be replayed"):
        asyncio.run(replay(Trajectory.from_json(row), engine=None))
