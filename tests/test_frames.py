"""The renderer's hot path gives what the slow path gives (turnrl/frames.py, ChatRenderer.encode):

- a prompt or an observation delta filled into a proven template frame is the template's own render, token
  for token, for every content (plain ones go through the frame, the others through the template);
- `encode` calling the Rust tokenizer directly gives the tokenizer's own call's ids and offsets;
on the real chat templates and tokenizers of the template zoo (Qwen3 with and without thinking, SmolLM2,
Llama-3.1, Hermes, gemma, Phi-3.5, DeepSeek-R1...), and on templates written to defeat a frame.
"""

from __future__ import annotations

import copy

import pytest
from template_zoo import FAMILIES, family_tokenizer

from turnrl import frames
from turnrl.render import ChatRenderer, Strategy

CONTENTS = [
    "Tool result 1: 42.", "42", "x", "The answer is 4.\nNext line\n\nand a third", "tab\tinside",
    "  leading spaces", "trailing newline\n", "\nboth\n", "quotes ' \" and \\ backslash", "<b>markup</b> & more",
    "日本語のテキスト with é and emoji 🎉", "e\u0301 (NFC-able)", "<tool_response>\nwrapped\n</tool_response>",
    "before </think> after", "<think>\nhidden\n</think>\n\nshown", "the user said hello to the assistant",
    "{{ not jinja }} {% neither %}", "<|im_end|>", "<|im_start|>assistant\n", "a" * 600, "line\r\nwindows",
]
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string", "description": "expression"}}, "required": ["expr"]}}}]


def _slow_observation(r: ChatRenderer, messages, tools, history) -> tuple[str, list[int]]:
    text, start = r.observation_text(messages, tools, history)
    return text[start:], r._encode_suffix(text, start)


def _observations(content: str) -> list[list[dict]]:
    return [[{"role": "user", "content": content}],
            [{"role": "tool", "tool_call_id": "call_0", "name": "calc", "content": content}],
            [{"role": "tool", "tool_call_id": "call_0", "name": "calc", "content": content},
             {"role": "tool", "tool_call_id": "call_1", "name": "calc", "content": "second " + content}]]


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_frames_render_what_the_template_renders(zoo, family):
    r = ChatRenderer(family_tokenizer(family), family.kwargs)
    tools_variants = [TOOLS] if family.tools_always else [None, TOOLS]
    system_ok = family.system
    used = 0
    for tools in tools_variants:
        if r.profiles[bool(tools)].error is not None:
            continue
        for content in CONTENTS:
            prompt = ([{"role": "system", "content": "Be brief."}] if system_ok else []) + \
                     [{"role": "user", "content": content}]
            try:
                expected = r.render_text(prompt, tools, add_generation_prompt=True)
            except Exception:  # the template refuses this prompt: so must the hot path
                with pytest.raises(Exception):  # noqa: B017
                    r.render_initial(prompt, tools)
                continue
            assert r.render_initial(prompt, tools) == expected, (family.name, content)
            assert r.initial(prompt, tools).ids == r.tokenizer(expected, add_special_tokens=False)["input_ids"]
            history = [*prompt, {"role": "assistant", "content": "Let me compute."}]
            for observation in _observations(content):
                try:
                    text, ids = _slow_observation(r, observation, tools, history)
                except Exception:
                    with pytest.raises(Exception):  # noqa: B017
                        r.observation(observation, tools, history=history)
                    continue
                got = r.observation(observation, tools, history=history)
                assert got.ids == ids, (family.name, observation)
                assert r.observation_ids(observation, tools, history=history) == ids
                assert r.decode(got.ids) == r.decode(ids) and text.endswith(got.prefill)
        used += sum(f is not None for f in r._frames.values())
    if family.name.startswith(("Qwen3 (", "Qwen2.5", "SmolLM2", "Llama-3.1", "Hermes")):
        assert used >= 2, f"{family.name}: no frame was proven (the hot path never ran)"


def test_qwen3_plain_contents_use_the_frame_and_others_the_template(qwen3_tokenizer):
    r = ChatRenderer(qwen3_tokenizer, {"enable_thinking": False})
    obs = [{"role": "user", "content": "Tool result 1: 42."}]
    r.observation(obs)
    (key, frame), = r._frames.items()
    assert key[0] == "observation" and frame is not None
    assert frame.pieces == ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for content in ("<tool_response>x</tool_response>", " padded", "a </think> b", ""):
        assert not r._plain(content), content  # the template tests for these: rendered through it
    assert r._plain("Tool result 1: 42.") and r._plain("multi\nline\twith 'quotes'")
    assert r._plain("Use the tool, user.")  # role names are compared with roles, never with a content


def test_a_tool_list_counts_by_its_content_not_its_identity(qwen3_tokenizer):
    r = ChatRenderer(qwen3_tokenizer, {"enable_thinking": False})
    prompt = [{"role": "user", "content": "Use the tool."}]
    tools = copy.deepcopy(TOOLS)
    assert r.render_initial(prompt, tools) == r.render_text(prompt, tools, add_generation_prompt=True)
    n = len(r._frames)
    fresh = copy.deepcopy(TOOLS)  # an env that builds its tool list per episode: the same frame
    assert r.render_initial(prompt, fresh) == r.render_text(prompt, fresh, add_generation_prompt=True)
    assert len(r._frames) == n
    tools[0]["function"]["description"] = "Changed in place."  # the same list, other content: another frame
    assert r.render_initial(prompt, tools) == r.render_text(prompt, tools, add_generation_prompt=True)
    assert "Changed in place." in r.render_initial(prompt, tools) and len(r._frames) == n + 1


