"""Hangs: finite engine timeouts, cancellation that never waits on what hung, and the watchdog, with real faults
(a TCP server that accepts connections and never answers, envs that hang, a training phase that hangs)."""

from __future__ import annotations

import asyncio
import copy
import logging
import re
import time

import pytest
from fakes import ScriptedEngine

from turnrl.agents import AGENTS
from turnrl.build import build_learner
from turnrl.config import RolloutConfig
from turnrl.engines.base import EngineError
from turnrl.engines.http import HttpEngine
from turnrl.engines.router import Router
from turnrl.observe.watchdog import Stalled, Watchdog, abandon_after
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutLimits, RolloutManager, run_groups
from turnrl.testing.faults import SilentServer
from turnrl.train.loop import Trainer
from turnrl.types import SamplingParams, StepResult

# ---- the watchdog on its own -------------------------------------------------------------------------


async def _stuck_forever():
    await asyncio.Event().wait()


async def test_a_wait_with_nothing_progressing_fails_naming_the_activity_and_logs_its_stack(caplog):
    watchdog = Watchdog(0.3, poll_s=0.05)

    async def generate_call():
        with watchdog.busy("engine.generate", lambda: "replica a (http://x)"):
            await _stuck_forever()

    calls = [asyncio.ensure_future(generate_call()) for _ in range(3)]
    start = time.perf_counter()
    with caplog.at_level(logging.ERROR, logger="turnrl.observe.watchdog"), pytest.raises(Stalled) as stalled:
        await watchdog.wait(asyncio.gather(*calls))
    assert time.perf_counter() - start < 2.0
    assert str(stalled.value).startswith("no progress for 0 s: 3 × engine.generate (replica a (http://x), oldest 0 s)")
    assert "_stuck_forever" in caplog.text and "generate_call" in caplog.text  # the stuck task's stack
    for call in calls:
        call.cancel()


async def test_steady_progress_is_never_a_stall():
    watchdog = Watchdog(0.3, poll_s=0.05)

    async def work():
        for _ in range(12):  # 1.2 s in all, one step every 0.1 s
            with watchdog.busy("env.step", "e"):
                await asyncio.sleep(0.1)
        return "done"

    assert await watchdog.wait(work()) == "done"


def test_a_hung_sync_phase_is_interrupted_in_its_thread_and_a_finished_one_never_is():
    watchdog = Watchdog(0.3, poll_s=0.05)
    stalled = pytest.raises(Stalled, match=r"no progress for 0 s: trainer.update \(step 3, oldest 0 s\)")
    with stalled, watchdog.phase("trainer.update", "step 3"):
        while True:  # Python code that never ends (a deadlocked update)
            time.sleep(0.01)
    with watchdog.phase("trainer.update", "step 4"):
        time.sleep(0.1)
    time.sleep(0.6)  # no interrupt lands after the phase ended


async def test_abandon_after_never_waits_on_a_call_that_swallows_its_cancellation():
    async def stubborn():
        try:
            await _stuck_forever()
        except asyncio.CancelledError:
            await asyncio.sleep(30)  # asyncio.wait_for would wait for this

    start = time.perf_counter()
    with pytest.raises(TimeoutError, match="engine.release gave no answer within 0.2 s"):
        await abandon_after(stubborn(), 0.2, "engine.release")
    assert time.perf_counter() - start < 1.0


# ---- engine clients ------------------------------------------------------------------------------------


async def test_http_engine_against_a_server_that_never_answers_fails_naming_the_url():
    with SilentServer() as server:
        engine = HttpEngine(server.url, timeout_s=0.5, control_timeout_s=0.3)
        start = time.perf_counter()
        with pytest.raises(EngineError, match=rf"POST {server.url}/generate gave no answer within 0.5 s: the server "
                                              "accepted the connection but did not answer"):
            await engine.generate([1, 2], SamplingParams(), request_id="r")
        with pytest.raises(EngineError, match=r"/release gave no answer within 0.3 s"):
            await engine.release("r")
        assert time.perf_counter() - start < 3.0 and server.connections >= 1


def test_default_limits_are_finite():
    assert HttpEngine("http://x").http.timeout_s == 600.0 and HttpEngine("http://x").control_timeout_s == 10.0
    router = Router({"a": HttpEngine("http://x")})
    assert router.request_timeout_s == 600.0 and router.release_timeout_s == 10.0  # None (forever) before
    assert RolloutConfig().watchdog_s == 600.0


