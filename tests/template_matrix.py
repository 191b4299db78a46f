"""The template × scenario matrix: real chat templates driven through the real turn loop (`drive`).

Each cell runs one scripted conversation through `drive` with an *ideal* policy: an engine that emits, turn by
turn, exactly the tokens the family's template renders for the scripted assistant turn after the prompt it was
given (cut at the family's end-of-turn token). The token stream `drive` builds is then compared with the
tokenised `apply_chat_template` of the final conversation, and the sanity check `drive` ran is compared with
that verdict:

- `exact`: the stream is a token prefix of the full render (the render also closes the last turn);
- `explained`: every stretch where the ids differ is named: `reasoning` (a block in the family's markers, or an
  empty pre-filled one, that the template drops from history: the stream keeps what the model saw), `retokenised`
  (the same text in other tokens at a boundary the model could not merge across) or a `rewrite` the family's
  template makes to an observation once a reply follows (Hermes tool_use);
- `unexplained`: any other difference (a lost tool result, a wrong boundary token, ...);
- `refused`: a RenderError (the reason is kept); `n/a`: the template itself cannot express the scripted turn;
  `error`: anything else raised.

The harness names differences from its own knowledge of each family (tests/template_zoo.py), not from the
renderer's probe. The sanity check is a false alarm when it reports a content difference on an exact/explained
cell, and a miss when it accepts an unexplained one; it runs twice per cell, on the trajectory's own messages
(what `drive` runs) and on the conversation as written (structured tool calls).

Run `python tests/template_matrix.py` for the table; tests/test_templates.py asserts on it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import difflib
import json
import re
import sys
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # this checkout's turnrl

from template_zoo import FAMILIES, Family, family_tokenizer  # noqa: E402

from turnrl.render import ChatRenderer, RenderError  # noqa: E402
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
        header = prompt[_lcp(self.render(history, False), prompt):]  # the generation prompt
        bare = Reply(reply.content, None, reply.calls)
        candidates = [assistant_message(self.family, r) for r in (reply, bare, Reply(reply.content, "", reply.calls))]
        for message in candidates:
            full = self.render(history + [message], False)
            if full.startswith(prompt):
                return self._to_stop(full[len(prompt):]), message
            at = full.rfind(header) if header else -1  # after a history the template re-rendered (Hermes)
            if at >= 0 and at + len(header) > _lcp(prompt, full):
                return self._to_stop(full[at + len(header):]), message
        for message in candidates:
            full = self.render(history + [message], False)
            prefill = prompt[_lcp(prompt, full):]
            if not message.get("tool_calls") and (message["content"] or "").startswith(prefill):
                return message["content"][len(prefill):] + self.family.stops[0], message
        message = candidates[1]
        full = self.render(history + [message], False)
        common = self._token_start_at_most(full, _lcp(prompt, full))
        prefill, opened = prompt[common:], "".join(self.family.reasoning)
        if not opened.startswith(prefill):
            return self._to_stop(full[common:]), message
        # the pre-fill opens the reasoning: the model closes it (empty), then writes the turn
        if not message.get("tool_calls"):
            message = {**message, "content": opened + (message["content"] or "")}
        return opened[len(prefill):] + self._to_stop(full[common:]), message

    def _token_start_at_most(self, text: str, limit: int) -> int:
        starts = [a for a, _ in self.tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
        return max([a for a in starts if a <= limit] or [0])

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
    """exact | explained | unexplained | refused (a RenderError, reason kept) | n/a (the template itself cannot
    express the scripted turn) | error (anything else raised)"""
    detail: str = ""
    check: str = ""
    """The sanity check on the trajectory's messages (what `drive` runs): ok | strippable | flagged | unchecked"""
    check_structured: str = ""
    """The sanity check on the conversation as written (structured tool calls): ok | strippable | flagged"""
    masks_ok: bool = True
    trajectory: Any = field(default=None, repr=False)
    conversation: list[dict] = field(default_factory=list, repr=False)
    """The conversation as written (the ideal policy's messages, structured tool calls)."""
    tools: list[dict] | None = field(default=None, repr=False)
    renderer: Any = field(default=None, repr=False)

    @property
    def false_alarm(self) -> bool:
        return self.outcome in ("exact", "explained") and "flagged" in (self.check, self.check_structured)

    @property
    def miss(self) -> bool:
        return self.outcome == "unexplained" and not {self.check, self.check_structured} <= {"flagged", "unchecked"}


