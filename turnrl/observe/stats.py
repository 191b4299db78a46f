"""Observability: rollout statistics (O1), the trajectory JSONL dump (O2) and console tables/progress (O3).

Metric names are flat strings, `group/name`, so they can go to MLflow or a log line unchanged:
- `rollout/status/<status>`, `rollout/reason/<termination_reason>`: fractions of trajectories
- `rollout/turns_mean`, `rollout/turns_hist/<k>`: turn-count distribution
- `rollout/model_tokens_mean`, `rollout/injected_tokens_mean`: tokens per trajectory (mask 1 / mask 0)
- `rollout/gen_time_s`, `rollout/env_time_s`: summed over trajectories (waiting included)
- `rollout/env_retries`, `rollout/render_mismatch` (streams that differ from a full chat-template re-render in
  content), `rollout/render_harmless` (only in ways known to be harmless for the template; strict sanity check),
  `rollout/reward_errors`, `rollout/logprob_issues`: counts (render ones over the checked trajectories)
- `rollout/render_checked`: the fraction of trajectories the sanity check ran on (below 1 with
  rollout.sanity_check_every N > 1, and for trajectories with no model turn)
- `rollout/reward_mean`, `rollout/reward_std`: over trajectories with a reward
- `rollout/episodes`, `rollout/branches_per_episode` (trajectories per episode: 1 for a flat one, more with forks,
  compactions, sub-agents, splits; docs/trees.md), `rollout/compactions_per_episode` (`compaction` branches)
- `rollout/tokens_per_s`: model tokens per wall-clock second
- tool agents: `rollout/tool_call_rate` (trajectories with at least one tool call, well-formed or not),
  `rollout/tool_calls_mean` (call attempts per trajectory), `rollout/tool_invalid_call_rate` (attempts that
  failed: malformed, unknown tool, bad arguments, the tool raised or timed out, skipped)
- `memory/peak_rss_gb` (training steps): the most resident memory this process has held so far (`peak_rss_gb`)
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.table import Table

from turnrl.types import BranchKind, RolloutStatus, Trajectory


def peak_rss_gb() -> float | None:
    """The largest resident set size this process has had, in GB (10^9 bytes; what `/usr/bin/time -v` reports as
    "Maximum resident set size"); None where the OS does not say."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024) / 1e9  # bytes on macOS, KiB on Linux


