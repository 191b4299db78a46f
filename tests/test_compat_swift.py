"""ms-swift-style plugins through the public CLI: a gym env (`Env(env_config)`, `reset(request)`, `step(messages)`)
registered in `envs` whose groups share the map their seed decides, a ReAct tool scheduler that extends the turn's
token ids in place, and `messages` rows."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from fakes import script_the_cli
from typer.testing import CliRunner

from turnrl.cli import app
from turnrl.compat.swift import (
    ChatCompletionResponseChoice,
    MultiTurnScheduler,
    ThinkingModelTipsScheduler,
    multi_turns,
)
from turnrl.data import DataError, prompt_messages
from turnrl.types import FinishReason, SegmentSource, Trajectory, Turn

runner = CliRunner()

# Written from ms-swift's gym_env docs: the env gets the row's env_config (its seed decides the map, so the
# num_generations samples of a row play the same map), reset returns (observation, info, system_message), step
# gets the conversation and returns (observation, reward, done, info).
GYM_PLUGIN = '''
import random
import re
from typing import Any, Dict, Tuple

from turnrl.compat.swift import Env, Messages, RolloutInferRequest, envs, get_logger

logger = get_logger()
MOVE = re.compile(r"<move>(left|right)</move>")


class LineWalk(Env):
    """A line of cells; walk to the treasure."""

    def __init__(self, env_config: Dict[str, Any]):
        super().__init__(env_config)
        self.size = int(env_config.get("size", 7))
        self.seed = env_config.get("seed")

    async def reset(self, config: RolloutInferRequest) -> Tuple[str, Dict[str, Any], str]:
        rng = random.Random(self.seed)
        self.position, self.treasure = rng.sample(range(self.size), 2)
        self.row_id = config.data_dict["id"]
        return self._show(), {"seed": self.seed}, "You walk a line. Answer with <move>left</move> or <move>right</move>."

    def _show(self) -> str:
        return f"You are at {self.position}; the treasure is at {self.treasure}."

    async def step(self, action: Messages) -> Tuple[str, float, bool, Dict[str, Any]]:
        assert action[-1]["role"] == "assistant" and action[0]["role"] == "system"
        found = MOVE.search(action[-1]["content"])
        if found is None:
            return "Say <move>left</move> or <move>right</move>. " + self._show(), 0.0, False, {}
        self.position += 1 if found.group(1) == "right" else -1
        if self.position == self.treasure:
            return "Found it!", 1.0, True, {"status": "goal"}
        return self._show(), 0.0, False, {}

    async def close(self):
        logger.info("closed %s", self.row_id)


envs["line_walk"] = LineWalk
'''


def walker(request_id, turn, prompt):
    """Walks towards the treasure the last observation shows; says nothing useful on its first turn."""
    if turn == 1:
        return "Let me think."
    position, treasure = map(int, re.findall(r"You are at (\d+); the treasure is at (\d+)", prompt)[-1])
    return f"<move>{'right' if treasure > position else 'left'}</move>"


def test_gym_env_groups_share_the_map_their_seed_decides(tmp_path, monkeypatch, qwen3_tokenizer):
    (tmp_path / "gym_plugin.py").write_text(textwrap.dedent(GYM_PLUGIN))
    rows = [{"id": f"s{seed}", "messages": [{"role": "user", "content": "<placeholder>"}], "env_config": {"seed": seed}}
            for seed in (1, 2)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    script_the_cli(monkeypatch, qwen3_tokenizer, walker)
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--data", str(data), "--out", str(out),
                                 "--plugin", str(tmp_path / "gym_plugin.py"), "--scheduler", "gym_scheduler",
                                 "--gym-env", "line_walk", "--n", "3", "--max-turns", "10", "--max-new-tokens", "16",
                                 "--reward", "env"])
    assert result.exit_code == 0, result.output
    trajs = [json.loads(line) for line in out.read_text().splitlines()]
    first_maps = {}
    for traj in trajs:
        assert (traj["status"], traj["termination_reason"], traj["reward"]) == ("completed", "env_done", 1.0), traj
        system, first = traj["messages"][:2]
        assert system["content"].startswith("You walk a line") and first["role"] == "user"
        first_maps.setdefault(traj["group_id"], set()).add(first["content"])
        infos = traj["rollout_infos"]
        assert infos["total_reward"] == 1.0 and infos["gym_done"] is True
        assert infos["step_rewards"] == [0.0] * (infos["num_turns"] - 1) + [1.0]
    # every sample of a group saw the same map; the two seeds gave two maps
    assert {g: len(m) for g, m in first_maps.items()} == {"s1": 1, "s2": 1}
    assert first_maps["s1"] != first_maps["s2"]


# Written from ms-swift's multi-turn docs: a ReAct calculator whose tool output goes into the assistant message,
# masked, with the turn's token ids extended in place (as ms-swift's ToolCallScheduler example does).
CALC_PLUGIN = '''
import re
from typing import Dict

from turnrl.compat.swift import (ChatCompletionResponse, ChatCompletionResponseChoice, MultiTurnScheduler,
                                 RolloutInferRequest, multi_turns)

ACTION = re.compile(r"Action:\\s*(\\w+)\\s*\\nAction Input:\\s*(.*?)(?:\\n|$)")


class ReActCalculator(MultiTurnScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tools = {"calculator": lambda expr: f"Result: {eval(expr, {'__builtins__': {}})}"}

    def check_finished(self, infer_request: "RolloutInferRequest", response_choice: "ChatCompletionResponseChoice",
                       current_turn: int) -> bool:
        if not ACTION.search(response_choice.message.content):
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request: "RolloutInferRequest", response_choice: "ChatCompletionResponseChoice",
             current_turn: int) -> Dict:
        name, expr = ACTION.search(response_choice.message.content).groups()
        observation = self.tools[name](expr)
        infer_request.messages[-1]["content"] += observation
        token_ids = response_choice.token_ids
        loss_mask = [1] * len(token_ids)
        logprobs = [entry["logprob"] for entry in response_choice.logprobs["content"]]
        observation_ids = self.tokenizer.encode(observation, add_special_tokens=False)
        token_ids.extend(observation_ids)
        loss_mask.extend([0] * len(observation_ids))
        return {"infer_request": infer_request, "response_token_ids": token_ids, "response_loss_mask": loss_mask,
                "rollout_logprobs": logprobs, "rollout_infos": {"tool_results": observation, "num_turns": -1}}


multi_turns["react_calculator"] = ReActCalculator
'''


def test_react_scheduler_extends_the_turns_token_ids_on_messages_rows(tmp_path, monkeypatch, qwen3_tokenizer):
    (tmp_path / "calc_plugin.py").write_text(textwrap.dedent(CALC_PLUGIN))
    row = {"messages": [{"role": "system", "content": "Use the calculator."},
                        {"role": "user", "content": "What is 2+3?"},
                        {"role": "assistant", "content": "Reference: 2+3 = \\boxed{5}"}],  # the reference reply
           "solution": "\\boxed{5}"}
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(row) + "\n")
    out = tmp_path / "out.jsonl"
    engines = script_the_cli(monkeypatch, qwen3_tokenizer, lambda rid, turn, prompt: {
        1: "Action: calculator\nAction Input: 2+3\n", 2: " so the answer is \\boxed{5}."}[turn])
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--data", str(data), "--out", str(out),
                                 "--plugin", str(tmp_path / "calc_plugin.py"), "--scheduler", "react_calculator",
                                 "--max-new-tokens", "32"])
    assert result.exit_code == 0, result.output
    [traj] = map(json.loads, out.read_text().splitlines())
    assert (traj["status"], traj["termination_reason"], traj["num_turns"]) == ("completed", "env_done", 2)
    # the prompt is the messages without the reference reply
    assert [m["role"] for m in traj["messages"]] == ["system", "user", "assistant"]
    assert traj["messages"][2]["content"] == ("Action: calculator\nAction Input: 2+3\n"
                                              "Result: 5 so the answer is \\boxed{5}.")
    assert "Reference" not in qwen3_tokenizer.decode(traj["prompt_ids"])
    # one model segment: the reply (mask 1), the tool output (mask 0), the continuation and its stop token (mask 1)
    [segment] = Trajectory.from_json(traj).segments
    tok = qwen3_tokenizer
    reply = tok("Action: calculator\nAction Input: 2+3\n", add_special_tokens=False)["input_ids"]
    result_ids = tok("Result: 5", add_special_tokens=False)["input_ids"]
    rest = tok(" so the answer is \\boxed{5}.", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(
        "<|im_end|>")]
    assert segment.source == SegmentSource.MODEL and segment.token_ids == reply + result_ids + rest
    assert segment.loss_mask == [1] * len(reply) + [0] * len(result_ids) + [1] * len(rest)
    assert segment.logprobs[: len(reply)] == [-(k + 1) / 100 for k in range(len(reply))]  # the engine's own
    assert segment.logprobs[len(reply):len(reply) + len(result_ids)] == [None] * len(result_ids)
    assert traj["warnings"] == []
    # the continuation asked the engine to go on after the masked tool output, with no end-of-turn token between
    second_prompt = engines[-1].calls[1].prompt_ids
    assert second_prompt[-len(reply + result_ids):] == reply + result_ids
    assert traj["rollout_infos"] == {"tool_results": "Result: 5", "num_turns": 2}


def test_the_choice_is_ms_swifts_shape(qwen3_tokenizer):
    from turnrl.agents.scheduler import TurnResponse

    end = qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = qwen3_tokenizer("hi there", add_special_tokens=False)["input_ids"]
    turn = Turn(turn=1, text="hi there", token_ids=ids + [end], logprobs=[-0.1] * (len(ids) + 1),
                finish_reason=FinishReason.STOP, messages=[])
    choice = MultiTurnScheduler(tokenizer=qwen3_tokenizer).hook_response(TurnResponse.of(turn, frozenset({end})))
    assert isinstance(choice, ChatCompletionResponseChoice)
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "hi there", "stop")
    assert choice.token_ids == ids and [e["logprob"] for e in choice.logprobs["content"]] == [-0.1] * len(ids)
    assert "".join(e["token"] for e in choice.logprobs["content"]) == "hi there"
    assert "gym_scheduler" in multi_turns


def test_messages_rows():
    row = {"messages": [{"role": "user", "content": "Describe it."}, {"role": "assistant", "content": "A cat."}],
           "images": ["cat.png"], "solution": "cat", "system": "Be brief."}
    messages = prompt_messages(row)
    assert [m["role"] for m in messages] == ["system", "user"] and messages[0]["content"] == "Be brief."
    # ms-swift adds the missing <image> tag at the start of the first message: the image goes there
    assert messages[1]["content"] == [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "Describe it."}]
    assert row["messages"][1] == {"role": "assistant", "content": "A cat."}  # the row keeps its reference reply
    tagged = prompt_messages({"messages": [{"role": "user", "content": "Look: <image>"}], "images": ["a.png"]})
    assert tagged[0]["content"][-1] == {"type": "image", "image": "a.png"}
    assert prompt_messages({"messages": [{"role": "assistant", "content": "only"}]}) == [
        {"role": "assistant", "content": "only"}]  # a lone message is the prompt, whatever its role
    with pytest.raises(DataError, match=r"row: messages\[0\] must be a message"):
        prompt_messages({"messages": [{"from": "human"}]})
    with pytest.raises(DataError, match="missing field 'prompt' .* or 'messages'"):
        prompt_messages({"question": "?"})


# ms-swift's examples/train/grpo/plugin/deepeyes/deepeyes_plugin.py (VisualToolBoxScheduler.step): the tool's cropped
# image is appended to infer_request.images, the new user message carries an '<image>' tag where it goes, and
# rollout_infos['images'] overrides the sample's images.
IMAGE_STEP_PLUGIN = '''
from PIL import Image

from turnrl.compat.swift import MultiTurnScheduler, multi_turns


class ZoomScheduler(MultiTurnScheduler):
    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= 2

    def step(self, infer_request, response_choice, current_turn):
        cropped_img = Image.new("RGB", (56, 56), (0, 0, 255))
        query = "<tool_response>" + "<image>" + "Here is the zoomed region." + "</tool_response>"
        infer_request.messages.append({"role": "user", "content": query})
        infer_request.images.append(cropped_img)
        return {"infer_request": infer_request, "rollout_infos": {"images": infer_request.images}}


class TwoImagesOneTag(ZoomScheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "<image>"})
        infer_request.images += [Image.new("RGB", (56, 56)), Image.new("RGB", (56, 56), (9, 9, 9))]
        return {"infer_request": infer_request}


multi_turns["zoom_c13"] = ZoomScheduler
multi_turns["two_images_c13"] = TwoImagesOneTag
'''


def image_rollout(tmp_path, monkeypatch, scheduler: str) -> dict:
    from PIL import Image
    from transformers import AutoTokenizer

    from turnrl.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny-qwen3-vl"))
    script_the_cli(monkeypatch, tokenizer, lambda rid, turn, prompt: "zoom in" if turn == 1 else "blue")
    Image.new("RGB", (56, 56), (255, 0, 0)).save(tmp_path / "pic.png")
    (tmp_path / "plugin.py").write_text(textwrap.dedent(IMAGE_STEP_PLUGIN))
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "<image>colour?"}],
                                "images": [str(tmp_path / "pic.png")]}) + "\n")
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3-vl", "--data", str(data), "--out", str(out),
                                 "--plugin", str(tmp_path / "plugin.py"), "--scheduler", scheduler,
                                 "--max-turns", "3", "--max-new-tokens", "16", "--sanity-check", "ignore_strippable"])
    assert result.exit_code == 0, result.output
    [traj] = map(json.loads, out.read_text().splitlines())
    return traj


def test_a_step_that_appends_an_image_with_an_image_tag_shows_it_to_the_model(tmp_path, monkeypatch):
    traj = image_rollout(tmp_path, monkeypatch, "zoom_c13")
    assert (traj["status"], traj["error"], traj["num_turns"]) == ("completed", None, 2)
    # the tag became an image part of the new message, where ms-swift's template puts the image
    observation = next(m for m in traj["messages"][2:] if m["role"] == "user")
    assert [p["type"] for p in observation["content"]] == ["text", "image", "text"]
    assert observation["content"][0]["text"] == "<tool_response>"
    # both images are in the token stream: the prompt's and the step's (an image pad run in the observation)
    assert len(traj["images"]) == 2 and traj["images"][0].endswith("pic.png")
    assert traj["images"][1].startswith("sha256:")
    pad = 151655  # Qwen-VL's <|image_pad|>
    observed = [t for t, m in zip(traj["response_ids"], traj["loss_mask"], strict=True) if m == 0]
    assert pad in observed and "<image>" not in json.dumps(traj["messages"])
    # rollout_infos['images'] (ms-swift's override of the sample's images) is kept as the images' references
    assert traj["rollout_infos"]["images"] == traj["images"]


def test_new_images_without_a_tag_each_fail_with_a_clear_error(tmp_path, monkeypatch):
    traj = image_rollout(tmp_path, monkeypatch, "two_images_c13")
    assert traj["status"] == "failed"
    assert "step() appended 2 image(s) to request.images, but the messages it added have 1 '<image>' tags" in traj["error"]


# User plugins subclassing ms-swift's built-in schedulers (swift/rollout/multi_turn.py), as ms-swift documents them:
# class attributes and hooks overridden, the constructor's `acc_function=` keyword.
TIPS_PLUGIN = '''
from turnrl.compat.swift import (MathTipsScheduler, RolloutScheduler, ThinkingModelTipsScheduler, get_logger,
                                 multi_turns)


class ShortTips(MathTipsScheduler):
    tips_prompt = " Hmm, wait,"


class SecondChance(ThinkingModelTipsScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, acc_function=lambda completions, solutions: [
            float(c.endswith(s)) for c, s in zip(completions, solutions)], **kwargs)


class Judged(RolloutScheduler):
    async def on_turn_end(self, infer_request, response_choice, current_turn):
        return {"reward": float("4" in response_choice.message.content), "rollout_infos": {"judged": current_turn}}


multi_turns["short_tips_c13"] = ShortTips
multi_turns["second_chance_c13"] = SecondChance
multi_turns["judged_c13"] = Judged
'''


def tips_rollout(tmp_path, monkeypatch, qwen3_tokenizer, scheduler, replies) -> list[dict]:
    script = replies if callable(replies) else (lambda rid, turn, prompt: replies[turn - 1])
    engines = script_the_cli(monkeypatch, qwen3_tokenizer, script)
    (tmp_path / "tips_plugin.py").write_text(textwrap.dedent(TIPS_PLUGIN))
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"}], "solution": "4"}) + "\n")
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--data", str(data), "--out", str(out),
                                 "--plugin", str(tmp_path / "tips_plugin.py"), "--scheduler", scheduler,
                                 "--max-turns", "4", "--max-new-tokens", "48"])
    assert result.exit_code == 0, result.output
    trajs = sorted(map(json.loads, out.read_text().splitlines()), key=lambda t: t["id"])
    assert sum(len(e.calls) for e in engines) == sum(t["num_turns"] for t in trajs)
    return trajs


def test_a_math_tips_scheduler_subclass_cuts_before_the_answer_and_appends_its_tip(tmp_path, monkeypatch,
                                                                                   qwen3_tokenizer):
    [traj] = tips_rollout(tmp_path, monkeypatch, qwen3_tokenizer, "short_tips_c13",
                          ["<think>2+2=5</think><answer>\\boxed{5}</answer>", " it is 4</think><answer>4</answer>"])
    assert (traj["status"], traj["error"], traj["num_turns"]) == ("completed", None, 2)
    # one assistant message: the reply up to its </think>, the tip, the continuation
    assert traj["messages"][-1] == {"role": "assistant",
                                    "content": "<think>2+2=5 Hmm, wait, it is 4</think><answer>4</answer>"}
    # the tip's tokens are in the stream with mask 0; the model's own tokens before and after it with mask 1
    tip_ids = qwen3_tokenizer(" Hmm, wait,", add_special_tokens=False)["input_ids"]
    ids, mask = traj["response_ids"], traj["loss_mask"]
    start = next(i for i in range(len(ids)) if ids[i:i + len(tip_ids)] == tip_ids)
    assert mask[start:start + len(tip_ids)] == [0] * len(tip_ids) and mask[start - 1] == mask[start + len(tip_ids)] == 1
    assert "<answer>\\boxed{5}" not in qwen3_tokenizer.decode(ids)  # the cut part never reached the stream


def test_a_thinking_tips_subclass_asks_again_once_with_earlier_reasoning_dropped(tmp_path, monkeypatch,
                                                                                qwen3_tokenizer):
    def script(request_id, turn, prompt):  # the second round is a new sample: its own request id
        return "<think>check</think>4" if "recheck" in prompt else "<think>guess</think>5"

    first, second = tips_rollout(tmp_path, monkeypatch, qwen3_tokenizer, "second_chance_c13", script)
    assert [t["num_turns"] for t in (first, second)] == [1, 1]  # one sample per round, as ms-swift returns them
    assert second["messages"][1:] == [
        {"role": "assistant", "content": "5"},  # the earlier reply without its <think> block
        {"role": "user", "content": ThinkingModelTipsScheduler.tips_prompt},
        {"role": "assistant", "content": "<think>check</think>4"}]  # right (the subclass's acc_function): it ends


def test_a_rollout_scheduler_subclass_takes_one_turn_with_its_hooks(tmp_path, monkeypatch, qwen3_tokenizer):
    [traj] = tips_rollout(tmp_path, monkeypatch, qwen3_tokenizer, "judged_c13", ["4", "never asked"])
    assert (traj["num_turns"], traj["turn_rewards"], traj["rollout_infos"]["judged"]) == (1, [1.0], 1)


def test_ms_swifts_scheduler_classes_subclass_as_in_ms_swift():
    from turnrl.compat.swift import GYMScheduler, MathTipsScheduler, RolloutScheduler

    assert issubclass(MultiTurnScheduler, RolloutScheduler) and issubclass(GYMScheduler, MultiTurnScheduler)
    assert issubclass(MathTipsScheduler, MultiTurnScheduler) and issubclass(ThinkingModelTipsScheduler,
                                                                            MultiTurnScheduler)
    assert MathTipsScheduler.tips_prompt == "But wait... It seems I made a mistake,"  # ms-swift's
    assert MathTipsScheduler(None, 3).max_turns == 3


# ---- ms-swift's own FrozenLake plugin (examples/megatron/grpo/multi_turn/frozen_lake_plugin.py, imports changed) ----
PLUGIN = Path(__file__).parent / "data" / "swift_frozen_lake_plugin.py"
GRID_ROW = re.compile(r"^(?:[SGHFP*] ){3}[SGHFP*]$")


def lake_solver(request_id, turn, prompt):
    """A scripted policy: the shortest safe path from P to G on the last grid the prompt shows, one move a turn."""
    lines = prompt.splitlines()
    end = max(i for i, line in enumerate(lines) if GRID_ROW.match(line))
    grid = [line.split() for line in lines[end - 3:end + 1]]
    start = next((r, c) for r in range(4) for c in range(4) if grid[r][c] == "P")
    moves = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
    frontier, seen = [(start, None)], {start}
    while frontier:
        (r, c), first = frontier.pop(0)
        for name, (dr, dc) in moves.items():
            cell = (r + dr, c + dc)
            if 0 <= cell[0] < 4 and 0 <= cell[1] < 4 and cell not in seen and grid[cell[0]][cell[1]] != "H":
                if grid[cell[0]][cell[1]] == "G":
                    return f"<action>{first or name}</action>"
                seen.add(cell)
                frontier.append((cell, first or name))
    raise AssertionError(f"no path on {grid}")


# The same env on the env path: build_env steps ms-swift's FrozenLakeEnv with the reply; the rows carry the
# system prompt and first observation that the gym scheduler's reset would have put there.
ENV_PATH = '''
import sys
sys.path.insert(0, {folder!r})
from swift_frozen_lake_plugin import FrozenLakeEnv


class Lake:
    def __init__(self, sample):
        self.lake = FrozenLakeEnv(sample["env_config"])

    async def reset(self):
        await self.lake.reset(None)

    async def step(self, text):
        return await self.lake.step([{{"role": "assistant", "content": text}}])


def build_env(sample, config):
    return Lake(sample)
'''

REWRITING = '''
from turnrl.compat.swift import GYMScheduler, multi_turns


class LastObservationOnly(GYMScheduler):
    """Shows the model only the system prompt and the latest observation: history really is rewritten."""

    def step(self, infer_request, response_choice, current_turn):
        observation = self.episodes[infer_request.uuid].observation
        infer_request.messages[:] = [infer_request.messages[0], {"role": "user", "content": observation}]
        return {"infer_request": infer_request}


multi_turns["last_observation_only"] = LastObservationOnly
'''


def _lake_rollout(tmp_path, monkeypatch, tokenizer, rows, *args) -> list[dict]:
    data, out = tmp_path / "lake.jsonl", tmp_path / "out.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    script_the_cli(monkeypatch, tokenizer, lake_solver)
    result = runner.invoke(app, ["rollout", "--model", "tiny-qwen3", "--data", str(data), "--out", str(out),
                                 "--max-turns", "10", "--max-new-tokens", "16", "--reward", "env", *args])
    assert result.exit_code == 0, result.output
    return sorted(map(json.loads, out.read_text().splitlines()), key=lambda t: t["id"])


@pytest.mark.parametrize("thinking", [False, True])
def test_ms_swift_frozen_lake_gives_one_trajectory_per_episode_as_the_env_path_does(
        tmp_path, monkeypatch, qwen3_tokenizer, thinking):
    import asyncio
    import sys

    sys.path.insert(0, str(PLUGIN.parent))
    from swift_frozen_lake_plugin import FrozenLakeEnv

    kwargs = ["--chat-template-kwargs", json.dumps({"enable_thinking": thinking})]
    seeds = (0, 3, 5)  # 3, 4 and 6 moves to the goal
    gym = _lake_rollout(tmp_path, monkeypatch, qwen3_tokenizer,
                        [{"id": f"lake{s}", "messages": [{"role": "user", "content": "<placeholder>"}],
                          "env_config": {"seed": s}} for s in seeds],
                        "--plugin", str(PLUGIN), "--scheduler", "gym_scheduler", "--gym-env", "frozen_lake", *kwargs)
    firsts = [asyncio.run(FrozenLakeEnv({"seed": s}).reset(None)) for s in seeds]
    (tmp_path / "lake_env.py").write_text(ENV_PATH.format(folder=str(PLUGIN.parent)))
    env = _lake_rollout(tmp_path, monkeypatch, qwen3_tokenizer,
                        [{"id": f"lake{s}", "env_config": {"seed": s},
                          "messages": [{"role": "system", "content": system}, {"role": "user", "content": obs}]}
                         for s, (obs, _, system) in zip(seeds, firsts, strict=True)],
                        "--env", str(tmp_path / "lake_env.py"), *kwargs)
    # before: one sample per move with Qwen3's thinking off (termination_reason split), the empty <think></think>
    # the template pre-fills being missing from the request's history
    assert len(gym) == len(env) == len(seeds)
    assert [t["num_turns"] for t in gym] == [3, 4, 6]
    for g, e in zip(gym, env, strict=True):
        assert (g["status"], g["termination_reason"], g["reward"]) == ("completed", "env_done", 1.0)
        assert g["num_turns"] == e["num_turns"] == g["rollout_infos"]["num_turns"]
        for key in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "turn_rewards", "reward"):
            assert g[key] == e[key], key
        assert g["rollout_infos"]["step_rewards"] == e["turn_rewards"] == [0.0] * (g["num_turns"] - 1) + [1.0]


def test_a_scheduler_that_rewrites_history_still_splits(tmp_path, monkeypatch, qwen3_tokenizer):
    (tmp_path / "rewriting.py").write_text(REWRITING)
    trajs = _lake_rollout(tmp_path, monkeypatch, qwen3_tokenizer,
                          [{"id": "lake5", "messages": [{"role": "user", "content": "<placeholder>"}],
                            "env_config": {"seed": 5}}],  # six moves to the goal
                          "--plugin", str(PLUGIN), "--plugin", str(tmp_path / "rewriting.py"),
                          "--scheduler", "last_observation_only", "--gym-env", "frozen_lake",
                          "--chat-template-kwargs", '{"enable_thinking": false}')
    moves = trajs[0]["rollout_infos"]["num_turns"]
    assert moves == 6 and len(trajs) == moves and all(t["num_turns"] == 1 for t in trajs)
    assert [t["termination_reason"] for t in trajs] == ["split"] * (moves - 1) + ["env_done"]
    # the samples share the episode's reward (`--reward env`: every sample's env rewards; before, 0.0 for the first
    # samples and 1.0 for the last, which training refuses)
    assert {t["episode_id"] for t in trajs} == {trajs[0]["id"]} and {t["reward"] for t in trajs} == {1.0}
