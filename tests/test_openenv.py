"""OpenEnv's own example environments (tests/openenv_envs, copied from its repository) through `turnrl rollout`:
in this process (`--env openenv:MODULE:CLASS`, where openenv is installed: `make openenv-test`) and served by
uvicorn from the openenv venv on 127.0.0.1 (`--env openenv+http://HOST:PORT`: WebSocket sessions, from this venv,
which has no openenv). Masks, logprobs, rewards, invalid actions, MCP tools, capacity and a server that dies."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fakes import script_the_cli
from typer.testing import CliRunner

from turnrl.cli import app
from turnrl.envs.openenv import InvalidAction, observation_message, parse_action
from turnrl.types import Trajectory

runner = CliRunner()
TESTS = Path(__file__).resolve().parent
OPENENV_PYTHON = Path(os.environ.get("TURNRL_OPENENV_PYTHON", TESTS.parent / ".venv-openenv" / "bin" / "python"))
HAS_OPENENV = importlib.util.find_spec("openenv") is not None
in_process = pytest.mark.skipif(not HAS_OPENENV, reason="openenv is not installed here (make openenv-test)")

GRID = "openenv_envs.grid_world_env.server.grid_world_environment:GridWorldEnvironment"
ECHO = "openenv_envs.echo_env.server.echo_environment:EchoEnvironment"
RG = "openenv_envs.reasoning_gym_env.server.reasoning_gym_environment:ReasoningGymEnvironment"


def run(tmp_path, env, *flags, data=None):
    out = tmp_path / "out.jsonl"
    args = ["rollout", "--model", "tiny-qwen3", "--env", env, "--out", str(out), "--max-new-tokens", "48",
            "--reward", "env", *flags]
    args += ["--data", str(data)] if data else []
    result = runner.invoke(app, args)
    return result, ([json.loads(line) for line in out.read_text().splitlines()] if out.exists() else [])


def check(row):
    """Model tokens mask 1 with their sampling logprobs; observations and tool outputs mask 0."""
    Trajectory.from_json(row).validate()
    for seg in row["segments"]:
        mask = row["loss_mask"][seg["start"]: seg["start"] + seg["length"]]
        assert set(mask) == ({1} if seg["source"] == "model" else {0}), seg


GRID_PATH = ["DOWN"] * 4 + ["RIGHT"] * 4


def grid_script(rid, turn, prompt):
    if turn == 1:
        return "I will go north"  # not an action: told to the model, the env is not stepped
    return GRID_PATH[turn - 2]


def check_grid(rows):
    for row in rows:
        check(row)
        assert row["status"] == "completed" and row["termination_reason"] == "env_done", row["error"]
        assert row["num_turns"] == 9 and row["turn_rewards"] == [-0.1] * 7 + [1.0]
        assert row["reward"] == pytest.approx(0.3)
        assert "x: 0\ny: 0\nmessage: Welcome to Grid World!" in row["messages"][0]["content"]
        invalid = row["messages"][2]["content"]
        assert invalid.startswith("Invalid action: field 'action' must be one of UP, DOWN, LEFT, RIGHT"), invalid
        assert row["rollout_infos"]["openenv_seed"] == int(row["group_id"].split("-")[1])
        assert row["messages"][-2]["content"].startswith("x: 4\ny: 3")


# ---- the rule for actions and observations (no openenv needed) -----------------------------------------
def test_action_rule():
    one_text = {"properties": {"metadata": {"type": "object"}, "answer": {"type": "string"}}, "required": ["answer"]}
    assert parse_action("<think>hmm</think> 12 ", one_text) == {"answer": "12"}
    assert parse_action('{"answer": "7"}', one_text) == {"answer": "7"}
    two = {"properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}
    assert parse_action('Moving to ```json\n{"x": 1, "y": 2}\n```', two) == {"x": 1, "y": 2}
    assert parse_action('first {"x": 0} then {"x": 1, "y": 2}', two) == {"x": 1, "y": 2}
    with pytest.raises(InvalidAction, match=r"field 'y' is missing"):
        parse_action('{"x": 1}', two)
    with pytest.raises(InvalidAction, match=r"JSON object with the fields x \(integer\), y \(integer\)"):
        parse_action("go", two)
    enum = {"properties": {"action": {"$ref": "#/$defs/M"}}, "$defs": {"M": {"enum": ["UP", "DOWN"], "type": "string"}}}
    with pytest.raises(InvalidAction, match=r"field 'action' must be one of UP, DOWN; got 'left'"):
        parse_action("left", enum)


def test_observation_rule():
    assert observation_message({"question": "2+2?", "score": None, "metadata": {"a": 1}}) == \
        {"role": "user", "content": "2+2?"}
    assert observation_message({"x": 1, "message": "hi"}) == {"role": "user", "content": "x: 1\nmessage: hi"}
    assert observation_message({"prompt": "P", "messages": [1]}, ["prompt"]) == {"role": "user", "content": "P"}
    assert observation_message({"metadata": {"status": "ready"}}) is None
    image = "data:image/png;base64,AAAA"
    assert observation_message({"screen": image, "text": "t"})["content"] == [
        {"type": "image", "image": image}, {"type": "text", "text": "t"}]


# ---- in process -------------------------------------------------------------------------------------
@in_process
def test_grid_world_in_process(tmp_path, monkeypatch, qwen3_tokenizer):
    monkeypatch.syspath_prepend(str(TESTS))
    script_the_cli(monkeypatch, qwen3_tokenizer, grid_script)
    result, rows = run(tmp_path, f"openenv:{GRID}", "--limit", "2", "--max-turns", "12")
    assert result.exit_code == 0, result.output
    assert len(rows) == 2
    check_grid(rows)


@in_process
def test_reasoning_gym_env_with_reset_arguments(tmp_path, monkeypatch, qwen3_tokenizer):
    import reasoning_gym

    monkeypatch.syspath_prepend(str(TESTS))
    config = {"reset_kwargs": {"dataset_name": "leg_counting", "dataset_config": {}, "seed": 5, "size": 10}}
    entries = {e["question"]: e["answer"] for e in reasoning_gym.create_dataset("leg_counting", seed=5, size=10)}
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: next(
        a for q, a in entries.items() if q in prompt) if rid.startswith("seed-0") else "many legs")
    result, rows = run(tmp_path, f"openenv:{RG}", "--limit", "2", "--env-config", json.dumps(config))
    assert result.exit_code == 0, result.output
    by_id = {r["id"]: r for r in rows}
    for rid, row in by_id.items():
        check(row)
        assert row["messages"][0]["content"] in entries  # the question field alone is the message
        assert row["termination_reason"] == "env_done"
        assert row["reward"] == (1.0 if rid.startswith("seed-0") else 0.0)
        assert row["turns"][0]["env"]["info"]["action"]["answer"] == row["messages"][1]["content"]


@in_process
def test_mcp_environment_tools_in_process(tmp_path, monkeypatch, qwen3_tokenizer):
    monkeypatch.syspath_prepend(str(TESTS))
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"id": "e", "prompt": "Echo the word hello with a tool, then say done."}) + "\n")
    tools_seen = []

    def script(rid, turn, prompt):
        tools_seen.append("echo_with_length" in prompt)
        if turn == 1:
            return '<tool_call>\n{"name": "echo_with_length", "arguments": {"message": "hello"}}\n</tool_call>'
        return "done"

    script_the_cli(monkeypatch, qwen3_tokenizer, script)
    result, rows = run(tmp_path, f"openenv:{ECHO}", data=data)
    assert result.exit_code == 0, result.output
    [row] = rows
    check(row)
    assert tools_seen[0], "the env's MCP tools are rendered into the prompt"
    assert (row["termination_reason"], row["num_turns"]) == ("no_tool_call", 2)
    tool = row["messages"][2]
    assert tool["role"] == "tool" and json.loads(tool["content"]) == {"message": "hello", "length": 5}
    assert [s["source"] for s in row["segments"]].count("tool") == 1


@in_process
def test_not_an_environment_class(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    result, _ = run(tmp_path, "openenv:openenv_envs.grid_world_env.models:GridWorldAction", "--limit", "1")
    assert result.exit_code == 2 and "is not a subclass of openenv's Environment" in result.output, result.output


# ---- served from the openenv venv --------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app_path: str, **env: str):
    """`uvicorn APP` in the openenv venv on 127.0.0.1; yields (url, process)."""
    port = _free_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"openenv-{port}.log", "w+")  # noqa: SIM115
    process = subprocess.Popen([str(OPENENV_PYTHON), "-m", "uvicorn", app_path, "--host", "127.0.0.1", "--port",
                                str(port)], cwd=TESTS, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONPATH": str(TESTS), **env})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if process.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the OpenEnv server exited: {log.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        else:
            raise RuntimeError("the OpenEnv server did not start in 60 s")
        yield url, process
    finally:
        process.kill()
        process.wait(10)
        log.close()


@pytest.mark.slow
@pytest.mark.skipif(not OPENENV_PYTHON.exists(), reason="no openenv venv to serve from (make openenv-install)")
def test_grid_world_over_websocket_up_to_the_servers_capacity(tmp_path, monkeypatch, qwen3_tokenizer):
    script_the_cli(monkeypatch, qwen3_tokenizer, grid_script)
    with serve("openenv_envs.grid_world_env.server.app:app") as (url, _):
        # GridWorld does not declare concurrent sessions: its server takes one session at a time, and the four
        # trajectories in flight wait their turn instead of failing
        result, rows = run(tmp_path, f"openenv+{url}", "--limit", "2", "--n", "2", "--max-turns", "12")
    assert result.exit_code == 0, result.output
    assert len(rows) == 4
    check_grid(rows)


@pytest.mark.slow
@pytest.mark.skipif(not OPENENV_PYTHON.exists(), reason="no openenv venv to serve from (make openenv-install)")
def test_mcp_environment_over_websocket(tmp_path, monkeypatch, qwen3_tokenizer):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"id": "e", "prompt": "Echo hi."}) + "\n")
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: (
        '<tool_call>\n{"name": "echo_message", "arguments": {"message": "hi"}}\n</tool_call>' if turn == 1
        else "The echo said hi."))
    with serve("openenv_envs.echo_env.server.app:app") as (url, _):
        result, rows = run(tmp_path, f"openenv+{url}", "--n", "3", data=data)
    assert result.exit_code == 0, result.output
    assert len(rows) == 3
    for row in rows:
        check(row)
        assert row["termination_reason"] == "no_tool_call"
        assert row["messages"][2] == {"role": "tool", "tool_call_id": row["messages"][2]["tool_call_id"],
                                      "name": "echo_message", "content": "hi"}


@pytest.mark.slow
@pytest.mark.skipif(not OPENENV_PYTHON.exists(), reason="no openenv venv to serve from (make openenv-install)")
def test_a_server_that_dies_mid_episode_fails_its_trajectories(tmp_path, monkeypatch, qwen3_tokenizer):
    state = {}

    def script(rid, turn, prompt):
        if turn == 2 and "process" in state:  # the server dies while the model thinks
            state.pop("process").kill()
        return "DOWN"

    script_the_cli(monkeypatch, qwen3_tokenizer, script)
    with serve("openenv_envs.grid_world_env.server.app:app", ) as (url, process):
        state["process"] = process
        start = time.monotonic()
        result, rows = run(tmp_path, f"openenv+{url}", "--limit", "1", "--max-turns", "6")
    assert result.exit_code == 0, result.output
    assert time.monotonic() - start < 60
    [row] = rows
    assert row["status"] == "failed" and row["termination_reason"] == "env_error"
    assert re.search(r"OpenEnv server at http://127\.0\.0\.1:\d+ closed the session during step", row["error"])
    assert row["num_turns"] == 2 and row["turn_rewards"] == [-0.1]


def test_no_server_fails_the_trajectory_clearly(tmp_path, monkeypatch, qwen3_tokenizer):
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: "UP")
    result, rows = run(tmp_path, f"openenv+http://127.0.0.1:{_free_port()}", "--limit", "2")
    assert result.exit_code == 0, result.output
    for row in rows:
        assert row["status"] == "failed" and "GET /schema failed" in row["error"], row["error"]


@pytest.mark.slow
def test_a_server_without_websocket_is_spoken_to_over_http(tmp_path, monkeypatch, qwen3_tokenizer):
    port = _free_port()
    process = subprocess.Popen([sys.executable, str(TESTS / "data" / "openenv_http_only.py"), str(port)])
    try:
        for _ in range(300):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/schema", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: "Hello!" if "seed 0" in prompt else "no")
        result, rows = run(tmp_path, f"openenv+http://127.0.0.1:{port}", "--limit", "2")
    finally:
        process.kill()
        process.wait(10)
    assert result.exit_code == 0, result.output
    by_id = {r["id"]: r for r in rows}
    assert by_id["seed-0-0"]["messages"][0]["content"] == "Say hello (seed 0)." and by_id["seed-0-0"]["reward"] == 1.0
    assert by_id["seed-1-0"]["reward"] == 0.0
