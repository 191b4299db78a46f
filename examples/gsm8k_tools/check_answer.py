"""A stateful answer-checking tool (verl's Gsm8kTool, with the per-trajectory lifecycle verl lost).

One instance per trajectory: `create` receives the row's ground truth, each `execute` grades a candidate,
`calc_reward` (called when the episode ends) is 1.0 if the last checked answer was right.
"""

from __future__ import annotations

from turnrl.rewards import math_equal
from turnrl.tools import StatefulToolBase


class CheckAnswer(StatefulToolBase):
    schema = {
        "type": "function",
        "function": {
            "name": "check_answer",
            "description": "Check a final numeric answer. Use it at most once.",
            "parameters": {"type": "object", "properties": {"answer": {"type": "string", "description": "the answer"}},
                           "required": ["answer"]},
        },
    }

    async def create(self, ground_truth: str) -> None:
        self.ground_truth, self.last_correct, self.calls = ground_truth, False, 0

    async def execute(self, arguments: dict) -> tuple[str, float]:
        self.calls += 1
        self.last_correct = math_equal(str(arguments["answer"]), self.ground_truth)
        if self.calls > 1:
            return "check_answer may be used once; give your final answer now.", 0.0
        return ("correct" if self.last_correct else "incorrect, try again"), 0.0

    async def calc_reward(self) -> float:
        return 1.0 if self.last_correct else 0.0
