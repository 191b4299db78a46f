"""The template × scenario matrix: real chat templates driven through the real turn loop (`drive`).

Each cell runs one scripted conversation through `drive` with an *ideal* policy: an engine that emits, turn by
turn, exactly the tokens the family's template renders for the scripted assistant turn after the prompt it was
given (cut at the family's end-of-turn token). The token stream `drive` builds is then compared with the
tokenised `apply_chat_template` of the final conversation, and the sanity check `drive` ran is compared with
that verdict:

- `exact`: the stream is a token prefix of the full render (the render also closes the last turn);
- `explained`: every difference is a reasoning block (or an empty pre-filled one) of the family's markers that
  the template drops from history: the stream keeps what the model saw, the render does not;
- `unexplained`: any other difference (a lost tool result, a wrong boundary token, ...);
- `refused`: the renderer or the template refused the conversation (the reason is kept).

The sanity check is a false alarm when it reports a content difference on an exact/explained cell, and a miss
when it reports nothing (or only strippable differences) on an unexplained one.

Run `python tests/template_matrix.py` for the table; tests/test_templates.py asserts on it.
"""

from __future__ import annotations

import asyncio
import copy
import difflib
import json
import re
import sys
import traceback
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # this checkout's turnrl

from template_zoo import FAMILIES, Family, family_tokenizer  # noqa: E402

from turnrl.render import ChatRenderer  # noqa: E402
from turnrl.rollout import RolloutContext, RolloutLimits, drive  # noqa: E402
from turnrl.types import FinishReason, GenerateOutput, SamplingParams, StepResult  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string", "description": "The expression."}},
    "required": ["expression"]}}}]


# ---- scenarios --------------------------------------------------------------------------------------
@dataclass
class Reply:
    """A scripted assistant turn."""

    content: str = ""
    reasoning: str | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)
    """(call id, expression) of `calc` calls."""


@dataclass
class Scenario:
    name: str
    prompt: list[dict]
    turns: list[tuple[Reply, list[dict] | None]]
    """Each assistant turn and the observation that follows it (None after the last)."""
    tools: list[dict] | None = None
    images: bool = False


def _tool(call_id: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "name": "calc", "content": content}


def _image_part(colour: str):
    from PIL import Image

    return {"type": "image", "image": Image.new("RGB", (56, 56), colour)}


def scenarios() -> list[Scenario]:
    ask = [{"role": "user", "content": "What is 2+2?"}]
    ask_tools = [{"role": "system", "content": "Be brief."}, *ask]
    return [
        Scenario("plain", ask, [
            (Reply("It is 5."), [{"role": "user", "content": "Wrong, try again."}]),
            (Reply("It is 4."), None)]),
        Scenario("tools", ask_tools, [
            (Reply("", calls=[("call_1", "2+2"), ("call_2", "3*3")]), [_tool("call_1", "4"), _tool("call_2", "9")]),
            (Reply("4 and 9."), None)], tools=TOOLS),
        Scenario("tool_error", ask_tools, [
            (Reply("", calls=[("call_1", "2+")]), [_tool("call_1", "Error: invalid expression '2+'")]),
            (Reply("", calls=[("call_2", "2+2")]), [_tool("call_2", "4")]),
            (Reply("It is 4."), None)], tools=TOOLS),
        Scenario("reasoning", ask, [
            (Reply("It is 5.", reasoning="Add two and two."), [{"role": "user", "content": "Wrong, try again."}]),
            (Reply("It is 4.", reasoning="Count again: 1, 2, 3, 4."), None)]),
        Scenario("unicode", [{"role": "user", "content": "\n\nCompute  2+2 \n\n e\u0301 🙂 你好\n"}], [
            (Reply("\n答案是 5 🙂\n\n"), [{"role": "user", "content": "  \nWrong e\u0301\n\n再试一次 🙂  \n"}]),
            (Reply("好的:\n\n4 e\u0301"), None)]),
    ]


