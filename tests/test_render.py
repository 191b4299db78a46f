"""Rendering against the real Qwen3 and SmolLM2 templates: deltas, boundary repair, the sanity check."""

from __future__ import annotations

import copy

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



def test_the_check_names_the_same_stretches_as_difflib(qwen3_tokenizer):
    """The linear scan of `_differences` against difflib over the whole: Qwen3 without thinking (an empty think
    block per earlier turn), a reasoning block longer than the scan's span (difflib aligns the rest), a
    difference at the very end of the stream (retokenised), and three equal tokens between two stretches."""
    from turnrl.render import _RESYNC_SPAN, _differences, _differences_difflib

    r = ChatRenderer(qwen3_tokenizer, {"enable_thinking": False})
    messages = [{"role": "user", "content": "What is 2+2?"}]
    feedback = [{"role": "user", "content": "Are you sure?"}]
    long_think = "<think>\n" + " ".join(f"step {k}" for k in range(3 * _RESYNC_SPAN)) + "\n</think>\n\n"
    cases = [stream_of(r, messages, ["4", "Yes, 4.", "Still 4."], [feedback, feedback]),
             stream_of(r, messages, [long_think + "4", "Yes, 4."], [feedback])]
    for ids, conversation in cases:
        full = full_render_ids(r, conversation)
        check = r.check(ids, conversation)
        assert check.reasons and set(check.reasons) == {"reasoning"}, check.diff
        assert _differences(ids, full) == _differences_difflib(ids, full)
    ids, conversation = cases[0]
    full = full_render_ids(r, conversation)
    hello = r.encode("Hello")
    tail = [*ids[:-1], *r.encode("Hel"), *r.encode("lo")]
    assert _differences(tail, full + hello) == _differences_difflib(tail, full + hello)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    b = [1, 2, 3, 20, 21, 7, 8, 9, 30, 11, 12, 13, 14, 15, 16]
    assert _differences(a, b) == _differences_difflib(a, b) == [(3, 6, 3, 5), (9, 10, 8, 9)]
    assert _differences(a, a + [99]) == [] and _differences(a, a[:5]) == [(5, 16, 5, 5)]


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

    with pytest.raises(RenderError, match="chat template of Tok .*drops assistant content"):
        ChatRenderer(Tok())

    class NoTemplate:
        chat_template = None

    with pytest.raises(RenderError, match="no chat template"):
        ChatRenderer(NoTemplate())
    with pytest.raises(RenderError, match="text-only"):
        ChatRenderer(qwen3_tokenizer).initial([{"role": "user", "content": [{"type": "image", "image": "x.png"}]}])


# ---- issue 15: probed strategies, pre-fill, the token-level check ------------------------------------------
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# numbers the user turns: a template whose rendering of a new message depends on the earlier conversation
NUMBERED = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.n = ns.n + 1 %}"
            "<|im_start|>user {{ ns.n }}\n{{ m.content }}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
            "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")


def with_template(tokenizer, template: str):
    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return tok


def test_a_difference_in_token_ids_alone_is_reported(qwen3_tokenizer):
    """The reply's leading newline cannot merge with the generation prompt's: the same text, other tokens.
    A text-level check saw nothing; the token-level one names it, and only ignore_strippable accepts it."""
    r = ChatRenderer(with_template(qwen3_tokenizer, CHATML))
    messages = [{"role": "user", "content": "Hi"}]
    stream = r.initial_ids(messages) + r.encode("\nHello") + r.encode("<|im_end|>")
    conversation = [*messages, {"role": "assistant", "content": "\nHello"}]
    assert r.encode(r.render_text(conversation, add_generation_prompt=False))[: len(stream)] != stream
    strict = r.check(stream, conversation)
    assert not strict.ok and strict.strippable and strict.reasons == ["retokenised"]
    assert r.check(stream, conversation, mode=SanityMode.IGNORE_STRIPPABLE).ok


def test_a_missing_newline_after_the_turn_is_a_content_difference(qwen3_tokenizer):
    """Whitespace differences are not harmless when no reasoning block explains them: a lost closing newline
    is exactly the turn-boundary bug the check exists for."""
    r = ChatRenderer(with_template(qwen3_tokenizer, CHATML))
    messages = [{"role": "user", "content": "Hi"}]
    feedback = [{"role": "user", "content": "Again."}]
    conversation = [*messages, {"role": "assistant", "content": "Hello"}, *feedback,
                    {"role": "assistant", "content": "Hello again"}]
    reply, again = r.encode("Hello<|im_end|>"), r.encode("Hello again<|im_end|>")
    closed = r.initial_ids(messages) + reply + r.turn_closing_ids(reply) + r.observation_ids(feedback) + again
    assert r.check(closed, conversation).ok
    stream = r.initial_ids(messages) + reply + r.observation_ids(feedback) + again  # the closing "\n" is lost
    check = r.check(stream, conversation, mode=SanityMode.IGNORE_STRIPPABLE)
    assert not check.ok and check.reasons == ["content"]


def test_unicode_normalisation_by_the_tokenizer_is_no_difference(qwen):
    """Qwen's tokenizer normalises e + combining acute to é: ids agree, a text comparison did not."""
    messages = [{"role": "user", "content": "Caf" + "e\u0301?"}]
    ids, conversation = stream_of(qwen, messages, ["<think>\nx\n</think>\n\nOui, caf" + "e\u0301."], [])
    assert qwen.check(ids, conversation, mode=SanityMode.STRICT).ok


