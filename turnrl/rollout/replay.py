"""Deterministic replay of a recorded multi-turn trajectory: same tokens in, are the same tokens out?

A trajectory records everything its model calls saw and asked for: each call's prompt is a prefix of the token
stream (`turns[k].generate.prompt_tokens`), its sampling distribution (`sampling`), its token cap, stop tokens and
seed (`turns[k].generate`), and the policy version that answered. The observations in between are in the stream
too (mask-0 segments), so replay needs no environment: each call is re-issued against the recorded prefix, in
order and under one request id (so the engine reuses its KV across turns as it did when recording), and its
tokens and logprobs are compared with the recorded ones.

What is reproducible (docs/async-training.md, "Replaying a trajectory", has the measurements):
- the embedded engine, seeded sampling (`rollout.sampling.seed`, so every call has a derived seed) or greedy:
  the same tokens. Logprobs are bit-identical when the recording computed each call alone (engine
  max_batch_size 1, the batch-invariant setting); batched, they differ in the last bits (a batch changes the
  matmul shapes, so the float summation order), which can flip a sampled token only when a draw falls within
  that distance of a boundary.
- not reproducible: unseeded sampling; calls a scheduler edited after the fact (their recorded tokens are not
  what the engine returned: reported as `edited`); server engines whose kernels are not batch-invariant
  (vLLM/SGLang without their deterministic modes).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.engines.base import Engine
from turnrl.types import SamplingParams, Trajectory


@dataclass
class CallReplay:
    """One recorded generate call against its replay."""

    turn: int
    policy_version: int | None
    recorded: list[int]
    replayed: list[int]
    max_logprob_diff: float
    """Over the tokens both have in common (inf when the recording has no logprobs for them)."""
    edited: bool
    """A token edit changed this call's tokens after the engine returned them: a difference is expected."""

    @property
    def tokens_equal(self) -> bool:
        return self.recorded == self.replayed

    @property
    def bitwise(self) -> bool:
        return self.tokens_equal and self.max_logprob_diff == 0.0


@dataclass
class ReplayReport:
    trajectory_id: str
    calls: list[CallReplay]

    @property
    def tokens_equal(self) -> bool:
        return all(c.tokens_equal for c in self.calls if not c.edited)

    @property
    def bitwise(self) -> bool:
        return all(c.bitwise for c in self.calls if not c.edited)

    @property
    def max_logprob_diff(self) -> float:
        return max((c.max_logprob_diff for c in self.calls if not c.edited), default=0.0)


async def replay(traj: Trajectory, engine: Engine,
                 load_version: Callable[[int], Awaitable[None]] | None = None) -> ReplayReport:
    """Re-issue every recorded generate call of `traj` on `engine` and compare (module docstring). `load_version`
    puts a policy version's weights into the engine before a call that version answered (None: the engine
    already holds the right weights)."""
    if not traj.turns or not traj.sampling:
        raise ValueError(f"trajectory {traj.id!r} has no recorded turns or sampling settings (written before format "
                         "version 2?): it cannot be replayed")
    stream = traj.prompt_ids + traj.response_ids
    logprobs = [None] * len(traj.prompt_ids) + list(traj.rollout_logprobs or [None] * len(traj.response_ids))
    calls = []
    for record in traj.turns:
        span = record.generate
        if span is None or span.max_new_tokens is None or span.error is not None:
            continue
        if load_version is not None and span.policy_version is not None:
            await load_version(span.policy_version)
        start, end = span.prompt_tokens, span.prompt_tokens + span.tokens
        params = SamplingParams(temperature=traj.sampling["temperature"], top_p=traj.sampling["top_p"],
                                top_k=traj.sampling["top_k"], max_new_tokens=span.max_new_tokens,
                                stop_token_ids=tuple(span.stop_token_ids or ()), seed=span.seed)
        out = await engine.generate(stream[:start], params, request_id=f"replay-{traj.id}")
        recorded = stream[start:end]
        diffs = [abs(a - b) if a is not None else math.inf
                 for a, b in zip(logprobs[start:end], out.logprobs, strict=False)]
        calls.append(CallReplay(record.turn, span.policy_version, recorded, list(out.token_ids),
                                max(diffs, default=0.0), edited=record.edited))
    await engine.release(f"replay-{traj.id}")
    return ReplayReport(traj.id, calls)


# ---------------------------------------------------------------------------------------------------
# `turnrl replay`
# ---------------------------------------------------------------------------------------------------
def checkpoint_for(run_dir: Path, version: int) -> Path:
    """The model directory a training run saved for policy `version` (the weights after `version` steps)."""
    path = run_dir / "checkpoints" / f"step_{version:06d}" / "model"
    if not path.is_dir():
        saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) if run_dir.is_dir() else []
        raise FileNotFoundError(f"{run_dir}: no checkpoint of policy version {version} ({path}); saved: "
                                f"{', '.join(saved) or 'none'} (save_every=1 keeps every version)")
    return path


async def run_replay(traj: Trajectory, model: str, run_dir: Path | None = None) -> ReplayReport:
    """Replay `traj` on an embedded engine over `model` (version 0) or `run_dir`'s checkpoints, one call at a
    time (batch size 1: nothing else shares its batches)."""
    from turnrl.engines.embedded import EmbeddedEngine
    from turnrl.models import load_model, load_tokenizer
    from turnrl.render import ChatRenderer

    renderer = ChatRenderer(load_tokenizer(model))
    engine = EmbeddedEngine(load_model(model), eos_token_ids=sorted(renderer.end_of_turn_ids), max_batch_size=1)
    loaded = [0]

    async def load_version(version: int) -> None:
        if run_dir is None or version == loaded[0]:
            return
        weights = load_model(str(checkpoint_for(run_dir, version))) if version else load_model(model)
        await engine.update_weights(weights.state_dict(), version=version)
        loaded[0] = version

    try:
        return await replay(traj, engine, load_version)
    finally:
        engine.close()


def verdict(report: ReplayReport) -> str:
    same = sum(c.tokens_equal for c in report.calls)
    line = f"replay of {report.trajectory_id}: {same} of {len(report.calls)} calls give the same tokens"
    if not report.tokens_equal:
        return line + "; the replay differs"
    if report.bitwise:
        return line + "; logprobs equal bit for bit"
    return line + f"; largest logprob difference {report.max_logprob_diff:.2e}"


def report_table(report: ReplayReport) -> Any:
    from rich.table import Table

    table = Table()
    for column in ("turn", "policy version", "tokens", "same tokens", "max |Δ logprob|", "note"):
        table.add_column(column, justify="right")
    for c in report.calls:
        first = next((i for i, (a, b) in enumerate(zip(c.recorded, c.replayed, strict=False)) if a != b),
                     min(len(c.recorded), len(c.replayed)))
        note = "edited after sampling" if c.edited else "" if c.tokens_equal else (
            f"differs at token {first}: recorded {c.recorded[first:first + 1]}, replayed {c.replayed[first:first + 1]}")
        table.add_row(str(c.turn), str(c.policy_version), str(len(c.recorded)), "yes" if c.tokens_equal else "no",
                      f"{c.max_logprob_diff:.2e}", note)
    return table
