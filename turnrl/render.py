"""Chat templates to tokens, append-only: the initial prompt, observation deltas, turn-boundary repair, and a
sanity check against a full re-render.

The conversation is never re-tokenized. After the prompt, the token stream only grows by what the model
sampled and by *observation deltas*: the tokens the chat template would add for new messages (tool
results, env feedback) plus the next generation prompt. A delta is computed against a fixed dummy
conversation, not the real history (slime's and verl's trick): render `[system, user, assistant(MARK)] +
new_messages` and keep what follows the dummy assistant turn. So the system prompt and tool block are never
repeated, and templates that rewrite history (Qwen3 drops the reasoning of earlier turns) still give the
same delta every turn: the stream stays append-only and identical between rollout and training.

Turn-boundary repair: templates close an assistant turn with more than the stop token the model emits
(Qwen and ChatML add a newline after `<|im_end|>`). The closing text is read off the template itself (what
follows the dummy assistant content), so no per-family table is needed; whatever part of it the model
did not emit is appended as a mask-0 `template` segment before the next observation. A model that stopped
on another stop token (say `</tool_call>`) gets the whole closing, end-of-turn token included, masked.
"""

from __future__ import annotations

import difflib
import logging
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from turnrl.reasoning import remove_reasoning_blocks
from turnrl.types import Message

log = logging.getLogger(__name__)

DUMMY_SYSTEM = "You are a helpful assistant."
DUMMY_USER = "Hello."
DUMMY_MARK = "TURNRL_DUMMY_ASSISTANT_REPLY"


class SanityMode(StrEnum):
    STRICT = "strict"
    """Any difference between the incremental stream and a full re-render is reported."""
    IGNORE_STRIPPABLE = "ignore_strippable"
    """Differences only in reasoning blocks (`<think>...</think>`) or whitespace are accepted."""
    DISABLE = "disable"


class RenderError(ValueError):
    """The chat template cannot be used append-only (the message says why and with which messages)."""


@dataclass
class Rendered:
    """A rendered chunk of the token stream (the prompt, or one observation delta) and its images."""

    ids: list[int]
    images: list[Any] = field(default_factory=list)
    """Inference side: the images of this chunk in order (as given: paths, PIL images, base64...)."""
    mm_inputs: dict[str, Any] = field(default_factory=dict)
    """Training side: the processor's tensors for this chunk (pixel_values, image_grid_thw...)."""


@dataclass
class RenderCheck:
    """Result of comparing the incremental stream with a full re-render of the conversation."""

    ok: bool
    strippable: bool = False
    """True when the only differences are reasoning blocks or whitespace."""
    diff: str = ""


