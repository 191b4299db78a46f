"""Rendering against the real Qwen3 and SmolLM2 templates: deltas, boundary repair, the sanity check."""

from __future__ import annotations

import pytest

from turnrl.render import ChatRenderer, RenderError, SanityMode

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+2"}}\n</tool_call>'


def stream_of(r: ChatRenderer, messages, replies, observations, tools=None):
    """Build the incremental stream the way drive does: prompt, reply tokens, closing, observation delta."""
    ids = r.initial_ids(messages, tools)
    conversation = list(messages)
    for k, reply in enumerate(replies):
        reply_ids = r.encode(reply + "<|im_end|>")
        ids += reply_ids
        conversation.append({"role": "assistant", "content": reply})
        if k < len(observations):
            ids += r.turn_closing_ids(reply_ids) + r.observation_ids(observations[k], tools)
            conversation += observations[k]
    return ids, conversation


def full_render_ids(r: ChatRenderer, conversation, tools=None):
    return r.encode(r.render_text(conversation, tools, add_generation_prompt=False))


@pytest.fixture(scope="module")
def qwen(qwen3_tokenizer):
    return ChatRenderer(qwen3_tokenizer)


def test_qwen3_tools_and_tool_responses_with_thinking_are_strictly_equal(qwen):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    replies = ["<think>\nUse the tool.\n</think>\n\n" + CALL, "<think>\nIt said 4.\n</think>\n\nIt is 4."]
    observations = [[{"role": "tool", "content": "4"}]]
    ids, conversation = stream_of(qwen, messages, replies, observations, TOOLS)
    # one user query then tool rounds: the template keeps every reasoning block, so the stream IS the render
    full = full_render_ids(qwen, conversation, TOOLS)
    assert full[: len(ids)] == ids and qwen.decode(full[len(ids):]) == "\n"  # the render also closes the last turn
    assert qwen.check(ids, conversation, TOOLS, SanityMode.STRICT).ok
    # the system prompt and the tool block appear exactly once
    text = qwen.decode(ids)
    assert text.count("# Tools") == 1 and text.count("Be brief.") == 1


def test_two_parallel_tool_responses_form_one_user_turn(qwen):
    delta = qwen.decode(qwen.observation_ids([{"role": "tool", "content": "4"}, {"role": "tool", "content": "9"}], TOOLS))
    assert delta == ("<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n9\n</tool_response>"
                     "<|im_end|>\n<|im_start|>assistant\n")


def test_boundary_repair_is_the_templates_newline(qwen):
    assert qwen.decode(qwen.closing_ids) == "<|im_end|>\n"
    # the model emitted <|im_end|>: only the newline is missing
    assert qwen.decode(qwen.turn_closing_ids(qwen.encode("Hi<|im_end|>"))) == "\n"
    # the model stopped on another stop token (e.g. </tool_call>): the whole closing is injected, masked
    assert qwen.decode(qwen.turn_closing_ids(qwen.encode(CALL))) == "<|im_end|>\n"


def test_enable_thinking_off_differs_only_by_strippable_empty_think_blocks(qwen3_tokenizer):
    r = ChatRenderer(qwen3_tokenizer, {"enable_thinking": False})
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids, conversation = stream_of(r, messages, ["It is 5.", "It is 4."], [[{"role": "user", "content": "Wrong."}]])
    # every generation prompt carries "<think>\n\n</think>\n\n"; the template drops it from earlier turns
    assert r.decode(ids).count("<think>\n\n</think>\n\n") == 2
    strict = r.check(ids, conversation, mode=SanityMode.STRICT)
    assert not strict.ok and strict.strippable and "first difference" in strict.diff
    assert r.check(ids, conversation, mode=SanityMode.IGNORE_STRIPPABLE).ok
    assert r.check(ids, conversation, mode=SanityMode.DISABLE).ok


def test_reasoning_history_gives_a_stable_stream(qwen):
    """Qwen3 strips the reasoning of turns before the last user message, so a delta taken against the real
    history would change from turn to turn; against the dummy conversation it never does."""
    feedback = [{"role": "user", "content": "Wrong, try again."}]
    first = qwen.observation_ids(feedback)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids, conversation = stream_of(qwen, messages, ["<think>\na\n</think>\n\n5", "<think>\nb\n</think>\n\n3",
                                                   "<think>\nc\n</think>\n\n4"], [feedback, feedback])
    assert qwen.observation_ids(feedback) == first
    check = qwen.check(ids, conversation, mode=SanityMode.STRICT)
    assert not check.ok and check.strippable  # only the stripped reasoning differs
    assert qwen.check(ids, conversation, mode=SanityMode.IGNORE_STRIPPABLE).ok


def test_content_differences_are_not_strippable(qwen):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids, conversation = stream_of(qwen, messages, ["<think>\nx\n</think>\n\n4"], [])
    conversation[-1] = {"role": "assistant", "content": "<think>\nx\n</think>\n\n5"}
    check = qwen.check(ids, conversation, mode=SanityMode.IGNORE_STRIPPABLE)
    assert not check.ok and not check.strippable


def test_smollm2_chatml_is_strictly_equal(smol_tokenizer):
    r = ChatRenderer(smol_tokenizer)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids, conversation = stream_of(r, messages, ["5", "4"], [[{"role": "user", "content": "Wrong, try again."}]])
    assert r.check(ids, conversation, mode=SanityMode.STRICT).ok
    # SmolLM2's template injects a default system prompt when there is none: once, in the prompt only
    assert r.decode(ids).count("You are a helpful AI assistant named SmolLM") == 1


def test_templates_that_cannot_be_delta_rendered_are_refused(qwen3_tokenizer):
    class Tok:
        chat_template = "x"
        eos_token_id = 1

        def apply_chat_template(self, messages, **kw):
            return "".join(m["content"][::-1] for m in messages)  # reverses content: no assistant text survives

    with pytest.raises(RenderError, match="drops assistant content"):
        ChatRenderer(Tok())

    class NoTemplate:
        chat_template = None

    with pytest.raises(RenderError, match="no chat template"):
        ChatRenderer(NoTemplate())
    with pytest.raises(RenderError, match="text-only"):
        ChatRenderer(qwen3_tokenizer).initial([{"role": "user", "content": [{"type": "image", "image": "x.png"}]}])
