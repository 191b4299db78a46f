"""Cascade attention in the embedded engine's decode step (turnrl.engines.cascade).

The attention itself is checked against transformers' SDPA path on the same rows (1e-5 relative in float32):
groups of different prefix lengths beside plain rows, a group of one, GQA. The engine is checked end to end on
tiny-qwen3 against `share_prefixes=False` (each sample prefills and decodes against its own KV): the same tokens
and logprobs within the tolerance of tests/test_engine_prefix.py, with rows joining and leaving mid-decode.
Seeded rows sample with top-k or top-p: an unfiltered draw from random tiny-qwen3's near-flat 152k-token
distribution can land within float rounding of the boundary between two tokens, and then any change of
summation order (cascade, or rows batched differently) flips it (docs/engines.md, "Exactness").
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
import torch
from test_engine_embedded import scramble
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from turnrl.engines import cascade, embedded
from turnrl.engines.cascade import (
    CASCADE_ATTENTION,
    PLAN_KWARG,
    Shared,
    cascade_attention,
    decode_groups,
    plan_cascade,
    share,
)
from turnrl.engines.embedded import EmbeddedEngine
from turnrl.models import load_model
from turnrl.types import GenerateOutput, SamplingParams

ATOL = 1e-5  # as tests/test_engine_prefix.py


# ---- the attention on its own ------------------------------------------------------------------------------------
def slab(n: int, heads: int, kv_heads: int, dim: int, lens: list[int], groups: list[tuple[int, list[int]]],
         dtype: torch.dtype = torch.float32, seed: int = 0):
    """A decode step's inputs as the engine's slab gives them: K/V rows [n, Hkv, width, d] (views of a larger
    capacity), each group's rows holding its first row's K/V in columns [0, P)."""
    g = torch.Generator().manual_seed(seed)
    cap = max(lens) + 37
    k = torch.randn(n, kv_heads, cap, dim, generator=g) * 2
    v = torch.randn(n, kv_heads, cap, dim, generator=g)
    for p, rows in groups:
        k[rows, :, :p] = k[rows[0], :, :p]
        v[rows, :, :p] = v[rows[0], :, :p]
    q = torch.randn(n, heads, 1, dim, generator=g) * 2
    lens_t = torch.tensor(lens)
    width = max(lens) + 1
    mask = (torch.arange(width)[None, :] <= lens_t[:, None])[:, None, None, :]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    return module, q.to(dtype), k[:, :, :width].to(dtype), v[:, :, :width].to(dtype), mask, lens_t


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    err = ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()
    assert err <= rel, f"max error {err:.2e} relative to the largest output (allowed {rel:.0e})"


CASES = {  # n, heads, kv heads, head dim, lens, groups (P, rows)
    "one group, every row": (6, 8, 2, 16, [90, 95, 91, 99, 93, 92], [(80, [0, 1, 2, 3, 4, 5])]),
    "two groups of different prefixes beside plain rows": (
        7, 8, 2, 16, [120, 64, 130, 70, 118, 99, 66], [(100, [0, 2, 4]), (40, [6, 3, 1])]),
    "a group of one": (3, 4, 4, 8, [50, 60, 55], [(45, [1])]),
    "GQA, 7 query heads per KV head, rows out of slot order": (
        5, 14, 2, 32, [300, 260, 280, 301, 275], [(250, [4, 1, 3])]),
    "a prefix of the whole KV but the new token": (4, 6, 3, 16, [40, 40, 40, 40], [(40, [0, 1, 2, 3])]),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("path", ["cpu_flash", "portable"])
def test_cascade_attention_equals_sdpa_on_the_same_rows(name, path, monkeypatch):
    n, heads, kv_heads, dim, lens, groups = CASES[name]
    if path == "portable":
        monkeypatch.setattr(cascade, "_CPU_FLASH", None)
    elif cascade._CPU_FLASH is None:
        pytest.skip("this torch has no CPU flash kernel")
    module, q, k, v, mask, lens_t = slab(n, heads, kv_heads, dim, lens, groups)
    plan = plan_cascade(lens_t, groups, min_rows=1)
    assert plan is not None
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=dim ** -0.5)
    out, _ = cascade_attention(module, q, k, v, mask, scaling=dim ** -0.5, **{PLAN_KWARG: plan})
    assert out.shape == expected.shape == (n, 1, heads, dim)
    assert_rel_close(out, expected, 1e-5)


def test_cascade_attention_in_bfloat16_is_as_close_to_float32_as_sdpa_is():
    n, heads, kv_heads, dim, lens, groups = CASES["two groups of different prefixes beside plain rows"]
    module, q, k, v, mask, lens_t = slab(n, heads, kv_heads, dim, lens, groups)
    exact, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=dim ** -0.5)
    bf = [t.to(torch.bfloat16) for t in (q, k, v)]
    plan = plan_cascade(lens_t, groups)
    out, _ = cascade_attention(module, *bf, mask, scaling=dim ** -0.5, **{PLAN_KWARG: plan})
    sdpa_bf, _ = sdpa_attention_forward(module, *bf, mask, scaling=dim ** -0.5)
    assert out.dtype == torch.bfloat16
    err = (out.float() - exact).abs().max()
    assert err <= 2 * (sdpa_bf.float() - exact).abs().max() + 1e-3


def test_without_a_plan_it_is_sdpa_exactly():
    module, q, k, v, mask, _ = slab(3, 4, 2, 8, [20, 30, 25], [])
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    out, _ = cascade_attention(module, q, k, v, mask, scaling=0.3)
    assert torch.equal(out, expected)


def test_the_plan_groups_rows_and_refuses_impossible_groups():
    lens = torch.tensor([50, 60, 70, 80])
    assert plan_cascade(lens, [(40, [2])]) is None  # one row: nothing to share
    assert plan_cascade(lens, [(8, [0, 1])]) is None  # a prefix too short to gain anything
    plan = plan_cascade(lens, [(40, [3, 1])])
    assert plan is not None and plan.start == 40 and plan.groups[0][:2] == (1, 40)
    assert torch.equal(plan.grouped, torch.tensor([1, 3])) and [rows for rows, _ in plan.plain] == [slice(0, 1),
                                                                                                      slice(2, 3)]
    assert [mask[:, 0, 0].sum(-1).tolist() for _, mask in plan.plain] == [[51], [71]]  # columns 0..lens[i]
    # the suffix window: row 1 sees columns 40..60, row 3 40..80
    assert plan.suffix_mask.shape == (2, 1, 1, 81 - 40)
    assert plan.suffix_mask[0, 0, 0].nonzero()[[0, -1], 0].tolist() == [0, 20]
    assert plan.suffix_mask[1, 0, 0].nonzero()[[0, -1], 0].tolist() == [0, 40]
    whole = plan_cascade(lens, [(50, [0, 1, 2, 3])])
    assert whole is not None and whole.grouped == slice(0, 4) and whole.plain == []  # a view, no gather
    with pytest.raises(ValueError, match="longer than a row's KV"):
        plan_cascade(lens, [(55, [0, 1])])
    with pytest.raises(ValueError, match="out of"):
        plan_cascade(lens, [(20, [0, 4])])
    with pytest.raises(ValueError, match="overlap"):
        plan_cascade(lens, [(20, [0, 1]), (30, [1, 2])])


def test_shared_blocks_follow_copies_of_copies():
    a, b = share(None, 100)  # b copies 100 columns of a row that held no block: a becomes its original
    assert a.block is b.block and b.length == 100 and a.length > 10**9
    a2, c = share(b, 120)  # c copies 120 columns of b, which holds only 100 of the block
    assert a2 is b and c == Shared(a.block, 100)
    _, d = share(a, 30)
    assert d == Shared(a.block, 30)
    other, e = share(None, 50)
    held = [a, b, None, c, d, e]
    lens = torch.tensor([130, 140, 10, 150, 160, 70])
    assert decode_groups(held, lens) == [(30, [0, 1, 3, 4])]  # e alone holds its block: no group
    assert decode_groups([a, b], torch.tensor([20, 140])) == [(20, [0, 1])]  # the original's own KV bounds it


# ---- the engine, end to end ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m = load_model("tiny-qwen3")
    scramble(m, seed=0)
    return m.eval()


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def assert_same(a: list[GenerateOutput], b: list[GenerateOutput]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=ATOL, rtol=0)
        assert x.finish_reason == y.finish_reason


Job = tuple[list[int], SamplingParams, str, tuple[str, int] | None]


async def staggered(engine: EmbeddedEngine, jobs: list[Job]) -> list[GenerateOutput]:
    """Each job (prompt, params, request id, after): submitted at once (after None), or once request after[0] has
    sampled after[1] tokens, so that it joins a batch that is decoding."""
    sampled = {rid: 0 for _, _, rid, _ in jobs}
    waits = {after: asyncio.Event() for *_, after in jobs if after is not None}

    def counter(rid: str):
        def on_token(_: int) -> None:
            sampled[rid] += 1
            for (who, n), event in waits.items():
                if who == rid and sampled[rid] >= n:
                    event.set()
        return on_token

    async def one(prompt: list[int], params: SamplingParams, rid: str, after: tuple[str, int] | None):
        if after is not None:
            await asyncio.wait_for(waits[after].wait(), timeout=30)
        return await engine.generate(prompt, params, request_id=rid, on_token=counter(rid))

    return list(await asyncio.gather(*[one(*job) for job in jobs]))


def steps_with_two_rows(outs: list[GenerateOutput]) -> int:
    """Decode steps of rows admitted together while two or more were left (the first token comes from the prefill)."""
    return sorted(len(o.token_ids) for o in outs)[-2] - 1


def engines(model, **kwargs) -> tuple[EmbeddedEngine, EmbeddedEngine]:
    return (EmbeddedEngine(model, max_batch_size=8, eos_token_ids=(), **kwargs),
            EmbeddedEngine(model, max_batch_size=8, eos_token_ids=(), share_prefixes=False, **kwargs))


async def test_a_group_decodes_by_cascade_and_samples_as_without_sharing(model):
    prompt = tokens(70, seed=3)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (14, 6, 10)] + [
        SamplingParams(temperature=t, max_new_tokens=n, seed=s, top_p=p, top_k=k)
        for s, (t, n, p, k) in enumerate([(1.0, 12, 1.0, 50), (0.7, 4, 0.9, -1), (1.0, 16, 1.0, 20)])]
    cas, alone = engines(model)
    try:
        jobs = [(prompt, p, f"g{i}", None) for i, p in enumerate(params)]
        out = await staggered(cas, jobs)
        assert_same(out, await staggered(alone, jobs))
        # rows left at 4, 6, 10, 12 and 14 tokens (each leaving row moved the last one into its slot): every step
        # with two rows left went by cascade
        assert cas.stats["cascade_steps"] == steps_with_two_rows(out) and alone.stats["cascade_steps"] == 0
    finally:
        cas.close()
        alone.close()


async def test_rows_joining_mid_decode_and_different_prefixes(model, monkeypatch):
    system, task, other = tokens(40, seed=4), tokens(30, seed=5), tokens(35, seed=12)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    long = SamplingParams(temperature=0.0, max_new_tokens=20)
    jobs = [(system + task, long, "a0", None), (system + task, long, "a1", None),
            (other, SamplingParams(temperature=0.0, max_new_tokens=14), "c0", None),
            (other, SamplingParams(temperature=0.7, max_new_tokens=9, seed=3, top_p=0.9), "c1", None),
            (system + tokens(25, seed=6), SamplingParams(temperature=1.0, max_new_tokens=10, seed=7, top_k=30), "b0",
             ("a0", 3)),  # joins the running a-group with the system prompt only: the group's prefix shrinks to 40
            (system + task + tokens(3, seed=8), greedy, "a2", ("a0", 5)),  # copies all of a0's prompt and more
            (tokens(50, seed=9), greedy, "lone", ("a0", 4))]  # shares nothing: decodes plainly beside the groups
    plans: list = []

    def recording(lens, groups, **kwargs):
        plan = plan_cascade(lens, groups, **kwargs)
        plans.append(plan)
        return plan

    monkeypatch.setattr(embedded, "plan_cascade", recording)
    cas, alone = engines(model)
    try:
        out = await staggered(cas, jobs)
        assert_same(out, await staggered(alone, jobs))
        assert cas.stats["cascade_steps"] == sum(p is not None for p in plans) > 0
        prefixes = {tuple(sorted(p for _, p, _ in plan.groups)) for plan in plans if plan is not None}
        assert (34, 40) in prefixes and (34, 69) in prefixes  # two groups; the a-group before and after b0 joined
        assert any(plan is not None and plan.plain for plan in plans)  # "lone" beside them
    finally:
        cas.close()
        alone.close()


async def test_a_trajectory_next_turn_stays_in_its_group(model):
    """Turn 2 of every sample copies its own parked turn 1, which holds the group's prompt: still one group."""
    prompt = tokens(60, seed=10)
    first = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=s, top_k=40) for s in range(4)]
    cas, alone = engines(model)
    try:
        outs = []
        for engine in (cas, alone):
            one = await staggered(engine, [(prompt, p, f"t{i}", None) for i, p in enumerate(first)])
            steps = engine.stats["cascade_steps"]
            nxt = [(prompt + o.token_ids + tokens(5, seed=20 + i), SamplingParams(temperature=0.0, max_new_tokens=8),
                    f"t{i}", None) for i, o in enumerate(one)]
            outs.append((one, await staggered(engine, nxt), engine.stats["cascade_steps"] - steps))
        (c1, c2, c_steps), (a1, a2, a_steps) = outs
        assert_same(c1, a1)
        assert_same(c2, a2)
        assert c_steps == steps_with_two_rows(c2) > 0 and a_steps == 0
    finally:
        cas.close()
        alone.close()


