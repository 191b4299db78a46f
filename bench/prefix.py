"""Rollout time of the embedded engine with a group's shared prompt prefilled once vs by every sample.

The workload is a GRPO group's rollout as the turn loop drives it: n trajectories start together on the same
prompt; each turn samples up to `--turn-tokens` tokens (seeded, temperature 1: the same tokens in both modes),
then the trajectory's next prompt is its previous prompt, those tokens and a tool output of `--tool-tokens`
tokens, under the same request id (so both modes reuse a trajectory's own KV from its previous turn, as the
engine always did). `share` is the engine as it is (`share_prefixes=True`): the first sample prefills the
prompt and the others copy its KV; `per-sample` is `share_prefixes=False`: each sample prefills the whole prompt.
The two modes alternate within one run (A B, B A, ...) with a fresh engine each time, and the table gives the
median wall and CPU time of each (CPU time of the process: the work done, which a loaded machine disturbs less
than wall time), their ratios, and the prefill work (tokens forwarded, tokens served from the cache).

    python bench/prefix.py --case a                     # n=8, 2,000-token prompt, 3 turns of 100 tokens
    python bench/prefix.py --case a --threads 1         # the engine's forwards on one thread (engine.threads)
    python bench/prefix.py --case a --turns 1 --turn-tokens 16          # the issue's measured 104 s group
    python bench/prefix.py --case b --model tiny-qwen3 --prompt-tokens 8000

Case b (n=8, 20,000-token prompt, one 200-token completion) does not fit SmolLM2's 8,192-token context, and its
per-sample side prefills the 8 rows in one forward whose 4-D mask alone is 8 x 20,000^2 booleans (3.2 GB, ~10 GB
while it is built): on a shared 2-core machine it runs scaled down (`--prompt-tokens`, `--model`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from turnrl.engines.embedded import EmbeddedEngine
from turnrl.models import load_model, load_tokenizer
from turnrl.types import SamplingParams

CASES = {  # prompt tokens, turns, tokens per turn, tool-output tokens between turns
    "a": (2_000, 3, 100, 60),
    "b": (20_000, 1, 200, 0),
}

SYSTEM = ("You are an agent that solves tasks with tools. Think step by step, call one tool per turn, and read its "
          "output before you answer. Tools: search(query) returns web results; python(code) runs code and returns "
          "stdout; read_file(path) returns a file; write_file(path, text) writes one; bash(cmd) runs a shell "
          "command. Answer with the final result once you are sure. ")
TOOL_OUTPUT = ("\n<tool_output>\n$ python solve.py\nresult: 42\nchecked 17 cases, all pass; elapsed 0.31 s; "
               "warnings: none; next: verify the edge cases and report the answer.\n</tool_output>\n")


def repeat_to(ids: list[int], n: int) -> list[int]:
    return (ids * (n // max(len(ids), 1) + 1))[:n]


@dataclass
class Result:
    wall_s: float
    cpu_s: float  # CPU time of this process (every thread): the work done, less sensitive to a loaded machine
    prefill_s: float
    prefill_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int


async def rollout(engine: EmbeddedEngine, prompt: list[int], tool: list[int], n: int, turns: int,
                  turn_tokens: int) -> None:
    async def trajectory(k: int) -> None:
        ids = list(prompt)
        for turn in range(turns):
            params = SamplingParams(temperature=1.0, max_new_tokens=turn_tokens, seed=1000 * k + turn)
            out = await engine.generate(ids, params, request_id=f"traj{k}")
            ids += out.token_ids + tool

    await asyncio.gather(*[trajectory(k) for k in range(n)])


def run_once(model: torch.nn.Module, share: bool, prompt: list[int], tool: list[int], n: int, turns: int,
             turn_tokens: int, max_context: int, threads: int | None = None) -> Result:
    engine = EmbeddedEngine(model, max_batch_size=n, share_prefixes=share, max_context=max_context,
                            eos_token_ids=(), threads=threads)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        asyncio.run(rollout(engine, prompt, tool, n, turns, turn_tokens))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = engine.stats
        return Result(wall, cpu, float(s["prefill_s"]), int(s["prefill_tokens"]), int(s["cached_prompt_tokens"]), int(s["generated_tokens"]))
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=sorted(CASES), default="a")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--prompt-tokens", type=int, help="default: the case's")
    ap.add_argument("--turns", type=int, help="default: the case's")
    ap.add_argument("--turn-tokens", type=int, help="default: the case's")
    ap.add_argument("--tool-tokens", type=int, help="default: the case's")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternated")
    ap.add_argument("--threads", type=int, default=None,
                    help="the engine's intra-op threads, both modes (engine.threads; default: torch's)")
    args = ap.parse_args()
    prompt_tokens, turns, turn_tokens, tool_tokens = CASES[args.case]
    prompt_tokens = args.prompt_tokens or prompt_tokens
    turns, turn_tokens = args.turns or turns, args.turn_tokens or turn_tokens
    tool_tokens = tool_tokens if args.tool_tokens is None else args.tool_tokens

    torch.manual_seed(0)
    tok = load_tokenizer(args.model)
    model = load_model(args.model).eval()
    task = tok.encode("\nTask: find the answer.\n")
    prompt = repeat_to(tok.encode(SYSTEM), prompt_tokens - len(task)) + task
    tool = repeat_to(tok.encode(TOOL_OUTPUT), tool_tokens) if tool_tokens else []
    max_context = len(prompt) + turns * (turn_tokens + len(tool)) + 8
    results: dict[bool, list[Result]] = {True: [], False: []}
    for r in range(args.repeats):
        for share in ((True, False) if r % 2 == 0 else (False, True)):
            res = run_once(model, share, prompt, tool, args.n, turns, turn_tokens, max_context, args.threads)
            results[share].append(res)
            print(f"repeat {r} {'share' if share else 'per-sample'}: {res.wall_s:.1f} s wall, {res.cpu_s:.1f} s CPU "
                  f"({res.prefill_s:.1f} s prefilling {res.prefill_tokens} tokens)", flush=True)

    table = Table(title=f"case {args.case}: {args.model}, n={args.n}, {len(prompt)}-token prompt, {turns} turn(s) "
                        f"of {turn_tokens} tokens, {len(tool)}-token tool outputs ({args.repeats} alternated runs, "
                        f"engine threads {args.threads or f'torch default {torch.get_num_threads()}'})")
    for col in ("mode", "wall s (median)", "of which prefill s", "CPU s (median)", "prefill tokens",
                "cached prompt tokens", "generated tokens", "speed-up (wall)", "speed-up (CPU)"):
        table.add_column(col, justify="right")
    base = statistics.median(r.wall_s for r in results[False])
    base_cpu = statistics.median(r.cpu_s for r in results[False])
    for share in (False, True):
        runs = results[share]
        wall = statistics.median(r.wall_s for r in runs)
        prefill = statistics.median(r.prefill_s for r in runs)
        cpu = statistics.median(r.cpu_s for r in runs)
        last = runs[-1]
        table.add_row("share" if share else "per-sample", f"{wall:.1f}", f"{prefill:.1f}", f"{cpu:.1f}",
                      str(last.prefill_tokens), str(last.cached_prompt_tokens), str(last.generated_tokens),
                      f"{base / wall:.2f}x", f"{base_cpu / cpu:.2f}x")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
