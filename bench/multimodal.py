"""The training-side image store of a VLM trajectory: one merge at the end vs a concatenation after every turn.

Each turn of a trajectory adds one image's processor tensors: `pixel_values` [1024, 1536] fp32 (a 512x512
image in 16-pixel patches with temporal patch 2: 6 MiB) and `image_grid_thw` [1, 3] int64. Two strategies:

- `buffered` (turnrl.multimodal.ImageBuffer, the real class): keep each turn's tensors, `torch.cat` once per
  key when the trajectory ends. Every byte is copied once: T·S bytes for T turns of S bytes.
- `per-turn` (what a naive implementation does): after every turn, `merged = torch.cat([merged, new])`.
  Turn t rewrites everything so far: S·(2 + 3 + ... + T) = S·(T(T+1)/2 - 1) bytes, O(T²).

What is measured, and how:
- bytes copied: instrumented, not modelled: `torch.cat` is wrapped and every call adds its output's
  `nbytes` (a cat writes its whole output). The analytic values above are printed beside it as a check.
- peak memory: each (strategy, turns) runs in a fresh subprocess; peak = `ru_maxrss` at the end minus the
  resident size (/proc/self/statm) just before the workload, after torch is imported and warmed up. torch
  tensors live outside Python's allocator, so tracemalloc would not see them; RSS does, including what the
  allocator keeps after frees. Both strategies hold every turn's tensors plus the merged result at the worst
  moment (2·T·S), so their peaks should be close; the difference is the copying, and the time it takes
  (each per-turn cat runs inside the rollout, between two generate calls).
- time: wall time of all merging work (the final merge, or the sum of the per-turn cats), fastest of 3
  repeats inside the subprocess (the repeats run after the peak is read).

    python bench/multimodal.py                 # turns 4, 16, 32
    python bench/multimodal.py --turns 4,64
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

ROWS, DIM = 1024, 1536
"""pixel_values rows per image (patches) and values per row (3 channels x temporal 2 x 16 x 16)."""


def turn_inputs(turn: int) -> dict[str, Any]:
    import torch

    return {"pixel_values": torch.full((ROWS, DIM), float(turn)), "image_grid_thw": torch.tensor([[1, 32, 32]])}


class PerTurnConcat:
    """The naive store: the merged tensors are rebuilt after every turn."""

    def __init__(self) -> None:
        self.merged: dict[str, Any] | None = None

    def add(self, mm: dict[str, Any]) -> None:
        import torch

        self.merged = dict(mm) if self.merged is None else {k: torch.cat([self.merged[k], mm[k]]) for k in mm}


def run_strategy(strategy: str, turns: int, images: list) -> tuple[dict[str, Any], float]:
    """Add `turns` chunks and merge; returns the merged tensors and the seconds spent merging."""
    from turnrl.multimodal import ImageBuffer
    from turnrl.render import Rendered

    merge_s = 0.0
    if strategy == "buffered":
        buffer = ImageBuffer()
        for t in range(turns):
            buffer.add(Rendered([0], [images[t]], turn_inputs(t)))
        t0 = time.perf_counter()
        merged = buffer.merged()
        return merged, time.perf_counter() - t0
    store = PerTurnConcat()
    for t in range(turns):
        mm = turn_inputs(t)
        t0 = time.perf_counter()
        store.add(mm)
        merge_s += time.perf_counter() - t0
    return store.merged, merge_s


def worker(strategy: str, turns: int) -> dict[str, Any]:
    """One configuration in this (fresh) process: bytes copied, peak RSS above the start, merge time."""
    import torch
    from PIL import Image

    images = [Image.new("RGB", (8, 8), (t, t, t)) for t in range(turns)]  # refs only; tensors are synthetic
    torch.cat([torch.zeros(4), torch.zeros(4)])  # warm up torch's allocator and dispatch
    copied = {"calls": 0, "bytes": 0}
    real_cat = torch.cat

    def counting_cat(tensors, *args, **kwargs):
        out = real_cat(tensors, *args, **kwargs)
        copied["calls"] += 1
        copied["bytes"] += out.nbytes
        return out

    torch.cat = counting_cat
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        start_rss = int(f.read().split()[1]) * page
    merged, _ = run_strategy(strategy, turns, images)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start_rss  # ru_maxrss is in KiB on Linux
    payload = sum(v.nbytes for v in merged.values())
    calls, nbytes = copied["calls"], copied["bytes"]
    del merged
    torch.cat = real_cat
    times = [run_strategy(strategy, turns, images)[1] for _ in range(3)]
    return {"strategy": strategy, "turns": turns, "cat_calls": calls, "bytes_copied": nbytes, "payload": payload,
            "peak_rss": peak, "merge_s": min(times)}


def analytic_bytes(strategy: str, turns: int, chunk_bytes: int) -> int:
    return chunk_bytes * (turns if strategy == "buffered" else turns * (turns + 1) // 2 - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", default="4,16,32", help="comma-separated numbers of turns (one image each)")
    parser.add_argument("--worker", nargs=2, metavar=("STRATEGY", "TURNS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return
    results = []
    for turns in [int(t) for t in args.turns.split(",")]:
        for strategy in ("buffered", "per-turn"):
            out = subprocess.run([sys.executable, __file__, "--worker", strategy, str(turns)], check=True,
                                 capture_output=True, text=True)
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    report(results)


def report(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 2**20
    chunk_bytes = ROWS * DIM * 4 + 3 * 8
    table = Table(title=f"VLM image store: one image per turn, pixel_values [{ROWS}, {DIM}] fp32 "
                        f"({ROWS * DIM * 4 / mib:.0f} MiB) + image_grid_thw [1, 3]")
    for col in ("turns", "strategy", "cats", "MiB copied", "analytic", "copied/payload", "peak RSS MiB",
                "peak/payload", "merge s"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    by = {(r["strategy"], r["turns"]): r for r in results}
    for r in results:
        table.add_row(str(r["turns"]), r["strategy"], str(r["cat_calls"]), f"{r['bytes_copied'] / mib:,.0f}",
                      f"{analytic_bytes(r['strategy'], r['turns'], chunk_bytes) / mib:,.0f}",
                      f"{r['bytes_copied'] / r['payload']:.1f}x", f"{r['peak_rss'] / mib:,.0f}",
                      f"{r['peak_rss'] / r['payload']:.2f}x", f"{r['merge_s']:.3f}")
        if r["strategy"] == "per-turn" and ("buffered", r["turns"]) in by:
            b = by[("buffered", r["turns"])]
            table.add_row("", "[bold]per-turn/buffered[/]", "", f"[bold]{r['bytes_copied'] / b['bytes_copied']:.1f}x[/]",
                          "", "", f"[bold]{r['peak_rss'] / b['peak_rss']:.2f}x[/]", "",
                          f"[bold]{r['merge_s'] / b['merge_s']:.1f}x[/]", end_section=True)
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
