"""Engine/trainer mismatch with and without each correction: top-k/top-p kept sets and MoE router replay (issue 26).

Each case records multi-turn trajectories with the real embedded engine and turn loop (batched, KV reused across
turns), writes them as JSONL rows and reads them back, then scores every sampled token with the trainer's packed
forward, with the correction and without it. Columns:

- mismatch KL: the k3 estimate of KL(π_engine ‖ π_trainer) over the sampled tokens (`train/mismatch_kl_k3`; without
  the kept set it is `train/mismatch_kl_k3_unmasked`);
- IS weights: ρ = π_trainer / π_engine per token, the token-level TIS/MIS input: their mean (the bias: 1 when
  unbiased), spread (std of log ρ) and effective sample size ((Σρ)² / (n·Σρ²));
- update: one `Learner.update` over the batch (packing, forward, GRPO's loss, backward, AdamW step: what a training
  step pays), fastest of `--repeats`, with the correction and without it (the same trajectories with the recorded
  field removed, as a run without recording trains them) interleaved;
- JSONL: bytes per trajectory row, with the recorded field and without it.

Cases: tiny-qwen3 and SmolLM2-135M-Instruct sampled at top_p 0.9 on the trainer's own weights (the only
mismatch is the kept set); tiny-qwen3-moe with an engine in bfloat16 against an fp32 trainer, and with a trainer
whose router weights carry 1% noise (router logits that differ slightly, as other kernels' do).

    python bench/offpolicy.py --rows 8 --max-new-tokens 16 [--only tiny-qwen3-moe,SmolLM2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from turnrl.agents import AGENTS
from turnrl.build import build_learner
from turnrl.config import TrainConfig
from turnrl.engines.embedded import EmbeddedEngine
from turnrl.models import load_model, load_tokenizer
from turnrl.moe import moe_routers, replay_routing
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutLimits, RolloutManager
from turnrl.testing.latency import build_env
from turnrl.train.loop import PolicyLoss
from turnrl.train.packing import (
    PackedRow,
    pack_sequences,
    packed_kept_logprobs,
    packed_token_logprobs,
    row_kept_counts,
    row_routing,
    use_varlen_attention,
)
from turnrl.train.samples import to_sample
from turnrl.types import SamplingParams, Trajectory


@dataclass
class Case:
    name: str
    model: str
    sampling: SamplingParams
    correction: str  # "kept set" or "router replay"
    engine_dtype: torch.dtype = torch.float32
    router_noise: float = 0.0


@dataclass
class Row:
    case: str
    correction: str
    kl: float
    ratio_mean: float
    log_ratio_std: float
    ess: float
    update_s: float
    jsonl_bytes: float


def record(case: Case, policy: torch.nn.Module, rows: int, max_new: int) -> list[Trajectory]:
    renderer = ChatRenderer(load_tokenizer(case.model))
    engine_model = policy if case.engine_dtype == policy.dtype else copy.deepcopy(policy).to(case.engine_dtype)
    engine = EmbeddedEngine(engine_model, eos_token_ids=sorted(renderer.end_of_turn_ids), max_batch_size=8,
                            record_sampling_mask=case.correction == "kept set",
                            record_routing=case.correction == "router replay")
    manager = RolloutManager(engine, renderer, agents=AGENTS, env_factory=build_env, sanity_mode="disable",
                             sampling=case.sampling, limits=RolloutLimits(max_turns=3, max_new_tokens=max_new))
    data = [{"id": i, "prompt": f"Look up item {i} with the tool, then report it.", "latencies_s": [0.0] * 3}
            for i in range(rows)]

    async def run() -> list[Trajectory]:
        return [t async for t in manager.stream(data, 1)]

    try:
        trajs = asyncio.run(run())
    finally:
        engine.close()
    return [Trajectory.from_json(json.loads(json.dumps(t.to_json()))) for t in trajs]


def scorer(case: Case, trainer: torch.nn.Module, trajs: list[Trajectory], corrected: bool
           ) -> Callable[[PackedRow], torch.Tensor]:
    """The trainer's logprob of each target of a packed row, with or without the case's correction."""
    vocab = trainer.get_input_embeddings().num_embeddings
    temperature = case.sampling.temperature

    def score(row: PackedRow) -> torch.Tensor:
        if case.correction == "kept set":
            kept_N = row_kept_counts(row, [t.kept_counts if corrected else None for t in trajs], vocab)
            return packed_kept_logprobs(trainer, row, kept_N, temperature)[0]
        routing = row_routing(row, [t.routed_experts for t in trajs]) if corrected else None
        with replay_routing(trainer, routing) if routing is not None else contextlib.nullcontext():
            return packed_token_logprobs(trainer, row, temperature)

    return score


def measure(case: Case, trainer: torch.nn.Module, trajs: list[Trajectory], corrected: bool, update_s: float) -> Row:
    rows = pack_sequences([(t.prompt_ids, t.response_ids, t.loss_mask) for t in trajs], max_tokens=2048)
    score = scorer(case, trainer, trajs, corrected)
    log_ratios = []
    with torch.no_grad():
        for row in rows:
            engine_N = torch.tensor([trajs[row.sequence_index[s]].rollout_logprobs[k]
                                     for s, k in zip(row.target_seq.tolist(), row.target_pos.tolist(), strict=True)])
            log_ratios.append(score(row).double() - engine_N.double())
    log_ratio = torch.cat(log_ratios)
    ratio = log_ratio.exp()
    ess = float(ratio.sum() ** 2 / (len(ratio) * ratio.square().sum()))
    return Row(case.name, ("with " if corrected else "without ") + case.correction,
               float((ratio - 1 - log_ratio).mean()), float(ratio.mean()), float(log_ratio.std()), ess, update_s,
               jsonl_bytes(trajs, keep=corrected))


def update_times(case: Case, trainer: torch.nn.Module, trajs: list[Trajectory], repeats: int) -> dict[bool, float]:
    """One `Learner.update` (GRPO's PolicyLoss, TIS, AdamW) over the batch, configured as a run with the correction
    on trains: with the recorded field (corrected) and without it (the same trajectories as an unrecorded run gives
    them). The fastest of `repeats`, the two interleaved so that a change in the machine's load hits both alike."""
    replay = case.correction == "router replay"
    s = case.sampling
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig.model_validate({
            "model": case.model, "train_data": "unused", "output_dir": out,
            "rollout": {"sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k},
                        "router_replay": "record" if replay else "none"},
            "algo": {"router_replay": replay, "is_mode": "truncate"},
            "optim": {"lr": 1e-7, "micro_batch_tokens": 2048}})
        learner = build_learner(cfg, copy.deepcopy(trainer))
    samples = {True: [to_sample(t, 1.0 if k % 2 else -1.0) for k, t in enumerate(trajs)]}
    samples[False] = [dataclasses.replace(x, kept_counts=None, routed_experts=None) for x in samples[True]]
    loss_fn = PolicyLoss(cfg.algo, version=0)
    best = {False: math.inf, True: math.inf}
    for _ in range(repeats):
        for corrected in (False, True):
            t0 = time.perf_counter()
            learner.update(samples[corrected], loss_fn)
            best[corrected] = min(best[corrected], time.perf_counter() - t0)
    return best


def jsonl_bytes(trajs: list[Trajectory], *, keep: bool) -> float:
    """Mean bytes of a JSONL row, with the recorded field, or with it removed (as an unrecorded run writes)."""
    sizes = []
    for t in trajs:
        row = t.to_json()
        if not keep:
            row.pop("routed_experts", None)
            for s in row["segments"]:
                s.pop("kept_counts", None)
        sizes.append(len(json.dumps(row)))
    return sum(sizes) / len(sizes)


def run_case(case: Case, rows: int, max_new: int, repeats: int) -> list[Row]:
    policy = load_model(case.model)
    trajs = record(case, policy, rows, max_new)
    trainer = copy.deepcopy(policy)
    use_varlen_attention(trainer)
    if case.router_noise:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for router in moe_routers(trainer):
                router.weight.mul_(1 + case.router_noise * torch.randn(router.weight.shape, generator=generator))
    times = update_times(case, trainer, trajs, repeats)
    return [measure(case, trainer, trajs, corrected, times[corrected]) for corrected in (False, True)]


def report(rows: list[Row], args: argparse.Namespace) -> Table:
    table = Table(title=f"engine/trainer mismatch, {args.rows} three-turn trajectories of ≤{args.max_new_tokens} "
                        "tokens per turn, per case")
    for column in ("case", "scored", "mismatch KL (k3)", "mean ρ", "std log ρ", "IS ESS", "Learner.update",
                   "vs without", "JSONL bytes/traj", "vs without"):
        table.add_column(column, justify="left" if column in ("case", "scored") else "right")
    for without, with_ in zip(rows[::2], rows[1::2], strict=True):
        for r, base in ((without, without), (with_, without)):
            table.add_row(r.case, r.correction, f"{r.kl:.2e}", f"{r.ratio_mean:.4f}", f"{r.log_ratio_std:.2e}", f"{r.ess:.4f}",
                          f"{r.update_s * 1e3:.0f} ms", f"{r.update_s / base.update_s:.2f}x", f"{r.jsonl_bytes:,.0f}",
                          f"{r.jsonl_bytes / base.jsonl_bytes:.2f}x")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated case names to run (substrings), e.g. tiny-qwen3-moe")
    args = parser.parse_args()
    top_p = SamplingParams(top_p=0.9, seed=1)
    cases = [
        Case("tiny-qwen3, top_p 0.9", "tiny-qwen3", top_p, "kept set"),
        Case("tiny-qwen3, top_k 20", "tiny-qwen3", SamplingParams(top_k=20, seed=1), "kept set"),
        Case("SmolLM2-135M, top_p 0.9", "smollm2-135m-instruct", top_p, "kept set"),
        Case("tiny-qwen3-moe, bf16 engine", "tiny-qwen3-moe", SamplingParams(seed=1), "router replay",
             engine_dtype=torch.bfloat16),
        Case("tiny-qwen3-moe, 1% router noise", "tiny-qwen3-moe", SamplingParams(seed=1), "router replay",
             router_noise=0.01),
    ]
    wanted = [w for w in args.only.split(",") if w]
    console, rows = Console(width=160), []
    for case in cases:
        if wanted and not any(w in case.name for w in wanted):
            continue
        rows += run_case(case, args.rows, args.max_new_tokens, args.repeats)
        console.print(f"done: {case.name}: " + "; ".join(f"{r.correction}: KL {r.kl:.2e}" for r in rows[-2:]))
    console.print(report(rows, args))


if __name__ == "__main__":
    main()
