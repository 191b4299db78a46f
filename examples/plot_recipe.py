"""The curves of an SFT-then-RL recipe as one PNG (turnrl.observe.plots.plot_sft_then_rl).

    python examples/plot_recipe.py runs/calculator_agent --out examples/calculator_agent/curves.png

reads RUN/sft/metrics.jsonl and RUN/rl/metrics.jsonl (what `turnrl sft` and `turnrl train` write).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from turnrl.observe.plots import plot_sft_then_rl


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the recipe's run folder, with sft/ and rl/ inside")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    print(f"wrote {plot_sft_then_rl(read(args.run / 'sft' / 'metrics.jsonl'), read(args.run / 'rl' / 'metrics.jsonl'), args.out, args.title)}")


if __name__ == "__main__":
    main()