class StubbornEngine(ScriptedEngine):
    """Never answers, and on cancellation keeps its caller 30 s more (a client blocking in its abort)."""

    async def generate(self, prompt_ids, params, *, request_id, images=None):
        try:
            await _stuck_forever()
        except asyncio.CancelledError:
            await asyncio.sleep(30)
            raise


async def test_router_fails_over_from_a_hung_replica_without_waiting_for_it(qwen3_tokenizer):
    good = ScriptedEngine(qwen3_tokenizer, lambda rid, turn, text: "ok")
    router = Router({"stuck": StubbornEngine(qwen3_tokenizer, None), "good": good}, request_timeout_s=0.2)
    start = time.perf_counter()
    out = await router.generate([1, 2], SamplingParams(max_new_tokens=4), request_id="t")
    assert time.perf_counter() - start < 1.5  # asyncio.wait_for waited the 30 s of the cancellation before
    assert qwen3_tokenizer.decode(out.token_ids).startswith("ok")
    assert router.stats().replicas["stuck"].last_error == "TimeoutError: no answer within request_timeout_s=0.2"


# ---- the watchdog in a rollout and in training ------------------------------------------------------------


def _manager(engine, renderer, **kwargs) -> RolloutManager:
    kwargs.setdefault("limits", RolloutLimits(max_turns=2, max_new_tokens=8, cleanup_timeout_s=1.0))
    return RolloutManager(engine, renderer, agents=AGENTS, default_agent="single_turn", **kwargs)


async def test_a_rollout_on_a_silent_engine_fails_within_the_watchdog_naming_the_replica(qwen3_tokenizer):
    with SilentServer() as server:
        router = Router({"replica0": HttpEngine(server.url, control_timeout_s=0.5)})  # generate waits 600 s
        manager = _manager(router, ChatRenderer(qwen3_tokenizer), watchdog_s=1.0)
        start = time.perf_counter()
        with pytest.raises(Stalled) as stalled:
            await run_groups(manager, [{"prompt": "hi"}, {"prompt": "ho"}], n=2)
        assert time.perf_counter() - start < 5.0  # 1 s of silence, then at most a cleanup bound
        assert str(stalled.value).startswith(
            f"no progress for 1 s: 4 trajectories waiting on engine.generate (replica replica0 ({server.url}), oldest")


class HangingEnv:
    def step(self, text: str) -> StepResult:
        time.sleep(3600)  # a sync env stuck in its thread
        return StepResult(done=True)


async def test_a_rollout_whose_env_hangs_fails_within_the_watchdog_naming_the_env(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, lambda rid, turn, text: "answer")
    manager = RolloutManager(engine, ChatRenderer(qwen3_tokenizer), agents=AGENTS, env_factory=lambda s, c: HangingEnv(),
                             limits=RolloutLimits(max_turns=2, max_new_tokens=8, env_timeout_s=None), watchdog_s=1.0)
    start = time.perf_counter()
    with pytest.raises(Stalled) as stalled:
        await run_groups(manager, [{"prompt": "hi"}], n=3)
    assert time.perf_counter() - start < 4.0
    assert str(stalled.value).startswith(
        "no progress for 1 s: 3 trajectories waiting on env.step (test_watchdog.HangingEnv, oldest")


async def test_a_training_step_whose_update_hangs_fails_naming_the_phase(tiny_qwen3, qwen3_tokenizer, tmp_path):
    from turnrl.config import TrainConfig

    engine = ScriptedEngine(qwen3_tokenizer, lambda rid, turn, text: "hello")
    manager = _manager(engine, ChatRenderer(qwen3_tokenizer), watchdog_s=1.0,
                       reward_fn=lambda traj: float(traj.sample_index))  # unequal rewards: samples to train on
    cfg = TrainConfig(model="tiny-qwen3", train_data="x", output_dir=str(tmp_path), prompts_per_step=1,
                      rollout={"n": 2, "max_new_tokens": 8})
    trainer = Trainer(cfg, build_learner(cfg, copy.deepcopy(tiny_qwen3)), engine, manager, [{"prompt": "hi"}], [])
    assert trainer.watchdog is manager.watchdog

    def deadlocked_update(samples):
        while True:
            time.sleep(0.01)

    trainer.update = deadlocked_update
    trainer.step = 1
    producer = trainer._start_producer()  # what train() starts: the step takes its samples from the buffer
    try:
        with pytest.raises(Stalled, match=r"no progress for 1 s: trainer.update \(step 1, 2 samples, oldest 1 s\)"):
            await trainer.train_step()
    finally:
        producer.cancel()


