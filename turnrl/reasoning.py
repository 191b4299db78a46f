"""Reasoning ("thinking") in a model's reply, told apart from its answer by each family's markers.

    <think> ... </think>              Qwen3, QwQ, DeepSeek-R1 and most open reasoning models
    <|channel>thought ... <channel|>  Gemma 4's thought channel

How a reply (the text of ONE assistant turn) is read:
- `<open>...<close>` is reasoning; several blocks are joined with newlines.
- A `<close>` with no `<open>` of its own closes reasoning that began where the text (or the previous block)
  ended: templates that pre-fill `<think>` in the generation prompt (QwQ, DeepSeek-R1, Qwen3 thinking
  variants) make the model start inside its reasoning, so everything up to that `<close>` is reasoning. The
  same rule reads nested blocks (`<think>a<think>b</think>c</think>d`: only `d` is content).
- An `<open>` that is never closed makes everything after it reasoning: generation stopped mid-thought, and an
  answer written inside unfinished reasoning is not an answer (a tool call there is not a call).

Everything that is not reasoning is the content: the pieces between blocks, joined, with surrounding
whitespace stripped (templates put blank lines after `</think>`).
"""

from __future__ import annotations

import re

REASONING_MARKERS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),  # Qwen3, QwQ, Qwen3.5, DeepSeek-R1, SmolLM3, MiMo
    ("<|channel>thought", "<channel|>"),  # gemma-4's thought channel
)
"""(open, close) marker pairs, one per model family. The renderer's sanity check accepts a difference that is only
such a block (a template that drops reasoning from history); a template's markers are those its source names."""

_CLOSED_BLOCKS = re.compile(
    "|".join(f"{re.escape(open_tag)}.*?{re.escape(close_tag)}" for open_tag, close_tag in REASONING_MARKERS),
    re.DOTALL,
)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of one reply; reasoning is None when the text has no reasoning marker at all
    ("" when it has only empty blocks, as Qwen3's `<think>\\n\\n</think>` with thinking disabled)."""
    reasoning: list[str] = []
    for open_tag, close_tag in REASONING_MARKERS:
        if open_tag in text or close_tag in text:
            text = _split_one(text, open_tag, close_tag, reasoning)
    if not reasoning:
        return None, text.strip()
    return "\n".join(r.strip() for r in reasoning).strip(), text.strip()


def strip_reasoning(text: str) -> str:
    """The reply without its reasoning (the content of `split_reasoning`)."""
    return split_reasoning(text)[1]


def remove_reasoning_blocks(text: str) -> str:
    """Remove closed reasoning blocks only. For texts that hold a whole conversation (a rendered prompt and its
    turns), where a stray or unclosed marker in one turn must not swallow the turns after it."""
    return _CLOSED_BLOCKS.sub("", text)


def _split_one(text: str, open_tag: str, close_tag: str, reasoning: list[str]) -> str:
    """Move one family's reasoning from `text` into `reasoning`; return what is left."""
    content: list[str] = []
    pos = 0
    start = close = -2  # the next markers at or after `pos`, searched again only once `pos` passed them:
    while pos < len(text):  # searching both every round is quadratic on a reply of many `</think>`
        if start != -1 and start < pos:
            start = text.find(open_tag, pos)
        if close != -1 and close < pos:
            close = text.find(close_tag, pos)
        if start == -1 and close == -1:
            break
        if start == -1 or (close != -1 and close < start):  # closes reasoning that began at `pos`
            reasoning.append(text[pos:close])
            pos = close + len(close_tag)
            continue
        content.append(text[pos:start])
        end = text.find(close_tag, start + len(open_tag))
        if end == -1:  # unclosed: the rest is reasoning
            reasoning.append(text[start + len(open_tag):])
            return "".join(content)
        reasoning.append(text[start + len(open_tag):end])
        pos = end + len(close_tag)
    content.append(text[pos:])
    return "".join(content)
