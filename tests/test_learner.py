"""The Learner on tiny-qwen3: what a loss function sees of each packed micro-batch, how the update adds up its
loss and metrics, and that the learner is built from plain arguments (no config)."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

from turnrl.build import build_learner
from turnrl.config import TrainConfig
from turnrl.train.learner import MicroBatch
from turnrl.train.packing import pack_sequences, packed_token_logprobs
from turnrl.train.samples import TrainSample


def _samples() -> list[TrainSample]:
    """Five sequences of 24-30 tokens (two fit a 64-token row: three micro-batches), some tokens masked."""
    g = torch.Generator().manual_seed(1)
    samples = []
    for k in range(5):
        prompt = torch.randint(0, 150_000, (8 + k,), generator=g).tolist()
        response = torch.randint(0, 150_000, (16 + k,), generator=g).tolist()
        mask = [0 if t % 4 == 3 else 1 for t in range(len(response))]
        samples.append(TrainSample(prompt, response, mask, None, 1.0))
    return samples


def test_the_loss_function_sees_each_micro_batch_with_its_own_logprobs_mask_and_reference(tiny_qwen3, tmp_path):
    cfg = TrainConfig(model="tiny-qwen3", train_data="x", output_dir=str(tmp_path), algo={"kl_coef": 0.1},
                      optim={"lr": 1e-3, "micro_batch_tokens": 64})
    learner = build_learner(cfg, copy.deepcopy(tiny_qwen3))
    samples = _samples()
    with torch.no_grad():  # each sequence alone in its row, before the update
        alone = [packed_token_logprobs(learner.policy, pack_sequences([(s.prompt_ids, s.response_ids, s.loss_mask)],
                                                                      4096)[0]) for s in samples]
    seen: list[MicroBatch] = []

    def nll(batch: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        seen.append(batch)
        trained = float(batch.mask_B_T.sum())
        return -batch.logp_B_T, {"probe/trained": trained, "probe/sequences": float(len(batch.samples)),
                                 "_count/probe/sequences": 1.0}

    metrics = learner.update(samples, nll)
    assert [len(b.samples) for b in seen] == [2, 2, 1]
    assert sorted(id(s) for b in seen for s in b.samples) == sorted(map(id, samples))
    for batch in seen:
        assert batch.ref_B_T is not None  # kl_coef > 0: the frozen reference's logprobs come along
        for b, s in enumerate(batch.samples):
            n, mask = len(s.response_ids), torch.tensor(s.loss_mask, dtype=torch.bool)
            assert batch.mask_B_T[b, :n].tolist() == s.loss_mask and not batch.mask_B_T[b, n:].any()
            logp = batch.logp_B_T[b, :n].detach()
            torch.testing.assert_close(logp[mask], alone[samples.index(s)], atol=1e-5, rtol=1e-5)
            assert not logp[~mask].any() and torch.equal(batch.old_B_T[b], batch.logp_B_T[b].detach())
            torch.testing.assert_close(batch.ref_B_T[b], batch.logp_B_T[b].detach())  # before the step: the same
    # token_mean over every trained token of the mini-batch, though it came in three micro-batches
    assert metrics["train/loss"] == pytest.approx(float(-torch.cat(alone).mean()), rel=1e-5)
    trained = [float(b.mask_B_T.sum()) for b in seen]
    assert metrics["probe/trained"] == pytest.approx(sum(t * t for t in trained) / sum(trained))  # by tokens
    assert metrics["probe/sequences"] == pytest.approx(5 / 3)  # by its own count: one per micro-batch
    assert metrics["train/tokens"] == sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)


def test_without_kl_there_is_no_reference_and_more_steps_bring_old_logprobs(tiny_qwen3, tmp_path):
    cfg = TrainConfig(model="tiny-qwen3", train_data="x", output_dir=str(tmp_path),
                      optim={"lr": 1e-2, "micro_batch_tokens": 4096, "mini_batches": 2})
    learner = build_learner(cfg, copy.deepcopy(tiny_qwen3))
    assert learner.reference is None
    samples = _samples()
    seen: list[MicroBatch] = []

    def record(batch: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        seen.append(batch)
        return -batch.logp_B_T, {}

    learner.update(samples, record, step=1)
    assert len(seen) == 2 and all(b.ref_B_T is None for b in seen)
    second = seen[1]  # after the first mini-batch's step: old (before the update) differs from the policy now
    assert not torch.allclose(second.old_B_T, second.logp_B_T.detach())
    torch.testing.assert_close(seen[0].old_B_T, seen[0].logp_B_T.detach())  # no step yet: the same policy


def test_the_learner_module_reads_no_config():
    tree = ast.parse((Path(__file__).parents[1] / "turnrl" / "train" / "learner.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "turnrl.config" not in imported and "cfg" not in names