@dataclass
class RolloutStats:
    """Accumulates per-trajectory facts as trajectories stream in."""

    started: float = field(default_factory=time.perf_counter)
    count: int = 0
    statuses: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    turns: Counter = field(default_factory=Counter)
    rewards: list[float] = field(default_factory=list)
    totals: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    tool_calls: Counter = field(default_factory=Counter)
    episodes: Counter = field(default_factory=Counter)
    """Trajectories (branches) per episode (`episode_id`, else the trajectory's own id)."""

    def add(self, traj: Trajectory) -> None:
        self.count += 1
        self.episodes[traj.episode_id or traj.id] += 1
        self.totals["compactions"] += traj.parent is not None and traj.parent.kind == BranchKind.COMPACTION
        self.statuses[str(traj.status)] += 1
        self.reasons[str(traj.termination_reason)] += 1
        self.turns[traj.num_turns] += 1
        if traj.reward is not None:
            self.rewards.append(float(traj.reward))
        self.totals["model_tokens"] += traj.num_model_tokens
        self.totals["injected_tokens"] += traj.num_response_tokens - traj.num_model_tokens
        for key in ("gen_time_s", "env_time_s", "env_retries", "render_mismatch", "render_harmless",
                    "cached_prompt_tokens", "logprob_issues", "render_checked"):
            self.totals[key] += float(traj.metrics.get(key, 0.0))
        self.totals["reward_errors"] += traj.reward_error is not None
        tool_stats = traj.info.get("tool_stats")
        if tool_stats is not None:
            for name, n in tool_stats.get("calls", {}).items():
                self.tool_calls[name] += n
            attempts = tool_stats.get("attempts", sum(tool_stats.get("calls", {}).values()))
            self.totals["tool_trajectories"] += 1
            self.totals["tool_attempts"] += attempts
            self.totals["tool_errors"] += tool_stats.get("errors", 0)
            self.totals["tool_calling"] += attempts > 0

    def summary(self) -> dict[str, float]:
        n = max(self.count, 1)
        wall = time.perf_counter() - self.started
        out: dict[str, float] = {"rollout/trajectories": float(self.count), "rollout/wall_s": wall}
        out.update({f"rollout/status/{k}": v / n for k, v in self.statuses.items()})
        out.update({f"rollout/reason/{k}": v / n for k, v in self.reasons.items()})
        out.update({f"rollout/turns_hist/{k}": v / n for k, v in sorted(self.turns.items())})
        out["rollout/turns_mean"] = sum(k * v for k, v in self.turns.items()) / n
        episodes = max(len(self.episodes), 1)
        out["rollout/episodes"] = float(len(self.episodes))
        out["rollout/branches_per_episode"] = self.count / episodes
        out["rollout/compactions_per_episode"] = self.totals["compactions"] / episodes
        out["rollout/model_tokens_mean"] = self.totals["model_tokens"] / n
        out["rollout/injected_tokens_mean"] = self.totals["injected_tokens"] / n
        out["rollout/render_checked"] = self.totals["render_checked"] / n
        out["rollout/tokens_per_s"] = self.totals["model_tokens"] / wall if wall > 0 else 0.0
        for key in ("gen_time_s", "env_time_s", "env_retries", "render_mismatch", "render_harmless", "reward_errors",
                    "cached_prompt_tokens", "logprob_issues"):
            out[f"rollout/{key}"] = float(self.totals[key])
        if self.totals["tool_trajectories"]:
            with_tools, attempts = self.totals["tool_trajectories"], self.totals["tool_attempts"]
            out["rollout/tool_call_rate"] = self.totals["tool_calling"] / with_tools
            out["rollout/tool_calls_mean"] = attempts / with_tools
            out["rollout/tool_invalid_call_rate"] = self.totals["tool_errors"] / attempts if attempts else 0.0
        if self.rewards:
            mean = sum(self.rewards) / len(self.rewards)
            out["rollout/reward_mean"] = mean
            out["rollout/reward_std"] = math.sqrt(sum((r - mean) ** 2 for r in self.rewards) / len(self.rewards))
        return out

    def table(self, title: str = "rollout summary") -> Table:
        s = self.summary()
        t = Table(title=title, show_header=True, header_style="bold")
        t.add_column("metric")
        t.add_column("value", justify="right")
        t.add_row("trajectories", f"{self.count}")
        for status in RolloutStatus:
            if self.statuses[str(status)]:
                t.add_row(f"status {status}", f"{self.statuses[str(status)]} ({s[f'rollout/status/{status}']:.0%})")
        for reason, k in self.reasons.most_common():
            t.add_row(f"reason {reason}", f"{k}")
        if len(self.episodes) < self.count:
            t.add_row("episodes: branches / compactions per episode", f"{len(self.episodes)}: "
                      f"{s['rollout/branches_per_episode']:.2f} / {s['rollout/compactions_per_episode']:.2f}")
        t.add_row("turns (count: trajectories)", ", ".join(f"{k}: {v}" for k, v in sorted(self.turns.items())))
        t.add_row("model / injected tokens per trajectory",
                  f"{s['rollout/model_tokens_mean']:.1f} / {s['rollout/injected_tokens_mean']:.1f}")
        t.add_row("generation / env time (s, summed)", f"{s['rollout/gen_time_s']:.1f} / {s['rollout/env_time_s']:.1f}")
        t.add_row("model tokens per second", f"{s['rollout/tokens_per_s']:.1f}")
        if "rollout/reward_mean" in s:
            t.add_row("reward mean ± std", f"{s['rollout/reward_mean']:.3f} ± {s['rollout/reward_std']:.3f}")
        for key in ("env_retries", "render_mismatch", "render_harmless", "reward_errors", "logprob_issues"):
            if s[f"rollout/{key}"]:
                t.add_row(_ROW_NAMES.get(key, key.replace("_", " ")), f"{s[f'rollout/{key}']:.0f}")
        if 0 < s["rollout/render_checked"] < 1:  # rollout.sanity_check_every N > 1, or trajectories with no model turn
            t.add_row("sanity-checked trajectories", f"{self.totals['render_checked']:.0f} ({s['rollout/render_checked']:.0%})")
        if self.tool_calls:
            t.add_row("tool calls", ", ".join(f"{k}: {v}" for k, v in self.tool_calls.most_common()))
        t.add_row("wall time (s)", f"{s['rollout/wall_s']:.1f}")
        return t


_ROW_NAMES = {"render_mismatch": "render mismatch (content)",
              "render_harmless": "render difference, known harmless"}


class TrajectoryWriter:
    """Appends trajectories to a JSONL file as they finish (docs/trajectory-format.md)."""

    def __init__(self, path: str | Path, mode: str = "w"):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(self.path, mode, encoding="utf-8")

    def write(self, traj: Trajectory) -> None:
        self._file.write(json.dumps(traj.to_json(), ensure_ascii=False, default=json_default) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def json_default(obj: Any) -> Any:
    """What a trajectory's JSON holds for a value JSON has no type for (`json.dumps(..., default=json_default)`),
    in a JSONL file as on the rollout server's stream."""
    if hasattr(obj, "getpixel"):  # a PIL image in a message part: its ref, as in `Trajectory.images`
        from turnrl.multimodal import image_ref

        return image_ref(obj)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, set | tuple):
        return list(obj)
    return str(obj)


def read_trajectories(path: str | Path) -> list[Trajectory]:
    with open(path, encoding="utf-8") as f:
        return [Trajectory.from_json(json.loads(line)) for line in f if line.strip()]
