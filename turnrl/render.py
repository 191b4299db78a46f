"""Chat templates to tokens, append-only: the initial prompt, observation deltas, turn-boundary repair, and a
token-level sanity check against a full re-render.

The conversation is never re-tokenized. After the prompt, the token stream only grows by what the model
sampled and by *observation deltas*: the tokens the chat template would add for new messages (tool
results, env feedback) plus the next generation prompt. How a delta is computed is decided per template by
probing it once, at start-up (`ChatRenderer.profile`, logged and listed in docs/templates.md):

- `dummy` (most templates): against a fixed dummy conversation, not the real history (slime's and verl's
  trick): render `[system, user, assistant(MARK)] + new_messages` and keep what follows the dummy assistant
  turn. The system prompt and tool block are never repeated, and templates that rewrite history (Qwen3
  drops the reasoning of earlier turns) still give the same delta every turn. The dummy has the shape the
  template needs: no system message for templates that refuse one (gemma-2).
- `dummy_tool_calls`: tool results against a dummy whose assistant turn carries the tool calls they answer
  (same ids and names), for templates that render a tool message only inside the assistant turn that
  called it (gemma-4: without the calls every tool result would be dropped).
- `history`: against the real previous conversation, for templates whose rendering of new messages
  depends on earlier ones (DeepSeek-R1 opens the tool outputs block only once per conversation). The
  previous render must be a text prefix of the new one (checked); only the new suffix is tokenised.
- `unsupported`: the template renders nothing for that role (Phi-3.5 has no tool role; gemma-2 refuses
  it): a RenderError names the template and the role, never a silently lost tool result.

Tool schemas: the probe also checks that the template renders the tools it is given. Many do not (SmolLM2's
drops them: the model would never see its tools). Those get the schemas the documented way instead, as the
Hermes / Qwen2.5 system-prompt block (`TOOL_BLOCK`: `<tools>` JSON lines, calls as `<tool_call>` JSON, what
`--tool-parser hermes` reads), said once at start-up (`require_tools`); with another tool-call format the
renderer refuses (RenderError) rather than drop them.

Turn-boundary repair: templates close an assistant turn with more than the stop token the model emits
(Qwen and ChatML add a newline after `<|im_end|>`). The closing text is read off the template itself (what
follows the dummy assistant content, before the next message; an end-of-conversation trailer such as
Phi-3.5's eos is not part of it), and a tool-call turn has its own (gemma-4 ends it with `<|tool_response>`,
which is also a stop token). Whatever part of the closing the model did not emit is appended as a mask-0
`template` segment; a model that stopped on another stop token gets the whole closing, masked.

Pre-fill: a generation prompt may open the model's turn for it (`<think>\\n` for QwQ, Qwen3.5 and
DeepSeek-R1; an empty thought channel for gemma-4). `Rendered.prefill` says so; the turn loop records it at
the start of the assistant message and as its own mask-0 `template` segment, so the messages say what the
model was conditioned on.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import logging
import re
import unicodedata
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from turnrl import frames
from turnrl.reasoning import REASONING_MARKERS
from turnrl.types import Message

log = logging.getLogger(__name__)

DUMMY_SYSTEM = "You are a helpful assistant."
DUMMY_USER = "Hello."
DUMMY_MARK = "TURNRL_DUMMY_ASSISTANT_REPLY"
PROBE_MARK = "TURNRL_PROBE_OBSERVATION"
DUMMY_TOOL: dict[str, Any] = {"type": "function", "function": {"name": "turnrl_probe", "description": "Probe.", "parameters": {
    "type": "object", "properties": {"x": {"type": "string", "description": "x"}}, "required": ["x"]}}}
TOOL_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
"""The system-prompt tool block of the Hermes / Qwen2.5 templates, one JSON schema per line: what turnrl puts
into the prompt for templates that drop the tools they are given (the format `--tool-parser hermes` reads)."""
INJECTED_TOOL_FORMAT = "hermes"
_UNPROVEN: Any = object()  # a frame key not seen yet


class SanityMode(StrEnum):
    STRICT = "strict"
    """Any difference between the incremental stream and a full re-render is reported."""
    IGNORE_STRIPPABLE = "ignore_strippable"
    """Differences only in reasoning blocks the template drops, or only in tokenisation, are accepted."""
    DISABLE = "disable"


class Strategy(StrEnum):
    """How the observation deltas of one role are rendered (module docstring)."""

    DUMMY = "dummy"
    DUMMY_TOOL_CALLS = "dummy_tool_calls"
    HISTORY = "history"
    UNSUPPORTED = "unsupported"


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
    prefill: str = ""
    """Text the generation prompt pre-fills for the model's next turn (e.g. `<think>\\n`); part of `ids`."""
    prefill_ids: list[int] = field(default_factory=list)
    """The tokens of `prefill`: the tail of `ids` (empty when they merge with the tokens before them)."""


@dataclass
class RenderCheck:
    """Result of comparing the incremental stream with a full re-render of the conversation."""

    ok: bool
    strippable: bool = False
    """True when every difference is a named, harmless one (`reasons`)."""
    diff: str = ""
    checked: bool = True
    """False when the conversation cannot be re-rendered faithfully (`diff` says why); `ok` is then True."""
    reasons: list[str] = field(default_factory=list)
    """One per stretch where the ids differ: `retokenised` (the same text in other tokens), `reasoning` (a
    reasoning block the template drops from history), `observation_rewrite` (the template re-renders the end
    of an observation once a reply follows, as probed), or `content` (a real difference)."""


@dataclass
class TemplateProfile:
    """What probing a chat template found, with tools offered or without (`ChatRenderer.profile`)."""

    error: str | None = None
    """Why the template cannot be used this way (then nothing else is set)."""
    system: bool = True
    """The dummy conversation has a system message (False for templates that refuse one)."""
    closing: str = ""
    """Text after an assistant turn's content before the next message (e.g. `<|im_end|>\\n`)."""
    trailer: str = ""
    """Text a render adds only at the very end of a conversation (Phi-3.5's eos)."""
    prefill: str = ""
    tool_closing: str = ""
    """The closing of an assistant turn that calls tools, when it differs (gemma-4: `<|tool_response>`)."""
    user: Strategy = Strategy.DUMMY
    tool: Strategy = Strategy.DUMMY
    rewrites: list[tuple[str, str, str]] = field(default_factory=list)
    """(text before, stream text, render text): how the template re-renders the end of an observation once a
    reply follows it (Hermes tool_use: `</tool_response><|im_end|>` becomes `</tool_response>\n<|im_end|>`).
    The stream keeps what the model was shown; the sanity check names the difference."""


