"""Agent loops by name. An agent is `async (ctx: RolloutContext, sample: dict) -> Trajectory | list[Trajectory]`.

Each dataset row may name its agent in `agent_name`; rows without one use the configured default. User
agents are loaded by path (`my_agents.py:fn` or `pkg.module:fn`) and registered under their function name
or an explicit `name=spec`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import turnrl.agents.schedulers_builtin  # noqa: F401  (registers the built-in schedulers into SCHEDULERS)
from turnrl.calling import env_arguments
from turnrl.envs.base import EnvError, call
from turnrl.envs.single_turn import SingleTurnEnv
from turnrl.loading import load_object, split_object_spec
from turnrl.rollout.episode import RolloutContext, drive
from turnrl.rollout.manager import Agent
from turnrl.types import Trajectory


async def single_turn(ctx: RolloutContext, sample: dict[str, Any]) -> Trajectory:
    """One reply to the prompt; the episode ends there (COMPLETED / env_done)."""
    return await drive(ctx, SingleTurnEnv())


async def env_agent(ctx: RolloutContext, sample: dict[str, Any]) -> Trajectory:
    """The slime-style loop: `build_env(sample, config)` from `--env`, then the turn loop. The row and the config
    arrive as dicts that also read by attribute, like slime's `sample` and `args` (turnrl.calling)."""
    if ctx.env_factory is None:
        raise ValueError("agent 'env_agent' needs an environment: pass --env NAME|module|file.py")
    env_sample, env_config = env_arguments(sample, ctx.env_config, session_id=ctx.trajectory_id)
    env = await call(ctx.env_factory, env_sample, env_config, threads=ctx.env_threads)
    if env is None:
        where = getattr(ctx.env_factory, "__module__", "the environment")
        raise EnvError(f"build_env(sample, config) of {where} returned None; it must return the environment")
    return await drive(ctx, env)


def _tool_agent(ctx: RolloutContext, sample: dict[str, Any]):
    from turnrl.agents.tool_agent import tool_agent

    return tool_agent(ctx, sample)


def _openai_agent(ctx: RolloutContext, sample: dict[str, Any]):
    from turnrl.agents.openai_agent import openai_agent

    return openai_agent(ctx, sample)


def _verifiers_agent(ctx: RolloutContext, sample: dict[str, Any]):
    from turnrl.agents.verifiers import verifiers_agent

    return verifiers_agent(ctx, sample)


AGENTS: dict[str, Agent] = {
    "single_turn": single_turn,
    "single_turn_agent": single_turn,  # verl's name, as rows from its preprocessing scripts say it
    "env_agent": env_agent,
    "tool_agent": _tool_agent,
    "openai_agent": _openai_agent,
    "verifiers": _verifiers_agent,
}
"""The built-in agents. Copy this dict (see `agent_registry`) rather than mutating it."""


def load_agent(spec: str) -> tuple[str, Agent]:
    """`[name=]path.py:function` or `[name=]pkg.module:function` → (name, agent)."""
    name, _, target = spec.rpartition("=") if "=" in spec else ("", "", spec)
    if ":" not in target:
        raise ValueError(f"agent spec {spec!r}: expected [name=]path.py:function or [name=]pkg.module:function")
    return name or split_object_spec(target, "agent")[1], load_object(target, what="agent")


def agent_registry(extra_specs: Sequence[str] = ()) -> dict[str, Agent]:
    """The built-ins plus user agents loaded by path; a clash with a built-in name is an error."""
    registry = dict(AGENTS)
    for spec in extra_specs:
        name, fn = load_agent(spec)
        if name in registry:
            raise ValueError(f"agent {name!r} from {spec!r} clashes with a registered agent; pick another name=")
        registry[name] = fn
    return registry
