"""trainer.loggers: a run's metrics in W&B (offline) and TensorBoard at metrics.jsonl's names and steps, read back
with each backend's own reader (`wandb leet inspect --json` on the offline run's .wandb log, TensorBoard's
EventAccumulator); a backend that cannot start or log warns once and training goes on."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from turnrl.cli import app
from turnrl.observe.loggers import Loggers

RESOLUTION = 1e-6  # TensorBoard keeps float32


def _config(tmp_path: Path, loggers: list[str], **extra) -> Path:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Say {i}."}) + "\n" for i in range(4)))
    (tmp_path / "reward.py").write_text("def reward(response):\n    return float(len(response) % 3)\n")
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({
        "model": "tiny-qwen3", "train_data": str(data), "eval_data": str(data), "output_dir": str(tmp_path / "runs"),
        "steps": 2, "prompts_per_step": 2, "seed": 1, "rollout": {"env": "single_turn", "n": 2, "max_new_tokens": 4},
        "trainer": {"loggers": loggers}, "reward": {"function": f"{tmp_path / 'reward.py'}:reward"}, **extra}))
    return config


def _jsonl_by_step(run: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl's finite numbers by step (a step's training line and its evaluation line together)."""
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[int(record["step"])].update({k: float(v) for k, v in record.items() if k != "step" and isinstance(
            v, int | float) and not isinstance(v, bool) and math.isfinite(v)})
    return dict(by_step)


def _wandb_records(run: Path) -> list[dict]:
    [log] = run.glob("wandb/offline-run-*/run-*.wandb")
    reader = Path(sys.executable).with_name("wandb")
    out = subprocess.run([str(reader), "leet", "inspect", "--json", str(log)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _tensorboard_scalars(run: Path) -> tuple[dict[int, dict[str, float]], object]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            by_step[event.step][tag] = event.value
    return dict(by_step), events


@pytest.mark.filterwarnings("ignore")
def test_wandb_offline_and_tensorboard_hold_every_metric_of_metrics_jsonl_at_its_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = _config(tmp_path, ["jsonl", "wandb", "tensorboard"])
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", str(config), "--run-dir", str(run)])
    assert result.exit_code == 0, result.output
    expected = _jsonl_by_step(run)
    assert sorted(expected) == [0, 1, 2] and len(expected[1]) > 40  # eval before at 0; steps 1, 2 (+ eval after)

    records = _wandb_records(run)
    history: dict[int, dict[str, float]] = defaultdict(dict)
    for r in records:
        if r["type"] == "history":
            item = r["history"]["item"]
            history[int(item["_step"])].update({k: v for k, v in item.items() if not k.startswith("_")})
    assert {s: sorted(m) for s, m in history.items()} == {s: sorted(m) for s, m in expected.items()}
    for step, metrics in expected.items():
        assert history[step] == pytest.approx(metrics, rel=1e-9, abs=1e-12), step
    [meta] = [r["run"] for r in records if r["type"] == "run"]
    assert meta["display_name"] == "run"  # the run directory's name
    config_items = meta["config"]["update"]
    assert config_items["model"] == "tiny-qwen3" and config_items["trainer"]["loggers"] == ["jsonl", "wandb",
                                                                                          "tensorboard"]
    [artifact] = [r["artifact"] for r in records if r["type"] == "artifact"]
    files = {entry["path"] for entry in artifact["manifest"]["contents"]}
    assert {"curves.png", "last_step.jsonl", "eval_before.jsonl", "eval_after.jsonl"} <= files

    scalars, events = _tensorboard_scalars(run)
    assert {s: sorted(m) for s, m in scalars.items()} == {s: sorted(m) for s, m in expected.items()}
    for step, metrics in expected.items():
        assert scalars[step] == pytest.approx(metrics, rel=RESOLUTION, abs=RESOLUTION), step
    tags = events.Tags()
    assert "curves" in tags["images"]
    assert {"config/text_summary", "samples/last_step/text_summary"} <= set(tags["tensors"])


def test_a_backend_that_cannot_start_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    import wandb

    def no_login(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", no_login)
    config = _config(tmp_path, ["wandb"], eval_data=None)
    result = CliRunner().invoke(app, ["train", str(config), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert text.count("trainer.loggers: wandb could not start (UsageError: api_key not configured") == 1
    assert len(_jsonl_by_step(tmp_path / "run")) == 2  # metrics.jsonl has every step


class FlakyBackend:
    name = "flaky"

    def __init__(self):
        self.calls = 0

    def log(self, metrics, step):
        self.calls += 1
        raise ConnectionError("dashboard gone")

    def artifacts(self, files):
        raise AssertionError("a backend that failed is off")

    def close(self, failed):
        raise AssertionError("a backend that failed is off")


def test_a_backend_that_fails_while_logging_is_dropped_after_one_warning(tmp_path, caplog):
    flaky = FlakyBackend()
    loggers = Loggers(tmp_path / "metrics.jsonl", [flaky])
    with caplog.at_level(logging.WARNING, logger="turnrl.observe.loggers"):
        for step in range(3):
            loggers.log({"step": float(step), "rollout/reward_mean": 0.5, "eval/tag": "x"}, step)
        loggers.close([tmp_path / "metrics.jsonl"])
    assert flaky.calls == 1 and len(caplog.records) == 1
    assert "flaky failed in log (ConnectionError: dashboard gone)" in caplog.records[0].getMessage()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # every record, every key


def test_mlflow_needs_its_tracking_uri(tmp_path):
    config = _config(tmp_path, ["jsonl", "mlflow"])
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 2
    assert "trainer.loggers: mlflow logs to the MLflow server at rollout.trace_uri" in " ".join(result.output.split())
