"""The vocabulary of turnrl: what a rollout produces and what every component passes around.

A trajectory is a prompt followed by an ordered list of *segments*. Each segment is a run of tokens
that came from one source (the model, the environment, a tool, or the chat template) with a loss
mask born together with the tokens: 1 where the model sampled the token, 0 where something else
injected it. Sampling logprobs sit next to the tokens they belong to. Everything the trainer reads
(`response_ids`, `loss_mask`, `rollout_logprobs`) is derived from the segments, never rebuilt by
re-rendering text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

Message = dict[str, Any]
"""An OpenAI-style chat message: `role`, `content` (a string, or a list of parts such as
`{"type": "text", "text": ...}` / `{"type": "image", "image": ...}`), and optionally `tool_calls`,
`tool_call_id`, `name`, `reasoning_content`."""


class RolloutStatus(StrEnum):
    """How a trajectory ended, at the coarsest level. Trainers decide per status what to train on."""

    COMPLETED = "completed"
    """The episode ended normally: the env said done, the model stopped calling tools, or max_turns."""
    TRUNCATED = "truncated"
    """A length limit cut the episode: the engine hit max_new_tokens, or the trajectory token budget ran out."""
    ABORTED = "aborted"
    """The rollout was cancelled from outside (shutdown, engine abort). Content up to that point is kept."""
    FAILED = "failed"
    """Something broke (env exception, engine error, timeout, parity violation). `error` says what."""


class TerminationReason(StrEnum):
    """Why a trajectory ended, precisely. Each reason belongs to exactly one status (see `STATUS_OF`)."""

    ENV_DONE = "env_done"
    """The environment returned done=True."""
    NO_ACTION = "no_action"
    """The environment found no action in the model's reply and ended the episode."""
    NO_TOOL_CALL = "no_tool_call"
    """The tool agent's model answered without calling a tool: its final answer."""
    MAX_TURNS = "max_turns"
    """The turn limit was reached. Reported COMPLETED, as slime does: the episode ran its course."""
    TOKEN_BUDGET = "token_budget"
    """The whole-trajectory token budget (prompt + every turn + every observation) ran out."""
    LENGTH = "length"
    """The engine stopped at the per-turn max_new_tokens without an end-of-turn token."""
    INVALID_CALLS = "invalid_calls"
    """Too many consecutive malformed tool calls (`max_invalid_calls`)."""
    ENV_ERROR = "env_error"
    """The environment (or a tool lifecycle hook) raised; the message is kept in `error`."""
    TIMEOUT = "timeout"
    """An env step, a tool call or the whole trajectory exceeded its time limit."""
    ENGINE_ERROR = "engine_error"
    """The inference engine raised or returned malformed output."""
    PARITY_ERROR = "parity_error"
    """A multimodal parity check failed (image placeholders vs features vs images); never trained on."""
    INVALID_OUTPUT = "invalid_output"
    """A custom agent or scheduler produced tokens/masks/logprobs that break the invariants."""
    CANCELLED = "cancelled"
    """Cancelled from outside (rollout shutdown) or the engine aborted the request."""
    SPLIT = "split"
    """A scheduler rewrote the history: this sample ends here and the episode goes on in a new sample (same
    `info["episode_id"]`, same reward)."""


STATUS_OF: dict[TerminationReason, RolloutStatus] = {
    TerminationReason.ENV_DONE: RolloutStatus.COMPLETED,
    TerminationReason.NO_ACTION: RolloutStatus.COMPLETED,
    TerminationReason.NO_TOOL_CALL: RolloutStatus.COMPLETED,
    TerminationReason.MAX_TURNS: RolloutStatus.COMPLETED,
    TerminationReason.TOKEN_BUDGET: RolloutStatus.TRUNCATED,
    TerminationReason.LENGTH: RolloutStatus.TRUNCATED,
    TerminationReason.INVALID_CALLS: RolloutStatus.COMPLETED,
    TerminationReason.ENV_ERROR: RolloutStatus.FAILED,
    TerminationReason.TIMEOUT: RolloutStatus.FAILED,
    TerminationReason.ENGINE_ERROR: RolloutStatus.FAILED,
    TerminationReason.PARITY_ERROR: RolloutStatus.FAILED,
    TerminationReason.INVALID_OUTPUT: RolloutStatus.FAILED,
    TerminationReason.CANCELLED: RolloutStatus.ABORTED,
    TerminationReason.SPLIT: RolloutStatus.COMPLETED,
}


