"""Token fidelity on every common chat-template family (issue 15): the template × scenario matrix.

19 real chat templates (llama.cpp's collection inside the llama-cpp-python sdist) with real tokenizers
(tests/template_zoo.py says which stand in where a family's own is not shipped) × 5 scenarios, plus two VLM
rows with images, each driven through `drive` by an ideal policy and compared token by token with the
tokenised `apply_chat_template` of the final conversation (tests/template_matrix.py). Every difference must be
named (a reasoning block the template drops from history, the same text in other tokens at a turn boundary,
an observation the template re-renders once a reply follows), every refusal must be a RenderError naming the
template, the sanity check must neither raise a false alarm nor miss a corrupted stream, and the loss mask
must cover exactly the tokens the policy sampled. docs/templates.md is the table of what each family gets.
"""

from __future__ import annotations

import logging

import pytest
from template_zoo import FAMILIES

from turnrl.render import RenderError

SCENARIOS = ("plain", "tools", "tool_error", "reasoning", "unicode")

# cells whose stream differs from the full render, and only by named differences (all others: exact)
EXPLAINED = {
    "Qwen2.5": {"unicode"},  # retokenised: the reply's leading "\n" after the generation prompt's "\n"
    "Qwen3 (thinking)": set(SCENARIOS),  # reasoning: the template drops earlier <think> blocks
    "Qwen3 (no thinking)": set(SCENARIOS),  # reasoning: the pre-filled empty <think> block, dropped later
    "Qwen3-Coder": {"unicode"},
    "Qwen3.5": set(SCENARIOS),  # reasoning, and retokenised after the pre-filled "<think>\n"
    "QwQ": set(SCENARIOS),
    "Hermes-2-Pro (tool_use)": {"tools", "tool_error", "unicode"},  # rewrite: "\n" after </tool_response>
    "Hermes-3 (tool_use)": {"tools", "tool_error", "unicode"},
    "gemma-4": set(SCENARIOS),  # reasoning: the pre-filled empty thought channel
    "DeepSeek-R1-Distill-Qwen": set(SCENARIOS),  # reasoning: <think> dropped from every turn
    "MiMo-VL (text)": {"unicode"},
    "Qwen3.5 (images)": {"images"},
}
REFUSED = {  # (family, scenario): what the RenderError says
    ("gemma-2", "tools"): "renders no 'tool' messages", ("gemma-2", "tool_error"): "renders no 'tool' messages",
    ("Phi-3.5", "tools"): "renders no 'tool' messages", ("Phi-3.5", "tool_error"): "renders no 'tool' messages",
}
NOT_EXPRESSIBLE = {  # the template itself refuses the scripted turn
    (f"Llama-3.{k}", "tools"): "only supports single tool-calls" for k in (1, 2, 3)
}
NAMED = {"retokenised", "reasoning", "observation_rewrite"}
CELLS = [(f.name, s) for f in FAMILIES for s in SCENARIOS] + [("Qwen-VL (images)", "images"),
                                                                 ("Qwen3.5 (images)", "images")]


@pytest.fixture(scope="module")
def matrix(zoo):
    from template_matrix import matrix as run

    logger = logging.getLogger("turnrl")
    level = logger.level
    logger.setLevel(logging.ERROR)  # a matrix of expected sanity-check warnings
    try:
        return {(c.family, c.scenario): c for c in run()}
    finally:
        logger.setLevel(level)  # later tests assert on turnrl's warnings


def expected(family: str, scenario: str) -> str:
    if (family, scenario) in REFUSED:
        return "refused"
    if (family, scenario) in NOT_EXPRESSIBLE:
        return "n/a"
    return "explained" if scenario in EXPLAINED.get(family, ()) else "exact"


