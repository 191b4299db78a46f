"""split_reasoning: one reader of reasoning markers for every place that strips them."""

from __future__ import annotations

import pytest

from turnrl.reasoning import remove_reasoning_blocks, split_reasoning, strip_reasoning


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("plain answer", None, "plain answer"),
        ("<think>\nAdd them.\n</think>\n\nIt is 5.", "Add them.", "It is 5."),  # Qwen3, closed
        ("<think>\n\n</think>\n\nHi", "", "Hi"),  # thinking disabled: an empty block, not no block
        ("Add them.\n</think>\n\nIt is 5.", "Add them.", "It is 5."),  # <think> pre-filled by the template
        ("Answer first. <think>then I wonder", "then I wonder", "Answer first."),  # unclosed: the rest
        ("<think>a</think>x<think>b</think>y", "a\nb", "xy"),  # several blocks
        ("<think> a <think> b </think> c </think> d", "a <think> b\nc", "d"),  # nested: the outer close wins
        ("r</think>z<think>s</think>", "r\ns", "z"),  # pre-filled, then another block
        ("<think>a</think> x </think> y", "a\nx", "y"),  # a stray close ends reasoning begun after the block
        ("  \n<think>  a  </think>  \n b \n", "a", "b"),  # whitespace around both is stripped
        ("<|channel>thought\nPlan it.<channel|>Done.", "Plan it.", "Done."),  # Gemma 4 thought channel
        ("<|channel>thought\nstill going", "still going", ""),
        ("<think>t</think><|channel>thought\ng<channel|>end", "t\ng", "end"),
        ("", None, ""),
    ],
)
def test_split_reasoning(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)
    assert strip_reasoning(text) == content


def test_remove_reasoning_blocks_leaves_unclosed_and_stray_markers():
    """For a whole rendered conversation: an unclosed block in one turn must not swallow later turns."""
    conversation = "u1<think>a</think>r1 u2<think>cut off u3 r3</think>x"
    assert remove_reasoning_blocks(conversation) == "u1r1 u2x"
    assert remove_reasoning_blocks("t1 <think>cut off, then turn 2") == "t1 <think>cut off, then turn 2"
    assert remove_reasoning_blocks("a<|channel>thought\nb<channel|>c") == "ac"


def test_every_call_site_reads_a_prefilled_think_alike():
    """The template pre-filled `<think>`, so the reply starts inside reasoning. Before one reader existed, the
    remote_env scheduler took the whole reply as its action and thinking_tips kept the reasoning in history."""
    from turnrl.agents.schedulers_builtin import RemoteEnvScheduler, is_correct
    from turnrl.agents.schedulers_builtin import strip_reasoning as strip_history
    from turnrl.envs.frozenlake import parse_move
    from turnrl.tools import get_parser

    reply = 'Maybe {"move": "up"}, 3 is \\boxed{3}.\n</think>\n\n{"move": "down"}'
    assert RemoteEnvScheduler().parse_action(reply) == {"move": "down"}
    assert strip_history([{"role": "assistant", "content": reply}]) == [
        {"role": "assistant", "content": '{"move": "down"}'}]
    assert parse_move(reply) == 1  # down
    assert not is_correct(reply, {"answer": "3"})  # the boxed 3 sits in the reasoning
    parsed = get_parser("hermes").parse(reply)
    assert parsed.content == '{"move": "down"}' and parsed.reasoning.startswith("Maybe")
