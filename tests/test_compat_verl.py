"""verl-style tools and rows through the public CLI: a BaseTool subclass with instance ids and a pydantic schema,
loaded from a verl tool-config YAML, on rows as verl's preprocessing scripts write them (JSONL and parquet), with no
--agent and no extra flag; the tool's reward; the first error of a trajectory kept."""

from __future__ import annotations

import copy
import json
import sys
import textwrap
from pathlib import Path

import pytest
from fakes import script_the_cli
from typer.testing import CliRunner

from turnrl.cli import app
from turnrl.compat.verl import (
    BaseTool,
    OpenAIFunctionToolSchema,
    ToolResponse,
    geo3k,
    gsm8k,
    rollout_trace_op,
)
from turnrl.observe.tracing import collect_spans
from turnrl.tools import ToolSet
from turnrl.types import ToolCall

runner = CliRunner()

# Written from verl's docs on BaseTool: one object serves every trajectory, state lives per instance id; create
# gets the row's create_kwargs. `submit_answer` takes them as keywords (verl's SGLang path), `check_guess` as
# `create_kwargs=` (verl's agent loop). The package name is unique to this file (sys.modules).
TOOLS = '''
from typing import Any, Optional
from uuid import uuid4

from turnrl.compat.verl import BaseTool, OpenAIFunctionToolSchema, ToolResponse, rollout_trace_op
from turnrl.compat.verl import gsm8k

EVENTS = []


class SubmitAnswer(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self.state = {}
        EVENTS.append(("init", self.name, config["penalty"]))

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs):
        instance_id = instance_id or f"sub-{uuid4().hex[:8]}"
        self.state[instance_id] = {"truth": ground_truth, "answer": "", "best": 0.0}
        EVENTS.append(("create", instance_id))
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        state = self.state[instance_id]
        state["answer"] = f"#### {parameters['answer']}"
        reward = await self.calc_reward(instance_id)
        step = 0.0 if reward > state["best"] else -self.config["penalty"]
        state["best"] = max(state["best"], reward)
        arg = next(iter(self.tool_schema.function.parameters.properties))
        return ToolResponse(text=f"{self.tool_schema.function.name} got {arg}={parameters[arg]}"), step, {"n": 1}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self.state[instance_id]
        return gsm8k.compute_score(state["answer"], state["truth"], method="flexible")

    async def release(self, instance_id: str, **kwargs) -> None:
        EVENTS.append(("release", instance_id))
        del self.state[instance_id]


class CheckGuess(BaseTool):
    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.targets = {}

    async def create(self, instance_id=None, **kwargs):
        instance_id = "guess-" + uuid4().hex[:6]
        self.targets[instance_id] = kwargs["create_kwargs"]["target"]
        return instance_id  # a bare id, as older verl tools return

    def execute(self, instance_id, parameters, **kwargs):  # a sync method is fine too
        higher = int(parameters["guess"]) < self.targets[instance_id]
        return ToolResponse(text="higher" if higher else "not higher"), 0.0, {}
'''
TOOL_CONFIG = '''
tools:
  - class_name: "verlrepo_c13.tools.SubmitAnswer"
    config:
      type: native
      penalty: 0.05
    tool_schema:
      type: "function"
      function:
        name: "submit_answer"
        description: "Score the answer to the math problem (1.0 if correct)."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The final answer, digits only"
          required: ["answer"]
  - class_name: "verlrepo_c13.tools.CheckGuess"
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: check_guess
        description: Whether the target is higher than a guess.
        parameters: {type: object, properties: {guess: {type: string}}, required: [guess]}
'''
SYSTEM = "Solve it step by step, call `submit_answer` at least once, then answer as `#### <answer>`."


def verl_row(index: int, question: str, truth: str, tools_kwargs: dict) -> dict:
    """A row as verl's gsm8k tool-agent preprocessing script writes it."""
    return {
        "data_source": "openai/gsm8k", "agent_name": "tool_agent",
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": index, "answer": f"... #### {truth}", "question": question,
                       "need_tools_kwargs": True, "tools_kwargs": tools_kwargs,
                       "interaction_kwargs": {"query": question, "ground_truth": truth}},
    }


ROWS = [
    verl_row(0, "Natalia sold 48 clips in April and half as many in May. How many in total?", "72",
             {"submit_answer": {"create_kwargs": {"ground_truth": "72"}},
              "check_guess": {"create_kwargs": {"target": 9}}}),
    verl_row(1, "What is 5 + 5?", "10", {"submit_answer": {"create_kwargs": {"ground_truth": "10"}}}),
]


