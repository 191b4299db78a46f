"""ms-swift's scheduler and gym-env API on turnrl's schedulers: an ms-swift plugin ports by changing its imports.

    from swift.rollout.multi_turn import MultiTurnScheduler, multi_turns      ┐
    (also RolloutScheduler, MathTipsScheduler, ThinkingModelTipsScheduler)   │
    from swift.rollout.gym_env import Env, envs                              │
    from swift.infer_engine.protocol import (ChatCompletionResponse,         ├→ from turnrl.compat.swift import ...
        ChatCompletionResponseChoice, RolloutInferRequest)                   │
    from swift.template import Messages                                      │
    from swift.utils import get_logger                                       ┘

What the names are here:
- `MultiTurnScheduler`: turnrl's scheduler (turnrl.agents.scheduler) with ms-swift's constructor,
  `__init__(infer_engine=None, max_turns=None, *args, **kwargs)` (`infer_engine` is None: turnrl's engine is not the
  scheduler's to call), whose hooks receive a `ChatCompletionResponseChoice` like ms-swift's:
  `.message.content`, `.finish_reason`, `.token_ids`, `.logprobs["content"][i]["logprob"]`. `token_ids` are the
  turn's tokens *without* the end-of-turn token the engine sampled (as ms-swift's engines stopping on a stop word
  give them), so ids a `step` builds by extending them continue the assistant message; turnrl closes the turn
  with the template's own tokens when the message really ends. `multi_turns` is turnrl's registry.
- `RolloutScheduler` (ms-swift's base: one turn, with the hooks), `MathTipsScheduler` and
  `ThinkingModelTipsScheduler`: ms-swift's classes of those names, to subclass (their `tips_prompt`,
  `acc_function=` and hooks behave as ms-swift's; see each class). ms-swift's `OpenEnvScheduler` is not here: it
  drives OpenEnv's own client; turnrl's `remote_env` scheduler speaks OpenEnv-style HTTP.
- `Env` / `envs`: ms-swift's gym environment (`Env(env_config)`, async `reset(request) -> (observation, info,
  system_message)`, `step(messages) -> (observation, reward, done, info)`, `close()`) and its registry.
  `GYMScheduler` (registered as `gym_scheduler`, ms-swift's name) runs them: the row's whole `env_config`
  (seed included) reaches `Env(env_config)`, so the samples of a group share what the seed decides (a map);
  the env is `env_config["name"]`, else the rollout's `env_config.gym_env` (`--gym-env`, ms-swift's --gym_env).
  Names found only in turnrl's `GYM_ENVS` run as turnrl's gym scheduler runs them.
- `RolloutInferRequest` is turnrl's `RolloutRequest` (messages, tools, images, data_dict, uuid); `Messages` a
  list of chat messages; `get_logger` a standard logger.
"""

from __future__ import annotations

import abc
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

from turnrl.agents.scheduler import MultiTurnScheduler as _TurnrlScheduler
from turnrl.agents.scheduler import RolloutInferRequest, TurnResponse, multi_turns
from turnrl.agents.schedulers_builtin import (
    GYM_ENVS,
    EnvEpisode,
    GymScheduler,
    is_correct,
    row_env_config,
    strip_reasoning,
    token_index,
)
from turnrl.envs.base import call

Messages = list[dict[str, Any]]
"""ms-swift's `swift.template.Messages`: a list of chat messages."""


def get_logger(name: str | None = None) -> logging.Logger:
    """A standard logger (ms-swift's `swift.utils.get_logger`)."""
    return logging.getLogger(name or "turnrl.compat.swift")


# ---- what the hooks receive ------------------------------------------------------------------------
@dataclass
class ChatMessage:
    role: str
    content: Any
    tool_calls: list[Any] | None = None
    reasoning_content: str | None = None