@pytest.mark.parametrize(("family", "scenario"), CELLS, ids=[f"{f}-{s}" for f, s in CELLS])
def test_cell(matrix, family, scenario):
    cell = matrix[(family, scenario)]
    assert cell.outcome == expected(family, scenario), cell.detail
    if cell.outcome == "refused":
        assert REFUSED[(family, scenario)] in cell.detail and f"chat template of {family}" in cell.detail
        return
    if cell.outcome == "n/a":
        assert NOT_EXPRESSIBLE[(family, scenario)] in cell.detail
        return
    assert cell.masks_ok, "the loss mask covers other tokens than those the policy sampled"
    assert not cell.false_alarm and not cell.miss, (cell.check, cell.check_structured, cell.detail)
    check = cell.renderer.check(_stream(cell), cell.conversation, cell.tools)
    if cell.outcome == "exact":
        assert check.ok and not check.reasons
    else:  # STRICT reports every difference; each is named, and ignore_strippable accepts them
        assert not check.ok and check.strippable and set(check.reasons) <= NAMED, check.diff
        assert cell.renderer.check(_stream(cell), cell.conversation, cell.tools, "ignore_strippable").ok


def _stream(cell) -> list[int]:
    return cell.trajectory.prompt_ids + cell.trajectory.response_ids


RENDERED = [c for c in CELLS if expected(*c) in ("exact", "explained")]


@pytest.mark.parametrize(("family", "scenario"), RENDERED, ids=[f"{f}-{s}" for f, s in RENDERED])
def test_the_check_flags_a_corrupted_observation_or_closing(matrix, family, scenario):
    """No misses: one wrong token in the last observation, or a missing turn closing, is a content difference."""
    cell = matrix[(family, scenario)]
    traj, stream = cell.trajectory, _stream(cell)
    injected = [(k, s) for k, s in enumerate(traj.segments) if s.source in ("env", "tool") and len(s.token_ids) > 2]
    if not injected:
        pytest.skip("no observation in this scenario")
    offset = len(traj.prompt_ids) + sum(len(s.token_ids) for s in traj.segments[: injected[-1][0]])
    at = offset + len(injected[-1][1].token_ids) // 2
    wrong = list(stream)
    x, y = cell.renderer.encode("X")[0], cell.renderer.encode("Y")[0]
    wrong[at] = x if stream[at] != x else y
    check = cell.renderer.check(wrong, cell.conversation, cell.tools, "ignore_strippable")
    assert not check.ok and "content" in check.reasons, check.diff
    closings = [k for k, s in enumerate(traj.segments) if s.source == "template" and s.token_ids
                and k + 1 < len(traj.segments) and traj.segments[k + 1].source in ("env", "tool")]
    if closings:  # drop the repair (e.g. Qwen's "\n" after <|im_end|>): a whitespace difference is a real one
        k = closings[0]
        begin = len(traj.prompt_ids) + sum(len(s.token_ids) for s in traj.segments[:k])
        cut = stream[:begin] + stream[begin + len(traj.segments[k].token_ids):]
        check = cell.renderer.check(cut, cell.conversation, cell.tools, "ignore_strippable")
        assert not check.ok and "content" in check.reasons, check.diff



