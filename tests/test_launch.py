"""`turnrl train` on two trainer ranks end to end (CPU, gloo): launched by torchrun and by `trainer.launcher: ray`;
`turnrl export`; the launch errors; the example configs of docs/distributed.md.

The torchrun run is the contract of issue 11 in one launch: rank 0 rolls out, both ranks train (a sharded
checkpoint with a shard and an RNG state per rank), the weights pushed from the two ranks reach the engine
(the trajectories of step 2 carry the logprobs of the step-1 policy, as `turnrl export` writes it), and a
rank killed with SIGKILL mid-run is resumed from the last sharded checkpoint on one rank, giving the losses
of an uninterrupted one-process run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from typer.testing import CliRunner

from turnrl.cli import app, run_training
from turnrl.config import TrainConfig, load_config
from turnrl.types import Trajectory

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _write_config(tmp_path: Path, name: str, steps: int, **extra) -> Path:
    """tiny-qwen3 on turnrl.testing.latency's tool env (1-2 turns whose tools answer after 0.5 s: a step's rollout
    takes that long at least), a reward that varies (so there is something to train), fp32, seeded, a
    checkpoint every step; epochs 2 so the loss is not the trivial first-epoch one."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Look up {i}.", "latencies_s": [0.5] * (1 + i % 2)})
                            + "\n" for i in range(8)))
    (tmp_path / "reward.py").write_text("def reward(response):\n    return float(len(response) % 3)\n")
    cfg = {"model": "tiny-qwen3", "train_data": str(data), "output_dir": str(tmp_path / name), "steps": steps,
           "prompts_per_step": 2, "seed": 3, "save_every": 1,
           "rollout": {"env": "turnrl.testing.latency", "n": 2, "max_new_tokens": 8, "max_turns": 3, "sanity_check": "disable"},
           "engine": {"max_batch_size": 1},  # one request at a time: the same tokens whatever the timing
           "optim": {"lr": 1e-3, "epochs": 2, "micro_batch_tokens": 64},
           "reward": {"function": f"{tmp_path / 'reward.py'}:reward"}, **extra}
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(cfg))
    return path


