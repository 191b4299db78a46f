"""The one table of sampling rules (turnrl/types.py) and the boundaries that check it."""

import pytest

from turnrl.engines.base import InvalidRequest
from turnrl.engines.embedded import check_sampling
from turnrl.engines.http import sampling_from_json
from turnrl.serve.http import sampling_fields
from turnrl.serve.sessions import ChatRequestError
from turnrl.types import CHAT_SAMPLING_RULES, SAMPLING_RULES, SamplingParams

BAD = [  # (field, a value its rule refuses)
    ("temperature", float("nan")), ("temperature", -0.5), ("temperature", True),
    ("top_p", 0), ("top_p", 1.5), ("top_p", "1"),
    ("top_k", 1.5), ("top_k", False),
    ("max_new_tokens", 0), ("max_new_tokens", 2.0),
    ("stop_token_ids", (1, -2)), ("stop_token_ids", 5),
    ("seed", 2**64), ("seed", "x"),
]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_sampling_params_refuse_what_the_table_refuses(name, value):
    # a NaN temperature, a float top_k or a string seed were built before and failed later, inside an engine
    with pytest.raises(ValueError) as built:
        SamplingParams(**{name: value})
    assert str(built.value).startswith(f"SamplingParams.{name} must be {SAMPLING_RULES[name].expected}, got")


def _bypassed(name, value) -> SamplingParams:
    params = SamplingParams()
    object.__setattr__(params, name, value)  # what a caller that skipped the checks could hand an engine
    return params


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, v in BAD if not isinstance(v, tuple)])
def test_every_boundary_says_the_same_rule(name, value):
    expected = SAMPLING_RULES[name].expected
    with pytest.raises(InvalidRequest, match="must be") as wire:
        sampling_from_json({name: value})
    assert wire.value.param == f"sampling.{name}" and expected in str(wire.value)
    with pytest.raises(InvalidRequest) as door:
        check_sampling(_bypassed(name, value), "request 'r'", vocab_size=100)
    assert door.value.param == f"sampling.{name}" and expected in str(door.value)
    chat_name = {"max_new_tokens": "max_tokens"}.get(name, name)
    if name in CHAT_SAMPLING_RULES and not (name == "top_p" and value == 0):
        with pytest.raises(ChatRequestError) as chat:
            sampling_fields({chat_name: value}, {chat_name: name}, "stop")
        assert chat.value.param == chat_name and CHAT_SAMPLING_RULES[name].expected in str(chat.value)


def test_the_boundaries_differ_only_where_the_table_says():
    assert sampling_fields({"top_p": 0}, {"top_p": "top_p"}, "stop") == {"top_p": 0}  # OpenAI's greedy
    assert sampling_from_json({"stop_token_ids": None}).stop_token_ids == ()  # the wire's null
    with pytest.raises(InvalidRequest, match=r"integers in \[0, 100\)") as door:  # the engine's vocabulary
        check_sampling(SamplingParams(stop_token_ids=(100,)), "request 'r'", vocab_size=100)
    assert door.value.param == "sampling.stop_token_ids"