@pytest.mark.parametrize(("family", "scenario"), RENDERED, ids=[f"{f}-{s}" for f, s in RENDERED])
def test_the_linear_scan_finds_difflibs_stretches(matrix, family, scenario):
    """`_differences` (a linear scan, difflib inside each differing region) gives the stretches difflib's matcher
    over the whole gave, on every cell's stream and on the corrupted ones above (one wrong token, a lost closing)."""
    from turnrl.render import _differences, _differences_difflib

    cell = matrix[(family, scenario)]
    stream = _stream(cell)
    for messages in (cell.trajectory.messages, cell.conversation):
        if cell.renderer._unrenderable(messages, cell.tools):
            continue
        full = cell.renderer.encode(cell.renderer.render_text(messages, cell.tools, add_generation_prompt=False))
        variants = [stream, stream[:-3], stream[: len(stream) // 2]]
        for at in (len(stream) // 3, 2 * len(stream) // 3, len(stream) - 1):
            variants.append(stream[:at] + [stream[at] + 1] + stream[at + 1:])
            variants.append(stream[:at] + stream[at + 1:])
        for ids in variants:
            assert _differences(ids, full) == _differences_difflib(ids, full), (family, scenario, ids)


def test_matrix_totals(matrix):
    """The figures docs/templates.md quotes."""
    cells = list(matrix.values())
    assert len(cells) == 97
    assert sum(c.outcome == "exact" for c in cells) == 50 and sum(c.outcome == "explained" for c in cells) == 40
    assert not any(c.false_alarm or c.miss or not c.masks_ok for c in cells)
    assert all(c.outcome != "error" for c in cells)


# ---- the failures issue 15 measured, one by one ------------------------------------------------------------
TOOL_4 = {"role": "tool", "tool_call_id": "call_1", "name": "calc", "content": "4"}
TOOL_9 = {"role": "tool", "tool_call_id": "call_2", "name": "calc", "content": "9"}


@pytest.fixture(scope="module")
def renderer_of(zoo):
    from template_matrix import make_renderer

    families, made = {f.name: f for f in FAMILIES}, {}

    def get(name: str):
        if name not in made:
            made[name] = make_renderer(families[name])
        return made[name]

    return get


def test_gemma4_tool_results_are_rendered_inside_the_calls_they_answer(renderer_of):
    """gemma-4 renders a tool message only after an assistant turn carrying its call: against a dummy
    without calls every result was dropped (the delta was `<turn|>\\n<|turn>model\\n...`)."""
    from template_matrix import TOOLS

    r = renderer_of("gemma-4")
    assert (r.profile.user, r.profile.tool) == ("dummy", "dummy_tool_calls")
    delta = r.decode(r.observation_ids([TOOL_4, TOOL_9], TOOLS))
    assert delta == ('response:calc{value:<|"|>4<|"|>}<tool_response|>'
                     '<|tool_response>response:calc{value:<|"|>9<|"|>}<tool_response|>')
    # the model's natural stop after its calls is a stop token, and it needs no closing
    stop = r.tokenizer.convert_tokens_to_ids("<|tool_response>")
    assert stop in r.end_of_turn_ids and r.tokenizer.convert_tokens_to_ids("<turn|>") in r.end_of_turn_ids
    assert r.turn_closing_ids(r.encode("<|tool_call>call:calc{}<tool_call|><|tool_response>")) == []
    assert r.decode(r.turn_closing_ids(r.encode("Four.<turn|>"))) == "\n"


def test_deepseek_tool_outputs_are_rendered_against_the_real_conversation(renderer_of):
    """DeepSeek-R1 opens `<｜tool▁outputs▁begin｜>` once per conversation: a second round of tool outputs
    continues with `\\n`, which no delta against a fresh dummy reproduces."""
    from template_matrix import TOOLS

    r = renderer_of("DeepSeek-R1-Distill-Qwen")
    assert (r.profile.user, r.profile.tool) == ("dummy", "history")
    call = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calc\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    history = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": call}, TOOL_4,
               {"role": "assistant", "content": call}]
    assert r.decode(r.observation_ids([TOOL_9], TOOLS, history=history)) == \
        "\n<｜tool▁output▁begin｜>9<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    with pytest.raises(RenderError, match="pass history="):  # the proxy then renders the whole conversation
        r.observation_ids([TOOL_9], TOOLS)
    cell_delta = r.decode(r.observation_ids([TOOL_4], TOOLS, history=history[:2]))
    assert cell_delta.startswith("<｜tool▁outputs▁begin｜>")


def test_qwq_pre_fill_is_recorded_in_messages_and_segments(matrix):
    """QwQ's generation prompt opens `<think>\\n`: the assistant messages start with it (so a re-render of the
    trajectory's own messages matches), and after an observation it is its own mask-0 template segment."""
    traj = matrix[("QwQ", "plain")].trajectory
    replies = [m["content"] for m in traj.messages if m["role"] == "assistant"]
    assert all(reply.startswith("<think>\n") for reply in replies) and len(replies) == 2
    sources = [s.source for s in traj.segments]
    assert sources == ["model", "template", "env", "template", "model"]
    prefill = traj.segments[3]
    renderer = matrix[("QwQ", "plain")].renderer
    assert renderer.decode(prefill.token_ids) == "<think>\n" and not any(prefill.loss_mask)


def test_tool_use_only_templates_say_so_by_name(renderer_of):
    """Hermes' tool_use template iterates `tools`: without them it raised a TypeError deriving the closing."""
    from template_matrix import TOOLS

    r = renderer_of("Hermes-3 (tool_use)")
    assert r.profiles[False].error and r.profiles[True].error is None
    with pytest.raises(RenderError, match=r"chat template of Hermes-3 \(tool_use\).*without tools"):
        r.initial([{"role": "user", "content": "Hi"}])
    assert r.initial([{"role": "user", "content": "Hi"}], TOOLS).ids
    assert r.profiles[True].rewrites == [("\n</tool_response>", "", "\n")]


def test_gemma2_gets_a_dummy_without_system_message(renderer_of):
    r = renderer_of("gemma-2")
    assert not r.profile.system and r.profile.tool == "unsupported"
    assert r.decode(r.observation_ids([{"role": "user", "content": "Wrong."}])) == \
        "<start_of_turn>user\nWrong.<end_of_turn>\n<start_of_turn>model\n"


def test_phi35_eos_after_the_last_turn_is_a_trailer_not_part_of_the_closing(renderer_of):
    r = renderer_of("Phi-3.5")
    assert (r.profile.closing, r.profile.trailer) == ("<|end|>\n", "<|endoftext|>")
    assert r.decode(r.turn_closing_ids(r.encode("It is 4.<|end|>"))) == "\n"
    assert r.observation_ids([{"role": "user", "content": "Wrong."}]) == r.encode("<|user|>\nWrong.<|end|>\n<|assistant|>\n")
    with pytest.raises(RenderError, match="chat template of Phi-3.5 .*renders no 'tool' messages"):
        r.observation_ids([TOOL_4])
    with pytest.raises(RenderError, match="chat template of Phi-3.5 .*agent whose observations are tool messages"):
        r.require("tool")  # at start-up, for a tool agent
    r.require("user")
    renderer_of("Qwen2.5").require("tool")


def test_every_family_reports_its_strategy_and_stop_tokens(renderer_of):
    for family in FAMILIES:
        r = renderer_of(family.name)
        text = r.describe()
        assert f"chat template of {family.name}" in text and "observations" in text
        stops = {r.tokenizer.convert_tokens_to_ids(s) for s in family.stops}
        assert stops <= r.end_of_turn_ids, (family.name, r.describe())


@pytest.mark.parametrize("name", ["SmolLM2", "SmolLM3"])  # (Phi-3.5 drops calls too, but has no tool role)
def test_structured_tool_calls_the_template_drops_are_written_as_hermes_text(renderer_of, name):
    """SmolLM2's template ignores `tool_calls`: a client's history (OpenAI messages) rendered as an empty
    assistant turn before the tool result, the call lost. They become the hermes text the model writes."""
    from template_matrix import TOOLS

    r = renderer_of(name)
    assert not r.renders_tool_calls
    call = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "2+2"}'}}
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                TOOL_4]
    text = r.render_text(messages, TOOLS, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+2"}}\n</tool_call>' in text
    assert text.index("</tool_call>") < text.index("4", text.index("</tool_call>"))
    raw = {"role": "assistant", "content": '<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>',
           "tool_calls": [call]}  # the model's own text beside the parsed calls: not repeated
    again = r.render_text([messages[0], raw, TOOL_4], TOOLS, add_generation_prompt=True)
    assert again.split("2+2?", 1)[1].count("<tool_call>") == 1


def test_templates_that_render_tool_calls_are_left_to_render_them(renderer_of):
    for name in ("Qwen3 (no thinking)", "Llama-3.1", "gemma-4"):
        assert renderer_of(name).renders_tool_calls, name
