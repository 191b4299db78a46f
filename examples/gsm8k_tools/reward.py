"""Reward of the recipe: the final `#### <number>` (or `\\boxed{}`) of the model's last reply vs the ground truth."""

from __future__ import annotations

import re

from turnrl.rewards import last_boxed, math_equal

FINAL = re.compile(r"####\s*(-?[\d,\.]+)")


def gsm8k_reward(response: str, answer: str) -> float:
    found = FINAL.findall(response)
    candidate = found[-1].replace(",", "") if found else last_boxed(response)
    return 1.0 if candidate is not None and math_equal(candidate, answer) else 0.0
