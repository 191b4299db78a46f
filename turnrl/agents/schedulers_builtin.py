"""The built-in schedulers (ms-swift's four, on turnrl's one loop).

- `math_tip_trick`: a wrong answer is cut after its `\\boxed{}`, a tip is appended to the same assistant message
  (mask 0) and the model goes on, once (ms-swift's MathTipsScheduler).
- `thinking_tips`: after a wrong answer, the history is re-rendered without earlier reasoning plus a user tip,
  and the model answers again, once; one training sample per turn (ms-swift's ThinkingModelTipsScheduler).
- `gym`: a gymnasium-style text env from `GYM_ENVS` (e.g. `frozenlake`) per trajectory (ms-swift's GYMScheduler).
- `remote_env`: an environment behind HTTP, OpenEnv-style (`POST /reset`, `POST /step`).

Answers are checked with math-verify against the row's `solution` (its last `\\boxed{}`) or `answer` column.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from turnrl.agents.scheduler import (
    SCHEDULERS,
    MultiTurnScheduler,
    RolloutRequest,
    SchedulerRunner,
    TurnResponse,
)
from turnrl.envs.base import call
from turnrl.envs.frozenlake import FrozenLakeText
from turnrl.reasoning import split_reasoning
from turnrl.rewards import last_boxed, math_equal
from turnrl.types import FinishReason, Message, Trajectory

log = logging.getLogger(__name__)


# ---- answers ---------------------------------------------------------------------------------------
def reference_answer(data_dict: dict[str, Any]) -> str:
    """The row's reference: the last `\\boxed{}` of `solution` (or all of it), else `answer`."""
    for key in ("solution", "answer"):
        value = data_dict.get(key)
        if value is not None and str(value).strip():
            return last_boxed(str(value)) or str(value)
    raise ValueError(f"checking answers needs a `solution` or `answer` column; this row has {sorted(data_dict)}")


def is_correct(text: str, data_dict: dict[str, Any]) -> bool:
    """Whether the reply's final answer (after its reasoning) equals the row's reference under math-verify."""
    return math_equal(split_reasoning(text)[1], reference_answer(data_dict))


def answer_end(text: str) -> int:
    """Character index just after the last complete `\\boxed{...}` (the whole text when there is none)."""
    for match in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))):
        depth = 1
        for i in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return i + 1
    return len(text)


def token_index(tokenizer: Any, token_ids: list[int], char_end: int) -> int:
    """The fewest leading tokens whose decoded text reaches `char_end` characters (decoding growing prefixes;
    a binary search, since the decoded length grows with the prefix)."""
    lo, hi = 0, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(token_ids[:mid])) >= char_end:
            hi = mid
        else:
            lo = mid + 1
    return lo


