"""verifiers v1 episodes as turnrl trajectories, without re-tokenising (docs/ecosystems.md, "verifiers v1").

A verifiers 0.4 `Trace` is a message graph: each `MessageNode` holds the token ids it adds to the sequence
(`token_ids`, its template scaffold included), a per-token `mask` (True only on an assistant node's sampled
completion) and the `logprobs` of the masked tokens. Each root-to-leaf path (`Trace.branches`) is one training
sample, so it becomes one `Trajectory`:

    prompt_ids      every token before the path's first sampled (mask True) token
    segments        runs of equal mask, node by node: mask True → a model segment (mask 1, the node's logprobs);
                    mask False → template (an assistant node's scaffold), tool (a tool message) or env (user,
                    system) tokens, mask 0
    messages        the path's messages, as verifiers recorded them
    reward          `Trace.reward` (the weighted sum of its `rewards`); rollout_infos `rewards` (each reward's
                    score), `metrics`, `verifiers_trace_id`, `stop_condition`
    status          completed, or failed with the trace's first error (`ok` false)

A trace of several branches gives several trajectories sharing `episode_id` (the trace id) and the reward, each
later one a `fork` of the earlier branch it shares the longest token prefix with (`parent`, docs/trees.md);
branches verifiers marks untrainable (a compaction attempt the harness did not resume from) are left out. The
function takes a `verifiers.v1.trace.Trace` or its JSON (what verifiers' env servers send and dump); a JSON trace
gives a branch per leaf with no compaction rules.

`verifiers_agent` (`agent: verifiers`) runs a row's task on a verifiers env server with turnrl as the policy: it
opens a session on the in-process gateway (turnrl.agents.openai_agent.gateway: the rollout's engine behind a random
token on 127.0.0.1), sends the server a RunRequest (turnrl.agents.verifiers_wire) whose client is a verifiers
`TrainClientConfig` pointing at that session, so every model call of the episode comes to the session's
`/inference/v1/generate` (turnrl/serve/inference.py) and is recorded there, on the rollout's event loop as
`drive`'s calls are; the episode's traces come back and become trajectories (above), each model segment checked
against the tokens the session recorded (a trace claiming tokens this engine did not sample fails its trajectory)
and given the recorded logprobs and policy version. docs/ecosystems.md has the settings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from turnrl.rollout.tree import link_by_prefix
from turnrl.types import (
    BranchKind,
    Message,
    RolloutStatus,
    Segment,
    SegmentSource,
    TerminationReason,
    Trajectory,
)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1800.0
"""An episode's bound on the env server when `env_config.timeout_s` does not set one."""
_TURNRL_COLUMNS = ("agent_name", "env_config")


def trajectories_from_trace(trace: Any, group_id: str, sample_index: int = 0,
                            sample: dict[str, Any] | None = None) -> list[Trajectory]:
    """The trainable branches of a verifiers trace as validated trajectories (module docstring)."""
    data = trace.model_dump(mode="json") if hasattr(trace, "model_dump") else dict(trace)
    branches = _branches(trace, data)
    reward = _reward(data)
    infos = {"rewards": {k: (v or {}).get("score") for k, v in (data.get("rewards") or {}).items()},
             "metrics": data.get("metrics") or {}, "verifiers_trace_id": data.get("id"),
             "stop_condition": data.get("stop_condition")}
    out = []
    for k, nodes in enumerate(branches):
        suffix = f"-{k}" if len(branches) > 1 else ""
        traj = _trajectory(nodes, f"{data.get('id', group_id)}{suffix}", group_id, sample_index)
        traj.reward, traj.rollout_infos, traj.sample = reward, dict(infos), dict(sample or {})
        traj.episode_id = data.get("id") if len(branches) > 1 else None
        traj.agent = "verifiers"
        _finish(traj, data)
        out.append(traj)
    link_by_prefix(out, BranchKind.FORK)  # each branch forks the earlier one it shares the most nodes with
    for traj in out:
        traj.validate()
    return out


