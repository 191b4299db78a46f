"""Tree-packed vs flat training on the same batches: tokens forwarded and update wall time, and the tokens TRL
1.16's `TreeRow` packer would forward on the same rows.

Batches (GRPO, n = 8 samples per prompt; token ids random but shaped like the real thing, seeded):
- (a) tools: a 2,000-token tool prompt (system + tool schemas + task), three model turns of ~100 tokens each
  (trained) with a ~50-token tool output after the first two (mask 0). Model: a config-built Qwen3 (`--hidden`
  wide, `--layers` layers, heads of 32, fp32) with a `--vocab` of 8,192, so that, as in a real LLM, the LM
  head at the trained positions is a small part of the work; `micro_batch_tokens` 8,192.
- (b) harness: one 20,000-token prompt (`--long-prompt`), ~200-token completions; a narrower model
  (`--long-hidden`, `--long-layers`: flat attention over 8 × 20k tokens is minutes on a CPU) and
  `--long-rounds` (1) updates of each; `micro_batch_tokens` 24,000 (a flat row holds one sample, the tree
  row all eight).
- (c) demo: the CPU demo's batch shape (examples/arithmetic: 8 prompts × 4, SmolLM2's chat template around
  `What is a + b? Reply with just the number.`, 1-3 turns of up to 32 tokens with the env's retry feedback
  between them), on the demo's model SmolLM2-135M-Instruct with its `micro_batch_tokens` 512.

Each update is one `Learner.update` (pack, forward, loss, backward, clip, AdamW step) with GRPO's loss
(`PolicyLoss`, token-mean), timed wall clock; flat and tree alternate (`--rounds` each, the first round of
each batch is a warm-up and dropped when there are more than one) on a machine shared with other sessions:
compare the ratios, not the absolute times. The process's CPU time (all its threads) is shown beside the wall
time: on a loaded machine it is the steadier of the two. TRL: its `trl/experimental/async_grpo/packing.py` from the wheel
(`pip download trl==1.16.* --no-deps -d /tmp/trl116`; plain Python, its attention needs a GPU), each of our
tree rows' samples (the rows of the batch in its given order) added to one `TreeRow`, its unique node count summed,
beside our count on the same rows (the update's own rows follow its shuffle and can differ).

    python bench/tree.py --trl-wheel /tmp/trl116/trl-1.16.0-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from turnrl.build import build_learner
from turnrl.config import TrainConfig
from turnrl.train.loop import PolicyLoss
from turnrl.train.samples import TrainSample


def small_qwen3(hidden: int, layers: int, vocab: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    heads = max(hidden // 32, 1)
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=32,
        max_position_embeddings=32768, tie_word_embeddings=True))


def _ids(g: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def _jitter(g: torch.Generator, n: int, spread: float = 0.2) -> int:
    return max(1, int(n * (1 + spread * (2 * torch.rand(1, generator=g).item() - 1))))


def tools_batch(n: int = 8, prompt: int = 2000, turn: int = 100, tool: int = 50, vocab: int = 32768,
                seed: int = 0) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    p = _ids(g, prompt, vocab)
    out = []
    for k in range(n):
        response, mask = [], []
        for t in range(3):
            model_turn = _ids(g, _jitter(g, turn), vocab)
            response += model_turn
            mask += [1] * len(model_turn)
            if t < 2:
                output = _ids(g, _jitter(g, tool), vocab)
                response += output
                mask += [0] * len(output)
        out.append(TrainSample(p, response, mask, None, (-1.0) ** k * (0.3 + k / 10)))
    return out


def harness_batch(n: int = 8, prompt: int = 20_000, completion: int = 200, vocab: int = 32768,
                  seed: int = 1) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    p = _ids(g, prompt, vocab)
    out = []
    for k in range(n):
        response = _ids(g, _jitter(g, completion), vocab)
        out.append(TrainSample(p, response, [1] * len(response), None, (-1.0) ** k * (0.3 + k / 10)))
    return out


def demo_batch(tokenizer, prompts: int = 8, n: int = 4, max_new: int = 32, seed: int = 2) -> list[TrainSample]:
    from turnrl.envs.arithmetic import WRONG

    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    out = []
    for q in range(prompts):
        a, b = (int(x) for x in torch.randint(0, 10, (2,), generator=g))
        messages = [{"role": "user", "content": f"What is {a} + {b}? Reply with just the number."}]
        p = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        p = list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p)
        feedback = tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n{WRONG}<|im_end|>\n<|im_start|>assistant\n")
        for k in range(n):
            turns = int(torch.randint(1, 4, (1,), generator=g))
            response, mask = [], []
            for t in range(turns):
                reply = _ids(g, int(torch.randint(1, max_new + 1, (1,), generator=g)), vocab)
                response += reply
                mask += [1] * len(reply)
                if t + 1 < turns:
                    response += feedback
                    mask += [0] * len(feedback)
            out.append(TrainSample(p, response, mask, None, (-1.0) ** (q + k) * 0.5))
    return out


def trl_packer(wheel: Path | None):
    """TRL 1.16's packing module, imported from the unpacked wheel (None when no wheel is given)."""
    if wheel is None:
        return None
    target = Path(tempfile.mkdtemp(prefix="trl116-"))
    with zipfile.ZipFile(wheel) as z:
        z.extract("trl/experimental/async_grpo/packing.py", target)
    spec = importlib.util.spec_from_file_location("trl116_packing", target / "trl/experimental/async_grpo/packing.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trl_tokens(module, samples: list[TrainSample], rows) -> int:
    """Unique tokens TRL's TreeRow holds for each of our rows' samples."""
    total = 0
    for row in rows:
        tree = module.TreeRow()
        for i in row.sequence_index:
            s = samples[i]
            tree.add({"input_ids": torch.tensor(s.prompt_ids + s.response_ids),
                      "completion_mask": torch.tensor([0] * len(s.prompt_ids) + s.loss_mask), "group_id": 0})
        total += len(tree.tokens)
    return total


def config(packing: str, micro: int, model: str = "tiny-qwen3") -> TrainConfig:
    return TrainConfig.model_validate({
        "model": model, "train_data": "unused", "output_dir": tempfile.mkdtemp(prefix="bench-tree-"), "seed": 0,
        "optim": {"lr": 1e-6, "micro_batch_tokens": micro, "grad_clip": 1.0},
        "algo": {"loss_agg": "token_mean", "is_mode": "none"}, "trainer": {"packing": packing}})


def run(name: str, model, samples: list[TrainSample], micro: int, rounds: int, trl, console: Console) -> dict:
    learners = {p: build_learner(config(p, micro), copy.deepcopy(model)) for p in ("flat", "tree")}
    loss = PolicyLoss(config("tree", micro).algo, version=0)
    times: dict[str, list[float]] = {"flat": [], "tree": []}
    cpu: dict[str, list[float]] = {"flat": [], "tree": []}
    metrics: dict[str, dict] = {}
    for r in range(rounds):
        for packing in ("flat", "tree") if r % 2 == 0 else ("tree", "flat"):
            t0, c0 = time.perf_counter(), time.process_time()
            metrics[packing] = learners[packing].update(samples, loss, step=r)
            times[packing].append(time.perf_counter() - t0)
            cpu[packing].append(time.process_time() - c0)
            console.print(f"  {name} round {r} {packing}: {times[packing][-1]:.2f} s ({cpu[packing][-1]:.2f} CPU s), "
                          f"{metrics[packing]['train/tokens_forwarded']:.0f} tokens forwarded")
    timed = {p: t[1:] if len(t) > 1 else t for p, t in times.items()}
    timed_cpu = {p: t[1:] if len(t) > 1 else t for p, t in cpu.items()}
    tree_rows = learners["tree"].pack(samples, list(range(len(samples))))  # TRL's packer on these rows
    same_rows = sum(int(r.input_ids.shape[1]) for r in tree_rows)
    return {"name": name, "samples": len(samples), "raw": metrics["flat"]["train/tokens_raw"],
            "flat_tokens": metrics["flat"]["train/tokens_forwarded"],
            "tree_tokens": metrics["tree"]["train/tokens_forwarded"],
            "trl_tokens": trl_tokens(trl, samples, tree_rows) if trl is not None else None, "same_rows": same_rows,
            "flat_s": statistics.median(timed["flat"]), "tree_s": statistics.median(timed["tree"]),
            "flat_cpu": statistics.median(timed_cpu["flat"]), "tree_cpu": statistics.median(timed_cpu["tree"]),
            "loss": (metrics["flat"]["train/loss"], metrics["tree"]["train/loss"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trl-wheel", type=Path, default=None, help="trl-1.16.*.whl (pip download --no-deps)")
    ap.add_argument("--rounds", type=int, default=3, help="updates of each packing per batch (first: warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--long-prompt", type=int, default=20_000)
    ap.add_argument("--long-hidden", type=int, default=32, help="(b)'s model width (heads of 32)")
    ap.add_argument("--long-layers", type=int, default=1, help="(b)'s model depth")
    ap.add_argument("--long-rounds", type=int, default=1, help="(b)'s updates of each packing (no warm-up)")
    ap.add_argument("--only", default="abc", help="which batches: any of a, b, c")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=220)
    trl = trl_packer(args.trl_wheel)
    small = small_qwen3(args.hidden, args.layers, args.vocab)
    results = []
    if "a" in args.only:
        results.append(run("(a) tools: n=8, 2k prompt, 3 turns", small, tools_batch(vocab=args.vocab), 8192, args.rounds, trl,
                           console))
    if "b" in args.only:  # flat attention over 8 × 20k tokens is the cost: a narrower model, fewer rounds
        results.append(run(f"(b) harness: n=8, {args.long_prompt // 1000}k prompt", small_qwen3(
            args.long_hidden, args.long_layers, args.vocab), harness_batch(prompt=args.long_prompt, vocab=args.vocab),
            args.long_prompt + 4000, args.long_rounds, trl, console))
    if "c" in args.only:
        from turnrl.models import load_model, load_tokenizer

        results.append(run("(c) demo: arithmetic 8x4, SmolLM2", load_model("smollm2-135m-instruct"),
                           demo_batch(load_tokenizer("smollm2-135m-instruct")), 512, args.rounds, trl, console))
    table = Table(title=f"tree vs flat packing, one Learner.update each (torch {torch.__version__}, "
                        f"{args.threads} threads; Qwen3 of vocabulary {args.vocab}, (a) hidden {args.hidden} × {args.layers} "
                        f"layers, (b) {args.long_hidden} × {args.long_layers}; (c) SmolLM2-135M)")
    for col in ("batch", "samples", "raw tokens", "flat fwd", "tree fwd", "TRL TreeRow (tree, same rows)", "token ratio",
                "flat s", "tree s", "speed-up", "flat CPU s", "tree CPU s", "CPU ratio", "loss flat / tree"):
        table.add_column(col, justify="right" if col != "batch" else "left")
    for r in results:
        table.add_row(r["name"], str(r["samples"]), f"{r['raw']:.0f}", f"{r['flat_tokens']:.0f}",
                      f"{r['tree_tokens']:.0f}", "-" if r["trl_tokens"] is None else
                      f"{r['trl_tokens']} (tree {r['same_rows']})",
                      f"{r['flat_tokens'] / r['tree_tokens']:.2f}", f"{r['flat_s']:.2f}", f"{r['tree_s']:.2f}",
                      f"{r['flat_s'] / r['tree_s']:.2f}x", f"{r['flat_cpu']:.1f}", f"{r['tree_cpu']:.1f}",
                      f"{r['flat_cpu'] / r['tree_cpu']:.2f}x", f"{r['loss'][0]:.6f} / {r['loss'][1]:.6f}")
    console.print(table)
    print(f"python {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
