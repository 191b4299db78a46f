"""The trivial environment: the episode ends after the model's first reply (single-turn RL on one loop)."""

from __future__ import annotations

from typing import Any

from turnrl.types import StepResult, TerminationReason


class SingleTurnEnv:
    def reset(self) -> None:
        return None

    def step(self, response_text: str) -> StepResult:
        return StepResult(done=True, termination_reason=TerminationReason.ENV_DONE)

    def format_observation(self, observation: Any) -> Any:
        return observation


def build_env(sample: dict[str, Any], config: dict[str, Any]) -> SingleTurnEnv:
    return SingleTurnEnv()
