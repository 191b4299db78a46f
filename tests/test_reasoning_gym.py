"""`--env reasoning_gym:NAME` through the public CLI: reasoning-gym's own generators and graders (the package, not
envs written here), rows without prompt, `--limit N` without --data, the feedback loop and config errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fakes import script_the_cli
from typer.testing import CliRunner

from turnrl.cli import app
from turnrl.types import Trajectory

rg = pytest.importorskip("reasoning_gym", reason="pip install 'turnrl[reasoning-gym]'")
runner = CliRunner()


def run(tmp_path, env, *flags):
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--env", env, "--out", str(out),
                                 "--max-new-tokens", "64", "--reward", "env", *flags])
    return result, ([json.loads(line) for line in out.read_text().splitlines()] if out.exists() else [])


def answer_of(name, config, prompt):
    """The dataset's own answer to the question in `prompt` (found by regenerating the dataset)."""
    ds = rg.create_dataset(name, **config)
    question = next(e for e in ds if e["question"] in prompt)
    return question["answer"]


def check_masks(row):
    """Model tokens mask 1 with real logprobs; template, env and tool tokens mask 0."""
    Trajectory.from_json(row).validate()
    for seg in row["segments"]:
        mask = row["loss_mask"][seg["start"]: seg["start"] + seg["length"]]
        assert set(mask) == ({1} if seg["source"] == "model" else {0}), seg
        if seg["source"] == "model":
            assert all(lp < 0 for lp in row["rollout_logprobs"][seg["start"]: seg["start"] + seg["length"]])


@pytest.mark.parametrize("name", ["basic_arithmetic", "leg_counting", "word_sorting", "spell_backward"])
def test_generators_graded_by_their_own_scorer(tmp_path, monkeypatch, qwen3_tokenizer, name):
    config = {"size": 20, "seed": 3}
    # seeds 0 and 2 answer with the dataset's own answer; seed 1 answers nonsense
    def script(rid, turn, prompt):
        return "<answer>nonsense</answer>" if rid.startswith("seed-1") else \
            f"<answer>{answer_of(name, config, prompt)}</answer>"

    script_the_cli(monkeypatch, qwen3_tokenizer, script)
    result, rows = run(tmp_path, f"reasoning_gym:{name}", "--limit", "3", "--env-config", json.dumps(config))
    assert result.exit_code == 0, result.output
    by_id = {r["id"]: r for r in rows}
    assert sorted(by_id) == ["seed-0-0", "seed-1-0", "seed-2-0"]
    for rid, row in by_id.items():
        check_masks(row)
        infos = row["rollout_infos"]
        assert infos["source_dataset"] == name and infos["dataset_seed"] == 3
        assert infos["index"] == int(rid.split("-")[1])
        assert row["messages"][0]["role"] == "system" and row["messages"][1]["role"] == "user"
        assert row["reward"] == (0.0 if rid.startswith("seed-1") else 1.0), (rid, row["messages"])
        assert (row["status"], row["termination_reason"], row["num_turns"]) == ("completed", "env_done", 1)


def test_feedback_gives_the_verdict_and_another_try(tmp_path, monkeypatch, qwen3_tokenizer):
    config = {"size": 5, "feedback": True, "system_prompt": None}
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: "I think it is <answer>-1e9</answer>"
                   if turn == 1 else f"<answer>{answer_of('basic_arithmetic', {'size': 5, 'seed': 0}, prompt)}</answer>")
    result, rows = run(tmp_path, "reasoning_gym:basic_arithmetic", "--limit", "2", "--n", "2", "--max-turns", "3",
                       "--env-config", json.dumps(config))
    assert result.exit_code == 0, result.output
    assert len(rows) == 4
    for row in rows:
        check_masks(row)
        assert row["messages"][0]["role"] == "user"  # system_prompt: null
        assert row["num_turns"] == 2 and row["reward"] == 1.0 and row["turn_rewards"] == [1.0]
        assert row["rollout_infos"]["scores"] == [0.0, 1.0]
        verdict = row["messages"][2]
        assert verdict["role"] == "user" and "'-1e9' is not correct" in verdict["content"]
        assert [s["source"] for s in row["segments"]] == ["model", "template", "env", "model"]


def test_feedback_stops_at_max_turns_with_the_last_score(tmp_path, monkeypatch, qwen3_tokenizer):
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: "no tags here")
    result, rows = run(tmp_path, "reasoning_gym:basic_arithmetic", "--limit", "1", "--max-turns", "2",
                       "--env-config", '{"feedback": true}')
    assert result.exit_code == 0, result.output
    [row] = rows
    assert row["num_turns"] == 2 and row["reward"] == 0.0 and row["turn_rewards"] == [0.0]
    assert "No answer found" in row["messages"][3]["content"]


