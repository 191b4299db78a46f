"""Episode trees: the branches of one episode (forks, compactions, sub-agents, splits) and their parent links.

Every trajectory stays self-contained and token-exact; a branch only adds `Trajectory.parent` = {id, at, kind}: the
trajectory it branched from, how many leading tokens of the two streams (prompt_ids + response_ids) are identical,
and why it branched (docs/trees.md). The producers (the proxy's `assemble_trajectories`, the turn loop's context
policy, the scheduler's splits) link branches with `branch`/`link_by_prefix`; the metrics and the viewer read the
trees back with `episodes` and `walk`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from turnrl.types import BranchKind, Parent, Trajectory


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def branch(child: Trajectory, parent: Trajectory, kind: BranchKind, at: int | None = None) -> Parent:
    """Link `child` to `parent` (same episode: the child takes the parent's `episode_id`, or the parent's id when the
    parent has none yet). `at` defaults to the longest common token prefix of their streams (None when they share
    no token: a new context)."""
    if at is None:
        at = common_prefix(child.stream, parent.stream) or None
    child.parent = Parent(parent.id, at, kind)
    parent.episode_id = parent.episode_id or parent.id
    child.episode_id = parent.episode_id
    return child.parent


def closest(stream: Sequence[int], candidates: Sequence[Trajectory]) -> tuple[Trajectory, int] | None:
    """The candidate whose stream shares the longest prefix with `stream` (the latest of equals), and that length."""
    best: tuple[Trajectory, int] | None = None
    for traj in candidates:
        n = common_prefix(stream, traj.stream)
        if best is None or n >= best[1]:
            best = (traj, n)
    return best


def link_by_prefix(trajectories: Sequence[Trajectory], kind: BranchKind) -> None:
    """Link each trajectory after the first (in production order) to the earlier one it shares the longest token
    prefix with: the samples of a split episode, the branches of a verifiers trace."""
    for k, traj in enumerate(trajectories[1:], 1):
        if traj.parent is None:
            parent, _ = closest(traj.stream, trajectories[:k]) or (trajectories[0], 0)
            branch(traj, parent, kind)


def episodes(trajectories: Iterable[Trajectory]) -> dict[str, list[Trajectory]]:
    """Trajectories by episode (`episode_id`, else their own id), in the order given."""
    out: dict[str, list[Trajectory]] = {}
    for traj in trajectories:
        out.setdefault(traj.episode_id or traj.id, []).append(traj)
    return out


def walk(episode: Sequence[Trajectory]) -> list[tuple[int, Trajectory]]:
    """(depth, trajectory) of one episode's trajectories in tree order: each root (no parent, or a parent that is not
    among them), then its children depth first, in the order given."""
    ids = {t.id for t in episode}
    children: dict[str, list[Trajectory]] = {}
    roots = []
    for traj in episode:
        if traj.parent is not None and traj.parent.id in ids:
            children.setdefault(traj.parent.id, []).append(traj)
        else:
            roots.append(traj)
    out: list[tuple[int, Trajectory]] = []
    seen: set[str] = set()

    def visit(traj: Trajectory, depth: int) -> None:
        if traj.id in seen:  # a malformed file with a parent cycle: shown once
            return
        seen.add(traj.id)
        out.append((depth, traj))
        for child in children.get(traj.id, []):
            visit(child, depth + 1)

    for root in roots:
        visit(root, 0)
    out += [(0, t) for t in episode if t.id not in seen]  # members of a cycle
    return out


def tree_stats(trajectories: Iterable[Trajectory]) -> dict[str, float]:
    """`branches_per_episode` (trajectories per episode, 1 for a flat one) and `compactions_per_episode`, averaged
    over the episodes of `trajectories`."""
    trees = episodes(trajectories)
    if not trees:
        return {}
    compactions = sum(1 for ts in trees.values() for t in ts
                      if t.parent is not None and t.parent.kind == BranchKind.COMPACTION)
    return {"branches_per_episode": sum(len(ts) for ts in trees.values()) / len(trees),
            "compactions_per_episode": compactions / len(trees)}
