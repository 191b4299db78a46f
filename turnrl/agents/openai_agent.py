"""`openai_agent`: train an agent written against the OpenAI API, without changing its code.

The user writes an ordinary agent loop with the `openai` client (or LangGraph, the OpenAI Agents SDK, the
`anthropic` client with the base_url less its `/v1`, anything that takes a base_url) as

    async def run(base_url: str, api_key: str, sample: dict) -> float | None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
        ...                                   # chat.completions.create(...), tool calls, its own tools
        return reward                         # or None: the configured reward function scores it

(a plain `def run` is run in a worker thread, so a synchronous client works too; an `async def run` must not
block, since the engine calls its requests trigger run on the same event loop) and points the config at it:

    rollout:
      agent: openai_agent
      env_config:
        openai_agent: examples/openai_agent/agent.py:run     # or a row column `openai_agent`
        tool_parser: hermes                                  # how tool calls are read from model text

For each trajectory this agent opens a session on an in-process `ChatProxy` that shares the rollout's
engine and chat template, served over HTTP on 127.0.0.1 (a random bearer token, one server per engine), and
calls `run` with that session's base_url. The proxy records every call's exact tokens; when `run` returns,
the session is assembled into trajectories (turnrl/serve/sessions.py): one when the agent keeps its history, several
when it drops or rewrites it. They share the episode's reward and `episode_id`, so the trainer counts
them as one episode in their group.

The trainer's sampling (temperature, top_p, seed) applies to every call whatever the agent asks for (the
loss assumes the policy's distribution); the agent's max_tokens may lower `rollout.max_new_tokens`, and a call
beyond `rollout.max_turns` is refused with an error the agent sees (the episode then ends as max_turns).
Engine calls run on the rollout's own event loop, exactly as in `drive`. `rollout.token_budget` is not applied
(the agent owns its context); `rollout.trajectory_timeout_s` is, and keeps the first trajectory's tokens.

Rewards: return one from `run` when the agent knows its outcome. When it returns None and the episode split
into several trajectories, each carries the episode's final conversation in `messages` (its own in
`info["trajectory_messages"]`), so the reward function gives every piece the episode's reward.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from turnrl.engines.base import Engine
from turnrl.envs.base import maybe_await
from turnrl.loading import load_object
from turnrl.observe.watchdog import abandon_after
from turnrl.render import ChatRenderer
from turnrl.rollout.episode import RolloutContext
from turnrl.serve.app import ServerThread, create_app
from turnrl.serve.sessions import ChatProxy, Session, assemble_trajectories
from turnrl.types import TerminationReason, Trajectory

log = logging.getLogger(__name__)


@dataclass
class Gateway:
    """A ChatProxy on one engine, served on 127.0.0.1 for the agents of this process."""

    proxy: ChatProxy
    http: ServerThread
    token: str

    def session_url(self, session_id: str) -> str:
        return f"{self.http.base_url}/sessions/{quote(session_id, safe='')}/v1"


_GATEWAYS: dict[tuple[int, int, str], Gateway] = {}
_GATEWAYS_LOCK = threading.Lock()


def gateway(engine: Engine, renderer: ChatRenderer, tool_parser: str = "hermes") -> Gateway:
    """The process-wide gateway for this engine and template, started on first use."""
    key = (id(engine), id(renderer), tool_parser)
    with _GATEWAYS_LOCK:
        gw = _GATEWAYS.get(key)
        if gw is None or gw.proxy.engine is not engine or gw.proxy.renderer is not renderer:
            proxy = ChatProxy(engine, renderer, model_name="turnrl-policy", tool_parser=tool_parser,
                              create_sessions=False)  # a late call of a finished episode gets a 404
            token = secrets.token_urlsafe(16)
            # the chat APIs only: the agent's code must not reach the token level (weights, sleep); the body
            # limit is generous, the agent being this process's own code on loopback
            http = ServerThread(create_app(engine, proxy, token=token, model_name="turnrl-policy", token_level=False,
                                           max_body_mb=256))
            http.start()
            gw = _GATEWAYS[key] = Gateway(proxy, http, token)
        return gw


def close_gateways() -> None:
    """Stop every gateway's HTTP server (tests; the threads are daemons otherwise)."""
    with _GATEWAYS_LOCK:
        for gw in _GATEWAYS.values():
            gw.http.stop()
        _GATEWAYS.clear()


