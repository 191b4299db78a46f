"""The recipes' data generators write what their READMEs promise."""

from __future__ import annotations

from pathlib import Path

from turnrl.loading import load_module

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_every_generated_gsm8k_problem_has_a_non_negative_integer_answer():
    gsm8k = load_module(str(EXAMPLES / "gsm8k_tools" / "prepare_data.py"), what="gsm8k data")
    rows = [row for seed in range(5) for row in gsm8k.generated_rows(400, seed)]
    answers = [row["answer"] for row in rows]
    assert all(a.isdigit() for a in answers), [a for a in answers if not a.isdigit()][:5]
    assert all(row["tools_kwargs"]["check_answer"]["create_kwargs"]["ground_truth"] == row["answer"] for row in rows)


def test_gsm8k_demonstrations_call_the_calculator_per_annotation_with_its_real_output(tmp_path):
    import asyncio

    import pyarrow as pa
    import pyarrow.parquet as pq

    from turnrl.tools import ToolSet, calculator
    from turnrl.types import ToolCall

    gsm8k = load_module(str(EXAMPLES / "gsm8k_tools" / "prepare_data.py"), what="gsm8k data")
    answer = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
              "altogether in April and May.\n#### 72")
    pq.write_table(pa.table({"question": ["How many clips?"], "answer": [answer]}), tmp_path / "train-0.parquet")
    [row] = gsm8k.gsm8k_rows(tmp_path / "train-0.parquet", None)
    assert row["calculations"] == [["48/2", "24"], ["48+24", "72"]]
    demo = gsm8k.demonstration(row)
    roles = [m["role"] for m in demo["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert demo["messages"][-1]["content"].endswith("#### 72")
    session = ToolSet([calculator]).session({})
    for call_msg, result in zip(demo["messages"][2:6:2], demo["messages"][3:7:2], strict=True):
        expression = call_msg["content"].split('"expression": "')[1].split('"')[0]
        real = asyncio.run(session.call(ToolCall("calculator", {"expression": expression}, "c"), timeout_s=5))
        assert result["content"] == real.text  # what the RL tool agent would put in the stream


def test_calculator_agent_data(tmp_path):
    import json

    calc = load_module(str(EXAMPLES / "calculator_agent" / "prepare_data.py"), what="calculator data")
    calc_reward = load_module(str(EXAMPLES / "calculator_agent" / "reward.py"), what="reward").calculator_reward
    import sys

    argv, sys.argv = sys.argv, ["prepare_data.py", "--out", str(tmp_path), "--sft", "40", "--train", "30",
                                "--eval", "12"]
    try:
        calc.main()
    finally:
        sys.argv = argv
    read = {n: [json.loads(x) for x in (tmp_path / f"{n}.jsonl").read_text().splitlines()] for n in ("sft", "train", "eval")}
    assert [len(read[n]) for n in ("sft", "train", "eval")] == [40, 30, 12]
    questions = [[r["messages"][1]["content"] for r in read["sft"]], *[[r["prompt"][1]["content"] for r in read[n]]
                                                                      for n in ("train", "eval")]]
    assert sum(len(q) for q in questions) == len({x for q in questions for x in q})  # no problem in two files
    assert {r["kind"] for r in read["sft"]} == {"one_step", "demo_two_step"}
    assert {r["kind"] for r in read["eval"]} == {"one_step", "two_step"}
    for r in read["sft"]:  # the demonstrated expression gives the answer the demonstration states
        call = json.loads(r["messages"][2]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert eval(call["arguments"]["expression"]) == int(r["messages"][3]["content"])  # noqa: S307
        assert calc_reward(r["messages"][4]["content"], int(r["messages"][3]["content"])) == 1.0
    assert calc_reward("The answer is 1,776.", 1776) == 1.0 and calc_reward("It is 1776 or 12.", 1776) == 0.0