def tool_call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def script(request_id, turn, prompt):
    """Both rows answer 72: right for row 0, wrong (then not improved) for row 1."""
    return {1: "Half of 48 is 24; 48 + 24 = 72. " + tool_call("submit_answer", answer="72"),
            2: tool_call("submit_answer", answer="72")}.get(turn, "So the answer is #### 72")


@pytest.fixture
def verl_repo(tmp_path, monkeypatch):
    package = tmp_path / "verlrepo_c13"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tools.py").write_text(textwrap.dedent(TOOLS))
    (tmp_path / "tool_config.yaml").write_text(textwrap.dedent(TOOL_CONFIG))
    (tmp_path / "reward.py").write_text("def reward(tool_rewards):\n    return tool_rewards['submit_answer']\n")
    monkeypatch.chdir(tmp_path)  # verl names tool classes by module: the repo is the current directory
    yield tmp_path
    sys.modules.pop("verlrepo_c13.tools", None)
    sys.modules.pop("verlrepo_c13", None)


def write_rows(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)  # struct columns: row 1 gets check_guess = None
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rollout(tmp_path, data: Path, *extra) -> list[dict]:
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--data", str(data), "--out", str(out),
                                 "--tools", "tool_config.yaml", "--max-turns", "4", "--max-new-tokens", "96", *extra])
    assert result.exit_code == 0, result.output
    return sorted(map(json.loads, out.read_text().splitlines()), key=lambda t: t["id"])


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_verl_rows_and_tool_give_the_tool_reward_with_no_extra_flag(verl_repo, monkeypatch, qwen3_tokenizer, suffix):
    script_the_cli(monkeypatch, qwen3_tokenizer, script)
    data = write_rows(verl_repo / f"train{suffix}", ROWS)
    right, wrong = rollout(verl_repo, data, "--n", "2", "--reward", "reward.py:reward")[::2]
    for traj in (right, wrong):  # the row's agent_name picked the tool agent; nobody passed --agent
        assert (traj["agent"], traj["status"], traj["termination_reason"], traj["num_turns"]) == (
            "tool_agent", "completed", "no_tool_call", 3)
        assert traj["error"] is None and traj["warnings"] == []
        tool_messages = [m["content"] for m in traj["messages"] if m["role"] == "tool"]
        assert tool_messages == ["submit_answer got answer=72"] * 2
    # extra_info.tools_kwargs reached create: the ground truth decides the reward (verl's gsm8k compute_score)
    assert (right["tool_rewards"], right["reward"]) == ({"submit_answer": 1.0}, 1.0)
    assert (wrong["tool_rewards"], wrong["reward"]) == ({"submit_answer": 0.0}, 0.0)
    # execute's step rewards: no penalty for the first correct submission, -penalty for one that did not improve
    assert right["turn_rewards"] == [0.0, -0.05] and wrong["turn_rewards"] == [-0.05, -0.05]
    # rollout_trace_op recorded execute under the tool call, with its inputs and outputs
    call = right["turns"][0]["env"]["info"]["tool_calls"][0]
    assert call["metrics"] == {"n": 1}
    [span] = call["spans"]
    assert span["name"] == "SubmitAnswer.execute" and span["inputs"]["parameters"] == {"answer": "72"}
    assert span["outputs"][0]["text"] == "submit_answer got answer=72" and span["end_ns"] >= span["start_ns"]
    # one tool object per process; per trajectory: one instance id, created before its first call, released once
    events = sys.modules["verlrepo_c13.tools"].EVENTS
    assert [e for e in events if e[0] == "init"] == [("init", "submit_answer", 0.05)]
    created = [e[1] for e in events if e[0] == "create"]
    assert len(created) == len(set(created)) == 4 and sorted(created) == sorted(e[1] for e in events
                                                                                  if e[0] == "release")


def test_a_verl_tool_with_create_kwargs_and_a_sync_execute(verl_repo, monkeypatch, qwen3_tokenizer):
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: tool_call("check_guess", guess="3")
                   if turn == 1 else "done")
    trajs = rollout(verl_repo, write_rows(verl_repo / "rows.jsonl", ROWS[:1]))
    assert [m["content"] for m in trajs[0]["messages"] if m["role"] == "tool"] == ["higher"]
    assert trajs[0]["tool_rewards"] == {"check_guess": 0.0}


