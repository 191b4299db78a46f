"""Rows of the compaction recipe: train.jsonl (128 RL reports), eval.jsonl (32 held out: other codes, other reports)
and sft.jsonl (the warm start: 64 demonstration episodes, each as its two branches: reading with short replies up to
the summary request, answered with the code; then the compacted branch, answered from its summary).

    python examples/compaction/prepare_data.py --out data/compaction
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env import QUESTION, page  # noqa: E402

from turnrl.rollout.context import SUMMARY_HEADER  # noqa: E402

PROMPT = ("You will read a report, one page per turn. Reply 'next' to get the next page. "
          "At the end you will be asked for the access code written in the report.")


def rows(n: int, seed: int, prefix: str) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"{prefix}{k}", "prompt": PROMPT, "code": str(rng.randint(1000, 9999)), "seed": rng.randint(0, 10**6)}
            for k in range(n)]


def demonstrations(rows_: list[dict], instruction: str) -> list[dict]:
    """Each episode's two branches as SFT conversations (the pages are the env's own, from the row's seed)."""
    out = []
    for row in rows_:
        rng, code = random.Random(row["seed"]), row["code"]
        first, second = page(rng, 1, code), page(rng, 2, None)
        summary = f"The access code is {code}."
        out.append({"id": f"{row['id']}-read", "messages": [
            {"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": "next"},
            {"role": "user", "content": first}, {"role": "assistant", "content": "next"},
            {"role": "user", "content": instruction}, {"role": "assistant", "content": summary}]})
        out.append({"id": f"{row['id']}-answer", "messages": [
            {"role": "user", "content": row["prompt"]}, {"role": "user", "content": SUMMARY_HEADER + summary},
            {"role": "user", "content": second}, {"role": "assistant", "content": "next"},
            {"role": "user", "content": QUESTION}, {"role": "assistant", "content": code}]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="data/compaction")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = rows(128, 0, "r"), rows(32, 1, "h")
    config = yaml.safe_load((Path(__file__).resolve().parent / "config.yaml").read_text())
    sft = demonstrations(rows(64, 2, "s"), config["rollout"]["context"]["instruction"])
    for name, data in (("train", train), ("eval", held_out), ("sft", sft)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    print(f"wrote {len(train)} train, {len(held_out)} held-out rows and {len(sft)} SFT conversations to {out}")


if __name__ == "__main__":
    main()