def _branches(trace: Any, data: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Root-to-leaf node lists: verifiers' own `Trace.branches` (trainable ones) when given a Trace."""
    if hasattr(trace, "branches") and not isinstance(trace, dict):
        return [[n.model_dump(mode="json") for n in b.nodes] for b in trace.branches if b.trainable]
    nodes = data.get("nodes") or []
    parents = {n.get("parent") for n in nodes}
    paths: list[list[dict[str, Any]]] = []
    for leaf in (i for i in range(len(nodes)) if i not in parents):
        path, nid = [], leaf
        while nid is not None:
            path.append(nodes[nid])
            nid = nodes[nid].get("parent")
        paths.append(path[::-1])
    return paths


def _trajectory(nodes: list[dict[str, Any]], tid: str, group_id: str, sample_index: int) -> Trajectory:
    runs = [run for node in nodes for run in _runs(node)]
    first = next((i for i, (_, mask, _, _) in enumerate(runs) if mask), len(runs))
    prompt_ids = [t for ids, _, _, _ in runs[:first] for t in ids]
    traj = Trajectory(id=tid, group_id=group_id, sample_index=sample_index, prompt_ids=prompt_ids,
                      messages=[_message(n) for n in nodes])
    turn = 0
    for ids, mask, logprobs, source in runs[first:]:
        if mask:
            turn += 1
            traj.segments.append(Segment(SegmentSource.MODEL, ids, [1] * len(ids), list(logprobs), turn))
        else:
            traj.segments.append(Segment(source, ids, [0] * len(ids), [None] * len(ids), max(turn, 1)))
    traj.num_turns = turn
    return traj


def _runs(node: dict[str, Any]) -> list[tuple[list[int], bool, list[float], SegmentSource]]:
    """A node's tokens as runs of equal mask, each with its logprobs (mask True) and the source of its tokens."""
    ids, mask, logprobs = node.get("token_ids") or [], node.get("mask") or [], node.get("logprobs") or []
    if mask and len(mask) != len(ids):
        raise ValueError(f"verifiers node: {len(ids)} token ids but {len(mask)} mask entries")
    mask = mask or [False] * len(ids)
    if sum(mask) != len(logprobs):
        raise ValueError(f"verifiers node: {sum(mask)} sampled tokens but {len(logprobs)} logprobs")
    role = str((node.get("message") or {}).get("role"))
    injected = {"tool": SegmentSource.TOOL, "assistant": SegmentSource.TEMPLATE}.get(role, SegmentSource.ENV)
    runs: list[tuple[list[int], bool, list[float], SegmentSource]] = []
    start, used = 0, 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            n_sampled = i - start if mask[start] else 0
            runs.append((ids[start:i], bool(mask[start]), logprobs[used:used + n_sampled], injected))
            used += n_sampled
            start = i
    return runs


def _message(node: dict[str, Any]) -> Message:
    message = dict(node.get("message") or {})
    return {k: v for k, v in message.items() if v is not None}


def _reward(data: dict[str, Any]) -> float | None:
    rewards = [r for r in (data.get("rewards") or {}).values() if r is not None]
    if not rewards:
        return None
    return float(sum(r["score"] * r.get("weight", 1.0) for r in rewards))


def _finish(traj: Trajectory, data: dict[str, Any]) -> None:
    errors = data.get("errors") or []
    if errors or data.get("ok") is False:
        first = errors[0] if errors else {}
        traj.finish(TerminationReason.ENV_ERROR, f"verifiers: {first.get('type', 'error')}: "
                                                 f"{first.get('message', 'the rollout did not finish ok')}")
        return
    traj.finish(TerminationReason.ENV_DONE)


# ---- the agent: an episode on a verifiers env server -------------------------------------------------------
async def verifiers_agent(ctx: Any, sample: dict[str, Any]) -> list[Trajectory]:
    """Run the row's task on the env server named by `env_config.env_server` (module docstring)."""
    from turnrl.agents.openai_agent import close_session, gateway
    from turnrl.agents.verifiers_wire import EnvServer, EpisodeTimeout

    config = {**ctx.env_config, **(sample.get("env_config") or {})}
    address = config.get("env_server")
    if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")):
        raise ValueError("agent 'verifiers' needs its env server: set env_config.env_server to the address it binds "
                         f"(tcp://127.0.0.1:5000), got {address!r}")
    gw = gateway(ctx.engine, ctx.renderer)
    session = gw.proxy.open_session(ctx.trajectory_id, loop=asyncio.get_running_loop(), sampling=ctx.sampling,
                                    max_new_tokens=ctx.limits.max_new_tokens, max_calls=ctx.limits.max_turns)
    try:
        request = run_request(ctx, sample, config, gw.session_url(session.id), gw.token)
        health_timeout_s = float(config.get("health_timeout_s") or 30.0)
        try:
            episode = await EnvServer.on_loop(address).run(
                request, timeout_s=float(config.get("timeout_s") or DEFAULT_TIMEOUT_S),
                health_interval_s=min(5.0, health_timeout_s / 2), health_timeout_s=health_timeout_s)
        except EpisodeTimeout as e:
            return [ctx.failed(TerminationReason.TIMEOUT, str(e))]
        return episode_trajectories(ctx, sample, episode, session.calls, max_turns_hit=session.limit_reached)
    finally:
        await close_session(ctx, gw, session)


def run_request(ctx: Any, sample: dict[str, Any], config: dict[str, Any], base_url: str, token: str) -> dict[str, Any]:
    """verifiers' RunRequest: the row's task data (its `task` column, else the row less turnrl's own columns), a
    train client on this session (`renderer`, `renderer_model`: what the env server renders prompts with), the
    policy's sampling."""
    task = sample.get("task") if isinstance(sample.get("task"), dict) else {
        k: v for k, v in sample.items() if k not in _TURNRL_COLUMNS}
    renderer = config.get("renderer")
    if isinstance(renderer, str):
        renderer = {"name": renderer}
    tokenizer = getattr(ctx.renderer, "tokenizer", None)
    client = {"type": "train", "base_url": base_url, "api_key_var": "TURNRL_GATEWAY_TOKEN_UNSET",
              "headers": {"X-Api-Key": token}, "renderer": renderer,
              "renderer_model_name": config.get("renderer_model") or getattr(tokenizer, "name_or_path", None)}
    params = ctx.sampling
    sampling = {"temperature": params.temperature, "top_p": params.top_p, "max_tokens": ctx.limits.max_new_tokens}
    if params.top_k > 0:
        sampling["top_k"] = params.top_k
    return {"task_data": task, "client": client, "model": str(config.get("model") or "turnrl-policy"),
            "sampling": sampling}


def episode_trajectories(ctx: Any, sample: dict[str, Any], episode: dict[str, Any], calls: list[Any],
                         max_turns_hit: bool = False) -> list[Trajectory]:
    """The episode's traces as trajectories (ids `<trajectory id>`, `<trajectory id>.<k>`, one `episode_id`), their
    model segments checked against the session's recorded `calls`; an episode with no trace is one failed
    trajectory with the episode's first error. `max_turns_hit`: the session refused a call past
    `rollout.max_turns`, so a trace that failed on it ends as max_turns (its error kept as a warning)."""
    trajectories = [t for trace in episode.get("traces") or []
                    for t in trajectories_from_trace(trace, ctx.group_id, ctx.sample_index, sample)]
    if not trajectories:
        errors = episode.get("errors") or [{}]
        message = f"{errors[0].get('type', 'error')}: {errors[0].get('message', 'the episode has no trace')}"
        return [ctx.failed(TerminationReason.ENV_ERROR, f"verifiers: {message}")]
    recorded = {tuple(c.completion_ids): c for c in calls}
    renamed: dict[str, str] = {}
    for k, traj in enumerate(trajectories):
        new_id = ctx.trajectory_id if k == 0 else f"{ctx.trajectory_id}.{k}"
        renamed[traj.id], traj.id = new_id, new_id
    for traj in trajectories:  # the parent links of each trace's branches follow the renaming; a later trace's
        if traj.parent is not None:  # first branch forks the earlier branch it shares the most tokens with
            traj.parent = dataclasses.replace(traj.parent, id=renamed.get(traj.parent.id, traj.parent.id))
    for traj in trajectories:
        traj.episode_id = ctx.trajectory_id if len(trajectories) > 1 else None
        traj.agent = ctx.agent_name
        traj.rollout_infos["verifiers_episode_id"] = episode.get("id")
        if max_turns_hit and traj.termination_reason == TerminationReason.ENV_ERROR:
            refused, traj.error = traj.error, None
            traj.finish(TerminationReason.MAX_TURNS)
            traj.warnings.append(f"{refused} (a call past rollout.max_turns was refused)")
        _check_against(traj, recorded)
    link_by_prefix(trajectories, BranchKind.FORK)
    return trajectories


def _check_against(traj: Trajectory, recorded: dict[tuple[int, ...], Any]) -> None:
    """Give each model segment the logprobs and policy version its recorded call has; fail the trajectory when
    the trace holds sampled tokens no call of the session returned."""
    for segment in traj.segments:
        if segment.source != SegmentSource.MODEL:
            continue
        call = recorded.get(tuple(segment.token_ids))
        if call is None:
            if traj.status != RolloutStatus.FAILED:
                traj.finish(TerminationReason.ENV_ERROR, (
                    f"verifiers trace: turn {segment.turn}'s {len(segment.token_ids)} sampled tokens are not what "
                    "turnrl's engine returned to this session (the env server used another endpoint, or rewrote "
                    "the completion)"))
            continue
        segment.logprobs = list(call.logprobs)
        segment.policy_version = call.policy_version
