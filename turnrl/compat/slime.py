"""slime's names for turnrl's environment contract: a slime interaction env ports by changing its imports.

    from slime.utils.types import Sample                        →  from turnrl.compat.slime import Sample
    from slime.rollout.rm_hub import grade_answer_verl          →  from turnrl.compat.slime import grade_answer_verl
    from slime.rollout.rm_hub.math_utils import extract_answer  →  from turnrl.compat.slime import extract_answer

A slime reward function (`--custom-rm-path`: `async def reward_func(args, sample, **kwargs)`, or batched
`(args, samples)`) runs with `--reward file.py:reward_func`: `reward_caller` recognises the signature and passes
the finished trajectory as a `Sample` (`reward_sample`: `.prompt`, `.response`, `.label`, `.tokens`, ...).

turnrl calls `build_env(sample, config)` with the row as a `Sample` and the rollout's env config (the
`--custom-config` YAML under `env_config`) as an `Args`. Both are dicts that also read by attribute, so an env
written for turnrl (`sample["answer"]`, `config.get("max_turns")`) and one written for slime (`sample.label`,
`args.max_turns`) run on the same call, with no mode to pick. The env file's folder is importable (sibling
imports), and so is the current directory when the file lies under it, so slime's `from examples.x.base_env
import ...` works run from the repository root (turnrl.loading).
"""

from __future__ import annotations

import re
from typing import Any

from turnrl.calling import (
    Args,
    Sample,
    SampleStatus,
    env_arguments,
    reward_args,
    reward_caller,
    reward_sample,
)
from turnrl.rewards.math import last_boxed, math_equal

# What slime's envs and reward functions are called with lives in turnrl.calling (a core concept).


# ---- slime's graders -------------------------------------------------------------------------------
def extract_answer(passage: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) of `passage`; None when it has none
    (slime's `rm_hub.math_utils.extract_answer`)."""
    return last_boxed(passage) if passage and ("\\boxed" in passage or "\\fbox" in passage) else None


def grade_answer_verl(solution_str: str, ground_truth: Any) -> bool:
    """Whether the last `\\boxed{}` of `solution_str` equals `ground_truth` (itself boxed or not), as slime's
    `grade_answer_verl`: False without a boxed answer or without a ground truth. Equality is math-verify's
    (turnrl.rewards.math_equal), falling back to normalised text when the reference cannot be parsed."""
    if ground_truth is None or not str(ground_truth).strip():
        return False
    truth = str(ground_truth)
    if "\\boxed" in truth:
        truth = extract_answer(truth) or truth
    given = extract_answer(str(solution_str))
    if given is None:
        return False
    try:
        return math_equal(given, truth)
    except ValueError:  # a reference math-verify cannot read: compare the text
        return _plain(given) == _plain(truth)


def _plain(answer: str) -> str:
    return re.sub(r"\s+", "", answer).strip("$").rstrip(".").lower()


__all__ = ["Args", "Sample", "SampleStatus", "env_arguments", "extract_answer", "grade_answer_verl", "reward_args",
           "reward_caller", "reward_sample"]
