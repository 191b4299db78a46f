"""`turnrl rollout` end to end on tiny-qwen3, and the errors a user sees for bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fakes import script_the_cli
from typer.testing import CliRunner

from turnrl.cli import app
from turnrl.types import Trajectory

runner = CliRunner()
def _documented_fields() -> set[str]:
    """The field names of docs/trajectory-format.md's Fields table (so the docs cannot drift from the writer)."""
    text = (Path(__file__).parent.parent / "docs" / "trajectory-format.md").read_text()
    table = text.split("## Fields", 1)[1].split("###", 1)[0]
    return set(re.findall(r"^\| `(\w+)` \|", table, flags=re.M))


DOCUMENTED_FIELDS = _documented_fields()
OPTIONAL_FIELDS = {"routed_experts"}  # written only when recorded (rollout.router_replay: record)


def _data(tmp_path, rows):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rollout_writes_documented_jsonl(tmp_path):
    data = _data(tmp_path, [{"id": "q1", "prompt": "What is 2 + 3?", "answer": 5},
                            {"id": "q2", "prompt": [{"role": "user", "content": "What is 4 - 1?"}], "answer": 3}])
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--env", "arithmetic", "--data", str(data),
                                 "--n", "2", "--max-turns", "2", "--max-new-tokens", "8", "--out", str(out),
                                 "--seed", "1", "--reward", "env", "--sanity-check", "ignore_strippable"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and all(DOCUMENTED_FIELDS - OPTIONAL_FIELDS <= set(r) <= DOCUMENTED_FIELDS for r in rows)
    assert sorted(r["id"] for r in rows) == ["q1-0", "q1-1", "q2-0", "q2-1"]
    for row in rows:
        traj = Trajectory.from_json(row)
        traj.validate()
        assert traj.response_ids == row["response_ids"] and row["reward"] is not None
        assert row["num_turns"] >= 1 and row["status"] in ("completed", "truncated")
    assert "rollout summary" in result.output or "rollout of tiny-qwen3" in result.output


def test_same_seed_same_trajectories(tmp_path):
    data = _data(tmp_path, [{"id": "q", "prompt": "Say hi.", "answer": 1}])
    outs = []
    for k in range(2):
        out = tmp_path / f"o{k}.jsonl"
        result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--env", "single_turn", "--data", str(data),
                                     "--n", "3", "--max-new-tokens", "6", "--out", str(out), "--seed", "7"])
        assert result.exit_code == 0, result.output
        outs.append(sorted((r["id"], tuple(r["response_ids"])) for r in map(json.loads, out.read_text().splitlines())))
    assert outs[0] == outs[1]


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--env", "/nonexistent/env.py"], "environment file /nonexistent/env.py does not exist"),
    (["--env", "ENVFILE_WITHOUT_BUILD_ENV"], "has no build_env(sample, config) function"),
])
def test_clear_errors(tmp_path, args, message):
    data = _data(tmp_path, [{"prompt": "hi"}])
    no_build = tmp_path / "nobuild.py"
    no_build.write_text("class Env:\n    pass\n")
    args = [str(no_build) if a == "ENVFILE_WITHOUT_BUILD_ENV" else a for a in args]
    base = {"--model": "tiny-qwen3", "--env": "single_turn"}
    for k in range(0, len(args), 2):
        base[args[k]] = args[k + 1]
    cli = ["rollout", "--data", str(data), "--out", str(tmp_path / "o.jsonl")]
    for k, v in base.items():
        cli += [k, v]
    result = runner.invoke(app, cli)
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


