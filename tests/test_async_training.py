"""`trainer.mode=async` on the real tiny-qwen3: staleness within the bound, versions per segment, and nothing in
flight lost across kill -9 and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from turnrl.cli import run_training
from turnrl.config import TrainConfig, load_config
from turnrl.types import Trajectory


def _setup(tmp_path, rows=12):
    data = tmp_path / "rows.jsonl"  # 1-4 tool turns of varied latency (turnrl.testing.latency's env)
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Look up {i}.",
                                        "latencies_s": [0.01 * (i % 4)] * (1 + i % 4)}) + "\n" for i in range(rows)))
    (tmp_path / "reward.py").write_text("def reward(response):\n    return float(len(response) % 3)\n")
    return data


def _config(tmp_path, data, out, steps, **extra):
    cfg = {"model": "tiny-qwen3", "train_data": str(data), "run_dir": str(out), "steps": steps,
           "prompts_per_step": 2, "seed": 3, "save_every": 1,
           "rollout": {"env": "turnrl.testing.latency", "n": 2, "max_new_tokens": 8, "max_turns": 6,
                       "sanity_check": "disable"},
           "engine": {"max_batch_size": 4}, "optim": {"lr": 1e-3},
           "trainer": {"mode": "async", "max_staleness": 2},
           "reward": {"function": f"{tmp_path / 'reward.py'}:reward"}, **extra}
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(json.dumps(cfg))
    return load_config(TrainConfig, path)


def _ledger(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]


@pytest.mark.filterwarnings("ignore")
def test_async_training_keeps_staleness_within_the_bound(tmp_path):
    data = _setup(tmp_path)
    history = run_training(_config(tmp_path, data, tmp_path / "run", steps=5))
    steps = [m for m in history if "async/staleness_max" in m]
    assert len(steps) == 5 and all(m["async/staleness_max"] <= 2 for m in steps)
    assert [m["async/lost"] for m in steps] == [0.0] * 5  # stated every step (it was not)
    ledger = _ledger(tmp_path / "run")
    assert sorted(g["index"] for g in ledger) == list(range(10))  # 5 steps x 2 groups, each trained once
    for g in ledger:
        assert g["admitted_version"] <= g["oldest_version"] and g["step"] - 1 - g["oldest_version"] <= 2
    for line in (tmp_path / "run" / "trajectories" / "last_step.jsonl").read_text().splitlines():
        traj = Trajectory.from_json(json.loads(line))
        traj.validate()
        versions = [s.policy_version for s in traj.segments if s.source == "model"]
        assert versions == sorted(versions) and max(versions) <= 4  # sampled by versions 0..4, in order


def test_sync_mode_refuses_a_staleness_bound(tmp_path):
    from turnrl.config import ConfigError

    with pytest.raises(ConfigError, match="needs trainer.mode=async"):
        _config(tmp_path, _setup(tmp_path), tmp_path / "x", 2, trainer={"mode": "sync", "max_staleness": 1})


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_kill_9_and_resume_loses_no_admitted_prompt(tmp_path):
    data = _setup(tmp_path, rows=16)
    out = tmp_path / "run"
    cfg = _config(tmp_path, data, out, steps=8)
    config_file = tmp_path / "run.yaml"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([str(Path(sys.executable).with_name("turnrl")), "train", str(config_file)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and not (latest.exists() and latest.read_text().strip() >= "step_000004"):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)  # mid-run: groups are in flight and buffered
    proc.wait()
    assert latest.exists(), "the run never reached its fourth checkpoint"
    checkpoint = latest.read_text().strip()
    resumed = run_training(cfg.model_copy(update={"resume": True}))
    ledger = _ledger(out)
    indices = sorted(g["index"] for g in ledger)
    assert indices == list(range(16))  # 8 steps x 2 groups: every admitted group trained exactly once
    assert all(g["step"] - 1 - g["oldest_version"] <= 2 for g in ledger)
    reissued = [m["async/reissued"] for m in resumed if "async/reissued" in m]
    # groups in flight at the checkpoint were re-issued (their partial trajectories could not be kept), counted
    # and logged; the buffered ones were trained as they were
    assert reissued and reissued[-1] >= 1 and reissued[-1] == sum(g["reissued"] for g in ledger)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
             if "train/samples" in json.loads(x)]
    assert steps == sorted(set(steps)), f"a step was logged twice after resuming from {checkpoint}"
