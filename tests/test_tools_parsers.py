"""Tool-call parsers: calls, ids, errors as data (never exceptions), reasoning stripped, typed values."""

from __future__ import annotations

import json
import time

import pytest

from turnrl.testing.faults import fuzz_parsers
from turnrl.tools import PARSERS, get_parser
from turnrl.types import ToolCall

hermes = get_parser("hermes")


def test_registry_and_unknown_parser():
    assert set(PARSERS) >= {"hermes", "qwen3_coder"}
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; registered: hermes, qwen3_coder"):
        get_parser("nope")


# ---- hermes ----------------------------------------------------------------------------------------


def test_hermes_single_call_and_content():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    result = hermes.parse(text)
    assert result.calls == [ToolCall(name="add", arguments={"a": 1, "b": 2}, id="call_0")]
    assert result.errors == []
    assert result.content == "Let me add."
    assert hermes.has_call_syntax(text)


def test_hermes_multiple_calls_ids_generated_in_order_and_model_ids_kept():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"id": "abc", "name": "b", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>\n'
        '<tool_call>{"type": "function", "function": {"name": "c", "arguments": {"y": null}}}</tool_call>\n'
        '<tool_call>{"name": "d"}</tool_call>'
    )
    result = hermes.parse(text)
    assert result.calls == [
        ToolCall("a", {}, "call_0"),
        ToolCall("b", {"x": [1, 2]}, "abc"),
        ToolCall("c", {"y": None}, "call_2"),
        ToolCall("d", {}, "call_3"),
    ]
    assert result.errors == [] and result.content == ""


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": "a" "arguments": {}}', "invalid JSON in <tool_call> #1: Expecting ',' delimiter at char 13"),
        ('{"arguments": {"x": 1}}', 'missing "name" in <tool_call> #1'),
        ('["a", {}]', "<tool_call> #1 must hold a JSON object"),
        ('{"name": "a", "arguments": [1]}', '"arguments" in <tool_call> #1 must be a JSON object, got an array'),
        ('{"name": "a", "arguments": "{bad"}', 'invalid JSON in the "arguments" string of <tool_call> #1'),
    ],
)
def test_hermes_malformed_calls_become_errors(body, error):
    result = hermes.parse(f"<tool_call>{body}</tool_call>")
    assert result.calls == []
    assert len(result.errors) == 1 and result.errors[0].startswith(error)


def test_hermes_good_and_bad_calls_mix_and_blocks_are_numbered():
    text = '<tool_call>{oops}</tool_call><tool_call>{"name": "ok", "arguments": {}}</tool_call>'
    result = hermes.parse(text)
    assert result.calls == [ToolCall("ok", {}, "call_0")]
    assert len(result.errors) == 1 and result.errors[0].startswith("invalid JSON in <tool_call> #1:")


def test_hermes_unterminated_call_is_an_error():
    text = 'Sure. <tool_call>{"name": "a", "arguments": {}}'
    result = hermes.parse(text)
    assert result.calls == []
    assert result.errors == ["unterminated <tool_call> #1: missing </tool_call>"]
    assert result.content == "Sure."
    assert hermes.has_call_syntax(text)


def test_no_call_syntax_is_a_plain_answer():
    result = hermes.parse("The answer is 4.")
    assert result.calls == [] and result.errors == [] and result.content == "The answer is 4."
    assert not hermes.has_call_syntax("The answer is 4.")


def test_calls_inside_think_are_ignored():
    call = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    text = f"<think>maybe {call}?</think>Final: 4"
    result = hermes.parse(text)
    assert result.calls == [] and result.errors == []
    assert result.content == "Final: 4"
    assert result.reasoning == f"maybe {call}?"
    assert not hermes.has_call_syntax(text)


def test_reasoning_without_opening_tag_qwen3_style():
    call = '<tool_call>{"name": "real", "arguments": {}}</tool_call>'
    text = f'thinking about <tool_call>{{"name": "fake", "arguments": {{}}}}</tool_call>\n</think>\n\n{call}'
    result = hermes.parse(text)
    assert [c.name for c in result.calls] == ["real"]
    assert result.reasoning.startswith("thinking about")


