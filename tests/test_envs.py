"""The env boundary (turnrl.envs.base): its own threads with timeouts that start with the call, and env output
checked before anything is trained on it."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fakes import ScriptedEngine

from turnrl.agents import AGENTS
from turnrl.envs.base import EnvThreads, call
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutLimits, RolloutManager
from turnrl.types import RolloutStatus, StepResult, TerminationReason

HANG = threading.Event()  # never set while a test runs: a hung step waits on it


class SometimesHangs:
    """A sync env whose step blocks (for good) on the trajectories listed in `hung`."""

    def __init__(self, hung: bool):
        self.hung = hung

    def step(self, text):
        if self.hung:
            HANG.wait(60)
        time.sleep(0.01)
        return StepResult(reward=1.0, done=True)


def manager(tokenizer, factory, *, concurrency=64, env_timeout_s=2.0):
    engine = ScriptedEngine(tokenizer, lambda rid, turn, prompt: "It is 4.")
    return RolloutManager(engine, ChatRenderer(tokenizer), agents=AGENTS, env_factory=factory, concurrency=concurrency,
                          limits=RolloutLimits(max_turns=2, max_new_tokens=16, env_timeout_s=env_timeout_s),
                          sanity_mode="disable")


async def test_hung_sync_envs_time_out_alone_and_healthy_ones_are_not_starved(qwen3_tokenizer):
    # 6 of 64 steps hang: on asyncio's default pool (6 threads on 2 cores) they took every thread, and the
    # healthy steps' queue wait counted against their own timeout (53 of 64 timed out).
    hung_rows = {3, 11, 19, 27, 35, 43}
    mgr = manager(qwen3_tokenizer, lambda sample, config: SometimesHangs(sample["id"] in hung_rows))
    rows = [{"id": i, "prompt": "What is 2+2?"} for i in range(64)]
    t0 = time.perf_counter()
    trajs = [t async for t in mgr.stream(rows)]
    elapsed = time.perf_counter() - t0
    timed_out = {t.sample["id"] for t in trajs if t.termination_reason == TerminationReason.TIMEOUT}
    assert timed_out == hung_rows
    assert all(t.status == RolloutStatus.COMPLETED for t in trajs if t.sample["id"] not in hung_rows)
    assert elapsed < 20  # the six hung calls are abandoned after their 2 s, not waited for


def test_abandoned_env_threads_do_not_hold_up_process_exit(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import asyncio, threading, time
        from turnrl.envs.base import EnvThreads

        async def main():
            threads = EnvThreads(2)
            try:
                await threads.run(threading.Event().wait, 120, timeout_s=0.5)
            except TimeoutError:
                print("timed out", flush=True)

        asyncio.run(main())
    """))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "timed out" and time.perf_counter() - t0 < 30  # not the 120 s of the hung call


async def test_a_call_timeout_starts_when_the_call_starts_not_when_it_was_queued():
    threads = EnvThreads(1)
    # two 0.3 s calls through one thread, each with a 0.5 s limit: the second waits 0.3 s in the queue first
    results = await asyncio.gather(*(threads.run(time.sleep, 0.3, timeout_s=0.5) for _ in range(2)))
    assert results == [None, None]
    with pytest.raises(TimeoutError):
        await call(time.sleep, 1.0, timeout_s=0.2, threads=threads)


class Returns:
    """An env whose step returns `result` (and whose format_observation passes observations through)."""

    def __init__(self, result):
        self.result = result

    def step(self, text):
        return self.result

    def format_observation(self, observation):
        return observation


@pytest.mark.parametrize(("result", "expected"), [
    (StepResult(reward=math.nan, done=True), "non-finite reward (nan)"),
    (("Try again.", math.inf, False, {}), "non-finite reward (inf)"),
    (StepResult(reward="1", done=True), "reward must be a number"),
    (StepResult(done="no"), "done must be a bool, got 'no'"),
    (("obs", 0.0, False, ["not", "a", "dict"]), "info must be a dict"),
    (StepResult({"role": "wizard", "content": "You shall not pass."}), "role 'wizard'"),
])
async def test_malformed_env_output_fails_the_trajectory_naming_the_env(qwen3_tokenizer, result, expected):
    mgr = manager(qwen3_tokenizer, lambda sample, config: Returns(result))
    [traj] = [t async for t in mgr.stream([{"prompt": "What is 2+2?"}])]
    assert (traj.status, traj.termination_reason) == (RolloutStatus.FAILED, TerminationReason.ENV_ERROR)
    assert expected in traj.error and "test_envs.Returns" in traj.error
    assert traj.reward is None and traj.turn_rewards == []  # never scored


async def test_numpy_done_and_rewards_are_accepted(qwen3_tokenizer):
    mgr = manager(qwen3_tokenizer, lambda sample, config: Returns((None, np.float32(0.5), np.bool_(True), {})))
    [traj] = [t async for t in mgr.stream([{"prompt": "What is 2+2?"}])]
    assert traj.status == RolloutStatus.COMPLETED and traj.turn_rewards == [0.5]


async def test_build_env_returning_none_fails_at_once_with_a_clear_error(qwen3_tokenizer):
    mgr = manager(qwen3_tokenizer, lambda sample, config: None)
    [traj] = [t async for t in mgr.stream([{"prompt": "What is 2+2?"}])]
    assert traj.status == RolloutStatus.FAILED and "returned None; it must return the environment" in traj.error


async def test_env_threads_are_reused_and_a_hung_call_gives_its_slot_to_a_new_thread():
    threads = EnvThreads(2)
    assert await asyncio.gather(*(threads.run(abs, -k) for k in range(200))) == list(range(200))
    assert threads.threads_started <= 2  # not one thread per call
    release = threading.Event()
    with pytest.raises(TimeoutError):
        await threads.run(release.wait, 30, timeout_s=0.2)  # its thread stays busy, abandoned
    # both slots still serve: the hung call's thread no longer counts, a new one is started for the freed slot
    assert await asyncio.gather(threads.run(time.sleep, 0.05), threads.run(time.sleep, 0.05)) == [None, None]
    release.set()
    assert threads.threads_started == 3
    with pytest.raises(ValueError, match="boom"):  # an env that raises keeps its thread
        await threads.run(int, "boom")
    assert await threads.run(abs, -1) == 1 and threads.threads_started == 3
