"""One trainer rank for tests/test_parallel.py, started by torchrun: `dist_worker.py OUT TASK [TASK...]`.

Tasks (each writes `OUT/<task>.pt` from rank 0; tests/test_parallel.py runs the one-process twins):
    update-<name>   one `Trainer.update` on `fixed_samples(1)` with the settings UPDATES[name]: loss, grad norm
                    and every parameter gathered whole
    sync            an update, then weights streamed in small buckets to an embedded engine on rank 0; the
                    engine's sampling logprobs beside the sharded trainer's for the same tokens
    lora            a LoRA update (which parameters changed), a merged-weight push to an engine, and the KL
                    reference (adapters off) beside the base model
    run             steps 1..3, a sharded checkpoint after each (KILL_AT_STEP=k: rank 1 kills itself with
                    SIGKILL in the middle of step k's update)
    resume-<dir>    resume OUT/<dir> from its latest checkpoint and run up to step 3
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import sys
from pathlib import Path

import torch

from turnrl.build import build_learner
from turnrl.config import TrainConfig
from turnrl.models import load_model
from turnrl.train.loop import PolicyLoss, Trainer
from turnrl.train.packing import pack_sequences, packed_token_logprobs
from turnrl.train.parallel import full_tensor
from turnrl.train.samples import TrainSample
from turnrl.types import SamplingParams

# grad_clip below the gradient norms of these steps (~0.6-0.9): the clip acts, on sharded gradients. A small
# lr: Adam's first steps move an element with a near-zero gradient by up to lr whatever its sign, so float
# noise in such a gradient shows in the weights at the scale of lr (the gradients are compared as well).
BASE = {"optim": {"lr": 1e-4, "micro_batch_tokens": 64, "grad_clip": 0.5}, "algo": {"is_mode": "truncate"}}
UPDATES = {  # name -> overrides of BASE (each also run in one process by the test)
    "token_mean": {},
    "seq_mean": {"algo": {"loss_agg": "seq_mean_token_mean", "kl_coef": 0.05}, "optim": {"epochs": 2, "mini_batches": 2}},
    "sum_norm": {"algo": {"loss_agg": "seq_mean_token_sum_norm", "norm_constant": 16.0}},
    "vlm": {"model": "tiny-qwen3-vl"},  # text rows: the vision tower (in the root unit) gets no gradient
    "ckpt_offload": {"optim": {"gradient_checkpointing": True}, "trainer": {"cpu_offload": True}},
    "bf16": {"dtype": "bfloat16"},
    "smol": {"model": "smollm2-135m-instruct", "optim": {"micro_batch_tokens": 128}},  # the slow test
    "tree": {"algo": {"loss_agg": "seq_mean_token_mean"}},  # group_samples, tree-packed (the default)
    "tree_flat": {"algo": {"loss_agg": "seq_mean_token_mean"}, "trainer": {"packing": "flat"}},
}
LORA = {"trainer": {"lora": {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}},
        "algo": {"kl_coef": 0.1}, "optim": {"lr": 1e-2}}
# the off-policy corrections (samples with kept sets and routing: `fixed_samples(offpolicy=True)`): an MoE policy
# sampled at top_k 20, its routing replayed through checkpointed backwards, with old logprobs (2 mini-batches)
OFFPOLICY = {"model": "tiny-qwen3-moe", "rollout": {"router_replay": "record", "sampling": {"top_k": 20}},
             "algo": {"router_replay": True, "kl_coef": 0.05},
             "optim": {"gradient_checkpointing": True, "mini_batches": 2}}
UPDATES.update({
    "offpolicy": OFFPOLICY,
    "offpolicy_lora": {**OFFPOLICY, "trainer": LORA["trainer"]},
    "offpolicy_off": {**OFFPOLICY, "algo": {"router_replay": False, "sampling_mask": "ignore", "kl_coef": 0.05}},
})


def config(out: str | Path, world_size: int, **overrides) -> TrainConfig:
    data = {"model": "tiny-qwen3", "train_data": "unused", "output_dir": str(out), "seed": 3,
            "trainer": {"parallel": "fsdp" if world_size > 1 else "none", "world_size": world_size}}
    for part in (BASE, overrides):
        for key, value in part.items():
            data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return TrainConfig.model_validate(data)


def fixed_samples(step: int, vocab: int = 49_152, offpolicy: bool = False) -> list[TrainSample]:
    """Nine samples of uneven lengths (so the token balance across ranks is not trivial), some tokens masked,
    rollout logprobs on all but one, advantages of both signs. Token ids fit SmolLM2's and Qwen3's vocab.
    `offpolicy`: with kept sets (20 tokens; none on one sample) and a routing of tiny-qwen3-moe's 2 layers x 2 of
    8 experts for every token but the last (none on another sample)."""
    g = torch.Generator().manual_seed(100 + step)
    samples = []
    for k in range(9):
        prompt = torch.randint(0, vocab, (3 + k % 4,), generator=g).tolist()
        response = torch.randint(0, vocab, (4 + (5 * k) % 11,), generator=g).tolist()
        mask = [0 if (k + t) % 5 == 0 else 1 for t in range(len(response))]
        logprobs = None if k == 4 else [-12.0 + 0.1 * t if m else 0.0 for t, m in enumerate(mask)]
        sample = TrainSample(prompt, response, mask, logprobs, [1.0, -0.5, 0.25][k % 3])
        if offpolicy:
            fed = torch.arange(len(prompt) + len(response) - 1)
            sample.kept_counts = None if k == 5 else [20 if m else None for m in mask]
            sample.routed_experts = None if k == 6 else torch.stack(
                [torch.stack([(fed + 3 * layer) % 8, (fed + 3 * layer + 5) % 8], 1) for layer in (0, 1)], 1).short()
        samples.append(sample)
    return samples


def group_samples(step: int, vocab: int = 49_152) -> list[TrainSample]:
    """Three GRPO groups of three on shared prompts (two responses of a group start alike), and two lone
    samples: what tree packing shares (turnrl.train.tree), over both ranks."""
    g = torch.Generator().manual_seed(200 + step)
    samples = []
    for k in range(3):
        prompt, start = torch.randint(0, vocab, (10 + 3 * k,), generator=g).tolist(), [7, 8]
        for j in range(3):
            response = (start if j < 2 else []) + torch.randint(0, vocab, (5 + 2 * j + k,), generator=g).tolist()
            mask = [0 if t % 4 == 3 else 1 for t in range(len(response))]
            samples.append(TrainSample(prompt, response, mask, [-11.0 if m else 0.0 for m in mask],
                                       [1.0, -0.5, 0.25][j] * (k + 1)))
    for k in range(2):
        samples.append(TrainSample(torch.randint(0, vocab, (6,), generator=g).tolist(),
                                   torch.randint(0, vocab, (9 + k,), generator=g).tolist(), [1] * (9 + k), None, 0.5))
    return samples


SAMPLES = {"tree": group_samples, "tree_flat": group_samples}


def make_trainer(cfg: TrainConfig, engine=None) -> Trainer:
    return Trainer(cfg, build_learner(cfg, load_model(cfg.model)), engine=engine, rollout=None, train_rows=[{}],
                   eval_rows=[])


def whole_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective), by name."""
    return {n: full_tensor(p.detach()).float().clone() for n, p in trainer.learner.policy.named_parameters()}


