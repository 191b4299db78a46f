"""The vocabulary of turnrl: what a rollout produces and what every component passes around.

A trajectory is a prompt followed by an ordered list of *segments*. Each segment is a run of tokens
that came from one source (the model, the environment, a tool, or the chat template) with a loss
mask born together with the tokens: 1 where the model sampled the token, 0 where something else
injected it. Sampling logprobs sit next to the tokens they belong to. Everything the trainer reads
(`response_ids`, `loss_mask`, `rollout_logprobs`) is derived from the segments, never rebuilt by
re-rendering text.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, cast

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
    """A scheduler rewrote the history, or the context was compacted: this branch ends here and the episode goes on
    in a new one (same `episode_id`, same reward; its `parent` names this one)."""


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


class BranchKind(StrEnum):
    """Why a trajectory branched from another of its episode (`Parent.kind`; docs/trees.md)."""

    FORK = "fork"
    """An external agent's call diverged from its session's token stream (history rewritten or retried)."""
    COMPACTION = "compaction"
    """The context filled up: the episode goes on from the system prompt, the task and a summary."""
    SUBAGENT = "subagent"
    """A harness's sub-agent (its own conversation in the same episode, sharing the episode's reward)."""
    SPLIT = "split"
    """A scheduler rewrote the history (ms-swift's thinking tips, trajectory splitting)."""
    SEAT = "seat"
    """Another seat of a game the policy plays against itself: that player's own conversation in the same episode,
    with that player's own reward (turnrl.envs.seats)."""


@dataclass(frozen=True)
class Parent:
    """Where a trajectory branched from: `Trajectory.parent` (None for an episode's first trajectory)."""

    id: str
    """The trajectory it branched from (same `episode_id`)."""
    at: int | None
    """Index into the parent's token stream (prompt_ids + response_ids) up to which the two streams are identical:
    both start with the same `at` tokens. None when the branch starts from a new context (no token shared)."""
    kind: BranchKind

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "at": self.at, "kind": str(self.kind)}

    @classmethod
    def from_json(cls, row: Any, where: str = "parent") -> Parent | None:
        """A `parent` object of the trajectory format (None stays None); raises ValueError naming the field."""
        if row is None:
            return None
        if not isinstance(row, dict) or not isinstance(row.get("id"), str):
            raise ValueError(f"{where} must be null or {{id: str, at: int | null, kind}}, got {row!r}"[:300])
        at = row.get("at")
        if at is not None and (not is_int(at) or at < 0):
            raise ValueError(f"{where}.at must be null or an integer >= 0, got {at!r}")
        try:
            kind = BranchKind(str(row.get("kind")))
        except ValueError:
            raise ValueError(f"{where}.kind must be one of {', '.join(BranchKind)}, got {row.get('kind')!r}") from None
        return cls(row["id"], at, kind)


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
        for name, rule in SAMPLING_RULES.items():
            if not rule.check(getattr(self, name)):
                raise ValueError(f"SamplingParams.{name} must be {rule.expected}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def is_int(value: Any) -> bool:
    """An integer that is not a bool (JSON's `true` is not a token id)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A finite integer or float that is not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class FieldRule:
    """What a value must be: `check(value)` holds; `expected` says it to the user ("an integer >= 1")."""

    check: Callable[[Any], bool]
    expected: str


SAMPLING_RULES: dict[str, FieldRule] = {
    "temperature": FieldRule(lambda v: is_real(v) and v >= 0, "a finite number >= 0"),
    "top_p": FieldRule(lambda v: is_real(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": FieldRule(is_int, "an integer (-1 or 0 disables it)"),
    "max_new_tokens": FieldRule(lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    "stop_token_ids": FieldRule(lambda v: isinstance(v, list | tuple | set | frozenset) and all(is_int(t) and t >= 0
                                                                                          for t in v),
                           "a list of token ids (integers >= 0)"),
    "seed": FieldRule(lambda v: v is None or (is_int(v) and -(2**63) <= v < 2**64), "null or a 64-bit integer"),
}
"""The rule of every SamplingParams field: the one table, checked wherever sampling settings enter. `SamplingParams`
checks it when built; the token-level wire (`sampling_from_json`, turnrl/engines/http.py) checks the JSON
against it before building one, so the error names the field as sent (`sampling.top_k`); `EmbeddedEngine`
checks it again at its door (`check_sampling`: params whose checks were bypassed would fail every request
batched with them); the chat APIs check their request fields against `CHAT_SAMPLING_RULES`. Where a boundary
differs, it is written here:
- the token-level wire: `stop_token_ids: null` means none (`JSON_SAMPLING_RULES`);
- the chat APIs (OpenAI, Responses, Anthropic): `top_p: 0` is allowed, as OpenAI allows it: the smallest nucleus,
  the most likely token alone, so the proxy samples greedily (top_p 1, top_k 1); a field sent as null is
  absent; the cap is named `max_tokens` (`max_output_tokens`, `max_completion_tokens`) and stop *strings*
  replace `stop_token_ids` (`CHAT_SAMPLING_RULES`, `turnrl.serve.http.sampling_fields`);
- an engine bounds stop token ids by its vocabulary too (`check_sampling`);
- the run's config (`SamplingConfig`, turnrl/config.py) states the same ranges in pydantic for its fields."""

JSON_SAMPLING_RULES: dict[str, FieldRule] = {
    **SAMPLING_RULES,
    "stop_token_ids": FieldRule(lambda v: v is None or SAMPLING_RULES["stop_token_ids"].check(v),
                           "null or a list of token ids (integers >= 0)"),
}
"""The token-level wire's rules (`POST /generate`, `POST /rollout`): `stop_token_ids` may be null."""

CHAT_SAMPLING_RULES: dict[str, FieldRule] = {
    **{name: SAMPLING_RULES[name] for name in ("temperature", "top_k", "max_new_tokens", "seed")},
    "top_p": FieldRule(lambda v: is_real(v) and 0 <= v <= 1, "a number in [0, 1]"),
}
"""The chat APIs' rules, by SamplingParams name: `top_p` 0 allowed (greedy); no stop token ids."""


def broken_sampling_field(fields: dict[str, Any], rules: dict[str, FieldRule] = SAMPLING_RULES) -> tuple[str, str] | None:
    """(name, what it must be) of the first of `fields` that breaks its rule in `rules`; None when all hold.
    A name without a rule is the caller's to refuse."""
    for name, value in fields.items():
        rule = rules.get(name)
        if rule is not None and not rule.check(value):
            return name, rule.expected
    return None


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
    token_versions: list[int] | None = None
    """The policy version of each token, when the call went on across a weight update (pause mode `keep`);
    None: every token has `policy_version`."""
    preempted: bool = False
    """With finish_reason `abort`: a weight update (pause mode `abort`) stopped the call; the tokens so far are
    kept and the driver resubmits prompt + tokens to finish the turn under the new weights."""
    kept_counts: list[int] | None = None
    """The sampling mask of each returned token (`rollout.sampling_mask: record`), as the size k of its kept set:
    top-k and top-p kept the k most likely tokens of the temperature-scaled distribution (ties do not matter: the
    trainer needs the kept logits' values, not their ids), and the token was drawn from those k, renormalised.
    The vocabulary size where nothing was cut (greedy). None: the engine did not record it."""
    routed_experts: Any = field(default=None, repr=False)
    """MoE routing (`rollout.router_replay: record`): a `torch.Tensor` [tokens, moe_layers, top_k] of the expert ids
    each MoE layer's router chose for each token this call fed through the model, in stream order from position
    `routed_start` of prompt + returned tokens (a prefix served from the KV cache was routed by an earlier call;
    the last returned token is never fed, so it has none). None: not recorded."""
    routed_start: int = 0
    """Stream position (index into prompt + returned tokens) of the first row of `routed_experts`."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("logprobs", "token_versions", "kept_counts"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"GenerateOutput: {n} token ids but {len(values)} {name.replace('_', ' ')}")

    def head(self, n: int) -> GenerateOutput:
        """The first `n` tokens of this output, with everything aligned to them (versions, kept counts, routing:
        the tokens dropped after token n-1 were fed, so each takes one routing row with it)."""
        drop = len(self.token_ids) - n
        routed = self.routed_experts
        if routed is not None and drop > 0:
            routed = routed[: max(routed.shape[0] - drop, 0)]
        return dataclasses.replace(
            self, token_ids=self.token_ids[:n], logprobs=self.logprobs[:n],
            token_versions=None if self.token_versions is None else self.token_versions[:n],
            kept_counts=None if self.kept_counts is None else self.kept_counts[:n], routed_experts=routed)

    def versions(self) -> list[int]:
        """The policy version of every token."""
        return self.token_versions if self.token_versions is not None else [self.policy_version] * len(self.token_ids)


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
    kept_counts: list[int | None] | None = None
    """The sampling mask of each mask-1 token (see `GenerateOutput.kept_counts`), None at mask 0; None for the whole
    segment when it was not recorded (the trainer then scores its tokens under the full softmax)."""

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
    """Free-form extras of one producer (e.g. `tool_stats`, `render_check`, `mlflow_trace_id`); what several
    modules read has a field of its own below."""
    turns: list[TurnRecord] = field(default_factory=list)
    """One record per model turn: generate and env timings, token counts (the trace tree)."""
    rollout_infos: dict[str, Any] = field(default_factory=dict)
    """Infos schedulers and envs return for reward functions (each key is passed to them by name)."""
    tool_rewards: dict[str, float] = field(default_factory=dict)
    """`calc_reward()` of each stateful tool the trajectory used, by tool name."""
    episode_id: str | None = None
    """Set on the trajectories of an episode with several (branches: they share its reward): its first trajectory's id
    (the proxy: the session id)."""
    parent: Parent | None = None
    """The trajectory this one branched from, where and why (None: an episode's first trajectory; docs/trees.md)."""
    reward_error: str | None = None
    """The exception the reward function raised (the reward is then None, never a silent 0.0)."""
    warnings: list[str] = field(default_factory=list)
    """What went wrong without deciding the outcome, in order: dropped rollout logprobs, cleanup and release
    failures, and any error raised after the first one (which stays in `error`)."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """The sampling distribution of its model turns: temperature, top_p, top_k (each call's seed, token cap and
    stop tokens are in its `turns[k].generate`). With them a trajectory can be replayed (`turnrl replay`)."""
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
    routed_experts: Any = field(default=None, repr=False)
    """MoE routing (`rollout.router_replay: record`): a `torch.Tensor` [tokens, moe_layers, top_k] (uint8, or int16
    past 256 experts) of the experts the engine's routers chose for the first `tokens` tokens of prompt_ids +
    response_ids, which the trainer forces in its forward (`turnrl.moe.replay_routing`). It usually stops one token
    short of the stream (the last token was never fed to the engine); a row of -1 is a token the engine did not
    route. None: not recorded."""

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
    def kept_counts(self) -> list[int | None] | None:
        """Aligned with response_ids: the sampling mask (kept-set size) of each mask-1 token, None at mask 0. None
        overall when any model segment lacks them (as `rollout_logprobs`)."""
        out: list[int | None] = []
        for s in self.segments:
            if s.kept_counts is None:
                if any(s.loss_mask):
                    return None
                out.extend([None] * len(s.token_ids))
            else:
                out.extend(s.kept_counts)
        return out

    @property
    def stream(self) -> list[int]:
        """prompt_ids + response_ids: the token stream `Parent.at` indexes."""
        return self.prompt_ids + self.response_ids

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
        """Set termination reason, the status it implies, and the error message if any. The first error is
        kept in `error`; a later one goes to `warnings` (the first usually explains the later ones)."""
        self.termination_reason = reason
        self.status = STATUS_OF[reason]
        if error is not None:
            self.add_error(error)

    def add_error(self, error: str) -> None:
        """Record an error: the first in `error`, every later one appended to `warnings`."""
        if self.error is None:
            self.error = error
        elif error != self.error:
            self.warnings.append(error)

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
        if self.parent is not None:
            at, n = self.parent.at, len(self.prompt_ids) + self.num_response_tokens
            if self.parent.id == self.id or (at is not None and not 0 <= at <= n):
                raise ValueError(f"{where}: parent {self.parent} must name another trajectory and share at most its "
                                 f"own {n} stream tokens")
        if self.routed_experts is not None:
            rows, stream = self.routed_experts.shape[0], len(self.prompt_ids) + self.num_response_tokens
            if self.routed_experts.dim() != 3 or rows > stream:
                raise ValueError(f"{where}: routed_experts must be [tokens <= {stream}, moe_layers, top_k], got "
                                 f"{tuple(self.routed_experts.shape)}")

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
            "segments": [_segment_json(s, start) for s, start in zip(  # starts: one more (the end), unused
                self.segments, itertools.accumulate((len(s.token_ids) for s in self.segments), initial=0), strict=False)],
            "messages": self.messages,
            "images": self.images,
            "turns": [t.to_json() for t in self.turns],
            "rollout_infos": self.rollout_infos,
            "tool_rewards": self.tool_rewards,
            "episode_id": self.episode_id,
            "parent": None if self.parent is None else self.parent.to_json(),
            "reward_error": self.reward_error,
            "warnings": self.warnings,
            "sampling": self.sampling,
            "info": self.info,
            "metrics": self.metrics,
            "sample": self.sample,
            **({} if self.routed_experts is None else {"routed_experts": _routing_json(self.routed_experts)}),
        }

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Trajectory:
        """Rebuild a trajectory from one JSONL row (segments are re-sliced from the flat arrays)."""
        response, mask = row["response_ids"], row["loss_mask"]
        logprobs = row.get("rollout_logprobs")
        segments = []
        listed: list[dict[str, Any]] | None = row.get("segments")  # [] = failed before its first turn
        whole: list[dict[str, Any]] = [{"source": "model", "turn": 1, "start": 0, "length": len(response)}]
        for s in listed if listed is not None else whole:
            a, b = s["start"], s["start"] + s["length"]
            segments.append(
                Segment(
                    source=SegmentSource(s["source"]),
                    token_ids=list(response[a:b]),
                    loss_mask=list(mask[a:b]),
                    logprobs=None if logprobs is None else list(logprobs[a:b]),
                    turn=s.get("turn", 0),
                    policy_version=s.get("policy_version"),
                    kept_counts=s.get("kept_counts"),
                )
            )
        reason = row.get("termination_reason")
        info = dict(row.get("info") or {})
        if row.get("format_version", 1) < 2:  # version 1 kept these in `info` (docs/trajectory-format.md)
            row = {**row, **_fields_from_v1_info(info)}
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
            info=info,
            turns=[TurnRecord.from_json(t) for t in row.get("turns") or []],
            rollout_infos=row.get("rollout_infos") or {},
            tool_rewards=row.get("tool_rewards") or {},
            episode_id=row.get("episode_id"),
            parent=Parent.from_json(row.get("parent"), f"trajectory {row['id']!r} parent"),
            reward_error=row.get("reward_error"),
            warnings=list(row.get("warnings") or []),
            sampling=row.get("sampling") or {},
            status=RolloutStatus(row.get("status", "completed")),
            termination_reason=None if reason is None else TerminationReason(reason),
            error=row.get("error"),
            num_turns=row.get("num_turns", 0),
            metrics=row.get("metrics", {}),
            sample=row.get("sample", {}),
            agent=row.get("agent", ""),
            routed_experts=None if row.get("routed_experts") is None else _routing_json(row["routed_experts"], decode=True),
        )


TRAJECTORY_FORMAT_VERSION = 3
"""3 added `parent` (the episode tree; versions 1 and 2 read as null: flat episodes). 2 moved `turns`, `rollout_infos`, `tool_rewards`, `episode_id` and `reward_error` out of `info` into fields of
their own and added `warnings`; version-1 files still load (`_fields_from_v1_info`)."""


def _fields_from_v1_info(info: dict[str, Any]) -> dict[str, Any]:
    """Version 1 rows kept the named fields inside `info`: take them out (in place) as top-level values."""
    moved: dict[str, Any] = {key: info.pop(key) for key in ("turns", "rollout_infos", "tool_rewards", "episode_id", "reward_error")
             if key in info}
    warnings = [str(w) for w in info.pop("logprob_issues", [])]
    for key in ("trajectory_end_error", "tool_release_error"):
        if key in info:
            warnings.append(str(info.pop(key)))
    return {**moved, "warnings": warnings}


def _segment_json(s: Segment, start: int) -> dict[str, Any]:
    out = {"source": str(s.source), "turn": s.turn, "start": start, "length": len(s.token_ids),
           "policy_version": s.policy_version}
    if s.kept_counts is not None:  # only where recorded: rows without it read as before
        out["kept_counts"] = s.kept_counts
    return out


def _routing_json(experts: Any, decode: bool = False) -> Any:
    """[tokens, layers, k] expert ids as `{dtype, shape, data}` (the base64 of the little-endian array), or back."""
    from turnrl.moe import decode_routing, encode_routing

    return decode_routing(experts) if decode else encode_routing(experts)


def validate_segment(seg: Segment, where: str) -> None:
    """Raise ValueError (naming `where`) unless tokens, mask and logprobs line up as the invariants demand. Whole-list
    C loops (`map(type, ...)`, `count`, `sum`, `max`) can only say "valid"; else the per-token checks name the value."""
    ids, mask, n = seg.token_ids, seg.loss_mask, len(seg.token_ids)
    if not (list(map(type, ids)).count(int) == n and (n == 0 or min(ids) >= 0)):  # type int: no bool, no subclass
        _check_token_ids(ids, where)
    if len(mask) != n:
        raise ValueError(f"{where}: {n} token ids but {len(mask)} mask values")
    zeros, ones = (mask.count(0), mask.count(1)) if type(mask) is list else (-1, -1)  # count: ==, as `in` compares
    if zeros + ones != n and any(m not in (0, 1) for m in mask):
        raise ValueError(f"{where}: loss_mask values must be 0 or 1, got {sorted(set(mask))}")
    if seg.source != SegmentSource.MODEL and any(mask):
        raise ValueError(f"{where}: only model segments may carry mask 1")
    if seg.kept_counts is not None:
        _check_kept_counts(seg, where)
    logprobs = seg.logprobs
    if logprobs is None:
        return
    if len(logprobs) != n:
        raise ValueError(f"{where}: {n} token ids but {len(logprobs)} logprobs")
    kinds = list(map(type, logprobs)) if type(logprobs) is list else []
    if zeros == n and kinds.count(type(None)) == n:
        return  # injected tokens: no logprob anywhere
    floats = cast(list[float], logprobs)  # when every type is float (checked first)
    if ones == n and kinds.count(float) == n and math.isfinite(sum(floats)) and max(floats, default=0.0) <= 1e-4:
        return  # sampled tokens: finite floats (a sum of floats is finite only when every term is), <= 1e-4
    for j, (m, lp) in enumerate(zip(mask, logprobs, strict=True)):
        if m == 1 and (lp is None or not math.isfinite(lp) or lp > 1e-4):
            raise ValueError(f"{where} token {j}: mask 1 needs a finite logprob <= 0, got {lp}")
        if m == 0 and lp is not None:
            raise ValueError(f"{where} token {j}: mask 0 must not carry a logprob, got {lp}")


def _check_kept_counts(seg: Segment, where: str) -> None:
    """A kept-set size >= 1 exactly where the mask is 1, None where it is 0."""
    kept = seg.kept_counts or []
    if len(kept) != len(seg.token_ids):
        raise ValueError(f"{where}: {len(seg.token_ids)} token ids but {len(kept)} kept counts")
    for j, (m, k) in enumerate(zip(seg.loss_mask, kept, strict=True)):
        if m == 1 and not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
            raise ValueError(f"{where} token {j}: mask 1 needs a kept count (an int >= 1), got {k!r}")
        if m == 0 and k is not None:
            raise ValueError(f"{where} token {j}: mask 0 must not carry a kept count, got {k!r}")


def _check_token_ids(ids: list[int], where: str) -> None:
    for t in ids:
        if not is_int(t) or t < 0:
            raise ValueError(f"{where}: token ids must be non-negative ints, got {t!r}")


@dataclass
class TokenEdit:
    """A rewrite of the turn the model just produced (ms-swift's `step` token fields), applied and checked by
    `TrajectoryBuilder.apply_edit`. Rules (ms-swift's, but loud): `token_ids` and `loss_mask` have equal length
    and mask values in {0, 1}, else the trajectory fails (invalid_output); one logprob per mask-1 token, else
    importance correction is switched off for this trajectory only (and `Trajectory.warnings` says why)."""

    token_ids: list[int] | None = None
    """The turn's new tokens (e.g. the reply cut after its answer, then a tip); None keeps the engine's."""
    loss_mask: list[int] | None = None
    """Mask of `token_ids` (0 on injected tokens); None = all 1."""
    logprobs: list[float] | None = None
    """One sampling logprob per mask-1 token; None = the engine's, when the mask-1 tokens are its own prefix."""


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
    edit: TokenEdit | None = None
    """Token-aware envs only (schedulers): replace this turn's model tokens before anything else happens."""
    continuation: bool = False
    """The observation (a str) continues the assistant message instead of starting a new turn: its tokens
    are appended to the model segment with mask 0, with no turn closing and no generation prompt."""
    rollout_infos: dict[str, Any] | None = None
    """Merged into `Trajectory.rollout_infos`; reward functions receive the keys as arguments."""
    compact: bool = False
    """Ask for the context to be compacted now (`rollout.context.strategy`; turnrl.rollout.context): the episode goes
    on in a `compaction` branch after this observation, whether or not the context is full."""


@dataclass
class Turn:
    """One model turn as an env that implements `step_turn` sees it (tokens, not just text)."""

    turn: int
    text: str
    """The reply text of this generate call (on a continuation: only the new part)."""
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    messages: list[Message] = field(default_factory=list)
    """The conversation exactly as the token stream holds it, this reply included. Read it; do not mutate it."""
    continued: bool = False
    """This call continued the previous assistant message (after a continuation observation)."""


@dataclass
class GenerateSpan:
    """One generate call of a turn (times in ns since the epoch, as traces want them)."""

    start_ns: int
    end_ns: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    tokens: int = 0
    finish_reason: FinishReason | None = None
    policy_version: int | None = None
    error: str | None = None
    max_new_tokens: int | None = None
    """What the call asked for: min(per-turn cap, budget left)."""
    seed: int | None = None
    """The call's sampler seed (derived from the run seed, the trajectory id and the turn); None = unseeded."""
    stop_token_ids: list[int] | None = None
    """The call's stop tokens (end-of-turn tokens and any requested ones)."""


@dataclass
class EnvSpan:
    """The env step of a turn (all attempts together)."""

    start_ns: int
    end_ns: int = 0
    attempts: int = 0
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """The step's info dict (a tool agent's `tool_calls` records live here)."""
    error: str | None = None


@dataclass
class TurnRecord:
    """What happened in one model turn: the trace of its generate call and env step."""

    turn: int
    generate: GenerateSpan | None = None
    env: EnvSpan | None = None
    observation_tokens: int = 0
    """Mask-0 tokens appended after the turn (template closing + observation delta, or a continuation)."""
    edited: bool = False
    """A token edit (a scheduler's) replaced what the engine returned for this turn."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Producer-specific details (the OpenAI proxy: call index, whether the call continued the stream)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"turn": self.turn, **self.extra}
        for name in ("generate", "env"):
            span = getattr(self, name)
            if span is not None:
                out[name] = {k: (str(v) if isinstance(v, FinishReason) else v)
                             for k, v in dataclasses.asdict(span).items() if v is not None}
        out["observation_tokens"] = self.observation_tokens
        if self.edited:
            out["edited"] = True
        return out

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> TurnRecord:
        extra = {k: v for k, v in row.items() if k not in ("turn", "generate", "env", "observation_tokens", "edited")}
        gen, env = row.get("generate"), row.get("env")
        if gen is not None and gen.get("finish_reason") is not None:
            gen = {**gen, "finish_reason": FinishReason(gen["finish_reason"])}
        return cls(row.get("turn", 0), GenerateSpan(**gen) if gen else None, EnvSpan(**env) if env else None,
                   row.get("observation_tokens", 0), row.get("edited", False), extra)
