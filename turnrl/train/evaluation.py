"""Held-out evaluation through the rollout, and what a run logs: shared by `turnrl train` (turnrl.train.loop),
`turnrl sft` (turnrl.train.sft) and `turnrl eval`.

    evaluator = Evaluator(rollout, eval_rows, ...)
    metrics = await evaluator.evaluate("after", step)     # greedy pass (and a sampled one), trajectories to files
    write_metrics(out, metrics, step, tracer)            # metrics.jsonl and the tracer
    console.print(format_step_line(metrics, steps))
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from turnrl.observe.stats import RolloutStats, TrajectoryWriter
from turnrl.observe.tracing import TrajectoryTracer
from turnrl.rollout.manager import Rollout
from turnrl.types import SamplingParams


class Evaluator:
    """Passes over the held-out `rows` through `rollout` (on rank 0, where the rollout is): greedy decoding
    (temperature 0, `greedy_n` samples per row, at most `max_new_tokens` each) and, with `sampled_n` > 0, the
    sampling policy (the rollout's sampling: the training temperature) with that many samples per row.
    Trajectories go to `out`/trajectories and to `tracer`."""

    def __init__(self, rollout: Rollout | None, rows: list[dict], *, out: Path, tracer: TrajectoryTracer,
                 console: Console, greedy_n: int, sampled_n: int, max_new_tokens: int):
        self.rollout, self.rows, self.out, self.tracer, self.console = rollout, rows, out, tracer, console
        self.greedy_n, self.sampled_n, self.max_new_tokens = greedy_n, sampled_n, max_new_tokens
        self.progress: Progress | None = None
        """The training progress bar while it shows (an evaluation pass adds its own bar to it)."""

    async def evaluate(self, tag: str, step: int, *, greedy: bool = True, sampled_n: int | None = None,
                       out: Path | None = None) -> dict[str, Any]:
        """The metrics of `tag`'s passes at `step`; trajectories go to `out` (greedy; default
        trajectories/eval_{tag}.jsonl) and `sampled_path(out)`. `sampled_n`: default the evaluator's."""
        sampled_n = self.sampled_n if sampled_n is None else sampled_n
        path = out or self.out / "trajectories" / f"eval_{tag}.jsonl"
        metrics: dict[str, Any] = {"step": float(step), "eval/tag": tag}
        if greedy:
            params = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens)
            metrics.update(await self._pass(tag, step, params, self.greedy_n, "eval/", path))
        if sampled_n:
            assert self.rollout is not None  # evaluation runs on rank 0, where the rollout is
            metrics.update(await self._pass(f"{tag}-sampled", step, self.rollout.sampling, sampled_n,
                                            "eval/sampled_", sampled_path(path)))
        return metrics

    async def _pass(self, tag: str, step: int, sampling: SamplingParams, n: int, prefix: str,
                    path: Path) -> dict[str, float]:
        stats = RolloutStats()
        assert self.rollout is not None  # evaluation runs on rank 0, where the rollout is
        mode = "greedy" if sampling.temperature == 0 else f"sampled at T={sampling.temperature:g}" + (
            f", top_p {sampling.top_p:g}" if sampling.top_p < 1 else "") + (
            f", top_k {sampling.top_k}" if sampling.top_k > 0 else "")
        with TrajectoryWriter(path) as writer, self._task(f"eval {tag} ({mode})", len(self.rows) * n) as advance:
            async for traj in self.rollout.stream(self.rows, n, id_prefix=f"eval-{tag}-", sampling=sampling):
                stats.add(traj)
                self.tracer.export(traj, step, "eval")
                writer.write(traj)
                advance()
        s = stats.summary()
        tools = {f"{prefix}{k.removeprefix('rollout/')}": v for k, v in s.items() if k.startswith("rollout/tool_")}
        return {f"{prefix}reward_mean": s.get("rollout/reward_mean", float("nan")),
                # over every trajectory: a FAILED one has no reward (score() leaves it None) and is no success
                f"{prefix}success": sum(r > 0 for r in stats.rewards) / max(stats.count, 1),
                f"{prefix}turns_mean": s["rollout/turns_mean"], f"{prefix}trajectories": float(stats.count),
                f"{prefix}model_tokens_mean": s["rollout/model_tokens_mean"], **tools}

    @contextlib.contextmanager
    def _task(self, description: str, total: int) -> Iterator[Callable[[], None]]:
        """A progress bar for `description` (on the training one while it shows, else its own); yields advance.
        Into a file or a pipe, where no bar is drawn, a line says what started."""
        if not self.console.is_terminal:
            self.console.print(f"{description}: {total} trajectories")
        if self.progress is not None:
            bar: Progress = self.progress
            task = bar.add_task(description, total=total)
            try:
                yield lambda: bar.advance(task)
            finally:
                bar.remove_task(task)
            return
        with Progress(console=self.console, transient=True) as progress:
            task = progress.add_task(description, total=total)
            yield lambda: progress.advance(task)


