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
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from turnrl.loading import load_object
from turnrl.types import Message, StepResult, TerminationReason

EnvFactory = Callable[[dict[str, Any], dict[str, Any]], Any]

BUILTIN_ENVS: dict[str, str] = {
    "arithmetic": "turnrl.envs.arithmetic",
    "geo3k": "turnrl.envs.geo3k",
    "single_turn": "turnrl.envs.single_turn",
}
"""Short names accepted by `--env`, mapped to the modules that define `build_env`."""


class Env(Protocol):
    def reset(self) -> Any: ...
    def step(self, response_text: str) -> Any: ...
    def format_observation(self, observation: Any) -> Any: ...


class EnvError(RuntimeError):
    """An environment misbehaved (bad return value); the trajectory ends FAILED/env_error."""


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
    """A message, a list of messages or a string (a user message) → list of messages."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, dict) and "role" in value:
        return [value]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        return list(value)
    raise EnvError(f"{what} must return a chat message, a list of messages or a string; got {value!r:.100}")


async def observation_messages(env: Any, observation: Any) -> list[Message]:
    if observation is None:
        return []
    formatted = observation
    if hasattr(env, "format_observation"):
        formatted = await call(env.format_observation, observation)
    return as_messages(formatted, "env.format_observation")