class FinishReason(StrEnum):
    """Why one generate call stopped."""

    STOP = "stop"
    """A stop token (end-of-turn or a requested stop id) was sampled; it is included in the output."""
    LENGTH = "length"
    """max_new_tokens was reached."""
    ABORT = "abort"
    """The engine aborted the request (shutdown, weight update with abort policy)."""


class SegmentSource(StrEnum):
    """Who produced the tokens of a segment."""

    MODEL = "model"
    """Sampled by the policy (mask 1), possibly with injected mask-0 spans inside (continuations)."""
    ENV = "env"
    """An environment observation rendered by the chat template (mask 0)."""
    TOOL = "tool"
    """Tool responses rendered by the chat template (mask 0)."""
    TEMPLATE = "template"
    """Tokens the chat template adds at a turn boundary that the model did not emit (mask 0)."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one generate call. Logprobs are always those of this distribution."""

    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 disables it."""
    max_new_tokens: int = 256
    """Upper bound on tokens returned by this call (the driver passes min(per-turn cap, budget left))."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the model's end-of-turn tokens. A stop token is included in the output."""
    seed: int | None = None
    """Seed for this request's sampler; None uses the engine's generator."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerateOutput:
    """What an engine returns for one request: exactly the tokens it sampled."""

    token_ids: list[int]
    logprobs: list[float]
    """Logprob of each returned token under the sampling distribution (after temperature / top-k / top-p).
    For greedy requests, the logprob under the unscaled distribution."""
    finish_reason: FinishReason
    policy_version: int = 0
    """Version of the weights that produced the last token (bumped by every `update_weights`)."""
    cached_prompt_tokens: int = 0
    """Prompt tokens whose KV came from the engine's cache instead of a fresh prefill."""

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"GenerateOutput: {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs"
            )


@dataclass
class ToolCall:
    """A tool call parsed from the model's text."""

    name: str
    arguments: dict[str, Any]
    id: str = ""
    """The call id; the model's own id when the format carries one, else generated (`call_<n>`)."""