@dataclass
class ChatCompletionResponseChoice:
    """One turn as ms-swift's hooks see it (module docstring)."""

    index: int
    message: ChatMessage
    finish_reason: str | None
    """"stop" or "length" (or "abort")."""
    logprobs: dict[str, list[dict[str, Any]]] | None = None
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}`, one entry per token of `token_ids`."""
    token_ids: list[int] | None = None
    """The turn's tokens without the trailing end-of-turn token (a fresh list: extending it changes nothing)."""

    @property
    def text(self) -> str:
        """The reply text (turnrl's `TurnResponse.text`; hooks of turnrl's built-in schedulers read it)."""
        return self.message.content

    @classmethod
    def of(cls, response: TurnResponse, tokenizer: Any = None) -> ChatCompletionResponseChoice:
        ids = list(response.content_token_ids)
        pieces = tokenizer.batch_decode([[t] for t in ids]) if tokenizer is not None else [str(t) for t in ids]
        content = [{"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
                   for piece, lp in zip(pieces, response.logprobs[: len(ids)], strict=True)]
        return cls(0, ChatMessage("assistant", response.text), str(response.finish_reason), {"content": content}, ids)


@dataclass
class UsageInfo:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass
class ChatCompletionResponse:
    """ms-swift's response type (for annotations and `run()` code that builds one); the hooks get its choices."""

    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo = field(default_factory=UsageInfo)
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid4().hex}")
    object: str = "chat.completion"
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_token_ids: list[int] | None = None


# ---- the schedulers ----------------------------------------------------------------------------------
class RolloutScheduler(_TurnrlScheduler):
    """ms-swift's base scheduler: one turn, with the hooks `on_trajectory_start` and `on_turn_end` (which may
    return `done`, `rollout_infos` and `reward`), ms-swift's constructor and response type (module docstring).
    A subclass that overrides ms-swift's `run(infer_request, request_config)` calls `self.infer_engine`, which turnrl
    does not give a scheduler: override turnrl's `run(request, runner)` instead (docs/from-ms-swift.md)."""

    def __init__(self, infer_engine: Any = None, max_turns: int | None = None, *args: Any, **kwargs: Any):
        super().__init__(max_turns, **kwargs)
        self.infer_engine = infer_engine

    @property
    def engine(self) -> Any:
        """ms-swift's alias of `infer_engine` (None here)."""
        return self.infer_engine

    def hook_response(self, response: TurnResponse) -> ChatCompletionResponseChoice:
        return ChatCompletionResponseChoice.of(response, self.tokenizer)

    def check_finished(self, request: RolloutInferRequest, response: Any, turn: int) -> bool:
        return True  # a single turn


class MultiTurnScheduler(RolloutScheduler):
    """ms-swift's multi-turn scheduler: `step()` makes the next request, `check_finished()` (by default: a
    length-truncated turn or `max_turns`) ends the episode."""

    def check_finished(self, request: RolloutInferRequest, response: Any, turn: int) -> bool:
        return _TurnrlScheduler.check_finished(self, request, response, turn)


def math_accuracy(completions: list[str], solutions: list[str]) -> list[float]:
    """The default `acc_function` of the tips schedulers (ms-swift's `MathAccuracy` ORM, same call): 1.0 per
    completion whose final answer (after its reasoning; its last `\\boxed{}` when it has one) equals the
    solution's (its last `\\boxed{}`, or all of it) under math-verify, else 0.0."""
    return [float(is_correct(completion, {"solution": solution}))
            for completion, solution in zip(completions, solutions, strict=True)]


class _AccuracyScheduler(MultiTurnScheduler):
    """ms-swift's tips schedulers' constructor: `acc_function(completions, solutions) -> [score]` (default
    `math_accuracy`) as `self.acc_func`."""

    def __init__(self, infer_engine: Any = None, max_turns: int | None = None, *args: Any,
                 acc_function: Callable[[list[str], list[str]], list[float]] | None = None, **kwargs: Any):
        super().__init__(infer_engine, max_turns, **kwargs)
        self.acc_func = acc_function or math_accuracy


class MathTipsScheduler(_AccuracyScheduler):
    """ms-swift's `math_tip_trick`: on a wrong answer, the reply is cut before its `<answer>` or `</think>` (the
    first of them), `tips_prompt` is appended to the same assistant message (mask 0, no logprobs) and the model
    continues it, once. `acc_function(completions, solutions) -> [score]` (ms-swift's keyword; default
    `math_accuracy`) checks the message against the row's `solution` (else `answer`). turnrl's own
    `--scheduler math_tip_trick` cuts after the `\\boxed{}` instead (turnrl.agents.schedulers_builtin)."""

    tips_prompt = "But wait... It seems I made a mistake,"

    def check_finished(self, request: RolloutInferRequest, response: Any, turn: int) -> bool:
        last_completion = request.messages[-1]["content"]
        if self.tips_prompt in last_completion:  # tips once
            return True
        if self.acc_func([last_completion], [_solution(request)])[0] == 1:
            return True
        return super().check_finished(request, response, turn)

    def step(self, request: RolloutInferRequest, response: Any, turn: int) -> dict[str, Any]:
        text = response.message.content
        cut = min([text.index(tag) for tag in ("<answer>", "</think>") if tag in text], default=len(text))
        kept = response.token_ids[: token_index(self.tokenizer, response.token_ids, cut)]
        tip_ids = self.tokenizer(self.tips_prompt, add_special_tokens=False)["input_ids"]
        message = request.messages[-1]
        before = message["content"][: len(message["content"]) - len(text)]  # the message so far, on a continuation
        message["content"] = before + self.tokenizer.decode(kept) + self.tips_prompt
        logprobs = [entry["logprob"] for entry in (response.logprobs or {}).get("content", [])][: len(kept)]
        return {"infer_request": request, "response_token_ids": kept + tip_ids,
                "response_loss_mask": [1] * len(kept) + [0] * len(tip_ids), "rollout_logprobs": logprobs}


class ThinkingModelTipsScheduler(_AccuracyScheduler):
    """ms-swift's `thinking_tips_scheduler`: after a wrong answer, a user message `tips_prompt` asks again, once;
    the next request shows earlier replies without their `<think>` blocks (as thinking templates render history),
    so each round is its own training sample (ms-swift returns one RolloutOutput per round). `acc_function` as in
    MathTipsScheduler."""

    tips_prompt = "The answer is not correct, It seems You made a mistake, you need to recheck very carefully."

    def check_finished(self, request: RolloutInferRequest, response: Any, turn: int) -> bool:
        last_query = request.messages[-2].get("content") if len(request.messages) >= 2 else None
        if isinstance(last_query, str) and self.tips_prompt in last_query:  # tips once
            return True
        if self.acc_func([response.message.content], [_solution(request)])[0] == 1:
            return True
        return super().check_finished(request, response, turn)

    def step(self, request: RolloutInferRequest, response: Any, turn: int) -> dict[str, Any]:
        request.messages[:] = strip_reasoning(request.messages)
        request.messages.append({"role": "user", "content": self.tips_prompt})
        return {"infer_request": request}


def _solution(request: RolloutInferRequest) -> str:
    row = request.data_dict
    if row.get("solution") is None and row.get("answer") is None:
        raise KeyError(f"the tips schedulers check answers against the row's `solution` (or `answer`) column; this "
                       f"row has {sorted(row)}")
    return str(row["solution"] if row.get("solution") is not None else row["answer"])


# ---- gym environments ----------------------------------------------------------------------------------
class Env(abc.ABC):
    """ms-swift's gym environment. Subclasses implement async (or sync) `reset`, `step` and `close`."""

    def __init__(self, env_config: dict[str, Any]):
        self.env_config = env_config

    @abc.abstractmethod
    async def reset(self, config: RolloutInferRequest) -> tuple[str, dict[str, Any], str]:
        """The first observation (the user message), an info dict and the system message ("" for none)."""

    @abc.abstractmethod
    async def step(self, action: Messages) -> tuple[str, float, bool, dict[str, Any]]:
        """The conversation so far (its last message is the model's reply) → (observation, reward, done, info)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the environment's resources."""


envs: dict[str, type[Env]] = {}
"""ms-swift's env registry: a plugin registers `envs["name"] = MyEnv`."""


class GYMScheduler(MultiTurnScheduler, GymScheduler):
    """ms-swift's gym scheduler (module docstring): messages become `[system?, observation]` at reset, each reply
    steps the env with a copy of the conversation, and its observation is the next user message. Rollout infos:
    total_reward, step_rewards, gym_done; the env's `done` ends the episode (max_turns still applies)."""

    def __init__(self, infer_engine: Any = None, max_turns: int | None = None, *args: Any,
                 gym_env: str | None = None, **kwargs: Any):
        super().__init__(infer_engine, max_turns, **kwargs)
        self.gym_env_name = gym_env or self.env_config.get("gym_env")
        self._swift_episodes: set[str] = set()

    def _swift_env(self, request: RolloutInferRequest) -> Env | None:
        """The row's ms-swift env, built with the row's whole env_config; None for a turnrl text env."""
        env_config = row_env_config(request.data_dict)
        name = env_config.get("name", self.gym_env_name)
        if name in envs:
            return envs[name](env_config)
        if name is not None and name not in GYM_ENVS:
            raise ValueError(f"unknown gym env {name!r}: not in turnrl.compat.swift.envs "
                             f"({', '.join(envs) or 'empty'}; a plugin registers envs['{name}'] = MyEnv) "
                             f"nor in turnrl's GYM_ENVS ({', '.join(GYM_ENVS)})")
        return None

    async def on_trajectory_start(self, requests: list[RolloutInferRequest]) -> None:
        for request in requests:
            env = self._swift_env(request)
            if env is None:  # a turnrl text env (GYM_ENVS), or an unknown name: turnrl's gym scheduler says which
                await GymScheduler.on_trajectory_start(self, [request])
                continue
            self.episodes[request.uuid] = EnvEpisode(env)
            self._swift_episodes.add(request.uuid)
            observation, _info, system_message = await call(env.reset, request)
            messages: Messages = [{"role": "system", "content": system_message}] if system_message else []
            request.messages[:] = [*messages, {"role": "user", "content": observation}]

    async def on_turn_end(self, request: RolloutInferRequest, response: Any, turn: int) -> dict:
        if request.uuid not in self._swift_episodes:
            return await GymScheduler.on_turn_end(self, request, response, turn)
        episode = self.episodes[request.uuid]
        observation, reward, done, _info = await call(episode.env.step, copy.deepcopy(request.messages))
        return episode.record(str(observation), reward, done)

    async def on_trajectory_end(self, requests: list[RolloutInferRequest], error: BaseException | None = None) -> None:
        for request in requests:
            self._swift_episodes.discard(request.uuid)
        await GymScheduler.on_trajectory_end(self, requests, error)


multi_turns["gym_scheduler"] = GYMScheduler

__all__ = [
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatMessage",
    "Env",
    "GYMScheduler",
    "MathTipsScheduler",
    "Messages",
    "MultiTurnScheduler",
    "RolloutInferRequest",
    "RolloutScheduler",
    "ThinkingModelTipsScheduler",
    "envs",
    "get_logger",
    "math_accuracy",
    "multi_turns",
]
