"""The harness agent (turnrl.agents.harness) and Harbor tasks (turnrl.agents.harbor) with a small real CLI
(tests/harness_cli.py: the system python speaking chat completions) against the in-process proxy on a scripted
engine with the real Qwen3 tokenizer; the faults of the issue (a CLI that hangs, one that exits at once, one that
crashes, tests that hang, tests that write no reward), each a FAILED trajectory saying why, nothing left behind.
The real Claude Code, Codex and opencode are in tests/test_harness_clis.py (slow)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from fakes import ScriptedEngine

from turnrl.agents.harbor import HarborTaskError, dockerfile_workdir, load_task, read_reward, task_rows
from turnrl.agents.harness import HarnessSettings, fill, harness_spec, make_harness_agent
from turnrl.agents.openai_agent import close_gateways
from turnrl.build import harness_settings
from turnrl.config import ConfigError, HarnessConfig, RolloutConfig, effective_rollout_config
from turnrl.data import DataError, load_rows
from turnrl.render import ChatRenderer
from turnrl.rollout.episode import RolloutLimits
from turnrl.rollout.manager import RolloutManager, run_groups
from turnrl.tools._sandbox_kernel import landlock_abi
from turnrl.types import RolloutStatus, SegmentSource, TerminationReason

ROOT = Path(__file__).resolve().parent
TASKS = ROOT / "data" / "harbor"
FAKE_CLI = ROOT / "harness_cli.py"
IS_ROOT = os.geteuid() == 0
needs_sandbox = pytest.mark.skipif(not IS_ROOT or not landlock_abi() or not Path("/usr/bin/python3").exists(),
                                   reason="the harness runs CLIs in the command sandbox (root, Landlock, "
                                          "/usr/bin/python3 for the test CLI)")
GREETING = "hello from turnrl"


@pytest.fixture(autouse=True)
def _stop_gateways():
    yield
    close_gateways()


def write_call(path: str, content: str) -> str:
    return '<tool_call>\n{"name": "write_file", "arguments": ' + json.dumps({"path": path, "content": content}) + \
        "}\n</tool_call>"


def greeting_script(content: str = GREETING):
    """The scripted policy: write the file through the CLI's own tool, then say it is done."""
    def script(request_id: str, turn: int, prompt: str) -> str:
        return "Done." if "<tool_response>" in prompt.rsplit("<|im_start|>assistant", 1)[0][-400:] else \
            write_call("greeting.txt", content)
    return script


def settings(tmp_path: Path, **overrides) -> HarnessSettings:
    cfg = HarnessConfig(command=[str(FAKE_CLI), "{instruction}"], api="chat", base_dir=str(tmp_path / "runs"),
                        **overrides)
    (tmp_path / "runs").mkdir(exist_ok=True)
    return harness_settings(cfg)


def manager(engine, tokenizer, harness: HarnessSettings, **limits) -> RolloutManager:
    return RolloutManager(engine, ChatRenderer(tokenizer), agents={"harness": make_harness_agent(harness)},
                          default_agent="harness", limits=RolloutLimits(max_turns=6, max_new_tokens=128, **limits))


def processes_of_uid(uid: int) -> list[str]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if re.search(rf"^Uid:\s+{uid}\s", text, re.M):
            found.append(status.parent.name)
    return found


def assert_token_exact(traj, engine: ScriptedEngine) -> None:
    """Each model segment follows exactly a prompt the engine was given; everything not sampled is mask 0."""
    prompts = [c.prompt_ids for c in engine.calls]
    stream = list(traj.prompt_ids)
    for seg in traj.segments:
        if seg.source == SegmentSource.MODEL:
            assert stream in prompts, f"{traj.id}: a model segment after a prefix the engine was never given"
        else:
            assert set(seg.loss_mask) == {0}
        stream += seg.token_ids
    traj.validate()


def assert_nothing_left(traj, tmp_path: Path) -> None:
    uid = traj.info["harness"]["sandbox"]["uid"]
    assert uid is not None and processes_of_uid(uid) == []
    assert list((tmp_path / "runs").iterdir()) == []


