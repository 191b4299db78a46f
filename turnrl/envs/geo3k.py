"""The geo3k environment: a geometry problem with an answer-checking tool, as in slime's geo3k recipe.

The model may call `calc_score` with a candidate answer and is told whether it matches the reference;
it then gives its final answer in `\\boxed{}`. The environment is an oracle: the metric is final-answer
correctness after up to `max_turns - 1` checks, not comparable to single-turn geo3k accuracy.

Turns are counted 1-based: `step` number t handles the model's t-th reply (after dropping `<think>`
reasoning) and returns:
- no `<tool_call>` in the reply: done, NO_TOOL_CALL (the model's final answer), on any turn;
- on t >= max_turns, any tool call: done, MAX_TURNS. The env ends the episode itself, as slime's does
  (slime discards that final observation); the driver enforces the limit as well;
- otherwise, not done, with a user message: CORRECT_FEEDBACK or WRONG_FEEDBACK for a valid call, and
  MALFORMED_FEEDBACK + `tool_call_format()` for a call it cannot use (bad JSON, unclosed tag, unknown tool,
  missing or empty answer). On t == max_turns - 1 the message ends with LAST_CHANCE_WARNING, since the
  next reply is the last (max_turns=3: on step 2; max_turns=1: never).

`reward` is 0.0 on every step but the last, where it is `geo3k_reward` of the model's replies.

Differences from slime, on purpose:
- The reward reads the model's own replies only. slime graded `sample.response`, which includes the
  env's feedback, so the empty `\\boxed{}` in a feedback message could zero a correct trajectory.
- Tool calls inside `<think>` reasoning are ignored, and a malformed call gets a corrective message
  instead of silently ending the episode.
- The last-chance warning is added to any message on step max_turns - 1, not only to wrong answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from turnrl.reasoning import strip_reasoning
from turnrl.rewards import boxed_answer_reward, last_boxed, math_equal  # noqa: F401 (re-exported)
from turnrl.rewards import reference_parses as _reference_parses
from turnrl.types import Message, StepResult, TerminationReason

TOOL_NAMES = ("calc_score", "calc_geo3k_reward")
"""Accepted tool names: `calc_score` as the prompt says, `calc_geo3k_reward` as verl names it."""

CORRECT_FEEDBACK = (
    "calc_score result: 1. Your answer '{answer}' matches the reference answer. "
    "Stop calling tools and give your final answer in \\boxed{{}}."
)
WRONG_FEEDBACK = (
    "calc_score result: 0. Your answer '{answer}' does not match the reference answer: it is wrong, "
    "try another way. Don't repeat this answer unless you are sure of it."
)
MALFORMED_FEEDBACK = "Your tool call could not be used: {problem}. Call the tool exactly like this: "
"""Followed by `tool_call_format(tool_names[0])` (appended, not formatted: it is JSON, full of braces)."""
LAST_CHANCE_WARNING = (
    " This is your last chance: your next reply is your final one and no more tool calls will be "
    "answered. Do not call a tool; end your reply with Answer: \\boxed{your answer}."
)


@dataclass(frozen=True)
class Geo3kConfig:
    """Settings of the geo3k environment (the `config` dict of `build_env`)."""

    max_turns: int = 3
    """Model replies per episode; the reply on turn max_turns is final (slime's recipe uses 3)."""
    tool_names: tuple[str, ...] = TOOL_NAMES
    """Names under which the answer-checking tool may be called."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"geo3k config: max_turns must be an int >= 1, got {self.max_turns!r}")
        if not self.tool_names:
            raise ValueError("geo3k config: tool_names must name at least one tool")


def tool_call_format(tool_name: str = "calc_score") -> str:
    """The exact call the corrective message shows:
    `<tool_call>{"name": "calc_score", "arguments": {"answer": "<your answer>"}}</tool_call>`."""
    payload = {"name": tool_name, "arguments": {"answer": "<your answer>"}}
    return f"<tool_call>{json.dumps(payload)}</tool_call>"


# ---- scoring -------------------------------------------------------------------------------------


def geo3k_reward(model_texts: list[str], answer: str) -> float:
    """1.0 when the last `\\boxed{}` across the model's own replies matches `answer`, else 0.0.

    Pass only text the model generated: env feedback contains `\\boxed{}` and must never be graded.
    """
    return boxed_answer_reward(model_texts, answer)


answers_match = math_equal


# ---- parsing -------------------------------------------------------------------------------------


@dataclass
class ParsedToolCall:
    """A `<tool_call>` as the env read it; `problem` says why it cannot be used, if it cannot."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None


def parse_last_tool_call(text: str, tool_names: tuple[str, ...] = TOOL_NAMES) -> ParsedToolCall | None:
    """The reply's last `<tool_call>` (slime uses the last one), or None when there is no call at all."""
    opening = text.rfind("<tool_call>")
    if opening < 0:
        return None
    body, closed, _ = text[opening + len("<tool_call>") :].partition("</tool_call>")
    if not closed:
        return ParsedToolCall(problem="the <tool_call> tag is not closed with </tool_call>")
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return ParsedToolCall(problem="the text inside <tool_call> is not valid JSON")
    if not isinstance(payload, dict):
        return ParsedToolCall(problem="the text inside <tool_call> must be one JSON object")
    function = payload.get("function")
    function = function if isinstance(function, dict) else {}
    name = payload.get("name") or function.get("name") or ""
    arguments = payload.get("arguments", function.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ParsedToolCall(name=str(name), problem="the arguments string is not valid JSON")
    if not isinstance(arguments, dict):
        arguments = {}
    call = ParsedToolCall(name=str(name), arguments=arguments)
    answer = arguments.get("answer")
    if not call.name:
        call.problem = 'the call has no "name"'
    elif call.name not in tool_names:
        call.problem = f"unknown tool {call.name!r}; the only tool is {tool_names[0]!r}"
    elif answer is None or not str(answer).strip():
        call.problem = 'the call has no "answer" argument, or it is empty'
    return call


# ---- the environment -----------------------------------------------------------------------------


class Geo3kEnv:
    """One geo3k episode. See the module docstring for the behaviour of `step`."""

    def __init__(self, answer: str, config: Geo3kConfig) -> None:
        if not _reference_parses(answer):
            raise ValueError(f"geo3k: reference answer {answer!r} cannot be parsed by math-verify")
        self.answer = answer
        self.config = config
        self.turn = 0
        self.model_texts: list[str] = []

    def reset(self) -> None:
        self.turn = 0
        self.model_texts = []

    def step(self, response_text: str) -> StepResult:
        self.turn += 1
        self.model_texts.append(response_text)
        call = parse_last_tool_call(strip_reasoning(response_text), self.config.tool_names)
        info: dict[str, Any] = {
            "turn": self.turn,
            "tool_calls": [],
            "calc_score_results": [],
            "tool_error": None,
        }
        if call is None:
            return self._finish(TerminationReason.NO_TOOL_CALL, info)
        info["tool_calls"].append({"name": call.name, "arguments": call.arguments})
        if call.problem is not None:
            info["tool_error"] = call.problem
            message = MALFORMED_FEEDBACK.format(problem=call.problem) + tool_call_format(
                self.config.tool_names[0]
            )
        else:
            candidate = str(call.arguments["answer"])
            correct = answers_match(candidate, self.answer)
            info["calc_score_results"].append(int(correct))
            message = (CORRECT_FEEDBACK if correct else WRONG_FEEDBACK).format(answer=candidate)
        if self.turn >= self.config.max_turns:
            return self._finish(TerminationReason.MAX_TURNS, info)
        if self.turn == self.config.max_turns - 1:
            message += LAST_CHANCE_WARNING
        return StepResult(observation=message, reward=0.0, done=False, info=info)

    def _finish(self, reason: TerminationReason, info: dict[str, Any]) -> StepResult:
        reward = geo3k_reward(self.model_texts, self.answer)
        info["final_score"] = reward
        return StepResult(observation=None, reward=reward, done=True, info=info, termination_reason=reason)

    def format_observation(self, observation: str) -> Message:
        # A user message, as slime's recipe sends it (its env's "tool" role is ignored there too).
        return {"role": "user", "content": observation}

    def close(self) -> None:
        return None


def build_env(sample: dict[str, Any], config: dict[str, Any]) -> Geo3kEnv:
    """The env for one dataset row; the reference answer is `sample["answer"]`.

    config keys: `max_turns` (default 3) and `tool_names` (default `TOOL_NAMES`).
    """
    if "answer" not in sample:
        raise ValueError(f"geo3k: the sample has no 'answer' key (keys: {sorted(sample)})")
    known = {f.name for f in fields(Geo3kConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"geo3k config: unknown keys {unknown}; known keys are {sorted(known)}")
    settings = dict(config)
    if "tool_names" in settings:
        settings["tool_names"] = tuple(settings["tool_names"])
    return Geo3kEnv(str(sample["answer"]), Geo3kConfig(**settings))
