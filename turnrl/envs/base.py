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
import contextlib
import difflib
import importlib
import inspect
import json
import logging
import math
import queue
import sysconfig
import threading
import traceback
import weakref
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

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

ECOSYSTEMS: dict[str, str] = {
    "reasoning_gym": "turnrl.envs.reasoning_gym",
    "openenv": "turnrl.envs.openenv",
    "openenv+http": "turnrl.envs.openenv",
    "openenv+https": "turnrl.envs.openenv",
    "textarena": "turnrl.envs.textarena",
}
"""`--env SCHEME:TARGET` for environments kept elsewhere (docs/ecosystems.md): each module's `env_factory(spec)`
returns the `build_env` of that target (`reasoning_gym:NAME`, `openenv:MODULE:CLASS`, `openenv+http://HOST:PORT`,
`textarena:GAME-v0`)."""


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


def error_with_frames(error: BaseException, frames: int = 3) -> str:
    """`Type: message` and where it was raised: the innermost of its traceback's last `frames` frames (outside
    Python's own library) with its source line, then the frames that called it, so a one-line report keeps the
    most useful part first. What a trajectory's `error` keeps of user code that raised (the whole traceback goes
    to the log at -v)."""
    head = f"{type(error).__name__}: {error}"
    stack = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_STDLIB)][-frames:]
    if not stack:  # never raised (a timeout or a malformed result, described by turnrl itself)
        return head
    inner, *outer = reversed(stack)
    where = f"{Path(inner.filename).name}:{inner.lineno} in {inner.name}" + (f": {inner.line}" if inner.line else "")
    called = "".join(f"; called from {Path(f.filename).name}:{f.lineno} in {f.name}" for f in outer)
    return f"{head} [at {where}{called}]"


_STDLIB = sysconfig.get_paths()["stdlib"]


class EnvStepError(EnvError):
    """env.step failed on every attempt; `timed_out` when the last attempt exceeded the time limit."""

    def __init__(self, cause: BaseException | None, attempts: int):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause, self.attempts = cause, attempts
        self.timed_out = isinstance(cause, TimeoutError)


def load_env_factory(spec: str) -> EnvFactory:
    """Find `build_env` in a built-in env name, a dotted module path, a `.py` file, or an ecosystem's target
    (`ECOSYSTEMS`). A factory may carry `opens_episode = True` (its env's `reset()` gives the first message, so
    rows need no prompt) and `check(config)` (called once at start-up with the env config: a bad config fails
    there, not in every trajectory)."""
    scheme = spec.partition(":")[0]
    if scheme in ECOSYSTEMS:
        module = importlib.import_module(ECOSYSTEMS[scheme])
        return module.env_factory(spec)
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


class EnvThreads:
    """The threads sync env methods run in: their own, never asyncio's shared default pool, and reused (a call
    hands its work to an idle thread; a thread starts only when none is idle, and one idle for `idle_s` ends).

    At most `size` calls run at once (the rollout sizes it to its concurrency); a call's timeout counts from
    when it starts running, never from when it was queued behind others: a call is handed over only once it
    holds a slot, and every call holding a slot has a thread of its own waiting for it. A call past its timeout
    (or cancelled) is abandoned: Python cannot kill a thread, so it runs on, but its thread no longer counts
    (a new one serves the freed slot: a hung env cannot starve the other trajectories), ends when the call
    returns, and, a daemon, never holds up process exit. A call abandoned before it started never runs."""

    def __init__(self, size: int = 64, idle_s: float = 30.0):
        if size < 1:
            raise ValueError(f"EnvThreads size must be >= 1, got {size}")
        self.size, self.idle_s = size, idle_s
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary())  # one per event loop: asyncio primitives belong to one loop
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job and not promised to one
        self.threads_started = 0
        """Threads started so far (each call used to start one; now only a burst past the idle ones does)."""

    async def run(self, fn: Callable, *args: Any, timeout_s: float | None = None) -> Any:
        loop = asyncio.get_running_loop()
        slots = self._slots.get(loop)
        if slots is None:
            slots = self._slots.setdefault(loop, asyncio.Semaphore(self.size))
        async with slots:
            job = _Job(loop, loop.create_future(), fn, args)
            self._submit(job)
            try:  # a timeout cancels the wait (not the thread's call) and frees the slot
                async with asyncio.timeout(timeout_s):  # one timer, no task (asyncio.wait_for made both)
                    return await job.done
            except BaseException:
                self._abandon(job)
                raise

    def _submit(self, job: _Job) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that thread is promised to this job
            else:
                self.threads_started += 1
        self._jobs.put(job)
        if start:
            threading.Thread(target=self._serve, daemon=True, name="turnrl-env").start()

    def _abandon(self, job: _Job) -> None:
        with self._lock:
            job.abandoned = not job.finished  # its thread ends after it instead of taking another job

    def _serve(self) -> None:
        """A worker thread: run jobs until one is abandoned under it, or none comes for `idle_s`."""
        while True:
            try:
                job = self._jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # no job is promised to this thread: it ends
                        self._idle -= 1
                        return
                continue  # a job was promised meanwhile: it is in the queue
            result, error = job.call() if not job.abandoned else (None, None)
            with self._lock:
                job.finished = True  # before the result is handed over: a finished call is never abandoned
                gone = job.abandoned
                if not gone:
                    self._idle += 1
            if gone:
                return
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits for it
                job.loop.call_soon_threadsafe(_settle, job.done, result, error)


