"""The recipes run from the installed `turnrl` command (slow: real training steps on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TURNRL = str(Path(sys.executable).with_name("turnrl"))
pytestmark = pytest.mark.slow


def run(*args: str, cwd: Path = ROOT, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_gsm8k_tool_agent_recipe_trains(tmp_path):
    data = tmp_path / "gsm8k"
    run(sys.executable, "examples/gsm8k_tools/prepare_data.py", "--out", str(data), "--train", "8", "--eval", "2")
    out = tmp_path / "run"
    run(TURNRL, "train", "examples/gsm8k_tools/config.yaml", "model=tiny-qwen3", f"train_data={data}/train.jsonl",
        f"eval_data={data}/eval.jsonl", f"run_dir={out}", "steps=2", "prompts_per_step=2", "rollout.n=2",
        "rollout.max_new_tokens=24", "algo.kl_coef=0.01")
    steps = [m for m in metrics(out) if "train/loss" in m]
    assert [m["step"] for m in steps] == [1.0, 2.0]
    lines = (out / "trajectories" / "last_step.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(x)["agent"] == "tool_agent" for x in lines)
    assert (out / "curves.png").exists() and (out / "checkpoints" / "latest").exists()


def test_arithmetic_demo_config_runs_one_step_on_smollm2(tmp_path):
    data = tmp_path / "arith"
    run(sys.executable, "examples/arithmetic/prepare_data.py", "--out", str(data))
    eval_rows = (data / "eval.jsonl").read_text().splitlines()
    (data / "eval.jsonl").write_text("\n".join(eval_rows[:8]) + "\n")  # keep the slow test short
    out = tmp_path / "run"
    result = run(TURNRL, "train", "examples/arithmetic/config.yaml", f"train_data={data}/train.jsonl",
                 f"eval_data={data}/eval.jsonl", f"run_dir={out}", "steps=1", "prompts_per_step=4",
                 "eval_every=0", "eval_sampled_n=0")
    history = metrics(out)
    assert [m["eval/tag"] for m in history if "eval/tag" in m] == ["before", "after"]
    assert any("train/loss" in m or "train/samples" in m for m in history)
    assert "eval after" in result.stdout


def sft_then_rl(tmp_path: Path, recipe: str, sft_args: list[str], rl_args: list[str]) -> tuple[list[dict], list[dict]]:
    """A recipe shortened: `turnrl sft` its sft.yaml, then `turnrl train` its RL config from the SFT model."""
    run(TURNRL, "sft", f"examples/{recipe}/sft.yaml", f"output_dir={tmp_path}/sft", f"run_dir={tmp_path}/sft", *sft_args)
    assert (tmp_path / "sft" / "model" / "config.json").exists()
    run(TURNRL, "train", f"examples/{recipe}/{'config' if recipe == 'gsm8k_tools' else 'rl'}.yaml",
        f"model={tmp_path}/sft/model", f"run_dir={tmp_path}/rl", *rl_args)  # the run's own directory
    return metrics(tmp_path / "sft"), metrics(tmp_path / "rl")


def assert_trains(sft: list[dict], rl: list[dict], rl_steps: int) -> None:
    losses = [m["train/loss"] for m in sft if "train/loss" in m]
    assert len(losses) >= 3 and losses[-1] < losses[0], losses  # the SFT loss falls
    assert [m["eval/tag"] for m in sft if "eval/tag" in m] == ["before", "after"]
    assert [m["eval/tag"] for m in rl if "eval/tag" in m] == ["before", "after"]
    assert [m["step"] for m in rl if "rollout/reward_mean" in m and "eval/tag" not in m] == \
        [float(k) for k in range(1, rl_steps + 1)]


def test_calculator_agent_recipe_sft_then_rl_on_smollm2(tmp_path):
    data = tmp_path / "data"
    run(sys.executable, "examples/calculator_agent/prepare_data.py", "--out", str(data), "--sft", "24",
        "--train", "8", "--eval", "4")
    files = [f"train_data={data}/train.jsonl", f"eval_data={data}/eval.jsonl"]
    sft, rl = sft_then_rl(tmp_path, "calculator_agent",
                          [f"train_data={data}/sft.jsonl", f"eval_data={data}/eval.jsonl", "sft.batch_size=8"],
                          [*files, "steps=2", "prompts_per_step=2", "rollout.n=2"])
    assert_trains(sft, rl, 2)
    assert "eval/tool_call_rate" in sft[-1] and "rollout/tool_call_rate" in rl[1]
    run(sys.executable, "examples/plot_recipe.py", str(tmp_path), "--out", str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_gsm8k_recipe_gains_the_sft_warm_start(tmp_path):
    data = tmp_path / "data"
    run(sys.executable, "examples/gsm8k_tools/prepare_data.py", "--out", str(data), "--sft", "24", "--train", "8",
        "--eval", "2")
    sft, rl = sft_then_rl(tmp_path, "gsm8k_tools",
                          [f"train_data={data}/sft.jsonl", f"eval_data={data}/eval.jsonl", "sft.batch_size=8"],
                          [f"train_data={data}/train.jsonl", f"eval_data={data}/eval.jsonl", "steps=1",
                           "prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=48"])
    assert_trains(sft, rl, 1)


def test_vlm_shapes_recipe_sft_then_rl_and_the_viewer_shows_its_pictures(tmp_path):
    data = tmp_path / "data"
    run(sys.executable, "examples/vlm_shapes/prepare_data.py", "--out", str(data), "--sft", "24", "--train", "8",
        "--eval", "4")
    sft, rl = sft_then_rl(tmp_path, "vlm_shapes",
                          [f"train_data={data}/sft.jsonl", f"eval_data={data}/eval.jsonl", "sft.batch_size=8",
                           "sft.epochs=1"],
                          [f"train_data={data}/train.jsonl", f"eval_data={data}/eval.jsonl", "steps=2",
                           "prompts_per_step=2", "rollout.n=2"])
    assert_trains(sft, rl, 2)
    page = tmp_path / "view.html"
    run(TURNRL, "view", str(tmp_path / "rl" / "trajectories" / "eval_after.jsonl"), "--html", str(page))
    text = page.read_text()
    assert text.count("<img src='data:image/png;base64,") == 4 and "missing image" not in text