def write_metrics(out: Path, metrics: dict[str, Any], step: int, tracer: TrajectoryTracer) -> None:
    """A step's or an evaluation's metrics: one line of `out`/metrics.jsonl, and to the tracer (MLflow)."""
    tracer.log_metrics(metrics, step)
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(metrics) + "\n")


def sampled_path(path: Path) -> Path:
    """Where the sampled evaluation pass goes beside the greedy one's `path`: eval.jsonl -> eval-sampled.jsonl."""
    return path.with_name(f"{path.stem}-sampled{path.suffix}")


def _branches(m: dict[str, Any]) -> str:
    """The episode trees of a step, when any episode branched: branches and compactions per episode."""
    branches = m.get("rollout/branches_per_episode", 1.0)
    if branches <= 1.0:
        return ""
    return f"branches {branches:.2f}/ep  compactions {m.get('rollout/compactions_per_episode', 0.0):.2f}/ep  "


def format_step_line(m: dict[str, Any], total: int) -> str:
    """The console line of an RL step's or an evaluation's metrics (SFT prints its own step lines)."""
    if "eval/tag" in m:
        passes = []
        if "eval/reward_mean" in m:
            passes.append(f"greedy reward {m['eval/reward_mean']:.3f}  success {m['eval/success']:.0%}  turns "
                          f"{m['eval/turns_mean']:.2f}  ({m['eval/trajectories']:.0f} trajectories)")
        if "eval/sampled_reward_mean" in m:
            passes.append(f"sampled reward {m['eval/sampled_reward_mean']:.3f}  success {m['eval/sampled_success']:.0%}"
                          f"  turns {m['eval/sampled_turns_mean']:.2f}  ({m['eval/sampled_trajectories']:.0f} "
                          "trajectories)")
        return f"[bold cyan]eval {m['eval/tag']}[/]: " + "  |  ".join(passes)
    reasons = Counter({k.split("/")[-1]: v for k, v in m.items() if k.startswith("rollout/reason/")})
    reason_text = " ".join(f"{k} {v:.0%}" for k, v in reasons.most_common(3))
    loss = _branches(m) + (f"loss {m['train/loss']:.4f}" if "train/loss" in m else "no trainable samples"
                           + (" (every group's rewards equal)" if m.get("train/constant_group_frac") == 1.0 else ""))
    return (f"step {m['step']:.0f}/{total}  reward {m.get('rollout/reward_mean', float('nan')):.3f}"
            f"±{m.get('rollout/reward_std', float('nan')):.2f}  turns {m['rollout/turns_mean']:.2f}  ({reason_text})  "
            f"gen {m['rollout/tokens_per_s']:.0f} tok/s  train {m.get('train/tokens_per_s', 0):.0f} tok/s"
            f"{packing_text(m)}  {loss}  "
            f"step {m['time/step_s']:.1f}s")


def packing_text(m: dict) -> str:
    """" (×3.5 packed)": what tree packing saved (train/packing_ratio: sample tokens per forwarded token), when
    it saved anything."""
    ratio = m.get("train/packing_ratio", 1.0)
    return f" (×{ratio:.1f} packed)" if ratio > 1.005 else ""