# ---------------------------------------------------------------------------------------------------
# The renderer
# ---------------------------------------------------------------------------------------------------
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
        self._backend = _backend_of(tokenizer)
        """The tokenizer's Rust `tokenizers.Tokenizer` when calling it directly is what the tokenizer's own call does
        (a fast tokenizer whose call is transformers' own), else None (`encode` goes through the call)."""
        self._decodes_directly = self._backend is not None and _decodes_as_backend(tokenizer)
        self._pieces: dict[str, list[int]] = {}
        self._frames: dict[tuple, frames.Frame | None] = {}
        self._plain = frames.plain_test(frames.logic_literals(tokenizer.chat_template))
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.template_name = _template_name(tokenizer)
        self.reasoning_markers = _markers_of(tokenizer.chat_template)
        self.renders_tools, self._system_ok = self._probe_tool_schemas()
        """Whether the template shows the model the tool schemas it is given; if not, TOOL_BLOCK does."""
        self.renders_tool_calls = self._probe_tool_calls()
        """Whether the template shows an assistant message's structured `tool_calls`; if not (SmolLM2's drops
        them: a client's history would show an empty turn before each tool result), they are written into its
        content as hermes `<tool_call>` JSON, the format TOOL_BLOCK asks for."""
        self.tool_parser = INJECTED_TOOL_FORMAT
        """The tool-call format the model is asked for (`require_tools`); injected blocks need hermes."""
        self._told_tools = True  # the probes below render DUMMY_TOOL: nothing to tell the user about yet
        self.profiles: dict[bool, TemplateProfile] = {False: self._probe(None), True: self._probe([DUMMY_TOOL])}
        """The template's behaviour without tools (False) and with tools offered (True)."""
        usable = [p for p in self.profiles.values() if p.error is None]
        if not usable:
            raise RenderError(f"{self.template_name} cannot be rendered append-only: {self.profiles[False].error}")
        self._told_tools = False
        self.profile = usable[0]
        """The profile of conversations without tools (with tools, for templates that need them)."""
        self.closing_ids: list[int] = self.encode(self.profile.closing)
        """Tokens that close an assistant turn in the template (e.g. `<|im_end|>`, `\\n`)."""
        self._closings = self._closing_variants()
        self.end_of_turn_ids: frozenset[int] = self._end_of_turn_ids()
        """Token ids that end a model turn: the tokenizer's eos and each closing's end-of-turn token."""
        log.info("%s", self.describe())

    # ---- text level -----------------------------------------------------------------------------
    def render_text(
        self, messages: list[Message], tools: list[dict] | None = None, *, add_generation_prompt: bool,
        continue_final_message: bool = False,
    ) -> str:
        if tools and not self.renders_tools:  # the template would drop them: the documented block instead
            messages, tools = self._with_tool_block(messages, tools), None
        if not self.renders_tool_calls and any(m.get("tool_calls") for m in messages):
            messages = self._with_calls_as_text(messages)
        extra = {"continue_final_message": True} if continue_final_message else {}  # passed only when asked
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt,
            **extra, **self.chat_template_kwargs,
        )

    def _with_tool_block(self, messages: list[Message], tools: list[dict]) -> list[Message]:
        if self.tool_parser != INJECTED_TOOL_FORMAT:
            raise RenderError(self._tools_refused())
        if not self._told_tools:
            self._told_tools = True
            log.warning("%s", self._tools_injected())
        return with_tool_block(messages, tools, system=self._system_ok)

    def _with_calls_as_text(self, messages: list[Message]) -> list[Message]:
        if self.tool_parser != INJECTED_TOOL_FORMAT:
            raise RenderError(f"{self.template_name} does not render an assistant message's tool_calls, and turnrl "
                              f"can write them into its text only in the hermes format, which --tool-parser "
                              f"{self.tool_parser} does not read: use --tool-parser hermes or a template that "
                              "renders tool calls")
        return [calls_as_text(m) if m.get("role") == "assistant" and m.get("tool_calls") else m for m in messages]

    def require_tools(self, tool_parser: str) -> None:
        """At start-up, for an agent that offers tools parsed as `tool_parser`: says (a warning, once) that the
        schemas go into the system prompt when the template drops them, or raises a RenderError when they
        cannot (an injected block is in the hermes format; another parser would not read the calls it asks for)."""
        self.tool_parser = tool_parser
        if self.renders_tools:
            return
        if tool_parser != INJECTED_TOOL_FORMAT:
            raise RenderError(self._tools_refused())
        if not self._told_tools:
            self._told_tools = True
            log.warning("%s", self._tools_injected())

    def _tools_injected(self) -> str:
        return (f"{self.template_name} does not render the tool schemas it is given, so the model would never see "
                "its tools; turnrl puts them into the system prompt instead, as the hermes tool block (<tools> with "
                "one JSON schema per line, calls asked as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>, "
                "what --tool-parser hermes reads; docs/templates.md)")

    def _tools_refused(self) -> str:
        return (f"{self.template_name} does not render the tool schemas it is given, and turnrl can put them into "
                f"the system prompt only in the hermes format, which --tool-parser {self.tool_parser} does not read: "
                "use --tool-parser hermes (rollout.tool_parser), or a model whose chat template renders tools")

    def _probe_tool_schemas(self) -> tuple[bool, bool]:
        """(does the template render the tools it is given, does it accept a system message), from raw renders."""
        def raw(messages: list[Message], tools: list[dict] | None) -> str:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=True, **self.chat_template_kwargs)

        user: list[Message] = [{"role": "user", "content": DUMMY_USER}]
        system_ok = False  # gemma-2 refuses a system message: an injected block goes into the first user turn
        for tools in (None, [DUMMY_TOOL]):  # (Hermes' tool_use templates render only with tools)
            with contextlib.suppress(Exception):
                raw([{"role": "system", "content": DUMMY_SYSTEM}, *user], tools)
                system_ok = True
        try:
            renders = DUMMY_TOOL["function"]["name"] in raw(user, [DUMMY_TOOL])
        except Exception:  # the template raises when given tools: it cannot render them
            renders = False
        return renders, system_ok

    def _probe_tool_calls(self) -> bool:
        """Does the template render an assistant message's structured tool calls (from raw renders)."""
        call = {"id": "turnrl_call_0", "type": "function", "function": {"name": DUMMY_TOOL["function"]["name"],
                                                                          "arguments": {"x": "1"}}}
        messages: list[Message] = [{"role": "user", "content": DUMMY_USER},
                                   {"role": "assistant", "content": "", "tool_calls": [call]},
                                   {"role": "tool", "tool_call_id": "turnrl_call_0", "content": PROBE_MARK}]
        for tools in ([DUMMY_TOOL], None):
            try:
                text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                          add_generation_prompt=False, **self.chat_template_kwargs)
            except Exception:  # a template that refuses this shape: try the next
                continue
            return DUMMY_TOOL["function"]["name"] in text
        return True  # the template refuses tool calls outright: its own error says so, nothing to rewrite

    def encode(self, text: str) -> list[int]:
        backend = self._usable_backend()
        if backend is not None:
            return backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, character offsets) of `text`, as the tokenizer's call with return_offsets_mapping gives them."""
        backend = self._usable_backend()
        if backend is not None:
            enc = backend.encode(text, add_special_tokens=False)
            return enc.ids, enc.offsets
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], enc["offset_mapping"]

    def _usable_backend(self) -> Any:
        """The Rust tokenizer when a direct call equals the tokenizer's call now: no truncation or padding left
        set on it by another caller (the tokenizer's call turns them off), special tokens not split."""
        b = self._backend
        if b is None or b.truncation is not None or b.padding is not None:
            return None
        if b.encode_special_tokens != bool(getattr(self.tokenizer, "split_special_tokens", False)):
            return None
        return b

    def _piece_ids(self, piece: str) -> list[int]:
        """`encode(piece)` of a template piece (a pre-fill), encoded once: the same text always gives the same
        tokens, and every turn asks for the same few pieces."""
        ids = self._pieces.get(piece)
        if ids is None:
            ids = self._pieces[piece] = self.encode(piece)
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        if self._decodes_directly and type(ids) is list:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def describe(self) -> str:
        """One line per probed variant: the strategies, closings, pre-fill and stop tokens (docs/templates.md)."""
        lines = [f"{self.template_name}: stop tokens {[self.decode([t]) for t in sorted(self.end_of_turn_ids)]}, "
                 + ("tool schemas rendered by the template" if self.renders_tools
                    else "tool schemas not rendered by the template (injected as the hermes block)")]
        for tools, p in self.profiles.items():
            where = "with tools" if tools else "without tools"
            if p.error is not None:
                lines.append(f"  {where}: unusable ({p.error})")
                continue
            lines.append(f"  {where}: user observations {p.user}, tool observations {p.tool}, closing {p.closing!r}"
                         + (f", tool-call closing {p.tool_closing!r}" if p.tool_closing != p.closing else "")
                         + (f", trailer {p.trailer!r}" if p.trailer else "") + (f", pre-fill {p.prefill!r}" if p.prefill else "")
                         + ("" if p.system else ", no system message in the dummy")
                         + "".join(f", re-renders {a + b!r} as {a + c!r} once a reply follows" for a, b, c in p.rewrites))
        return "\n".join(lines)

    def require(self, role: str, tools: bool = True) -> None:
        """Raise now, naming the template, if observations of `role` ("user" or "tool") cannot be rendered,
        e.g. a tool agent on Phi-3.5, whose template has no tool role (a composition root calls this once)."""
        p = self._profile([DUMMY_TOOL] if tools else None)
        if (p.tool if role == "tool" else p.user) == Strategy.UNSUPPORTED:
            raise RenderError(f"{self.template_name} renders no {role!r} messages as a turn of the conversation, "
                              f"so an agent whose observations are {role} messages cannot run on it")

    def _profile(self, tools: list[dict] | None) -> TemplateProfile:
        profile = self.profiles[bool(tools)]
        if profile.error is not None:
            raise RenderError(f"{self.template_name} cannot render conversations {'with' if tools else 'without'} "
                              f"tools: {profile.error}")
        return profile

    def _dummy(self, system: bool = True, calls: list[dict] | None = None) -> list[Message]:
        assistant: Message = {"role": "assistant", "content": DUMMY_MARK}
        if calls:
            assistant = {"role": "assistant", "content": "", "tool_calls": calls}
        head = [{"role": "system", "content": DUMMY_SYSTEM}] if system else []
        return [*head, {"role": "user", "content": DUMMY_USER}, assistant]

    # ---- probing (once, at start-up) ------------------------------------------------------------
    def _probe(self, tools: list[dict] | None) -> TemplateProfile:
        try:
            system = self._accepts_system(tools)
            closing, trailer = self._probe_closing(system, tools)
            p = TemplateProfile(system=system, closing=closing, trailer=trailer)
            p.prefill = self._probe_prefill(system, tools)
            p.user = self._probe_strategy(p, [{"role": "user", "content": PROBE_MARK}], tools)
            p.tool = self._probe_tool_strategy(p, tools)
            p.rewrites = self._probe_rewrites(p, tools)
            return p
        except RenderError as e:
            return TemplateProfile(error=str(e))
        except Exception as e:  # the template raised: it cannot render this shape of conversation
            return TemplateProfile(error=f"the template raised {type(e).__name__}: {e}")

    def _accepts_system(self, tools: list[dict] | None) -> bool:
        try:
            self.render_text(self._dummy(True), tools, add_generation_prompt=False)
            return True
        except Exception:
            self.render_text(self._dummy(False), tools, add_generation_prompt=False)  # raises if neither works
            return False

    def _probe_closing(self, system: bool, tools: list[dict] | None) -> tuple[str, str]:
        """The closing is what follows the assistant content both at the end of a conversation and before
        the next message (cut at a token boundary); what only the end has is the trailer."""
        end = self.render_text(self._dummy(system), tools, add_generation_prompt=False)
        at = end.find(DUMMY_MARK)
        if at < 0:
            raise RenderError("the chat template drops assistant content; cannot derive the turn closing")
        follow = self.render_text(self._dummy(system) + [{"role": "user", "content": PROBE_MARK}], tools,
                                  add_generation_prompt=True)
        tail, nxt = end[at + len(DUMMY_MARK):], follow[follow.find(DUMMY_MARK) + len(DUMMY_MARK):]
        cut = self._token_boundary_at_most(tail, _common_prefix_len(tail, nxt))
        return tail[:cut], tail[cut:]

    def _token_boundary_at_most(self, text: str, limit: int) -> int:
        if limit >= len(text):
            return len(text)
        starts = [a for a, _ in self._encode_offsets(text)[1]]
        return max([a for a in starts if a <= limit] or [0])

    def _probe_prefill(self, system: bool, tools: list[dict] | None) -> str:
        """What the generation prompt adds after the assistant header an earlier turn is rendered with."""
        user = self._dummy(system)[:-1]
        prompt = self.render_text(user, tools, add_generation_prompt=True)
        history = self.render_text(self._dummy(system) + [{"role": "user", "content": PROBE_MARK}], tools,
                                   add_generation_prompt=False)
        header_end = history.find(DUMMY_MARK)
        if prompt.startswith(history[:header_end]):
            return prompt[header_end:]
        return ""

    def _probe_strategy(self, p: TemplateProfile, observation: list[Message], tools: list[dict] | None) -> Strategy:
        """DUMMY unless a second round against the real history renders differently (cross-turn state)."""
        first = self._delta_after_mark(p, observation, tools)
        if PROBE_MARK not in first:
            return Strategy.UNSUPPORTED
        history = self._dummy(p.system) + observation + [{"role": "assistant", "content": DUMMY_MARK + "2"}]
        try:
            second = self._delta_after_history(p, history, observation, tools)
        except Exception:  # the template rewrites history (Qwen3 drops old reasoning): only the dummy works
            return Strategy.DUMMY
        return Strategy.DUMMY if second == first else Strategy.HISTORY

    def _probe_tool_strategy(self, p: TemplateProfile, tools: list[dict] | None) -> Strategy:
        observation = [{"role": "tool", "tool_call_id": "turnrl_call_0", "name": "turnrl_probe", "content": PROBE_MARK}]
        p.tool_closing = p.closing
        try:
            strategy = self._probe_strategy(p, observation, tools)
        except Exception:  # e.g. gemma-2: "roles must alternate"
            return Strategy.UNSUPPORTED
        if strategy != Strategy.UNSUPPORTED:
            return strategy
        try:
            delta = self._delta_after_history(p, self._dummy(p.system, _calls_for(observation)), observation, tools)
        except Exception:
            return Strategy.UNSUPPORTED
        if PROBE_MARK not in delta:
            return Strategy.UNSUPPORTED
        p.tool_closing = self._tool_call_closing(p, tools)
        return Strategy.DUMMY_TOOL_CALLS

    def _tool_call_closing(self, p: TemplateProfile, tools: list[dict] | None) -> str:
        """From the last special token of a closed tool-call turn on (gemma-4: `<|tool_response>`)."""
        calls = _calls_for([{"role": "tool", "tool_call_id": "turnrl_call_0", "name": "turnrl_probe"}])
        text = self.render_text(self._dummy(p.system, calls), tools, add_generation_prompt=False)
        text = text[: len(text) - len(p.trailer)] if p.trailer and text.endswith(p.trailer) else text
        ids, offsets = self._encode_offsets(text)
        special = self._special_ids()
        for tid, (a, _) in reversed(list(zip(ids, offsets, strict=True))):
            if tid in special:
                return text[a:]
            if text[a:].strip():
                break
        return ""

    def _probe_rewrites(self, p: TemplateProfile, tools: list[dict] | None) -> list[tuple[str, str, str]]:
        """Does an observation render the same once the model's reply follows it? Where not, what changes."""
        found = []
        for strategy, observation in ((p.user, {"role": "user", "content": PROBE_MARK}),
                                      (p.tool, {"role": "tool", "tool_call_id": "turnrl_call_0",
                                                "name": "turnrl_probe", "content": PROBE_MARK})):
            if strategy == Strategy.UNSUPPORTED:
                continue
            context = self._dummy(p.system, _calls_for([observation]) if strategy == Strategy.DUMMY_TOOL_CALLS else None)
            try:
                shown = self.render_text(context + [observation], tools, add_generation_prompt=True)
                later = self.render_text(context + [observation, {"role": "assistant", "content": DUMMY_MARK + "2"}],
                                         tools, add_generation_prompt=False)
            except Exception:  # a reply after this observation is refused: nothing to compare
                continue
            shown, reply_at = shown[: len(shown) - len(p.prefill)], later.find(DUMMY_MARK + "2")
            later = later[:reply_at]
            if reply_at < 0 or later.startswith(shown):
                continue
            at = _common_prefix_len(shown, later)
            tail = _common_suffix_len(shown[at:], later[at:])
            left = shown[:at].rsplit(PROBE_MARK, 1)[-1]
            found.append((left, shown[at:len(shown) - tail], later[at:len(later) - tail]))
        return found

    def _special_ids(self) -> set[int]:
        return set(getattr(self.tokenizer, "added_tokens_decoder", {}) or {}) | set(self.tokenizer.all_special_ids)

    def _closing_variants(self) -> list[list[int]]:
        texts = [p.closing for p in self.profiles.values() if p.error is None]
        texts += [p.tool_closing for p in self.profiles.values() if p.error is None and p.tool_closing]
        return [self.encode(t) for t in dict.fromkeys(texts) if t]

    def _end_of_turn_ids(self) -> frozenset[int]:
        eos = self.tokenizer.eos_token_id
        ends = {eos} if isinstance(eos, int) else set(eos or [])
        special = self._special_ids()
        ends |= {c[0] for c in self._closings if c[0] in special}  # a plain-text first token is no stop token
        return frozenset(ends)

    # ---- deltas ---------------------------------------------------------------------------------
    def _delta_after_mark(self, p: TemplateProfile, messages: list[Message], tools: list[dict] | None) -> str:
        text, start = self._text_after_mark(p, messages, tools)
        return text[start:]

    def _text_after_mark(self, p: TemplateProfile, messages: list[Message], tools: list[dict] | None) -> tuple[str, int]:
        """(text, start): the dummy conversation + `messages`, and where the delta starts in it."""
        text = self.render_text(self._dummy(p.system) + list(messages), tools, add_generation_prompt=True)
        at = text.find(DUMMY_MARK)
        start = at + len(DUMMY_MARK)
        if at < 0 or not text.startswith(p.closing, start):
            roles = [m.get("role") for m in messages]
            raise RenderError(
                f"{self.template_name} closes an assistant turn differently when it is followed by {roles}: "
                f"expected {p.closing!r} after the assistant content, got {text[start:start + 40]!r}"
            )
        return text, start + len(p.closing)

    def _delta_after_history(self, p: TemplateProfile, history: list[Message], messages: list[Message],
                             tools: list[dict] | None) -> str:
        text, start = self._text_after_history(p, history, messages, tools)
        return text[start:]

    def _text_after_history(self, p: TemplateProfile, history: list[Message], messages: list[Message],
                            tools: list[dict] | None) -> tuple[str, int]:
        """(text, start): `history + messages`, and where the delta starts: after the render of `history`,
        which must be a text prefix of it (less an end-of-conversation trailer)."""
        before = self.render_text(history, tools, add_generation_prompt=False)
        if p.trailer and before.endswith(p.trailer):
            before = before[: len(before) - len(p.trailer)]
        text = self.render_text(list(history) + list(messages), tools, add_generation_prompt=True)
        if not text.startswith(before):
            at = _common_prefix_len(before, text)
            raise RenderError(f"{self.template_name} re-renders the conversation differently once "
                              f"{[m.get('role') for m in messages]} follow: {before[at:at + 40]!r} became "
                              f"{text[at:at + 40]!r}")
        return text, len(before)

    def observation_text(self, messages: list[Message], tools: list[dict] | None = None,
                         history: list[Message] | None = None) -> tuple[str, int]:
        """(text, start): a render that ends with the observation delta of `messages`, from char `start`."""
        if not messages:
            raise RenderError("observation_ids needs at least one message")
        try:
            return self._observation_text(messages, tools, history)
        except RenderError:
            raise
        except Exception as e:  # the template raised (bad roles, bad content): name it, never a bare TypeError
            raise RenderError(f"{self.template_name} cannot render the observation "
                              f"{[m.get('role') for m in messages]}: {type(e).__name__}: {e}") from e

    def _observation_text(self, messages: list[Message], tools: list[dict] | None,
                          history: list[Message] | None) -> tuple[str, int]:
        p = self._profile(tools)
        role = "tool" if any(m.get("role") == "tool" for m in messages) else "user"
        strategy = p.tool if role == "tool" else p.user
        if strategy == Strategy.UNSUPPORTED:
            raise RenderError(f"{self.template_name} renders no {role!r} messages as a turn of the conversation; "
                              f"send them as {'user' if role == 'tool' else 'tool'} messages or use another template")
        if strategy == Strategy.HISTORY:
            if history is None:
                raise RenderError(f"{self.template_name} renders {role} messages depending on the earlier "
                                  "conversation; pass history= (the conversation so far)")
            return self._text_after_history(p, history, messages, tools)
        if strategy == Strategy.DUMMY_TOOL_CALLS:
            return self._text_after_history(p, self._dummy(p.system, _calls_for(messages)), messages, tools)
        return self._text_after_mark(p, messages, tools)

    # ---- token level ----------------------------------------------------------------------------
    def initial_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """The prompt: every message rendered, followed by the generation prompt."""
        return self.encode(self.render_initial(messages, tools))

    def continuation_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """The prompt that continues the last message, an assistant's pre-filled text (Anthropic's prefill): the
        conversation rendered with that turn left open (no end-of-turn token), so the model goes on writing it."""
        self._profile(tools)
        try:
            return self.encode(self.render_text(messages, tools, add_generation_prompt=False,
                                                continue_final_message=True))
        except Exception as e:
            raise RenderError(f"{self.template_name} cannot continue the assistant message: {type(e).__name__}: "
                              f"{e}") from e

    def render_initial(self, messages: list[Message], tools: list[dict] | None = None) -> str:
        self._profile(tools)  # a template that cannot render this variant says so by name
        key = frames.shape_key("initial", messages, tools, self._plain)
        if key is not None:
            frame = self._frame(key, messages, lambda ms: self.render_text(ms, tools, add_generation_prompt=True))
            if frame is not None:
                return frame.fill([m["content"] for m in messages])
        try:
            return self.render_text(messages, tools, add_generation_prompt=True)
        except Exception as e:
            raise RenderError(f"{self.template_name} cannot render the prompt {[m.get('role') for m in messages]}: "
                              f"{type(e).__name__}: {e}") from e

    def observation_ids(self, messages: list[Message], tools: list[dict] | None = None, *,
                        history: list[Message] | None = None) -> list[int]:
        """Tokens for `messages` appended after a closed assistant turn, plus the next generation prompt.
        `history` (the conversation so far) is needed by templates whose strategy is `history`."""
        framed = self._framed_delta(messages, tools)
        if framed is not None:
            return self.encode(framed)
        text, start = self.observation_text(messages, tools, history)
        return self._encode_suffix(text, start)

    def _framed_delta(self, messages: list[Message], tools: list[dict] | None) -> str | None:
        """The observation delta of `messages` from a proven frame (turnrl.frames), or None (render it). Only for
        the `dummy` strategy (the delta does not depend on the history), and only where the delta starts with a
        special token, so its tokens in the dummy render are its tokens alone (checked on the sentinels too)."""
        key = frames.shape_key("observation", messages, tools, self._plain)
        p = self.profiles[bool(tools)]
        if key is None or p.error is not None:
            return None
        strategy = p.tool if any(m.get("role") == "tool" for m in messages) else p.user
        if strategy != Strategy.DUMMY:
            return None
        frame = self._frame(key, messages, lambda ms: self._delta_after_mark(p, ms, tools),
                            lambda ms: self._hard_start(p, ms, tools))
        return None if frame is None else frame.fill([m["content"] for m in messages])

    def _frame(self, key: tuple, messages: list[Message], render: Any, also: Any = None) -> frames.Frame | None:
        """The frame of `key` (proven once by `render` of the sentinel contents, and by `also` when given)."""
        frame = self._frames.get(key, _UNPROVEN)
        if frame is _UNPROVEN:
            if len(self._frames) >= frames.MAX_FRAMES:
                self._frames.clear()
            frame = frames.prove(render, messages)
            if frame is not None and also is not None:
                proven = [{**m, "content": s(k)} for s in frames.SENTINELS for k, m in enumerate(messages)]
                n = len(messages)
                frame = frame if also(proven[:n]) and also(proven[n:]) else None
            self._frames[key] = frame
        return frame

    def _hard_start(self, p: TemplateProfile, messages: list[Message], tools: list[dict] | None) -> bool:
        """Does the delta of `messages` start with a special token, and tokenise alone as inside the dummy render?"""
        text, start = self._text_after_mark(p, messages, tools)
        ids, offsets = self._encode_offsets(text[start:])
        return (bool(ids) and ids[0] in self._special_ids() and offsets[0][0] == 0
                and ids == self._encode_suffix(text, start))

    def _encode_suffix(self, text: str, char_start: int) -> list[int]:
        """Tokens of `text[char_start:]` as they are tokenized inside the whole text (same boundaries). Only
        a window before the suffix is tokenised with it: a delta never costs the length of the history."""
        for window in (256, len(text)):
            begin = max(0, char_start - window)
            ids, offsets = self._encode_offsets(text[begin:])
            starts = [begin + a for a, _ in offsets]
            if char_start in starts[1:] or (begin == 0 and char_start in starts):
                suffix = ids[starts.index(char_start):]
                if suffix != self.encode(text[char_start:]):
                    raise RenderError("observation tokens depend on the text before them; not append-safe")
                return suffix
            if begin == 0:
                break
        if char_start >= len(text):
            raise RenderError("the observation rendered to no tokens")
        raise RenderError(f"observation boundary at char {char_start} falls inside a token")

    def _prefill_of(self, text: str, ids: list[int]) -> tuple[str, list[int]]:
        """The pre-fill the rendered chunk ends with, and its tokens when they are the tail of `ids`."""
        for p in self.profiles.values():
            if p.error is None and p.prefill and text.endswith(p.prefill):
                tail = self._piece_ids(p.prefill)
                return p.prefill, tail if ids[len(ids) - len(tail):] == tail else []
        return "", []

    def prefill_of(self, token_ids: list[int]) -> str:
        """The template pre-fill a token stream ends with (what the model's next turn starts with), or ""."""
        for p in self.profiles.values():
            tail = self._piece_ids(p.prefill) if p.error is None and p.prefill else []
            if tail and token_ids[len(token_ids) - len(tail):] == tail:
                return p.prefill
        return ""

    def turn_closing_ids(self, model_ids: list[int]) -> list[int]:
        """Template tokens to append (mask 0) after a model turn so it is closed as the template closes it:
        the rest of the closing whose start the model emitted (a tool-call turn has its own), else all of
        the ordinary closing."""
        best: tuple[int, list[int]] | None = None
        for closing in self._closings:
            for k in range(min(len(closing), len(model_ids)), 0, -1):
                if model_ids[-k:] == closing[:k]:
                    if best is None or k > best[0]:
                        best = (k, closing[k:])
                    break
        return list(best[1]) if best is not None else list(self.closing_ids)

    def assistant_text(self, model_ids: list[int]) -> str:
        """The reply text: decoded model tokens without a trailing end-of-turn token."""
        ids = list(model_ids)
        while ids and ids[-1] in self.end_of_turn_ids:
            ids.pop()
        return self.decode(ids)

    def initial(self, messages: list[Message], tools: list[dict] | None = None) -> Rendered:
        _refuse_images(messages)
        text = self.render_initial(messages, tools)
        return self._rendered(text, self.encode(text))

    def observation(self, messages: list[Message], tools: list[dict] | None = None, *,
                    history: list[Message] | None = None) -> Rendered:
        """The delta of `messages` (see `observation_ids`) and the pre-fill it ends with."""
        _refuse_images(messages)
        framed = self._framed_delta(messages, tools)
        if framed is not None:
            return self._rendered(framed, self.encode(framed))
        text, start = self.observation_text(messages, tools, history)
        return self._rendered(text, self._encode_suffix(text, start))

    def _rendered(self, text: str, ids: list[int]) -> Rendered:
        prefill, prefill_ids = self._prefill_of(text, ids)
        return Rendered(ids, prefill=prefill, prefill_ids=prefill_ids)

    # ---- sanity check ---------------------------------------------------------------------------
    def check(
        self, stream_ids: list[int], messages: list[Message], tools: list[dict] | None = None,
        mode: SanityMode | str = SanityMode.STRICT,
    ) -> RenderCheck:
        """Compare the incremental stream with a full render of `messages`, token by token (a prefix match:
        the stream ends where the model stopped, the render also closes the last turn). Each stretch where
        the ids differ is named (`RenderCheck.reasons`): the same text in other tokens (a boundary the model
        could not merge across, Unicode normalisation), a reasoning block the template drops from history,
        an observation the template re-renders once a reply follows (probed); anything else is `content`,
        and only `content` makes a difference real. `messages` may carry structured `tool_calls`."""
        mode = SanityMode(mode)
        if mode == SanityMode.DISABLE:
            return RenderCheck(ok=True)
        unrenderable = self._unrenderable(messages, tools)
        if unrenderable:
            return RenderCheck(ok=True, checked=False, diff=unrenderable)
        full = self.render_text(messages, tools, add_generation_prompt=False)
        full_ids = self.encode(full)
        if full_ids[: len(stream_ids)] == stream_ids:
            return RenderCheck(ok=True)
        rewrites = self.profiles[bool(tools)].rewrites
        stretches = _differences(stream_ids, full_ids)
        reasons = [self._explain(self.decode(stream_ids[i1:i2]), self.decode(full_ids[j1:j2]),
                                 self.decode(full_ids[max(0, j1 - 8):j1]), rewrites, at_end=i2 == len(stream_ids))
                   for i1, i2, j1, j2 in stretches]
        strippable = "content" not in reasons
        first = self._first_tokens(stream_ids, full_ids, stretches[0]) + "\n" if stretches else ""
        diff = f"differences: {', '.join(reasons)}\n{first}" + readable_diff(self.decode(stream_ids), full)
        return RenderCheck(ok=strippable and mode == SanityMode.IGNORE_STRIPPABLE, strippable=strippable, diff=diff,
                           reasons=reasons)

    def _first_tokens(self, stream: list[int], full: list[int], stretch: tuple[int, int, int, int]) -> str:
        """The first stretch where the ids differ, as ids and text on both sides (at most 8 tokens each)."""
        i1, i2, j1, j2 = stretch

        def side(ids: list[int]) -> str:
            return f"{ids[:8]}{'...' if len(ids) > 8 else ''} {self.decode(ids[:8])!r}"

        return (f"first differing tokens, at stream position {i1}: stream {side(stream[i1:i2])}, full render "
                f"{side(full[j1:j2])}")

    def _unrenderable(self, messages: list[Message], tools: list[dict] | None) -> str:
        """Why a full render of `messages` cannot show what the stream holds, or ""."""
        if self.profiles[bool(tools)].tool != Strategy.DUMMY_TOOL_CALLS:
            return ""
        for prev, m in zip(messages, messages[1:], strict=False):
            if m.get("role") == "tool" and prev.get("role") == "assistant" and not prev.get("tool_calls"):
                return (f"not checked: {self.template_name} renders tool results only inside structured tool "
                        "calls, and the assistant message holds the model's raw text")
        return ""

    def _explain(self, stream: str, render: str, before: str, rewrites: list[tuple[str, str, str]], *,
                 at_end: bool = False) -> str:
        """Name one stretch where the ids differ (see `RenderCheck.reasons`). A stretch `at_end` of the stream
        is a prefix match: past the stream's end the render closes the turn the model never finished."""
        stream, render = unicodedata.normalize("NFC", stream), unicodedata.normalize("NFC", render)

        def same(a: str, b: str) -> bool:
            return b.startswith(a) if at_end else a == b

        if same(stream, render):
            return "retokenised"
        if any(before.endswith(left) and (stream, render) == (a, b) for left, a, b in rewrites):
            return "observation_rewrite"
        stream_left = _strip_reasoning(stream, self.reasoning_markers)
        render_left = _strip_reasoning(render, self.reasoning_markers)
        had_block = stream_left != stream or render_left != render  # either side: the template may add an empty one
        if had_block and same(re.sub(r"\s+", "", stream_left), re.sub(r"\s+", "", render_left)):
            return "reasoning"  # whitespace beside the block goes with it (templates strip it); alone it counts
        return "content"


