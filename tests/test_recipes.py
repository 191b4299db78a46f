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
