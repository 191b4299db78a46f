"""Math answer checking with math-verify: the last `\\boxed{}` of a text and answer equality (the built-in
graders' and slime's `grade_answer_verl`)."""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from math_verify import parse, verify


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