def whole_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The last optimizer step's (clipped) gradients, gathered whole."""
    return {n: full_tensor(p.grad).float().clone() for n, p in trainer.learner.policy.named_parameters()
            if p.grad is not None}


def run_update(out: Path, name: str, world_size: int) -> dict:
    cfg = config(out / name, world_size, **UPDATES[name])
    torch.manual_seed(cfg.seed)  # LoRA's A matrices start random: the same in every run, whatever ran before
    trainer = make_trainer(cfg)
    trainer.step = 1
    metrics = trainer.update(SAMPLES[name](1) if name in SAMPLES else
                             fixed_samples(1, offpolicy=name.startswith("offpolicy")))
    return {"metrics": metrics, "params": whole_params(trainer), "grads": whole_grads(trainer),
            "dtypes": sorted({str(p.dtype) for p in trainer.learner.policy.parameters()}),
            "recomputes": any(getattr(m, "gradient_checkpointing", False) for m in trainer.learner.policy.modules())}


def engine_vs_trainer(trainer: Trainer, engine, prompt: list[int]) -> dict:
    """Rank 0's engine samples; every rank scores the same tokens with the sharded trainer."""
    sampled = None
    if engine is not None:
        out = asyncio.run(engine.generate(prompt, SamplingParams(temperature=0.8, max_new_tokens=10, seed=4),
                                          request_id="r"))
        sampled = (out.token_ids, out.logprobs, out.policy_version)
    tokens, engine_logp, version = trainer.parallel.broadcast_object(sampled)
    row = pack_sequences([(prompt, tokens, [1] * len(tokens))], 4096)[0]
    with torch.no_grad():
        trainer_logp = packed_token_logprobs(trainer.learner.policy, row, temperature=0.8)
    return {"engine": torch.tensor(engine_logp), "trainer": trainer_logp, "version": version, "tokens": tokens}


