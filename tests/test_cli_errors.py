"""Bad input to `turnrl train` and `turnrl rollout`: one paragraph naming the field or file, no traceback (only
with -v); a dead engine and an unreachable hub id fail at start-up in one line; failed trajectories log one line."""

from __future__ import annotations

import json
import logging
import re
import time

import pytest
from fakes import ScriptedEngine
from typer.testing import CliRunner

from turnrl.cli import app
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutManager, run_groups

runner = CliRunner()

TOOLS = '''from turnrl.tools import function_tool


@function_tool
def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: a
        b: b
    """
    return a + b
'''


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"prompt": "hi"}\n{"prompt": "ho"}\n')
    (tmp_path / "badjson.jsonl").write_text('{"prompt": "hi"}\n\n{"prompt": "ho", oops}\n')
    (tmp_path / "noprompt.jsonl").write_text('{"prompt": "hi"}\n{"question": "ho"}\n')
    (tmp_path / "nobuild.py").write_text("x = 1\n")
    (tmp_path / "syntax.py").write_text("def build_env(:\n")
    (tmp_path / "badimport.py").write_text("import nonexistent_module_xyz\n")
    (tmp_path / "rew.py").write_text("def other(traj):\n    return 1.0\n")
    (tmp_path / "tools.py").write_text(TOOLS)
    (tmp_path / "nomodel").mkdir()
    (tmp_path / "bad.yaml").write_text("steps: [1\n")
    (tmp_path / "cfg.yaml").write_text(json.dumps({
        "model": "tiny-qwen3", "train_data": str(tmp_path / "data.jsonl"), "output_dir": str(tmp_path / "run"),
        "steps": 1, "rollout": {"env": "single_turn", "n": 2, "max_new_tokens": 4}}))
    return tmp_path


TRAIN_CASES = [
    (["MISSING.yaml"], "config file ~/MISSING.yaml does not exist"),
    (["~/bad.yaml"], "config file ~/bad.yaml: invalid YAML"),
    (["stpes=3"], "stpes: unknown key (did you mean 'steps'?)"),
    (["steps=abc"], "steps: Input should be a valid integer"),
    (["steps"], "override 'steps': expected dotted.key=value"),
    (["rollout.watchdog_s=-1"], "rollout.watchdog_s: Input should be greater than 0 (got -1)"),
    (["rollout.env_timeout_s=0"], "rollout.env_timeout_s: Input should be greater than 0"),
    (["algo.loss_agg=seq_mean_token_sum_norm"], "algo.norm_constant is required with algo.loss_agg=seq_mean_token_sum_norm"),
    (["train_data=/nope/d.jsonl"], "data file /nope/d.jsonl does not exist"),
    (["train_data=~/badjson.jsonl"], "~/badjson.jsonl line 3: invalid JSON (Expecting property name enclosed in "
                                     "double quotes at column 18)"),
    (["train_data=~/noprompt.jsonl"], "~/noprompt.jsonl row 2: missing field 'prompt'"),
    (["eval_data=/nope/e.jsonl"], "data file /nope/e.jsonl does not exist"),
    (["rollout.env=arithmetc"], "unknown environment 'arithmetc': not a built-in (arithmetic, geo3k, single_turn), a "
                                "module or a .py file; did you mean 'arithmetic'?"),
    (["rollout.env=/nope/env.py"], "environment file /nope/env.py does not exist"),
    (["rollout.env=~/nobuild.py"], "~/nobuild.py has no build_env(sample, config) function"),
    (["rollout.env=~/syntax.py"], "environment file ~/syntax.py: syntax error at ~/syntax.py:1"),
    (["rollout.env=~/badimport.py"], "an import inside it failed: No module named 'nonexistent_module_xyz'"),
    (["reward.function=nope"], "reward 'nope': expected one of"),
    (["reward.function=/nope/r.py:f"], "reward file /nope/r.py does not exist"),
    (["reward.function=~/rew.py:reward"], "~/rew.py has no attribute 'reward'; it defines other"),
    (["model=no-such-model"], "unknown model 'no-such-model'"),
    (["model=org/not-cached-model"], "model 'org/not-cached-model' is not in the local Hugging Face cache"),
    (["model=~/nomodel"], "model directory ~/nomodel has no config.json"),
    (["rollout.agent=tool_agent", "rollout.tools=[/nope/t.py]"], "tool file /nope/t.py does not exist"),
    (["rollout.agent=tool_agent", "rollout.tools=[t.txt]"], "rollout.tools: expected .py function-tool files"),
    (["rollout.agent=tool_agent", "rollout.tools=[~/tools.py]", "rollout.tool_parser=nope"],
     "unknown tool-call parser 'nope'; registered: hermes, qwen3_coder"),
    (["rollout.agent=tool_agent", "rollout.tools=[~/tools.py]", "rollout.tool_agent={bogus: 1}"],
     "rollout.tool_agent: unknown option(s) ['bogus']"),
    (["rollout.agents=[/nope/a.py:fn]"], "agent file /nope/a.py does not exist"),
    (["rollout.agents=[~/rew.py:missing]"], "~/rew.py has no attribute 'missing'"),
    (["rollout.agent=nope"], "unknown default agent 'nope'"),
    (["rollout.scheduler=nope"], "unknown scheduler 'nope'"),
    (["rollout.plugins=[/nope/p.py]"], "plugin file /nope/p.py does not exist"),
    (["rollout.custom_config=/nope/c.yaml"], "custom config /nope/c.yaml does not exist"),
    (["engine.kind=http"], "engine.urls is required for engine.kind='http'"),
    (["engine.kind=http", "engine.urls=[http://127.0.0.1:9]"],  # a dead engine: at start-up, not per trajectory
     "engine.urls: no answer from http://127.0.0.1:9 (ConnectError"),
]


