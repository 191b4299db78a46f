"""A scripted TextArena opponent for tests/test_textarena.py: the first move TextArena lists as available."""

import re


def first_available(observation: str) -> str:
    moves = re.findall(r"'(\[\d+\])'", observation.rsplit("Available Moves:", 1)[-1])
    return moves[0] if moves else "[0]"
