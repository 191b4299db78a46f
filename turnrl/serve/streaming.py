"""A reply as it is generated: text decoded incrementally from the sampled token ids, stop strings, SSE lines.

Stop strings (OpenAI's `stop`, Anthropic's `stop_sequences`; `StopWatch`) are matched in the decoded completion,
across tokens and inside one. An engine that streams tokens ends the call as soon as one appears; another's
output is cut afterwards. The reply is the text before the stop string (finish_reason stop); the recorded
completion runs through the token that completed it, so the tokens are exactly those sampled and a
continuation's prompt holds them (the model sees the stop string it wrote).

Streaming (`ChatProxy.complete(..., on_delta=)`, `ReplyStream`): the reply's text is sent as it is generated (an
engine with `generate(on_token=)`, as EmbeddedEngine, streams while it decodes; others stream the whole output
once it is back). The recorded reply is exactly what the streamed chunks add up to, so the client's echo of it
continues the recorded tokens. Each API turns these deltas into its own events (`sse` lines): openai.py,
responses.py, anthropic.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turnrl.reasoning import REASONING_MARKERS
from turnrl.render import ChatRenderer
from turnrl.tools.parsers import CALL_OPEN
from turnrl.types import FinishReason, GenerateOutput, Message

log = logging.getLogger(__name__)


def sse(event: str | None, data: dict[str, Any]) -> str:
    """One server-sent event: `event: <name>` (when the API names its events) and its JSON data."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


class IncrementalDecoder:
    """Text of a growing token sequence, released only when it is final: a token that ends inside a multi-byte
    character decodes to U+FFFD, so its text waits for the tokens that complete it (the window re-decoded is
    a few tokens, as in vLLM and TGI)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.prefix, self.read = decode, 0, 0
        self.ids: list[int] = []

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix: self.read])
        text = self.decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


def find_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """(position, stop string) of the earliest stop string in `text[start:]`, if any."""
    found = [(at, stop) for stop in stops if (at := text.find(stop, start)) >= 0]
    return min(found) if found else None


def partial_tail(text: str, markers: list[str]) -> int:
    """The length of the longest tail of `text` that is a proper beginning of one of `markers` (text that may
    still become a marker, so it is held back)."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


@dataclass
class StopMatch:
    """Where a stop string ended a completion."""

    stop: str
    tokens: int
    """Completion tokens kept: through the one whose text completed the stop string."""
    text: str
    """The reply text: the completion's decoded text before the stop string."""


class StopWatch:
    """Watches a completion's decoded text for the request's stop strings (OpenAI `stop`, Anthropic
    `stop_sequences`), token by token, as vLLM does: a stop string may span tokens or end inside one (".\n" holds
    "\n"). `push` says when one has appeared (the engine then ends the call); `cut` trims the engine's output to
    the token that completed it, so the recorded tokens are exactly what the model produced up to there."""

    def __init__(self, renderer: ChatRenderer, stops: list[str]):
        self.stops, self.end_of_turn_ids = stops, renderer.end_of_turn_ids
        self.decoder = IncrementalDecoder(renderer.decode)
        self.text, self.pushed = "", 0
        self.match: StopMatch | None = None

    def push(self, token: int) -> bool:
        """Take the next completion token; True once a stop string has appeared."""
        if self.match is not None or not self.stops:
            return self.match is not None
        self.pushed += 1
        if token in self.end_of_turn_ids:
            return False
        start = max(0, len(self.text) - max(map(len, self.stops)) + 1)
        self.text += self.decoder.push(token)
        found = find_stop(self.text, self.stops, start)
        if found is not None:
            self.match = StopMatch(found[1], self.pushed, self.text[: found[0]])
        return self.match is not None

    def cut(self, out: GenerateOutput) -> tuple[GenerateOutput, StopMatch | None]:
        """`out` through the token that completed a stop string (finish_reason stop), and the match; `out` as it
        is when no stop string appeared. Tokens not yet pushed (an engine without token streaming) are pushed."""
        for token in out.token_ids[self.pushed:]:
            if self.push(token):
                break
        if self.match is None:
            return out, None
        return dataclasses.replace(out.head(self.match.tokens), finish_reason=FinishReason.STOP), self.match


