"""Decode throughput: the embedded engine vs transformers `generate` vs transformers `generate_batch`.

The workload is an RL rollout step: B chat prompts sampled at temperature 1.0 for up to `--max-new-tokens`,
every method returning the logprob of each sampled token. Two modes:

- `eos`: EOS ends a row, so rows finish at different lengths (as in RL). `generate` keeps decoding the
  finished rows of its static batch until the longest ends; only real tokens (up to and including EOS)
  are counted, for every method.
- `fixed`: no row stops early (EOS is disabled or masked), so every method does the same work and the
  difference is the per-step cost alone.

Wall time covers the whole call (prefill included; the prompts are ~35-60 tokens) and, for `generate`,
turning its scores into logprobs. Each method is warmed up once before timing; with `--repeats > 1` the
fastest repeat is kept. In `eos` mode each method draws its own samples, so row lengths differ between
methods; at batch 1 a single sample decides the length (8 tokens or 128), so read batch 1 in `fixed` mode.

    python bench/engine.py --batches 1,8,16 --max-new-tokens 128 --model smollm2-135m-instruct --repeats 1
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from turnrl.engines.embedded import EmbeddedEngine
from turnrl.models import load_model, load_tokenizer
from turnrl.types import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a ten-year-old.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me a short recipe for pancakes.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is 17 times 23? Show your work.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Name a famous painting by Vincent van Gogh.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a pet turtle.",
    "How many continents are there? Name them.",
    "Write one sentence that uses the word 'serendipity'.",
]


@dataclass
class Run:
    """One timed call: the real tokens it produced and how long it took."""

    tokens: int
    wall_s: float


Method = Callable[[list[list[int]], int, bool], int]
"""(prompts, max_new_tokens, stop_at_eos) -> number of real tokens generated (logprobs computed too)."""


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    questions = (QUESTIONS * (n // len(QUESTIONS) + 1))[:n]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
        for q in questions
    ]


def real_length(row: list[int], eos_ids: set[int]) -> int:
    """Tokens up to and including the first EOS (all of them when there is none)."""
    return next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))


# ---- the three methods --------------------------------------------------------------------------------
def engine_method(engine: EmbeddedEngine) -> Method:
    eos_ids = engine.eos_token_ids

    def run(prompts: list[list[int]], max_new: int, stop_at_eos: bool) -> int:
        engine.eos_token_ids = eos_ids if stop_at_eos else frozenset()  # read per request at submission
        params = SamplingParams(temperature=1.0, max_new_tokens=max_new)

        async def all_requests():
            return await asyncio.gather(
                *[engine.generate(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
            )

        outs = asyncio.run(all_requests())
        assert all(len(o.logprobs) == len(o.token_ids) for o in outs)
        return sum(len(o.token_ids) for o in outs)

    return run


def generate_method(model, eos_ids: set[int], pad_id: int) -> Method:
    def run(prompts: list[list[int]], max_new: int, stop_at_eos: bool) -> int:
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        # top_k=0: without it generate samples from the top 50 (its default), not the full distribution
        out = model.generate(
            input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=max_new,
            min_new_tokens=0 if stop_at_eos else max_new, pad_token_id=pad_id,
            output_scores=True, return_dict_in_generate=True,
        )
        new_B_T = out.sequences[:, width:]
        # scores are the processed logits each token was sampled from: the same logprobs the engine returns
        logp_B_T = torch.stack(
            [s.log_softmax(-1).gather(1, new_B_T[:, t : t + 1])[:, 0] for t, s in enumerate(out.scores)], 1
        )
        assert logp_B_T.shape == new_B_T.shape
        rows = new_B_T.tolist()
        return sum(real_length(r, eos_ids) if stop_at_eos else len(r) for r in rows)

    return run


def generate_batch_method(model, eos_ids: set[int], pad_id: int, max_batch: int) -> tuple[Method, str]:
    """transformers' continuous batching; falls back to no logprobs if they are not supported."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    def make(return_logprobs: bool) -> Method:
        def run(prompts: list[list[int]], max_new: int, stop_at_eos: bool) -> int:
            config = GenerationConfig(
                do_sample=True, temperature=1.0, top_k=0, max_new_tokens=max_new, pad_token_id=pad_id,
                eos_token_id=sorted(eos_ids) if stop_at_eos else -1,  # -1 disables EOS in generate_batch
            )
            # Sized for this workload: left to itself it sizes the paged cache from free memory, which on a
            # CPU means gigabytes allocated and cleared on every call.
            page = 256
            cb_config = ContinuousBatchingConfig(
                return_logprobs=return_logprobs, max_requests_per_batch=max_batch, page_size=page,
                num_blocks=len(prompts) * -(-(max(map(len, prompts)) + max_new) // page) + 1,
                max_batch_tokens=max(page, sum(map(len, prompts))),
            )
            results = model.generate_batch(
                prompts, generation_config=config, continuous_batching_config=cb_config, max_new_tokens=max_new
            )
            if len(results) != len(prompts) or any(r.error for r in results.values()):
                raise RuntimeError(f"generate_batch failed: {[r.error for r in results.values() if r.error]}")
            if return_logprobs:
                assert all(len(r.logprobs) == len(r.generated_tokens) for r in results.values())
            rows = [r.generated_tokens for r in results.values()]
            return sum(real_length(r, eos_ids) if stop_at_eos else len(r) for r in rows)

        return run

    try:
        with_logprobs = make(True)
        with_logprobs([[1, 2, 3]], 2, True)
        return with_logprobs, "with logprobs"
    except Exception as e:  # any failure: time it without logprobs and say so
        return make(False), f"NO logprobs ({type(e).__name__}: {e})"


# ---- timing and report ----------------------------------------------------------------------------------
def time_method(method: Method, prompts: list[list[int]], max_new: int, stop_at_eos: bool, repeats: int) -> Run:
    runs = []
    for i in range(repeats):
        torch.manual_seed(i)
        t0 = time.perf_counter()
        tokens = method(prompts, max_new, stop_at_eos)
        runs.append(Run(tokens, time.perf_counter() - t0))
    return min(runs, key=lambda r: r.wall_s / r.tokens)


def report(results: dict[tuple[str, int, str], Run], methods: list[str], notes: dict[str, str], args) -> Table:
    table = Table(
        title=f"Decode throughput, {args.model}, temperature 1.0, max_new_tokens {args.max_new_tokens}, "
        f"{torch.get_num_threads()} torch threads",
        caption="All methods sample the full distribution (top_k=0) and return per-token logprobs: generate via "
        "output_scores=True + return_dict_in_generate=True (log_softmax of the scores is inside the timing). "
        "Tokens = real tokens (up to and including EOS). eos: rows stop at EOS; fixed: no early EOS "
        "(min_new_tokens = max_new_tokens for generate, EOS disabled for the others).",
    )
    for col in ("mode", "batch", "method", "tokens", "wall s", "tok/s", "vs generate"):
        table.add_column(col, justify="left" if col in ("mode", "method") else "right")
    for mode in ("eos", "fixed"):
        for batch in args.batches:
            base = results.get((mode, batch, "generate"))
            for name in methods:
                run = results.get((mode, batch, name))
                if run is None:
                    continue
                tps = run.tokens / run.wall_s
                ratio = tps / (base.tokens / base.wall_s) if base else float("nan")
                label = f"{name} ({notes[name]})" if notes.get(name) else name
                table.add_row(mode, str(batch), label, str(run.tokens), f"{run.wall_s:.2f}", f"{tps:.1f}",
                              f"{ratio:.2f}x")
            table.add_section()
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,16", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip", default="", help="comma-separated methods to leave out, e.g. generate_batch")
    args = parser.parse_args()

    console = Console()
    model = load_model(args.model).eval()
    tokenizer = load_tokenizer(args.model)
    max_batch = max(args.batches)
    prompts = chat_prompts(tokenizer, max_batch)

    engine = EmbeddedEngine(model, max_batch_size=max_batch, prefix_cache_tokens=0)
    eos_ids = set(engine.eos_token_ids)  # every method stops on the same tokens
    pad_id = model.generation_config.pad_token_id
    pad_id = pad_id if pad_id is not None else min(eos_ids)

    run_cb, cb_note = generate_batch_method(model, eos_ids, pad_id, max_batch)
    methods: dict[str, Method] = {
        "engine": engine_method(engine),
        "generate": generate_method(model, eos_ids, pad_id),
        "generate_batch": run_cb,
    }
    methods = {k: v for k, v in methods.items() if k not in args.skip.split(",")}
    notes = {"generate_batch": cb_note}

    results: dict[tuple[str, int, str], Run] = {}
    with torch.inference_mode():
        for method in methods.values():
            method(prompts[: min(4, max_batch)], 8, True)  # warm-up
        for mode in ("eos", "fixed"):
            for batch in args.batches:
                for name, method in methods.items():
                    try:
                        run = time_method(method, prompts[:batch], args.max_new_tokens, mode == "eos", args.repeats)
                    except Exception as e:  # one broken method must not lose the other rows
                        console.log(f"{mode} batch {batch} {name} FAILED: {type(e).__name__}: {e}")
                        continue
                    results[(mode, batch, name)] = run
                    console.log(f"{mode} batch {batch} {name}: {run.tokens} tokens in {run.wall_s:.2f}s")
    engine.close()
    console.print(report(results, list(methods), notes, args))


if __name__ == "__main__":
    main()
