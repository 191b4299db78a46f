"""Adaptive admission against fixed concurrencies, and rollout workers 1 vs 2.

admission: the latency harness (`turnrl.testing.latency`: `LatencyEngine` with a KV budget of --kv-tokens, a
decode step of --per-token-s for up to --max-batch rows, recomputation at --prefill-per-token-s per token;
`LatencyToolEnv` episodes of 1 to 6 turns with lognormal tool latencies). The same rows run with each fixed
`rollout.concurrency` of --fixed and with `auto` (kv_soft_cap --soft, kv_hard_cap --hard), alternated over
--rounds. Turns per second, preemptions (running requests preempted plus live trajectories' cached prefixes
evicted: both recomputed), and trajectories admitted while the engine's last KV report was past the hard cap.

workers: the zero-cost engine and env of bench/overhead.py inside each Ray rollout worker (a `RayRollout` of 1,
then 2 workers, each its own process with its own engine), --worker-trajectories trajectories of 4 turns at
concurrency 10,000 per worker. Turns per second seen by the driver.

    PYTHONPATH=. python bench/admission.py                      # both
    PYTHONPATH=. python bench/admission.py --what admission --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from turnrl.agents import AGENTS
from turnrl.models import load_tokenizer
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutLimits, RolloutManager
from turnrl.rollout.admission import Admission, AdmissionSettings
from turnrl.testing.latency import LatencyDraw, LatencyEngine, build_env, latency_rows

REPLY = "It is done, and here is the answer with a few more words to hold some cache."


async def _admission_run(args: argparse.Namespace, tokenizer: Any, renderer: ChatRenderer, concurrency: Any
                         ) -> dict[str, float]:
    reply = tokenizer(REPLY, add_special_tokens=False)["input_ids"]
    engine = LatencyEngine(reply, per_token_s=args.per_token_s, max_batch=args.max_batch, kv_tokens=args.kv_tokens,
                           prefill_per_token_s=args.prefill_per_token_s)
    manager = RolloutManager(engine, renderer, agents=AGENTS, env_factory=build_env, sanity_mode="disable",
                             limits=RolloutLimits(max_turns=8, max_new_tokens=args.max_new_tokens),
                             admission=AdmissionSettings(concurrency, kv_soft_cap=args.soft, kv_hard_cap=args.hard))
    rows = latency_rows(args.trajectories, LatencyDraw(mean_s=args.tool_mean_s, sigma=1.0, seed=11))
    t0 = time.perf_counter()
    turns = sum([t.num_turns async for t in manager.stream(rows, 1)])
    wall = time.perf_counter() - t0
    gate: Admission = manager._gate()
    return {"turns_per_s": turns / wall, "preemptions": engine.stats["preemptions"],
            "past_hard": gate.admitted_past_hard_cap, "limit": manager.stats()["concurrency"]}


def admission(args: argparse.Namespace, console: Console) -> None:
    tokenizer = load_tokenizer("tiny-qwen3")
    renderer = ChatRenderer(tokenizer)
    settings: list[Any] = [*args.fixed, "auto"]
    results: dict[str, list[dict[str, float]]] = {str(c): [] for c in settings}
    for _ in range(args.rounds):
        for c in settings:
            results[str(c)].append(asyncio.run(_admission_run(args, tokenizer, renderer, c)))
    best = max(statistics.median(r["turns_per_s"] for r in results[str(c)]) for c in args.fixed)
    table = Table(title=f"admission: LatencyEngine kv_tokens={args.kv_tokens} max_batch={args.max_batch} "
                        f"per_token_s={args.per_token_s}, {args.trajectories} trajectories, tool mean "
                        f"{args.tool_mean_s}s; auto soft {args.soft} hard {args.hard}")
    for col in ("concurrency", "turns/s (rounds)", "median", "vs best fixed", "preemptions (median)",
                "admitted past the hard cap", "final limit"):
        table.add_column(col)
    for c in settings:
        rs = results[str(c)]
        med = statistics.median(r["turns_per_s"] for r in rs)
        table.add_row(str(c), " / ".join(f"{r['turns_per_s']:.0f}" for r in rs), f"{med:.0f}", f"{med / best:.2f}",
                      f"{statistics.median(r['preemptions'] for r in rs):.0f}",
                      f"{max(r['past_hard'] for r in rs):.0f}", f"{rs[-1]['limit']:.0f}")
    console.print(table)


def _zero_manager(turns: int, engine: Any) -> RolloutManager:
    """A worker's manager over the zero-cost engine of bench/overhead.py (built in the worker's process; the
    engine actors it is given are not used: the engine costs nothing and lives in the worker)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import overhead

    m = overhead._imports()
    renderer, reply, end = overhead._renderer(m)
    return RolloutManager(overhead.ZeroEngine(m, reply, end), renderer, agents=AGENTS, default_agent="env_agent",
                          limits=RolloutLimits(max_turns=turns, max_new_tokens=64), concurrency=10_000,
                          env_factory=lambda sample, config: overhead.SyncEnv(turns))