def test_rows_without_prompt_and_per_row_env_config(tmp_path, monkeypatch, qwen3_tokenizer):
    data = tmp_path / "rows.jsonl"
    rows = [{"id": "a", "seed": 4}, {"id": "heldout", "seed": 4, "env_config": {"seed": 99}}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = {}

    def script(rid, turn, prompt):
        prompts[rid] = prompt
        return "<answer>0</answer>"

    script_the_cli(monkeypatch, qwen3_tokenizer, script)
    result, out = run(tmp_path, "reasoning_gym:basic_arithmetic", "--data", str(data))
    assert result.exit_code == 0, result.output
    seeds = {r["id"]: r["rollout_infos"]["dataset_seed"] for r in out}
    assert seeds == {"a-0": 0, "heldout-0": 99}
    expected = {k: rg.create_dataset("basic_arithmetic", seed=s)[4]["question"] for k, s in (("a-0", 0), ("heldout-0", 99))}
    for rid, question in expected.items():
        assert question in prompts[rid]


def test_composite_of_generators(tmp_path, monkeypatch, qwen3_tokenizer):
    config = {"size": 10, "seed": 1, "datasets": [{"name": "basic_arithmetic", "weight": 1, "config": {}},
                                                  {"name": "letter_counting", "weight": 1, "config": {}}]}
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: "<answer>3</answer>")
    result, rows = run(tmp_path, "reasoning_gym:composite", "--limit", "6", "--env-config", json.dumps(config))
    assert result.exit_code == 0, result.output
    assert {r["rollout_infos"]["source_dataset"] for r in rows} <= {"basic_arithmetic", "letter_counting"}
    assert len({r["rollout_infos"]["source_dataset"] for r in rows}) == 2


def test_a_real_model_samples_logprobs(tmp_path):
    result, rows = run(tmp_path, "reasoning_gym:word_sorting", "--limit", "2", "--max-new-tokens", "8", "--seed", "0")
    assert result.exit_code == 0, result.output
    for row in rows:
        check_masks(row)
        assert len(row["rollout_logprobs"]) == len(row["response_ids"]) and all(
            lp < 0 for lp, m in zip(row["rollout_logprobs"], row["loss_mask"], strict=True) if m)


@pytest.mark.parametrize(("flags", "message"), [
    (["--env-config", '{"min_terms": 5, "max_terms": 2}'], r"the generator rejected env_config .*max_terms must be >= min_terms"),
    (["--env-config", '{"nope": 1}'], r"unknown key\(s\) \['nope'\].*min_terms"),
])
def test_config_errors_fail_at_start_up(tmp_path, flags, message):
    result, _ = run(tmp_path, "reasoning_gym:basic_arithmetic", "--limit", "2", *flags)
    assert result.exit_code == 2, result.output
    assert re.search(message, " ".join(result.output.split())), result.output


def test_unknown_generator_and_missing_data(tmp_path):
    result, _ = run(tmp_path, "reasoning_gym:basic_arithmetc", "--limit", "1")
    assert result.exit_code == 2 and "did you mean basic_arithmetic" in result.output, result.output
    result, _ = run(tmp_path, "reasoning_gym:basic_arithmetic")
    assert result.exit_code == 2 and "--limit N" in result.output, result.output
    result, _ = run(tmp_path, "arithmetic", "--limit", "2")
    assert result.exit_code == 2 and "--data is required" in result.output, result.output


def test_a_bad_row_fails_only_its_trajectory(tmp_path, monkeypatch, qwen3_tokenizer):
    data = tmp_path / "rows.jsonl"
    rows = [{"id": "ok", "seed": 1}, {"id": "bad", "seed": 1, "env_config": {"min_terms": 9, "max_terms": 2}},
            {"id": "far", "seed": 10_000}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: "<answer>1</answer>")
    result, out = run(tmp_path, "reasoning_gym:basic_arithmetic", "--data", str(data))
    assert result.exit_code == 0, result.output
    by_id = {r["id"]: r for r in out}
    assert by_id["ok-0"]["status"] == "completed"
    assert by_id["bad-0"]["status"] == "failed" and "max_terms must be >= min_terms" in by_id["bad-0"]["error"]
    assert by_id["far-0"]["status"] == "failed" and "outside the dataset (env_config.size = 500)" in by_id["far-0"]["error"]


@pytest.mark.slow
def test_the_recipe_trains_on_seed_only_rows(tmp_path, monkeypatch):
    """examples/reasoning_gym: its rows have no prompt; `turnrl train` reads them (one small step on tiny-qwen3)."""
    import runpy
    import sys

    from turnrl.cli import run_training
    from turnrl.config import TrainConfig, load_config

    root = Path(__file__).resolve().parent.parent
    monkeypatch.setattr(sys, "argv", ["prepare_data.py", "--out", str(tmp_path / "data"), "--train", "8", "--eval", "2"])
    runpy.run_path(str(root / "examples" / "reasoning_gym" / "prepare_data.py"), run_name="__main__")
    assert json.loads((tmp_path / "data" / "eval.jsonl").read_text().splitlines()[0]) == \
        {"id": "eval-0", "seed": 0, "env_config": {"seed": 1000}}
    cfg = load_config(TrainConfig, root / "examples" / "reasoning_gym" / "config.yaml", [
        "model=tiny-qwen3", f"train_data={tmp_path / 'data' / 'train.jsonl'}", f"eval_data={tmp_path / 'data' / 'eval.jsonl'}",
        f"run_dir={tmp_path / 'run'}", "steps=1", "prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=6",
        "eval_every=0", "eval_sampled_n=0"])
    history = run_training(cfg)
    assert history[-1]["step"] == 1 and "eval/reward_mean" in history[-1]
    rows = [json.loads(line) for line in (tmp_path / "run" / "trajectories" / "last_step.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["messages"][0]["content"].endswith("Reply with just the number.") for r in rows)
