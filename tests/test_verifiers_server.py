"""`agent: verifiers`: verifiers v1 env servers drive turnrl's policy through its generate endpoint.

The slow tests serve verifiers' own example environments `reverse_text` (single-turn) and `glossary` (a tool over
MCP) (tests/verifiers_envs, copied from its repository) from `.venv-verifiers` (`make verifiers-install`; its pins clash with this venv) with
`python -m turnrl.agents.verifiers_serve`, and run `turnrl rollout --agent verifiers` against it: the env server's
harness program talks to verifiers' interception server, whose train client renders with the `renderers` package
and calls turnrl's `/inference/v1/generate`; the traces come back over ZMQ as trajectories. The fast tests stand in
for a broken server with a few lines of ZMQ (one that never answers, one that never finishes, one that fails the
run, one that sends garbage): each fails its own trajectory, clearly and in bounded time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fakes import ScriptedEngine, script_the_cli
from typer.testing import CliRunner

from turnrl.agents import agent_registry
from turnrl.agents.openai_agent import close_gateways
from turnrl.cli import app as cli_app
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutLimits, RolloutManager, run_groups
from turnrl.types import RolloutStatus, SegmentSource, TerminationReason

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

TESTS = Path(__file__).resolve().parent
VERIFIERS_PYTHON = Path(os.environ.get("TURNRL_VERIFIERS_PYTHON", TESTS.parent / ".venv-verifiers" / "bin" / "python"))
SYSTEM = "Reverse the text character-by-character. Put your answer in <reversed_text> tags."  # reverse_text's
ROWS = [{"id": "hello", "idx": 0, "prompt": "hello world", "system_prompt": SYSTEM, "answer": "dlrow olleh"},
        {"id": "turnrl", "idx": 1, "prompt": "turnrl", "system_prompt": SYSTEM, "answer": "lrnrut"}]
served = pytest.mark.skipif(not VERIFIERS_PYTHON.exists(),
                            reason="no verifiers venv to serve from (make verifiers-install)")


@pytest.fixture(scope="module", autouse=True)
def _stop_gateways():
    yield
    close_gateways()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- fakes: servers that fail ----------------------------------------------------------------------
class FakeServer:
    """A ZMQ ROUTER on a thread: `mode` silent (reads, never answers), health (answers health, never a run),
    fail (fails every run), garbage (answers a run with a frame that is not msgpack)."""

    def __init__(self, mode: str):
        self.mode, self.methods = mode, []
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.socket.poll(50):
                continue
            client, request_id, method, payload = self.socket.recv_multipart()
            self.methods.append((method.decode(), msgpack.unpackb(payload)))
            reply = None
            if method == b"health" and self.mode != "silent":
                reply = msgpack.packb({"success": True, "error": None})
            elif method == b"run" and self.mode == "fail":
                reply = msgpack.packb({"success": False, "error": "ValueError: the task is not a ReverseTextData"})
            elif method == b"run" and self.mode == "garbage":
                reply = b"\xc1 not msgpack"
            if reply is not None:
                self.socket.send_multipart([client, request_id, b"reply", reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.socket.close(0)
        self.ctx.term()


def _manager(engine, tokenizer, env_config) -> RolloutManager:
    return RolloutManager(engine, ChatRenderer(tokenizer), agents=agent_registry(), default_agent="verifiers",
                          env_config=env_config, limits=RolloutLimits(max_turns=4, max_new_tokens=32))


@pytest.mark.parametrize(("mode", "bounds", "words"), [
    ("silent", {"timeout_s": 60, "health_timeout_s": 1}, "does not answer (no health reply for 1 s"),
    ("health", {"timeout_s": 2, "health_timeout_s": 60}, "did not finish the episode in 2 s"),
    ("fail", {}, "failed the run: ValueError: the task is not a ReverseTextData"),
    ("garbage", {}, "sent a malformed reply"),
])
async def test_a_broken_env_server_fails_its_trajectory_not_the_batch(qwen3_tokenizer, mode, bounds, words):
    broken, healthy = FakeServer(mode), FakeServer("fail")
    try:
        engine = ScriptedEngine(qwen3_tokenizer, lambda *_: "x")
        manager = _manager(engine, qwen3_tokenizer, {"env_server": broken.address, **bounds})
        rows = [{**ROWS[0]}, {**ROWS[1], "env_config": {"env_server": healthy.address}}]
        t0 = time.monotonic()
        [[bad], [other]] = await run_groups(manager, rows)
        assert time.monotonic() - t0 < 15
    finally:
        broken.close()
        healthy.close()
    reason = TerminationReason.TIMEOUT if mode == "health" else TerminationReason.ENV_ERROR
    assert (bad.status, bad.termination_reason) == (RolloutStatus.FAILED, reason)
    assert words in bad.error and broken.address in bad.error
    assert other.status == RolloutStatus.FAILED and "not a ReverseTextData" in other.error  # its own server's answer
    run = next(p for m, p in broken.methods if m == "run")
    assert run["task_data"] == {k: v for k, v in ROWS[0].items()}  # the row is the task: its id is TaskData.id
    assert run["client"]["type"] == "train" and run["client"]["base_url"].endswith("/sessions/hello-0/v1")
    assert run["sampling"]["max_tokens"] == 32
    if mode == "health":  # a run given up is cancelled on the server
        deadline = time.monotonic() + 5
        while not any(m == "cancel" for m, _ in broken.methods) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(m == "cancel" for m, _ in broken.methods)


async def test_a_row_without_an_env_server_fails_naming_the_setting(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, lambda *_: "x")
    [[traj]] = await run_groups(_manager(engine, qwen3_tokenizer, {}), [ROWS[0]])
    assert traj.status == RolloutStatus.FAILED and "env_config.env_server" in traj.error


# ---- a real verifiers env server --------------------------------------------------------------------
def _start_server(port: int, log_path: Path, taskset: str = "reverse-text") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(TESTS / "verifiers_envs" / taskset.replace("-", "_"))}
    log = open(log_path, "w")  # noqa: SIM115 (the process writes it until the test stops it)
    return subprocess.Popen([str(VERIFIERS_PYTHON), "-m", "turnrl.agents.verifiers_serve", "--taskset",
                             taskset, "--address", f"tcp://127.0.0.1:{port}"], cwd=TESTS.parent, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def _serving(taskset: str, log_path: Path):
    port = _free_port()
    process = _start_server(port, log_path, taskset)
    address = f"tcp://127.0.0.1:{port}"
    try:
        _wait_healthy(address, process, log_path)
        yield address, process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def _wait_healthy(address: str, process: subprocess.Popen, log_path: Path, timeout_s: float = 180) -> None:
    ctx = zmq.Context()
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert process.poll() is None, f"the env server exited: {log_path.read_text()[-3000:]}"
            socket.send_multipart([b"h", b"health", msgpack.packb({})])
            if socket.poll(1000):
                socket.recv_multipart()
                return
        raise AssertionError(f"the env server did not come up in {timeout_s} s: {log_path.read_text()[-3000:]}")
    finally:
        socket.close()
        ctx.term()


@pytest.fixture(scope="module")
def reverse_text_server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("verifiers") / "env_server.log"
    with _serving("reverse-text", log_path) as (address, process):
        yield address, process, log_path


def _reverser(request_id: str, turn: int, prompt_text: str) -> str:
    """Right for "hello world", wrong (half right) for anything else."""
    return "<reversed_text>dlrow olleh</reversed_text>" if "hello world" in prompt_text else \
        "<reversed_text>lrn</reversed_text>"


@served
@pytest.mark.slow
def test_turnrl_rollout_runs_verifiers_reverse_text_env(reverse_text_server, qwen3_tokenizer, tmp_path, monkeypatch):
    address, _, log_path = reverse_text_server
    engines = script_the_cli(monkeypatch, qwen3_tokenizer, _reverser)
    data, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    bad = {"id": "bad", "idx": 2, "prompt": "no answer"}  # ReverseTextData requires `answer`
    data.write_text("".join(json.dumps(r) + "\n" for r in [*ROWS, bad]))
    result = CliRunner().invoke(cli_app, [
        "rollout", "--model", "tiny-qwen3", "--agent", "verifiers", "--data", str(data), "--n", "2",
        "--out", str(out), "--max-new-tokens", "48",
        "--env-config", json.dumps({"env_server": address, "renderer": "qwen3"})])
    assert result.exit_code == 0, result.output + log_path.read_text()[-3000:]
    trajs = {t["id"]: t for t in map(json.loads, out.read_text().splitlines())}
    assert sorted(trajs) == ["bad-0", "bad-1", "hello-0", "hello-1", "turnrl-0", "turnrl-1"]
    for tid in ("bad-0", "bad-1"):  # the env server validates the task with the taskset's own type
        failed = trajs.pop(tid)
        assert failed["status"] == "failed" and "failed the run" in failed["error"] and "answer" in failed["error"]
    [engine] = engines
    im_end = qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for tid, t in trajs.items():
        assert (t["status"], t["termination_reason"], t["agent"], t["num_turns"]) == (
            "completed", "env_done", "verifiers", 1), t.get("error")
        # reverse_text's own reward: the LCS ratio of the tagged answer (verifiers' @vf.reward lcs)
        expected = 1.0 if tid.startswith("hello") else pytest.approx(2 * 3 / (3 + 6))
        assert t["reward"] == expected and t["rollout_infos"]["rewards"] == {"lcs": expected}
        # token-exact: the prompt verifiers' renderer built is what the engine was given, the completion is the
        # engine's (its end-of-turn token included), mask 1 only there, its logprobs the engine's
        [call] = [c for c in engine.calls if c.request_id == tid]
        assert t["prompt_ids"] == call.prompt_ids
        reply = qwen3_tokenizer.encode(_reverser(tid, 1, "hello world" if tid.startswith("hello") else ""),
                                       add_special_tokens=False) + [im_end]
        assert t["response_ids"] == reply and t["loss_mask"] == [1] * len(reply)
        assert t["rollout_logprobs"] == [-(k + 1) / 100 for k in range(len(reply))]
        assert [s["source"] for s in t["segments"]] == [SegmentSource.MODEL.value]
        assert [m["role"] for m in t["messages"]] == ["system", "user", "assistant"]
        assert t["messages"][1]["content"] == next(r["prompt"] for r in ROWS if tid.startswith(r["id"]))
    assert qwen3_tokenizer.decode(trajs["hello-0"]["prompt_ids"]) == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n")


def _glossary_agent(request_id: str, turn: int, prompt_text: str) -> str:
    """Call verifiers' facts_lookup tool (hermes format, as Qwen3's renderer parses it), then answer with its
    result."""
    if "<tool_response>" in prompt_text:
        fact = prompt_text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
        return f"<answer>{fact}</answer>"
    return '<tool_call>\n{"name": "facts_lookup", "arguments": {"name": "Ada Lovelace"}}\n</tool_call>'


@served
@pytest.mark.slow
def test_a_multi_turn_verifiers_env_with_its_own_mcp_tool(qwen3_tokenizer, tmp_path):
    """verifiers' example `glossary`: a task-scoped toolset (`@vf.tool`) verifiers serves over MCP per rollout; the
    model's tool call goes to it, its result comes back as a tool message (mask 0) and the answer is rewarded."""
    import asyncio

    engine = ScriptedEngine(qwen3_tokenizer, _glossary_agent)
    row = {"idx": 0, "name": "Ada Lovelace", "answer": "the first computer programmer",
           "prompt": 'Use the `facts_lookup` tool to look up "Ada Lovelace", then reply with exactly what it returns '
                     "inside <answer></answer> tags."}  # the task glossary's load() makes for this entity
    log_path = tmp_path / "env_server.log"
    with _serving("glossary", log_path) as (address, _):
        manager = _manager(engine, qwen3_tokenizer, {"env_server": address, "renderer": "qwen3"})
        [[traj]] = asyncio.run(run_groups(manager, [row]))
    assert traj.status == RolloutStatus.COMPLETED, f"{traj.error}\n{log_path.read_text()[-3000:]}"
    assert traj.reward == 1.0 and traj.rollout_infos["rewards"] == {"looked_up": 1.0}
    assert traj.num_turns == 2 and [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert [(s.source, sum(s.loss_mask) == len(s.token_ids)) for s in traj.segments] == [
        (SegmentSource.MODEL, True), (SegmentSource.TOOL, False), (SegmentSource.TEMPLATE, False),
        (SegmentSource.MODEL, True)]
    tool = next(s for s in traj.segments if s.source == SegmentSource.TOOL)
    assert sum(tool.loss_mask) == 0 and "the first computer programmer" in qwen3_tokenizer.decode(tool.token_ids)
    # the second call's prompt is the first call's prompt, its completion and the tool's tokens: one stream
    first, second = engine.calls
    assert second.prompt_ids[:len(first.prompt_ids)] == first.prompt_ids
    assert traj.prompt_ids + traj.response_ids[:-len([*traj.segments][-1].token_ids)] == second.prompt_ids
    assert "facts_lookup" in qwen3_tokenizer.decode(first.prompt_ids)  # its schema, rendered by verifiers


@served
@pytest.mark.slow
def test_an_env_server_killed_mid_episode_fails_that_trajectory(qwen3_tokenizer, tmp_path):
    import asyncio

    log_path = tmp_path / "env_server.log"
    with _serving("reverse-text", log_path) as (address, process):

        def slow(request_id: str, turn: int, prompt_text: str) -> str:
            os.killpg(process.pid, signal.SIGKILL)  # the server dies while its episode waits for the model
            return "<reversed_text>x</reversed_text>"

        engine = ScriptedEngine(qwen3_tokenizer, slow)
        manager = _manager(engine, qwen3_tokenizer, {"env_server": address, "renderer": "qwen3",
                                                     "health_timeout_s": 10})
        t0 = time.monotonic()
        [[traj]] = asyncio.run(run_groups(manager, [ROWS[0]]))
    assert len(engine.calls) == 1, log_path.read_text()[-3000:]
    assert time.monotonic() - t0 < 60
    assert (traj.status, traj.termination_reason) == (RolloutStatus.FAILED, TerminationReason.ENV_ERROR)
    assert f"env server at {address} does not answer" in traj.error


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
