"""Framework overhead of the rollout path and of the serve path, with an engine and an env that cost nothing.

What is left is turnrl's own work per turn: the turn loop (`drive`), the renderer (observation deltas, the
sanity re-render), the env plumbing (sync env calls in threads, timeouts), bookkeeping (watchdog, metrics,
the trajectory). Real Qwen3 tokenizer and chat template (`tiny-qwen3`), so rendering costs what it costs in a
real run.

- rollout: `RolloutManager.stream` over --trajectories rows (n=1), --concurrency in flight, every episode
  --turns model turns; the engine returns the same short reply at once, the env answers at once, `sync` (a
  plain `step`, run in the env threads) or `async` (`async def step`). Turns per second of wall time.
- serve: the chat completions API of `turnrl serve` (the app `create_app` builds, with a `ChatProxy`) called in
  process through an ASGI transport (no sockets: the client costs little), --sessions conversations at once,
  each --turns calls long, each call sending the whole conversation so far (as an agent does; the proxy checks
  it extends the session and records the delta). Calls per second and each call's latency (p50/p99): with an
  engine that costs nothing, all of it is added by the server.

The script uses only APIs present in main 9dd981a and after (a shim picks the module paths), so the same file
runs against both checkouts; `--repo` points the imports at one:

    PYTHONPATH=. python bench/overhead.py                                  # this checkout
    python bench/overhead.py --repo /work/wt/perf-base --repo .            # A/B alternated, 3 rounds
    python bench/overhead.py --repo . --profile 1000                       # cProfile summary of one run
    python bench/overhead.py --repo /work/wt/perf-base --repo . --sanity-check-every 1 16

--sanity-check-every N... runs the rollout paths once per N (rollout.sanity_check_every: 1 = every trajectory,
the default; N > 1 the first 64, then one id hash in N) on the checkouts that have the key; a checkout without it
runs only its default (every trajectory), labelled so.

Each measured run is the steady state: --warmup trajectories (default 200; serve: the same share of sessions) run
first, untimed, in the same process (what a long run pays once: the template's compile, the start-up heap's freeze,
the first 64 sanity checks of a sampled check); --warmup 0 measures from cold.

With several --repo, each round runs every checkout in a child process (alternating, so machine load hits all
alike) and the table shows every round and the median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPLY = "The answer is 4. Next I will check the result with the tool."


def _imports() -> dict[str, Any]:
    """The names the bench needs, wherever this checkout keeps them."""
    from turnrl.agents import AGENTS
    from turnrl.models import load_tokenizer
    from turnrl.render import ChatRenderer
    from turnrl.rollout import RolloutLimits, RolloutManager
    from turnrl.types import FinishReason, GenerateOutput, SamplingParams

    try:
        from turnrl.serve.app import create_app
        from turnrl.serve.sessions import ChatProxy
    except ImportError:  # main 9dd981a: one serve module, the proxy beside it
        from turnrl.proxy import ChatProxy  # type: ignore[no-redef]

        from turnrl.serve import create_app  # type: ignore[no-redef,attr-defined]
    return {"AGENTS": AGENTS, "load_tokenizer": load_tokenizer, "ChatRenderer": ChatRenderer,
            "RolloutLimits": RolloutLimits, "RolloutManager": RolloutManager, "FinishReason": FinishReason,
            "GenerateOutput": GenerateOutput, "SamplingParams": SamplingParams, "create_app": create_app,
            "ChatProxy": ChatProxy}


class ZeroEngine:
    """Answers every call at once with the same reply, ended by the template's end-of-turn token."""

    policy_version = 0

    def __init__(self, m: dict[str, Any], reply_ids: list[int], end_id: int):
        self.m, self.reply = m, [*reply_ids, end_id]

    async def generate(self, prompt_ids, params, *, request_id, images=None, **_: Any):
        ids = self.reply[: params.max_new_tokens]
        finish = self.m["FinishReason"].STOP if len(ids) == len(self.reply) else self.m["FinishReason"].LENGTH
        return self.m["GenerateOutput"](ids, [-0.5] * len(ids), finish, 0)

    async def update_weights(self, named_tensors, version=None, *, final=True):
        return 0

    async def sleep(self) -> None: ...
    async def wake_up(self) -> None: ...
    async def release(self, request_id: str) -> None: ...


class SyncEnv:
    def __init__(self, turns: int):
        self.turns, self.n = turns, 0

    def step(self, text: str):
        self.n += 1
        return f"Tool result {self.n}: 42.", self.n >= self.turns, {"reward": 1.0}


