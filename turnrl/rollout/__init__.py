"""Rows in, trajectories out, on one machine or many.

    episode.py   drive: THE turn loop, and the Episode whose steps it runs (generate, env step, apply, observe)
    builder.py   TrajectoryBuilder: every mask rule (masks born with the tokens, logprobs aligned, edits checked)
    context.py   the context policy: compaction when the next prompt would not fit (rollout.context)
    tree.py      episode trees: parent links of branches (fork, compaction, subagent, split, seat), walks, stats
    manager.py   RolloutManager: rows × n trajectories at once, rewards streamed; the Rollout protocol, run_groups
    remote.py    RemoteRollout: the client of a `turnrl serve` rollout server
    ray.py       engine replicas and rollout workers as Ray actors around the same components
    replay.py    deterministic replay of a recorded trajectory
"""

from turnrl.rollout.builder import TokenEditError, TrajectoryBuilder
from turnrl.rollout.episode import Episode, EpisodeEnd, RolloutContext, RolloutLimits, derive_seed, drive
from turnrl.rollout.manager import (
    Agent,
    RewardFn,
    Rollout,
    RolloutManager,
    drain,
    group_ids,
    run_groups,
    score,
)

__all__ = [
    "Agent", "Episode", "EpisodeEnd", "RewardFn", "Rollout", "RolloutContext", "RolloutLimits", "RolloutManager",
    "TokenEditError", "TrajectoryBuilder", "derive_seed", "drain", "drive", "group_ids", "run_groups", "score",
]