def test_unclosed_think_makes_the_rest_reasoning():
    text = 'Answer first. <think>let me call <tool_call>{"name": "x", "arguments": {}}</tool_call>'
    result = hermes.parse(text)
    assert result.calls == [] and result.errors == [] and result.content == "Answer first."


# ---- qwen3_coder -----------------------------------------------------------------------------------

QWEN_CALL = """I'll run it.
<tool_call>
<function=run>
<parameter=count>
3
</parameter>
<parameter=ratio>
0.5
</parameter>
<parameter=items>
[1, "two", {"three": 3}]
</parameter>
<parameter=flag>
true
</parameter>
<parameter=nothing>
null
</parameter>
<parameter=text>
hello
world
</parameter>
<parameter=quoted>
"007"
</parameter>
<parameter=nan>
NaN
</parameter>
</function>
</tool_call>"""


def test_qwen3_coder_values_are_typed_via_json_with_string_fallback():
    result = get_parser("qwen3_coder").parse(QWEN_CALL)
    assert result.errors == []
    assert result.content == "I'll run it."
    assert result.calls == [
        ToolCall(
            name="run",
            arguments={
                "count": 3,
                "ratio": 0.5,
                "items": [1, "two", {"three": 3}],
                "flag": True,
                "nothing": None,
                "text": "hello\nworld",
                "quoted": "007",
                "nan": "NaN",
            },
            id="call_0",
        )
    ]


def test_qwen3_coder_keeps_string_parameters_as_strings_given_schemas():
    schemas = [{"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"count": {"type": "string"}, "n": {"type": "integer"}}}}}]
    text = "<tool_call>\n<function=run>\n<parameter=count>\n3\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"
    call = get_parser("qwen3_coder", schemas).parse(text).calls[0]
    assert call.arguments == {"count": "3", "n": 3}


def test_qwen3_coder_several_functions_and_lenient_inner_closing_tags():
    text = (
        "<tool_call>\n<function=a>\n<parameter=x>\n1\n</function>\n"
        "<function=b>\n<parameter=y>\nhi\n<parameter=z>\n[2]\n</function>\n</tool_call>"
    )
    result = get_parser("qwen3_coder").parse(text)
    assert result.errors == []
    assert result.calls == [ToolCall("a", {"x": 1}, "call_0"), ToolCall("b", {"y": "hi", "z": [2]}, "call_1")]


def test_qwen3_coder_errors():
    parser = get_parser("qwen3_coder")
    assert parser.parse("<tool_call>\n<function=a>\n").errors == ["unterminated <tool_call> #1: missing </tool_call>"]
    assert parser.parse("<tool_call>just text</tool_call>").errors == ["no <function=...> in <tool_call> #1"]
    assert parser.parse("<tool_call><function=>\n</function></tool_call>").errors[0].startswith("missing function name")
    dup = "<tool_call><function=f><parameter=x>1</parameter><parameter=x>2</parameter></function></tool_call>"
    assert parser.parse(dup).errors == ["parameter 'x' given twice in <tool_call> #1 (function 'f')"]


def test_qwen3_coder_ignores_calls_in_reasoning_and_never_evals():
    parser = get_parser("qwen3_coder")
    hidden = "<tool_call>\n<function=rm>\n</function>\n</tool_call>"
    assert parser.parse(f"<think>{hidden}</think>done").calls == []
    assert parser.parse(f"{hidden}</think>done").calls == []
    evil = "<tool_call>\n<function=f>\n<parameter=x>\n__import__('os').getcwd()\n</parameter>\n</function>\n</tool_call>"
    assert parser.parse(evil).calls[0].arguments == {"x": "__import__('os').getcwd()"}


# ---- hostile output: never an exception, always the invalid-call feedback ---------------------------

qwen = get_parser("qwen3_coder")


def _hermes_args(value: str) -> str:
    return f'<tool_call>{{"name": "f", "arguments": {{"x": {value}}}}}</tool_call>'


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("[" * 100_000 + "]" * 100_000, "nesting deeper than 64 levels"),  # RecursionError before
        ("[" * 65 + "]" * 65, "nesting deeper than 64 levels"),
        ("9" * 5000, "an integer of 5000 digits (at most 4300)"),  # ValueError before
        ("-" + "9" * 4301, "an integer of 4301 digits (at most 4300)"),
        ("NaN", "NaN is not JSON (numbers must be finite)"),  # accepted before, sent on as invalid JSON
        ("-Infinity", "-Infinity is not JSON (numbers must be finite)"),
        ("1e999", "the number 1e999 is out of range"),  # json.loads makes it inf
        ('"\\ud800"', "a string holds an unpaired surrogate ('\\ud800')"),  # cannot be written as UTF-8
    ],
)
def test_hermes_refuses_what_cannot_go_out_as_json(value, error):
    result = hermes.parse(_hermes_args(value))
    assert result.calls == []
    assert result.errors == [f"invalid JSON in <tool_call> #1: {error}"]