class AsyncEnv(SyncEnv):
    async def step(self, text: str):  # type: ignore[override]
        return SyncEnv.step(self, text)


_RENDERER: list[Any] = []
"""The renderer of this process (one per child; `--profile` warms it, and the imports, before it profiles)."""


def _renderer(m: dict[str, Any]):
    if not _RENDERER:
        _RENDERER.append(_new_renderer(m))
    return _RENDERER[0]


def _new_renderer(m: dict[str, Any]):
    tokenizer = m["load_tokenizer"]("tiny-qwen3")
    renderer = m["ChatRenderer"](tokenizer, {"enable_thinking": False})
    end = sorted(renderer.end_of_turn_ids)[0]
    return renderer, tokenizer.encode(REPLY, add_special_tokens=False), end


def has_sampled_check(m: dict[str, Any]) -> bool:
    """Does this checkout's RolloutManager take `sanity_check_every`?"""
    import inspect

    return "sanity_check_every" in inspect.signature(m["RolloutManager"]).parameters


async def _rollout(m: dict[str, Any], env: str, trajectories: int, concurrency: int, turns: int,
                   every: int = 1) -> dict[str, float]:
    renderer, reply, end = _renderer(m)
    env_cls = SyncEnv if env == "sync" else AsyncEnv
    extra = {"sanity_check_every": every} if every > 1 else {}
    manager = m["RolloutManager"](
        ZeroEngine(m, reply, end), renderer, agents=m["AGENTS"], default_agent="env_agent",
        sampling=m["SamplingParams"](temperature=1.0, max_new_tokens=64),
        limits=m["RolloutLimits"](max_turns=turns, max_new_tokens=64),
        env_factory=lambda sample, config: env_cls(turns), concurrency=concurrency, **extra)
    rows = [{"id": f"r{i}", "prompt": f"Question {i}: what is 2 + 2? Use the tool."} for i in range(trajectories)]
    t0 = time.perf_counter()
    done = total_turns = checked = 0
    async for traj in manager.stream(rows, 1):
        done += 1
        total_turns += traj.num_turns
        checked += traj.metrics.get("render_checked", 1.0) > 0
        if traj.status.value == "failed":
            raise RuntimeError(f"{traj.id} failed: {traj.error}")
    wall = time.perf_counter() - t0
    return {"turns_per_s": total_turns / wall, "wall_s": wall, "turns": total_turns, "trajectories": done,
            "checked": checked / max(done, 1)}