class _Job:
    __slots__ = ("loop", "done", "fn", "args", "abandoned", "finished")

    def __init__(self, loop: asyncio.AbstractEventLoop, done: asyncio.Future, fn: Callable, args: tuple):
        self.loop, self.done, self.fn, self.args = loop, done, fn, args
        self.abandoned = self.finished = False

    def call(self) -> tuple[Any, BaseException | None]:
        try:
            return self.fn(*self.args), None
        except BaseException as e:  # handed to the awaiting coroutine
            return None, e


def _settle(done: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if done.done():  # timed out or cancelled meanwhile
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


DEFAULT_THREADS = EnvThreads()
"""For env calls outside a rollout (env factories, tests); a RolloutManager brings its own, sized to it."""


async def call(fn: Callable, *args: Any, timeout_s: float | None = None, threads: EnvThreads | None = None) -> Any:
    """Call a sync-or-async function: coroutines are awaited, sync functions run in `threads`; either way
    bounded by `timeout_s` from when it starts running (TimeoutError)."""
    if inspect.iscoroutinefunction(fn):
        async with asyncio.timeout(timeout_s):  # in this task: one timer, no task (asyncio.wait_for made both)
            return await fn(*args)
    result = await (threads or DEFAULT_THREADS).run(fn, *args, timeout_s=timeout_s)
    if inspect.isawaitable(result):
        async with asyncio.timeout(timeout_s):
            result = await result
    return result


async def maybe_await(value: Any) -> Any:
    """`value`, awaited when it is awaitable: what a hook that may be sync or async returned."""
    return await value if inspect.isawaitable(value) else value


def normalise_step(result: Any) -> StepResult:
    """Accept StepResult, slime's (observation, done, info) and gym's (observation, reward, done, info), and
    check what the trainer relies on: `done` a bool, the reward a finite number (or None), `info` a dict."""
    if isinstance(result, tuple) and len(result) == 3:
        observation, done, info = result
        step = StepResult(observation, _info(info).get("reward"), done, _info(info))
    elif isinstance(result, tuple) and len(result) == 4:
        observation, reward, done, info = result
        step = StepResult(observation, reward, done, _info(info))
    elif isinstance(result, StepResult):
        step = result
    else:
        raise EnvError("env.step must return a StepResult, (observation, done, info) or (observation, reward, "
                       f"done, info); got {type(result).__name__}")
    step.done = _as_bool(step.done)
    step.reward = _as_reward(step.reward)
    if step.termination_reason is None and step.info.get("termination_reason") is not None:
        step.termination_reason = TerminationReason(step.info["termination_reason"])
    return step


def _info(info: Any) -> dict[str, Any]:
    if info is None:
        return {}
    if not isinstance(info, dict):
        raise EnvError(f"env.step's info must be a dict (or None), got {type(info).__name__}")
    return dict(info)


def _as_bool(done: Any) -> bool:
    if isinstance(done, bool | np.bool_) or (type(done) is int and done in (0, 1)):
        return bool(done)
    raise EnvError(f"env.step's done must be a bool, got {done!r:.40} ({type(done).__name__})")


def _as_reward(reward: Any) -> float | None:
    if reward is None:
        return None
    if isinstance(reward, bool) or not isinstance(reward, int | float | np.number):
        raise EnvError(f"env.step's reward must be a number or None, got {reward!r:.40} ({type(reward).__name__})")
    if not math.isfinite(reward):
        raise EnvError(f"env.step returned a non-finite reward ({reward}); it would make the whole group's "
                       "advantages NaN, so this trajectory fails instead of being trained on")
    return float(reward)


ROLES = frozenset({"system", "user", "assistant", "tool"})
"""Message roles an env may return: chat templates drop others silently, so they are refused."""


def as_messages(value: Any, what: str) -> list[Message]:
    """A message, a list of messages or a string (a user message) → list of messages. Content given as text
    parts only (`[{"type": "text", "text": ...}]`, as slime's base env writes every observation) becomes the
    joined string: every chat template renders that the same way, and text-only templates render nothing else."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages = [value] if isinstance(value, dict) and "role" in value else value
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise EnvError(f"{what} must return a chat message, a list of messages or a string; got {value!r:.100}")
    for m in messages:
        if m["role"] not in ROLES:
            raise EnvError(f"{what} returned a message with role {m['role']!r}; roles are {', '.join(sorted(ROLES))}")
    return [_joined_text_parts(m) for m in messages]


def _joined_text_parts(message: Message) -> Message:
    content = message.get("content")
    if not isinstance(content, list) or not content:
        return message
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return message
    return {**message, "content": "".join(p["text"] for p in content)}


class EpisodeEnv:
    """One episode's environment as the driver sees it, built once per episode (`EpisodeEnv.of`): every optional
    method present, sync methods run in `threads`, step results normalised to `StepResult` and checked, a step
    bounded by a timeout and retried, errors naming the env. Nothing inside the turn loop probes the env."""

    def __init__(self, env: Env | TurnEnv, timeout_s: float | None = None, retries: int = 0,
                 threads: EnvThreads | None = None):
        self.env = env
        self.name = f"{type(env).__module__}.{type(env).__qualname__}"
        self.tools: list[dict] | None = getattr(env, "tools", None)
        self.token_aware = hasattr(env, "step_turn")  # isinstance(env, TurnEnv), without the Protocol's slow check
        """Token-aware envs get the `Turn` and see length-truncated turns (plain envs never do)."""
        self.opens_episode = bool(getattr(env, "opens_episode", False))
        """Its `reset()` gives the episode's first message (rows need no prompt)."""
        self.timeout_s, self.retries, self.threads = timeout_s, retries, threads
        if getattr(env, "waits_for_others", False):  # a seat of a game (turnrl.envs.seats): its step holds the other
            self.timeout_s = None                    # seats' model turns; the table bounds its own game calls

    @classmethod
    def of(cls, env: Any, timeout_s: float | None = None, retries: int = 0,
           threads: EnvThreads | None = None) -> EpisodeEnv:
        if isinstance(env, EpisodeEnv):
            return env
        if callable(getattr(env, "seats", None)):
            raise EnvError(f"{type(env).__name__} is a game the policy plays in every seat (a turnrl.envs.seats Table): "
                           "the env_agent drives its seats; another agent or a scheduler cannot")
        if env is None or not (callable(getattr(env, "step", None)) or callable(getattr(env, "step_turn", None))):
            raise EnvError(f"an environment needs a step(response_text) method; got {type(env).__name__} (does "
                           "build_env return the env?)")
        return cls(env, timeout_s, retries, threads)

    async def reset(self) -> list[Message]:
        """Extra prompt messages from `reset()` (slime's reset returns (obs, info), which it ignores)."""
        reset = getattr(self.env, "reset", None)
        extra = await self._call(reset) if reset is not None else None
        self.tools = getattr(self.env, "tools", None)  # an env may learn its tools in reset (an MCP environment)
        return self._messages(extra, "reset") if isinstance(extra, dict | list) else []

    async def step(self, turn: Turn) -> tuple[StepResult, int]:
        """Step with the turn (token-aware envs) or its text, retried: (result, attempts). Raises EnvStepError
        after the last failed attempt."""
        env: Any = self.env
        fn, arg = (env.step_turn, turn) if self.token_aware else (env.step, turn.text)
        error: BaseException | None = None
        for attempt in range(1, self.retries + 2):
            try:
                return normalise_step(await self._call(fn, arg, timeout_s=self.timeout_s)), attempt
            except TimeoutError:
                error = TimeoutError(f"{self.name}.step exceeded env_timeout_s={self.timeout_s}")
            except EnvError as e:  # a malformed result: the same env would return it again
                raise EnvStepError(EnvError(f"{self.name}: {e}"), attempt) from None
            except Exception as e:
                error = e
            if attempt <= self.retries:
                log.warning("%s.step failed (%s); retry %d of %d", self.name, error, attempt, self.retries)
        raise EnvStepError(error, self.retries + 1)

    async def observation(self, observation: Any) -> list[Message]:
        """The chat messages of an observation (`format_observation` when the env has one)."""
        if observation is None:
            return []
        fmt = getattr(self.env, "format_observation", None)
        formatted = await self._call(fmt, observation) if fmt is not None else observation
        return self._messages(formatted, "format_observation")

    @property
    def closes(self) -> bool:
        """`close` does something: the env has a close() (or a subclass has its own `close`)."""
        return getattr(self.env, "close", None) is not None or type(self).close is not EpisodeEnv.close

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            await self._call(close, timeout_s=self.timeout_s)

    async def _call(self, fn: Callable, *args: Any, timeout_s: float | None = None) -> Any:
        return await call(fn, *args, timeout_s=timeout_s, threads=self.threads)

    def _messages(self, value: Any, method: str) -> list[Message]:
        return as_messages(value, f"{self.name}.{method}")


def episode_settings(sample: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """One episode's env settings: the rollout's env config with the row's `env_config` column over it."""
    row = sample.get("env_config") or {}
    if not isinstance(row, dict):
        raise EnvError(f"the row's env_config must be a mapping of env settings, got {row!r:.60}")
    return {**config, **row}


def episode_seed(sample: dict[str, Any]) -> int:
    """The row's `seed`, else a seed derived from the row itself (its `id`, else its columns): the n samples of a
    group play the same episode, and the same row replays the same episode."""
    seed = sample.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise EnvError(f"the row's seed must be an integer >= 0, got {seed!r:.40}")
        return seed
    key = sample.get("id")
    if key is None:
        key = json.dumps({k: v for k, v in sample.items() if k != "session_id"}, sort_keys=True, default=str)
    return zlib.crc32(str(key).encode())