def test_hermes_limits_also_apply_inside_an_arguments_string_and_keep_what_is_fine():
    nested = json.dumps({"x": json.loads("[" * 63 + "]" * 63), "n": int("9" * 4300), "s": "\ud83d\ude00", "f": 1e308})
    ok = hermes.parse(f'<tool_call>{{"name": "f", "arguments": {json.dumps(nested)}}}</tool_call>')
    assert ok.errors == [] and ok.calls[0].arguments["n"] == int("9" * 4300) and ok.calls[0].arguments["s"] == "😀"
    bad = hermes.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": NaN}"}</tool_call>')
    assert bad.calls == []
    assert bad.errors == ['invalid JSON in the "arguments" string of <tool_call> #1: NaN is not JSON (numbers must be finite)']


@pytest.mark.parametrize(
    "value",
    ["[" * 100_000, "[" * 100_000 + "]" * 100_000, "9" * 5000, "1e999", "-Infinity", '"\\udc00"'],
)
def test_qwen3_coder_keeps_values_it_cannot_read_as_raw_strings(value):
    result = qwen.parse(f"<tool_call>\n<function=f>\n<parameter=x>\n{value}\n</parameter>\n</function>\n</tool_call>")
    assert result.errors == []
    assert result.calls == [ToolCall("f", {"x": value}, "call_0")]
    json.dumps(result.calls[0].arguments, allow_nan=False)


@pytest.mark.parametrize(
    "text",
    [
        "</think>" * 100_000 + "<think>",  # quadratic in split_reasoning before: minutes
        "<channel|>" * 100_000 + "<tool_call>",
        "<tool_call><function=" * 50_000 + "</tool_call>",  # quadratic in the function regex before
        "<tool_call><function=f><parameter=" * 50_000 + "</tool_call>",
        '<tool_call>{"name": "f", "arguments": ' + json.dumps('{"a": [' * 100_000) + "}</tool_call>",
        '<tool_call>{"name": "f", "arguments": {"x": "' + '\\"[' * 200_000 + "}}</tool_call>",
    ],
)
def test_parsing_is_linear_in_the_reply(text):
    # A bound, not a benchmark: each reply takes well under a second when parsing is linear and minutes when it is
    # quadratic, so 20 s separates the two even on a loaded 2-core machine (2 s failed there at 2.8 s).
    for parser in (hermes, qwen):
        start = time.perf_counter()
        parser.parse(text)
        assert time.perf_counter() - start < 20.0, parser.name


@pytest.mark.parametrize(("inner", "depth"), [
    ('{"a": [1, {"b": "]]]}}}"}]}', 4),  # brackets inside strings do not count
    ('["\\"[[[", [[]]]', 4),  # nor after an escaped quote
    ('"[[[[', 1),  # an unterminated string runs to the end
    ('"x\\', 1),  # also with a trailing backslash
    ("[" * 70 + "]" * 70, 65),  # counting stops past the limit
])
def test_nesting_depth_reads_strings_as_json_does(inner, depth):
    from turnrl.tools.parsers import _nesting_depth

    padded = '["' + "[" * 100 + '", ' + inner + "]"  # more than 64 brackets: the text is scanned
    assert _nesting_depth(padded, 64) == depth


def test_fuzz_of_adversarial_replies_raises_nothing():
    """A fast slice of bench/faults.py's fuzz (200,000 inputs there): every parser, with and without schemas."""
    report = fuzz_parsers(2000, seed=7)
    assert report.inputs == 2000 and report.calls == 16_000
    assert report.exceptions == {} and report.bad_outputs == 0, report.examples
    assert report.tool_calls > 500 and report.parse_errors > 2000  # the mix holds good and bad calls
