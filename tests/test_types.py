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


def _validate_segment_per_token(seg, where):
    """validate_segment as it was before its fast paths (per-token Python checks): the reference."""
    import math

    from turnrl.types import SegmentSource, _check_kept_counts, _check_token_ids

    _check_token_ids(seg.token_ids, where)
    if len(seg.loss_mask) != len(seg.token_ids):
        raise ValueError(f"{where}: {len(seg.token_ids)} token ids but {len(seg.loss_mask)} mask values")
    if any(m not in (0, 1) for m in seg.loss_mask):
        raise ValueError(f"{where}: loss_mask values must be 0 or 1, got {sorted(set(seg.loss_mask))}")
    if seg.source != SegmentSource.MODEL and any(seg.loss_mask):
        raise ValueError(f"{where}: only model segments may carry mask 1")
    if seg.kept_counts is not None:
        _check_kept_counts(seg, where)
    if seg.logprobs is None:
        return
    if len(seg.logprobs) != len(seg.token_ids):
        raise ValueError(f"{where}: {len(seg.token_ids)} token ids but {len(seg.logprobs)} logprobs")
    for j, (m, lp) in enumerate(zip(seg.loss_mask, seg.logprobs, strict=True)):
        if m == 1 and (lp is None or not math.isfinite(lp) or lp > 1e-4):
            raise ValueError(f"{where} token {j}: mask 1 needs a finite logprob <= 0, got {lp}")
        if m == 0 and lp is not None:
            raise ValueError(f"{where} token {j}: mask 0 must not carry a logprob, got {lp}")


def test_validate_segment_fast_paths_accept_and_reject_exactly_what_the_per_token_check_does():
    import enum

    import numpy as np

    from turnrl.types import Segment, SegmentSource, validate_segment

    class Tok(enum.IntEnum):
        A = 7

    model, env = SegmentSource.MODEL, SegmentSource.ENV
    ids = [5, 6, 7]
    cases = [
        (model, ids, [1, 1, 1], [-0.1, -0.2, 0.0]), (env, ids, [0, 0, 0], [None] * 3), (env, ids, [0, 0, 0], None),
        (model, [], [], []), (model, ids, [1, 0, 1], [-0.1, None, -0.3]), (model, ids, [True, 1, 1], [-0.1] * 3),
        (model, ids, [1, 1, 1], [-1e308, -1e308, -1.0]), (model, ids, [1.0, 1, 1], [-1, -0.5, 0]),
        (model, [Tok.A, 6, 7], [1, 1, 1], [-0.1] * 3), (model, [np.int64(5), 6, 7], [1, 1, 1], [-0.1] * 3),
        (model, [True, 6, 7], [1, 1, 1], [-0.1] * 3), (model, [5, -1, 7], [1, 1, 1], [-0.1] * 3),
        (model, [5, 6.0, 7], [1, 1, 1], [-0.1] * 3), (model, ids, [1, 2, 1], [-0.1] * 3),
        (model, ids, [1, [1], 1], [-0.1] * 3), (model, ids, [1, 1], [-0.1] * 3), (env, ids, [0, 1, 0], [None] * 3),
        (model, ids, [1, 1, 1], [-0.1, None, -0.1]), (model, ids, [1, 1, 1], [-0.1, float("nan"), -0.1]),
        (model, ids, [1, 1, 1], [-0.1, float("-inf"), -0.1]), (model, ids, [1, 1, 1], [-0.1, 0.5, -0.1]),
        (model, ids, [1, 1, 1], [-0.1, True, -0.1]), (model, ids, [1, 1, 1], [-0.1, np.float64(-0.2), -0.1]),
        (env, ids, [0, 0, 0], [None, -0.1, None]), (env, ids, [0, 0, 0], [None, None]),
        (model, ids, (1, 1, 1), (-0.1, -0.1, -0.1)), (model, ids, [1, 1, 1], [-0.1, "x", -0.1]),
    ]
    for source, token_ids, mask, logprobs in cases:
        seg = Segment(source, list(token_ids), mask, logprobs, turn=1)  # type: ignore[arg-type]
        outcomes = []
        for check in (validate_segment, _validate_segment_per_token):
            try:
                check(seg, "here")
                outcomes.append("ok")
            except (ValueError, TypeError) as e:
                outcomes.append(f"{type(e).__name__}: {e}")
        assert outcomes[0] == outcomes[1], (token_ids, mask, logprobs, outcomes)
