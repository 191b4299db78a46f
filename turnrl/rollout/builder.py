"""TrajectoryBuilder: every mask rule. Segments are appended with their mask born with the tokens (1 sampled,
0 injected), logprobs aligned; token edits from token-aware envs and schedulers are validated here.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from turnrl.moe import merge_routing
from turnrl.multimodal import ImageBuffer
from turnrl.types import (
    GenerateOutput,
    Segment,
    SegmentSource,
    TerminationReason,
    TokenEdit,
    Trajectory,
    validate_segment,
)

log = logging.getLogger(__name__)



# ---------------------------------------------------------------------------------------------------
# Building a trajectory
# ---------------------------------------------------------------------------------------------------
class TokenEditError(ValueError):
    """Token edits that break the invariants (ids and mask of unequal length, mask values outside {0, 1})."""


class TrajectoryBuilder:
    """Appends segments to a trajectory, checking each one as it arrives (masks are born with tokens)."""

    def __init__(self, trajectory: Trajectory):
        self.trajectory = trajectory
        self._ids = list(trajectory.prompt_ids)
        self._response_len = 0
        self.images = ImageBuffer()
        """Both image stores (inference list, training tensors per chunk) of a VLM trajectory."""

    @property
    def token_ids(self) -> list[int]:
        """Prompt + response so far: exactly what the next generate call receives. Do not mutate."""
        return self._ids

    @property
    def response_len(self) -> int:
        return self._response_len

    def add(self, segment: Segment) -> Segment:
        validate_segment(segment, f"trajectory {self.trajectory.id!r} new segment ({segment.source})")
        self.trajectory.segments.append(segment)
        self._ids.extend(segment.token_ids)
        self._response_len += len(segment.token_ids)
        return segment

    def add_model(self, out: GenerateOutput, turn: int, *, extend: bool = False) -> None:
        """Append the engine's tokens (mask 1, its logprobs and kept counts), one segment per policy version that
        sampled them (a call can go on across a weight update); `extend` continues the last model segment if its
        version is the same. The call's MoE routing joins the trajectory's, at the stream positions it covers."""
        if out.routed_experts is not None:  # positions are in the stream the engine was given: this one
            traj = self.trajectory
            traj.routed_experts = merge_routing(traj.routed_experts, out.routed_start, out.routed_experts)
        start, versions = 0, out.versions()
        for version, run in itertools.groupby(versions):
            end = start + len(list(run))
            ids, logprobs, last = out.token_ids[start:end], out.logprobs[start:end], self._last_model()
            kept: list[int | None] | None = None if out.kept_counts is None else list(out.kept_counts[start:end])
            if extend and last is not None and last.policy_version == version:
                self._extend(last, ids, 1, logprobs, kept)
            else:
                self.add(Segment(SegmentSource.MODEL, list(ids), [1] * len(ids), list(logprobs), turn, version,
                                 kept_counts=kept))
            start = end

    def add_injected(self, token_ids: Sequence[int], source: SegmentSource, turn: int) -> Segment | None:
        if not token_ids:
            return None
        return self.add(Segment(source, list(token_ids), [0] * len(token_ids), [None] * len(token_ids), turn))

    def continue_model(self, token_ids: Sequence[int], turn: int) -> None:
        """A continuation: injected tokens (mask 0) inside the current model segment, e.g. a tip the model reads
        and then goes on after, in the same assistant message."""
        last = self._last_model()
        if last is None:
            self.add_injected(token_ids, SegmentSource.TEMPLATE, turn)
        else:
            self._extend(last, token_ids, 0, [None] * len(token_ids), None)

    def apply_edit(self, edit: TokenEdit, turn_ids: Sequence[int], turn_logprobs: Sequence[float]) -> list[int]:
        """Replace the last turn's tokens (`turn_ids`, the tail of the last model segment) by `edit`; returns the
        new ids. Raises TokenEditError on ids/mask that break the invariants; unusable logprobs only switch importance
        correction off for this trajectory (the segment gets None logprobs, and `warnings` says why)."""
        traj = self.trajectory
        ids = list(edit.token_ids if edit.token_ids is not None else turn_ids)
        mask = list(edit.loss_mask if edit.loss_mask is not None else [1] * len(ids))
        if len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
            raise TokenEditError(
                f"trajectory {traj.id!r} turn {traj.num_turns}: the token edit (response_token_ids) has {len(ids)} "
                f"tokens and its loss mask (response_loss_mask) {len(mask)} values {sorted(set(mask))}; they must "
                "have equal length and values in {0, 1}")
        logprobs, issue = _edit_logprobs(edit, turn_ids, turn_logprobs, ids, mask)
        if issue is not None:
            log.warning("trajectory %s turn %d: %s; importance-sampling correction is off for this trajectory",
                        traj.id, traj.num_turns, issue)
            traj.warnings.append(f"turn {traj.num_turns}: {issue}")
            traj.metrics["logprob_issues"] = traj.metrics.get("logprob_issues", 0) + 1
        n_old = len(turn_ids)
        last = self._merged_tail(n_old)
        if last is None or n_old > len(last.token_ids):
            raise TokenEditError(f"trajectory {traj.id!r}: no model turn of {n_old} tokens to replace")
        keep = len(last.token_ids) - n_old
        old_kept = None if last.kept_counts is None else last.kept_counts[keep:]
        last.token_ids[keep:], last.loss_mask[keep:] = ids, mask
        last.logprobs = None if logprobs is None or last.logprobs is None else last.logprobs[:keep] + logprobs
        if last.kept_counts is not None:  # a cut of the engine's own tokens keeps their kept counts, as logprobs
            own = edit.logprobs is None and issue is None
            n_trained = sum(mask)  # the engine's first n_trained tokens (mask 1), then injected ones
            last.kept_counts = (last.kept_counts[:keep] + list(old_kept[:n_trained]) + [None] * (len(ids) - n_trained)
                                if own and old_kept is not None else None)
        self._cut_routing(len(self._ids) - n_old + _common_prefix(turn_ids, ids))
        validate_segment(last, f"trajectory {traj.id!r} edited model segment")
        self._ids[len(self._ids) - n_old:] = ids
        self._response_len += len(ids) - n_old
        return ids

    def finish(self, reason: TerminationReason, error: str | None = None) -> Trajectory:
        self.trajectory.finish(reason, error)
        self.trajectory.validate()
        return self.trajectory

    def _cut_routing(self, end: int) -> None:
        """Routing rows from stream position `end` on belong to tokens an edit replaced: dropped (the next call
        routes the new ones; past the last call the trainer routes them itself)."""
        traj = self.trajectory
        if traj.routed_experts is not None and traj.routed_experts.shape[0] > end:
            traj.routed_experts = traj.routed_experts[:end]

    def _last_model(self) -> Segment | None:
        segments = self.trajectory.segments
        return segments[-1] if segments and segments[-1].source == SegmentSource.MODEL else None

    def _merged_tail(self, n_tokens: int) -> Segment | None:
        """The last model segment, merged with the model segments of its turn before it until it holds `n_tokens`
        (a turn that went on across a weight update spans one segment per version; the merged one keeps the
        oldest version, the conservative staleness anchor)."""
        segments = self.trajectory.segments
        while (len(segments) >= 2 and len(segments[-1]) < n_tokens and segments[-1].source == SegmentSource.MODEL
               and segments[-2].source == SegmentSource.MODEL and segments[-2].turn == segments[-1].turn):
            tail, head = segments.pop(), segments[-1]
            head.token_ids += tail.token_ids
            head.loss_mask += tail.loss_mask
            head.logprobs = None if head.logprobs is None or tail.logprobs is None else head.logprobs + tail.logprobs
            head.kept_counts = (None if head.kept_counts is None or tail.kept_counts is None
                                else head.kept_counts + tail.kept_counts)
        return self._last_model()

    def _extend(self, seg: Segment, token_ids: Sequence[int], mask: int, logprobs: Sequence[float | None],
                kept: Sequence[int | None] | None) -> None:
        seg.token_ids.extend(token_ids)
        seg.loss_mask.extend([mask] * len(token_ids))
        if seg.logprobs is not None:
            seg.logprobs.extend(logprobs)
        if seg.kept_counts is not None:  # mask-1 tokens without kept counts leave the segment without any
            added: Sequence[int | None] = [None] * len(token_ids) if kept is None else kept
            seg.kept_counts = None if mask and kept is None else [*seg.kept_counts, *added]
        self._ids.extend(token_ids)
        self._response_len += len(token_ids)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _edit_logprobs(edit: TokenEdit, turn_ids: Sequence[int], turn_logprobs: Sequence[float], ids: list[int],
                   mask: list[int]) -> tuple[list[float | None] | None, str | None]:
    """Logprobs aligned with an edit's ids (None at mask 0), or None and why they cannot be had."""
    n_trained = sum(mask)
    if edit.logprobs is not None:
        if len(edit.logprobs) != n_trained:
            return None, f"rollout_logprobs has {len(edit.logprobs)} values for {n_trained} mask-1 tokens"
        trained: list[float] = list(edit.logprobs)
    elif ids[:n_trained] == list(turn_ids[:n_trained]) and all(mask[:n_trained]):
        trained = list(turn_logprobs[:n_trained])  # a cut of the engine's own tokens keeps their logprobs
    else:
        return None, f"{n_trained} mask-1 tokens are not the engine's own tokens and no rollout_logprobs were given"
    it = iter(trained)
    return [next(it) if m else None for m in mask], None

