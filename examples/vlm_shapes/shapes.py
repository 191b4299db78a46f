"""Generated pictures of shapes to count, and the environment that asks for the count with feedback.

A picture is 64×64 pixels: a 4×4 grid of 16-pixel cells, `n` of them (1 to 6) holding a circle, square or
triangle of a random colour and size. The built-in `smollm2-llava` sees it as 16 image tokens, one per cell.

The environment asks how many shapes there are. A wrong count gets feedback that says which way it is off
(`Wrong: there are more than 3 shapes.`) and another try, up to `max_turns`; the reward is 1.0, 0.5 or 0.25 for
the right count at turn 1, 2 or 3, else 0.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from turnrl.types import Message, StepResult, TerminationReason

SIZE, CELL = 64, 16
COLOURS = ["red", "blue", "green", "orange", "purple", "black"]
QUESTION = "How many shapes are in the image? Reply with just the number."
INTEGER = re.compile(r"-?\d+")


def draw(rng: random.Random, n: int) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), "white")
    pen = ImageDraw.Draw(image)
    for cell in rng.sample(range((SIZE // CELL) ** 2), n):
        x0, y0 = (cell % (SIZE // CELL)) * CELL, (cell // (SIZE // CELL)) * CELL
        side = rng.randint(9, 14)
        x, y = x0 + rng.randint(1, CELL - side - 1), y0 + rng.randint(1, CELL - side - 1)
        colour, kind = rng.choice(COLOURS), rng.choice(["circle", "square", "triangle"])
        if kind == "circle":
            pen.ellipse((x, y, x + side, y + side), fill=colour)
        elif kind == "square":
            pen.rectangle((x, y, x + side, y + side), fill=colour)
        else:
            pen.polygon([(x + side / 2, y), (x, y + side), (x + side, y + side)], fill=colour)
    return image


def write_pictures(folder: Path, prefix: str, count: int, rng: random.Random, most: int = 6) -> list[tuple[str, int]]:
    """`count` pictures as PNG files in `folder`: (path relative to folder's parent, number of shapes)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(count):
        n = rng.randint(1, most)
        name = f"{prefix}-{i:04d}.png"
        draw(rng, n).save(folder / name)
        out.append((f"{folder.name}/{name}", n))
    return out


class CountEnv:
    def __init__(self, answer: int, max_turns: int = 3, turn_rewards: tuple[float, ...] = (1.0, 0.5, 0.25)):
        self.answer, self.max_turns, self.turn_rewards, self.turn = answer, max_turns, turn_rewards, 0

    def step(self, response_text: str) -> StepResult:
        self.turn += 1
        numbers = INTEGER.findall(response_text)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.answer and len(numbers) <= 2:
            reward = self.turn_rewards[self.turn - 1] if self.turn <= len(self.turn_rewards) else 0.0
            return StepResult(reward=reward, done=True, info={"success_turn": self.turn})
        if self.turn >= self.max_turns:
            return StepResult(reward=0.0, done=True, termination_reason=TerminationReason.MAX_TURNS)
        if guess is None:
            feedback = "Your reply has no number. Reply with just the number."
        else:
            way = "more" if self.answer > guess else "fewer" if self.answer < guess else "exactly"
            feedback = f"Wrong: there are {way} than {guess} shapes. Try again; reply with just the number."
        return StepResult(observation=feedback, reward=0.0)

    def format_observation(self, observation: str) -> Message:
        return {"role": "user", "content": observation}


def build_env(sample: dict[str, Any], config: dict[str, Any]) -> CountEnv:
    return CountEnv(int(sample["answer"]), config.get("max_turns", 3), tuple(config.get("turn_rewards", (1.0, 0.5, 0.25))))
