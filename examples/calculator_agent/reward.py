"""1.0 when the last integer of the model's final reply is the answer (commas allowed: 1,776), else 0.0."""

from __future__ import annotations

import re

INTEGER = re.compile(r"-?\d[\d,]*")


def calculator_reward(response: str, answer: int) -> float:
    found = [n.replace(",", "") for n in INTEGER.findall(response)]
    found = [n for n in found if n.lstrip("-").isdigit()]
    return 1.0 if found and int(found[-1]) == int(answer) else 0.0
