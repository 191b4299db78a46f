"""The context policy (`rollout.context`): what the turn loop does when the next prompt would not fit.

`Episode.observe` asks `ContextPolicy.full` before it appends an observation: when the stream with the observation
and a whole next turn (`max_new_tokens`) would pass `max_tokens`, or the env asked for it (`StepResult.compact`),
the episode is compacted and goes on in a new trajectory, a `compaction` branch of this one (docs/trees.md):

    summarize          `instruction` is appended (mask 0) and the policy writes a summary of its work so far: a model
                       turn of this branch (mask 1, trained). The next branch starts from the episode's first messages
                       (system prompt, task), the summary (a user message) and the observation that did not fit (a
                       tool output as a user message: the call it answers stayed behind).
    drop_observations  the next branch is the conversation so far with the tool/env outputs of all but the last
                       `keep_last_turns` turns replaced by a stub, rendered afresh (the model turns it holds were
                       trained in this branch; in the next they are prompt).
    none               never compacted: the episode ends TRUNCATED/token_budget when the context is full.

`max_tokens` is the threshold, not the engine's limit: the summary request (the stream and the instruction) and the
summary itself (up to max_new_tokens) may go past it, so the engine's context must hold max_tokens + the instruction
+ max_new_tokens. A branch that still would not fit (a prompt
longer than max_tokens) has its turns cut to what is left and ends TRUNCATED/token_budget when nothing is.

Budgets count across branches: `max_turns` (the summary turn is not one of them) and `token_budget` (every
branch's response tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from turnrl.reasoning import split_reasoning
from turnrl.types import Message

DEFAULT_INSTRUCTION = (
    "Your context is full. Write a summary of the work so far that lets you continue from it alone: the task, what "
    "you did and found (keep exact values you still need), and what remains to be done.")
SUMMARY_HEADER = "Summary of the work so far (the earlier context was compacted):\n\n"
"""What the summary message of a compaction branch starts with."""
DROPPED = "[output dropped to fit the context]"
"""What `drop_observations` leaves of an older tool or env output."""


class Strategy(StrEnum):
    SUMMARIZE = "summarize"
    DROP_OBSERVATIONS = "drop_observations"
    NONE = "none"


@dataclass(frozen=True)
class ContextPolicy:
    """`rollout.context`: the context window of one branch and what to do when it is full (module docstring)."""

    max_tokens: int | None = None
    """Tokens one branch's stream (prompt + response) may hold; None: no limit, never compacted."""
    strategy: Strategy = Strategy.SUMMARIZE
    keep_last_turns: int = 1
    """drop_observations: the outputs of this many last turns are kept whole."""
    instruction: str = DEFAULT_INSTRUCTION
    """summarize: the user message that asks the policy for its summary."""

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"rollout.context.max_tokens must be >= 1 or null, got {self.max_tokens}")
        if self.keep_last_turns < 0:
            raise ValueError(f"rollout.context.keep_last_turns must be >= 0, got {self.keep_last_turns}")
        object.__setattr__(self, "strategy", Strategy(self.strategy))

    def room(self, stream_len: int) -> int | None:
        """Tokens the branch's stream may still grow by (None: no limit)."""
        return None if self.max_tokens is None else self.max_tokens - stream_len

    def full(self, stream_len: int, max_new_tokens: int, asked: bool) -> Strategy | None:
        """How to compact now (None: not now): when the stream (the next observation included) and a whole next turn
        would pass `max_tokens`, or the env asked."""
        if self.strategy == Strategy.NONE:
            return None
        over = self.max_tokens is not None and stream_len + max_new_tokens > self.max_tokens
        return self.strategy if over or asked else None

    def request(self) -> Message:
        """The message asking for the summary."""
        return {"role": "user", "content": self.instruction}


def after_summary(first_messages: list[Message], summary: str, observation: list[Message]) -> list[Message]:
    """A summarize branch's conversation: the episode's first messages (system prompt, task), the summary (its
    reasoning, if any, left out), then the observation that did not fit, tool outputs as user messages."""
    _, answer = split_reasoning(summary)
    summary_message = {"role": "user", "content": SUMMARY_HEADER + (answer.strip() or summary.strip())}
    return [*first_messages, summary_message, *(_as_user(m) for m in observation)]


def _as_user(message: Message) -> Message:
    """A tool output as a user message (the assistant call it answers is not in the new branch)."""
    if message.get("role") != "tool":
        return message
    content = message.get("content")
    head = f"Output of {message.get('name') or 'the tool call'}:\n"
    if isinstance(content, list):
        return {"role": "user", "content": [{"type": "text", "text": head}, *content]}
    return {"role": "user", "content": head + str(content or "")}


def drop_observations(messages: list[Message], keep_last_turns: int) -> list[Message] | None:
    """The conversation with every tool/env output after the first model turn replaced by `DROPPED`, except those of
    the last `keep_last_turns` model turns; None when there is nothing to drop."""
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        return None
    keep_from = turns[-keep_last_turns] if 0 < keep_last_turns <= len(turns) else (turns[0] if keep_last_turns
                                                                                  else len(messages))
    out, dropped = [], False
    for i, m in enumerate(messages):
        if turns[0] < i < keep_from and m.get("role") in ("tool", "user") and m.get("content") != DROPPED:
            m = {**m, "content": DROPPED}
            dropped = True
        out.append(m)
    return out if dropped else None
