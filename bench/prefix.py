"""Rollout time of the embedded engine with a group's shared prompt prefilled once vs by every sample.

The workload is a GRPO group's rollout as the turn loop drives it: n trajectories start together on the same
prompt; each turn samples up to `--turn-tokens` tokens (seeded, temperature 1: the same tokens in both modes),
then the trajectory's next prompt is its previous prompt, those tokens and a tool output of `--tool-tokens`
tokens, under the same request id (so both modes reuse a trajectory's own KV from its previous turn, as the
engine always did). `share` is the engine as it is (`share_prefixes=True`): the first sample prefills the
prompt and the others copy its KV, and the rows that hold the copied prompt decode against one copy of it
(cascade attention, turnrl/engines/cascade.py); `share-copy` is the same without cascade (`cascade=False`: each
row decodes against its own copy); `per-sample` is `share_prefixes=False`: each sample prefills the whole prompt
and decodes against its own KV. The modes alternate within one run (A B C, B C A, ...) with a fresh engine each
time, and the table gives the median wall and CPU time of each (CPU time of the process: the work done, which a
loaded machine disturbs less than wall time), their ratios to `per-sample`, the prefill work (tokens forwarded,
tokens served from the cache) and the median decode step.

    python bench/prefix.py --case a                     # n=8, 2,000-token prompt, 3 turns of 100 tokens
    python bench/prefix.py --case a --threads 1         # this process at one intra-op thread (both modes)
    python bench/prefix.py --case a --turns 1 --turn-tokens 16          # the issue's measured 104 s group
    python bench/prefix.py --case b --model tiny-qwen3 --prompt-tokens 8000
    python bench/prefix.py --case a --modes per-sample,share               # without the share-copy mode

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

MODES = {  # EmbeddedEngine keywords of each mode
    "per-sample": {"share_prefixes": False},
    "share-copy": {"share_prefixes": True, "cascade": False},
    "share": {"share_prefixes": True, "cascade": True},
}
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
    decode_step_s: float  # median wall time of one decode step (all active rows)
    cascade_steps: int  # decode steps that ran cascade attention


async def rollout(engine: EmbeddedEngine, prompt: list[int], tool: list[int], n: int, turns: int,
                  turn_tokens: int) -> None:
    async def trajectory(k: int) -> None:
        ids = list(prompt)
        for turn in range(turns):
            params = SamplingParams(temperature=1.0, max_new_tokens=turn_tokens, seed=1000 * k + turn)
            out = await engine.generate(ids, params, request_id=f"traj{k}")
            ids += out.token_ids + tool

    await asyncio.gather(*[trajectory(k) for k in range(n)])


def run_once(model: torch.nn.Module, mode: str, prompt: list[int], tool: list[int], n: int, turns: int,
             turn_tokens: int, max_context: int) -> Result:
    engine = EmbeddedEngine(model, max_batch_size=n, max_context=max_context, eos_token_ids=(), **MODES[mode])
    steps: list[float] = []
    decode_step = engine._decode_step

    def timed_step() -> None:  # the engine thread's decode steps, timed from outside
        t = time.perf_counter()
        decode_step()
        steps.append(time.perf_counter() - t)

    engine._decode_step = timed_step  # type: ignore[method-assign]
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        asyncio.run(rollout(engine, prompt, tool, n, turns, turn_tokens))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = engine.stats
        return Result(wall, cpu, float(s["prefill_s"]), int(s["prefill_tokens"]), int(s["cached_prompt_tokens"]),
                      int(s["generated_tokens"]), statistics.median(steps), int(s["cascade_steps"]))
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
    ap.add_argument("--modes", default="per-sample,share-copy,share",
                    help=f"comma-separated, from {', '.join(MODES)} (per-sample is the baseline)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch's intra-op threads for this whole process, both modes (default: torch's)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if "per-sample" not in modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: a comma-separated list of {', '.join(MODES)} that includes per-sample, got {args.modes!r}")
    if args.threads:
        torch.set_num_threads(args.threads)  # before the engines start: their threads take it up
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
    results: dict[str, list[Result]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode in modes[r % len(modes):] + modes[: r % len(modes)]:  # rotated: each mode runs early and late
            res = run_once(model, mode, prompt, tool, args.n, turns, turn_tokens, max_context)
            results[mode].append(res)
            print(f"repeat {r} {mode}: {res.wall_s:.1f} s wall, {res.cpu_s:.1f} s CPU ({res.prefill_s:.1f} s prefilling "
                  f"{res.prefill_tokens} tokens; decode step {res.decode_step_s * 1e3:.0f} ms median, "
                  f"{res.cascade_steps} by cascade)", flush=True)

    table = Table(title=f"case {args.case}: {args.model}, n={args.n}, {len(prompt)}-token prompt, {turns} turn(s) "
                        f"of {turn_tokens} tokens, {len(tool)}-token tool outputs ({args.repeats} alternated runs, "
                        f"{torch.get_num_threads()} intra-op threads)")
    for col in ("mode", "wall s (median)", "of which prefill s", "CPU s (median)", "decode step ms (median)",
                "prefill tokens", "cached prompt tokens", "generated tokens", "speed-up (wall)", "speed-up (CPU)"):
        table.add_column(col, justify="right")
    base = statistics.median(r.wall_s for r in results["per-sample"])
    base_cpu = statistics.median(r.cpu_s for r in results["per-sample"])
    for mode in MODES:
        runs = results.get(mode)
        if not runs:
            continue
        wall = statistics.median(r.wall_s for r in runs)
        prefill = statistics.median(r.prefill_s for r in runs)
        cpu = statistics.median(r.cpu_s for r in runs)
        step = statistics.median(r.decode_step_s for r in runs)
        last = runs[-1]
        table.add_row(mode, f"{wall:.1f}", f"{prefill:.1f}", f"{cpu:.1f}", f"{step * 1e3:.0f}",
                      str(last.prefill_tokens), str(last.cached_prompt_tokens), str(last.generated_tokens),
                      f"{base / wall:.2f}x", f"{base_cpu / cpu:.2f}x")
    Console(width=220).print(table)


if __name__ == "__main__":
    main()