def workers(args: argparse.Namespace, console: Console) -> None:
    import ray

    from turnrl.rollout.ray import RayRollout, RolloutWorker, init_ray

    init_ray(None, num_cpus=max(args.workers))
    rows = [{"id": f"r{i}", "prompt": f"Question {i}: what is 2 + 2? Use the tool."}
            for i in range(args.worker_trajectories)]
    results: dict[int, list[float]] = {w: [] for w in args.workers}
    driver: dict[int, list[float]] = {w: [] for w in args.workers}  # the driver's CPU seconds per second of wall
    pools = {}
    for w in args.workers:
        handles = [RolloutWorker.remote(functools.partial(_zero_manager, 4), []) for _ in range(w)]  # type: ignore[attr-defined]
        ray.get([h.ready.remote() for h in handles])
        pools[w] = RayRollout(handles, None, None, None)  # type: ignore[arg-type]  # stream only

    async def warm(rollout: RayRollout) -> None:  # first calls in a worker compile templates, import lazily
        async for _ in rollout.stream(rows[: 50 * len(rollout.workers)], 1):
            pass

    for rollout in pools.values():
        asyncio.run(warm(rollout))
    for _ in range(args.rounds):
        for w in args.workers:
            async def run(rollout: RayRollout) -> tuple[float, float]:
                t0, cpu0 = time.perf_counter(), time.process_time()
                turns = sum([t.num_turns async for t in rollout.stream(rows, 1)])
                wall = time.perf_counter() - t0
                return turns / wall, (time.process_time() - cpu0) / wall

            speed, driver_cpu = asyncio.run(run(pools[w]))
            results[w].append(speed)
            driver[w].append(driver_cpu)
    table = Table(title=f"rollout workers: zero-cost engine and env in each worker, {args.worker_trajectories} "
                        "trajectories x 4 turns")
    for col in ("workers", "turns/s (rounds)", "median", "vs 1 worker", "driver CPU (of one core)"):
        table.add_column(col)
    base = statistics.median(results[args.workers[0]])
    for w in args.workers:
        med = statistics.median(results[w])
        table.add_row(str(w), " / ".join(f"{x:.0f}" for x in results[w]), f"{med:.0f}", f"{med / base:.2f}x",
                      f"{statistics.median(driver[w]):.0%}")
    console.print(table)
    for rollout in pools.values():
        for h in rollout.workers:
            ray.kill(h)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", nargs="+", default=["admission", "workers"], choices=["admission", "workers"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trajectories", type=int, default=384)
    parser.add_argument("--fixed", type=int, nargs="+", default=[8, 32, 64, 128, 384])
    parser.add_argument("--kv-tokens", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--per-token-s", type=float, default=0.004)
    parser.add_argument("--prefill-per-token-s", type=float, default=5e-5)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--tool-mean-s", type=float, default=0.05)
    parser.add_argument("--soft", type=float, default=0.85)
    parser.add_argument("--hard", type=float, default=0.95)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--worker-trajectories", type=int, default=2000)
    args = parser.parse_args()
    console = Console()
    if "admission" in args.what:
        admission(args, console)
    if "workers" in args.what:
        workers(args, console)


if __name__ == "__main__":
    main()
