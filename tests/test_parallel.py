"""FSDP2 trainer on CPU with gloo: 2 ranks (torchrun, tests/dist_worker.py) against the one-process trainer.

One torchrun launch runs most 2-rank scenarios (updates, weight push, LoRA, a 3-step run with checkpoints);
each test compares its output with the same thing computed here in one process. The kill test launches
twice more (a run whose rank 1 is SIGKILLed, then the resumes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import dist_worker as worker
import pytest
import torch

from turnrl.build import build_learner
from turnrl.config import ConfigError, TrainConfig, load_config
from turnrl.models import load_model
from turnrl.train.checkpoint import export_checkpoint
from turnrl.train.loop import Trainer
from turnrl.train.packing import pack_sequences, packed_token_logprobs, use_varlen_attention
from turnrl.train.parallel import balanced_split
from turnrl.train.weights import plan_buckets

ROOT = Path(__file__).resolve().parents[1]


def torchrun(out: Path, *tasks: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "tests" / "dist_worker.py"), str(out), *tasks]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                **(env or {})}
    return subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=900)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    _ok(torchrun(out, "update-token_mean", "update-seq_mean", "update-sum_norm", "update-vlm", "update-ckpt_offload",
                 "update-bf16", "update-offpolicy", "update-offpolicy_lora", "update-tree", "sync", "lora", "run"))
    return out


def _result(out: Path, task: str) -> dict:
    return torch.load(out / f"{task}.pt", weights_only=False)


def _assert_same_tensors(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    """Each tensor within `rel` of the one-process one, relative to its norm."""
    assert one.keys() == two.keys() and one
    for name in one:
        relative = float((one[name] - two[name]).norm() / one[name].norm().clamp(min=1e-12))
        assert relative <= rel, (name, relative)


def _assert_same_update(one: dict, two: dict) -> None:
    """Every updated parameter within 1e-5 relative; the gradients within 1e-4 (a gradient that is a sum over
    tokens that nearly cancels, like a norm weight's, keeps float32 rounding of order 1e-5)."""
    _assert_same_tensors(one["params"], two["params"])
    # a parameter no rank used has no gradient in one process, a zero one when sharded (FSDP must reduce it)
    assert all(not two["grads"][n].any() for n in two["grads"].keys() - one["grads"].keys())
    _assert_same_tensors(one["grads"], {n: two["grads"][n] for n in one["grads"]}, rel=1e-4)


@pytest.mark.parametrize(("two_rank", "one_process"), [
    ("token_mean", "token_mean"),
    ("seq_mean", "seq_mean"),  # + KL to a sharded reference, 2 epochs x 2 mini-batches (old logprobs)
    ("sum_norm", "sum_norm"),
    ("vlm", "vlm"),  # a VLM's language layers sharded; its vision tower unused by text rows
    ("ckpt_offload", "token_mean"),  # activation checkpointing + CPU offload change nothing in the math
    ("tree", "tree_flat"),  # groups tree-packed on 2 ranks (families balanced by unique tokens) == flat in one
])
def test_a_two_rank_step_equals_the_one_process_step(two_ranks, tmp_path, two_rank, one_process):
    two = _result(two_ranks, f"update-{two_rank}")
    one = worker.run_update(tmp_path, one_process, world_size=1)
    for key in ("train/loss", "train/grad_norm", "train/tokens", "train/mismatch_kl_k1", "train/is_valid_frac"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key
    assert two["recomputes"] == (two_rank == "ckpt_offload")
    if two_rank == "tree":  # each rank forwarded its groups' prompts once
        assert two["metrics"]["train/tokens_forwarded"] < 0.75 * two["metrics"]["train/tokens_raw"]
    if two_rank in ("token_mean", "seq_mean"):
        assert two["metrics"]["train/grad_norm"] > 0.5  # so the clip at 0.5 acted on sharded gradients
    if "kl_coef" in worker.UPDATES[two_rank].get("algo", {}):
        assert two["metrics"]["train/kl"] == pytest.approx(one["metrics"]["train/kl"], rel=1e-4)
    _assert_same_update(one, two)


def test_off_policy_corrections_two_rank_steps_equal_the_one_process_steps(two_ranks, tmp_path):
    """Kept sets and router replay on tiny-qwen3-moe, through checkpointed backwards, with old logprobs and a KL
    reference, without and with LoRA: FSDP2 over 2 ranks gives the one-process update."""
    for name in ("offpolicy", "offpolicy_lora"):
        two, one = _result(two_ranks, f"update-{name}"), worker.run_update(tmp_path, name, world_size=1)
        for key in ("train/loss", "train/grad_norm", "train/mismatch_kl_k3", "train/mismatch_kl_k3_unmasked",
                    "train/kl"):
            assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), (name, key)
        assert two["recomputes"]
        _assert_same_update(one, two)
    # the corrections acted: the kept set changes the mismatch, the replayed routing and kept sets the update
    m = two["metrics"]
    assert m["train/mismatch_kl_k3"] != pytest.approx(m["train/mismatch_kl_k3_unmasked"], rel=1e-3)
    off = worker.run_update(tmp_path, "offpolicy_off", world_size=1)
    assert off["metrics"]["train/loss"] != pytest.approx(_result(two_ranks, "update-offpolicy")["metrics"]["train/loss"],
                                                         rel=1e-3)


@pytest.mark.slow
def test_smollm2_two_rank_step_equals_the_one_process_step(tmp_path):
    _ok(torchrun(tmp_path, "update-smol"))
    two = _result(tmp_path, "update-smol")
    one = worker.run_update(tmp_path / "one", "smol", world_size=1)
    for key in ("train/loss", "train/grad_norm", "train/tokens"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key
    _assert_same_update(one, two)


def test_bf16_compute_keeps_fp32_shards_and_close_numbers(two_ranks, tmp_path):
    two = _result(two_ranks, "update-bf16")
    one = worker.run_update(tmp_path, "token_mean", world_size=1)
    assert two["dtypes"] == ["torch.float32"]  # master weights and optimizer stay fp32
    assert two["metrics"]["train/loss"] == pytest.approx(one["metrics"]["train/loss"], rel=2e-2)
    assert two["metrics"]["train/grad_norm"] == pytest.approx(one["metrics"]["train/grad_norm"], rel=2e-2)
    start = {n: p.detach() for n, p in load_model("tiny-qwen3").named_parameters()}
    moved = [n for n in start if not torch.equal(start[n], two["params"][n])]
    assert len(moved) == len(start)


def test_after_a_push_from_two_ranks_the_engine_samples_from_the_trainer(two_ranks):
    r = _result(two_ranks, "sync")
    assert r["version"] == 1 and r["sync"]["train/policy_version"] == 1.0
    assert r["sync"]["weight_sync/buckets"] >= 3  # streamed in several buckets
    torch.testing.assert_close(r["engine"], r["trainer"].float(), atol=1e-4, rtol=0)
    before = _logprobs(load_model("tiny-qwen3"), list(range(100, 110)), r["tokens"], 0.8)
    assert (before - r["engine"]).abs().max() > 1e-3  # the engine's weights did change


@torch.no_grad()
def _logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    use_varlen_attention(model)
    return packed_token_logprobs(model, pack_sequences([(prompt, tokens, [1] * len(tokens))], 4096)[0], temperature)


def test_a_lora_step_trains_only_adapters_and_the_engine_samples_the_merged_model(two_ranks):
    r = _result(two_ranks, "lora")
    assert r["trainable"] and all(".lora_" in n for n in r["trainable"])
    assert r["changed"] and set(r["changed"]) <= set(r["trainable"])
    assert any("lora_B" in n for n in r["changed"])  # B starts at 0, so the first step moves B (A's grad is 0)
    torch.testing.assert_close(r["engine"], r["trainer"].float(), atol=1e-4, rtol=0)
    base = _logprobs(load_model("tiny-qwen3"), list(range(200, 212)), r["tokens"], 0.8)
    assert (base - r["engine"]).abs().max() > 1e-4  # the engine holds W + BA, not the base weights
    # only the merged q/v projections travel: 2 layers x (q [64, 32] + v [32, 32]) fp32
    assert r["sync"]["weight_sync/mb"] == pytest.approx(2 * (64 * 32 + 32 * 32) * 4 / 2**20)
    torch.testing.assert_close(r["reference"], r["base"])  # the KL reference is the base model (adapters off)


def test_a_rank_killed_mid_step_resumes_from_the_last_sharded_checkpoint(two_ranks):
    killed = torchrun(two_ranks, "run-killed", env={"KILL_AT_STEP": "3"})
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    assert (two_ranks / "killed" / "checkpoints" / "latest").read_text() == "step_000002"
    # 1 -> 2: a one-process run of steps 1-2, resumed on 2 ranks (in the same launch as the killed run's resume)
    worker.run_steps(two_ranks, "single", resume=False, world_size=1, last=2)
    _ok(torchrun(two_ranks, "resume-killed", "resume-single"))
    uninterrupted = _result(two_ranks, "run")["losses"][3]
    assert _result(two_ranks, "resume-killed")["losses"] == {3: pytest.approx(uninterrupted, rel=1e-6)}
    assert _result(two_ranks, "resume-single")["losses"] == {3: pytest.approx(uninterrupted, rel=1e-5)}


def test_a_two_rank_checkpoint_resumes_in_one_process(two_ranks, tmp_path):
    run = tmp_path / "resharded"
    shutil.copytree(two_ranks / "run", run)
    trainer = worker.make_trainer(worker.config(run, 1, resume=str(run / "checkpoints" / "step_000002")))
    trainer.load_checkpoint()
    assert trainer.step == 2
    trainer.step = 3
    loss = trainer.update(worker.fixed_samples(3))["train/loss"]
    assert loss == pytest.approx(_result(two_ranks, "run")["losses"][3], rel=1e-5)


def test_export_of_a_sharded_checkpoint_loads_with_from_pretrained(two_ranks, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = two_ranks / "run" / "checkpoints" / "step_000003"
    expected = _result(two_ranks, "run")["logits"]
    probe = torch.arange(300, 316)[None]
    for where in (export_checkpoint(ckpt, tmp_path / "hf"), ckpt / "model"):  # exported, and saved with the run
        model = AutoModelForCausalLM.from_pretrained(where)
        with torch.no_grad():
            torch.testing.assert_close(model(probe).logits, expected, atol=1e-5, rtol=1e-5)


def test_export_writes_tokenizer_and_merged_lora(tmp_path, qwen3_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manager = SimpleNamespace(renderer=SimpleNamespace(tokenizer=qwen3_tokenizer))
    cfg = worker.config(tmp_path / "run", 1, **worker.LORA)
    trainer = Trainer(cfg, build_learner(cfg, load_model(cfg.model)), engine=None, rollout=manager, train_rows=[{}],
                      eval_rows=[])
    trainer.step = 1
    trainer.update(worker.fixed_samples(1))
    ckpt = trainer.save_checkpoint()
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(ckpt / "state")).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("training.model.")]
    assert weights and all(".lora_" in k for k in weights)  # only the adapters are training state
    out = export_checkpoint(ckpt, tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("hello")["input_ids"] == qwen3_tokenizer("hello")["input_ids"]
    assert tokenizer.chat_template == qwen3_tokenizer.chat_template
    probe = torch.arange(300, 316)[None]
    with torch.no_grad():  # the trained adapters applied by peft, against the merged export
        expected = trainer.learner.policy(input_ids=probe, position_ids=torch.arange(16)[None], turnrl_cu_seqlens=[0, 16]).logits
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out)(probe).logits, expected)
        base = load_model(cfg.model)(probe).logits
    assert (base - expected).abs().max() > 1e-4  # the adapters did change the model
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]


