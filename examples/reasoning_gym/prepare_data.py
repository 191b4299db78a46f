"""Rows for the reasoning-gym recipe: a seed per row and nothing else (the env generates each task from its seed).

    python examples/reasoning_gym/prepare_data.py --out data/reasoning_gym

train.jsonl: items 0..N-1 of the dataset with the config's seed (0). eval.jsonl: 32 items of a dataset with
another seed (1000, set per row in `env_config`), so the held-out problems are generated apart from the training
ones (with two-digit sums some coincide: there are 10,000 of them).
"""

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="data/reasoning_gym")
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--eval", type=int, default=32)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train = [{"id": f"train-{i}", "seed": i} for i in range(args.train)]
    held_out = [{"id": f"eval-{i}", "seed": i, "env_config": {"seed": 1000}} for i in range(args.eval)]
    for name, rows in (("train.jsonl", train), ("eval.jsonl", held_out)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(train)} training and {len(held_out)} held-out rows to {out}")


if __name__ == "__main__":
    main()
