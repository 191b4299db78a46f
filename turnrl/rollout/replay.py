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

A call whose tokens differ says why (`CallReplay.reason`): edited, replayed with other weights than the policy
version that sampled it, unseeded, or (same weights and seed) numerics the replay does not share.

`turnrl replay TRAJ.jsonl --id ID` needs nothing else when the file lies in a training run (`RUN/trajectories/`,
`RUN/eval/`): the run's `config.yaml` names the model and its checkpoints hold the policy versions
(`find_run`); `--model` and `--run-dir` name them for a file elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
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
    replayed_version: int | None = None
    """The policy version whose weights replayed the call (None: not known, the caller loaded the engine)."""
    seeded: bool = True
    """The call can be drawn again: it had a seed, or it was greedy."""

    @property
    def tokens_equal(self) -> bool:
        return self.recorded == self.replayed

    @property
    def bitwise(self) -> bool:
        return self.tokens_equal and self.max_logprob_diff == 0.0

    @property
    def reason(self) -> str:
        """Why the replayed tokens differ from the recorded ones ("" when they do not)."""
        if self.tokens_equal:
            return ""
        if self.edited:
            return "edited after sampling: the recorded tokens are not what the engine returned"
        version, replayed = self.policy_version, self.replayed_version
        if version is not None and replayed is not None and replayed != version:
            weights = "the base model's weights (version 0)" if replayed == 0 else f"version {replayed}'s weights"
            return (f"sampled by policy version {version} but replayed with {weights}: replay it with the run "
                    f"whose checkpoints hold version {version} (--run-dir, or the file inside its run)")
        if not self.seeded:
            return ("unseeded sampling: the recording drew without a seed, so its draws cannot be repeated "
                    "(rollout.sampling.seed seeds every call)")
        return (f"same weights and seed, other tokens: the recording's numerics differ from this replay's (max "
                f"|Δ logprob| {self.max_logprob_diff:.1e}: another engine or device, or batch-dependent kernels "
                "that moved a draw across a boundary)")


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
                 load_version: Callable[[int], Awaitable[int]] | None = None) -> ReplayReport:
    """Re-issue every recorded generate call of `traj` on `engine` and compare (module docstring). `load_version`
    puts a policy version's weights into the engine before a call that version answered, as far as it can, and
    returns the version the engine then holds (None: the engine already holds the right weights)."""
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
        replayed_version = None
        if load_version is not None and span.policy_version is not None:
            replayed_version = await load_version(span.policy_version)
        start, end = span.prompt_tokens, span.prompt_tokens + span.tokens
        params = SamplingParams(temperature=traj.sampling["temperature"], top_p=traj.sampling["top_p"],
                                top_k=traj.sampling["top_k"], max_new_tokens=span.max_new_tokens,
                                stop_token_ids=tuple(span.stop_token_ids or ()), seed=span.seed)
        out = await engine.generate(stream[:start], params, request_id=f"replay-{traj.id}")
        recorded = stream[start:end]
        diffs = [abs(a - b) if a is not None else math.inf
                 for a, b in zip(logprobs[start:end], out.logprobs, strict=False)]
        calls.append(CallReplay(record.turn, span.policy_version, recorded, list(out.token_ids),
                                max(diffs, default=0.0), edited=record.edited, replayed_version=replayed_version,
                                seeded=span.seed is not None or params.temperature == 0))
    await engine.release(f"replay-{traj.id}")
    return ReplayReport(traj.id, calls)


# ---------------------------------------------------------------------------------------------------
# `turnrl replay`
# ---------------------------------------------------------------------------------------------------
async def run_replay(traj: Trajectory, model: str,
                     version_weights: Callable[[int], Any] | None = None) -> ReplayReport:
    """Replay `traj` on an embedded engine over `model` (policy version 0), one call at a time (batch size 1:
    nothing else shares its batches). `version_weights(v)` gives the policy of version v > 0 (a training run's
    checkpoint); without it every call replays with `model`'s weights, and a call sampled by a later version
    says so when its tokens differ."""
    from turnrl.engines.embedded import EmbeddedEngine
    from turnrl.models import load_model, load_tokenizer
    from turnrl.render import ChatRenderer

    renderer = ChatRenderer(load_tokenizer(model))
    engine = EmbeddedEngine(load_model(model), eos_token_ids=sorted(renderer.end_of_turn_ids), max_batch_size=1,
                            share_prefixes=False)  # each call computed as the batch-invariant recording computes it
    loaded = [0]

    async def load_version(version: int) -> int:
        if version_weights is None or version == loaded[0]:
            return loaded[0]
        weights = version_weights(version) if version else load_model(model)
        await engine.update_weights(weights.state_dict(), version=version)
        loaded[0] = version
        return version

    try:
        return await replay(traj, engine, load_version)
    finally:
        engine.close()


def policy_versions(traj: Trajectory) -> list[int]:
    """The policy versions that answered the trajectory's model calls, in order of first use."""
    versions = [t.generate.policy_version for t in traj.turns if t.generate is not None]
    return list(dict.fromkeys(v for v in versions if v is not None))


def verdict(report: ReplayReport) -> str:
    same = sum(c.tokens_equal for c in report.calls)
    line = f"replay of {report.trajectory_id}: {same} of {len(report.calls)} calls give the same tokens"
    if not report.tokens_equal:
        reasons = dict.fromkeys(c.reason for c in report.calls if not c.tokens_equal and not c.edited)
        return line + "; the replay differs: " + "; ".join(reasons)
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
            f"differs at token {first}: recorded {c.recorded[first:first + 1]}, replayed {c.replayed[first:first + 1]}"
            f" ({_short(c.reason)})")
        table.add_row(str(c.turn), str(c.policy_version), str(len(c.recorded)), "yes" if c.tokens_equal else "no",
                      f"{c.max_logprob_diff:.2e}", note)
    return table


def _short(reason: str) -> str:
    """The first clause of a CallReplay.reason, for the table (the verdict line has all of it)."""
    return reason.split(":")[0]