async def openai_agent(ctx: RolloutContext, sample: dict[str, Any]) -> list[Trajectory]:
    """Run the user's OpenAI-client agent on one row (module docstring) and return its trajectories."""
    spec = sample.get("openai_agent") or ctx.env_config.get("openai_agent")
    if not spec:
        raise ValueError("agent 'openai_agent' needs the agent's code: set rollout.env_config.openai_agent to "
                         "path/to/agent.py:run (or give rows an `openai_agent` column)")
    run = _load_run(spec)
    gw = gateway(ctx.engine, ctx.renderer, ctx.env_config.get("tool_parser", "hermes"))
    session = gw.proxy.open_session(ctx.trajectory_id, loop=asyncio.get_running_loop(), sampling=ctx.sampling,
                                    max_new_tokens=ctx.limits.max_new_tokens, max_calls=ctx.limits.max_turns)
    t0 = time.perf_counter()
    reward, error = None, None
    try:
        reward = _as_reward(await _call(run, gw.session_url(session.id), gw.token, sample), spec)
    except asyncio.CancelledError:  # trajectory_timeout_s: keep what was generated for the FAILED/timeout record
        if session.calls:
            ctx.partial = assemble_trajectories(session, group_id=ctx.group_id, sample_index=ctx.sample_index,
                                                sample=sample, agent=ctx.agent_name)[0]
        raise
    except Exception as e:  # the agent's failure ends this episode only
        error = e
        log.info("openai agent %s raised on %s", spec, ctx.trajectory_id, exc_info=True)  # -v; one line at the end
    finally:
        await close_session(ctx, gw, session)
    return _episode(ctx, sample, session, reward, error, time.perf_counter() - t0)


async def close_session(ctx: RolloutContext, gw: Gateway, session: Session) -> None:
    """End an agent's gateway session (a late call gets a 404) and release the engine's cache of its trajectory; a
    cache entry that is not dropped never fails the episode (the agents over the gateway: this one, harness,
    verifiers)."""
    gw.proxy.close_session(session.id)
    try:
        await abandon_after(ctx.engine.release(ctx.trajectory_id), ctx.limits.cleanup_timeout_s, "engine.release")
    except Exception as e:
        log.warning("trajectory %s: engine.release raised %r", ctx.trajectory_id, e)


def _episode(ctx: RolloutContext, sample: dict[str, Any], session: Session, reward: float | None,
             error: BaseException | None, seconds: float) -> list[Trajectory]:
    end: tuple[TerminationReason, str | None] | None
    if session.limit_reached:
        end = (TerminationReason.MAX_TURNS, None)
    elif error is not None:
        end = (TerminationReason.ENV_ERROR, f"agent raised {type(error).__name__}: {error}")
    else:
        end = None
    if not session.calls:
        traj = Trajectory(id=ctx.trajectory_id, group_id=ctx.group_id, sample_index=ctx.sample_index, prompt_ids=[],
                          sample=sample, agent=ctx.agent_name, episode_id=session.id)
        traj.finish(TerminationReason.ENV_ERROR, end[1] if end and end[1] else "the agent made no model call")
        return [traj]
    trajectories = assemble_trajectories(session, group_id=ctx.group_id, sample_index=ctx.sample_index,
                                         sample=sample, agent=ctx.agent_name, end=end)
    last = session.calls[-1]
    for traj in trajectories:
        traj.metrics["total_time_s"] = seconds
        traj.reward = reward
        if reward is None and len(trajectories) > 1:  # one reward per episode, whatever piece is scored
            traj.info["trajectory_messages"] = traj.messages
            traj.messages = [*last.messages, last.reply]
    return trajectories


_RUNS: dict[str, Callable[..., Any]] = {}


def _load_run(spec: str) -> Callable[..., Any]:
    """`path.py:function` or `pkg.module:function`, loaded once (a file runs once per process: turnrl.loading)."""
    if spec not in _RUNS:
        _RUNS[spec] = load_object(spec, what="openai agent")
    return _RUNS[spec]


async def _call(run: Callable[..., Any], base_url: str, api_key: str, sample: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(run):
        return await run(base_url, api_key, sample)
    # A synchronous agent (the sync OpenAI client) would block this loop, which must stay free to run the
    # engine calls its requests trigger. (An async callable object returns its coroutine from the thread.)
    result = await asyncio.to_thread(run, base_url, api_key, sample)
    return await maybe_await(result)


def _as_reward(value: Any, spec: str) -> float | None:
    if value is None or isinstance(value, int | float):
        return None if value is None else float(value)
    raise TypeError(f"openai agent {spec}: run() must return a float reward or None, got {type(value).__name__}")
