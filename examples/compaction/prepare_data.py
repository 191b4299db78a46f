"""Rows of the compaction recipe: train.jsonl (128) and eval.jsonl (32 held out: other codes, other reports).

    python examples/compaction/prepare_data.py --out data/compaction
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PROMPT = ("You will read a report, one page per turn. Reply 'next' to get the next page. "
          "At the end you will be asked for the access code written in the report.")


def rows(n: int, seed: int, prefix: str) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"{prefix}{k}", "prompt": PROMPT, "code": str(rng.randint(1000, 9999)), "seed": rng.randint(0, 10**6)}
            for k in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="data/compaction")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = rows(128, 0, "r"), rows(32, 1, "h")
    for name, data in (("train", train), ("eval", held_out)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    print(f"wrote {len(train)} train and {len(held_out)} held-out rows to {out}")


if __name__ == "__main__":
    main()