# ---- pieces ------------------------------------------------------------------------------------------
def test_balanced_split_is_deterministic_and_even():
    parts = balanced_split([5, 1, 4, 2, 3], 2)
    # longest first onto the lighter rank: 5->r0, 4->r1, 3->r1 (4<5), 2->r0 (5<7), 1->r0 or r1 (7=7 -> r0)
    assert parts == [[0, 1, 3], [2, 4]]
    assert balanced_split([3, 3], 4) == [[0], [1], [], []]
    assert balanced_split([2, 9, 4], 1) == [[0, 1, 2]]


def test_buckets_keep_layers_whole():
    names = ["model.embed_tokens.weight", "model.layers.0.q.weight", "model.layers.0.k.weight",
             "model.layers.1.q.weight", "model.layers.1.k.weight", "model.norm.weight"]
    assert plan_buckets(names, [10, 3, 3, 3, 3, 1], bucket_bytes=7) == [[0], [1, 2], [3, 4, 5]]
    assert plan_buckets(names, [1, 1, 1, 1, 1, 1], bucket_bytes=100) == [[0, 1, 2, 3, 4, 5]]


def test_world_size_needs_fsdp(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: tiny-qwen3\ntrain_data: x\ntrainer: {world_size: 2}\n")
    with pytest.raises(ConfigError, match="trainer.world_size=2 needs trainer.parallel: fsdp"):
        load_config(TrainConfig, path)
    with pytest.raises(ConfigError, match="trainer.lora.r"):
        load_config(TrainConfig, path, ["trainer.world_size=1", "trainer.lora.r=0"])