def strip_reasoning(messages: list[Message]) -> list[Message]:
    """Assistant messages without their `<think>...</think>` blocks, as Qwen3's template shows earlier turns."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and isinstance(m.get("content"), str):
            m = {k: v for k, v in m.items() if k != "reasoning_content"}
            m["content"] = split_reasoning(m["content"])[1]
        out.append(m)
    return out


# ---- math_tip_trick --------------------------------------------------------------------------------
class MathTipTrick(MultiTurnScheduler):
    """On a wrong answer: keep the reply up to its answer, append `tip` (mask 0, no logprobs) to the same
    assistant message and let the model continue — once. The result is one model segment with a masked span."""

    tip = "\n\nWait, let me double-check this."

    def check_finished(self, request: RolloutRequest, response: TurnResponse, turn: int) -> bool:
        content = request.messages[-1]["content"]
        if self.tip in content or is_correct(content, request.data_dict):
            return True
        return super().check_finished(request, response, turn)

    def step(self, request: RolloutRequest, response: TurnResponse, turn: int) -> dict:
        message = request.messages[-1]
        before = message["content"][: len(message["content"]) - len(response.text)]
        kept = response.content_token_ids[: token_index(self.tokenizer, response.content_token_ids,
                                                        answer_end(response.text))]
        tip_ids = self.tokenizer(self.tip, add_special_tokens=False)["input_ids"]
        message["content"] = before + self.tokenizer.decode(kept) + self.tip
        return {"infer_request": request, "response_token_ids": kept + tip_ids,
                "response_loss_mask": [1] * len(kept) + [0] * len(tip_ids),
                "rollout_logprobs": response.logprobs[: len(kept)]}


# ---- thinking_tips ---------------------------------------------------------------------------------
class ThinkingTips(MultiTurnScheduler):
    """After a wrong answer, ask again once with `tip`, showing the model only its latest reasoning. The history
    changes, so every turn is its own sample (a fresh render); the samples share the episode's rollout infos
    `correct` and `final_response`, so a reward reading those is equal across them, as the trainer requires."""

    tip = "Your answer is not correct. Check each step carefully, then give the final answer in \\boxed{}."

    async def run(self, request: RolloutRequest, runner: SchedulerRunner) -> list[Trajectory]:
        messages = copy.deepcopy(request.messages)
        for attempt in (1, 2):
            response = await runner.generate(dataclasses.replace(request, messages=messages), new_sample=True)
            correct = response.finish_reason == FinishReason.STOP and is_correct(response.text, request.data_dict)
            runner.rollout_infos.update(correct=correct, final_response=response.text, tip_given=attempt == 2)
            if correct or response.finish_reason != FinishReason.STOP:
                break
            messages = strip_reasoning(messages + [{"role": "assistant", "content": response.text}])
            messages.append({"role": "user", "content": self.tip})
        return await runner.finish()


# ---- environments: gym and remote ------------------------------------------------------------------
GYM_ENVS: dict[str, Callable[..., Any]] = {
    "frozenlake": FrozenLakeText,
    "FrozenLake-v1": FrozenLakeText,
}
"""Text environments the gym scheduler runs, by name: `GYM_ENVS["name"] = factory(**options)`. An env has
`reset(seed=None) -> observation | (observation, info) | (observation, info, system_message)` and
`step(action_text) -> (observation, reward, terminated, truncated, info)` or `(observation, reward, done, info)`,
optionally `close()` and a `system_prompt`; sync or async methods."""


@dataclass
class EnvEpisode:
    """One trajectory's environment and what it has reported."""

    env: Any
    total_reward: float = 0.0
    step_rewards: list[float] = field(default_factory=list)
    observation: str | None = None
    """The observation the next request shows (set by on_turn_end, used by step)."""

    def record(self, observation: str, reward: float | None, done: bool) -> dict[str, Any]:
        reward = float(reward or 0.0)
        self.observation = observation
        self.total_reward += reward
        self.step_rewards.append(reward)
        return {"done": done, "reward": reward, "rollout_infos": {
            "total_reward": self.total_reward, "step_rewards": list(self.step_rewards), "gym_done": done}}


def inject_observation(request: RolloutRequest, observation: str, system: str | None) -> None:
    """The env's first observation replaces the first user message (or is added); its system prompt likewise."""
    messages = request.messages
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if users:
        messages[users[0]] = {"role": "user", "content": observation}
    else:
        messages.append({"role": "user", "content": observation})
    if system:
        if messages[0].get("role") == "system":
            messages[0] = {"role": "system", "content": system}
        else:
            messages.insert(0, {"role": "system", "content": system})


def row_env_config(data_dict: dict[str, Any]) -> dict[str, Any]:
    """The row's `env_config` column (a mapping, or its JSON text) as a dict; {} without one."""
    row = data_dict.get("env_config") or {}
    if isinstance(row, str):
        row = json.loads(row)
    if not isinstance(row, dict):
        raise ValueError(f"column env_config must be a mapping (name, seed, options), got {type(row).__name__}")
    return dict(row)


def _step_tuple(result: Any) -> tuple[Any, float | None, bool]:
    if isinstance(result, tuple) and len(result) == 5:  # gymnasium: terminated, truncated
        observation, reward, terminated, truncated, _ = result
        return observation, reward, bool(terminated or truncated)
    if isinstance(result, tuple) and len(result) == 4:  # gym < 0.26 and ms-swift's Env
        observation, reward, done, _ = result
        return observation, reward, bool(done)
    raise TypeError("a gym env's step must return (observation, reward, terminated, truncated, info) or "
                    f"(observation, reward, done, info); got {type(result).__name__}")