VERL_SCORE = '''
from turnrl.compat.verl import gsm8k


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "openai/gsm8k" and extra_info["split"] == "train"
    return gsm8k.compute_score(solution_str, ground_truth)
'''


def test_a_verl_reward_function_is_called_with_verls_arguments(verl_repo, monkeypatch, qwen3_tokenizer):
    (verl_repo / "verl_score.py").write_text(textwrap.dedent(VERL_SCORE))
    script_the_cli(monkeypatch, qwen3_tokenizer, script)
    trajs = rollout(verl_repo, write_rows(verl_repo / "rows.jsonl", ROWS), "--reward", "verl_score.py:compute_score")
    # solution_str ends with the final reply ("So the answer is #### 72"), ground_truth is the row's
    # reward_model.ground_truth
    assert [(t["id"], t["reward"], t["reward_error"]) for t in trajs] == [("0-0", 1.0, None), ("1-0", 0.0, None)]


# verl's examples/sglang_multiturn/gsm8k_toolcall_shaping/gsm8k_toolcall_shaping.py (its compute_score, import
# changed), and verl-recipe retool/retool.py's use of extra_info["num_turns"]; the extra_info keys verl's reward
# managers add (verl/workers/reward_manager/naive.py) are recorded.
VERL_SHAPING = '''
import json
from pathlib import Path
from typing import Any, Optional

from turnrl.compat.verl.gsm8k import compute_score as gsm8k_compute_score


def toolcall_shaping_reward(data_source: Optional[str], solution_str: str, ground_truth: str,
                            extra_info: Optional[dict[str, Any]] = None, *, method: str = "strict",
                            format_score: float = 0.1, score: float = 1.0, shaping_reward: float = 0.1,
                            trigger_substring: str = "<tool_call>", **kwargs) -> float:
    base = gsm8k_compute_score(solution_str, ground_truth, method, format_score, score)
    bonus = shaping_reward if (trigger_substring and trigger_substring in solution_str) else 0.0
    return float(base + bonus)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    with Path(__file__).with_name("seen.jsonl").open("a") as f:
        f.write(json.dumps({"solution_str": solution_str, "extra_info": extra_info}) + "\\n")
    shaped = toolcall_shaping_reward(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                                     extra_info=extra_info)
    return shaped - (extra_info["num_turns"] - 2) / 2 * 0.1  # retool's use of num_turns, sign flipped
'''


def test_verl_reward_functions_get_the_whole_response_and_verls_extra_info(verl_repo, monkeypatch, qwen3_tokenizer):
    (verl_repo / "shaping.py").write_text(textwrap.dedent(VERL_SHAPING))
    script_the_cli(monkeypatch, qwen3_tokenizer, script)
    [traj] = rollout(verl_repo, write_rows(verl_repo / "rows.jsonl", ROWS[:1]), "--reward", "shaping.py:compute_score")
    [seen] = map(json.loads, (verl_repo / "seen.jsonl").read_text().splitlines())
    # solution_str: the response tokens decoded as verl's reward manager decodes them (skip_special_tokens=True):
    # every model turn and the tool responses between them, so the shaping bonus sees the model's <tool_call>
    assert seen["solution_str"] == qwen3_tokenizer.decode(traj["response_ids"], skip_special_tokens=True)
    assert seen["solution_str"].count("<tool_call>") == 2 and "submit_answer got answer=72" in seen["solution_str"]
    assert seen["solution_str"].endswith("So the answer is #### 72")
    # extra_info: the row's, plus verl's num_turns (prompt + 3 model turns + 2 tool responses, as verl's
    # ToolAgentLoop counts user_turns + assistant_turns + 1) and rollout_reward_scores (calc_reward by tool)
    assert seen["extra_info"]["split"] == "train" and seen["extra_info"]["index"] == 0
    assert (seen["extra_info"]["num_turns"], seen["extra_info"]["rollout_reward_scores"]) == (6, {"submit_answer": 1.0})
    assert traj["reward"] == pytest.approx(1.0 + 0.1 - 0.2)
    assert "num_turns" not in traj["sample"]["extra_info"]  # the row itself is unchanged


