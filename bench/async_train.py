"""Synchronous vs asynchronous training where generation, tools and the update are separate resources.

As on GPUs: the accelerator that samples (`turnrl.testing.latency.LatencyEngine`, a continuous-batching server modelled in
time), the tools (heavy-tailed latency, `turnrl.testing.latency.LatencyToolEnv`) and the trainer (an update of fixed cost,
`turnrl.testing.latency.simulate_training`) each take time without taking the others'. Every run trains the same number
of steps of `--batch` groups of `--n` trajectories over the same rows (same episode lengths, same latency draws):

- sync: `TrajectoryBuffer(max_staleness=0)`: a step's groups are admitted at the current weights and the step
  waits for all of them; rollouts stop while the trainer updates. (turnrl's sync mode, and every sync trainer.)
- async K: the same buffer with `max_staleness=K`: rollouts go on during updates, a group is trained within K
  versions of the policy that sampled it, nothing is dropped (`turnrl.train.buffer`).
- drop-stale K (a baseline, for the length-bias column only): the B groups that finished first are trained and
  finished groups older than K versions are discarded, as the drop strategies of other frameworks do.
- bound: max(generation, update, longest chain): generation = all decode steps packed at full batch, update =
  steps × --update-s, longest chain = the slowest single trajectory (its tools plus its own decode steps).

Columns: trained samples per hour, speed-up over sync, fraction of the bound reached, engine idle %, trainer idle
%, the staleness of trained groups, and the length bias: mean turns of trained episodes minus mean turns of all
finished episodes (0 = unbiased; drop-stale discards the slow, long ones).

    python bench/async_train.py
    python bench/async_train.py --steps 12 --batch 8 --n 4 --update-s 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter

from rich.console import Console
from rich.table import Table

from turnrl.agents import AGENTS
from turnrl.models import load_tokenizer
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutLimits, RolloutManager
from turnrl.testing.latency import LatencyDraw, LatencyEngine, build_env, latency_rows, simulate_training
from turnrl.train.buffer import Group, TrajectoryBuffer


class DropStaleBuffer(TrajectoryBuffer):
    """The baseline: train whatever finished first, discard finished groups older than max_staleness."""

    def _next_batch(self) -> list[Group] | None:
        version = self.trained // self.batch_size  # the policy the next step updates
        for g in [g for g in self.pending.values() if g.trajectories is not None]:
            if version - g.oldest_version > self.max_staleness:
                del self.pending[g.index]
                self.stats.dropped += 1
                self.finished_dropped.extend(g.trajectories or [])
        done = sorted((g for g in self.pending.values() if g.trajectories is not None), key=lambda g: g.index)
        return done[: self.batch_size] if len(done) >= self.batch_size else None

    def can_admit(self, version: int) -> bool:  # refill what was dropped, as drop strategies do
        return self.admitted - self.stats.dropped < (version + self.max_staleness + 1) * self.batch_size

    def __init__(self, batch_size: int, max_staleness: int):
        super().__init__(batch_size, max_staleness)
        self.finished_dropped: list = []


def make_rows(args: argparse.Namespace) -> list[dict]:
    return latency_rows(args.rows, LatencyDraw(mean_s=args.tool_mean_s, sigma=args.tool_sigma, min_turns=1,
                                               max_turns=args.max_turns, seed=args.seed))


async def run(args: argparse.Namespace, tokenizer, buffer: TrajectoryBuffer) -> dict[str, float]:
    reply = tokenizer("x " * args.tokens_per_turn, add_special_tokens=False)["input_ids"][: args.tokens_per_turn]
    engine = LatencyEngine(reply, per_token_s=args.per_token_s, max_batch=args.engine_batch)
    manager = RolloutManager(engine, ChatRenderer(tokenizer), agents=AGENTS, env_factory=build_env,
                             concurrency=10_000, sanity_mode="disable",
                             limits=RolloutLimits(max_turns=args.max_turns, max_new_tokens=args.tokens_per_turn))
    rows = make_rows(args)
    result = await simulate_training(manager, engine, rows, steps=args.steps, update_s=args.update_s, n=args.n,
                                     buffer=buffer)
    trained = [t for _, groups in result.steps for g in groups for t in g.trajectories or []]
    finished = trained + [t for g in buffer.pending.values() for t in g.trajectories or []]
    finished += getattr(buffer, "finished_dropped", [])
    busy_s = engine.stats["steps"] * args.per_token_s
    staleness = Counter(buffer.stats.staleness)
    return {
        "wall_s": result.wall_s, "trained": len(trained), "engine_idle": 1 - busy_s / result.wall_s,
        "trainer_idle": buffer.stats.wait_s / result.wall_s, "max_staleness": max(staleness, default=0),
        "mean_staleness": sum(k * v for k, v in staleness.items()) / max(sum(staleness.values()), 1),
        "length_bias": statistics.mean(t.num_turns for t in trained) - statistics.mean(t.num_turns for t in finished),
        "dropped": buffer.stats.dropped,
    }


def bound_s(args: argparse.Namespace) -> tuple[float, dict[str, float]]:
    rows = make_rows(args)
    used = [rows[i % len(rows)] for i in range(args.steps * args.batch)]
    turns = sum(len(r["latencies_s"]) for r in used) * args.n
    generation = turns * args.tokens_per_turn / args.engine_batch * args.per_token_s
    update = args.steps * args.update_s
    chain = max(sum(r["latencies_s"]) + len(r["latencies_s"]) * args.tokens_per_turn * args.per_token_s for r in used)
    parts = {"generation": generation, "update": update, "longest chain": chain}
    return max(parts.values()), parts


async def main(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer("tiny-qwen3")
    bound, parts = bound_s(args)
    settings = [("sync (K=0)", TrajectoryBuffer(args.batch, 0))]
    settings += [(f"async K={k}", TrajectoryBuffer(args.batch, k)) for k in args.staleness]
    settings += [(f"drop-stale K={k}", DropStaleBuffer(args.batch, k)) for k in args.drop_baseline]
    results = []
    for name, buffer in settings:
        t0 = time.perf_counter()
        results.append((name, await run(args, tokenizer, buffer)))
        Console().print(f"{name}: {time.perf_counter() - t0:.1f} s")
    sync_rate = results[0][1]["trained"] / results[0][1]["wall_s"]
    table = Table(title=f"{args.steps} steps x {args.batch} groups x {args.n} samples; update {args.update_s} s; "
                        f"bound {bound:.1f} s ({', '.join(f'{k} {v:.1f} s' for k, v in parts.items())})")
    for col in ("run", "wall s", "trained samples/h", "vs sync", "of bound", "engine idle", "trainer idle",
                "staleness max / mean", "dropped", "length bias (turns)"):
        table.add_column(col, justify="right")
    for name, r in results:
        rate = r["trained"] / r["wall_s"]
        ideal = r["trained"] / bound
        table.add_row(name, f"{r['wall_s']:.1f}", f"{rate * 3600:,.0f}", f"{rate / sync_rate:.2f}x",
                      f"{rate / ideal:.2f}", f"{r['engine_idle']:.0%}", f"{r['trainer_idle']:.0%}",
                      f"{r['max_staleness']} / {r['mean_staleness']:.2f}", str(r["dropped"]), f"{r['length_bias']:+.2f}")
    Console(width=200).print(table)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8, help="groups per step")
    p.add_argument("--n", type=int, default=4, help="samples per group")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--tokens-per-turn", type=int, default=16)
    p.add_argument("--per-token-s", type=float, default=0.005)
    p.add_argument("--engine-batch", type=int, default=256)
    p.add_argument("--tool-mean-s", type=float, default=0.2)
    p.add_argument("--tool-sigma", type=float, default=1.0)
    p.add_argument("--update-s", type=float, default=2.0)
    p.add_argument("--staleness", type=int, nargs="*", default=[1, 2, 4])
    p.add_argument("--drop-baseline", type=int, nargs="*", default=[1])
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(main(p.parse_args()))
