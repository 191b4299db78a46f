"""Reward functions and their calling convention.

A reward function is a plain function (sync or async) that returns a float. Its parameters are filled by
name, so it asks only for what it needs:

    def my_reward(response: str, answer: str) -> float: ...          # `answer` is a dataset column
    async def judge(messages, sample, **rollout_infos) -> float: ...

Names it may ask for:
- `trajectory`: the Trajectory itself
- `messages`: the whole conversation (assistant text decoded from its tokens)
- `response`: the final assistant reply; `responses`: every assistant reply, in order (model text only,
  never env or tool text: slime's geo3k reward read a `\\boxed{}` out of env feedback)
- `sample`: the dataset row; any column of it by its own name (e.g. `answer`, `solution`)
- `info`: the trajectory's info dict; `turn_rewards`: rewards the env/tools reported per step
- `tool_rewards`: {tool name: calc_reward()} of stateful tools; `num_turns`, `status`, `termination_reason`
- any key of the trajectory's `rollout_infos` (scheduler/env infos), by name or through `**kwargs`
- verl's names, so a verl `compute_score(data_source, solution_str, ground_truth, extra_info=None)` is called as
  it is: `solution_str` (the final reply) and `ground_truth` (`reward_model.ground_truth`), unless the row has
  columns of those names (turnrl.compat.verl.reward_arguments)

Rewards are computed by the RolloutManager as each trajectory finishes (streamed, overlapping the rest of
the rollout). A reward function that raises leaves the reward None with the error recorded; it is never
silently scored 0.0.
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
from collections.abc import Callable
from typing import Any

from math_verify import parse, verify

from turnrl.types import Trajectory

RewardFunction = Callable[..., Any]


# ---- math answer checking --------------------------------------------------------------------------
def last_boxed(text: str) -> str | None:
    """Content of the last complete (brace-balanced) `\\boxed{...}` or `\\fbox{...}` in text."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def _normalise_answer(answer: str) -> str:
    answer = answer.strip().strip("$").strip()
    # Forms math-verify misreads: "30°" (unparsed) and a bare "pi" (read as p*i).
    answer = answer.replace("°", "^\\circ")
    return re.sub(r"(?<![\\a-zA-Z])pi(?![a-zA-Z])", r"\\pi", answer)


def _timeout_s() -> int | None:
    # math-verify's timeouts use signal.alarm, which only works on the main thread; calls from worker
    # threads (sync envs run in asyncio.to_thread) run without them (and math-verify's warning about it is
    # silenced below: it would fire on every call).
    return 5 if threading.current_thread() is threading.main_thread() else None


class _NoDisabledTimeoutWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).addFilter(_NoDisabledTimeoutWarning())


def _parse(answer: str) -> list[Any]:
    return parse(f"\\boxed{{{_normalise_answer(answer)}}}", parsing_timeout=_timeout_s())


def reference_parses(answer: str) -> bool:
    """Whether math-verify can read a reference answer (checked when data is loaded, not at scoring time)."""
    return bool(_parse(str(answer)))


def math_equal(candidate: str, answer: str) -> bool:
    """Whether a candidate answer (raw, `$...$` or `\\boxed{...}`) equals the reference under math-verify.

    Raises ValueError when the reference itself cannot be parsed (a data bug, not a wrong answer).
    """
    boxed = last_boxed(candidate)
    if boxed is not None:
        candidate = boxed
    if not candidate.strip():
        return False
    gold = _parse(str(answer))
    if not gold:
        raise ValueError(f"reference answer {answer!r} cannot be parsed by math-verify")
    return bool(verify(gold, _parse(candidate), timeout_seconds=_timeout_s()))


def boxed_answer_reward(responses: list[str], answer: str) -> float:
    """1.0 when the last `\\boxed{}` across the model's own replies matches `answer`, else 0.0."""
    for text in reversed(responses):
        boxed = last_boxed(text)
        if boxed is not None:
            return 1.0 if math_equal(boxed, answer) else 0.0
    return 0.0


# ---- built-in reward functions ---------------------------------------------------------------------
def env_reward(turn_rewards: list[float]) -> float:
    """Sum of the rewards the environment reported over the episode (0 when it reported none)."""
    return float(sum(turn_rewards))


def env_last_reward(turn_rewards: list[float]) -> float:
    """The last reward the environment reported (0 when it reported none)."""
    return float(turn_rewards[-1]) if turn_rewards else 0.0


def format_reward(response: str) -> float:
    """1.0 when the final reply ends its answer with a `\\boxed{...}`."""
    return 1.0 if last_boxed(response) is not None else 0.0


BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "env": env_reward,
    "env_last": env_last_reward,
    "math": boxed_answer_reward,
    "format": format_reward,
}


# ---- calling convention ----------------------------------------------------------------------------
def reward_kwargs(traj: Trajectory) -> dict[str, Any]:
    """Everything a reward function may ask for by name (see the module docstring)."""
    responses = [m["content"] for m in traj.messages if m.get("role") == "assistant" and isinstance(m.get("content"), str)]
    rollout_infos = dict(traj.rollout_infos)
    named = {
        "trajectory": traj, "messages": traj.messages, "responses": responses,
        "response": responses[-1] if responses else "", "sample": traj.sample, "info": traj.info,
        "turn_rewards": traj.turn_rewards, "tool_rewards": traj.tool_rewards,
        "num_turns": traj.num_turns, "status": str(traj.status),
        "termination_reason": None if traj.termination_reason is None else str(traj.termination_reason),
        "rollout_infos": rollout_infos,
    }
    from turnrl.compat.verl import reward_arguments

    verl_names = reward_arguments(traj.sample, responses[-1] if responses else "")
    return {**verl_names, **traj.sample, **rollout_infos, **named}


def bind_reward(fn: RewardFunction, name: str | None = None) -> Callable[[Trajectory], Any]:
    """Wrap `fn` so it is called with the arguments it names; a missing one is a clear error."""
    sig = inspect.signature(fn)
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    label = name or str(getattr(fn, "__name__", repr(fn)))

    def call(traj: Trajectory) -> Any:
        available = reward_kwargs(traj)
        args = {}
        for pname, p in sig.parameters.items():
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            if pname in available:
                args[pname] = available[pname]
            elif p.default is p.empty:
                raise TypeError(
                    f"reward function {label!r} needs argument {pname!r}, which is neither a built-in name, a "
                    f"dataset column ({sorted(traj.sample)}) nor a rollout info"
                )
        if takes_kwargs:
            args.update({k: v for k, v in available.items() if k not in args})
        return fn(**args)

    call.__name__ = label
    return call


def load_reward_fn(spec: str, format_weight: float = 0.0) -> Callable[[Trajectory], Any]:
    """A built-in name (env, env_last, math, format) or `path.py:fn` / `pkg.module:fn`, optionally plus
    `format_weight` × format reward."""
    if spec in BUILTIN_REWARDS:
        main = bind_reward(BUILTIN_REWARDS[spec], spec)
    else:
        from turnrl.loading import load_object

        if ":" not in spec:
            raise ValueError(
                f"reward {spec!r}: expected one of {sorted(BUILTIN_REWARDS)} or path.py:function / pkg.module:function"
            )
        main = bind_reward(load_object(spec, what="reward"), spec)
    if not format_weight:
        return main
    fmt = bind_reward(format_reward)

    async def combined(traj: Trajectory) -> float:
        value = main(traj)
        if inspect.isawaitable(value):
            value = await value
        return float(value) + format_weight * fmt(traj)

    return combined