# ---------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------
def _backend_of(tokenizer: Any) -> Any:
    """The Rust tokenizer of a transformers fast tokenizer whose call is transformers' own (then a direct
    `encode(text, add_special_tokens=False)` gives the call's ids and offsets), else None."""
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend, cls = getattr(tokenizer, "_tokenizer", None), type(tokenizer)
    if (not isinstance(backend, Tokenizer) or cls.__call__ is not PreTrainedTokenizerBase.__call__
            or cls._encode_plus is not TokenizersBackend._encode_plus):
        return None
    return backend


def _decodes_as_backend(tokenizer: Any) -> bool:
    """Is the tokenizer's decode its Rust tokenizer's decode (transformers' own, no clean-up of spaces)?"""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    return (cls.decode is PreTrainedTokenizerBase.decode and cls._decode is TokenizersBackend._decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False))


def _template_name(tokenizer: Any) -> str:
    template = tokenizer.chat_template
    source = template if isinstance(template, str) else repr(sorted(template.items()))
    where = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return f"the chat template of {where} (sha1 {hashlib.sha1(source.encode()).hexdigest()[:8]})"


def _markers_of(template: Any) -> tuple[tuple[str, str], ...]:
    source = template if isinstance(template, str) else " ".join(map(str, dict(template).values()))
    return tuple(m for m in REASONING_MARKERS if m[0] in source or m[1] in source)