def test_verl_counts_a_single_reply_as_two_turns(tmp_path, qwen3_tokenizer):
    from turnrl.compat.verl import reward_arguments
    from turnrl.types import Segment, SegmentSource, Trajectory

    reply = qwen3_tokenizer("#### 3<|im_end|>")["input_ids"]
    traj = Trajectory("t", "g", 0, [1, 2], [Segment(SegmentSource.MODEL, reply, [1] * len(reply), [-0.1] * len(reply), 1)],
                      num_turns=1, sample={"reward_model": {"ground_truth": "3"}})
    names = reward_arguments(traj, qwen3_tokenizer)
    assert names == {"solution_str": "#### 3", "ground_truth": "3",
                     "extra_info": {"num_turns": 2, "rollout_reward_scores": {}}}
    # every tool's calc_reward value, as returned (verl's SearchTool: a list), is in rollout_reward_scores
    traj.tool_rewards, traj.info["tool_reward_values"] = {"check": 1.0}, {"search": ["doc"]}
    assert reward_arguments(traj)["extra_info"]["rollout_reward_scores"] == {"check": 1.0, "search": ["doc"]}
    assert "solution_str" not in reward_arguments(traj)  # no tokenizer: no decoded response


# The shape of verl's own verl/tools/search_tool.py (and sandbox_fusion_tools.py, mcp_base_tool.py): the instance's
# "reward" is a list the tool appends its results to, and calc_reward returns that list; verl never scores it.
SEARCH = '''
from uuid import uuid4

from turnrl.compat.verl import BaseTool, ToolResponse


class SearchTool(BaseTool):
    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    async def create(self, instance_id=None, **kwargs):
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": kwargs.get("ground_truth"), "reward": []}
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        result_text = f"Doc 1(Title: {parameters['query']}) Paris is the capital of France."
        self._instance_dict[instance_id]["reward"].append(result_text.strip())
        return ToolResponse(text=result_text), 0.0, {"status": "success"}

    async def calc_reward(self, instance_id: str, **kwargs) -> str:
        return self._instance_dict[instance_id]["reward"]

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
'''
SEARCH_CONFIG = '''
tools:
  - class_name: search_tool.py:SearchTool
    config: {type: native}
    tool_schema: {type: function, function: {name: search, description: Search the web.,
                  parameters: {type: object, properties: {query: {type: string}}, required: [query]}}}
'''


def test_a_verl_tool_whose_calc_reward_returns_a_list_does_not_fail_the_trajectory(tmp_path, monkeypatch,
                                                                                   qwen3_tokenizer):
    (tmp_path / "search_tool.py").write_text(textwrap.dedent(SEARCH))
    (tmp_path / "tools.yaml").write_text(textwrap.dedent(SEARCH_CONFIG))
    (tmp_path / "reward.py").write_text("def reward(response, tool_rewards):\n"
                                        "    return float('Paris' in response) + sum(tool_rewards.values())\n")
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: tool_call("search", query="France")
                   if turn == 1 else "Paris")
    data = write_rows(tmp_path / "rows.jsonl", [{"prompt": "Capital of France?", "agent_name": "tool_agent"}])
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--data", str(data), "--out", str(out),
                                 "--tools", str(tmp_path / "tools.yaml"), "--max-new-tokens", "32",
                                 "--reward", str(tmp_path / "reward.py") + ":reward"])
    assert result.exit_code == 0, result.output
    [traj] = map(json.loads, out.read_text().splitlines())
    assert (traj["status"], traj["error"], traj["reward"]) == ("completed", None, 1.0), traj["error"]
    # the list is no reward: kept as the tool returned it, and said so
    assert traj["tool_rewards"] == {}
    assert traj["info"]["tool_reward_values"] == {"search": ["Doc 1(Title: France) Paris is the capital of France."]}
    [warning] = traj["warnings"]
    assert "calc_reward() of tool(s) 'search' returned no number (list)" in warning


async def test_calc_reward_values_split_into_rewards_and_the_rest():
    from turnrl.tools import split_tool_rewards

    assert split_tool_rewards({"a": 1, "b": True, "c": 0.5, "d": [1.0], "e": None}) == (
        {"a": 1.0, "b": 1.0, "c": 0.5}, {"d": [1.0], "e": None})


FLAKY = '''
from turnrl.compat.verl import BaseTool, ToolResponse


class Flaky(BaseTool):
    calls = 0

    async def execute(self, instance_id, parameters, **kwargs):
        Flaky.calls += 1
        if Flaky.calls == 1:
            raise RuntimeError("backend down")
        return ToolResponse(text="ok"), "high", {}  # a bug: the step reward is not a number

    async def release(self, instance_id, **kwargs):
        raise RuntimeError("cleanup failed")
'''
FLAKY_CONFIG = '''
tools:
  - class_name: flaky_tool.py:Flaky
    tool_schema: {type: function, function: {name: flaky, description: x, parameters: {type: object, properties: {}}}}
'''