def run_sync(out: Path) -> dict:
    from turnrl.engines.embedded import EmbeddedEngine

    cfg = config(out / "sync", 2, weight_sync={"bucket_mb": 0.05}, optim={"lr": 1e-3})
    engine = EmbeddedEngine(load_model(cfg.model), max_batch_size=2) if int(os.environ["RANK"]) == 0 else None
    trainer = make_trainer(cfg, engine)
    try:
        trainer.step = 1
        trainer.update(fixed_samples(1))
        sync = asyncio.run(trainer.sync_weights())
        return {"sync": sync, **engine_vs_trainer(trainer, engine, list(range(100, 110)))}
    finally:
        if engine is not None:
            engine.close()


def run_lora(out: Path) -> dict:
    from turnrl.engines.embedded import EmbeddedEngine

    cfg = config(out / "lora", 2, **LORA)
    engine = EmbeddedEngine(load_model(cfg.model), max_batch_size=2) if int(os.environ["RANK"]) == 0 else None
    trainer = make_trainer(cfg, engine)
    try:
        before = whole_params(trainer)
        trainer.step = 1
        metrics = trainer.update(fixed_samples(1))
        after = whole_params(trainer)
        sync = asyncio.run(trainer.sync_weights())
        prompt = list(range(200, 212))
        result = {"metrics": metrics, "sync": sync, **engine_vs_trainer(trainer, engine, prompt),
                  "changed": sorted(n for n in before if not torch.equal(before[n], after[n])),
                  "trainable": sorted(n for n, p in trainer.learner.policy.named_parameters() if p.requires_grad)}
        row = pack_sequences([(prompt[:6], prompt[6:], [1] * 6)], 4096)[0]
        result["reference"] = trainer.learner.reference_logprobs(row)
        with torch.no_grad():
            result["base"] = packed_token_logprobs(load_model(cfg.model), row)
        return result
    finally:
        if engine is not None:
            engine.close()


def run_steps(out: Path, name: str, resume: bool, world_size: int = 2, last: int = 3) -> dict:
    trainer = make_trainer(config(out / name, world_size, resume=resume))
    if resume:
        trainer.load_checkpoint()  # a ValueError naming the run when it has no checkpoint
    kill_at = int(os.environ.get("KILL_AT_STEP", 0))
    losses = {}
    while trainer.step < last:
        trainer.step += 1
        if trainer.step == kill_at and trainer.parallel.rank == 1:  # the RL update, with a loss that dies
            trainer.learner.update(fixed_samples(kill_at), _dying(PolicyLoss(trainer.cfg.algo, kill_at - 1)),
                                   step=kill_at)
        losses[trainer.step] = trainer.update(fixed_samples(trainer.step))["train/loss"]
        trainer.save_checkpoint()
    probe = torch.arange(300, 316)[None]
    with torch.no_grad():  # every position's logits, for the exported model to match
        logits = trainer.learner.policy(input_ids=probe, position_ids=torch.arange(16)[None],
                                        turnrl_cu_seqlens=[0, 16], use_cache=False).logits
    return {"losses": losses, "logits": logits}


def _dying(loss_fn):
    """`loss_fn`, but the process kills itself in its second micro-batch: after one micro-batch's backward, rank 0
    is inside the next collective."""
    calls = []

    def dying(batch):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return loss_fn(batch)

    return dying


def main(out: Path, tasks: list[str]) -> None:
    results = {}
    for task in tasks:
        kind, _, name = task.partition("-")
        if kind == "update":
            results[task] = run_update(out, name, 2)
        elif kind == "sync":
            results[task] = run_sync(out)
        elif kind == "lora":
            results[task] = run_lora(out)
        elif kind in ("run", "resume"):
            results[task] = run_steps(out, name or "run", resume=kind == "resume")
        if int(os.environ["RANK"]) == 0:
            torch.save(copy.deepcopy(results[task]), out / f"{task}.pt")
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