@pytest.mark.parametrize(("content", "message"), [
    ('{"prompt": "ok"}\n{"question": "no prompt"}\n', "row 2: missing field 'prompt'"),
    ('{"prompt": "ok"}\n{not json\n', "line 2: invalid JSON"),
    ('{"prompt": "ok"}\n\n{"prompt": "x",}\n', "line 3: invalid JSON (Expecting property name enclosed in double "
                                               "quotes at column 16)"),  # the row's line and column, not the file's
    ('{"prompt": [{"role": "robot", "content": "x"}]}\n', "row 1: prompt[0] must be a message with 'role'"),
    ('{"prompt": "<image> what?", "images": []}\n', "row 1: the prompt has 1 '<image>' placeholders but 'images' has 0"),
    ('{"prompt": "<image> and <image>", "images": ["a.png"]}\n', "2 '<image>' placeholders but 'images' has 1"),
])
def test_malformed_rows_name_row_and_field(tmp_path, content, message):
    data = tmp_path / "bad.jsonl"
    data.write_text(content)
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--env", "single_turn", "--data", str(data),
                                 "--out", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_output_into_a_file_is_one_line_per_line(tmp_path):
    """Logs and console lines written to a file or a pipe are never wrapped at 80 columns (RichHandler's table
    did, mid-word); in a terminal they keep Rich's layout."""
    import subprocess
    import sys

    code = ("import logging; from turnrl.cli import _setup_logging, console; _setup_logging(False); "
            "logging.getLogger('turnrl.x').warning('warned ' + 'w' * 150); console.print('printed ' + 'p' * 150)")
    with open(tmp_path / "out.log", "w") as f:
        subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, check=True, timeout=120)
    lines = (tmp_path / "out.log").read_text().splitlines()
    [warned] = [x for x in lines if "warned" in x]
    assert warned.endswith("warned " + "w" * 150) and " WARNING " in warned  # time, level, message: one line
    assert "printed " + "p" * 150 in lines


def test_a_run_that_cannot_start_says_why_in_one_line_and_leaves_no_run_behind(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    data = _data(tmp_path, [{"prompt": "hi", "answer": 1}])
    config = tmp_path / "c.yaml"
    config.write_text(f"model: no-org/no-such-model\ntrain_data: {data}\noutput_dir: {tmp_path / 'runs'}\n"
                      "rollout: {env: single_turn}\n")
    result = runner.invoke(app, ["train", str(config)])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "model 'no-org/no-such-model' is not in the local Hugging Face cache" in said, said
    assert "run directory" not in said
    assert list((tmp_path / "runs").iterdir()) == []  # no empty run directory, no link to one


def test_qwen3s_empty_think_block_is_a_known_harmless_difference_not_a_warning(tmp_path):
    """tiny-qwen3 on arithmetic: a full render adds Qwen3's empty <think> block to the last assistant turn. Before,
    every trajectory counted as a render mismatch, with a warning on the first command a user runs."""
    import turnrl.rollout.episode as rollout_module

    rollout_module._EXPLAINED.clear()
    data = _data(tmp_path, [{"id": f"q{i}", "prompt": f"What is {i} + 3?", "answer": i + 3} for i in range(4)])
    out = tmp_path / "out.jsonl"
    args = ["rollout", "--model", "tiny-qwen3", "--env", "arithmetic", "--data", str(data), "--n", "2",
            "--max-turns", "1", "--max-new-tokens", "8", "--out", str(out), "--seed", "1", "--reward", "env"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "WARNING" not in result.output and "re-render" not in result.output
    assert re.search(r"render difference, known harmless\s*│\s*8", result.output) and "render mismatch" not in result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["metrics"]["render_harmless"] == 1.0 and r["metrics"]["render_mismatch"] == 0.0 for r in rows)
    rollout_module._EXPLAINED.clear()
    verbose = " ".join(runner.invoke(app, [*args, "-v"]).output.split())  # -v: explained once, at info
    assert verbose.count("known to be harmless for this template (reasoning") == 1
    assert "first differing tokens, at stream position" in verbose and "'<think>\\n\\n</think>\\n\\n" in verbose


BAD_ENV = '''
def parse(text):
    return int(text.split()[0])


class Bad:
    def step(self, response_text):
        return parse(response_text), True, {}


def build_env(sample, config):
    return Bad()
'''


def test_an_env_that_raises_leaves_its_last_frames_in_the_error_and_its_traceback_at_v(tmp_path, monkeypatch,
                                                                                     qwen3_tokenizer):
    (tmp_path / "bad_env.py").write_text(BAD_ENV)
    data = _data(tmp_path, [{"id": "q0", "prompt": "hi"}])
    out = tmp_path / "out.jsonl"
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: "hello")
    args = ["rollout", "--model", "tiny-qwen3", "--env", str(tmp_path / "bad_env.py"), "--data", str(data),
            "--max-turns", "1", "--max-new-tokens", "8", "--out", str(out)]
    quiet = runner.invoke(app, args)
    assert quiet.exit_code == 0, quiet.output
    [row] = map(json.loads, out.read_text().splitlines())
    assert (row["status"], row["termination_reason"]) == ("failed", "env_error")
    # before: "ValueError: invalid literal for int() with base 10: 'hello'" and nothing more, anywhere
    assert row["error"].startswith("ValueError: invalid literal for int() with base 10: 'hello' [at bad_env.py:3 "
                                   "in parse: return int(text.split()[0]); called from bad_env.py:8 in step; ")
    assert "Traceback" not in quiet.output and "bad_env.py:3 in parse" in quiet.output  # the one-line warning
    verbose = runner.invoke(app, [*args, "-v"]).output
    assert "Traceback (most recent call last)" in verbose and f'File "{tmp_path / "bad_env.py"}", line 3' in verbose


