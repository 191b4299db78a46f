"""slime-style interaction envs through the public CLI: attribute-style sample and args, a sibling package import in
slime's `examples.` layout, and the custom-config YAML's max_turns / rollout_interaction_env_path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fakes import script_the_cli
from typer.testing import CliRunner

from turnrl.cli import app
from turnrl.compat.slime import Args, Sample, extract_answer, grade_answer_verl
from turnrl.config import ConfigError, RolloutConfig, effective_rollout_config

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent

# A slime-style repo: examples/<recipe>/{__init__,base_env,env}.py, the env importing its base by package path and
# reading `sample.label` / `args.max_turns`, the YAML naming the env by module. Written from slime's docs (an env
# exposes build_env(sample, args); reset, step(text) -> (obs, done, info), format_observation(obs) -> message).
# The package name is unique to this file so sys.modules holds no other `examples` package.
BASE_ENV = '''
class BaseInteractionEnv:
    def reset(self):
        raise NotImplementedError

    def step(self, response_text):
        raise NotImplementedError

    def close(self):
        pass

    def format_observation(self, observation):
        parts = [{"type": "image", "image": im} for im in (observation or {}).get("images", [])]
        parts.append({"type": "text", "text": (observation or {}).get("obs_str", "")})
        return {"role": "user", "content": parts}
'''
ENV = '''
import json
import re

from slimerepo_c13.checker.base_env import BaseInteractionEnv
from turnrl.compat.slime import Sample, grade_answer_verl
from turnrl.compat.slime import extract_answer as extract_boxed_answer

CALL = re.compile(r"<tool_call>\\s*(\\{.*?\\})\\s*</tool_call>", re.DOTALL)


class CheckerEnv(BaseInteractionEnv):
    """Checks a candidate answer; done only when it is right (the turn limit is the rollout's)."""

    def __init__(self, ground_truth, max_turns):
        self.ground_truth, self.max_turns, self.turn = ground_truth, max_turns, 0

    def reset(self):
        self.turn = 0
        return {}, {"ground_truth_available": self.ground_truth is not None}

    def step(self, response_text):
        self.turn += 1
        found = CALL.findall(response_text)
        if not found:
            answer = extract_boxed_answer(response_text)
            return {"obs_str": "Use the tool."}, False, {"answer": answer}
        answer = str(json.loads(found[-1])["arguments"]["answer"])
        if grade_answer_verl("\\\\boxed{" + answer + "}", self.ground_truth):
            return {"obs_str": "correct"}, True, {"reward": 1.0, "turn": self.turn}
        return {"obs_str": f"{answer} is wrong, turn {self.turn} of {self.max_turns}"}, False, {"turn": self.turn}


def build_env(sample: Sample | None = None, args=None, **_):
    if args.max_turns is None:
        raise ValueError("max_turns must be set via --custom-config-path")
    if sample.metadata.get("expect_label") is not None and sample.label != sample.metadata["expect_label"]:
        raise ValueError(f"label {sample.label!r} != {sample.metadata['expect_label']!r}")
    return CheckerEnv(ground_truth=sample.label, max_turns=args.max_turns)
'''


def slime_repo(root: Path, max_turns: int = 3) -> Path:
    package = root / "slimerepo_c13"
    for path, text in {
        package / "__init__.py": "",
        package / "checker" / "__init__.py": "",
        package / "checker" / "base_env.py": BASE_ENV,
        package / "checker" / "env_checker.py": ENV,
    }.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    config = package / "checker" / "config.yaml"
    config.write_text(f"max_turns: {max_turns}\nrollout_interaction_env_path: slimerepo_c13.checker.env_checker\n")
    return config


ROWS = [
    {"id": "label", "prompt": "What is 2+2?", "label": "4", "metadata": {"expect_label": "4"}},
    {"id": "answer", "prompt": "What is 3+4?", "answer": "7", "metadata": {"expect_label": "7"}},
]


def call(answer: str) -> str:
    return f'Let me check. <tool_call>{{"name": "calc_score", "arguments": {{"answer": "{answer}"}}}}</tool_call>'


def script(request_id, turn, prompt):
    """Row `label` always answers 5 (wrong); row `answer` is wrong once, then right."""
    if request_id.startswith("label"):
        return call("5")
    return call("6") if turn == 1 else call("7")


def run_cli(tmp_path, *extra):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--data", str(data), "--out", str(out),
                                 "--n", "2", "--max-new-tokens", "64", *extra])
    assert result.exit_code == 0, result.output
    return {t["id"]: t for t in map(json.loads, out.read_text().splitlines())}


def test_slime_env_with_attribute_sample_and_args_and_yaml_turn_limit(tmp_path, monkeypatch, qwen3_tokenizer):
    config = slime_repo(tmp_path, max_turns=3)
    monkeypatch.chdir(tmp_path)  # slime's layout: run from the repo root, the env imports `slimerepo_c13.checker.*`
    engines = script_the_cli(monkeypatch, qwen3_tokenizer, script)
    trajs = run_cli(tmp_path, "--custom-config", str(config))  # no --env, no --max-turns: both from the YAML
    assert sorted(trajs) == ["answer-0", "answer-1", "label-0", "label-1"]
    for k in (0, 1):
        wrong, right = trajs[f"label-{k}"], trajs[f"answer-{k}"]
        assert wrong["error"] is None and right["error"] is None
        # the YAML's max_turns is the driver's limit: the env never says done on a wrong answer
        assert (wrong["status"], wrong["termination_reason"], wrong["num_turns"]) == ("completed", "max_turns", 3)
        # the label came from the `answer` column (no `label` column) and the env ended on the right answer
        assert (right["termination_reason"], right["num_turns"], right["turn_rewards"]) == ("env_done", 2, [1.0])
        # observations given as text parts render as the text: a full re-render differs in Qwen3's empty
        # <think> blocks at most, never in content
        assert wrong["info"].get("render_check", {"strippable": True})["strippable"], wrong["info"]
        assert [m["content"] for m in wrong["messages"] if m["role"] == "user"][1:] == [
            "5 is wrong, turn 1 of 3", "5 is wrong, turn 2 of 3"]
    assert len(engines[0].calls) == 2 * 3 + 2 * 2


def test_max_turns_flag_beats_the_yaml(tmp_path, monkeypatch, qwen3_tokenizer):
    config = slime_repo(tmp_path, max_turns=3)
    monkeypatch.chdir(tmp_path)
    script_the_cli(monkeypatch, qwen3_tokenizer, script)
    trajs = run_cli(tmp_path, "--custom-config", str(config), "--max-turns", "2")
    assert {t["num_turns"] for t in trajs.values()} == {2}
    assert trajs["label-0"]["termination_reason"] == "max_turns"
    # the env still sees the YAML's value (it is the env config, as slime's args would be)
    assert "turn 1 of 3" in trajs["label-0"]["messages"][-2]["content"]


def test_console_script_imports_the_yaml_env_module_from_the_current_directory(tmp_path):
    """`.venv/bin/turnrl` (no `python -m`: the current directory is not on sys.path) finds slime's dotted env
    module in the repo it runs from, through the YAML alone."""
    config = slime_repo(tmp_path)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "out.jsonl"
    script = Path(sys.executable).parent / "turnrl"
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.run([str(script), "rollout", "--model", "tiny-qwen3", "--data", str(data), "--out", str(out),
                           "--custom-config", str(config.relative_to(tmp_path)), "--max-new-tokens", "4"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trajs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(trajs) == 2 and all(t["error"] is None and t["status"] != "failed" for t in trajs), trajs


def test_an_env_error_names_the_missing_args_key(tmp_path, monkeypatch, qwen3_tokenizer):
    env = tmp_path / "needs_key.py"
    env.write_text("def build_env(sample, args):\n    return args.rollout_max_response_len\n")
    script_the_cli(monkeypatch, qwen3_tokenizer, script)
    trajs = run_cli(tmp_path, "--env", str(env))
    error = trajs["label-0"]["error"]
    assert trajs["label-0"]["status"] == "failed" and "args has no 'rollout_max_response_len'" in error
    assert "--custom-config YAML" in error and "max_turns" in error


# ---- the pieces ----------------------------------------------------------------------------------------
# slime's --custom-rm-path contract (slime/rollout/rm_hub: `await rm_function(args, sample, **kwargs)`, batched
# `(args, samples)`), written as slime's examples/search-r1 and retool reward functions are: they read
# sample.prompt + sample.response, sample.label, and check the type.
SLIME_RM = '''
import json
from pathlib import Path

from turnrl.compat.slime import Sample

SEEN = Path(__file__).with_name("seen.jsonl")


async def reward_func(args, sample, **kwargs):
    if not isinstance(sample, Sample):
        raise TypeError("Sample must be an instance of Sample class.")
    with SEEN.open("a") as f:
        f.write(json.dumps({"id": sample.session_id, "prompt": sample.prompt, "response": sample.response,
                            "label": sample.label, "status": sample.status.value, "tokens": len(sample.tokens),
                            "response_length": sample.response_length, "metadata": sample.metadata,
                            "custom_rm_path": args.custom_rm_path, "partial_rollout": args.partial_rollout}) + "\\n")
    return float(f'"answer": "{sample.label}"' in sample.response)


def batched_reward(args, samples, **kwargs):
    return [float(s.label in s.response) for s in samples]
'''


def test_a_slime_reward_function_gets_args_and_the_finished_sample(tmp_path, monkeypatch, qwen3_tokenizer):
    config = slime_repo(tmp_path, max_turns=3)
    (tmp_path / "slime_rm.py").write_text(textwrap.dedent(SLIME_RM))
    monkeypatch.chdir(tmp_path)
    script_the_cli(monkeypatch, qwen3_tokenizer, script)
    trajs = run_cli(tmp_path, "--custom-config", str(config), "--reward", "slime_rm.py:reward_func")
    seen = {r["id"]: r for r in map(json.loads, (tmp_path / "seen.jsonl").read_text().splitlines())}
    assert sorted(seen) == sorted(trajs)
    # row `label` answered 5 three times (label 4); row `answer` answered 6, then 7 (its label, from `answer`)
    assert {k: t["reward"] for k, t in trajs.items()} == {"label-0": 0.0, "label-1": 0.0, "answer-0": 1.0,
                                                          "answer-1": 1.0}
    wrong, right = seen["label-0"], seen["answer-0"]
    assert (wrong["label"], right["label"]) == ("4", "7")
    # the prompt as text with the chat template applied, the response all of it after the prompt: every model
    # turn and the env's feedback between them (special tokens dropped), as slime's sample.response holds it
    assert right["prompt"].startswith("<|im_start|>user\nWhat is 3+4?") and right["prompt"].endswith(
        "<|im_start|>assistant\n")
    assert right["response"].count("<tool_call>") == 2 and "6 is wrong, turn 1 of 3" in right["response"]
    assert "<|im_end|>" not in right["response"]
    traj = trajs["answer-0"]
    assert (right["tokens"], right["response_length"]) == (len(traj["prompt_ids"]) + len(traj["response_ids"]),
                                                           len(traj["response_ids"]))
    assert (right["status"], right["metadata"]) == ("completed", {"expect_label": "7"})
    assert (right["custom_rm_path"], right["partial_rollout"]) == ("slime_rm.py:reward_func", False)


def test_a_batched_slime_reward_function_and_slimes_label_key(tmp_path, monkeypatch, qwen3_tokenizer):
    config = slime_repo(tmp_path, max_turns=2)
    config.write_text(config.read_text() + "label_key: expected\n")  # slime's --label-key, in the custom config
    (tmp_path / "slime_rm.py").write_text(textwrap.dedent(SLIME_RM))
    monkeypatch.chdir(tmp_path)
    script_the_cli(monkeypatch, qwen3_tokenizer, script)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"id": "label", "prompt": "What is 2+3?", "expected": "5"}) + "\n")  # answers 5
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--data", str(data), "--out", str(out),
                                 "--custom-config", str(config), "--max-new-tokens", "64",
                                 "--reward", "slime_rm.py:batched_reward"])
    assert result.exit_code == 0, result.output
    [traj] = map(json.loads, out.read_text().splitlines())
    assert (traj["reward"], traj["reward_error"]) == (1.0, None)  # the env's label_key reached sample.label


def test_sample_reads_like_a_row_and_like_slimes_sample():
    row = {"prompt": "q", "answer": "7", "metadata": {"k": 1}, "id": "r"}
    sample = Sample.from_row(row)
    assert (sample.prompt, sample.label, sample.metadata, sample["answer"], sample.get("id")) == ("q", "7", {"k": 1},
                                                                                                   "7", "r")
    assert (sample.response, sample.reward, sample.status, sample.index) == ("", None, Sample.Status.PENDING, None)
    assert Sample.from_row({**row, "label": "L"}).label == "L"
    assert Sample.from_row({**row, "gt": "G"}, label_key="gt").label == "G"
    with pytest.raises(KeyError, match="label_key 'nope'"):
        Sample.from_row(row, label_key="nope")
    bare = Sample(prompt="p", label="x")  # by keyword, as slime builds one
    bare.metadata["seen"] = True  # a default that sticks once used
    bare.reward = 1.0
    assert (bare.label, bare.metadata, bare["reward"], bare.tokens) == ("x", {"seen": True}, 1.0, [])
    assert Sample({"messages": [{"role": "user", "content": "m"}]}).prompt == [{"role": "user", "content": "m"}]
    with pytest.raises(AttributeError, match="Sample has no field 'lable'"):
        _ = sample.lable
    assert json.loads(json.dumps(sample)) == row  # still a plain row for JSON and dict code
    args = Args({"max_turns": 3})
    assert (args.max_turns, args["max_turns"], args.get("nope", 0)) == (3, 3, 0)
    with pytest.raises(AttributeError, match="args has no 'nope'"):
        _ = args.nope


@pytest.mark.parametrize(("solution", "truth", "expected"), [
    ("so \\boxed{4}", "4", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{5}", "4", False),
    ("4", "4", False),  # no boxed answer: slime's grader says no
    ("\\boxed{4}", "\\boxed{4}", True),
    ("\\boxed{4}", "", False),
])
def test_grade_answer_verl(solution, truth, expected):
    assert grade_answer_verl(solution, truth) is expected


def test_extract_answer():
    assert extract_answer("a \\boxed{1} then \\boxed{x^{2}}") == "x^{2}"
    assert extract_answer("no box") is None


def test_effective_config_prefers_what_was_set():
    custom = {"max_turns": 3, "rollout_interaction_env_path": "pkg.env", "k": 1}
    plain = effective_rollout_config(RolloutConfig(), custom)
    assert (plain.max_turns, plain.env, plain.env_config) == (3, "pkg.env", {"max_turns": 3, "k": 1})
    assert effective_rollout_config(plain, {}) == plain  # applying it again changes nothing
    flags = effective_rollout_config(RolloutConfig(max_turns=5, env="arithmetic"), custom)
    assert (flags.max_turns, flags.env) == (5, "arithmetic")
    tools = effective_rollout_config(RolloutConfig(tools=["t.yaml"]), {})
    assert tools.agent == "tool_agent"
    chosen = effective_rollout_config(RolloutConfig(tools=["t.yaml"], agent="env_agent", env="x"), {})
    assert chosen.agent == "env_agent"
    with pytest.raises(ConfigError, match="max_turns"):
        effective_rollout_config(RolloutConfig(), {"max_turns": 0})