class ChatRenderer:
    """Turns chat messages into token ids with a Hugging Face tokenizer's chat template.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        chat_template_kwargs: passed to every render (e.g. `{"enable_thinking": False}` for Qwen3).
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise RenderError(f"tokenizer {type(tokenizer).__name__} has no chat template")
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._closing_text = self._derive_closing_text()
        self.closing_ids: list[int] = self.encode(self._closing_text)
        """Tokens that close an assistant turn in the template (e.g. `<|im_end|>`, `\\n`)."""
        eos = tokenizer.eos_token_id
        ends = {eos} if isinstance(eos, int) else set(eos or [])
        if self.closing_ids:
            ends.add(self.closing_ids[0])
        self.end_of_turn_ids: frozenset[int] = frozenset(ends)
        """Token ids that end a model turn: the tokenizer's eos and the template's end-of-turn token."""

    # ---- text level -----------------------------------------------------------------------------
    def render_text(
        self, messages: list[Message], tools: list[dict] | None = None, *, add_generation_prompt: bool
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False,
            add_generation_prompt=add_generation_prompt, **self.chat_template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _dummy(self) -> list[Message]:
        return [
            {"role": "system", "content": DUMMY_SYSTEM},
            {"role": "user", "content": DUMMY_USER},
            {"role": "assistant", "content": DUMMY_MARK},
        ]

    def _derive_closing_text(self) -> str:
        text = self.render_text(self._dummy(), add_generation_prompt=False)
        at = text.find(DUMMY_MARK)
        if at < 0:
            raise RenderError("the chat template drops assistant content; cannot derive the turn closing")
        return text[at + len(DUMMY_MARK):]

    # ---- token level ----------------------------------------------------------------------------
    def initial_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """The prompt: every message rendered, followed by the generation prompt."""
        return self.encode(self.render_text(messages, tools, add_generation_prompt=True))

    def observation_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """Tokens for `messages` appended after a closed assistant turn, plus the next generation prompt."""
        if not messages:
            raise RenderError("observation_ids needs at least one message")
        text = self.render_text(self._dummy() + list(messages), tools, add_generation_prompt=True)
        at = text.find(DUMMY_MARK)
        start = at + len(DUMMY_MARK)
        if at < 0 or not text.startswith(self._closing_text, start):
            roles = [m.get("role") for m in messages]
            raise RenderError(
                f"the chat template closes an assistant turn differently when it is followed by {roles}: "
                f"expected {self._closing_text!r} after the assistant content, got {text[start:start + 40]!r}"
            )
        return self._encode_suffix(text, start + len(self._closing_text))

    def _encode_suffix(self, text: str, char_start: int) -> list[int]:
        """Tokens of `text[char_start:]` as they are tokenized inside the whole text (same boundaries)."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        for i, (a, _) in enumerate(enc["offset_mapping"]):
            if a >= char_start:
                if a != char_start:
                    raise RenderError(f"observation boundary at char {char_start} falls inside a token")
                suffix = enc["input_ids"][i:]
                if suffix != self.encode(text[char_start:]):
                    raise RenderError("observation tokens depend on the text before them; not append-safe")
                return suffix
        raise RenderError("the observation rendered to no tokens")

    def turn_closing_ids(self, model_ids: list[int]) -> list[int]:
        """Template tokens to append (mask 0) after a model turn so it is closed as the template closes it."""
        closing = self.closing_ids
        for k in range(min(len(closing), len(model_ids)), 0, -1):
            if model_ids[-k:] == closing[:k]:
                return closing[k:]
        return list(closing)

    def assistant_text(self, model_ids: list[int]) -> str:
        """The reply text: decoded model tokens without a trailing end-of-turn token."""
        ids = list(model_ids)
        while ids and ids[-1] in self.end_of_turn_ids:
            ids.pop()
        return self.decode(ids)

    def initial(self, messages: list[Message], tools: list[dict] | None = None) -> Rendered:
        _refuse_images(messages)
        return Rendered(self.initial_ids(messages, tools))

    def observation(self, messages: list[Message], tools: list[dict] | None = None) -> Rendered:
        _refuse_images(messages)
        return Rendered(self.observation_ids(messages, tools))

    # ---- sanity check (T2) ----------------------------------------------------------------------
    def check(
        self, stream_ids: list[int], messages: list[Message], tools: list[dict] | None = None,
        mode: SanityMode | str = SanityMode.STRICT,
    ) -> RenderCheck:
        """Compare the incremental stream with a full render of `messages` (a prefix match: the stream
        ends where the model stopped, the render also closes the last turn)."""
        mode = SanityMode(mode)
        if mode == SanityMode.DISABLE:
            return RenderCheck(ok=True)
        # assistant content already holds the raw tool-call text; structured tool_calls would render it twice
        plain = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
        full = self.render_text(plain, tools, add_generation_prompt=False)
        stream = self.decode(stream_ids)
        if full.startswith(stream):
            return RenderCheck(ok=True)
        strippable = _normalise(full).startswith(_normalise(stream))
        diff = readable_diff(stream, full)
        ok = strippable and mode == SanityMode.IGNORE_STRIPPABLE
        return RenderCheck(ok=ok, strippable=strippable, diff=diff)


def _refuse_images(messages: list[Message]) -> None:
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(p.get("type") in ("image", "image_url") for p in content):
            raise RenderError("the conversation has images but the policy is text-only; load a VLM (e.g. tiny-qwen3-vl)")


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", remove_reasoning_blocks(text))


def readable_diff(stream: str, full: str, context: int = 60) -> str:
    """First point where the two texts differ, with context, as a short unified diff."""
    i = next((k for k, (a, b) in enumerate(zip(stream, full, strict=False)) if a != b), min(len(stream), len(full)))
    a, b = stream[max(0, i - context): i + context], full[max(0, i - context): i + context]
    lines = difflib.unified_diff(a.splitlines(), b.splitlines(), "incremental stream", "full render", lineterm="")
    return f"first difference at char {i}:\n" + "\n".join(lines)