def test_the_pre_fill_is_reported_with_its_tokens(qwen3_tokenizer):
    r = ChatRenderer(qwen3_tokenizer, {"enable_thinking": False})
    assert r.profile.prefill == "<think>\n\n</think>\n\n"
    prompt = r.initial([{"role": "user", "content": "Hi"}])
    assert prompt.prefill == r.profile.prefill and prompt.ids[-len(prompt.prefill_ids):] == prompt.prefill_ids
    assert r.decode(prompt.prefill_ids) == prompt.prefill and r.prefill_of(prompt.ids) == prompt.prefill
    obs = r.observation([{"role": "user", "content": "Again."}])
    assert obs.prefill == prompt.prefill and r.decode(obs.prefill_ids) == prompt.prefill
    assert ChatRenderer(qwen3_tokenizer).initial([{"role": "user", "content": "Hi"}]).prefill == ""


async def test_drive_records_the_pre_fill_in_the_messages_and_as_a_template_segment(qwen3_tokenizer):
    from fakes import ScriptedEngine

    from turnrl.rollout import RolloutContext, RolloutLimits, drive
    from turnrl.types import SamplingParams, StepResult

    class Feedback:
        turn = 0

        def step(self, text):
            self.turn += 1
            return StepResult("Again.") if self.turn == 1 else StepResult(done=True)

    r = ChatRenderer(qwen3_tokenizer, {"enable_thinking": False})
    ctx = RolloutContext(engine=ScriptedEngine(qwen3_tokenizer, lambda rid, turn, prompt: f"Answer {turn}."),
                         renderer=r, sampling=SamplingParams(), limits=RolloutLimits(max_turns=2),
                         trajectory_id="t", group_id="g", sample_index=0, sample={})
    traj = await drive(ctx, Feedback(), [{"role": "user", "content": "Hi"}])
    assert [m["content"] for m in traj.messages if m["role"] == "assistant"] == \
        ["<think>\n\n</think>\n\nAnswer 1.", "<think>\n\n</think>\n\nAnswer 2."]
    assert [s.source for s in traj.segments] == ["model", "template", "env", "template", "model"]
    prefill = traj.segments[3]
    assert r.decode(prefill.token_ids) == "<think>\n\n</think>\n\n" and prefill.loss_mask == [0] * len(prefill.token_ids)
    assert r.decode(traj.segments[2].token_ids).endswith("<|im_start|>assistant\n")
    check = r.check(traj.prompt_ids + traj.response_ids, traj.messages)
    assert check.strippable and check.reasons == ["reasoning"]  # the template drops the first turn's empty block


def test_a_template_with_state_across_the_conversation_gets_history_deltas(qwen3_tokenizer):
    r = ChatRenderer(with_template(qwen3_tokenizer, NUMBERED))
    assert r.profile.user == "history" and "user observations history" in r.describe()
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    delta = r.decode(r.observation_ids([{"role": "user", "content": "Again."}], history=history))
    assert delta == "<|im_start|>user 2\nAgain.<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(RenderError, match="pass history="):
        r.observation_ids([{"role": "user", "content": "Again."}])
    history += [{"role": "user", "content": "Again."}, {"role": "assistant", "content": "Hello again"}]
    stream = (r.initial_ids(history[:1]) + r.encode("Hello<|im_end|>") + r.encode("\n")
              + r.observation_ids(history[2:3], history=history[:2]) + r.encode("Hello again<|im_end|>"))
    assert r.check(stream, history).ok  # the full render numbers the turns the same way


def test_a_template_that_renders_no_tool_messages_refuses_them_by_name(qwen3_tokenizer):
    r = ChatRenderer(with_template(qwen3_tokenizer, CHATML.replace("{% for m in messages %}",
                                                                     "{% for m in messages if m.role != 'tool' %}")))
    assert r.profile.tool == "unsupported" and r.profile.user == "dummy"
    with pytest.raises(RenderError, match="chat template of .* renders no 'tool' messages"):
        r.observation([{"role": "tool", "content": "4"}])


def test_a_reply_cut_off_after_leading_newlines_is_a_harmless_difference(qwen):
    """tiny-qwen3 at T=1 cut off by max_new_tokens after '\\n\\n\\n': the full render adds the empty <think> block,
    strips the newlines and closes the turn; past the stream's end the render is a prefix match, so this is
    `reasoning`, not `content` (it was a content warning on a one-step training run)."""
    user = [{"role": "user", "content": "Say 0."}]
    reply = [198, 198, 198, 55541]  # '\n', '\n', '\n', 'omens': as sampled, not as the text encodes
    assert qwen.decode(reply) == "\n\n\nomens"
    check = qwen.check(qwen.initial(user).ids + reply, [*user, {"role": "assistant", "content": "\n\n\nomens"}])
    assert check.reasons == ["reasoning"] and check.strippable and not check.ok
    wrong = qwen.check(qwen.initial(user).ids + reply, [*user, {"role": "assistant", "content": "\n\n\nomen"}])
    assert "content" in wrong.reasons  # the render does not go on from what the stream holds: a real difference