# ---- Harbor tasks ------------------------------------------------------------------------------------
def test_a_harbor_task_reads_its_instruction_limits_and_workdir():
    task = load_task(TASKS / "write-greeting")
    assert task.instruction.startswith("Create a file named `greeting.txt`") and task.name == "write-greeting"
    assert (task.workdir, task.agent_timeout_s, task.verifier_timeout_s) == ("/app", 120.0, 30.0)
    template = load_task(TASKS / "harbor-template-task")  # Harbor's own template: its defaults
    assert (template.instruction, template.workdir, template.agent_timeout_s) == ("", "/app", 900.0)
    assert template.verifier_timeout_s == 900.0
    bare = load_task(TASKS / "json-rewards")  # no task.toml, no Dockerfile: Harbor's defaults
    assert (bare.workdir, bare.agent_timeout_s, bare.verifier_timeout_s) == ("/app", None, 600.0)


def test_the_dockerfiles_last_workdir_is_where_the_agent_works(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM python:3.12 AS build\nWORKDIR /src\nFROM ubuntu:24.04\n# WORKDIR /no\nWORKDIR /srv\n"
                          "WORKDIR project\nRUN true \\\n  && echo WORKDIR /not-this\n")
    assert dockerfile_workdir(dockerfile) == "/srv/project"
    dockerfile.write_text("FROM python:3.12\nWORKDIR /a\nFROM ubuntu\n")
    assert dockerfile_workdir(dockerfile) is None


@pytest.mark.parametrize(("toml", "message"), [
    ("[[steps]]\nname = 'one'\n", r"\[\[steps\]\] \(a multi-step task\) is not supported"),
    ("[agent]\ntimeout_sec = -1\n", r"\[agent\] timeout_sec must be a positive number of seconds, got -1"),
    ("[verifier]\nenv = {A = 1}\n", r"\[verifier\] env must be a table of strings"),
    ("[environment]\nos = 'windows'\n", "only linux tasks run here"),
    ("[environment]\nworkdir = 'app'\n", "workdir must be an absolute path, got 'app'"),
    ("[agent\n", "invalid TOML"),
])
def test_a_bad_task_toml_is_named_with_its_field(tmp_path, toml, message):
    shutil.copytree(TASKS / "write-greeting", tmp_path / "t")
    (tmp_path / "t" / "task.toml").write_text(toml)
    with pytest.raises(HarborTaskError, match=message):
        load_task(tmp_path / "t")


def test_a_folder_of_tasks_is_a_dataset_and_rows_may_name_tasks(tmp_path):
    rows = load_rows(TASKS)
    assert [r["id"] for r in rows] == ["hanging-test", "harbor-template-task", "json-rewards", "write-farewell",
                                       "write-greeting"]
    assert rows[4]["prompt"] == load_task(TASKS / "write-greeting").instruction
    assert rows[4]["harbor_task"] == str(TASKS / "write-greeting")
    assert [r["id"] for r in load_rows(TASKS / "write-greeting")] == ["write-greeting"]  # one task folder
    data = tmp_path / "rows.jsonl"
    shutil.copytree(TASKS / "write-greeting", tmp_path / "tasks" / "greet")
    data.write_text(json.dumps({"harbor_task": "tasks/greet", "difficulty": 1}) + "\n"
                    + json.dumps({"id": "mine", "prompt": "Say hi", "harbor_task": "tasks/greet"}) + "\n")
    named = load_rows(data)
    assert named[0]["id"] == "greet" and named[0]["harbor_task"] == str((tmp_path / "tasks" / "greet").resolve())
    assert named[1]["id"] == "mine" and named[1]["prompt"] == "Say hi"  # a row's own prompt and id win
    data.write_text(json.dumps({"harbor_task": "tasks/none"}) + "\n")
    with pytest.raises(DataError, match=r"rows.jsonl row 1: field 'harbor_task': Harbor task .*tasks/none: not a folder"):
        load_rows(data)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="neither a Harbor task folder nor a folder of them"):
        load_rows(tmp_path / "empty")
    assert task_rows(TASKS / "write-greeting")[0]["id"] == "write-greeting"