# ---- a dead engine and a slow one (issue 27): probe the server's health when a call has waited a while ------------


class SlowButHealthyServer:
    """Answers GET /health at once and POST /generate only after `delay_s` (a busy engine)."""

    def __init__(self, delay_s: float):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.health_checks = 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                outer.health_checks += 1
                self._send({"status": "ok"})

            def do_POST(self):
                self.rfile.read(int(self.headers["content-length"]))
                time.sleep(delay_s)
                self._send({"token_ids": [7, 8], "logprobs": [-0.5, -0.25], "finish_reason": "stop"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


async def test_a_call_to_a_dead_engine_fails_once_its_health_probe_gets_no_answer():
    with SilentServer() as server:
        engine = HttpEngine(server.url, probe_after_s=0.5, probe_timeout_s=0.5)
        start = time.perf_counter()
        calls = [engine.generate([1, 2], SamplingParams(), request_id=f"r{k}") for k in range(3)]
        errors = await asyncio.gather(*calls, return_exceptions=True)
        assert time.perf_counter() - start < 60  # 600 s (the request limit) before; about 1 s on a quiet machine
        assert all(isinstance(e, EngineError) for e in errors)
        assert re.search(rf"POST {re.escape(server.url)}/generate: no answer after \d+ s, and GET "
                         rf"{re.escape(server.url)}/health gave no answer within probe_timeout_s=0.5 s: the server "
                         "accepts connections but does not respond", str(errors[0]))
        start = time.perf_counter()  # a probe failed a moment ago: the next call probes at once
        with pytest.raises(EngineError, match="does not respond"):
            await engine.generate([1, 2], SamplingParams(), request_id="r3")
        assert time.perf_counter() - start < 30  # at once, not after another probe_after_s


async def test_a_slow_engine_that_answers_its_health_probe_keeps_its_calls():
    with SlowButHealthyServer(delay_s=2.0) as server:
        engine = HttpEngine(server.url, probe_after_s=0.3, probe_timeout_s=0.5)
        outs = await asyncio.gather(*(engine.generate([1, 2], SamplingParams(), request_id=f"r{k}") for k in range(4)))
        assert [o.token_ids for o in outs] == [[7, 8]] * 4
        assert 3 <= server.health_checks <= 12  # probed while waiting, one probe shared by the four calls


@pytest.mark.slow
async def test_with_default_settings_a_dead_engine_fails_a_call_within_a_minute():
    with SilentServer() as server:
        engine = HttpEngine(server.url)
        start = time.perf_counter()
        with pytest.raises(EngineError, match=f"{server.url}/health gave no answer"):
            await engine.generate([1, 2], SamplingParams(), request_id="r")
        assert 20 < time.perf_counter() - start < 40  # probe after 20 s of silence, which gets none in 10 s


def test_training_on_an_engine_that_hangs_mid_run_ends_naming_it(tmp_path):
    """`turnrl train` on an http engine that passes the start-up check, then accepts connections and never
    answers: every trajectory fails naming the server, then the run ends (before: 0 trajectories in 150 s, and the
    watchdog's 600 s)."""
    import json

    from typer.testing import CliRunner

    from turnrl.cli import app

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Say {i}."}) + "\n" for i in range(4)))
    with SilentServer(answers=1) as server:  # the one answer: the start-up health check
        config = tmp_path / "config.yaml"
        config.write_text(json.dumps({
            "model": "tiny-qwen3", "train_data": str(data), "output_dir": str(tmp_path / "runs"), "steps": 2,
            "prompts_per_step": 2, "rollout": {"env": "single_turn", "n": 2, "max_new_tokens": 4},
            "engine": {"kind": "http", "urls": [server.url], "probe_after_s": 1, "probe_timeout_s": 1},
            "reward": {"function": "env"}}))
        start = time.perf_counter()
        result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code != 0 and time.perf_counter() - start < 120  # model loading included

    text = " ".join(result.output.split())
    assert "trajectory g0-r" in text and f"failed (engine_error): EngineError: POST {server.url}/generate: no answer " \
                                         "after 2 s" in text
    assert text.count(f"GET {server.url}/health gave no answer within probe_timeout_s=1 s") >= 5
    assert "training" in text and re.search(rf"error: POST {re.escape(server.url)}/update_weights: no answer after \d+ s",
                                            text)