def _check(result, message: str, tmp_path) -> None:
    output = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert output.startswith("error: ") and message.replace("~", str(tmp_path)) in output, result.output
    assert "Traceback" not in result.output and "\n\n" not in result.output.strip()  # one paragraph


@pytest.mark.parametrize(("args", "message"), TRAIN_CASES, ids=[" ".join(a) for a, _ in TRAIN_CASES])
def test_train_bad_input_is_one_paragraph_naming_the_field_or_file(files, args, message):
    args = [a.replace("~", str(files)) for a in args]
    config = args.pop(0) if args[0].endswith(".yaml") and "=" not in args[0] else str(files / "cfg.yaml")
    start = time.perf_counter()
    result = runner.invoke(app, ["train", config.replace("MISSING", str(files / "MISSING")), *args])
    _check(result, message, files)
    assert time.perf_counter() - start < 10  # before any weights load (a dead engine: one connect)


ROLLOUT_CASES = [
    (["--data", "/nope/d.jsonl"], "data file /nope/d.jsonl does not exist"),
    (["--data", "~/badjson.jsonl"], "~/badjson.jsonl line 3: invalid JSON (Expecting property name enclosed in "
                                    "double quotes at column 18)"),
    (["--data", "~/noprompt.jsonl"], "~/noprompt.jsonl row 2: missing field 'prompt'"),
    (["--env", "nope_env"], "unknown environment 'nope_env'"),
    (["--env", "~/syntax.py"], "environment file ~/syntax.py: syntax error at ~/syntax.py:1"),
    (["--model", "org/not-cached"], "model 'org/not-cached' is not in the local Hugging Face cache"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--agent", "tool_agent", "--tools", "/nope/t.py"], "tool file /nope/t.py does not exist"),
    (["--agent", "tool_agent", "--tools", "~/tools.py", "--tool-parser", "nope"], "unknown tool-call parser 'nope'"),
    (["--agent-path", "/nope/a.py:fn"], "agent file /nope/a.py does not exist"),
    (["--reward", "nope"], "reward 'nope': expected one of"),
    (["--chat-template-kwargs", "{bad"], "--chat-template-kwargs: invalid JSON (Expecting property name enclosed in "
                                         "double quotes at column 2)"),
    (["--plugin", "/nope/p.py"], "plugin file /nope/p.py does not exist"),
    (["--scheduler", "nope"], "unknown scheduler 'nope'"),
    (["--env-timeout", "-1"], "--env-timeout: Input should be greater than 0 (got -1.0)"),
    (["--env-retries", "-1"], "--env-retries: Input should be greater than or equal to 0"),
    (["--watchdog", "-5"], "--watchdog: Input should be greater than 0 (got -5.0)"),
    (["--sanity-check", "bogus"], "--sanity-check: Input should be 'strict', 'ignore_strippable' or 'disable'"),
    (["--sanity-check-every", "0"], "--sanity-check-every: Input should be greater than or equal to 1"),
]


@pytest.mark.parametrize(("args", "message"), ROLLOUT_CASES, ids=[" ".join(a) for a, _ in ROLLOUT_CASES])
def test_rollout_bad_input_is_one_paragraph_naming_the_flag_or_file(files, args, message):
    base = {"--model": "tiny-qwen3", "--env": "single_turn", "--data": str(files / "data.jsonl"),
            "--out": str(files / "o.jsonl")}
    extra = []
    for k in range(0, len(args), 2):
        flag, value = args[k], args[k + 1].replace("~", str(files))
        if flag in base:
            base[flag] = value
        else:
            extra += [flag, value]
    if "--agent" in extra:
        del base["--env"]
    result = runner.invoke(app, ["rollout", *[x for kv in base.items() for x in kv], *extra])
    _check(result, message, files)


def test_the_traceback_shows_only_with_verbose(files):
    cli = ["rollout", "--model", "tiny-qwen3", "--env", "nope_env", "--data", str(files / "data.jsonl"),
           "--out", str(files / "o.jsonl")]
    quiet, verbose = runner.invoke(app, cli), runner.invoke(app, [*cli, "-v"])
    assert quiet.exit_code == verbose.exit_code == 2
    assert "Traceback" not in quiet.output and "Traceback" in verbose.output
    assert "unknown environment 'nope_env'" in " ".join(verbose.output.split())


HANGING_ENV = '''import time

from turnrl.types import StepResult, TerminationReason

ATTEMPTS = {}


class Env:  # token-aware (step_turn): it sees the random model's length-cut turns too
    def __init__(self, sample):
        self.sample = sample

    def step_turn(self, turn):
        key = self.sample["id"]
        ATTEMPTS[key] = ATTEMPTS.get(key, 0) + 1
        if self.sample["mode"] == "flaky" and ATTEMPTS[key] == 1:
            raise RuntimeError("transient failure")
        if self.sample["mode"] == "hang":
            time.sleep(3600)
        return StepResult(reward=1.0, done=True, termination_reason=TerminationReason.ENV_DONE)


def build_env(sample, config):
    return Env(sample)
'''


def test_env_timeout_and_retries_flags_and_the_watchdog_flag(files):
    (files / "hang_env.py").write_text(HANGING_ENV)
    rows = [{"id": "f", "prompt": "hi", "mode": "flaky"}, {"id": "h", "prompt": "hi", "mode": "hang"}]
    (files / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cli = ["rollout", "--model", "tiny-qwen3", "--env", str(files / "hang_env.py"), "--data", str(files / "rows.jsonl"),
           "--max-turns", "1", "--max-new-tokens", "4", "--sanity-check", "disable"]
    result = runner.invoke(app, [*cli, "--out", str(files / "o.jsonl"), "--env-timeout", "0.5", "--env-retries", "1"])
    assert result.exit_code == 0, result.output
    by_id = {r["id"]: r for r in map(json.loads, (files / "o.jsonl").read_text().splitlines())}
    assert (by_id["f-0"]["status"], by_id["f-0"]["turns"][0]["env"]["attempts"]) == ("completed", 2)
    assert (by_id["h-0"]["status"], by_id["h-0"]["termination_reason"]) == ("failed", "timeout")
    assert "env_timeout_s=0.5" in by_id["h-0"]["error"]

    start = time.perf_counter()  # no env limit: the watchdog ends the run, naming the env
    result = runner.invoke(app, [*cli, "--out", str(files / "o2.jsonl"), "--env-timeout", "0", "--watchdog", "1"])
    output = " ".join(result.output.split())
    assert result.exit_code == 1 and time.perf_counter() - start < 30, result.output
    assert "error: Stalled: no progress for 1 s: 1 trajectory waiting on env.step (" in output, result.output
    assert ".Env, oldest 1 s)" in output  # the env class, and how long it has been stuck


def test_a_hub_id_with_the_hub_unreachable_fails_fast_in_one_line(monkeypatch):
    from huggingface_hub import constants

    from turnrl.models import resolve_model

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"model 'org/not-cached' is not in the local Hugging Face cache and "
                                         r"http://127.0.0.1:9 cannot be reached \(ConnectError"):
        resolve_model("org/not-cached")
    assert time.perf_counter() - start < 6  # transformers retried for ~30-50 s, then printed a traceback


async def test_a_failed_trajectory_logs_one_line_and_its_traceback_only_at_info(qwen3_tokenizer, caplog):
    async def broken_agent(ctx, sample):
        raise RuntimeError("agent bug\nwith a second line")

    engine = ScriptedEngine(qwen3_tokenizer, lambda *a: "x")
    manager = RolloutManager(engine, ChatRenderer(qwen3_tokenizer), agents={"broken": broken_agent},
                             default_agent="broken")
    with caplog.at_level(logging.INFO, logger="turnrl.rollout"):
        await run_groups(manager, [{"prompt": "hi"}], n=2)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [re.sub(r"\.py:\d+", ".py:N", r.getMessage()) for r in warnings] == [  # where it was raised, first
        f"trajectory 0-{k} failed (env_error): RuntimeError: agent bug with a second line [at test_cli_errors.py:N "
        "in broken_agent: raise RuntimeError(\"agent bug\\nwith a second line\"); called from manager.py:N in "
        "_run_one]" for k in (0, 1)]
    assert all(r.exc_info is None for r in warnings)
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 2 and all(r.exc_info is not None for r in infos)  # shown with -v


def test_the_start_up_check_names_only_the_dead_replica(qwen3_tokenizer):
    from turnrl.engines import check_servers
    from turnrl.engines.base import EngineError
    from turnrl.engines.http import HttpEngine
    from turnrl.engines.router import Router
    from turnrl.serve.app import ServerThread, create_app
    from turnrl.serve.sessions import ChatProxy

    engine = ScriptedEngine(qwen3_tokenizer, lambda *a: "ok")
    server = ServerThread(create_app(engine, ChatProxy(engine, ChatRenderer(qwen3_tokenizer))))
    live = server.start()
    try:
        check_servers(HttpEngine(live))  # alive: no error
        with pytest.raises(EngineError) as dead:
            check_servers(Router({"a": HttpEngine(live), "b": HttpEngine("http://127.0.0.1:9")}))
        assert str(dead.value).startswith("engine.urls: no answer from http://127.0.0.1:9 (ConnectError")
        assert live not in str(dead.value)
    finally:
        server.stop()
