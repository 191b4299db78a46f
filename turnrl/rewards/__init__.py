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
- `info`: the trajectory's info dict; `turn_rewards`: rewards the env/tools reported per step (of the whole
  episode, when a scheduler split it into several samples: they share its reward)
- `tool_rewards`: {tool name: calc_reward()} of stateful tools; `num_turns`, `status`, `termination_reason`
- any key of the trajectory's `rollout_infos` (scheduler/env infos), by name or through `**kwargs`
- verl's names, so a verl `compute_score(data_source, solution_str, ground_truth, extra_info=None)` is called as
  it is: `solution_str` (the whole response decoded, as verl's reward managers decode it: every turn after the
  prompt, tool and env outputs included), `ground_truth` (`reward_model.ground_truth`), unless the row has columns
  of those names, and `extra_info` (the row's, plus verl's `num_turns` and `rollout_reward_scores`)
  (turnrl.calling.reward_arguments)

A slime reward function, `async def reward_func(args, sample, **kwargs)` (or batched: `(args, samples)`), is
recognised by its first two parameter names and called as slime calls it (turnrl.calling.reward_caller).

Rewards are computed by the RolloutManager as each trajectory finishes (streamed, overlapping the rest of
the rollout). A reward function that raises leaves the reward None with the error recorded; it is never
silently scored 0.0.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from turnrl.calling import reward_arguments, reward_caller
from turnrl.rewards.math import last_boxed, math_equal, reference_parses
from turnrl.types import Trajectory

RewardFunction = Callable[..., Any]
__all__ = ["last_boxed", "math_equal", "reference_parses"]  # (with the rest: from turnrl.rewards.math)


def reference_answer(sample: dict[str, Any], answer_key: str | None = None) -> Any:
    """The ground truth of a row for the built-in graders: the `answer_key` column when one is given (other than
    the default `answer`), else the `answer` column, else `label` (slime's key), else verl's
    `reward_model.ground_truth`."""
    if answer_key and answer_key != "answer":
        if answer_key not in sample:
            raise KeyError(f"reward.answer_key {answer_key!r}: the row has no such column (columns: {sorted(sample)})")
        return sample[answer_key]
    for key in ("answer", "label"):
        if key in sample:
            return sample[key]
    reward_model = sample.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        return reward_model["ground_truth"]
    raise KeyError(f"no ground truth in the row: it has no `answer`, `label` or `reward_model.ground_truth` "
                   f"(columns: {sorted(sample)}); name the column with reward.answer_key (--answer-key)")


def math_reward(responses: list[str], sample: dict[str, Any], answer_key: str | None = None) -> float:
    """The built-in `math`: `boxed_answer_reward` against the row's `reference_answer`."""
    return boxed_answer_reward(responses, str(reference_answer(sample, answer_key)))


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
    "math": math_reward,
    "format": format_reward,
}


# ---- calling convention ----------------------------------------------------------------------------
def reward_kwargs(traj: Trajectory, tokenizer: Any = None) -> dict[str, Any]:
    """Everything a reward function may ask for by name (see the module docstring). verl's `solution_str` is
    there only with the policy's `tokenizer` (it is the response tokens decoded)."""
    responses = [m["content"] for m in traj.messages if m.get("role") == "assistant" and isinstance(m.get("content"), str)]
    rollout_infos = dict(traj.rollout_infos)
    named = {
        "trajectory": traj, "messages": traj.messages, "responses": responses,
        "response": responses[-1] if responses else "", "sample": traj.sample, "info": traj.info,
        "turn_rewards": rollout_infos.get("episode_turn_rewards", traj.turn_rewards),  # a split episode's: all
        "tool_rewards": traj.tool_rewards,
        "num_turns": traj.num_turns, "status": str(traj.status),
        "termination_reason": None if traj.termination_reason is None else str(traj.termination_reason),
        "rollout_infos": rollout_infos,
    }
    verl_names = reward_arguments(traj, tokenizer)
    extra_info = {"extra_info": verl_names.pop("extra_info")}  # verl's, which adds to the row's column of that name
    return {**verl_names, **traj.sample, **extra_info, **rollout_infos, **named}


def bind_reward(fn: RewardFunction, name: str | None = None, tokenizer: Any = None,
                answer_key: str | None = None) -> Callable[[Trajectory], Any]:
    """Wrap `fn` so it is called with the arguments it names; a missing one is a clear error. `tokenizer` (the
    policy's) decodes the response for verl's `solution_str` and slime's `sample.response`; `answer_key` is
    `reward.answer_key` (the built-in graders' and slime's `sample.label` column)."""
    label = name or str(getattr(fn, "__name__", repr(fn)))
    slime_call = reward_caller(fn, label, tokenizer, answer_key)
    if slime_call is not None:
        return slime_call
    sig = inspect.signature(fn)
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    if "solution_str" in sig.parameters and tokenizer is None:
        raise ValueError(f"reward function {label!r} takes verl's solution_str (the decoded response): bind it with "
                         "the policy's tokenizer (bind_reward(fn, tokenizer=...))")

    def call(traj: Trajectory) -> Any:
        available = reward_kwargs(traj, tokenizer)
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


def load_reward_fn(spec: str, format_weight: float = 0.0, *, tokenizer: Any = None,
                   answer_key: str | None = None) -> Callable[[Trajectory], Any]:
    """A built-in name (env, env_last, math, format) or `path.py:fn` / `pkg.module:fn`, optionally plus
    `format_weight` × format reward; `tokenizer` and `answer_key` as in `bind_reward`."""
    if spec in BUILTIN_REWARDS:
        builtin = BUILTIN_REWARDS[spec]
        if answer_key and "answer_key" in inspect.signature(builtin).parameters:
            builtin = functools.partial(builtin, answer_key=answer_key)
        main = bind_reward(builtin, spec)
    else:
        from turnrl.loading import load_object

        if ":" not in spec:
            raise ValueError(
                f"reward {spec!r}: expected one of {sorted(BUILTIN_REWARDS)} or path.py:function / pkg.module:function"
            )
        main = bind_reward(load_object(spec, what="reward"), spec, tokenizer, answer_key)
    if not format_weight:
        return main
    fmt = bind_reward(format_reward)

    async def combined(traj: Trajectory) -> float:
        value = main(traj)
        if inspect.isawaitable(value):
            value = await value
        return float(value) + format_weight * fmt(traj)

    return combined
