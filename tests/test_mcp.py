"""MCP servers as the tool agent's tools (`--tools 'mcp:COMMAND ...'`, `--tools mcp+http://...`, tool-config YAML)
through `turnrl rollout`: FastMCP servers over stdio and streamable HTTP, the reference servers published on PyPI
(mcp-server-time, mcp-server-calculator, installed in the openenv venv where they resolve), results, errors,
images, sessions per trajectory, a server that fails to start, hangs or dies. Runs with the mcp SDK 2.x (this
venv) and 1.x (`make openenv-test`)."""

from __future__ import annotations

import contextlib
import json
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
from turnrl.tools.mcp import tool_result
from turnrl.types import Trajectory

pytest.importorskip("mcp", reason="pip install 'turnrl[mcp]'")
pytest.importorskip("fastmcp", reason="the test servers are FastMCP servers")
runner = CliRunner()
TESTS = Path(__file__).resolve().parent
SERVER = TESTS / "data" / "mcp_server.py"
STDIO = f"mcp:{sys.executable} {SERVER}"
OPENENV_BIN = TESTS.parent / ".venv-openenv" / "bin"


def call(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def run(tmp_path, script_calls, *flags, monkeypatch, tokenizer, rows=None, n=1):
    """`turnrl rollout` of the tool agent; `script_calls[k]` is the model's reply on turn k+1 (then a final answer)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows or [{"id": "q", "prompt": "Use the tools."}]))
    script_the_cli(monkeypatch, tokenizer, lambda rid, turn, prompt: script_calls[turn - 1]
                   if turn <= len(script_calls) else "The answer is done.")
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--data", str(data), "--out", str(out),
                                 "--max-turns", "6", "--max-new-tokens", "64", "--n", str(n), *flags])
    return result, ([json.loads(line) for line in out.read_text().splitlines()] if out.exists() else [])


def tool_messages(row):
    return [m for m in row["messages"] if m["role"] == "tool"]


def check(row):
    Trajectory.from_json(row).validate()
    for seg in row["segments"]:
        mask = row["loss_mask"][seg["start"]: seg["start"] + seg["length"]]
        assert set(mask) == ({1} if seg["source"] == "model" else {0}), seg
    assert any(seg["source"] == "tool" for seg in row["segments"])


def test_result_conversion():
    assert tool_result({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}).text == "a\nb"
    assert tool_result({"content": [], "structuredContent": {"x": 1}}).text == '{"x": 1}'
    assert tool_result({"content": [{"type": "text", "text": "boom"}], "isError": True}).text == "Error: boom"


def test_stdio_fastmcp_server(tmp_path, monkeypatch, qwen3_tokenizer):
    replies = [call("add", a=2, b=3), call("fail", reason="x") + call("nope"),
               call("add", a="two", b=1)]
    result, rows = run(tmp_path, replies, "--tools", STDIO, monkeypatch=monkeypatch, tokenizer=qwen3_tokenizer)
    assert result.exit_code == 0, result.output
    [row] = rows
    assert row["status"] == "completed" and row["termination_reason"] == "no_tool_call", row["error"]
    check(row)
    add, fail, unknown, bad = tool_messages(row)
    assert add["content"] == "5" and add["name"] == "add"
    assert "failed on purpose: x" in fail["content"] and fail["content"].startswith("Error:")
    assert unknown["content"].startswith("Error: unknown tool 'nope'")
    assert bad["content"].startswith("Error:") and "'a'" in bad["content"]
    prompt = qwen3_tokenizer.decode(row["prompt_ids"])
    assert '"name": "add_note"' in prompt and '"required": ["a", "b"]' in prompt  # the server's JSON schemas


async def test_images_and_structured_results_from_a_real_server():
    from turnrl.tools.mcp import mcp_server

    connection = await mcp_server(STDIO).connection()
    try:
        square = await connection.call("red_square", {})
        notes = await connection.call("list_notes", {})
    finally:
        await connection.close()
    [image] = square.images
    assert image.size == (4, 4) and image.getpixel((0, 0)) == (255, 0, 0)
    assert json.loads(notes.text) in ([], {"result": []})  # FastMCP wraps a list in structured content


@pytest.mark.slow
def test_tool_config_yaml_and_name_clash(tmp_path, monkeypatch, qwen3_tokenizer):
    config = tmp_path / "tools.yaml"
    config.write_text(f"tools:\n  - mcp: {sys.executable} {SERVER}\n")
    result, rows = run(tmp_path, [call("add", a=1, b=1)], "--tools", str(config), monkeypatch=monkeypatch,
                       tokenizer=qwen3_tokenizer)
    assert result.exit_code == 0, result.output
    assert tool_messages(rows[0])[0]["content"] == "2"
    clash = tmp_path / "mine.py"
    clash.write_text("from turnrl.tools import function_tool\n\n\n@function_tool\n"
                     "def add(a: int, b: int) -> int:\n    '''Add.'''\n    return a + b\n")
    result, _ = run(tmp_path, [], "--tools", str(clash), "--tools", str(config), monkeypatch=monkeypatch,
                    tokenizer=qwen3_tokenizer)
    assert result.exit_code == 2, result.output
    assert re.search(r"tool 'add' defined twice: in .*mine\.py \(function tool\) and MCP server",
                     " ".join(result.output.split())), result.output


@pytest.mark.slow
def test_a_hanging_call_times_out_and_a_dead_server_is_named(tmp_path, monkeypatch, qwen3_tokenizer):
    start = time.monotonic()
    result, rows = run(tmp_path, [call("hang"), call("add", a=1, b=2), call("die"), call("add", a=1, b=2)],
                       "--tools", STDIO, "--tool-timeout", "10", monkeypatch=monkeypatch, tokenizer=qwen3_tokenizer)
    assert result.exit_code == 0, result.output
    assert time.monotonic() - start < 120
    [row] = rows
    hang, after_hang, die, after_death = (m["content"] for m in tool_messages(row))
    assert hang == "Error: tool 'hang' timed out after 10 s"  # the first call also waited for the server to start
    assert after_hang == "3"  # the server is still there for the next call
    assert die.startswith("Error:")
    assert after_death.startswith("Error:") and "dying now" in after_death, after_death  # its stderr, named


def test_a_server_that_fails_to_start(tmp_path, monkeypatch, qwen3_tokenizer):
    broken = tmp_path / "broken.py"
    broken.write_text("import sys\nprint('cannot start: no config', file=sys.stderr)\nsys.exit(3)\n")
    result, _ = run(tmp_path, [], "--tools", f"mcp:{sys.executable} {broken}", monkeypatch=monkeypatch,
                    tokenizer=qwen3_tokenizer)
    assert result.exit_code != 0
    assert "MCP server mcp:" in result.output and "cannot start: no config" in result.output, result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_server():
    port = _free_port()
    process = subprocess.Popen([sys.executable, str(SERVER), "--http", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        for _ in range(300):
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(url, timeout=1)
                break
            time.sleep(0.1)
        yield url
    finally:
        process.kill()
        process.wait(10)


@pytest.mark.slow
def test_streamable_http_server_gives_each_trajectory_its_session(tmp_path, monkeypatch, qwen3_tokenizer):
    with http_server() as url:
        result, rows = run(tmp_path, [call("add_note", note="mine"), call("list_notes")], "--tools", f"mcp+{url}",
                           monkeypatch=monkeypatch, tokenizer=qwen3_tokenizer, n=3)
    assert result.exit_code == 0, result.output
    assert len(rows) == 3
    for row in rows:
        check(row)
        noted, listed = (m["content"] for m in tool_messages(row))
        assert noted == "noted (1 notes)" and json.loads(listed) == ["mine"]  # never another trajectory's note


@pytest.mark.slow
@pytest.mark.skipif(not (OPENENV_BIN / "mcp-server-time").exists(), reason="make openenv-install (mcp 1.x servers)")
def test_published_reference_servers(tmp_path, monkeypatch, qwen3_tokenizer):
    replies = [call("get_current_time", timezone="Europe/Paris") +
               call("convert_time", source_timezone="UTC", time="12:00", target_timezone="Asia/Tokyo"),
               call("calculate", expression="2*(3+4)")]
    result, rows = run(tmp_path, replies, "--tools", f"mcp:{OPENENV_BIN / 'mcp-server-time'}",
                       "--tools", f"mcp:{OPENENV_BIN / 'mcp-server-calculator'}", monkeypatch=monkeypatch,
                       tokenizer=qwen3_tokenizer)
    assert result.exit_code == 0, result.output
    [row] = rows
    check(row)
    now, converted, calculated = (m["content"] for m in tool_messages(row))
    assert json.loads(now)["timezone"] == "Europe/Paris"
    assert json.loads(converted)["target"]["datetime"].startswith(time.strftime("%Y")) or "21:00" in converted
    assert calculated.strip() == "14"
