"""Rows for the GSM8K tool-agent recipe (verl's gsm8k_tool_agent_loop data, turnrl's schema).

Each row: `prompt` (system + user messages), `agent_name: tool_agent`, `answer`, and `tools_kwargs` giving the
stateful `check_answer` tool its ground truth (`{"check_answer": {"create_kwargs": {"ground_truth": ...}}}`).

    python examples/gsm8k_tools/prepare_data.py --out data/gsm8k                  # generated problems
    python examples/gsm8k_tools/prepare_data.py --out data/gsm8k --gsm8k-dir DIR  # real GSM8K parquet

The real dataset (openai/gsm8k: `main/train-*.parquet`, `main/test-*.parquet` with `question` and an `answer`
ending in `#### <number>`) is used when a directory with those files is given; here, with no dataset hub,
arithmetic word problems are generated from templates, deterministically by seed.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

SYSTEM = (
    "You are a careful math assistant. Solve the problem step by step. For arithmetic, call the calculator "
    'tool like this: <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call> '
    'and wait for its result. You may check a final answer once with <tool_call>{"name": "check_answer", '
    '"arguments": {"answer": "84"}}</tool_call>. End your last message with "#### <number>".'
)

TEMPLATES = [
    ("{name} has {a} apples. {name} buys {b} bags with {c} apples in each bag. How many apples does {name} have now?",
     lambda a, b, c: a + b * c),
    ("A shop sells pencils for {c} dollars each. {name} buys {b} pencils and pays with {a} dollars more than the "
     "cost as a tip. How many dollars does {name} spend in total?", lambda a, b, c: b * c + a),
    ("{name} reads {b} pages every day for {c} days, then {a} more pages. How many pages did {name} read?",
     lambda a, b, c: b * c + a),
    ("A farm has {b} rows of {c} trees. {a} trees are cut down. How many trees are left?",
     lambda a, b, c: b * c - a),
]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana"]


def generated_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        template, solve = TEMPLATES[rng.randrange(len(TEMPLATES))]
        a, b, c = rng.randint(2, 20), rng.randint(2, 9), rng.randint(2, 12)
        if solve(a, b, c) < 0:  # "b rows of c trees, a cut down": never more than there are
            a = 1 + a % (b * c - 1)
        question = template.format(name=rng.choice(NAMES), a=a, b=b, c=c)
        rows.append(make_row(f"gen-{seed}-{i}", question, str(solve(a, b, c))))
    return rows


def make_row(row_id: str, question: str, answer: str) -> dict:
    return {
        "id": row_id,
        "agent_name": "tool_agent",
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "answer": answer,
        "tools_kwargs": {"check_answer": {"create_kwargs": {"ground_truth": answer}}},
    }


def gsm8k_rows(parquet: Path, limit: int | None) -> list[dict]:
    import pyarrow.parquet as pq

    rows = []
    for i, r in enumerate(pq.read_table(parquet).to_pylist()[:limit]):
        match = re.search(r"####\s*(-?[\d,\.]+)", r["answer"])
        if match is None:
            raise ValueError(f"{parquet} row {i}: answer has no '#### <number>' ending")
        rows.append(make_row(f"gsm8k-{parquet.stem}-{i}", r["question"], match.group(1).replace(",", "")))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/gsm8k"))
    ap.add_argument("--gsm8k-dir", type=Path, help="directory with GSM8K train-*.parquet / test-*.parquet")
    ap.add_argument("--train", type=int, default=256)
    ap.add_argument("--eval", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.gsm8k_dir:
        train = gsm8k_rows(next(args.gsm8k_dir.glob("train-*.parquet")), args.train)
        eval_ = gsm8k_rows(next(args.gsm8k_dir.glob("test-*.parquet")), args.eval)
    else:
        train, eval_ = generated_rows(args.train, args.seed), generated_rows(args.eval, args.seed + 1)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", eval_)):
        with open(args.out / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {len(rows)} rows to {args.out / f'{name}.jsonl'}")


if __name__ == "__main__":
    main()
