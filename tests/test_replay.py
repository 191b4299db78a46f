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
    """20 three-turn trajectories of tiny-qwen3 at T=1 on the embedded engine (KV reused across turns). At batch 1
    without sharing prefixes across requests (a copied prefix was computed inside another prompt's prefill: equal
    to rounding, not bit for bit) every call is computed alone: the batch-invariant setting."""
    renderer = ChatRenderer(tokenizer)
    engine = EmbeddedEngine(load_model("tiny-qwen3"), eos_token_ids=sorted(renderer.end_of_turn_ids),
                            max_batch_size=batch, share_prefixes=batch > 1)
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


# ---- `turnrl replay` on a training run's own files (issue 27) ------------------------------------------
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 3-step tiny-qwen3 run that checkpoints every policy version (save_every=1, keep_checkpoints: null), trained through the CLI."""
    tmp = tmp_path_factory.mktemp("replay-run")
    data = tmp / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Say {i}."}) + "\n" for i in range(4)))
    (tmp / "reward.py").write_text("def reward(response):\n    return float(len(response) % 3)\n")
    config = tmp / "config.yaml"
    config.write_text(json.dumps({
        "model": "tiny-qwen3", "train_data": str(data), "output_dir": str(tmp / "runs"), "steps": 3,
        "prompts_per_step": 2, "seed": 5, "save_every": 1, "rollout": {"env": "single_turn", "n": 2,
                                                                      "max_new_tokens": 6},
        "engine": {"max_batch_size": 2}, "optim": {"lr": 1e-2}, "reward": {"function": f"{tmp / 'reward.py'}:reward"},
        "trainer": {"keep_checkpoints": None}}))
    result = CliRunner().invoke(app, ["train", str(config), "--run-dir", str(tmp / "run")])
    assert result.exit_code == 0, result.output
    return tmp / "run"


def _last_step(run) -> tuple[str, dict]:
    rows = [json.loads(line) for line in (run / "trajectories" / "last_step.jsonl").read_text().splitlines()]
    assert {r["turns"][0]["generate"]["policy_version"] for r in rows} == {2}  # step 3 sampled by version 2
    return rows[0]["id"], rows[0]


def test_replay_needs_no_model_inside_its_run_and_uses_the_version_that_sampled(run_dir):
    trajectory_id, _ = _last_step(run_dir)
    result = CliRunner().invoke(app, ["replay", str(run_dir / "trajectories" / "last_step.jsonl"), "--id", trajectory_id])
    assert result.exit_code == 0, result.output  # before: exit 2, "Missing option '--model'"
    assert "replaying with tiny-qwen3" in result.output and "version(s) 2" in result.output
    assert "1 of 1 calls give the same tokens" in result.output


def test_a_replay_with_other_weights_or_unseeded_says_why_it_differs(run_dir, tmp_path):
    trajectory_id, row = _last_step(run_dir)
    outside = tmp_path / "copied.jsonl"  # the file out of its run, replayed on the base model (version 0)
    outside.write_text(json.dumps(row) + "\n")
    result = CliRunner().invoke(app, ["replay", str(outside), "--id", trajectory_id])
    assert result.exit_code == 2 and "--model" in result.output and "does not lie in a training run" in result.output
    result = CliRunner().invoke(app, ["replay", str(outside), "--id", trajectory_id, "--model", "tiny-qwen3"])
    assert result.exit_code == 1, result.output
    assert "sampled by policy version 2 but replayed with the base model's weights" in result.output
    unseeded = {**row, "turns": [{**t, "generate": {**t["generate"], "seed": None}} for t in row["turns"]]}
    outside.write_text(json.dumps(unseeded) + "\n")  # the same call without its seed: another draw
    result = CliRunner().invoke(app, ["replay", str(outside), "--id", trajectory_id, "--run-dir", str(run_dir)])
    assert result.exit_code == 1 and "unseeded sampling" in " ".join(result.output.split()), result.output


def test_a_run_without_the_sampling_version_is_refused_naming_what_it_saved(run_dir, tmp_path):
    import shutil

    trajectory_id, _ = _last_step(run_dir)
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("step_000002"))
    result = CliRunner().invoke(app, ["replay", str(copy / "trajectories" / "last_step.jsonl"), "--id", trajectory_id])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "no checkpoint of policy version 2" in text and "step_000001, step_000003" in text
