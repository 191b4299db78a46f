"""Train / held-out rows for the arithmetic demo (single-digit + and -, disjoint problems, deterministic)."""

from __future__ import annotations

import argparse
from pathlib import Path

from turnrl.data import write_jsonl
from turnrl.envs.arithmetic import split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("data/arithmetic"))
    ap.add_argument("--ops", default="+-")
    ap.add_argument("--held-out-per-op", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    train, held_out = split(args.ops, args.held_out_per_op, args.seed)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "eval.jsonl", held_out)
    print(f"wrote {len(train)} train and {len(held_out)} held-out rows to {args.out}")


if __name__ == "__main__":
    main()
