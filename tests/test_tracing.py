"""Trajectories as MLflow traces, checked against a real `mlflow server` (SQLite) that these tests start."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from test_tool_agent import THINK, call, run, scripted

from turnrl.observe.tracing import TrajectoryTracer

mlflow = pytest.importorskip("mlflow")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    log_file = open(root / "server.log", "w")  # noqa: SIM115 (closed at teardown)
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, cwd=root,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no job-runner process
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                pytest.fail(f"mlflow server exited with {process.returncode}:\n{(root / 'server.log').read_text()}")
            try:
                if httpx.get(f"{uri}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server not healthy after 90 s:\n{(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield uri
        mlflow.flush_trace_async_logging()  # nothing may be left queued for a server that is gone
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # the server and its uvicorn worker
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log_file.close()


def test_trajectory_becomes_a_span_tree_with_real_timings(mlflow_server, qwen3_tokenizer):
    [traj], _ = run(qwen3_tokenizer, scripted(THINK + call("add", a=2, b=3), THINK + "The answer is 5."))
    tracer = TrajectoryTracer(mlflow_server, "test-tracing", max_traces_per_step=1, tokenizer=qwen3_tokenizer)
    tracer.log_metrics({"rollout/reward_mean": 0.5, "eval/tag": "before"}, step=7)  # starts the run
    trace_id = tracer.export(traj, step=7, phase="train")
    assert tracer.export(traj, step=7, phase="train") is None  # the step's quota of 1 is used up
    tracer.close()
    assert (tracer.exported, tracer.sampled_out, tracer.failures) == (1, 1, 0)
    assert traj.info["mlflow_trace_id"] == trace_id

    mlflow.set_tracking_uri(mlflow_server)
    [found] = mlflow.search_traces(
        locations=[tracer.experiment_id], return_type="list",
        filter_string=f"tag.`turnrl.trajectory_id` = '{traj.id}' AND tag.`turnrl.step` = '7'",
    )
    assert found.info.trace_id == trace_id and found.info.tags["turnrl.phase"] == "train"
    assert found.info.trace_metadata["mlflow.sourceRun"] == tracer.run_id
    run_ = mlflow.MlflowClient(mlflow_server).get_run(tracer.run_id)
    assert run_.data.metrics == {"rollout/reward_mean": 0.5} and run_.info.status == "FINISHED"
    trace = mlflow.get_trace(trace_id)
    by_id = {s.span_id: s for s in trace.data.spans}
    # both turns have a "generate" and an "env.step": name each span by its parent's name and its own
    tree = {(by_id[s.parent_id].name if s.parent_id else None, s.name): s for s in trace.data.spans}
    assert len(tree) == len(trace.data.spans) == 8 and sorted(tree, key=str) == sorted([
        (None, "trajectory"), ("trajectory", "turn 1"), ("trajectory", "turn 2"),
        ("turn 1", "generate"), ("turn 1", "env.step"), ("env.step", "tool:add"),
        ("turn 2", "generate"), ("turn 2", "env.step"),
    ], key=str)
    root = tree[None, "trajectory"]
    assert root.span_type == "AGENT"
    assert (root.attributes["id"], root.attributes["group_id"], root.attributes["num_turns"]) == (traj.id, "0", 2)
    assert (root.attributes["status"], root.attributes["termination_reason"]) == ("completed", "no_tool_call")

    turn1, turn2 = spans_of_turn(trace, 1), spans_of_turn(trace, 2)
    assert (turn1["turn"].span_type, turn1["generate"].span_type, turn1["env.step"].span_type) == (
        "CHAIN", "LLM", "CHAIN")  # env.step wraps tool calls
    assert turn2["env.step"].span_type == "TOOL"  # a step without tool calls: the final answer
    assert turn1["generate"].attributes["tokens"] == traj.turns[0].generate.tokens
    assert turn1["generate"].attributes["finish_reason"] == "stop"
    assert "<tool_call>" in turn1["generate"].outputs["text"]
    assert "<tool_response>\n5\n</tool_response>" in turn1["env.step"].outputs["observation"]

    tool = tree["env.step", "tool:add"]
    assert tool.span_type == "TOOL" and tool.parent_id == turn1["env.step"].span_id
    assert (tool.attributes["name"], tool.attributes["ok"], tool.inputs) == ("add", True, {"a": 2, "b": 3})
    assert tool.outputs["ok"] is True and tool.outputs["latency_s"] > 0

    # the recorded times: spans nest, and turn 2 generates only after turn 1's tool call returned
    recorded_tool = traj.turns[0].env.info["tool_calls"][0]
    assert (tool.start_time_ns, tool.end_time_ns) == (recorded_tool["start_ns"], recorded_tool["end_ns"])
    assert turn1["generate"].end_time_ns <= turn1["env.step"].start_time_ns <= tool.start_time_ns
    assert tool.end_time_ns <= turn1["env.step"].end_time_ns <= turn2["generate"].start_time_ns
    assert root.start_time_ns == turn1["turn"].start_time_ns and root.end_time_ns == turn2["turn"].end_time_ns


def test_broken_trajectory_record_is_counted_not_raised(mlflow_server, qwen3_tokenizer, caplog):
    [traj], _ = run(qwen3_tokenizer, scripted("No tools needed."))
    traj.turns = [None]  # a corrupt record: the tracer cannot convert it
    tracer = TrajectoryTracer(mlflow_server, "test-tracing")
    with caplog.at_level(logging.WARNING, logger="turnrl.observe.tracing"):
        assert tracer.export(traj) is None
    tracer.close()  # the partial trace (marked ERROR) is sent now, while the server is up
    assert tracer.failures == 1 and tracer.exported == 0
    assert f"could not trace trajectory {traj.id}" in caplog.text


def test_unreachable_server_turns_tracing_off_without_raising(qwen3_tokenizer, caplog):
    [traj], _ = run(qwen3_tokenizer, scripted("No tools needed."))
    with caplog.at_level(logging.WARNING, logger="turnrl.observe.tracing"):
        tracer = TrajectoryTracer(f"http://127.0.0.1:{_free_port()}", "nowhere")
    assert not tracer.enabled and tracer.failures == 1
    assert "tracing is off" in caplog.text
    assert tracer.export(traj) is None and "mlflow_trace_id" not in traj.info
    tracer.log_metrics({"rollout/reward_mean": 1.0}, step=1)
    tracer.close()
    assert tracer.failures == 1


def test_tracer_without_uri_does_nothing(qwen3_tokenizer):
    [traj], _ = run(qwen3_tokenizer, scripted("No tools needed."))
    tracer = TrajectoryTracer(None)
    assert not tracer.enabled and tracer.export(traj) is None
    tracer.log_metrics({"x": 1.0}, step=0)
    tracer.close()
    assert tracer.failures == 0


def spans_of_turn(trace, turn: int) -> dict:
    """The `turn`, `generate` and `env.step` spans of one turn."""
    [turn_span] = [s for s in trace.data.spans if s.name == f"turn {turn}"]
    children = {s.name: s for s in trace.data.spans if s.parent_id == turn_span.span_id}
    return {"turn": turn_span, **children}


def test_the_mlflow_logger_names_the_run_after_its_directory_and_keeps_its_files(mlflow_server, tmp_path):
    from turnrl.observe.loggers import build_loggers

    run_dir = tmp_path / "20261201-103200"
    run_dir.mkdir()
    (run_dir / "curves.png").write_bytes(b"\x89PNG fake")
    tracer = TrajectoryTracer(mlflow_server, "test-loggers")
    loggers = build_loggers(["jsonl", "mlflow"], run_dir, {"model": "tiny-qwen3"}, tracer)
    for step in (0, 1, 2):
        loggers.log({"step": float(step), "rollout/reward_mean": step / 4, "eval/tag": "x"}, step)
    loggers.close([run_dir / "curves.png", run_dir / "metrics.jsonl"])
    tracer.close()
    client = mlflow.MlflowClient(mlflow_server)
    run_ = client.get_run(tracer.run_id)
    assert run_.info.run_name == "20261201-103200"
    history = client.get_metric_history(tracer.run_id, "rollout/reward_mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert {a.path for a in client.list_artifacts(tracer.run_id)} == {"curves.png", "metrics.jsonl"}
