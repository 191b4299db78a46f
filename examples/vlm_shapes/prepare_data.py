"""Data of the VLM recipe: SFT rows (a picture and its count), RL prompts and held-out prompts.

    python examples/vlm_shapes/prepare_data.py --out data/vlm_shapes

Writes `images/*.png` and three JSONL files whose image paths are relative to them: `sft.jsonl` (chat-message
rows: the question with its `<image>`, the right count as the reply), `train.jsonl` and `eval.jsonl` (prompts
with `answer` for the counting environment, examples/vlm_shapes/shapes.py). Different seeds, different pictures.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from shapes import QUESTION, write_pictures  # noqa: E402

from turnrl.data import write_jsonl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/vlm_shapes"))
    ap.add_argument("--sft", type=int, default=2400)
    ap.add_argument("--train", type=int, default=256)
    ap.add_argument("--eval", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    images = args.out / "images"
    sft = write_pictures(images, "sft", args.sft, random.Random(args.seed))
    write_jsonl(args.out / "sft.jsonl", [
        {"id": f"sft-{i}", "images": [path], "answer": n,
         "messages": [{"role": "user", "content": "<image>" + QUESTION}, {"role": "assistant", "content": str(n)}]}
        for i, (path, n) in enumerate(sft)])
    for k, (name, count) in enumerate((("train", args.train), ("eval", args.eval))):
        pictures = write_pictures(images, name, count, random.Random(args.seed + 1 + k))
        write_jsonl(args.out / f"{name}.jsonl", [{"id": f"{name}-{i}", "images": [path], "answer": n,
                                                  "prompt": "<image>" + QUESTION}
                                                 for i, (path, n) in enumerate(pictures)])
    print(f"wrote {args.sft} SFT rows, {args.train} RL prompts and {args.eval} held-out prompts to {args.out}")


if __name__ == "__main__":
    main()