async def _serve(m: dict[str, Any], sessions: int, turns: int) -> dict[str, float]:
    import httpx

    renderer, reply, end = _renderer(m)
    engine = ZeroEngine(m, reply, end)
    proxy = m["ChatProxy"](engine, renderer, model_name="zero")
    app = m["create_app"](engine, proxy, model_name="zero")
    latencies: list[float] = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
        async def conversation(k: int) -> None:
            messages = [{"role": "user", "content": f"Question {k}: what is 2 + 2? Use the tool."}]
            for t in range(turns):
                t0 = time.perf_counter()
                r = await client.post(f"/sessions/s{k}/v1/chat/completions",
                                      json={"model": "zero", "messages": messages, "max_tokens": 64})
                latencies.append(time.perf_counter() - t0)
                r.raise_for_status()
                messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"Tool result {t}: 42."}]
                messages[-2] = {"role": "assistant", "content": messages[-2]["content"]}

        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(k) for k in range(sessions)))
        wall = time.perf_counter() - t0
    latencies.sort()
    return {"calls_per_s": len(latencies) / wall, "p50_ms": 1e3 * latencies[len(latencies) // 2],
            "p99_ms": 1e3 * latencies[int(len(latencies) * 0.99)], "calls": len(latencies)}


def run_one(args: argparse.Namespace, what: str, every: int = 1) -> dict[str, float]:
    """One measured run; `--warmup` first runs a small one in the same process, untimed (what a long run pays once:
    the template's compile, first allocations, the start-up heap's freeze), so the figure is the steady state."""
    m = _imports()
    if what == "serve":
        if args.warmup:
            asyncio.run(_serve(m, max(args.sessions * args.warmup // max(args.trajectories, 1), 1), args.turns))
        return asyncio.run(_serve(m, args.sessions, args.turns))
    if every > 1 and not has_sampled_check(m):
        raise SystemExit(f"this checkout has no rollout.sanity_check_every (asked for {every})")
    if args.warmup:
        asyncio.run(_rollout(m, what, args.warmup, args.concurrency, args.turns, every))
    return asyncio.run(_rollout(m, what, args.trajectories, args.concurrency, args.turns, every))


def _child(repo: str, args: argparse.Namespace, what: str, every: int = 1) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", what, "--trajectories", str(args.trajectories),
           "--concurrency", str(args.concurrency), "--turns", str(args.turns), "--sessions", str(args.sessions),
           "--sanity-check-every", str(every), "--warmup", str(args.warmup)]
    env = {**os.environ, "PYTHONPATH": str(Path(repo).resolve())}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{repo} {what}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _profile(args: argparse.Namespace) -> None:
    import cProfile
    import pstats

    _renderer(_imports())  # imports, the tokenizer's load and the warm-up are not what is profiled
    if args.warmup:
        run_one(argparse.Namespace(**{**vars(args), "trajectories": args.warmup, "warmup": 0}), args.what[0],
                args.sanity_check_every[0])
    args.trajectories, args.warmup = args.profile, 0
    profile = cProfile.Profile()
    profile.enable()
    result = run_one(args, args.what[0], args.sanity_check_every[0])
    profile.disable()
    print(json.dumps(result))
    pstats.Stats(profile).sort_stats("cumulative").print_stats(45)
    pstats.Stats(profile).sort_stats("tottime").print_stats(40)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", action="append", default=[], help="checkout to measure (repeatable: A/B)")
    parser.add_argument("--what", nargs="+", default=["sync", "async", "serve"], choices=["sync", "async", "serve"])
    parser.add_argument("--trajectories", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=200, help="serve: conversations at once")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, help="cProfile one run of this many trajectories")
    parser.add_argument("--warmup", type=int, default=200,
                        help="trajectories run untimed first in the same process (0: measure from cold)")
    parser.add_argument("--sanity-check-every", type=int, nargs="+", default=[1],
                        help="rollout.sanity_check_every values to run (checkouts that have the key)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args, args.child, args.sanity_check_every[0])))
        return
    if args.profile:
        _profile(args)
        return
    repos = args.repo or ["."]
    sampled = {repo: _has_key(repo) for repo in repos}
    results: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for what in args.what:
            everys = [1] if what == "serve" else args.sanity_check_every
            # a checkout without the key runs its only mode (every trajectory) once, whatever was asked
            runs = dict.fromkeys((repo, every if sampled[repo] else 1) for every in everys for repo in repos)
            for repo, every in runs:
                results.setdefault((repo, what, every), []).append(_child(repo, args, what, every))
    _table(args, repos, results)


def _has_key(repo: str) -> bool:
    code = "import overhead, sys; sys.exit(0 if overhead.has_sampled_check(overhead._imports()) else 3)"
    env = {**os.environ, "PYTHONPATH": str(Path(repo).resolve())}  # run in bench/: the repo's turnrl, not the cwd's
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).parent, check=False).returncode == 0


def _table(args: argparse.Namespace, repos: list[str], results: dict[tuple[str, str, int], list[dict[str, float]]]
           ) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"turnrl overhead: zero-cost engine and env, {args.trajectories} trajectories x {args.turns} "
                        f"turns at concurrency {args.concurrency}; serve: {args.sessions} sessions x {args.turns} calls")
    for col in ("checkout", "path", "sanity check", "rounds", "median", "vs first checkout (its fewest skipped checks)"):
        table.add_column(col)
    for what in args.what:
        key, unit = ("calls_per_s", "calls/s") if what == "serve" else ("turns_per_s", "turns/s")
        first = [k for k in results if k[:2] == (repos[0], what)]
        base = statistics.median(r[key] for r in results[min(first, key=lambda k: k[2])])
        for every in sorted({k[2] for k in results if k[1] == what}):
            for repo in repos:
                rs = results.get((repo, what, every))
                if rs is None:
                    continue  # a checkout without rollout.sanity_check_every: its row is the every-trajectory one
                med = statistics.median(r[key] for r in rs)
                rounds = " / ".join(f"{r[key]:,.0f}" for r in rs)
                if what == "serve":
                    rounds += "  (p50/p99 ms: " + ", ".join(f"{r['p50_ms']:.1f}/{r['p99_ms']:.1f}" for r in rs) + ")"
                label = "n/a (serve)" if what == "serve" else (
                    "every trajectory" if every == 1 else f"1 in {every} ({rs[0].get('checked', 1):.1%} checked)")
                table.add_row(repo, what, label, rounds, f"{med:,.0f} {unit}", f"{med / base:.2f}x")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
