"""Write the geo3k recipe's data: JSONL rows with a `prompt` (the problem's `<image>` placeholder plus the
tool-use instructions), `images` (PNG paths relative to the JSONL) and `answer`.

    python examples/geo3k_vlm/prepare_data.py                       # synthetic diagrams (offline, seconds)
    python examples/geo3k_vlm/prepare_data.py --train-parquet geometry3k/train.parquet \\
        --eval-parquet geometry3k/test.parquet                      # the real geo3k (hiyouga/geometry3k)

Synthetic data comes from `geo3k_data.generate_geo3k` (next to this script) (train and eval use different seeds, so
no problem is shared). Real rows are read with `load_geo3k` (parquet or JSONL; embedded image bytes are
written out as PNG files). Remote image URLs are refused: download the images first.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from geo3k_data import generate_geo3k, load_geo3k  # next to this script

from turnrl.envs.geo3k import tool_call_format

IMAGE_PLACEHOLDER = "<image>"

INSTRUCTIONS = (
    "\n\nSolve the problem step by step. You have a tool, calc_score, that tells you whether a candidate "
    "answer matches the reference answer. To use it, write the call inside <tool_call></tool_call> tags: "
    + tool_call_format("calc_score") + ", and wait for the result. "
    "You may check at most {checks} candidate answer(s). When you are done, reply without a tool call and end "
    "your reply with your final answer as Answer: \\boxed{your answer}."
)
"""Appended to each problem; slime's recipe asks for the same protocol (check with calc_score inside
<tool_call> tags, then give the final answer in \\boxed{}). `{checks}` becomes max_turns - 1."""


def recipe_prompt(problem: str, n_images: int, max_turns: int) -> str:
    """The problem with one `<image>` placeholder per image (added in front when the text has none)."""
    if problem.count(IMAGE_PLACEHOLDER) == 0 and n_images:
        problem = IMAGE_PLACEHOLDER * n_images + problem
    return problem + INSTRUCTIONS.replace("{checks}", str(max(max_turns - 1, 1)))


def write_split(rows: list[dict[str, Any]], out_dir: Path, split: str, max_turns: int) -> Path:
    """Rows from `load_geo3k` (images as paths or data URIs) → `<out_dir>/<split>.jsonl` + `images/`."""
    image_dir = out_dir / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for index, row in enumerate(rows):
        row_id = f"{split}-{index:05d}"
        images = [_local_png(ref, image_dir / f"{row_id}-{k}.png", out_dir, f"{split} row {index}")
                  for k, ref in enumerate(row["images"])]
        lines.append({"id": row_id, "prompt": recipe_prompt(row["problem"], len(images), max_turns),
                      "images": images, "answer": row["answer"], **({"kind": row["kind"]} if "kind" in row else {})})
    path = out_dir / f"{split}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _local_png(ref: str, target: Path, out_dir: Path, where: str) -> str:
    """A path relative to `out_dir` (the loader resolves it against the JSONL's folder)."""
    if ref.startswith(("http://", "https://")):
        raise SystemExit(f"{where}: image {ref[:80]} is remote; turnrl does not fetch images, download it first")
    if ref.startswith("data:"):
        target.write_bytes(base64.b64decode(ref.split(",", 1)[1]))
    else:
        if not Path(ref).is_file():
            raise SystemExit(f"{where}: image file {ref} does not exist")
        target.write_bytes(Path(ref).read_bytes())
    return os.path.relpath(target, out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("data/geo3k_vlm"),
                        help="output folder: train.jsonl, eval.jsonl, images/ (default: data/geo3k_vlm, git-ignored)")
    parser.add_argument("--train", type=int, default=64, help="synthetic training problems")
    parser.add_argument("--eval", type=int, default=16, help="synthetic evaluation problems")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic training set (eval uses seed + 1)")
    parser.add_argument("--train-parquet", type=Path, help="real geo3k training rows (parquet or JSONL) instead")
    parser.add_argument("--eval-parquet", type=Path, help="real geo3k evaluation rows (parquet or JSONL)")
    parser.add_argument("--max-turns", type=int, default=3, help="rollout.max_turns the prompt is written for")
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    if args.train_parquet is not None:
        splits = {"train": args.train_parquet, "eval": args.eval_parquet}
        paths = [write_split(load_geo3k(src), args.out, split, args.max_turns)
                 for split, src in splits.items() if src is not None]
    else:
        paths = write_synthetic(args.out, args.train, args.eval, args.seed, args.max_turns)
    for path in paths:
        print(f"wrote {path} ({len(path.read_text().splitlines())} rows)")


def write_synthetic(out_dir: Path, n_train: int, n_eval: int, seed: int, max_turns: int) -> list[Path]:
    """generate_geo3k writes the geo3k schema into a scratch folder; the recipe's rows add the prompt."""
    with tempfile.TemporaryDirectory() as raw:
        return [write_split(load_geo3k(generate_geo3k(Path(raw) / split, n, split_seed, split)), out_dir, split, max_turns)
                for split, n, split_seed in (("train", n_train, seed), ("eval", n_eval, seed + 1))]


if __name__ == "__main__":
    main()