@pytest.mark.parametrize(("files", "expected"), [
    ({"reward.txt": "1\n"}, (1.0, {"reward": 1.0})),
    ({"reward.txt": "0.25"}, (0.25, {"reward": 0.25})),
    ({"reward.json": '{"reward": 0.5, "style": 1}', "reward.txt": "0"}, (0.5, {"reward": 0.5, "style": 1.0})),
    ({"reward.json": '{"accuracy": 0.75}'}, (0.75, {"accuracy": 0.75})),
    ({"reward.json": "2"}, (2.0, {"reward": 2.0})),
    ({}, "wrote no reward"),
    ({"reward.txt": ""}, "must hold a number, got ''"),
    ({"reward.txt": "nan"}, "not a finite number"),
    ({"reward.json": '{"a": 1, "b": 0}'}, r"several rewards \['a', 'b'\] and none is named `reward`"),
    ({"reward.json": '{"reward": "1"}'}, "must hold finite numbers"),
    ({"reward.json": "{"}, "invalid /logs/verifier/reward.json"),
])
def test_rewards_are_read_as_harbor_reads_them(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    if isinstance(expected, str):
        with pytest.raises(HarborTaskError, match=expected):
            read_reward(tmp_path)
    else:
        assert read_reward(tmp_path) == expected


# ---- configuration ------------------------------------------------------------------------------------
def test_a_harness_config_names_a_builtin_or_a_cli_of_its_own():
    assert HarnessConfig.model_validate("codex").name == "codex"
    assert effective_rollout_config(RolloutConfig(harness="opencode")).agent == "harness"
    assert effective_rollout_config(RolloutConfig(harness="opencode", agent="tool_agent")).agent == "tool_agent"
    with pytest.raises(ValueError, match="Input should be 'claude-code', 'codex' or 'opencode'"):
        HarnessConfig.model_validate("aider")
    with pytest.raises(ValueError, match="not both or neither"):
        HarnessConfig(name="codex", command=["x"], api="chat")
    with pytest.raises(ValueError, match="harness.api: your own CLI's API is required"):
        HarnessConfig(command=["my-agent"])
    with pytest.raises(ConfigError, match=r"rollout.harness custom: the CLI 'no-such-agent' is not installed"):
        harness_settings(HarnessConfig(command=["no-such-agent"], api="chat"))


def test_turnrl_rollout_names_a_bad_harness_before_loading_anything(tmp_path):
    from typer.testing import CliRunner

    from turnrl.cli import app

    result = CliRunner().invoke(app, ["rollout", "--model", "tiny-qwen3", "--harness", "aider", "--data",
                                      str(TASKS / "write-greeting"), "--out", str(tmp_path / "o.jsonl")])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "harness" in said and "'claude-code', 'codex' or 'opencode'" in said, said


def test_builtin_harnesses_fill_their_configuration_per_episode():
    codex = harness_spec("codex", env={"RUST_LOG": "warn"})
    assert codex.api == "responses" and codex.env["RUST_LOG"] == "warn" and codex.env["CODEX_HOME"] == "{home}/.codex"
    values = {"instruction": "fix it", "base_url": "http://127.0.0.1:9/sessions/s/v1", "api_key": "k", "model": "m",
              "workdir": "/app", "home": "/h"}
    config = fill(codex.files[".codex/config.toml"], values)
    assert 'base_url = "http://127.0.0.1:9/sessions/s/v1"' in config and 'model = "m"' in config
    opencode = json.loads(fill(harness_spec("opencode").files[".config/opencode/opencode.json"], values))
    assert opencode["provider"]["turnrl"]["options"] == {"baseURL": "http://127.0.0.1:9/sessions/s/v1", "apiKey": "k"}
    assert harness_spec(None, ["agent"], api="anthropic").env["ANTHROPIC_BASE_URL"] == "{base_url}"
    with pytest.raises(ValueError, match="unknown harness 'aider'"):
        harness_spec("aider")


# ---- episodes ------------------------------------------------------------------------------------------
@needs_sandbox
async def test_the_cli_writes_the_file_through_its_tool_and_the_tests_reward_1(qwen3_tokenizer, tmp_path):
    engine = ScriptedEngine(qwen3_tokenizer, greeting_script())
    rows = load_rows(TASKS / "write-greeting")
    [[traj]] = await run_groups(manager(engine, qwen3_tokenizer, settings(tmp_path)), rows)
    assert traj.status == RolloutStatus.COMPLETED and traj.reward == 1.0, (traj.error, traj.info)
    assert traj.termination_reason == TerminationReason.NO_TOOL_CALL and traj.num_turns == 2
    assert_token_exact(traj, engine)
    assert [s.source for s in traj.segments] == ["model", "template", "tool", "model"]
    assert traj.info["tests"]["reward"] == 1.0 and "greeting.txt is right" in traj.info["tests"]["output_tail"]
    harness = traj.info["harness"]
    assert harness["exit_code"] == 0 and harness["sandbox"]["mounts"] == ["/app"]
    assert "fake agent in /app as agent" in harness["output_tail"] and "Done." in harness["output_tail"]
    assert traj.episode_id == traj.id
    assert_nothing_left(traj, tmp_path)


@needs_sandbox
async def test_named_rewards_and_a_wrong_answer(qwen3_tokenizer, tmp_path):
    engine = ScriptedEngine(qwen3_tokenizer, greeting_script("goodbye"))
    rows = load_rows(TASKS / "write-greeting") + load_rows(TASKS / "json-rewards")
    [[wrong], [named]] = await run_groups(manager(engine, qwen3_tokenizer, settings(tmp_path)), rows)
    assert wrong.status == RolloutStatus.COMPLETED and wrong.reward == 0.0  # a wrong answer scores 0
    assert "missing or wrong: goodbye" in wrong.info["tests"]["output_tail"]
    assert named.reward == 1.0 and named.info["tests"]["rewards"] == {"reward": 1.0, "style": 0.5}


@needs_sandbox
async def test_a_cli_that_hangs_is_killed_at_its_limit(qwen3_tokenizer, tmp_path):
    engine = ScriptedEngine(qwen3_tokenizer, greeting_script())
    harness = settings(tmp_path, env={"FAKE_MODE": "hang"}, timeout_s=2)
    start = time.monotonic()
    [[traj]] = await run_groups(manager(engine, qwen3_tokenizer, harness), load_rows(TASKS / "write-greeting"))
    assert time.monotonic() - start < 15
    assert traj.status == RolloutStatus.FAILED and traj.termination_reason == TerminationReason.TIMEOUT
    assert traj.reward is None and "tests" not in traj.info
    assert "harness custom ran past its limit of 2 s and was killed" in traj.error and "thinking..." in traj.error
    assert_nothing_left(traj, tmp_path)


@needs_sandbox
@pytest.mark.parametrize(("mode", "reason", "message", "output"), [
    ("exit", "env_error", "harness custom exited with status 3 and no model call was answered", "giving up"),
    ("silent", "env_error", "harness custom exited and no model call was answered", "fake agent in /app"),
    ("crash", "env_error", "harness custom crashed (exit status 1) after 1 model calls", "segfault in the tool runner"),
])
async def test_a_cli_that_fails_ends_its_episode_failed_saying_why(qwen3_tokenizer, tmp_path, mode, reason, message,
                                                                   output):
    engine = ScriptedEngine(qwen3_tokenizer, greeting_script())
    harness = settings(tmp_path, env={"FAKE_MODE": mode})
    [[traj]] = await run_groups(manager(engine, qwen3_tokenizer, harness), load_rows(TASKS / "write-greeting"))
    assert traj.status == RolloutStatus.FAILED and traj.termination_reason == reason and traj.reward is None
    assert message in traj.error and output in traj.error, traj.error
    assert traj.info["harness"]["exit_code"] == (3 if mode == "exit" else 1 if mode == "crash" else 0)
    if mode == "crash":  # its one call is kept, token-exact, for inspection (never trained: FAILED)
        assert traj.num_turns == 1
        assert_token_exact(traj, engine)
    assert_nothing_left(traj, tmp_path)


@needs_sandbox
@pytest.mark.parametrize(("task", "reason", "message"), [
    ("hanging-test", "timeout", "the task's tests ran past their limit of 2 s and were killed"),
    ("harbor-template-task", "env_error", "the task's tests wrote no reward (neither /logs/verifier/reward.txt nor "
                                          "reward.json) (tests/test.sh exit status 0)"),
])
async def test_tests_that_hang_or_write_no_reward_fail_the_episode(qwen3_tokenizer, tmp_path, task, reason, message):
    engine = ScriptedEngine(qwen3_tokenizer, greeting_script())
    start = time.monotonic()
    [[traj]] = await run_groups(manager(engine, qwen3_tokenizer, settings(tmp_path)), load_rows(TASKS / task))
    assert time.monotonic() - start < 20
    assert traj.status == RolloutStatus.FAILED and traj.termination_reason == reason and traj.reward is None
    assert message in traj.error, traj.error
    assert traj.num_turns == 2 and traj.info["tests"]["error"] in traj.error
    assert_nothing_left(traj, tmp_path)


@needs_sandbox
async def test_a_trajectory_timeout_kills_the_cli_at_once(qwen3_tokenizer, tmp_path):
    """rollout.trajectory_timeout_s cancels the episode: the CLI is killed then, not at its own limit."""
    engine = ScriptedEngine(qwen3_tokenizer, greeting_script())
    harness = settings(tmp_path, env={"FAKE_MODE": "hang"}, timeout_s=600)
    start = time.monotonic()
    [[traj]] = await run_groups(manager(engine, qwen3_tokenizer, harness, trajectory_timeout_s=2.0),
                                load_rows(TASKS / "write-greeting"))
    assert time.monotonic() - start < 15
    assert traj.status == RolloutStatus.FAILED and traj.termination_reason == TerminationReason.TIMEOUT
    assert "trajectory_timeout_s=2.0" in traj.error
    assert list((tmp_path / "runs").iterdir()) == []


@needs_sandbox
async def test_a_call_beyond_max_turns_ends_the_episode_and_the_tests_still_score_it(qwen3_tokenizer, tmp_path):
    """rollout.max_turns bounds the CLI's model calls: the next is refused (the test CLI then exits 1), the episode
    ran its course (COMPLETED / max_turns), and the tests score what it did."""
    engine = ScriptedEngine(qwen3_tokenizer, greeting_script())
    rollout = manager(engine, qwen3_tokenizer, settings(tmp_path))
    rollout.limits.max_turns = 1
    [[traj]] = await run_groups(rollout, load_rows(TASKS / "write-greeting"))
    assert traj.status == RolloutStatus.COMPLETED and traj.termination_reason == TerminationReason.MAX_TURNS
    assert traj.reward == 1.0 and traj.info["harness"]["exit_code"] == 1 and len(engine.calls) == 1
    assert "HTTP Error 400" in traj.info["harness"]["output_tail"], traj.info["harness"]["output_tail"]


@needs_sandbox
async def test_without_its_own_user_the_harness_refuses_unless_weak(qwen3_tokenizer, tmp_path, monkeypatch):
    """Not root (simulated: no uid to switch to): strict refuses, naming `sandbox: weak`; weak runs the CLI as this
    user with the other layers (the task's /app still mounted)."""
    from turnrl.agents import sandbox as command_sandbox

    monkeypatch.setattr(command_sandbox, "pick_sandbox_id", lambda: None)
    engine = ScriptedEngine(qwen3_tokenizer, greeting_script())
    [[strict]] = await run_groups(manager(engine, qwen3_tokenizer, settings(tmp_path)), load_rows(TASKS / "write-greeting"))
    assert strict.status == RolloutStatus.FAILED and "set `sandbox: weak`" in strict.error
    weak = manager(engine, qwen3_tokenizer, settings(tmp_path, sandbox="weak"))
    [[traj]] = await run_groups(weak, load_rows(TASKS / "write-greeting"))
    assert traj.status == RolloutStatus.COMPLETED and traj.reward == 1.0, traj.error
    assert traj.info["harness"]["sandbox"]["uid"] is None and traj.info["harness"]["sandbox"]["mounts"] == ["/app"]
    assert list((tmp_path / "runs").iterdir()) == []


@needs_sandbox
async def test_a_row_without_a_task_is_scored_by_the_reward_function(qwen3_tokenizer, tmp_path):
    engine = ScriptedEngine(qwen3_tokenizer, greeting_script())
    scored = []
    rollout = manager(engine, qwen3_tokenizer, settings(tmp_path))
    rollout.reward_fn = lambda traj: scored.append(traj.id) or 0.5
    [[traj]] = await run_groups(rollout, [{"id": "free", "prompt": "Write greeting.txt"}])
    assert traj.status == RolloutStatus.COMPLETED and traj.reward == 0.5 and scored == ["free-0"]
    assert "tests" not in traj.info
    assert_token_exact(traj, engine)
