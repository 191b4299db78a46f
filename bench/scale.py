"""Step time and memory per rank of the trainer at world size 1 and 2 on this CPU (SmolLM2-135M, gloo).

    python bench/scale.py                      # one process (parallel none), fsdp x 1, fsdp x 2 (torchrun)
    python bench/scale.py --steps 3 --samples 16 --bucket-mb 64

Per setup and rank: the best and mean `Trainer.update` time per step (after a warm-up step; this machine's
cores are shared, so the best step is the steadier figure), the peak resident memory
during the steps, the training state the rank actually holds (its parameter, gradient and AdamW shards,
summed from the tensors) beside the expected (4 + 4 + 8) bytes x parameters / world size, and one weight
sync to an embedded engine on rank 0 in buckets of --bucket-mb: its time, the largest bucket it assembled
(what rank 0 holds beyond its shards; the other ranks hold one gathered tensor at a time) and the growth of
the resident set during it (a lower bound: memory freed by the training step is reused first). Resident memory also counts the Python/torch runtime, the full model each
rank loads before sharding and, on rank 0, the engine's own copy of the model, so it shrinks less than the
training state does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"


def _kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM (the peak resident set) to the current resident set."""
    Path("/proc/self/clear_refs").write_text("5")


def worker(args: argparse.Namespace) -> None:
    import torch

    from turnrl.build import build_learner
    from turnrl.config import TrainConfig
    from turnrl.engines.embedded import EmbeddedEngine
    from turnrl.models import load_model
    from turnrl.train.loop import Trainer
    from turnrl.train.samples import TrainSample

    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    cfg = TrainConfig.model_validate({
        "model": MODEL, "train_data": "unused", "output_dir": tempfile.mkdtemp(),
        "trainer": {"parallel": args.parallel, "world_size": world}, "weight_sync": {"bucket_mb": args.bucket_mb},
        "optim": {"lr": 1e-6, "micro_batch_tokens": 1024}, "algo": {"is_mode": "none"}})
    engine = EmbeddedEngine(load_model(MODEL), max_batch_size=1) if rank == 0 else None
    trainer = Trainer(cfg, build_learner(cfg, load_model(MODEL)), engine, rollout=None, train_rows=[{}], eval_rows=[])
    g = torch.Generator().manual_seed(0)
    samples = [TrainSample(torch.randint(0, 49_152, (64,), generator=g).tolist(),
                           torch.randint(0, 49_152, (64,), generator=g).tolist(), [1] * 64, None,
                           1.0 if k % 2 else -1.0) for k in range(args.samples)]
    trainer.update(samples)  # warm-up; creates the optimizer state
    asyncio.run(trainer.sync_weights())  # warm-up: the engine's weights are mmapped until first written
    reset_peak()
    times = []
    for step in range(args.steps):
        trainer.step = step + 1
        t0 = time.perf_counter()
        trainer.update(samples)
        times.append(time.perf_counter() - t0)
    peak_mb = _kb("VmHWM") / 1024
    state = _held_bytes(trainer)
    before = _kb("VmRSS")
    reset_peak()
    sync = asyncio.run(trainer.sync_weights())
    sync_peak_mb = (_kb("VmHWM") - before) / 1024
    n_params = sum(p.numel() for p in trainer.learner.policy.parameters())
    print("RESULT " + json.dumps({
        "setup": f"{args.parallel} x {world}", "rank": rank, "best_step_s": min(times),
        "mean_step_s": sum(times) / len(times), "peak_rss_mb": peak_mb,
        "held_mb": state / 2**20, "expected_mb": 16 * n_params / world / 2**20,
        "sync_s": sync["time/weight_sync_s"], "sync_buckets": sync["weight_sync/buckets"],
        "largest_bucket_mb": sync["weight_sync/largest_bucket_mb"],
        "sync_peak_mb": sync_peak_mb}), flush=True)
    if engine is not None:
        engine.close()
    trainer.parallel.close()


def _held_bytes(trainer) -> int:
    """Bytes of this rank's parameter, gradient and optimizer-state tensors (local shards of DTensors)."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    total = 0
    for p in trainer.learner.policy.parameters():
        total += local(p).nbytes + (local(p.grad).nbytes if p.grad is not None else 0)
        total += sum(local(v).nbytes for v in trainer.learner.optimizer.state.get(p, {}).values() if hasattr(v, "nbytes"))
    return total


def launch(parallel: str, world: int, args: argparse.Namespace) -> list[dict]:
    me = [str(Path(__file__).resolve()), "--worker", "--parallel", parallel, "--steps", str(args.steps),
          "--samples", str(args.samples), "--bucket-mb", str(args.bucket_mb)]
    runner = [sys.executable] if parallel == "none" else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // world)),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(runner + me, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{parallel} x {world} failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--parallel", default="none")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=16, help="samples of 64 prompt + 64 response tokens per step")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rows = [r for parallel, world in (("none", 1), ("fsdp", 1), ("fsdp", 2)) for r in launch(parallel, world, args)]
    header = ("setup", "rank", "best step s", "mean step s", "peak RSS MB", "held state MB", "expected MB", "sync s",
              "buckets", "largest bucket MB", "sync peak +MB")
    print(f"SmolLM2-135M, {args.samples} x 128 tokens per step, {args.steps} steps, bucket {args.bucket_mb} MB, "
          f"{os.cpu_count()} CPU cores")
    print(" | ".join(header))
    for r in rows:
        print(" | ".join([r["setup"], str(r["rank"]), f"{r['best_step_s']:.2f}", f"{r['mean_step_s']:.2f}", f"{r['peak_rss_mb']:.0f}",
                          f"{r['held_mb']:.0f}", f"{r['expected_mb']:.0f}", f"{r['sync_s']:.2f}",
                          f"{r['sync_buckets']:.0f}", f"{r['largest_bucket_mb']:.0f}", f"{r['sync_peak_mb']:.0f}"]))


if __name__ == "__main__":
    main()