def with_tool_block(messages: list[Message], tools: list[dict], *, system: bool = True) -> list[Message]:
    """`messages` with TOOL_BLOCK for `tools` at the end of the system message (a new one when there is none;
    the first user message when the template refuses system messages)."""
    block = TOOL_BLOCK.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    messages = list(messages)
    at = 0 if messages and messages[0].get("role") == "system" else None
    if at is None and system:
        return [{"role": "system", "content": block}, *messages]
    if at is None:
        at = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
        if at is None:
            return [{"role": "user", "content": block}, *messages]
    content, after = messages[at].get("content"), messages[at]["role"] == "system"  # a user turn: before it
    if isinstance(content, list):  # content parts (a VLM's): the block as one more text part
        part = {"type": "text", "text": "\n\n" + block if after else block + "\n\n"}
        joined: Any = [*content, part] if after else [part, *content]
    else:
        joined = f"{content or ''}\n\n{block}" if after else f"{block}\n\n{content or ''}"
    messages[at] = {**messages[at], "content": joined}
    return messages


def calls_as_text(message: Message) -> Message:
    """An assistant message with its structured `tool_calls` written into its content as hermes `<tool_call>`
    JSON (what the model writes and `--tool-parser hermes` reads); calls already in the text are not repeated."""
    content = message.get("content") or ""
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    if isinstance(content, str) and "<tool_call>" in content:
        return rest
    blocks = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):
                arguments = json.loads(arguments)
        blocks.append("<tool_call>\n" + json.dumps({"name": function.get("name"), "arguments": arguments},
                                                   ensure_ascii=False) + "\n</tool_call>")
    if isinstance(content, list):  # content parts: the calls as one more text part
        return {**rest, "content": [*content, {"type": "text", "text": "\n".join(blocks)}]}
    return {**rest, "content": "\n".join([content, *blocks] if content else blocks)}


