"""geo3k: the synthetic data generator, the dataset loader, the env's behaviour table and its reward."""

from __future__ import annotations

import base64
import io
import json
import random
import threading
from pathlib import Path

import pytest
from PIL import Image

from turnrl.envs.geo3k import (
    LAST_CHANCE_WARNING,
    TOOL_NAMES,
    answers_match,
    build_env,
    geo3k_reward,
    last_boxed,
    tool_call_format,
)
from turnrl.loading import load_module
from turnrl.reasoning import strip_reasoning
from turnrl.types import TerminationReason

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:  # pragma: no cover - pyarrow is in the test extra
    pa = pq = None
# the recipe's data generator lives with the recipe (examples/geo3k_vlm), not in the package
_data = load_module(str(Path(__file__).parent.parent / "examples" / "geo3k_vlm" / "geo3k_data.py"), what="geo3k data")
IMAGE_SIZE, PYTHAGOREAN_TRIPLES, TEMPLATES = _data.IMAGE_SIZE, _data.PYTHAGOREAN_TRIPLES, _data.TEMPLATES
generate_geo3k, load_geo3k, make_problem = _data.generate_geo3k, _data.load_geo3k, _data.make_problem
needs_pyarrow = pytest.mark.skipif(pa is None, reason="pyarrow not installed")


def call(answer: str, name: str = "calc_score") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"answer": "{answer}"}}}}</tool_call>'


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ---- generator -------------------------------------------------------------------------------------


def test_same_seed_gives_identical_rows_and_png_bytes(tmp_path: Path) -> None:
    first = generate_geo3k(tmp_path / "a", n=12, seed=7, split_name="train")
    second = generate_geo3k(tmp_path / "b", n=12, seed=7, split_name="train")
    assert first.read_text() == second.read_text()
    for row in map(json.loads, first.read_text().splitlines()):
        image = row["images"][0]
        assert (tmp_path / "a" / image).read_bytes() == (tmp_path / "b" / image).read_bytes()
    assert make_problem(7, 3) == make_problem(7, 3)


def test_different_seed_gives_different_problems() -> None:
    seed0 = [make_problem(0, i) for i in range(8)]
    seed1 = [make_problem(1, i) for i in range(8)]
    assert [p.png for p in seed0] != [p.png for p in seed1]
    assert [(p.kind, p.answer) for p in seed0] != [(p.kind, p.answer) for p in seed1]
    assert len({p.png for p in seed0}) == 8  # problems within a dataset differ too


def test_rows_follow_the_geo3k_schema(tmp_path: Path) -> None:
    jsonl = generate_geo3k(tmp_path, n=10, seed=0, split_name="test")
    assert jsonl == tmp_path / "test.jsonl"
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"test-{i:05d}" for i in range(10)]
    for row in rows:
        assert set(row) == {"id", "images", "kind", "problem", "answer"}
        assert row["problem"].startswith("<image>") and row["problem"].count("<image>") == 1
        assert len(row["images"]) == 1 and row["images"][0] == f"images/{row['id']}.png"
        with Image.open(tmp_path / row["images"][0]) as image:
            assert (image.format, image.size) == ("PNG", (IMAGE_SIZE, IMAGE_SIZE))
        assert isinstance(row["answer"], str) and row["answer"]
    if pq is not None:
        assert pq.read_table(tmp_path / "test.parquet").to_pylist() == rows


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_every_template_answer_verifies_in_its_natural_forms(kind: str) -> None:
    for seed in range(3):
        problem = TEMPLATES[kind](random.Random(seed))
        assert problem.kind == kind and problem.problem.count("<image>") == 1
        answer = problem.answer
        assert answers_match(answer, answer)
        assert answers_match(f"\\boxed{{{answer}}}", answer)
        assert answers_match(f"${answer}$", answer)
        if answer.endswith("\\pi"):
            coefficient = answer.removesuffix("\\pi")
            for form in (
                f"{coefficient} \\pi",
                f"{coefficient}π",
                f"\\pi \\cdot {coefficient}",
                f"{coefficient}pi",
            ):
                assert answers_match(form, answer), form
        else:
            assert answer.isdigit()
            for form in (
                f"{answer}.0",
                f"{answer}.00",
                f"{answer}^\\circ",
                f"{answer}°",
                f"{answer} \\text{{ cm}}",
            ):
                assert answers_match(form, answer), form
            assert not answers_match(str(int(answer) + 1), answer)


