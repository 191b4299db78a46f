"""Arithmetic with retry feedback: the built-in environment a real 135M model can make progress in.

The model is asked `What is a + b? Reply with just the number.`; a wrong reply gets feedback and another
try, up to `max_turns`. Success = the LAST integer in the reply equals the answer and the reply has at most
3 integers ("7 + 2 = 9", "9" and "The answer is 9." pass; listing numbers does not). The reward pays for
getting it right early: `turn_rewards` (default 1.0 / 0.7 / 0.4 for turns 1 / 2 / 3), 0 otherwise.

Why this task for the CPU demo (measured on SmolLM2-135M-Instruct, see examples/arithmetic/README.md):
its most likely answer is usually right (greedy ≈ 80-90%), but at temperature 1 it often wanders off in
its first tokens (sampled success ≈ 20%): early success is possible but not common, the reward is exact
and cheap, and GRPO has a clear signal to sharpen within tens of steps.

Rows carry `a`, `b`, `op` and `answer` (`make_rows` writes them, deterministically by seed).
"""

from __future__ import annotations

import random
import re
from typing import Any

from turnrl.types import Message, StepResult, TerminationReason

INTEGER = re.compile(r"-?\d+")
NO_NUMBER = "Your reply has no number. Reply with just the number."
WRONG = "Wrong, try again. Reply with just the number."
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def check(reply: str, answer: int) -> tuple[bool, str]:
    """(success, feedback for a failure)."""
    numbers = INTEGER.findall(reply)
    if not numbers:
        return False, NO_NUMBER
    return (int(numbers[-1]) == answer and len(numbers) <= 3), WRONG


class ArithmeticEnv:
    def __init__(self, answer: int, max_turns: int = 3, turn_rewards: tuple[float, ...] = (1.0, 0.7, 0.4)):
        if max_turns < 1:
            raise ValueError(f"arithmetic env: max_turns must be >= 1, got {max_turns}")
        self.answer, self.max_turns, self.turn_rewards = answer, max_turns, tuple(turn_rewards)
        self.turn = 0

    def reset(self) -> None:
        self.turn = 0

    def step(self, response_text: str) -> StepResult:
        self.turn += 1
        success, feedback = check(response_text, self.answer)
        if success:
            reward = self.turn_rewards[self.turn - 1] if self.turn <= len(self.turn_rewards) else 0.0
            return StepResult(reward=reward, done=True, info={"success_turn": self.turn})
        if self.turn >= self.max_turns:
            return StepResult(reward=0.0, done=True, termination_reason=TerminationReason.MAX_TURNS,
                              info={"success_turn": None})
        return StepResult(observation=feedback, reward=0.0, info={"feedback": feedback})

    def format_observation(self, observation: str) -> Message:
        return {"role": "user", "content": observation}


def build_env(sample: dict[str, Any], config: dict[str, Any]) -> ArithmeticEnv:
    if "answer" not in sample:
        raise KeyError("arithmetic env: the row needs an integer 'answer' (see turnrl.envs.arithmetic.make_rows)")
    unknown = set(config) - {"max_turns", "turn_rewards"}
    if unknown:
        raise ValueError(f"arithmetic env: unknown config keys {sorted(unknown)} (known: max_turns, turn_rewards)")
    return ArithmeticEnv(int(sample["answer"]), config.get("max_turns", 3), config.get("turn_rewards", (1.0, 0.7, 0.4)))


def all_problems(ops: str = "+-", lo: int = 1, hi: int = 9) -> list[tuple[int, str, int]]:
    """Every (a, op, b) with operands in [lo, hi]; subtraction keeps a >= b."""
    return [(a, op, b) for op in ops for a in range(lo, hi + 1) for b in range(lo, hi + 1) if op != "-" or a >= b]


def make_rows(problems: list[tuple[int, str, int]]) -> list[dict[str, Any]]:
    return [{"id": f"{a}{'plus' if op == '+' else 'minus' if op == '-' else 'times'}{b}",
             "prompt": f"What is {a} {op} {b}? Reply with just the number.",
             "a": a, "b": b, "op": op, "answer": OPS[op](a, b)} for a, op, b in problems]


def split(ops: str = "+-", held_out_per_op: int = 24, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Disjoint train / held-out rows, deterministic by seed: `held_out_per_op` problems of each op held out."""
    train, held_out = [], []
    for op in ops:
        problems = all_problems(op)
        random.Random(seed).shuffle(problems)
        held_out += problems[:held_out_per_op]
        train += problems[held_out_per_op:]
    return make_rows(train), make_rows(held_out)