def _calls_for(messages: list[Message]) -> list[dict]:
    """Dummy tool calls answered by the tool messages: their ids and names (arguments are not rendered
    in the delta, which starts after the calls)."""
    calls: list[dict] = []
    for k, m in enumerate(m for m in messages if m.get("role") == "tool"):
        calls.append({"id": m.get("tool_call_id") or f"turnrl_call_{k}", "type": "function",
                      "function": {"name": m.get("name") or "tool", "arguments": {}}})
    return calls


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _common_suffix_len(a: str, b: str) -> int:
    return _common_prefix_len(a[::-1], b[::-1])


def _strip_reasoning(text: str, markers: tuple[tuple[str, str], ...]) -> str:
    """`text` without reasoning blocks (a block left open by a pre-fill runs to the end)."""
    for open_, close in markers:
        text = re.sub(re.escape(open_) + ".*?(" + re.escape(close) + "|$)", "", text, flags=re.DOTALL)
    return text


def _differences(stream: list[int], full: list[int], join_gap: int = 2) -> list[tuple[int, int, int, int]]:
    """The stretches where the ids differ, as (stream start, end, render start, end); stretches separated by
    fewer than `join_gap` equal tokens are one. The render's closing after the end of the stream is none.

    A linear scan: equal tokens are skipped in C (list slices compared whole, halving); at each difference the
    nearest point where both sides agree again for `_RESYNC` tokens ends the differing region (the smallest
    total skip first, then the fewest stream tokens skipped), and difflib's matcher aligns the inside of that
    region, as it aligned the whole before (`_differences_difflib`); where no such point is within
    `_RESYNC_SPAN` tokens, difflib aligns the rest. An insertion or deletion that could sit further left (its
    tokens repeat those before it) sits where difflib puts it: left when the equal tokens after it, so
    lengthened, outnumber those before it."""
    n, m = len(stream), len(full)
    raw: list[list[int]] = []
    i = j = 0
    while True:
        k = _equal_run(stream, i, full, j)
        i, j = i + k, j + k
        if i >= n:
            break  # the rest of the render closes the turn the stream ends in
        if j >= m:
            raw.append([i, n, j, m])
            break
        at = _resync(stream, i, full, j)
        if at is None:
            raw += [[i + i1, i + i2, j + j1, j + j2] for i1, i2, j1, j2 in _opcodes(stream[i:], full[j:])]
            break
        raw += [[i + i1, i + i2, j + j1, j + j2]
                for i1, i2, j1, j2 in _opcodes(stream[i:at[0]], full[j:at[1]], open_end=False)]
        i, j = at
    for k, op in enumerate(raw):
        i1, i2, j1, j2 = op
        if (i1 == i2) == (j1 == j2):
            continue  # a replacement: nothing to slide
        before = i1 - (raw[k - 1][1] if k else 0)
        after = (raw[k + 1][0] if k + 1 < len(raw) else n) - i2
        side, lo, hi = (stream, i1, i2) if j1 == j2 else (full, j1, j2)
        t = 0
        while t < before and side[lo - 1 - t] == side[hi - 1 - t]:
            t += 1
        if t and after + t > before:
            op[:] = [i1 - t, i2 - t, j1 - t, j2 - t]
    return _merged(raw, join_gap)