def test_a_model_switched_to_cascade_forwards_as_with_sdpa_for_everyone_else():
    """A trainer sharing the engine's model (its packed rows: sequences told apart by their positions; padded
    batches: a 2-D mask) gets exactly SDPA's outputs: transformers builds the same masks for both."""
    m = load_model("tiny-qwen3").eval()
    ids = torch.tensor([tokens(9, seed=30) + tokens(7, seed=31)])
    packed = {"input_ids": ids, "position_ids": torch.tensor([list(range(9)) + list(range(7))])}
    padded = {"input_ids": torch.tensor([tokens(6, seed=32), tokens(6, seed=33)]),
              "attention_mask": torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])}
    with torch.no_grad():
        before = [m(**packed, use_cache=False).logits, m(**padded, use_cache=False).logits]
        engine = EmbeddedEngine(m)
        engine.close()
        assert m.config._attn_implementation == CASCADE_ATTENTION
        after = [m(**packed, use_cache=False).logits, m(**padded, use_cache=False).logits]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


async def test_off_switches_leave_the_plain_path(model):
    m = load_model("tiny-qwen3").eval()
    off = EmbeddedEngine(m, share_prefixes=False)
    no_cascade = EmbeddedEngine(m, cascade=False)
    try:
        assert not off.cascade and not no_cascade.cascade
        assert m.config._attn_implementation == "sdpa"  # neither switched the model's attention
        prompt = tokens(40, seed=11)
        await staggered(no_cascade, [(prompt, SamplingParams(temperature=0.0, max_new_tokens=4), f"r{i}", None)
                                     for i in range(3)])
        assert no_cascade.stats["cascade_steps"] == 0 and no_cascade.stats["shared_prompt_tokens"] > 0
    finally:
        off.close()
        no_cascade.close()
    on = EmbeddedEngine(m)
    try:
        assert on.cascade and m.config._attn_implementation == CASCADE_ATTENTION
    finally:
        on.close()
    eager = load_model("tiny-qwen3")
    eager.config._attn_implementation_internal = "eager"
    other = EmbeddedEngine(eager)
    try:  # another attention implementation is left alone, and cascade stays off
        assert not other.cascade and eager.config._attn_implementation == "eager"
    finally:
        other.close()
