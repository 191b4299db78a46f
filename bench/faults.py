"""Fault injection: what a rollout returns when envs, engines and the model misbehave, and how long it takes.

Scenarios (tiny-qwen3, real engines, real sync envs on their own threads; `turnrl.testing.faults`):

- env faults: 10% of env steps raise, 5% hang for an hour (env_timeout_s=2): every trajectory must come back,
  the healthy ones completed, the hung calls abandoned (and the process still exits at once).
- replica killed: a Router over two `turnrl serve` processes; one is killed (SIGKILL) mid-run: its pinned
  trajectories move to the other replica.
- unresponsive engine: a TCP server that accepts connections and never answers. Alone, with default engine
  timeouts (600 s), the watchdog (watchdog_s=10 here) ends the run naming the replica; behind a Router with a
  live replica (request_timeout_s=3), the trajectories fail over and complete.
- NaN rewards: 10% of env steps return a NaN reward: those trajectories FAIL (never scored), and every group's
  advantages stay finite.
- parser fuzz: every tool-call parser on 200,000 hostile replies (turnrl.testing.faults.adversarial_texts).

    python bench/faults.py                          # everything (the fuzz takes a few minutes on 2 cores)
    python bench/faults.py --fuzz-inputs 20000 --trajectories 32
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from rich.console import Console
from rich.table import Table

from turnrl.agents import AGENTS
from turnrl.config import TrainConfig
from turnrl.engines.embedded import EmbeddedEngine
from turnrl.engines.http import HttpEngine
from turnrl.engines.router import Router
from turnrl.models import load_model, load_tokenizer
from turnrl.observe.watchdog import Stalled
from turnrl.render import ChatRenderer
from turnrl.rewards import load_reward_fn
from turnrl.rollout import RolloutLimits, RolloutManager, run_groups
from turnrl.testing.faults import Faults, SilentServer, faulty_env_factory, fuzz_parsers
from turnrl.train.samples import group_advantages

MODEL = "tiny-qwen3"


@dataclass
class Outcome:
    scenario: str
    expected: int
    returned: int = 0
    statuses: Counter = field(default_factory=Counter)
    injected: str = ""
    wall_s: float = 0.0
    note: str = ""


def _rows(n: int) -> list[dict]:
    return [{"id": f"r{i}", "prompt": f"Say something about {i}."} for i in range(n)]


def _manager(engine, renderer, faults: Faults, args, *, turns: int = 2, watchdog_s: float = 60.0) -> RolloutManager:
    limits = RolloutLimits(max_turns=turns, max_new_tokens=args.max_new_tokens, env_timeout_s=2.0,
                           cleanup_timeout_s=2.0)
    return RolloutManager(engine, renderer, agents=AGENTS, env_factory=faulty_env_factory(faults, turns),
                          limits=limits, concurrency=args.trajectories, reward_fn=load_reward_fn("env"),
                          sanity_mode="disable", watchdog_s=watchdog_s)


async def _run(name: str, manager: RolloutManager, rows: list[dict], n: int, faults: Faults) -> tuple[Outcome, list]:
    outcome, groups = Outcome(name, len(rows) * n), []
    start = time.perf_counter()
    try:
        groups = await run_groups(manager, rows, n)
    except Stalled as e:
        outcome.note = str(e)
    outcome.wall_s = time.perf_counter() - start
    for traj in (t for g in groups for t in g):
        outcome.returned += 1
        outcome.statuses[f"{traj.status}/{traj.termination_reason}"] += 1
    outcome.injected = ", ".join(f"{k} {v}" for k, v in sorted(faults.injected.items())) or "-"
    return outcome, groups


# ---- scenarios ---------------------------------------------------------------------------------------------
async def env_faults(engine, renderer, args) -> Outcome:
    faults = Faults(raise_p=0.10, hang_p=0.05, seed=1)
    outcome, _ = await _run("env raises 10% / hangs 5% (env_timeout_s=2)", _manager(engine, renderer, faults, args),
                            _rows(args.trajectories // 2), 2, faults)
    outcome.note = outcome.note or "hung calls abandoned on daemon threads: they hold no slot and not the exit"
    return outcome


async def nan_rewards(engine, renderer, args) -> Outcome:
    faults = Faults(nan_p=0.10, seed=2)
    outcome, groups = await _run("NaN rewards 10%", _manager(engine, renderer, faults, args),
                                 _rows(args.trajectories // 4), 4, faults)
    scored, _ = group_advantages(groups, TrainConfig(model=MODEL, train_data="-"))
    finite = all(math.isfinite(a) for _, a in scored)
    outcome.note = f"{len(scored)} trained trajectories, advantages all finite: {finite}"
    return outcome


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(port: int) -> subprocess.Popen:
    code = "from turnrl.cli import app; app()"
    return subprocess.Popen([sys.executable, "-c", code, "serve", "--model", MODEL, "--port", str(port),
                             "--max-batch-size", "16"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"turnrl serve at {url} did not come up in {timeout_s:.0f} s")


async def replica_killed(renderer, args, servers: list[tuple[str, subprocess.Popen]]) -> Outcome:
    (url0, _), (url1, proc1) = servers
    router = Router({"r0": HttpEngine(url0), "r1": HttpEngine(url1)}, request_timeout_s=30)
    faults = Faults(seed=3)
    manager = _manager(router, renderer, faults, args, turns=4)

    async def kill_soon() -> None:  # once r1 has answered about one turn per trajectory pinned to it
        while (r1 := router.stats().replicas["r1"]).requests - r1.in_flight < args.trajectories // 4:
            await asyncio.sleep(0.05)
        os.killpg(proc1.pid, signal.SIGKILL)  # mid-run: trajectories pinned to r1 are mid-episode

    killer = asyncio.ensure_future(kill_soon())
    outcome, _ = await _run("engine replica killed mid-run (Router, 2 x turnrl serve)", manager,
                            _rows(args.trajectories // 2), 2, faults)
    killer.cancel()
    r1 = router.stats().replicas["r1"]
    outcome.injected = f"SIGKILL r1 after it answered {r1.requests - r1.failures} calls"
    outcome.note = f"r1 out of rotation ({r1.failures} failed calls re-routed to r0)"
    return outcome


async def unresponsive_alone(renderer, args) -> Outcome:
    with SilentServer() as silent:
        faults = Faults(seed=4)
        manager = _manager(HttpEngine(silent.url), renderer, faults, args, watchdog_s=args.watchdog_s)
        outcome, _ = await _run(f"unresponsive engine alone (default timeouts, watchdog_s={args.watchdog_s:g})",
                                manager, _rows(args.trajectories // 2), 2, faults)
        outcome.injected = f"silent server, {silent.connections} connections accepted"
    return outcome


async def unresponsive_behind_router(renderer, args, live_url: str) -> Outcome:
    with SilentServer() as silent:
        router = Router({"silent": HttpEngine(silent.url), "live": HttpEngine(live_url)}, request_timeout_s=3)
        faults = Faults(seed=5)
        outcome, _ = await _run("unresponsive replica + live one (Router request_timeout_s=3)",
                                _manager(router, renderer, faults, args), _rows(args.trajectories // 2), 2, faults)
        outcome.injected = f"silent replica, {silent.connections} connections accepted"
        stats = router.stats().replicas["silent"]
        outcome.note = f"silent replica out of rotation after {stats.failures} timed-out call(s)"
    return outcome


# ---- report ------------------------------------------------------------------------------------------------
def _table(outcomes: list[Outcome]) -> Table:
    table = Table(title="fault injection (tiny-qwen3, 2 CPU cores)")
    for column in ("scenario", "returned / expected", "statuses", "injected", "wall s", "note"):
        table.add_column(column, overflow="fold")
    for o in outcomes:
        statuses = ", ".join(f"{k} {v}" for k, v in o.statuses.most_common()) or "-"
        table.add_row(o.scenario, f"{o.returned} / {o.expected}", statuses, o.injected, f"{o.wall_s:.1f}", o.note)
    return table


def fuzz_table(n: int) -> Table:
    report = fuzz_parsers(n, seed=0)
    table = Table(title=f"tool-call parser fuzz ({report.inputs:,} hostile replies)")
    for column in ("parser calls", "exceptions", "outputs not valid JSON", "tool calls parsed", "parse errors",
                   "slowest call s", "wall s"):
        table.add_column(column)
    table.add_row(f"{report.calls:,}", str(sum(report.exceptions.values())), str(report.bad_outputs),
                  f"{report.tool_calls:,}", f"{report.parse_errors:,}", f"{report.slowest_s:.3f}", f"{report.wall_s:.0f}")
    table.caption = f"slowest: {report.slowest}"
    for example in report.examples:
        table.add_row(example, "", "", "", "", "", "")
    return table


async def scenarios(args, console: Console) -> list[Outcome]:
    tokenizer = load_tokenizer(MODEL)
    renderer = ChatRenderer(tokenizer)
    engine = EmbeddedEngine(load_model(MODEL), eos_token_ids=sorted(renderer.end_of_turn_ids), max_batch_size=16)
    outcomes = []
    try:
        for scenario in (env_faults, nan_rewards):
            outcomes.append(await scenario(engine, renderer, args))
            console.print(f"done: {outcomes[-1].scenario}")
    finally:
        engine.close()
    servers = [(f"http://127.0.0.1:{port}", _start_server(port)) for port in (_free_port(), _free_port())]
    try:
        for url, _ in servers:
            _wait_healthy(url)
        outcomes.append(await replica_killed(renderer, args, servers))
        outcomes.append(await unresponsive_behind_router(renderer, args, servers[0][0]))
        outcomes.append(await unresponsive_alone(renderer, args))
    finally:
        for _, proc in servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=64, help="trajectories per scenario")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--watchdog-s", type=float, default=10.0)
    parser.add_argument("--fuzz-inputs", type=int, default=200_000)
    parser.add_argument("--log-level", default="CRITICAL", help="turnrl's log (per-trajectory warnings, the "
                                                                "watchdog's stacks) below the table")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    console = Console(width=200)
    start = time.perf_counter()
    outcomes = asyncio.run(scenarios(args, console))
    console.print(_table(outcomes))
    if args.fuzz_inputs:
        console.print(fuzz_table(args.fuzz_inputs))
    console.print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