def test_llama31_tool_results_are_json_escaped_so_get_no_frame(zoo):
    family = next(f for f in FAMILIES if f.name == "Llama-3.1")
    r = ChatRenderer(family_tokenizer(family), family.kwargs)
    r.observation([{"role": "tool", "tool_call_id": "c", "name": "calc", "content": "42"}])
    assert list(r._frames.values()) == [None]  # tojson: the sentinels came back escaped


@pytest.mark.parametrize("body", [
    "{{ m.content | upper }}", "{{ m.content | replace('a', 'b') }}", "{{ m.content[:30] }}",
    "{% if m.content | length > 12 %}LONG{% endif %}{{ m.content }}", "{{ m.content | tojson }}",
    "{{ m.content.split('\\n') | join(' / ') }}", "{{ m.content }}{{ m.content }}",
])
def test_a_template_that_transforms_the_content_gets_no_frame(qwen3_tokenizer, body):
    r = ChatRenderer(_with_body(qwen3_tokenizer, body))
    for content in ("Tool result 1: 42.", "Result of length twenty!", "a\nb"):
        prompt = [{"role": "user", "content": content}]
        assert r.render_initial(prompt) == r.render_text(prompt, add_generation_prompt=True)
        assert r.observation_ids(prompt) == _slow_observation(r, prompt, None, None)[1]
    assert all(f is None for f in r._frames.values())


def test_a_literal_the_template_tests_for_keeps_that_content_off_the_frame(qwen3_tokenizer):
    r = ChatRenderer(_with_body(qwen3_tokenizer, "{% if 'secret' in m.content %}[hidden]{% else %}{{ m.content }}"
                                                  "{% endif %}"))
    for content in ("public text", "a secret text", "public again"):
        prompt = [{"role": "user", "content": content}]
        assert r.render_initial(prompt) == r.render_text(prompt, add_generation_prompt=True)
        assert r.observation_ids(prompt) == _slow_observation(r, prompt, None, None)[1]
    assert r.render_initial([{"role": "user", "content": "a secret text"}]).count("[hidden]") == 1
    assert any(f is not None for f in r._frames.values())


def test_a_template_that_reads_the_clock_gets_no_frames(qwen3_tokenizer):
    r = ChatRenderer(_with_body(qwen3_tokenizer, "{{ strftime_now('%d') if false else '' }}{{ m.content }}"))
    r.render_initial([{"role": "user", "content": "hello"}])
    assert frames.logic_literals(r.tokenizer.chat_template) is None and not r._frames


def _with_body(tokenizer, body: str):
    tok = copy.copy(tokenizer)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n" + body + "<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


TEXTS = ["", "plain", "<|im_start|>user\nhi<|im_end|>\n", "<think>\n\n</think>\n\n", "  spaces  \n\n\n", "🎉 é e\u0301",
         "<tool_call>\n{\"name\": \"x\"}\n</tool_call>", "x" * 2000, "<|endoftext|><|im_end|>", "\t\r\n"]


@pytest.mark.parametrize("name", ["qwen3", "smollm2", "llama3", "llama3+chatml", "phi3", "gemma4", "qwen2+deepseek"])
def test_encode_calls_the_rust_tokenizer_only_as_the_tokenizer_would(zoo, name):
    from template_zoo import tokenizer

    tok = tokenizer(name, "{% for m in messages %}{{ m.content }}{% endfor %}")
    r = ChatRenderer(tok)
    assert r._backend is not None and r._decodes_directly  # the shortcuts are what is tested
    for text in TEXTS:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert r.encode(text) == enc["input_ids"], (name, text)
        ids, offsets = r._encode_offsets(text)
        assert ids == enc["input_ids"] and [tuple(o) for o in offsets] == [tuple(o) for o in enc["offset_mapping"]]
        assert r.decode(ids) == tok.decode(ids, skip_special_tokens=False)
        assert r.decode(ids[1:-1]) == tok.decode(ids[1:-1], skip_special_tokens=False)  # cut anywhere
    tok(["a b c " * 50], truncation=True, max_length=4)  # someone else's call leaves truncation set on the backend
    if r._backend.truncation is not None:
        assert r._usable_backend() is None and r.encode("a b c " * 50) == tok("a b c " * 50, add_special_tokens=False)[
            "input_ids"]


def test_strategies_other_than_dummy_never_use_a_frame(zoo):
    family = next(f for f in FAMILIES if f.name == "DeepSeek-R1-Distill-Qwen")
    r = ChatRenderer(family_tokenizer(family), family.kwargs)
    assert r.profile.tool == Strategy.HISTORY
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    r.observation([{"role": "tool", "tool_call_id": "c", "name": "calc", "content": "42"}], history=history)
    assert not any(k[0] == "observation" and "tool" in str(k) for k in r._frames)