def make_renderer(family: Family, tok=None) -> ChatRenderer:
    tok = tok if tok is not None else family_tokenizer(family)
    tok.name_or_path = family.name  # errors and the profile name the template
    return ChatRenderer(tok, family.kwargs)


def run_cell(family: Family, scenario: Scenario, renderer: ChatRenderer) -> Cell:
    if not family.system:
        scenario = dataclasses.replace(scenario, prompt=[m for m in scenario.prompt if m["role"] != "system"])
    if family.tools_always and not scenario.tools:
        scenario = dataclasses.replace(scenario, tools=TOOLS)
    engine = IdealEngine(family, renderer, scenario)
    ctx = RolloutContext(
        engine=engine, renderer=renderer, sampling=SamplingParams(temperature=0.0),
        limits=RolloutLimits(max_turns=len(scenario.turns), max_new_tokens=4096, env_timeout_s=None),
        trajectory_id="t", group_id="g", sample_index=0, sample={}, sanity_mode="strict",
    )
    traj = asyncio.run(drive(ctx, ScriptedEnv(scenario, engine), copy.deepcopy(scenario.prompt)))
    if traj.error or len(engine.emitted) != len(scenario.turns):
        outcome = "refused" if "RenderError" in (traj.error or "") else "n/a" \
            if traj.termination_reason == "engine_error" else "error"
        return Cell(family.name, scenario.name, outcome, f"{traj.termination_reason}: {traj.error}")
    stream = traj.prompt_ids + traj.response_ids
    full = full_render_ids(renderer, engine.conversation, scenario)
    outcome, detail = compare(family, renderer, stream, full)
    model = [t for seg in traj.segments if seg.source == "model" for t, m in zip(seg.token_ids, seg.loss_mask, strict=True) if m]
    masks_ok = model == [t for ids in engine.emitted for t in ids] and all(
        not any(seg.loss_mask) for seg in traj.segments if seg.source != "model")
    return Cell(family.name, scenario.name, outcome, detail, _verdict(renderer.check(stream, traj.messages, scenario.tools)),
                _verdict(renderer.check(stream, engine.conversation, scenario.tools)), masks_ok, traj,
                engine.conversation, scenario.tools, renderer)


def _verdict(check) -> str:
    if not getattr(check, "checked", True):  # (the renderer before issue 15 had no such field)
        return "unchecked"
    return "ok" if check.ok else "strippable" if check.strippable else "flagged"


