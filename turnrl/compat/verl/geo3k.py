"""verl's geo3k rule reward (`verl.utils.reward_score.geo3k`), graded with math-verify (turnrl.rewards).

    format_reward(predict_str) -> 1.0 when the text is `<think>...</think>` followed by a `\\boxed{...}`, else 0.0
    acc_reward(predict_str, ground_truth, use_boxed=True) -> 1.0 when the (boxed) answer equals the ground truth
    compute_score(predict_str, ground_truth, use_boxed=True, format_score=0.1)
        = (1 - format_score) * acc_reward + format_score * format_reward
"""

from __future__ import annotations

import re

from turnrl.rewards import last_boxed, math_equal

_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_reward(predict_str: str) -> float:
    return 1.0 if _FORMAT.fullmatch(predict_str) else 0.0


def acc_reward(predict_str: str, ground_truth: str, use_boxed: bool = True) -> float:
    answer = (last_boxed(predict_str) or "") if use_boxed else predict_str
    try:
        return 1.0 if answer.strip() and math_equal(answer, str(ground_truth)) else 0.0
    except ValueError:  # a reference math-verify cannot read: compare the text
        return 1.0 if answer.strip() == str(ground_truth).strip() else 0.0


def compute_score(predict_str: str, ground_truth: str, use_boxed: bool = True, format_score: float = 0.1) -> float:
    return ((1.0 - format_score) * acc_reward(predict_str, ground_truth, use_boxed)
            + format_score * format_reward(predict_str))
