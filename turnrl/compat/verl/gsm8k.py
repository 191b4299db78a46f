"""verl's GSM8K rule reward (`verl.utils.reward_score.gsm8k`): the same answers score the same.

    extract_solution(solution_str, method="strict" | "flexible") -> str | None
    compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0) -> float

Only the last 300 characters are searched (the answer sits at the end; long texts make the regexes slow).
"strict" takes the last `#### <number>` (commas and `$` removed); "flexible" takes the last number-like run
that is not just "." (kept as written, commas included). The answer scores `score` when it equals
`ground_truth` as text, `format_score` when it differs, and 0 when there is none.
"""

from __future__ import annotations

import re

_TAIL_CHARS = 300
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-_TAIL_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    numbers = _NUMBER.findall(tail)
    if not numbers:
        return None
    meaningful = [n for n in numbers if n not in ("", ".")]
    return meaningful[-1] if meaningful else numbers[0]


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score