def full_render_ids(renderer: ChatRenderer, conversation: list[dict], scenario: Scenario) -> list[int]:
    text = renderer.render_text(conversation, scenario.tools, add_generation_prompt=False)
    if scenario.images:
        images = [p["image"] for m in conversation if isinstance(m["content"], list)
                  for p in m["content"] if p.get("type") == "image"]
        return renderer.processor(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
    return renderer.encode(text)


def compare(family: Family, renderer: ChatRenderer, stream: list[int], full: list[int]) -> tuple[str, str]:
    """exact, or each stretch where the ids differ named (retokenised, rewrite, reasoning) or unexplained."""
    if full[: len(stream)] == stream:
        return "exact", ""
    ops = [op for op in difflib.SequenceMatcher(None, stream, full, autojunk=False).get_opcodes()
           if op[0] != "equal" and not (op[0] == "insert" and op[1] == len(stream))]  # the render's own closing
    stretches: list[list[int]] = []
    for _, i1, i2, j1, j2 in ops:  # stretches one token apart are one (a marker split by the alignment)
        if stretches and i1 - stretches[-1][1] < 2 and j1 - stretches[-1][3] < 2:
            stretches[-1][1], stretches[-1][3] = i2, j2
        else:
            stretches.append([i1, i2, j1, j2])
    named, unexplained = [], []
    for i1, i2, j1, j2 in stretches:
        a, b = (unicodedata.normalize("NFC", renderer.decode(x)) for x in (stream[i1:i2], full[j1:j2]))
        before = renderer.decode(full[max(0, j1 - 8):j1])
        if a == b:
            named.append(f"retokenised {a!r}")
        elif any(before.endswith(left) and (a, b) == (x, y) for left, x, y in family.rewrites):
            named.append(f"rewrite {a!r} -> {b!r}")
        elif _is_reasoning_only(family, a, b):
            named.append(f"reasoning {a!r} -> {b!r}")
        else:
            unexplained.append(f"stream {a!r} / render {b!r}")
    if unexplained:
        return "unexplained", "; ".join(unexplained[:3])
    return "explained", "; ".join(named[:4])


def _is_reasoning_only(family: Family, stream: str, render: str) -> bool:
    """True when the stream's text is the render's plus reasoning blocks in the family's markers (possibly
    empty or left open by a pre-fill) and the whitespace around them; a whitespace difference alone is not."""
    open_, close = (m.strip() for m in family.reasoning)
    block = re.compile(re.escape(open_) + r".*?(" + re.escape(close) + "|$)", re.DOTALL)
    stripped = block.sub("", stream)
    return stripped != stream and re.sub(r"\s+", "", stripped) == re.sub(r"\s+", "", block.sub("", render))


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
            outcome = "refused" if isinstance(e, RenderError) else "error"
            cells += [Cell(family.name, s.name, outcome, f"renderer: {type(e).__name__}: {e}") for s in scenarios()]
            continue
        for scenario in scenarios():
            try:
                cells.append(run_cell(family, scenario, renderer))
            except Exception as e:
                cells.append(Cell(family.name, scenario.name, "error", f"{type(e).__name__}: {e}"))
    if with_vision:
        for family, renderer in vision_families():
            cells.append(run_cell(family, image_scenario(), renderer))
    return cells


def summary(cells: list[Cell]) -> str:
    from collections import Counter

    outcomes = Counter(c.outcome for c in cells)
    lines = [f"{len(cells)} cells: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
             + f"; sanity-check false alarms {sum(c.false_alarm for c in cells)}, misses {sum(c.miss for c in cells)}"
             + f", unchecked {sum(c.check == 'unchecked' for c in cells)}; mask errors {sum(not c.masks_ok for c in cells)}"]
    for c in cells:
        if c.outcome != "exact" or c.false_alarm or c.miss or not c.masks_ok:
            lines.append(f"  {c.family:26} {c.scenario:10} {c.outcome:11} check={c.check}/{c.check_structured} "
                         f"{'MASKS ' if not c.masks_ok else ''}{c.detail[:200]}")
    return "\n".join(lines)


def docs_table(cells: list[Cell]) -> str:
    """The family table of docs/templates.md, from the renderers' probes and the matrix."""
    by_family: dict[str, list[Cell]] = {}
    for c in cells:
        by_family.setdefault(c.family, []).append(c)
    rows = ["| family | tokenizer | user / tool observations | closing · tool-call closing | pre-fill | stop tokens "
            "| matrix (plain, tools, tool error, reasoning, unicode) |", "|---|---|---|---|---|---|---|"]
    notes = {f.name: f.tokenizer_note for f in FAMILIES}
    for name, row in by_family.items():
        r = next((c.renderer for c in row if c.renderer is not None), None)
        if r is None:
            continue
        p = r.profiles[True] if r.profiles[False].error else r.profiles[False]
        closing = f"`{p.closing!r}`" + (f" · `{p.tool_closing!r}`" if p.tool_closing not in ("", p.closing) else "")
        if p.trailer:
            closing += f" (+ trailer `{p.trailer!r}`)"
        stops = ", ".join(f"`{r.decode([t])}`" for t in sorted(r.end_of_turn_ids))
        outcomes = ", ".join(c.outcome for c in row)
        cells = [name, notes.get(name, "Qwen3's + tiny-qwen3-vl processor"), f"{p.user} / {p.tool}", closing,
                 f"`{p.prefill!r}`" if p.prefill else "", stops, outcomes]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")  # a pipe in a cell ends it
    return "\n".join(rows)


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    cells = matrix()
    print(docs_table(cells) if "--docs" in sys.argv else summary(cells))