def _merged(raw: list[list[int]], join_gap: int) -> list[tuple[int, int, int, int]]:
    merged: list[list[int]] = []
    for i1, i2, j1, j2 in raw:
        if merged and i1 - merged[-1][1] < join_gap and j1 - merged[-1][3] < join_gap:
            merged[-1][1], merged[-1][3] = i2, j2
        else:
            merged.append([i1, i2, j1, j2])
    return [(i1, i2, j1, j2) for i1, i2, j1, j2 in merged]


_RESYNC, _RESYNC_SPAN = 8, 32
"""`_differences`: equal tokens that end a stretch, and the most tokens (both sides together) a stretch may skip
before difflib aligns the rest."""


def _equal_run(a: list[int], i: int, b: list[int], j: int) -> int:
    """How many tokens a[i:] and b[j:] share from their start."""
    n = min(len(a) - i, len(b) - j)
    if a[i:i + n] == b[j:j + n]:
        return n
    lo, hi = 0, n  # a[i:i+lo] == b[j:j+lo], a[i:i+hi] != b[j:j+hi]
    while hi - lo > 8:
        mid = (lo + hi) // 2
        if a[i + lo:i + mid] == b[j + lo:j + mid]:
            lo = mid
        else:
            hi = mid
    while a[i + lo] == b[j + lo]:
        lo += 1
    return lo