def test_pi_answers_are_exact_so_a_decimal_approximation_is_wrong() -> None:
    # Circle problems ask for the answer "in terms of \pi"; 12\pi = 37.699..., so 37.7 is not it.
    assert answers_match("12\\pi", "12\\pi")
    assert not answers_match("37.7", "12\\pi")
    assert not answers_match("12", "12\\pi")


def test_template_answers_follow_from_their_geometry() -> None:
    hypotenuses = {k * c for _, _, c in PYTHAGOREAN_TRIPLES for k in (1, 2, 3)}
    legs = {k * leg for a, b, _ in PYTHAGOREAN_TRIPLES for leg in (a, b) for k in (1, 2, 3)}
    for index in range(60):
        problem = make_problem(3, index)
        if problem.kind == "right_hypotenuse":
            assert int(problem.answer) in hypotenuses
        elif problem.kind == "right_leg":
            assert int(problem.answer) in legs
        elif problem.kind == "triangle_angle":
            assert 25 <= int(problem.answer) <= 125  # the generator keeps every angle in [25, 125]
        elif problem.kind.startswith("circle"):
            assert problem.answer.endswith("\\pi") and "terms of \\pi" in problem.problem
        elif problem.kind.startswith("square_area"):
            assert int(problem.answer) ** 0.5 == int(int(problem.answer) ** 0.5)


def test_embedded_images_round_trip_through_the_loader(tmp_path: Path) -> None:
    jsonl = generate_geo3k(tmp_path, n=3, seed=5, split_name="val", embed_images=True)
    assert not any((tmp_path / "images").iterdir())
    for index, row in enumerate(load_geo3k(jsonl)):
        assert row["images"][0].startswith("data:image/png;base64,")
        png = base64.b64decode(row["images"][0].split(",", 1)[1])
        assert png == make_problem(5, index).png


# ---- loader ------------------------------------------------------------------------------------------


def test_loader_builds_chat_prompts_from_our_jsonl(tmp_path: Path) -> None:
    jsonl = generate_geo3k(tmp_path, n=4, seed=0, split_name="train")
    rows = load_geo3k(jsonl)
    assert len(rows) == 4
    for row in rows:
        image = str(tmp_path / "images" / f"{row['id']}.png")
        assert row["images"] == [image] and Path(image).is_file()
        text = row["problem"].removeprefix("<image>")
        assert row["prompt"] == [
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}
        ]


def test_image_parts_sit_where_the_placeholders_were(tmp_path: Path) -> None:
    rows = [
        {"id": "r", "images": ["a.png", "b.png"], "problem": "Compare <image> with <image>.", "answer": "1"}
    ]
    (row,) = load_geo3k(write_jsonl(tmp_path / "d.jsonl", rows))
    assert row["prompt"][0]["content"] == [
        {"type": "text", "text": "Compare "},
        {"type": "image", "image": str(tmp_path / "a.png")},
        {"type": "text", "text": " with "},
        {"type": "image", "image": str(tmp_path / "b.png")},
        {"type": "text", "text": "."},
    ]


def test_placeholder_and_image_counts_must_agree(tmp_path: Path) -> None:
    rows = [
        {"id": "ok", "images": ["a.png"], "problem": "<image>Find x.", "answer": "5"},
        {"id": "bad", "images": ["a.png"], "problem": "<image><image>Find x.", "answer": "5"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(
        ValueError, match=r"d\.jsonl row 1: the problem has 2 '<image>' placeholders but 1 images"
    ):
        load_geo3k(path)


def test_missing_column_names_the_file_and_column(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"images": [], "problem": "Find x."}])
    with pytest.raises(ValueError, match=r"d\.jsonl row 0 has no column 'answer'"):
        load_geo3k(path)
    with pytest.raises(ValueError, match=r"must be a \.parquet or \.jsonl file"):
        load_geo3k(tmp_path / "d.csv")