class GymScheduler(MultiTurnScheduler):
    """Any gymnasium-style text env: reset → first user message, each reply → `env.step(text)`, its observation
    → the next user message. The env is named globally (`env_config: {gym_env: NAME}` in the rollout config) or
    per row (`env_config` column: `{name, seed, **options}`; the row wins). `done` from the env overrides
    check_finished, so a length-truncated turn ends the episode only when the env says so (as in ms-swift);
    `max_turns` still applies. Rollout infos: total_reward, step_rewards, gym_done."""

    def __init__(self, max_turns: int | None = None, **kwargs: Any):
        super().__init__(max_turns, **kwargs)
        self.episodes: dict[str, EnvEpisode] = {}

    def make_env(self, data_dict: dict[str, Any]) -> tuple[Any, int | None]:
        options = row_env_config(data_dict)
        name = options.pop("name", None) or self.env_config.get("gym_env")
        seed = options.pop("seed", None)
        if name is None:
            raise ValueError("gym scheduler: no env named; set env_config.gym_env in the rollout config or an "
                             f"env_config column {{name: ...}}; registered text envs: {', '.join(sorted(GYM_ENVS))}")
        if name not in GYM_ENVS:
            raise ValueError(f"unknown gym env {name!r}; registered text envs: {', '.join(sorted(GYM_ENVS))}")
        return GYM_ENVS[name](**options), seed

    async def on_trajectory_start(self, requests: list[RolloutRequest]) -> None:
        for request in requests:
            env, seed = self.make_env(request.data_dict)
            self.episodes[request.uuid] = EnvEpisode(env)
            result = await call(functools.partial(env.reset, seed=seed))
            observation, system = result, None
            if isinstance(result, tuple):
                observation, system = result[0], (result[2] if len(result) == 3 else None)
            inject_observation(request, str(observation), system or getattr(env, "system_prompt", None))

    async def on_turn_end(self, request: RolloutRequest, response: TurnResponse, turn: int) -> dict:
        episode = self.episodes[request.uuid]
        observation, reward, done = _step_tuple(await call(episode.env.step, response.text))
        return episode.record(str(observation), reward, done)

    def step(self, request: RolloutRequest, response: TurnResponse, turn: int) -> dict:
        request.messages.append({"role": "user", "content": self.episodes[request.uuid].observation})
        return {"infer_request": request}

    async def on_trajectory_end(self, requests: list[RolloutRequest], error: BaseException | None = None) -> None:
        for request in requests:
            episode = self.episodes.pop(request.uuid, None)
            if episode is not None and hasattr(episode.env, "close"):
                await call(episode.env.close)


class RemoteEnvError(RuntimeError):
    """The remote environment could not be reached or answered with an error (after retries)."""