def _resync(a: list[int], i: int, b: list[int], j: int) -> tuple[int, int] | None:
    """The nearest (i2, j2) past a difference at (i, j) where a and b agree again for `_RESYNC` tokens, by the
    total skip (i2 - i) + (j2 - j), then the stream's skip; None within `_RESYNC_SPAN` or near the end of a
    (difflib aligns the rest: `_differences_difflib`)."""
    n, m = len(a), len(b)
    for skip in range(1, _RESYNC_SPAN + 1):
        for di in range(max(0, skip - (m - j - _RESYNC)), min(skip, n - i - _RESYNC) + 1):
            i2, j2 = i + di, j + skip - di
            if a[i2] == b[j2] and a[i2:i2 + _RESYNC] == b[j2:j2 + _RESYNC]:
                return i2, j2
    return None


def _opcodes(stream: list[int], full: list[int], *, open_end: bool = True) -> list[tuple[int, int, int, int]]:
    """difflib's differing opcodes (the longest common blocks first); `open_end`: the stream ends here (what the
    render adds after it is none)."""
    return [(i1, i2, j1, j2) for op, i1, i2, j1, j2
            in difflib.SequenceMatcher(None, stream, full, autojunk=False).get_opcodes()
            if op != "equal" and not (open_end and op == "insert" and i1 == len(stream))]


def _differences_difflib(stream: list[int], full: list[int], join_gap: int = 2) -> list[tuple[int, int, int, int]]:
    """`_differences` by difflib's matcher over the whole of both (what the check ran before the linear scan)."""
    return _merged([list(op) for op in _opcodes(stream, full)], join_gap)


def _refuse_images(messages: list[Message]) -> None:
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(p.get("type") in ("image", "image_url") for p in content):
            raise RenderError("the conversation has images but the policy is text-only; load a VLM (e.g. tiny-qwen3-vl)")


def readable_diff(stream: str, full: str, context: int = 60) -> str:
    """First point where the two texts differ, with context, as a short unified diff."""
    i = next((k for k, (a, b) in enumerate(zip(stream, full, strict=False)) if a != b), min(len(stream), len(full)))
    a, b = stream[max(0, i - context): i + context], full[max(0, i - context): i + context]
    lines = difflib.unified_diff(a.splitlines(), b.splitlines(), "incremental stream", "full render", lineterm="")
    return f"first difference at char {i}:\n" + "\n".join(lines)