@needs_pyarrow
def test_loader_reads_the_real_geo3k_parquet_layout(tmp_path: Path) -> None:
    # hiyouga/geometry3k: images is a list of {"bytes", "path"} structs; choices/ground_truth ride along.
    png = make_problem(0, 0).png
    table = pa.Table.from_pylist(
        [
            {
                "images": [{"bytes": png, "path": "diagram.png"}],
                "problem": "<image>Find x. Round to the nearest tenth if necessary.",
                "answer": "13",
                "id": 0,
                "choices": ["5", "12", "13", "17"],
                "ground_truth": "C",
            },
            {"images": [{"bytes": None, "path": "on_disk.png"}], "problem": "<image>Find y.", "answer": "2"},
        ]
    )
    pq.write_table(table, tmp_path / "geo3k.parquet")
    first, second = load_geo3k(tmp_path / "geo3k.parquet")
    data_uri = "data:image/png;base64," + base64.b64encode(png).decode()
    assert first["images"] == [data_uri] and first["answer"] == "13" and first["ground_truth"] == "C"
    assert first["prompt"][0]["content"] == [
        {"type": "image", "image": data_uri},
        {"type": "text", "text": "Find x. Round to the nearest tenth if necessary."},
    ]
    assert second["images"] == [str(tmp_path / "on_disk.png")]
    with Image.open(io.BytesIO(base64.b64decode(first["images"][0].split(",", 1)[1]))) as image:
        assert image.size == (IMAGE_SIZE, IMAGE_SIZE)


@needs_pyarrow
def test_parquet_missing_column_names_the_file_and_column(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist([{"images": ["a.png"], "answer": "1"}]), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"x\.parquet has no column 'problem'"):
        load_geo3k(tmp_path / "x.parquet")


# ---- the environment ---------------------------------------------------------------------------------


def make_env(max_turns: int = 3, answer: str = "13"):
    env = build_env({"answer": answer, "problem": "<image>Find x."}, {"max_turns": max_turns})
    env.reset()
    return env


def test_reply_without_a_tool_call_ends_the_episode_with_its_score() -> None:
    result = make_env().step("The hypotenuse is 13. Answer: \\boxed{13}")
    assert result.done and result.termination_reason == TerminationReason.NO_TOOL_CALL
    assert result.reward == 1.0 and result.observation is None
    assert result.info == {
        "turn": 1,
        "tool_calls": [],
        "calc_score_results": [],
        "tool_error": None,
        "final_score": 1.0,
    }


@pytest.mark.parametrize(
    ("reply", "problem"),
    [
        ('<tool_call>{"name": "calc_score", "arguments": {"answer": "13"</tool_call>', "is not valid JSON"),
        ('<tool_call>{"name": "calc_score", "arguments": {"answer": "13"}}', "is not closed"),
        ('<tool_call>["calc_score", "13"]</tool_call>', "must be one JSON object"),
        (call("13", name="search"), "unknown tool 'search'"),
        (call(""), 'no "answer" argument, or it is empty'),
        ('<tool_call>{"name": "calc_score", "arguments": {}}</tool_call>', 'no "answer" argument'),
        ('<tool_call>{"arguments": {"answer": "13"}}</tool_call>', 'the call has no "name"'),
    ],
)
def test_malformed_calls_get_a_corrective_message_with_the_exact_format(reply: str, problem: str) -> None:
    env = make_env()
    result = env.step(reply)
    assert not result.done and result.reward == 0.0
    assert problem in result.observation
    assert result.observation.endswith(
        '<tool_call>{"name": "calc_score", "arguments": {"answer": "<your answer>"}}</tool_call>'
    )
    assert result.info["tool_error"] is not None and result.info["calc_score_results"] == []
    assert LAST_CHANCE_WARNING not in result.observation


