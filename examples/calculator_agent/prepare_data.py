"""Data of the calculator-agent recipe: SFT demonstrations of the call format, RL prompts, held-out prompts.

    python examples/calculator_agent/prepare_data.py --out data/calculator_agent

Word problems with two-digit numbers that SmolLM2-135M-Instruct gets wrong without a calculator (it answers
a plausible number, rarely the right product):
- one step, `a * b`: boxes of items, rows of seats, weekly pay;
- two steps: `c + a * b` (some already, more bought in packs) and `a * b - c` (tickets sold, minus the rent).

`sft.jsonl` demonstrates the call format: one calculator call, the tool's result, `The answer is N.` Its
problems are the one-step kinds and three *other* two-step wordings (eggs in trays plus loose eggs, savings
plus daily pay, printed pages minus jammed ones). `train.jsonl` (RL prompts: a third one-step, two thirds
two-step) and `eval.jsonl` (held out, half and half: other numbers and names) use the two two-step wordings the
demonstrations never show. After SFT the model calls the calculator on every problem, but for these wordings
it often puts the wrong numbers or the wrong operation in the expression; RL has to teach it which expression
they need. Deterministic by seed; no problem is in two files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from turnrl.data import write_jsonl

SYSTEM = ('You are a math assistant with a calculator. To use it, reply with only <tool_call>{"name": "calculator", '
          '"arguments": {"expression": "..."}}</tool_call> and you will get the result. Then reply: The answer is N.')
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kemal", "Lena"]
ITEMS = ["pencils", "apples", "stickers", "marbles", "cards", "books"]

ONE_STEP = [
    ("{name} packs {a} boxes with {b} {item} in each box. How many {item} does {name} pack?", "{a} * {b}"),
    ("A hall has {a} rows of {b} seats. How many seats does the hall have?", "{a} * {b}"),
    ("{name} earns {b} dollars a week. How many dollars does {name} earn in {a} weeks?", "{a} * {b}"),
]
DEMO_TWO_STEP = [  # only in the demonstrations
    ("A tray holds {a} rows of {b} eggs, and there are {c} loose eggs. How many eggs are there in all?",
     "{a} * {b} + {c}"),
    ("{name} saved {c} dollars, then earned {b} dollars a day for {a} days. How many dollars does {name} have?",
     "{c} + {a} * {b}"),
    ("A printer prints {b} pages a minute for {a} minutes, and {c} pages jam. How many good pages are left?",
     "{a} * {b} - {c}"),
]
TWO_STEP = [  # only in the RL prompts and the held-out set
    ("{name} has {c} {item} and buys {a} packs of {b} {item}. How many {item} does {name} have now?",
     "{c} + {a} * {b}"),
    ("{name} sells {a} tickets at {b} dollars each and pays {c} dollars for the room. How many dollars does "
     "{name} have left?", "{a} * {b} - {c}"),
]


def problem(rng: random.Random, templates: list[tuple[str, str]], kind: str) -> dict:
    text, expression = rng.choice(templates)
    values = {"a": rng.randint(12, 99), "b": rng.randint(12, 99), "c": rng.randint(11, 99),
              "name": rng.choice(NAMES), "item": rng.choice(ITEMS)}
    expr = expression.format(**values)
    return {"question": text.format(**values), "expression": expr, "answer": eval(expr), "kind": kind}  # noqa: S307


def prompt_row(p: dict, row_id: str) -> dict:
    return {"id": row_id, "agent_name": "tool_agent", "kind": p["kind"], "answer": p["answer"],
            "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p["question"]}]}


def demonstration(p: dict, row_id: str) -> dict:
    call = json.dumps({"name": "calculator", "arguments": {"expression": p["expression"]}})
    return {"id": row_id, "kind": p["kind"], "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": p["question"]},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "name": "calculator", "content": str(p["answer"])},
        {"role": "assistant", "content": f"The answer is {p['answer']}."}]}


def unique(rng: random.Random, n: int, templates: list[tuple[str, str]], kind: str, seen: set[str]) -> list[dict]:
    out: list[dict] = []
    while len(out) < n:
        p = problem(rng, templates, kind)
        if p["question"] not in seen:
            seen.add(p["question"])
            out.append(p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/calculator_agent"))
    ap.add_argument("--sft", type=int, default=160, help="demonstrations (3/4 one-step, 1/4 other two-step)")
    ap.add_argument("--train", type=int, default=256, help="RL prompts (a third one-step, two thirds two-step)")
    ap.add_argument("--eval", type=int, default=48, help="held-out prompts (half one-step, half two-step)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng, seen = random.Random(args.seed), set()
    sft = unique(rng, args.sft - args.sft // 4, ONE_STEP, "one_step", seen)
    sft += unique(rng, args.sft // 4, DEMO_TWO_STEP, "demo_two_step", seen)
    rng.shuffle(sft)
    splits = {}
    for name, n, one in (("train", args.train, args.train // 3), ("eval", args.eval, args.eval // 2)):
        rows = unique(rng, one, ONE_STEP, "one_step", seen) + unique(rng, n - one, TWO_STEP, "two_step", seen)
        rng.shuffle(rows)
        splits[name] = [prompt_row(p, f"{name}-{i}") for i, p in enumerate(rows)]
    write_jsonl(args.out / "sft.jsonl", [demonstration(p, f"sft-{i}") for i, p in enumerate(sft)])
    for name, rows in splits.items():
        write_jsonl(args.out / f"{name}.jsonl", rows)
    print(f"wrote {len(sft)} demonstrations, {len(splits['train'])} RL prompts and {len(splits['eval'])} held-out "
          f"prompts to {args.out}")


if __name__ == "__main__":
    main()
