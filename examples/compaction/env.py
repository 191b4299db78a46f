"""A report read page by page whose pages outgrow the context: the episode must be compacted to finish.

The task: read a report (one page per turn, whatever the model replies) and at the end answer one question, the
code written on the first page. Every page is long (~150 tokens of log lines), so by the second page the stream
passes `rollout.context.max_tokens` and the turn loop compacts it (`strategy: summarize`): the policy writes a
summary of what it read, and the episode goes on from the task and that summary alone. The last question is
answered from the summary: reward 1.0 when the final reply holds the code, else 0. What RL can teach: to keep the
code in the summary (and to answer with it).

Rows: `{id, prompt, code, seed}` (prepare_data.py).
"""

from __future__ import annotations

import random
from typing import Any

from turnrl.types import Message, StepResult, TerminationReason, Turn

QUESTION = "That was the last page. What is the access code written in the report? Reply with just the code."
SERVICES = ["auth", "billing", "cache", "db", "gateway", "mailer", "queue", "search", "storage", "worker"]


def page(rng: random.Random, k: int, code: str | None) -> str:
    """Page `k` of a report: log lines; the first one holds the code in the middle of its lines."""
    lines = [f"{rng.randint(10, 23)}:{rng.randint(10, 59)} {rng.choice(SERVICES)} {rng.choice(['ok', 'slow', 'retry'])} "
             f"{rng.randint(100, 999)}ms" for _ in range(10)]
    if code is not None:
        lines.insert(5, f"NOTE: the access code is {code}.")
    return f"Report page {k}:\n" + "\n".join(lines)


class ReportEnv:
    def __init__(self, code: str, seed: int, pages: int = 2):
        self.code, self.rng, self.pages, self.turn = code, random.Random(seed), pages, 0

    def reset(self) -> None:
        self.turn = 0

    def step_turn(self, turn: Turn) -> StepResult:
        """Token-aware (`step_turn`) only so that a reply cut at max_new_tokens does not end the episode: the report
        goes on whatever the model says, and the last reply is scored whether or not it was cut."""
        response_text = turn.text
        self.turn += 1
        if self.turn <= self.pages:
            return StepResult(page(self.rng, self.turn, self.code if self.turn == 1 else None))
        if self.turn == self.pages + 1:
            return StepResult(QUESTION)
        right = self.code in response_text
        return StepResult(reward=float(right), done=True, termination_reason=TerminationReason.ENV_DONE,
                          info={"right": right})

    def format_observation(self, observation: str) -> Message:
        return {"role": "user", "content": observation}


def build_env(sample: dict[str, Any], config: dict[str, Any]) -> ReportEnv:
    if "code" not in sample:
        raise KeyError("compaction example env: the row needs its 'code' (examples/compaction/prepare_data.py)")
    return ReportEnv(str(sample["code"]), int(sample.get("seed", 0)), int(config.get("pages", 2)))