def test_correct_candidate_says_it_matches() -> None:
    result = make_env().step("I think x = 13. " + call("13"))
    assert not result.done and result.reward == 0.0
    assert result.observation == (
        "calc_score result: 1. Your answer '13' matches the reference answer. "
        "Stop calling tools and give your final answer in \\boxed{}."
    )
    assert result.info["calc_score_results"] == [1]
    assert result.info["tool_calls"] == [{"name": "calc_score", "arguments": {"answer": "13"}}]
    assert result.info["turn"] == 1


def test_wrong_candidate_says_try_another_way() -> None:
    result = make_env().step(call("12"))
    assert not result.done
    assert result.observation.startswith("calc_score result: 0. Your answer '12' does not match")
    assert "try another way" in result.observation
    assert result.info["calc_score_results"] == [0]


def test_verl_name_function_wrapper_and_string_arguments_are_accepted() -> None:
    env = make_env(max_turns=5)
    assert env.step(call("13", name="calc_geo3k_reward")).info["calc_score_results"] == [1]
    wrapped = '<tool_call>{"function": {"name": "calc_score", "arguments": "{\\"answer\\": 13}"}}</tool_call>'
    assert env.step(wrapped).info["calc_score_results"] == [1]
    assert TOOL_NAMES == ("calc_score", "calc_geo3k_reward")


def test_a_numeric_zero_answer_is_an_answer_not_a_missing_one() -> None:
    result = make_env().step('<tool_call>{"name": "calc_score", "arguments": {"answer": 0}}</tool_call>')
    assert result.info["tool_error"] is None and result.info["calc_score_results"] == [0]


def test_the_last_tool_call_in_a_reply_is_the_one_used() -> None:
    assert make_env().step(call("12") + " no wait " + call("13")).info["calc_score_results"] == [1]
    assert make_env().step(call("13") + " no wait " + call("12")).info["calc_score_results"] == [0]


@pytest.mark.parametrize("max_turns", [2, 3, 4, 5])
def test_last_chance_warning_appears_exactly_on_step_max_turns_minus_1(max_turns: int) -> None:
    env = make_env(max_turns)
    observations = []
    for _ in range(max_turns - 1):
        result = env.step(call("12"))
        assert not result.done
        observations.append(result.observation)
    warned_steps = [t for t, text in enumerate(observations, start=1) if LAST_CHANCE_WARNING in text]
    assert warned_steps == [max_turns - 1]
    assert observations[-1].endswith(LAST_CHANCE_WARNING)


def test_warning_also_follows_correct_and_malformed_feedback() -> None:
    env = make_env(max_turns=2)
    assert env.step(call("13")).observation.endswith(LAST_CHANCE_WARNING)
    env = make_env(max_turns=2)
    assert env.step(call("13", name="nope")).observation.endswith(LAST_CHANCE_WARNING)


def test_tool_call_on_the_last_turn_ends_with_max_turns() -> None:
    env = make_env(max_turns=3)
    env.step(call("12"))
    env.step(call("13") + " Answer: \\boxed{13}")
    result = env.step(call("13") + " Answer: \\boxed{13}")
    assert result.done and result.termination_reason == TerminationReason.MAX_TURNS
    assert result.observation is None and result.reward == 1.0
    assert result.info["turn"] == 3 and result.info["calc_score_results"] == [1]


def test_max_turns_1_ends_on_the_first_tool_call() -> None:
    result = make_env(max_turns=1).step(call("12"))
    assert result.done and result.termination_reason == TerminationReason.MAX_TURNS and result.reward == 0.0


def test_tool_calls_inside_reasoning_are_ignored() -> None:
    reply = "<think>Let me check " + call("12") + " first.</think>The answer is \\boxed{13}."
    result = make_env().step(reply)
    assert (
        result.done and result.termination_reason == TerminationReason.NO_TOOL_CALL and result.reward == 1.0
    )
    # The opening <think> was in the prompt (Qwen3 templates add it): only text after </think> counts.
    result = make_env().step("hmm " + call("12") + "</think>So x is \\boxed{13}.")
    assert result.termination_reason == TerminationReason.NO_TOOL_CALL
    # A call after the reasoning is used.
    result = make_env().step("<think>x is 13</think>" + call("13"))
    assert not result.done and result.info["calc_score_results"] == [1]


