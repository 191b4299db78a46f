"""The environment contract (slime-compatible) and `load_env_factory`, which finds `build_env` by name or path.

A user environment is message-level and never sees tokens:

    def build_env(sample: dict, config: dict) -> Env          # module-level factory

    class Env:
        def reset(self) -> None | Message | list[Message]     # optional extra prompt messages
        def step(self, response_text: str) -> StepResult | (observation, done, info)
                                                              #   | (observation, reward, done, info)
        def format_observation(self, observation) -> Message | list[Message] | str
        def close(self) -> None                               # optional

Every method may be sync or `async`. Sync methods run in a worker thread so a slow env never blocks the
event loop that other trajectories generate on. The driver (turnrl.rollout.drive) owns rendering,
limits, timeouts and retries, so an env stays a few dozen lines.
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from turnrl.loading import load_object
from turnrl.types import Message, StepResult, TerminationReason, Turn

log = logging.getLogger(__name__)

EnvFactory = Callable[[dict[str, Any], dict[str, Any]], Any]

BUILTIN_ENVS: dict[str, str] = {
    "arithmetic": "turnrl.envs.arithmetic",
    "geo3k": "turnrl.envs.geo3k",
    "single_turn": "turnrl.envs.single_turn",
}
"""Short names accepted by `--env`, mapped to the modules that define `build_env`."""


class Env(Protocol):
    """A message-level environment (slime's contract). Only `step` is required; `reset`, `format_observation`,
    `close` and a `tools` attribute (JSON schemas rendered into the prompt) are optional. Any method may be async."""

    def step(self, response_text: str) -> Any: ...


@runtime_checkable
class TurnEnv(Protocol):
    """A token-aware environment (schedulers): it gets the whole `Turn` (tokens, logprobs, finish reason, the
    conversation) instead of the reply text, may return token edits, and decides itself whether a
    length-truncated turn ends the episode."""

    def step_turn(self, turn: Turn) -> Any: ...


class EnvError(RuntimeError):
    """An environment misbehaved (bad return value); the trajectory ends FAILED/env_error."""


class EnvStepError(EnvError):
    """env.step failed on every attempt; `timed_out` when the last attempt exceeded the time limit."""

    def __init__(self, cause: BaseException | None, attempts: int):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause, self.attempts = cause, attempts
        self.timed_out = isinstance(cause, TimeoutError)


def load_env_factory(spec: str) -> EnvFactory:
    """Find `build_env` in a built-in env name, a dotted module path, or a `.py` file."""
    target = f"{BUILTIN_ENVS.get(spec, spec)}:build_env"
    try:
        return load_object(target, what="environment", expected="build_env(sample, config) function")
    except ModuleNotFoundError as e:
        if not spec.isidentifier() or e.name != spec:
            raise
        file = Path(f"{spec}.py")
        close = [file.name] if file.is_file() else difflib.get_close_matches(spec, BUILTIN_ENVS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        builtins = ", ".join(BUILTIN_ENVS)
        raise ModuleNotFoundError(
            f"unknown environment {spec!r}: not a built-in ({builtins}), a module or a .py file{hint}", name=spec
        ) from None


async def call(fn: Callable, *args: Any) -> Any:
    """Call a sync-or-async function: coroutines are awaited, sync functions run in a thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await asyncio.to_thread(fn, *args)
    if inspect.isawaitable(result):
        result = await result
    return result


def normalise_step(result: Any) -> StepResult:
    """Accept StepResult, slime's (observation, done, info) and gym's (observation, reward, done, info)."""
    if isinstance(result, StepResult):
        return result
    if isinstance(result, tuple) and len(result) == 3:
        observation, done, info = result
        info = dict(info or {})
        return StepResult(observation, info.get("reward"), bool(done), info, _reason(info))
    if isinstance(result, tuple) and len(result) == 4:
        observation, reward, done, info = result
        info = dict(info or {})
        return StepResult(observation, reward, bool(done), info, _reason(info))
    raise EnvError(
        "env.step must return a StepResult, (observation, done, info) or (observation, reward, done, info); "
        f"got {type(result).__name__}"
    )


def _reason(info: dict[str, Any]) -> TerminationReason | None:
    reason = info.get("termination_reason")
    return None if reason is None else TerminationReason(reason)


def as_messages(value: Any, what: str) -> list[Message]:
    """A message, a list of messages or a string (a user message) → list of messages. Content given as text
    parts only (`[{"type": "text", "text": ...}]`, as slime's base env writes every observation) becomes the
    joined string: every chat template renders that the same way, and text-only templates render nothing else."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, dict) and "role" in value:
        return [_joined_text_parts(value)]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        return [_joined_text_parts(m) for m in value]
    raise EnvError(f"{what} must return a chat message, a list of messages or a string; got {value!r:.100}")


def _joined_text_parts(message: Message) -> Message:
    content = message.get("content")
    if not isinstance(content, list) or not content:
        return message
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return message
    return {**message, "content": "".join(p["text"] for p in content)}


class EpisodeEnv:
    """One episode's environment as the driver sees it, built once per episode (`EpisodeEnv.of`): every optional
    method present, sync methods run in a thread, step results normalised to `StepResult`, a step bounded by a
    timeout and retried. Nothing inside the turn loop probes the env."""

    def __init__(self, env: Env | TurnEnv, timeout_s: float | None = None, retries: int = 0):
        self.env = env
        self.tools: list[dict] | None = getattr(env, "tools", None)
        self.token_aware = isinstance(env, TurnEnv)
        """Token-aware envs get the `Turn` and see length-truncated turns (plain envs never do)."""
        self.timeout_s, self.retries = timeout_s, retries

    @classmethod
    def of(cls, env: Any, timeout_s: float | None = None, retries: int = 0) -> EpisodeEnv:
        if isinstance(env, EpisodeEnv):
            return env
        if env is None or not (callable(getattr(env, "step", None)) or callable(getattr(env, "step_turn", None))):
            raise EnvError(f"an environment needs a step(response_text) method; got {type(env).__name__}")
        return cls(env, timeout_s, retries)

    async def reset(self) -> list[Message]:
        """Extra prompt messages from `reset()` (slime's reset returns (obs, info), which it ignores)."""
        reset = getattr(self.env, "reset", None)
        extra = await call(reset) if reset is not None else None
        return as_messages(extra, "env.reset") if isinstance(extra, dict | list) else []

    async def step(self, turn: Turn) -> tuple[StepResult, int]:
        """Step with the turn (token-aware envs) or its text, retried: (result, attempts). Raises EnvStepError
        after the last failed attempt."""
        env: Any = self.env
        fn, arg = (env.step_turn, turn) if self.token_aware else (env.step, turn.text)
        error: BaseException | None = None
        for attempt in range(1, self.retries + 2):
            try:
                return normalise_step(await asyncio.wait_for(call(fn, arg), self.timeout_s)), attempt
            except TimeoutError:
                error = TimeoutError(f"env.step exceeded env_timeout_s={self.timeout_s}")
            except Exception as e:
                error = e
            if attempt <= self.retries:
                log.warning("env.step failed (%s); retry %d of %d", error, attempt, self.retries)
        raise EnvStepError(error, self.retries + 1)

    async def observation(self, observation: Any) -> list[Message]:
        """The chat messages of an observation (`format_observation` when the env has one)."""
        if observation is None:
            return []
        fmt = getattr(self.env, "format_observation", None)
        formatted = await call(fmt, observation) if fmt is not None else observation
        return as_messages(formatted, "env.format_observation")

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            await call(close)