class RemoteEnvScheduler(MultiTurnScheduler):
    """An environment behind HTTP, OpenEnv-style. Per trajectory:

        POST {base_url}/reset  {"seed"?, **reset_kwargs}        → {"observation", "session_id"?, ...}
        POST {base_url}/step   {"action": parse_action(reply), "session_id"?}
                                                                 → {"observation", "reward", "done"}
                                                                   (or "terminated" / "truncated")
        POST {base_url}/close  {"session_id"}                    (only when /reset gave a session id)

    OpenEnv's plain HTTP server holds one env; run one per concurrent trajectory or give sessions ids. Settings
    come from the rollout's `env_config` under a row's `env_config` column: base_url (required), reset_kwargs,
    system_message, max_concurrent_envs. Calls are async (httpx), retried with exponential backoff on connection
    errors and 5xx answers, and at most `max_concurrent_envs` sessions are open at once (the server's
    MAX_CONCURRENT_ENVS). Override `parse_action` and `format_observation` for your env's schema.
    WebSocket sessions are not implemented.
    """

    max_concurrent_envs = 4
    retries = 3
    backoff_s = 0.2
    timeout_s = 30.0

    def __init__(self, max_turns: int | None = None, **kwargs: Any):
        super().__init__(max_turns, **kwargs)
        self.episodes: dict[str, EnvEpisode] = {}
        self._io: tuple[Any, Any, asyncio.Semaphore] | None = None

    def parse_action(self, text: str) -> dict[str, Any]:
        """The reply as an action: a JSON object (``` fences allowed) or `{"message": text}`."""
        body = split_reasoning(text)[1]
        fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
        try:
            action = json.loads(fenced.group(1) if fenced else body)
        except json.JSONDecodeError:
            return {"message": text}
        return action if isinstance(action, dict) else {"message": text}

    def format_observation(self, observation: Any) -> str:
        """The env's observation as the text of a user message."""
        return observation if isinstance(observation, str) else json.dumps(observation)

    def _settings(self, data_dict: dict[str, Any]) -> dict[str, Any]:
        settings = {**self.env_config, **row_env_config(data_dict)}
        if not settings.get("base_url"):
            raise ValueError("remote_env needs env_config.base_url (rollout config or the row's env_config column)")
        return settings

    def _client(self) -> tuple[Any, asyncio.Semaphore]:
        """One HTTP client and session cap per event loop (asyncio objects cannot cross loops)."""
        import httpx

        loop = asyncio.get_running_loop()
        if self._io is None or self._io[0] is not loop:
            limit = int(self.env_config.get("max_concurrent_envs", self.max_concurrent_envs))
            self._io = (loop, httpx.AsyncClient(timeout=self.timeout_s), asyncio.Semaphore(limit))
        return self._io[1], self._io[2]

    async def _post(self, url: str, payload: dict[str, Any]) -> dict[str, Any]:
        import httpx

        client, _ = self._client()
        for attempt in range(self.retries + 1):
            try:
                answer = await client.post(url, json=payload)
                if answer.status_code < 500:
                    if answer.status_code >= 400:
                        raise RemoteEnvError(f"POST {url} → {answer.status_code}: {answer.text[:200]}")
                    return answer.json()
                error: Exception = RemoteEnvError(f"POST {url} → {answer.status_code}: {answer.text[:200]}")
            except httpx.TransportError as e:
                error = e
            if attempt < self.retries:
                log.warning("remote env: %s; retry %d of %d", error, attempt + 1, self.retries)
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise RemoteEnvError(f"POST {url} failed after {self.retries + 1} attempts: {error}")

    async def on_trajectory_start(self, requests: list[RolloutRequest]) -> None:
        _, sessions = self._client()
        for request in requests:
            settings = self._settings(request.data_dict)
            base_url = settings["base_url"].rstrip("/")
            await sessions.acquire()  # released in on_trajectory_end, which always runs
            self.episodes[request.uuid] = EnvEpisode({"base_url": base_url, "session_id": None})
            payload = dict(settings.get("reset_kwargs") or {})
            if settings.get("seed") is not None:
                payload["seed"] = settings["seed"]
            answer = await self._post(f"{base_url}/reset", payload)
            self.episodes[request.uuid].env["session_id"] = answer.get("session_id")
            inject_observation(request, self.format_observation(answer.get("observation")),
                               settings.get("system_message"))

    async def on_turn_end(self, request: RolloutRequest, response: TurnResponse, turn: int) -> dict:
        episode = self.episodes[request.uuid]
        payload: dict[str, Any] = {"action": self.parse_action(response.text)}
        if episode.env["session_id"] is not None:
            payload["session_id"] = episode.env["session_id"]
        answer = await self._post(f"{episode.env['base_url']}/step", payload)
        done = bool(answer.get("done") or answer.get("terminated") or answer.get("truncated"))
        return episode.record(self.format_observation(answer.get("observation")), answer.get("reward"), done)

    def step(self, request: RolloutRequest, response: TurnResponse, turn: int) -> dict:
        request.messages.append({"role": "user", "content": self.episodes[request.uuid].observation})
        return {"infer_request": request}

    async def on_trajectory_end(self, requests: list[RolloutRequest], error: BaseException | None = None) -> None:
        _, sessions = self._client()
        for request in requests:
            episode = self.episodes.pop(request.uuid, None)
            if episode is None:
                continue
            try:
                if episode.env["session_id"] is not None:
                    await self._post(f"{episode.env['base_url']}/close", {"session_id": episode.env["session_id"]})
            finally:  # only once the server closed it: the next session must not overlap it (the cap)
                sessions.release()


BUILTIN_SCHEDULERS: dict[str, type[MultiTurnScheduler]] = {
    "math_tip_trick": MathTipTrick,
    "thinking_tips": ThinkingTips,
    "thinking_tips_scheduler": ThinkingTips,  # ms-swift's name
    "gym": GymScheduler,
    "gym_scheduler": GymScheduler,  # ms-swift's name
    "remote_env": RemoteEnvScheduler,
}
SCHEDULERS.update(BUILTIN_SCHEDULERS)