@dataclass
class Segment:
    """A run of tokens from one source, with its loss mask and logprobs aligned token by token."""

    source: SegmentSource
    token_ids: list[int]
    loss_mask: list[int]
    """1 on tokens the model sampled, 0 on injected tokens."""
    logprobs: list[float | None] | None
    """Sampling logprob where loss_mask is 1, None where it is 0. None for the whole segment when the
    producer could not supply them (the trainer then turns importance correction off for this
    trajectory and says so)."""
    turn: int
    """1-based index of the model turn this segment belongs to (0 for segments before the first turn)."""
    policy_version: int | None = None
    """Weights version that produced a model segment."""

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class Trajectory:
    """One episode: the token stream the engine saw and produced, plus everything needed to score it."""

    id: str
    group_id: str
    sample_index: int
    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    """The conversation for display and for reward functions (assistant text decoded from its tokens)."""
    images: list[str] = field(default_factory=list)
    """References of the images in token-stream order (file path, URL, or `sha256:<hex>`)."""
    reward: float | None = None
    turn_rewards: list[float] = field(default_factory=list)
    """Rewards the environment or tools reported, one entry per env step."""
    info: dict[str, Any] = field(default_factory=dict)
    """Rollout infos: env/tool info dicts, scheduler `rollout_infos`, trace spans, warnings."""
    status: RolloutStatus = RolloutStatus.COMPLETED
    termination_reason: TerminationReason | None = None
    error: str | None = None
    num_turns: int = 0
    """Number of model generate calls."""
    metrics: dict[str, float] = field(default_factory=dict)
    sample: dict[str, Any] = field(default_factory=dict)
    """The dataset row this trajectory came from (columns reach reward functions)."""
    agent: str = ""
    mm_train_inputs: dict[str, Any] | None = field(default=None, repr=False)
    """Processor tensors for training a VLM (pixel_values, image_grid_thw...), merged once per key."""

    # ---- derived views (what trainers and the JSONL read) -------------------------------------
    @property
    def response_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def loss_mask(self) -> list[int]:
        return [m for s in self.segments for m in s.loss_mask]

    @property
    def rollout_logprobs(self) -> list[float | None] | None:
        """Aligned with response_ids: a float where loss_mask is 1, None where it is 0. None overall
        when any model segment lacks logprobs."""
        out: list[float | None] = []
        for s in self.segments:
            if s.logprobs is None:
                if any(s.loss_mask):
                    return None
                out.extend([None] * len(s.token_ids))
            else:
                out.extend(s.logprobs)
        return out

    @property
    def num_response_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    @property
    def num_model_tokens(self) -> int:
        return sum(sum(s.loss_mask) for s in self.segments)

    @property
    def policy_versions(self) -> list[int]:
        return sorted({s.policy_version for s in self.segments if s.policy_version is not None})

    def finish(self, reason: TerminationReason, error: str | None = None) -> None:
        """Set termination reason, the status it implies, and the error message if any."""
        self.termination_reason = reason
        self.status = STATUS_OF[reason]
        if error is not None:
            self.error = error

    # ---- invariants ------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the trajectory and the broken invariant.

        Invariants (DESIGN.md): equal lengths of tokens, mask and logprobs in every segment; mask values
        in {0, 1}; a finite logprob <= 0 exactly where mask is 1 and None where it is 0; non-model
        segments entirely mask 0; the status agrees with the termination reason.
        """
        where = f"trajectory {self.id!r}"
        if not self.prompt_ids and self.status != RolloutStatus.FAILED:
            raise ValueError(f"{where}: prompt_ids is empty")
        _check_token_ids(self.prompt_ids, f"{where} prompt_ids")
        for i, seg in enumerate(self.segments):
            validate_segment(seg, f"{where} segment {i} ({seg.source})")
        if self.termination_reason is not None and STATUS_OF[self.termination_reason] != self.status:
            raise ValueError(
                f"{where}: status {self.status} contradicts termination reason {self.termination_reason} "
                f"(which implies {STATUS_OF[self.termination_reason]})"
            )
        if self.num_turns < 0:
            raise ValueError(f"{where}: num_turns must be >= 0, got {self.num_turns}")

    # ---- serialisation (docs/trajectory-format.md) ---------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": TRAJECTORY_FORMAT_VERSION,
            "id": self.id,
            "group_id": self.group_id,
            "sample_index": self.sample_index,
            "agent": self.agent,
            "status": str(self.status),
            "termination_reason": None if self.termination_reason is None else str(self.termination_reason),
            "error": self.error,
            "num_turns": self.num_turns,
            "reward": self.reward,
            "turn_rewards": self.turn_rewards,
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "loss_mask": self.loss_mask,
            "rollout_logprobs": self.rollout_logprobs,
            "segments": [
                {
                    "source": str(s.source),
                    "turn": s.turn,
                    "start": start,
                    "length": len(s.token_ids),
                    "policy_version": s.policy_version,
                }
                for s, start in zip(self.segments, _starts(self.segments), strict=True)
            ],
            "messages": self.messages,
            "images": self.images,
            "info": self.info,
            "metrics": self.metrics,
            "sample": self.sample,
        }

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Trajectory:
        """Rebuild a trajectory from one JSONL row (segments are re-sliced from the flat arrays)."""
        response, mask = row["response_ids"], row["loss_mask"]
        logprobs = row.get("rollout_logprobs")
        segments = []
        listed = row.get("segments")  # [] is a trajectory without segments (one that failed before its first turn)
        for s in listed if listed is not None else [{"source": "model", "turn": 1, "start": 0, "length": len(response)}]:
            a, b = s["start"], s["start"] + s["length"]
            segments.append(
                Segment(
                    source=SegmentSource(s["source"]),
                    token_ids=list(response[a:b]),
                    loss_mask=list(mask[a:b]),
                    logprobs=None if logprobs is None else list(logprobs[a:b]),
                    turn=s.get("turn", 0),
                    policy_version=s.get("policy_version"),
                )
            )
        reason = row.get("termination_reason")
        return cls(
            id=row["id"],
            group_id=row["group_id"],
            sample_index=row.get("sample_index", 0),
            prompt_ids=list(row["prompt_ids"]),
            segments=segments,
            messages=row.get("messages", []),
            images=row.get("images", []),
            reward=row.get("reward"),
            turn_rewards=row.get("turn_rewards", []),
            info=row.get("info", {}),
            status=RolloutStatus(row.get("status", "completed")),
            termination_reason=None if reason is None else TerminationReason(reason),
            error=row.get("error"),
            num_turns=row.get("num_turns", 0),
            metrics=row.get("metrics", {}),
            sample=row.get("sample", {}),
            agent=row.get("agent", ""),
        )


TRAJECTORY_FORMAT_VERSION = 1


def _starts(segments: list[Segment]) -> list[int]:
    starts, pos = [], 0
    for s in segments:
        starts.append(pos)
        pos += len(s.token_ids)
    return starts


def validate_segment(seg: Segment, where: str) -> None:
    """Raise ValueError (naming `where`) unless tokens, mask and logprobs line up as the invariants demand."""
    _check_token_ids(seg.token_ids, where)
    if len(seg.loss_mask) != len(seg.token_ids):
        raise ValueError(f"{where}: {len(seg.token_ids)} token ids but {len(seg.loss_mask)} mask values")
    if any(m not in (0, 1) for m in seg.loss_mask):
        raise ValueError(f"{where}: loss_mask values must be 0 or 1, got {sorted(set(seg.loss_mask))}")
    if seg.source != SegmentSource.MODEL and any(seg.loss_mask):
        raise ValueError(f"{where}: only model segments may carry mask 1")
    if seg.logprobs is None:
        return
    if len(seg.logprobs) != len(seg.token_ids):
        raise ValueError(f"{where}: {len(seg.token_ids)} token ids but {len(seg.logprobs)} logprobs")
    for j, (m, lp) in enumerate(zip(seg.loss_mask, seg.logprobs, strict=True)):
        if m == 1 and (lp is None or not math.isfinite(lp) or lp > 1e-4):
            raise ValueError(f"{where} token {j}: mask 1 needs a finite logprob <= 0, got {lp}")
        if m == 0 and lp is not None:
            raise ValueError(f"{where} token {j}: mask 0 must not carry a logprob, got {lp}")


def _check_token_ids(ids: list[int], where: str) -> None:
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"{where}: token ids must be non-negative ints, got {t!r}")


@dataclass
class StepResult:
    """What an environment step returns (envs may also return slime's `(observation, done, info)` or
    gym's `(observation, reward, done, info)` tuples; the driver normalises all three)."""

    observation: Any = None
    """Anything `format_observation` turns into chat message(s); a str becomes a user message."""
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    termination_reason: TerminationReason | None = None
    """Why the episode ended when done (default env_done)."""
    # ---- token-level edits (ms-swift's scheduler `step` results; plain envs leave them unset) ----------
    response_token_ids: list[int] | None = None
    """Replace this turn's model tokens (e.g. cut after the answer and append a tip)."""
    response_loss_mask: list[int] | None = None
    """Mask of `response_token_ids` (0 on injected tokens); default all 1."""
    rollout_logprobs: list[float] | None = None
    """One logprob per mask-1 token of `response_token_ids`; default: the engine's, when they still apply."""
    continuation: bool = False
    """The observation (a str) continues the assistant message instead of starting a new turn: its tokens
    are appended to the model segment with mask 0, with no turn closing and no generation prompt."""
    rollout_infos: dict[str, Any] | None = None
    """Merged into `Trajectory.info["rollout_infos"]`; reward functions receive the keys as arguments."""


@dataclass
class Turn:
    """One model turn as an env that implements `step_turn` sees it (tokens, not just text)."""

    turn: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
