"""Agent loops by name. An agent is `async (ctx: RolloutContext, sample: dict) -> Trajectory | list[Trajectory]`.

Each dataset row may name its agent in `agent_name`; rows without one use the configured default. User
agents are loaded by path (`my_agents.py:fn` or `pkg.module:fn`) and registered under their function name
or an explicit `name=spec`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import turnrl.agents.schedulers_builtin  # noqa: F401  (registers the built-in schedulers into SCHEDULERS)
from turnrl.calling import env_arguments
from turnrl.envs.base import EnvError, call
from turnrl.envs.seats import Table
from turnrl.envs.single_turn import SingleTurnEnv
from turnrl.loading import load_object, split_object_spec
from turnrl.rollout.episode import RolloutContext, drive
from turnrl.rollout.manager import Agent
from turnrl.rollout.tree import branch
from turnrl.types import BranchKind, RolloutStatus, Trajectory


async def single_turn(ctx: RolloutContext, sample: dict[str, Any]) -> Trajectory:
    """One reply to the prompt; the episode ends there (COMPLETED / env_done)."""
    return await drive(ctx, SingleTurnEnv())


async def env_agent(ctx: RolloutContext, sample: dict[str, Any]) -> Trajectory | list[Trajectory]:
    """The slime-style loop: `build_env(sample, config)` from `--env`, then the turn loop. The row and the config
    arrive as dicts that also read by attribute, like slime's `sample` and `args` (turnrl.calling). An env that is a
    `Table` (a game the policy plays in every seat) is driven seat by seat: `play_table`."""
    if ctx.env_factory is None:
        raise ValueError("agent 'env_agent' needs an environment: pass --env NAME|module|file.py")
    env_sample, env_config = env_arguments(sample, ctx.env_config, session_id=ctx.trajectory_id)
    env = await call(ctx.env_factory, env_sample, env_config, threads=ctx.env_threads)
    if env is None:
        where = getattr(ctx.env_factory, "__module__", "the environment")
        raise EnvError(f"build_env(sample, config) of {where} returned None; it must return the environment")
    if isinstance(env, Table):
        return await play_table(ctx, env)
    return await drive(ctx, env)


async def play_table(ctx: RolloutContext, table: Table) -> list[Trajectory]:
    """One episode of a game the policy plays in every seat (turnrl.envs.seats): the turn loop drives each seat, all
    at once, as a trajectory of its own (seat 0 keeps the episode's id, seat k is `<id>.s<k>`, its compactions
    `<id>.s<k>.c<j>`); each seat's first trajectory after seat 0's is a `seat` branch of seat 0's first one, every
    trajectory is in the episode (`episode_id`), and when the game ended each seat's trajectories have that seat's
    game reward (the episode's reward, for its group, is the last seat's: docs/trees.md)."""
    contexts = [ctx, *(dataclasses.replace(ctx, trajectory_id=f"{ctx.trajectory_id}.s{k}", branches=[], partial=None)
                       for k in range(1, table.num_seats))]
    try:
        results = await asyncio.gather(*(drive(c, seat) for c, seat in zip(contexts, table.seats(), strict=True)))
    except asyncio.CancelledError:  # trajectory_timeout_s: the RolloutManager keeps ctx's partial and branches,
        seats = [[*c.branches, *([c.partial] if c.partial is not None else [])] for c in contexts]  # the other
        _link(table, seats)                                                                         # seats' too
        ctx.branches += [t for seat in seats[1:] for t in seat]
        raise
    return _link(table, [[*c.branches, traj] for c, traj in zip(contexts, results, strict=True)])


def _link(table: Table, seats: list[list[Trajectory]]) -> list[Trajectory]:
    """Each seat's trajectories (seat 0's first) into one episode, with the seats' game rewards (`play_table`)."""
    if not seats or not seats[0]:
        return []
    root = seats[0][0]
    out = []
    for k, trajectories in enumerate(seats):
        if not trajectories:  # a seat cancelled before its first turn
            continue
        if k:
            branch(trajectories[0], root, BranchKind.SEAT)
        reward = table.rewards.get(k) if table.rewards is not None else None
        for traj in trajectories:
            traj.episode_id = root.id
            traj.rollout_infos["seat"] = k  # each seat has a baseline of its own in training (group_advantages)
            if reward is not None and traj.status != RolloutStatus.FAILED:
                traj.reward = float(reward)
        out += trajectories
    return out


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