class TextStream:
    """A legacy text completion streamed as `on_text(text)` calls: decoded incrementally, holding back text that
    may begin a stop string, ending where one begins."""

    def __init__(self, renderer: ChatRenderer, stops: list[str], on_text: Callable[[str], None]):
        self.decoder, self.end_of_turn_ids = IncrementalDecoder(renderer.decode), renderer.end_of_turn_ids
        self.stops, self.on_text = stops, on_text
        self.text, self.sent, self.stopped = "", 0, False

    def push(self, token: int) -> None:
        if self.stopped or token in self.end_of_turn_ids:
            return
        start = max(0, len(self.text) - max(map(len, self.stops), default=0) + 1)  # only where a new one can end
        self.text += self.decoder.push(token)
        found = find_stop(self.text, self.stops, start)
        if found is not None:
            self.text, self.stopped = self.text[: found[0]], True
        self._send(len(self.text) - (0 if self.stopped else partial_tail(self.text, self.stops)))

    def _send(self, upto: int) -> None:
        if upto > self.sent:
            self.on_text(self.text[self.sent: upto])
            self.sent = upto

    def finish(self, text: str) -> None:
        """Send what `text` (the whole completion's) adds to what was sent."""
        if text.startswith(self.text[: self.sent]):
            self.text = text
            self._send(len(text))


class ReplyStream:
    """One reply streamed as it is generated, as `on_delta(kind, text)` calls (kind "reasoning" or "content").

    The text is decoded incrementally from the sampled token ids (IncrementalDecoder) and routed by the
    reasoning markers (turnrl.reasoning); text that may be the start of a marker is held until it is not; at a
    tool call (`<tool_call>`, when the request has tools) streaming stops, since calls are parsed from the whole
    text as without streaming. Text that may be the start of one of the request's `stops` is held too, and the
    text ends where a stop string begins. Leading and trailing whitespace is held as the reply strips it.
    `finish` sends what the reply adds to the streamed text and returns the reply as the client assembled it:
    that is what is recorded, so the client's echo of it continues the recorded tokens."""

    def __init__(self, renderer: ChatRenderer, tools: list[dict] | None, tool_choice: Any,
                 on_delta: Callable[[str, str], None], stops: list[str] | None = None):
        self.renderer, self.on_delta, self.stops = renderer, on_delta, stops or []
        self.tool_mode = bool(tools) and tool_choice != "none"
        self.decoder = IncrementalDecoder(self.renderer.decode)
        self.text, self.pos, self.phase = "", 0, "content"
        self.raw = {"reasoning": "", "content": ""}
        self.sent = {"reasoning": "", "content": ""}
        self.done = self.stopped = False

    def push(self, token: int) -> None:
        if self.done or self.stopped or token in self.renderer.end_of_turn_ids:
            return
        self.text += self.decoder.push(token)
        found = find_stop(self.text, self.stops)
        if found is not None:  # the reply ends before it; later tokens are cut from the recorded call
            self.text, self.stopped = self.text[: found[0]], True
        self._route(final=False)

    def _markers(self) -> dict[str, str]:
        """marker -> the phase it switches to."""
        if self.phase == "reasoning":
            return {close: "content" for _, close in REASONING_MARKERS}
        markers = {open_: "reasoning" for open_, _ in REASONING_MARKERS}
        markers.update({close: "held" for _, close in REASONING_MARKERS})  # it was reasoning: cannot be undone
        if self.tool_mode:
            markers[CALL_OPEN] = "held"
        return markers

    def _route(self, final: bool) -> None:
        while self.phase != "held":
            rest, markers = self.text[self.pos:], self._markers()
            found = min(((rest.find(m), m) for m in markers if m in rest), default=None)
            if found is None:
                hold = 0 if final else min(len(rest), partial_tail(self.text, [*markers, *self.stops]))
                self._emit(rest[: len(rest) - hold])
                self.pos += len(rest) - hold
                return
            at, marker = found
            self._emit(rest[:at])
            self.pos += at + len(marker)
            self.phase = markers[marker]

    def _emit(self, text: str) -> None:
        kind = self.phase
        self.raw[kind] += text
        strip = kind == "reasoning" or self.tool_mode or bool(self.raw["reasoning"])
        target = (self.raw[kind].lstrip() if strip else self.raw[kind]).rstrip()
        self._send(kind, target)

    def _send(self, kind: str, target: str) -> None:
        if target.startswith(self.sent[kind]) and len(target) > len(self.sent[kind]):
            delta = target[len(self.sent[kind]):]
            self.sent[kind] = target
            self.on_delta(kind, delta)

    def finish(self, text: str, reply: Message) -> Message:
        """Send the rest of `reply` (parsed from the completion's whole `text`) and return the reply as streamed."""
        if text.startswith(self.text):
            self.text = text
        self._route(final=True)
        self.done = True
        out = dict(reply)
        for kind, key in (("reasoning", "reasoning_content"), ("content", "content")):
            final = reply.get(key) or ""
            self._send(kind, final)  # only when the final text extends what was sent
            if self.sent[kind] != final:
                log.info("streamed %s differs from the parsed reply; recording what was streamed", kind)
            out[key] = self.sent[kind]
        if not out["reasoning_content"]:
            out.pop("reasoning_content")
        if not out["content"] and reply.get("tool_calls"):
            out["content"] = None
        return out