@pytest.mark.parametrize(("content", "args", "message"), [
    ("", ["--index", "4"], "--index 4: {path} has 4 trajectories, so --index must be in 0..3"),
    ("", ["--index", "-1"], "--index -1: {path} has 4 trajectories, so --index must be in 0..3"),
    ("", ["--index", "9", "--html", "page.html"], "--index 9: {path} has 4 trajectories"),
    ('{"prompt": "What is 2 + 3?"}\n', [], "{path} line 1 is not a trajectory (no id, status, prompt_ids"),
    ("not json\n", [], "{path} line 1 is not JSON (Expecting value); expected trajectory JSONL"),
])
def test_view_of_a_bad_index_or_a_file_that_is_not_trajectories_is_one_line(tmp_path, content, args, message):
    path = tmp_path / "t.jsonl"
    path.write_text(content or (Path(__file__).parent / "data" / "trajectories_v1.jsonl").read_text())
    result = runner.invoke(app, ["view", str(path), *args])
    assert result.exit_code == 2 and "Traceback" not in result.output  # a traceback before
    assert message.format(path=path) in " ".join(result.output.split())


def test_training_whose_groups_all_tie_says_that_it_has_stalled(tmp_path):
    # A policy that stopped exploring (the calculator recipe's seed 0: from step 14 every group's 8 samples made the
    # same call) trains nothing; the log said only "no trainable samples", step after step.
    data = _data(tmp_path, [{"id": f"r{i}", "prompt": f"Say {i}.", "answer": "zebra"} for i in range(2)])
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({
        "model": "tiny-qwen3", "train_data": str(data), "output_dir": str(tmp_path / "runs"), "steps": 4,
        "prompts_per_step": 2, "rollout": {"env": "single_turn", "n": 2, "max_new_tokens": 2},
        "reward": {"function": "math"}}))
    result = runner.invoke(app, ["train", str(config), "-v"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "no trainable samples (every group's rewards equal)" in text
    assert text.count("steps 1-3: in every group all samples got the same reward, so every advantage was 0 and "
                      "nothing trained") == 1  # once per stall, not every step


def test_training_with_groups_of_one_says_at_start_up_that_nothing_will_train(tmp_path):
    data = _data(tmp_path, [{"id": f"r{i}", "prompt": f"Say {i}."} for i in range(2)])
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({
        "model": "tiny-qwen3", "train_data": str(data), "output_dir": str(tmp_path / "runs"), "steps": 1,
        "prompts_per_step": 2, "rollout": {"env": "single_turn", "n": 1, "max_new_tokens": 4},
        "reward": {"function": "env"}}))
    result = runner.invoke(app, ["train", str(config)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    warning = text.index("warning: rollout.n=1: each group has one sample, so every group-relative advantage "
                         "(algo.advantage=grpo) is 0")  # nothing was said before
    assert warning < text.index("run directory:")  # at start-up, before the model loads
    assert "n=1" not in " ".join(runner.invoke(app, ["train", str(config), "rollout.n=2"]).output.split())