def _metrics(out: Path) -> list[dict]:
    return [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/samples" in m]


def _kill_rank_1_after(launcher: subprocess.Popen, latest: Path, checkpoint: str, timeout_s: float = 600) -> None:
    """SIGKILL the rank-1 worker of a torchrun launch as soon as `latest` names `checkpoint`."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and launcher.poll() is None:
        if latest.exists() and latest.read_text().strip() == checkpoint:
            for child in psutil.Process(launcher.pid).children(recursive=True):
                if child.environ().get("RANK") == "1" and child.environ().get("LOCAL_RANK") == "1":
                    os.kill(child.pid, signal.SIGKILL)
                    return
        time.sleep(0.05)
    raise AssertionError(f"the run never wrote {checkpoint} (exit code {launcher.poll()})")


@torch.no_grad()
def _logprob_gap(trajectories: list[Trajectory], model_dir: Path | str) -> float:
    """The largest gap between the engine's logprobs (mask 1) and a transformers forward of `model_dir`
    (temperature 1) over `trajectories`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    gap = 0.0
    for traj in trajectories:
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        logp = torch.log_softmax(model(ids).logits[0, len(traj.prompt_ids) - 1 : -1].float(), -1)
        token_logp = logp.gather(-1, ids[0, len(traj.prompt_ids):, None])[:, 0]
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        engine = torch.tensor([float("nan") if lp is None else lp for lp in traj.rollout_logprobs])  # None at mask 0
        assert mask.any()
        gap = max(gap, float((token_logp[mask] - engine[mask]).abs().max()))
    return gap


def _assert_sampled_by(trajectories: list[Trajectory], model_dir: Path) -> None:
    """The engine sampled `trajectories` with the weights in `model_dir` (not the base model's)."""
    from turnrl.models import resolve_model

    assert _logprob_gap(trajectories, model_dir) < 1e-4
    assert _logprob_gap(trajectories, resolve_model("tiny-qwen3")) > 1e-3


@pytest.mark.filterwarnings("ignore")
def test_torchrun_trains_on_two_ranks_and_a_killed_run_resumes_on_one(tmp_path):
    config = _write_config(tmp_path, "run", steps=3, trainer={"parallel": "fsdp", "world_size": 2, "save_hf": False})
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    script = Path(sys.executable).with_name("turnrl")  # the console script, as docs/distributed.md runs it
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", str(script), "train", str(config), "--run-dir", str(out)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _kill_rank_1_after(launcher, out / "checkpoints" / "latest", "step_000002")  # rank 0 is rolling out step 3
        log = launcher.communicate(timeout=120)[0]
    finally:
        launcher.kill()
    assert launcher.returncode != 0 and "SIGKILL" in log, log[-3000:]
    assert [m["step"] for m in _metrics(out)] == [1.0, 2.0]

    # both ranks trained and checkpointed: a shard and an RNG state each
    ckpt = out / "checkpoints" / "step_000002"
    assert sorted(f.name for f in (ckpt / "state").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(f.name for f in (ckpt / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    assert torch.load(ckpt / "trainer_state.pt", weights_only=False)["world_size"] == 2
    assert not list((ckpt / "model").glob("*.safetensors"))  # save_hf: false: the weights are in state/ only

    # the weights pushed from two ranks reached the engine: step 2 was sampled by the step-1 policy
    exported = runner.invoke(app, ["export", str(out / "checkpoints" / "step_000001"), str(tmp_path / "hf1")])
    assert exported.exit_code == 0, exported.output
    step2 = [Trajectory.from_json(json.loads(line))
             for line in (out / "trajectories" / "last_step.jsonl").read_text().splitlines()]
    assert len(step2) == 4 and {s.policy_version for t in step2 for s in t.segments if s.source == "model"} == {1}
    _assert_sampled_by(step2, tmp_path / "hf1")

    # resume on one rank; an uninterrupted one-process run gives the same losses at every step
    resumed = runner.invoke(app, ["train", str(config), "--resume", str(out), "trainer.parallel=none",
                                  "trainer.world_size=1"])
    assert resumed.exit_code == 0, resumed.output
    assert "written by 2 ranks, now 1" in resumed.output
    reference = run_training(load_config(TrainConfig, config, ["trainer.parallel=none", "trainer.world_size=1",
                                                               f"output_dir={tmp_path / 'reference'}"]))
    expected = {m["step"]: m for m in reference if "train/samples" in m}
    got = _metrics(out)
    assert [m["step"] for m in got] == [1.0, 2.0, 3.0]  # step 3 once: nothing logged twice
    for m in got:
        for key in ("train/loss", "train/grad_norm", "train/tokens", "rollout/reward_mean"):
            assert m[key] == pytest.approx(expected[m["step"]][key], rel=1e-5, abs=1e-7), (m["step"], key)
    assert expected[3.0]["train/grad_norm"] > 0 and expected[3.0]["train/samples"] > 0


@pytest.mark.filterwarnings("ignore")
def test_torchrun_without_run_dir_trains_every_rank_in_rank_0s_timestamped_run(tmp_path):
    """`torchrun ... turnrl train CONFIG` with only output_dir, as verl and TRL users launch it (before: refused,
    "every rank needs the same run directory"): rank 0 makes the timestamped run directory, the other rank takes
    it once the process group is up, and `--resume` alone continues that run on both ranks."""
    from turnrl.train.runs import runs_under

    config = _write_config(tmp_path, "runs", steps=1, trainer={"parallel": "fsdp", "world_size": 2, "save_hf": False})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    script = Path(sys.executable).with_name("turnrl")

    def launch(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(script), "train", str(config), *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:]
        return done.stdout

    first = launch()
    [run] = runs_under(tmp_path / "runs")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted([run.name, "latest-run"])  # one run only
    assert (tmp_path / "runs" / "latest-run").resolve() == run.resolve()
    assert first.count("run directory: ") == 1 and f"run directory: {run}\n" in first  # said once, by rank 0
    ckpt = run / "checkpoints" / "step_000001"  # both ranks wrote their part into it
    assert sorted(f.name for f in (ckpt / "state").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(f.name for f in (ckpt / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]

    second = launch("--resume", "steps=2")
    assert f"run directory: {run} (resuming)" in second and f"resumed from {ckpt} (step 1" in second
    assert runs_under(tmp_path / "runs") == [run] and [m["step"] for m in _metrics(run)] == [1.0, 2.0]
    assert sorted(f.name for f in (run / "checkpoints" / "step_000002" / "state").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]


def test_python_dash_m_turnrl_cli_runs_the_cli():  # what `torchrun ... -m turnrl.cli train CONFIG` needs
    out = subprocess.run([sys.executable, "-m", "turnrl.cli", "export", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "Hugging Face directory" in out.stdout, out.stderr


def test_export_writes_a_hugging_face_directory_with_tokenizer_and_template(tmp_path, qwen3_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = _write_config(tmp_path, "one", steps=1, trainer={"save_hf": True})
    history = run_training(load_config(TrainConfig, config, [f"run_dir={tmp_path / 'one'}"]))
    assert history and (tmp_path / "one" / "checkpoints" / "latest").read_text() == "step_000001"
    ckpt = tmp_path / "one" / "checkpoints" / "step_000001"
    result = runner.invoke(app, ["export", str(ckpt), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    hf = tmp_path / "hf"
    assert (hf / "model.safetensors").exists() and (hf / "config.json").exists()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert tokenizer("hello there")["input_ids"] == qwen3_tokenizer("hello there")["input_ids"]
    assert tokenizer.chat_template == qwen3_tokenizer.chat_template
    probe = torch.arange(300, 316)[None]
    with torch.no_grad():  # the export and the checkpoint's own model dir (written by the trainer): same logits
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(hf)(probe).logits,
                                   AutoModelForCausalLM.from_pretrained(ckpt / "model")(probe).logits)

    missing = runner.invoke(app, ["export", str(tmp_path), str(tmp_path / "x")])
    assert missing.exit_code == 2 and "is not a turnrl checkpoint (no trainer_state.pt)" in missing.output


def test_eval_of_a_distributed_config_runs_in_one_process(tmp_path):
    from turnrl.cli import run_evaluation

    config = _write_config(tmp_path, "eval", steps=1, trainer={"parallel": "fsdp", "world_size": 4},
                           eval_data=str(tmp_path / "rows.jsonl"))
    metrics = run_evaluation(load_config(TrainConfig, config))
    assert metrics["eval/trajectories"] == 8.0


@pytest.mark.parametrize(("env", "overrides", "message"), [
    ({"WORLD_SIZE": "2"}, [], "2 trainer ranks were started but trainer.parallel is none; set trainer.parallel: "
                              "fsdp and trainer.world_size: 2"),
    ({"WORLD_SIZE": "3"}, ["trainer.parallel=fsdp", "trainer.world_size=2"],
     "trainer.world_size is 2 but 3 ranks were started (WORLD_SIZE=3)"),
    ({}, ["trainer.parallel=fsdp", "trainer.world_size=2"],
     "trainer.world_size is 2 but this process was not started by torchrun"),
    ({"WORLD_SIZE": "2"}, ["trainer.parallel=fsdp", "trainer.world_size=2", "trainer.launcher=ray"],
     "trainer.launcher is ray: `turnrl train` starts the 2 trainer ranks itself"),
    ({}, ["trainer.launcher=mpi"], "trainer.launcher: Input should be 'torchrun' or 'ray'"),
])
def test_launch_errors_name_the_field(tmp_path, monkeypatch, env, overrides, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = runner.invoke(app, ["train", str(_write_config(tmp_path, "bad", steps=1)), *overrides])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "bad").exists()  # refused before anything was built


def test_the_distributed_example_configs_load():
    configs = sorted((ROOT / "examples" / "distributed").glob("*.yaml"))
    assert [c.name for c in configs] == ["qwen3-4b.yaml", "qwen3-8b-lora.yaml", "qwen3-vl-2b.yaml"]
    loaded = {c.stem: load_config(TrainConfig, c) for c in configs}
    assert {c.model for c in loaded.values()} == {"Qwen/Qwen3-4B", "Qwen/Qwen3-8B", "Qwen/Qwen3-VL-2B-Instruct"}
    assert all(c.trainer.parallel == "fsdp" and c.device == "cuda" and c.dtype == "bfloat16" for c in loaded.values())
    assert [loaded[n].trainer.world_size for n in ("qwen3-vl-2b", "qwen3-4b", "qwen3-8b-lora")] == [1, 4, 8]
    assert loaded["qwen3-8b-lora"].trainer.lora is not None and loaded["qwen3-8b-lora"].trainer.launcher == "ray"