def test_strip_reasoning() -> None:
    assert strip_reasoning("<think>a</think>b<think>c</think>d") == "bd"
    assert strip_reasoning("a</think>b") == "b"
    assert strip_reasoning("a<think>unfinished") == "a"


def test_format_observation_is_a_user_message_and_reset_restarts() -> None:
    env = make_env()
    result = env.step(call("12"))
    assert env.format_observation(result.observation) == {"role": "user", "content": result.observation}
    env.reset()
    assert env.step(call("12")).info["turn"] == 1
    env.close()


def test_build_env_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="no 'answer' key"):
        build_env({"problem": "x"}, {"max_turns": 3})
    with pytest.raises(ValueError, match="max_turns must be an int >= 1, got 0"):
        build_env({"answer": "1"}, {"max_turns": 0})
    with pytest.raises(ValueError, match=r"unknown keys \['max_turn'\]"):
        build_env({"answer": "1"}, {"max_turn": 3})
    assert build_env({"answer": 7}, {}).config.max_turns == 3
    env = build_env({"answer": "7"}, {"tool_names": ["check"]})
    env.reset()
    assert env.step(call("7", name="check")).info["calc_score_results"] == [1]
    assert env.step(call("7")).observation.startswith(
        "Your tool call could not be used: unknown tool 'calc_score'"
    )


# ---- reward ------------------------------------------------------------------------------------------


def test_reward_reads_only_the_model_text_never_the_env_feedback() -> None:
    # slime's bug: grading the whole response (model + env feedback) finds the feedback's empty \boxed{}.
    env = make_env()
    first = "x = 13. " + call("13") + " Answer: \\boxed{13}"
    feedback = env.step(first).observation
    assert "\\boxed{}" in feedback
    second = "The tool agrees, so x is 13."
    result = env.step(second)
    assert result.done and result.termination_reason == TerminationReason.NO_TOOL_CALL
    assert result.reward == 1.0
    assert geo3k_reward([first, second], "13") == 1.0
    assert geo3k_reward([first + feedback + second], "13") == 0.0  # what grading env text would give


def test_reward_is_zero_when_the_model_never_boxes() -> None:
    env = make_env()
    env.step(call("13"))
    result = env.step("x is 13")
    assert result.done and result.reward == 0.0
    assert geo3k_reward(["x is 13", "13"], "13") == 0.0


def test_reward_uses_the_last_box() -> None:
    assert geo3k_reward(["\\boxed{12}", "no, \\boxed{13}"], "13") == 1.0
    assert geo3k_reward(["\\boxed{13} then \\boxed{12}"], "13") == 0.0
    assert geo3k_reward(["\\boxed{13}", "\\boxed{}"], "13") == 0.0  # the model's own empty box is its answer
    assert geo3k_reward(["\\boxed{6\\pi}"], "6\\pi") == 1.0
    assert geo3k_reward(["\\fbox{13}"], "13") == 1.0


def test_last_boxed_is_brace_balanced() -> None:
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{3} and \\boxed{\\frac{1}{2") == "3"  # an unclosed last box is incomplete
    assert last_boxed("no box") is None


def test_reward_works_off_the_main_thread() -> None:
    # math-verify's signal-based timeout fails off the main thread; envs may be stepped in a worker.
    scores: list[float] = []
    worker = threading.Thread(target=lambda: scores.append(geo3k_reward(["\\boxed{12\\pi}"], "12\\pi")))
    worker.start()
    worker.join()
    assert scores == [1.0]


def test_tool_call_format_is_the_hermes_json() -> None:
    assert tool_call_format() == (
        '<tool_call>{"name": "calc_score", "arguments": {"answer": "<your answer>"}}</tool_call>'
    )