def test_the_first_error_of_a_trajectory_is_kept(tmp_path, monkeypatch, qwen3_tokenizer):
    (tmp_path / "flaky_tool.py").write_text(textwrap.dedent(FLAKY))
    (tmp_path / "tools.yaml").write_text(textwrap.dedent(FLAKY_CONFIG))
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: tool_call("flaky"))
    data = write_rows(tmp_path / "rows.jsonl", [{"prompt": "go", "agent_name": "tool_agent"}])
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--data", str(data), "--out", str(out),
                                 "--tools", str(tmp_path / "tools.yaml"), "--max-new-tokens", "32"])
    assert result.exit_code == 0, result.output
    [traj] = map(json.loads, out.read_text().splitlines())
    # the first execute raised: the model was told, the episode went on
    first = next(m for m in traj["messages"] if m["role"] == "tool")
    assert first["content"] == "Error: tool 'flaky' raised RuntimeError: backend down"
    # the second returned a malformed result: the trajectory failed with that error, and the release that
    # failed afterwards is recorded after it, not over it
    assert (traj["status"], traj["termination_reason"]) == ("failed", "env_error")
    assert "reward 'high'" in traj["error"] and "cleanup failed" not in traj["error"]
    assert len(traj["warnings"]) == 1 and "release() failed" in traj["warnings"][0]
    assert "cleanup failed" in traj["warnings"][0]


# ---- the pieces ------------------------------------------------------------------------------------------
class Echo(BaseTool):
    """No tool_schema in a config: the class gives it."""

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
            "name": "echo", "description": "Echo.", "parameters": {"type": "object", "properties": {
                "items": {"type": "array", "items": {"type": "string"}}}, "required": ["items"]}}})

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=",".join(parameters["items"]), image=["img.png"]), 0.5, {}


async def test_a_verl_class_added_directly_keeps_its_schema_and_images():
    toolset = ToolSet([Echo])
    assert toolset.schemas[0]["function"]["parameters"]["properties"]["items"] == {"type": "array",
                                                                                   "items": {"type": "string"}}
    async with toolset.session() as session:
        result = await session.call(ToolCall(name="echo", arguments={"items": ["a", "b"]}, id="1"))
    assert (result.text, result.images, result.reward) == ("a,b", ["img.png"], 0.5)
    with pytest.raises(ValueError, match="ToolResponse.image must be a list"):
        ToolResponse(image="one.png")
    with pytest.raises(ValueError, match="no tool schema"):
        BaseTool({}, None)


async def test_rollout_trace_op_records_only_while_collecting():
    @rollout_trace_op
    async def op(x):
        return x * 2

    assert await op(2) == 4
    with collect_spans() as spans:
        await op(3)
    assert [(s["name"].rsplit(".", 1)[-1], s["inputs"], s["outputs"]) for s in spans] == [("op", {"x": 3}, 6)]


@pytest.mark.parametrize(("text", "truth", "method", "expected"), [
    ("so #### 72", "72", "strict", 1.0),
    ("so 72", "72", "strict", 0),  # no `#### n`: no answer
    ("#### 1,234", "1234", "strict", 1.0),  # strict drops the commas
    ("answer 72", "72", "flexible", 1.0),
    ("72 then 7.", "72", "flexible", 0.0),  # the last number counts
    ("the total is 72.", "72", "flexible", 0.0),  # "72." as written, as verl compares it
    ("1,234", "1234", "flexible", 0.0),  # flexible keeps the commas
])
def test_gsm8k_scores_as_verls(text, truth, method, expected):
    assert gsm8k.compute_score(text, truth, method=method) == expected


def test_geo3k_score():
    assert geo3k.compute_score("<think>r</think> \\boxed{3}", "3") == pytest.approx(1.0)
    assert geo3k.compute_score("\\boxed{3}", "3") == pytest.approx(0.9)
    assert geo3k.compute_score("<think>r</think> \\boxed{4}", "3") == pytest.approx(0.1)


