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

What is not here: the endpoint verifiers' env servers call to generate (`/inference/v1/generate`, rendered by the
`renderers` package) and the ZMQ client that sends them `RunRequest`s; see docs/ecosystems.md.
"""

from __future__ import annotations

from typing import Any

from turnrl.rollout.tree import link_by_prefix
from turnrl.types import (
    BranchKind,
    Message,
    Segment,
    SegmentSource,
    TerminationReason,
    Trajectory,
)


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
