"""gymnasium's FrozenLake as a text environment (the gym scheduler's `frozenlake`).

The observation is the map as a text grid with the player drawn as `P`; the action is read from the model's
reply: the last of left / down / right / up (or 0-3, gymnasium's action ids) outside its reasoning block.
The API is gymnasium's, with text in and out:

    reset(seed=None) -> (observation: str, info)
    step(action_text) -> (observation: str, reward, terminated, truncated, info)

A reply without a move leaves the player where it is, says so in the observation, and counts as a step.
"""

from __future__ import annotations

import re
from typing import Any

from turnrl.reasoning import strip_reasoning

ACTIONS = {"left": 0, "down": 1, "right": 2, "up": 3}
_MOVE_RE = re.compile(r"\b(left|down|right|up|[0-3])\b")


def parse_move(text: str) -> int | None:
    """gymnasium's action id of the last move named in `text` (reasoning ignored), or None."""
    moves = _MOVE_RE.findall(strip_reasoning(text).lower())
    if not moves:
        return None
    move = moves[-1]
    return ACTIONS[move] if move in ACTIONS else int(move)


class FrozenLakeText:
    """FrozenLake-v1 (default: 4x4, not slippery) with text observations."""

    system_prompt = (
        "You walk on a frozen lake drawn as a grid: S is the start, F is frozen ice (safe), H is a hole (you fall "
        "in and lose), G is the goal and P is where you stand. Reach G. Reply with one move: left, down, right "
        "or up."
    )

    def __init__(self, map_name: str = "4x4", is_slippery: bool = False, **kwargs: Any):
        try:
            import gymnasium
        except ImportError:  # pragma: no cover - gymnasium is in the test and gym extras
            raise ImportError("the frozenlake env needs gymnasium: pip install 'turnrl[gym]'") from None
        self.env = gymnasium.make("FrozenLake-v1", map_name=map_name, is_slippery=is_slippery, **kwargs)
        unwrapped: Any = self.env.unwrapped  # FrozenLakeEnv: its map is `desc`
        self.grid = [[cell.decode() for cell in row] for row in unwrapped.desc]
        self.state = 0

    def render(self, state: int) -> str:
        row, col = divmod(int(state), len(self.grid[0]))
        return "\n".join("".join("P" if (i, j) == (row, col) else cell for j, cell in enumerate(cells))
                         for i, cells in enumerate(self.grid))

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self.state, info = self.env.reset(seed=seed)
        return f"{self.render(self.state)}\nYour move?", dict(info)

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict]:
        action = parse_move(action_text)
        if action is None:
            return (f"{self.render(self.state)}\nNo move found: reply with left, down, right or up.", 0.0, False,
                    False, {"invalid_action": True})
        self.state, reward, terminated, truncated, info = self.env.step(action)
        cell = self.grid[self.state // len(self.grid[0])][self.state % len(self.grid[0])]
        outcome = {"G": "You reached the goal!", "H": "You fell into a hole."}.get(cell, "Your move?")
        return f"{self.render(self.state)}\n{outcome}", float(reward), bool(terminated), bool(truncated), dict(info)

    def close(self) -> None:
        self.env.close()