# ---- interactions ----------------------------------------------------------------------------------------
# verl/interactions/gsm8k_interaction.py (imports changed) and its interaction-config YAML
# (examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml, class_name pointing here).
GSM8K_INTERACTION = '''
from typing import Any, Optional
from uuid import uuid4

from turnrl.compat.verl import BaseInteraction, gsm8k

LIVE = {}


class Gsm8kInteraction(BaseInteraction):
    def __init__(self, config: dict):
        super().__init__(config)
        self._instance_dict = LIVE

    async def start_interaction(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                                **kwargs) -> str:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs
                                ) -> tuple[bool, str, float, dict]:
        content = ""
        for i in range(len(messages) - 1, -1, -1):
            item = messages[i]
            if item.get("role") == "assistant":
                content = item.get("content")
                break
        self._instance_dict[instance_id]["response"] = content
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            response = "Your response is correct!"
            should_terminate_sequence = True
        else:
            response = "Your response is incorrect! You need to reflect on your answer and try again."
            should_terminate_sequence = False
        return should_terminate_sequence, response, reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        return gsm8k.compute_score(self._instance_dict[instance_id]["response"],
                                   self._instance_dict[instance_id]["ground_truth"], method="strict",
                                   format_score=0.0, score=1.0)

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
'''
INTERACTION_CONFIG = '''
interaction:
  - name: "gsm8k"
    class_name: "verlrepo_i13.gsm8k_interaction.Gsm8kInteraction"
    config: {}
'''


def test_a_verl_interaction_runs_with_its_config_yaml_on_verls_rows(tmp_path, monkeypatch, qwen3_tokenizer):
    package = tmp_path / "verlrepo_i13"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "gsm8k_interaction.py").write_text(textwrap.dedent(GSM8K_INTERACTION))
    (tmp_path / "interaction_config.yaml").write_text(textwrap.dedent(INTERACTION_CONFIG))
    monkeypatch.chdir(tmp_path)
    script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: "#### 5" if turn == 1 else "#### 72")
    rows = copy.deepcopy(ROWS)
    for row in rows:  # as gsm8k_multiturn_w_interaction.py writes them: no agent_name, the interaction's name
        del row["agent_name"]
        row["extra_info"]["interaction_kwargs"]["name"] = "gsm8k"
    out = tmp_path / "out.jsonl"
    data = write_rows(tmp_path / "rows.jsonl", rows)
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--data", str(data), "--out", str(out), "--env", "turnrl.compat.verl.interaction", "--custom-config",
                                 "interaction_config.yaml", "--max-turns", "3", "--max-new-tokens", "16",
                                 "--reward", "env_last"])
    assert result.exit_code == 0, result.output
    right, wrong = sorted(map(json.loads, out.read_text().splitlines()), key=lambda t: t["id"])
    # row 0 (72): wrong, told so, then right: the interaction ends it; row 1 (10) never gets it right
    assert (right["termination_reason"], right["turn_rewards"], right["reward"]) == ("env_done", [0.0, 1.0], 1.0), \
        right["error"]
    assert [m["content"] for m in right["messages"] if m["role"] == "user"][1:] == [
        "Your response is incorrect! You need to reflect on your answer and try again."]
    assert (wrong["termination_reason"], wrong["turn_rewards"], wrong["reward"]) == ("max_turns", [0.0] * 3, 0.0)
    # start_interaction got the row's interaction_kwargs; finalize_interaction released every instance
    assert sys.modules["verlrepo_i13.gsm8k_interaction"].LIVE == {}


def test_an_interaction_config_is_built_once_when_first_trajectories_race(tmp_path, monkeypatch):
    """verl builds each interaction once per process; env factories run on threads, so the first trajectories of a
    batch ask for the map at once (two copies would split a stateful interaction's `_instance_dict`)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from turnrl.compat.verl.interaction import interaction_map

    (tmp_path / "slow_interaction_s35.py").write_text(textwrap.dedent('''
        import time
        from turnrl.compat.verl import BaseInteraction
        BUILT = []
        class SlowInteraction(BaseInteraction):
            def __init__(self, config):
                super().__init__(config)
                time.sleep(0.05)
                BUILT.append(self)
    '''))
    entries = [{"name": "slow", "class_name": f"{tmp_path}/slow_interaction_s35.py:SlowInteraction", "config": {}}]
    start = threading.Barrier(4)

    def first(_):
        start.wait()
        return interaction_map(entries)["slow"]

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(first, range(4)))
    assert len({id(g) for g in got}) == 1
    assert len(sys.modules[type(got[0]).__module__].BUILT) == 1