def image_scenario() -> Scenario:
    return Scenario("images", [{"role": "user", "content": [_image_part("red"), {"type": "text", "text": "Colour?"}]}], [
        (Reply("Red."), [{"role": "user", "content": [_image_part("blue"), {"type": "text", "text": "And this?"}]}]),
        (Reply("Blue."), None)], images=True)


def assistant_message(family: Family, reply: Reply) -> dict:
    """The scripted turn in the family's own convention: reasoning written in its markers inside the content
    (every template here either parses it out or passes it through), tool calls structured."""
    content = reply.content
    if reply.reasoning is not None:
        open_, close = family.reasoning
        content = f"{open_}{reply.reasoning}{close}{content}"
    if reply.calls and family.raw_calls:  # written as text, the way the template renders a first call turn
        body = "\n".join(family.raw_calls[1].format(name="calc", args=json.dumps({"expression": e}))
                         for _, e in reply.calls)
        content += family.raw_calls[0].format(body)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reply.calls and not family.raw_calls:
        message["tool_calls"] = [{"id": cid, "type": "function",
                                  "function": {"name": "calc", "arguments": {"expression": expr}}}
                                 for cid, expr in reply.calls]
    return message


# ---- the ideal policy ---------------------------------------------------------------------------------
def _lcp(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class IdealEngine:
    """Emits the template's own rendering of each scripted turn (see the module docstring).

    Each turn's message is tried as scripted, then without its reasoning, then with an empty reasoning block
    (a model whose prompt closed or opened the reasoning writes accordingly); the first whose rendering
    continues the template's generation prompt is what the model writes. When none does (the generation
    prompt pre-fills something the template does not render in history, e.g. `<think>\\n` or an empty thought
    channel), the model writes the turn as its family does after the pre-fill: its reasoning markers, then
    the template's rendering from where prompt and rendering part. `conversation` holds what was written."""

    def __init__(self, family: Family, renderer: ChatRenderer, scenario: Scenario):
        self.family, self.renderer, self.scenario = family, renderer, scenario
        self.tok = renderer.tokenizer
        self.emitted: list[list[int]] = []
        self.conversation = list(scenario.prompt)

    def render(self, messages: list[dict], agp: bool) -> str:
        return self.renderer.render_text(messages, self.scenario.tools, add_generation_prompt=agp)

    def model_text(self, reply: Reply) -> tuple[str, dict]:
        history = self.conversation
        prompt = self.render(history, True)
        bare = Reply(reply.content, None, reply.calls)
        candidates = [assistant_message(self.family, r) for r in (reply, bare, Reply(reply.content, "", reply.calls))]
        for message in candidates:
            full = self.render(history + [message], False)
            if full.startswith(prompt):
                return self._to_stop(full[len(prompt):]), message
        for message in candidates:
            full = self.render(history + [message], False)
            prefill = prompt[_lcp(prompt, full):]
            if not message.get("tool_calls") and (message["content"] or "").startswith(prefill):
                return message["content"][len(prefill):] + self.family.stops[0], message
        message = candidates[1]
        full = self.render(history + [message], False)
        common = _lcp(prompt, full)
        prefill, opened = prompt[common:], "".join(self.family.reasoning)
        if not opened.startswith(prefill):
            return self._to_stop(full[common:]), message
        # the pre-fill opens the reasoning: the model closes it (empty), then writes the turn
        if not message.get("tool_calls"):
            message = {**message, "content": opened + (message["content"] or "")}
        return opened[len(prefill):] + self._to_stop(full[common:]), message

    def _to_stop(self, text: str) -> str:
        ends = [(text.find(s), s) for s in self.family.stops if s in text]
        if not ends:
            raise AssertionError(f"{self.family.name}: no end-of-turn token {self.family.stops} in {text!r}")
        at, stop = min(ends)
        return text[: at + len(stop)]

    async def generate(self, prompt_ids, params, *, request_id, images=None) -> GenerateOutput:
        reply, _ = self.scenario.turns[len(self.emitted)]
        text, message = self.model_text(reply)
        self.conversation.append(message)
        ids = _suffix_ids(self.tok, self.renderer.decode(prompt_ids), text)
        self.emitted.append(ids)
        return GenerateOutput(ids, [-0.5] * len(ids), FinishReason.STOP)

    async def release(self, request_id: str) -> None:
        return None


def _suffix_ids(tok, prompt_text: str, text: str) -> list[int]:
    """`text`'s tokens as they come after `prompt_text` (in-context tokenisation, as a model trained on full
    renders samples them); standalone when the boundary falls inside a token."""
    enc = tok(prompt_text + text, add_special_tokens=False, return_offsets_mapping=True)
    for i, (a, _) in enumerate(enc["offset_mapping"]):
        if a >= len(prompt_text):
            if a == len(prompt_text):
                return enc["input_ids"][i:]
            break
    return tok(text, add_special_tokens=False)["input_ids"]


class ScriptedEnv:
    def __init__(self, scenario: Scenario, engine: IdealEngine):
        self.scenario, self.engine, self.turn = scenario, engine, 0
        self.tools = scenario.tools

    def step(self, text: str) -> StepResult:
        _, observation = self.scenario.turns[self.turn]
        self.turn += 1
        if observation is None:
            return StepResult(done=True)
        self.engine.conversation += copy.deepcopy(observation)
        return StepResult(copy.deepcopy(observation))


# ---- one cell -----------------------------------------------------------------------------------------
@dataclass
class Cell:
    family: str
    scenario: str
    outcome: str
    """exact | explained | unexplained | refused"""
    detail: str = ""
    check: str = ""
    """The sanity check of `drive`: ok | strippable | flagged | error"""
    masks_ok: bool = True

    @property
    def false_alarm(self) -> bool:
        return self.outcome in ("exact", "explained") and self.check in ("flagged", "error")

    @property
    def miss(self) -> bool:
        return self.outcome == "unexplained" and self.check in ("ok", "strippable")


def make_renderer(family: Family, tok=None) -> ChatRenderer:
    return ChatRenderer(tok if tok is not None else family_tokenizer(family), family.kwargs)


def run_cell(family: Family, scenario: Scenario, renderer: ChatRenderer) -> Cell:
    engine = IdealEngine(family, renderer, scenario)
    ctx = RolloutContext(
        engine=engine, renderer=renderer, sampling=SamplingParams(temperature=0.0),
        limits=RolloutLimits(max_turns=len(scenario.turns), max_new_tokens=4096, env_timeout_s=None),
        trajectory_id="t", group_id="g", sample_index=0, sample={}, sanity_mode="strict",
    )
    try:
        traj = asyncio.run(drive(ctx, ScriptedEnv(scenario, engine), copy.deepcopy(scenario.prompt)))
    except Exception as e:
        return Cell(family.name, scenario.name, "refused", f"drive raised {type(e).__name__}: {e}")
    if traj.error or len(engine.emitted) != len(scenario.turns):
        return Cell(family.name, scenario.name, "refused", f"{traj.termination_reason}: {traj.error}")
    stream = traj.prompt_ids + traj.response_ids
    try:
        full = full_render_ids(renderer, engine.conversation, scenario)
    except Exception as e:
        return Cell(family.name, scenario.name, "refused", f"the template refuses the conversation: {type(e).__name__}: {e}")
    outcome, detail = compare(family, renderer, stream, full)
    info = traj.info.get("render_check")
    check = "ok" if info is None else ("strippable" if info["strippable"] else "flagged")
    model = [t for seg in traj.segments if seg.source == "model" for t, m in zip(seg.token_ids, seg.loss_mask, strict=True) if m]
    masks_ok = model == [t for ids in engine.emitted for t in ids] and all(
        not any(seg.loss_mask) for seg in traj.segments if seg.source != "model")
    return Cell(family.name, scenario.name, outcome, detail, check, masks_ok)


def full_render_ids(renderer: ChatRenderer, conversation: list[dict], scenario: Scenario) -> list[int]:
    text = renderer.render_text(conversation, scenario.tools, add_generation_prompt=False)
    if scenario.images:
        images = [p["image"] for m in conversation if isinstance(m["content"], list)
                  for p in m["content"] if p.get("type") == "image"]
        return renderer.processor(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
    return renderer.encode(text)


def compare(family: Family, renderer: ChatRenderer, stream: list[int], full: list[int]) -> tuple[str, str]:
    if full[: len(stream)] == stream:
        return "exact", ""
    matcher = difflib.SequenceMatcher(None, stream, full, autojunk=False)
    unexplained, explained = [], []
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal" or (op == "insert" and i1 == len(stream)):
            continue  # the render's own closing of the last turn
        a, b = renderer.decode(stream[i1:i2]), renderer.decode(full[j1:j2])
        if op == "replace" and unicodedata.normalize("NFC", a) == unicodedata.normalize("NFC", b):
            explained.append(f"retokenised {a!r}")  # the same text split into other tokens at a turn boundary
            continue
        (explained if _is_reasoning_only(family, a, b) else unexplained).append(f"{op}: stream {a!r} / render {b!r}")
    if unexplained:
        return "unexplained", "; ".join(unexplained[:3])
    return "explained", "; ".join(explained[:3])


def _is_reasoning_only(family: Family, stream: str, render: str) -> bool:
    """True when the stream's text is the render's plus reasoning blocks in the family's markers (possibly
    empty or left open by a pre-fill) and whitespace."""
    open_, close = (m.strip() for m in family.reasoning)
    block = re.compile(re.escape(open_) + r".*?" + re.escape(close) + "|" + re.escape(open_), re.DOTALL)
    return re.sub(r"\s+", "", block.sub("", stream)) == re.sub(r"\s+", "", render) and stream != render


# ---- the matrix -----------------------------------------------------------------------------------------
def vision_families() -> list[tuple[Family, Any]]:
    """The VLM rows: tiny-qwen3-vl's processor with turnrl's Qwen-VL template and with Qwen3.5's real one."""
    from template_zoo import template

    from turnrl.models import resolve_model
    from turnrl.multimodal import VisionRenderer, build_processor

    rows = []
    for name, tmpl in (("Qwen-VL (images)", None), ("Qwen3.5 (images)", template("Qwen3.5-4B"))):
        processor = build_processor(resolve_model("tiny-qwen3-vl"))
        if tmpl is not None:
            processor.chat_template = tmpl
        rows.append((Family(name, None, "qwen3", ("<|im_end|>",)), VisionRenderer(processor)))
    return rows


def matrix(families: list[Family] | None = None, with_vision: bool = True) -> list[Cell]:
    cells = []
    for family in families or FAMILIES:
        try:
            renderer = make_renderer(family)
        except Exception as e:
            cells += [Cell(family.name, s.name, "refused", f"renderer: {type(e).__name__}: {e}") for s in scenarios()]
            continue
        for scenario in scenarios():
            try:
                cells.append(run_cell(family, scenario, renderer))
            except Exception as e:
                cells.append(Cell(family.name, scenario.name, "refused", f"harness: {traceback.format_exc(limit=-2)}"))
                print(e)
    if with_vision:
        for family, renderer in vision_families():
            cells.append(run_cell(family, image_scenario(), renderer))
    return cells


def summary(cells: list[Cell]) -> str:
    from collections import Counter

    outcomes = Counter(c.outcome for c in cells)
    lines = [f"{len(cells)} cells: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
             + f"; sanity-check false alarms {sum(c.false_alarm for c in cells)}, misses {sum(c.miss for c in cells)}"
             + f"; mask errors {sum(not c.masks_ok for c in cells)}"]
    for c in cells:
        if c.outcome != "exact" or c.false_alarm or c.miss or not c.masks_ok:
            lines.append(f"  {c.family:26} {c.scenario:10} {c.outcome:11} check={c.check:10} "
                         f"{'MASKS ' if not c.masks_ok else ''}{c.detail[:220]}")
    return "\n".join(lines)


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    print(summary(matrix()))
