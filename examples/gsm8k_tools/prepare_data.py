"""Rows for the GSM8K tool-agent recipe (verl's gsm8k_tool_agent_loop data, turnrl's schema).

Each row: `prompt` (system + user messages), `agent_name: tool_agent`, `answer`, and `tools_kwargs` giving the
stateful `check_answer` tool its ground truth (`{"check_answer": {"create_kwargs": {"ground_truth": ...}}}`).

    python examples/gsm8k_tools/prepare_data.py --out data/gsm8k                  # generated problems
    python examples/gsm8k_tools/prepare_data.py --out data/gsm8k --gsm8k-dir DIR  # real GSM8K parquet

It also writes `sft.jsonl`, demonstrations for the SFT warm start (`turnrl sft examples/gsm8k_tools/sft.yaml`):
one calculator call per calculation, the calculator's result, then `The answer is N.` and `#### N`. With real
GSM8K the calculations are the solution's own annotations (`<<48/2=24>>`), from training rows the RL prompts do
not use; with generated problems, the expression the template solves.

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

TEMPLATES = [  # (question, the expression that solves it)
    ("{name} has {a} apples. {name} buys {b} bags with {c} apples in each bag. How many apples does {name} have now?",
     "{a} + {b} * {c}"),
    ("A shop sells pencils for {c} dollars each. {name} buys {b} pencils and pays with {a} dollars more than the "
     "cost as a tip. How many dollars does {name} spend in total?", "{b} * {c} + {a}"),
    ("{name} reads {b} pages every day for {c} days, then {a} more pages. How many pages did {name} read?",
     "{b} * {c} + {a}"),
    ("A farm has {b} rows of {c} trees. {a} trees are cut down. How many trees are left?",
     "{b} * {c} - {a}"),
]
ANNOTATION = re.compile(r"<<([^=<>]+)=([^<>]+)>>")  # GSM8K's calculator annotations: <<48/2=24>>
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana"]


def generated_rows(n: int, seed: int) -> list[dict]:
    """Rows with a `calculations` column: [(expression, result)] that solve them (what demonstrations call)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        template, expression = TEMPLATES[rng.randrange(len(TEMPLATES))]
        a, b, c = rng.randint(2, 20), rng.randint(2, 9), rng.randint(2, 12)
        if "-" in expression:  # "b rows of c trees, a cut down": never more than there are
            a = 1 + a % (b * c - 1)
        expr = expression.format(a=a, b=b, c=c)
        answer = str(eval(expr))  # noqa: S307 (our own template)
        question = template.format(name=rng.choice(NAMES), a=a, b=b, c=c)
        rows.append({**make_row(f"gen-{seed}-{i}", question, answer), "calculations": [[expr, answer]]})
    return rows


def demonstration(row: dict) -> dict:
    """An SFT row (turnrl sft) for a prompt row: one calculator call per calculation, each followed by the
    calculator's result, then the final answer in the format the reward reads."""
    from turnrl.tools.calculator import evaluate_expression, format_number

    messages = [*row["prompt"]]
    for expression, _ in row["calculations"]:
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        result = format_number(evaluate_expression(expression))  # the text the calculator tool returns
        messages += [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                     {"role": "tool", "name": "calculator", "content": result}]
    messages.append({"role": "assistant", "content": f"The answer is {row['answer']}.\n#### {row['answer']}"})
    return {"id": f"sft-{row['id']}", "messages": messages, "answer": row["answer"]}


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
        row = make_row(f"gsm8k-{parquet.stem}-{i}", r["question"], match.group(1).replace(",", ""))
        rows.append({**row, "calculations": [[e.strip(), v.strip()] for e, v in ANNOTATION.findall(r["answer"])]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/gsm8k"))
    ap.add_argument("--gsm8k-dir", type=Path, help="directory with GSM8K train-*.parquet / test-*.parquet")
    ap.add_argument("--train", type=int, default=256)
    ap.add_argument("--eval", type=int, default=32)
    ap.add_argument("--sft", type=int, default=128, help="demonstrations for the SFT warm start (sft.jsonl)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.gsm8k_dir:
        train = gsm8k_rows(next(args.gsm8k_dir.glob("train-*.parquet")), args.train + args.sft)
        eval_ = gsm8k_rows(next(args.gsm8k_dir.glob("test-*.parquet")), args.eval)
        demos, train = train[args.train:], train[: args.train]  # GSM8K's own calculator annotations
    else:
        train, eval_ = generated_rows(args.train, args.seed), generated_rows(args.eval, args.seed + 1)
        demos = generated_rows(args.sft, args.seed + 2)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "sft.jsonl", "w") as f:
        for row in demos:
            if row["calculations"]:  # a GSM8K solution without annotations demonstrates no call
                f.write(json.dumps(demonstration(row)) + "\n")
    print(f"wrote {sum(bool(r['calculations']) for r in demos)} demonstrations to {args.out / 'sft.jsonl'}")
    for name, rows in (("train", train), ("eval", eval_)):
        with open(args.out / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps({k: v for k, v in row.items() if k != "calculations"}) + "\n")
        print(f"wrote {len(rows)} rows to {args.out / f'{name}.jsonl'}")


if __name__ == "__main__":
    main()
