"""turnrl.rewards: the built-in graders' ground truth (slime's `label`, verl's `reward_model.ground_truth`,
reward.answer_key) and the calling convention's checks."""

from __future__ import annotations

import json

import pytest
from fakes import script_the_cli
from typer.testing import CliRunner

from turnrl.cli import app
from turnrl.rewards import load_reward_fn, reference_answer
from turnrl.types import Trajectory


def finished(reply: str, row: dict) -> Trajectory:
    return Trajectory("t", "g", 0, [1], messages=[{"role": "user", "content": "q"},
                                                  {"role": "assistant", "content": reply}], sample=row)


@pytest.mark.parametrize(("row", "answer_key", "expected"), [
    ({"answer": "4", "label": "5"}, None, "4"),  # turnrl's column first
    ({"label": "5"}, None, "5"),  # slime's key (--label-key label)
    ({"reward_model": {"ground_truth": "6"}}, None, "6"),  # verl's rows
    ({"answer": "4", "gt": "7"}, "gt", "7"),  # reward.answer_key, when given, wins
    ({"answer": "4"}, "answer", "4"),  # the default is no override
])
def test_reference_answer(row, answer_key, expected):
    assert reference_answer(row, answer_key) == expected


def test_reference_answer_errors_name_the_columns():
    with pytest.raises(KeyError, match=r"no ground truth in the row.*\['question'\].*--answer-key"):
        reference_answer({"question": "q"})
    with pytest.raises(KeyError, match=r"reward.answer_key 'gt': the row has no such column"):
        reference_answer({"answer": "4"}, "gt")


def test_math_grades_a_slime_row_with_a_label_column():
    math = load_reward_fn("math")
    assert math(finished("so \\boxed{12}", {"label": "12"})) == 1.0
    assert math(finished("so \\boxed{13}", {"label": "12"})) == 0.0
    assert load_reward_fn("math", answer_key="gt")(finished("\\boxed{2}", {"answer": "1", "gt": "2"})) == 1.0


def test_rollout_answer_key_flag_and_the_custom_configs_label_key(tmp_path, monkeypatch, qwen3_tokenizer):
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: "\\boxed{12}")
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "3*4?", "answer": "0", "truth": "12"}) + "\n")
    config = tmp_path / "custom.yaml"
    config.write_text("label_key: truth\n")  # slime's --label-key, as the env reads it
    runs = {"flag": ["--answer-key", "truth"], "config": ["--custom-config", str(config)], "neither": []}
    for name, extra in runs.items():
        out = tmp_path / f"{name}.jsonl"
        result = CliRunner().invoke(app, ["rollout", "--model", "tiny-qwen3", "--data", str(data), "--out", str(out),
                                          "--agent", "single_turn", "--max-new-tokens", "16", "--reward", "math",
                                          *extra])
        assert result.exit_code == 0, result.output
        [traj] = map(json.loads, out.read_text().splitlines())
        assert (name, traj["reward"]) == (name, 0.0 if name == "neither" else 1.0)
