"""Shared-prefix reuse in the embedded engine (turnrl.engines.prefix): a group's prompt, the turns before a fork
and a compacted branch's system prompt are prefilled once, and every output equals the no-sharing path's.

"Equal" is what the no-sharing path itself guarantees across batch compositions: the same token ids and logprobs
within float rounding (1e-5 here; the engine's own tests allow 1e-4 between batched and alone). Each comparison
also checks against an independent full forward without any cache.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from test_engine_embedded import assert_logprobs_match, full_logprobs, scramble

from turnrl.engines.embedded import EmbeddedEngine
from turnrl.engines.prefix import Candidate, Parked, ParkedKV, best_source, common_prefix
from turnrl.models import load_model
from turnrl.types import GenerateOutput, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
ATOL = 1e-5


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m = load_model("tiny-qwen3")
    scramble(m, seed=0)
    return m.eval()


@pytest.fixture
def engines(model):
    """make(**kwargs) -> (sharing engine, the same engine with share_prefixes=False)."""
    made: list[EmbeddedEngine] = []

    def make(m: torch.nn.Module = model, **kwargs) -> tuple[EmbeddedEngine, EmbeddedEngine]:
        kwargs = {"max_batch_size": 8, **kwargs}
        made.extend([EmbeddedEngine(m, **kwargs), EmbeddedEngine(m, share_prefixes=False, **kwargs)])
        return made[-2], made[-1]

    yield make
    for e in made:
        e.close()


def tokens(n: int, seed: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


def group_params() -> list[SamplingParams]:
    """Two greedy samples and six seeded ones (temperature 1 and 0.7, top-p, top-k)."""
    sampled = [SamplingParams(temperature=t, max_new_tokens=12, seed=s, top_p=p, top_k=k)
               for s, (t, p, k) in enumerate([(1.0, 1.0, -1), (0.7, 1.0, -1), (1.0, 0.9, -1), (1.0, 1.0, 20)] * 2)]
    return [GREEDY, GREEDY] + sampled[:6]


async def serve(engine: EmbeddedEngine, prompts: list[list[int]], params: list[SamplingParams],
                prefix: str = "g") -> list[GenerateOutput]:
    return await asyncio.gather(*[engine.generate(p, sp, request_id=f"{prefix}{i}")
                                  for i, (p, sp) in enumerate(zip(prompts, params, strict=True))])


def assert_same(shared: list[GenerateOutput], alone: list[GenerateOutput]) -> None:
    for s, a in zip(shared, alone, strict=True):
        assert s.token_ids == a.token_ids
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(a.logprobs), atol=ATOL, rtol=0)
        assert s.finish_reason == a.finish_reason


# ---- the pieces ----------------------------------------------------------------------------------
def test_common_prefix_agrees_with_a_plain_scan():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
        expected = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == common_prefix(b, a) == expected


def test_best_source_takes_the_longest_prefix_and_leaves_a_token_to_prefill():
    prompt = [1, 2, 3, 4, 5]
    short = Candidate("parked", "short", [1, 2, 9], 3)
    whole = Candidate("running", "whole", [1, 2, 3, 4, 5, 6], 4)  # KV for 4 of its tokens only
    same_round = Candidate("round", "round", [1, 2, 3, 4, 5], 5, level=1)
    assert best_source(prompt, [short]).tokens == 2
    assert (best_source(prompt, [short, whole]).key, best_source(prompt, [short, whole]).tokens) == ("whole", 4)
    chosen = best_source(prompt, [short, whole, same_round])
    assert (chosen.key, chosen.tokens, chosen.level) == ("whole", 4, 0)  # 4 either way: the lower level wins
    assert best_source(prompt, [same_round]).tokens == 4  # the last prompt token is always prefilled
    assert best_source(prompt, [Candidate("parked", "x", [7, 1, 2], 3)]) is None
    assert best_source([1], [same_round]) is None


def test_parked_kv_is_bounded_least_recently_used_first():
    store = ParkedKV(max_tokens=10)
    for rid, n in [("a", 4), ("b", 4)]:
        store.park(rid, Parked(rid, list(range(n)), [], n))
    store.touch("a")  # copied from: now the most recently used
    store.park("c", Parked("c", list(range(4)), [], 4))
    assert [rid for rid, _ in store.items()] == ["a", "c"] and store.tokens == 8
    store.park("big", Parked("big", list(range(11)), [], 11))  # larger than the bound: never kept
    assert [rid for rid, _ in store.items()] == ["a", "c"]
    assert store.pop("a") is not None and store.tokens == 4
    store.clear()
    assert len(store) == 0 and store.tokens == 0


# ---- a GRPO group: one prompt, eight samples -----------------------------------------------------
async def test_a_group_prefills_its_prompt_once_and_samples_as_without_sharing(engines, model):
    shared_eng, alone_eng = engines()
    prompt = tokens(60, seed=1)
    params = group_params()
    shared = await serve(shared_eng, [prompt] * 8, params)
    alone = await serve(alone_eng, [prompt] * 8, params)
    assert_same(shared, alone)
    for out in shared[:2]:  # the greedy rows against a full forward (the sampled rows' filters differ per row)
        assert_logprobs_match(out, full_logprobs(model, prompt, out.token_ids))
    assert len({tuple(o.token_ids) for o in shared[2:]}) > 1  # the seeds sample differently
    assert sorted(o.cached_prompt_tokens for o in shared) == [0] + [len(prompt) - 1] * 7
    assert all(o.cached_prompt_tokens == 0 for o in alone)
    assert shared_eng.stats["prefill_tokens"] == len(prompt) + 7
    assert alone_eng.stats["prefill_tokens"] == 8 * len(prompt)
    assert shared_eng.stats["shared_prompt_tokens"] == 7 * (len(prompt) - 1)


async def test_engine_threads_are_its_own_and_change_no_output(engines, model):
    """`threads` sets the intra-op threads of the engine's forwards on its thread alone: the caller's stay, and the
    group samples what it samples at torch's setting."""
    caller = torch.get_num_threads()
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    try:
        one_thread, _ = engines(threads=1)
        prompt = tokens(40, seed=5)
        params = group_params()
        outs = await serve(one_thread, [prompt] * 8, params)
    finally:
        hook.remove()
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == caller
    default, _ = engines()
    assert_same(outs, await serve(default, [prompt] * 8, params))
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        EmbeddedEngine(model, threads=0)


async def test_prompts_sharing_a_system_prompt_copy_only_that(engines, model):
    shared_eng, alone_eng = engines()
    system = tokens(40, seed=2)
    prompts = [system + tokens(5 + 3 * i, seed=10 + i) for i in range(4)]
    params = [GREEDY] * 4
    shared = await serve(shared_eng, prompts, params)
    assert_same(shared, await serve(alone_eng, prompts, params))
    assert sorted(o.cached_prompt_tokens for o in shared) == [0, 40, 40, 40]
    for prompt, out in zip(prompts, shared, strict=True):
        assert_logprobs_match(out, full_logprobs(model, prompt, out.token_ids))


# ---- forks, running requests, compaction ---------------------------------------------------------
async def test_a_fork_copies_its_parents_turns_from_the_parked_kv(engines, model):
    shared_eng, alone_eng = engines()
    prompt = tokens(30, seed=3)
    outs = []
    for eng in (shared_eng, alone_eng):
        parent = await eng.generate(prompt, GREEDY, request_id="parent")
        # the fork keeps the parent's prompt and first 5 output tokens, then a different observation
        fork_prompt = prompt + parent.token_ids[:5] + tokens(6, seed=4)
        outs.append((parent, await eng.generate(fork_prompt, GREEDY, request_id="parent/fork")))
    (parent, fork), (_, fork_alone) = outs
    assert_same([fork], [fork_alone])
    assert fork.cached_prompt_tokens == len(prompt) + 5 and fork_alone.cached_prompt_tokens == 0
    assert_logprobs_match(fork, full_logprobs(model, prompt + parent.token_ids[:5] + tokens(6, seed=4),
                                              fork.token_ids))
    # the parent's entry stays for the parent's own next turn (only a request's own turn consumes it)
    nxt = await shared_eng.generate(prompt + parent.token_ids + [7], GREEDY, request_id="parent")
    assert nxt.cached_prompt_tokens == len(prompt) + len(parent.token_ids) - 1


async def test_a_request_copies_from_a_running_one(engines, model):
    shared_eng, alone_eng = engines()
    prompt = tokens(50, seed=5)
    long = SamplingParams(temperature=0.0, max_new_tokens=40)
    results = []
    for eng in (shared_eng, alone_eng):
        seen: list[int] = []
        started = asyncio.Event()

        def on_token(t: int, seen=seen, started=started) -> None:
            seen.append(t)
            if len(seen) == 6:
                started.set()

        first = asyncio.ensure_future(eng.generate(prompt, long, request_id="first", on_token=on_token))
        await asyncio.wait_for(started.wait(), 60)
        branch = prompt + seen[:4] + tokens(3, seed=6)  # shares the prompt and 4 sampled tokens
        second = await eng.generate(branch, GREEDY, request_id="second")
        results.append((await first, second, branch))
    (first, second, branch), (first_alone, second_alone, _) = results
    assert_same([first, second], [first_alone, second_alone])
    assert second.cached_prompt_tokens == len(prompt) + 4 and second_alone.cached_prompt_tokens == 0
    assert_logprobs_match(second, full_logprobs(model, branch, second.token_ids))


async def test_a_compacted_branch_reuses_the_system_prompt_of_the_history_it_replaces(engines, model):
    shared_eng, _ = engines()
    system, task = tokens(30, seed=7), tokens(10, seed=8)
    history = system + task + tokens(50, seed=9)
    await shared_eng.generate(history, GREEDY, request_id="ep")
    compacted = system + task + tokens(8, seed=11)  # system prompt, task, summary
    out = await shared_eng.generate(compacted, GREEDY, request_id="ep/compaction")
    assert out.cached_prompt_tokens == 40
    assert_logprobs_match(out, full_logprobs(model, compacted, out.token_ids))


async def test_a_group_through_the_turn_loop_counts_its_shared_prompt_in_the_rollout_metric(model, qwen3_tokenizer):
    """run_groups with n=4 on the real engine: the group's prompt is prefilled once (rollout/cached_prompt_tokens),
    and the trajectories are those of the no-sharing engine."""
    from test_rollout import FeedbackEnv, _manager

    from turnrl.observe.stats import RolloutStats
    from turnrl.rollout import run_groups

    row = {"id": "r", "prompt": "You are a careful solver. " * 20 + "What is 2+2?"}
    # a random model rarely ends its turn: every token id stops one, so each turn is one sampled token. Greedy:
    # a seeded draw from this model's near-flat 152k-token distribution flips on float rounding (turn 3 of 12
    # draws did once), with or without sharing, as it does between two batch compositions without it
    sampling = SamplingParams(temperature=0.0, stop_token_ids=tuple(range(151936)))
    groups = {}
    for share in (True, False):
        engine = EmbeddedEngine(model, max_batch_size=4, share_prefixes=share)
        try:
            manager = _manager(engine, qwen3_tokenizer, lambda s, c: FeedbackEnv(answer="never-said"), concurrency=4)
            [groups[share]] = await run_groups(manager, [row], n=4, sampling=sampling)
        finally:
            engine.close()
    shared, alone = groups[True], groups[False]
    assert [t.response_ids for t in shared] == [t.response_ids for t in alone]
    prompt_len = len(shared[0].prompt_ids)
    first = sorted(t.turns[0].generate.cached_prompt_tokens for t in shared)
    assert first == [0] + [prompt_len - 1] * 3 and all(t.turns[0].generate.cached_prompt_tokens == 0 for t in alone)
    summary = {share: RolloutStats() for share in groups}
    for share, group in groups.items():
        for t in group:
            summary[share].add(t)
    gained = (summary[True].summary()["rollout/cached_prompt_tokens"]
              - summary[False].summary()["rollout/cached_prompt_tokens"])
    assert gained >= 3 * (prompt_len - 1)  # later turns reuse their own trajectory's KV either way


# ---- what is never copied ------------------------------------------------------------------------
async def test_kv_from_replaced_weights_is_never_copied(engines, model):
    import copy

    shared_eng, _ = engines(copy.deepcopy(model))
    prompt = tokens(30, seed=12)
    await shared_eng.generate(prompt, GREEDY, request_id="before")
    perturbed = copy.deepcopy(model)
    scramble(perturbed, seed=1, noise=0.1, logit_scale=1.0)
    await shared_eng.update_weights(perturbed.state_dict())
    out = await shared_eng.generate(prompt + [5], GREEDY, request_id="after")
    assert out.cached_prompt_tokens == 0
    assert_logprobs_match(out, full_logprobs(perturbed, prompt + [5], out.token_ids))


async def test_parked_kv_stays_within_prefix_cache_tokens(engines):
    shared_eng, _ = engines(prefix_cache_tokens=100)
    a, b = tokens(40, seed=13), tokens(40, seed=14)
    await shared_eng.generate(a, GREEDY, request_id="a")  # parks its prompt and 11 of its 12 output tokens
    await shared_eng.generate(b, GREEDY, request_id="b")  # 51 more: over 100, "a" (least recently used) goes
    assert shared_eng._parked.tokens <= 100
    assert (await shared_eng.generate(b + [3], GREEDY, request_id="y")).cached_prompt_tokens == 40
    assert (await shared_eng.generate(a + [3], GREEDY, request_id="x")).cached_prompt_tokens == 0


async def test_a_source_whose_prefill_fails_leaves_its_group_to_prefill_alone(engines, model, monkeypatch):
    shared_eng, _ = engines()
    prompt = tokens(30, seed=15)
    real_prefill = EmbeddedEngine._prefill

    def failing(self, group):
        if any(req.request_id == "g0" for req, _ in group):
            raise RuntimeError("injected prefill failure")
        return real_prefill(self, group)

    monkeypatch.setattr(EmbeddedEngine, "_prefill", failing)
    outs = await asyncio.gather(*[shared_eng.generate(prompt, GREEDY, request_id=f"g{i}") for i in range(3)],
                                return_exceptions=True)
    assert isinstance(outs[0], Exception) and "injected" in str(outs[0])
    for out in outs[1:]:
        assert isinstance(out, GenerateOutput)
        assert_logprobs_match(out, full_logprobs(model, prompt, out.token_ids))
    # g1 copies nothing (g0 failed); g2 copies g1 when it came a step later, else it prefills whole as g1 does
    assert outs[1].cached_prompt_tokens == 0 and outs[2].cached_prompt_tokens in (0, len(prompt) - 1)


async def test_routing_and_vlm_engines_reuse_only_their_own_trajectory():
    """Recorded MoE routing of a copied prefix would be another request's; image tokens of different images share
    their ids. Both keep the per-trajectory reuse only."""
    from turnrl.models import resolve_model
    from turnrl.multimodal import build_processor

    moe = EmbeddedEngine(load_model("tiny-qwen3-moe"), max_batch_size=4, record_routing=True)
    vlm = EmbeddedEngine(load_model("tiny-qwen3-vl"), max_batch_size=2,
                         image_processor=build_processor(resolve_model("tiny-qwen3-vl")).image_processor)
    try:
        assert not moe.share_prefixes and not vlm.share_prefixes
        prompt = tokens(20, seed=16)
        outs = await serve(moe, [prompt] * 3, [GREEDY] * 3)
        assert [o.cached_prompt_tokens for o in outs] == [0, 0, 0]
        assert all(o.routed_start == 0 and len(o.routed_experts) == len(prompt) + 11 for o in outs)
        nxt = await moe.generate(prompt + outs[0].token_ids + [5], GREEDY, request_id="g0")
        assert nxt.cached_prompt_tokens == len(prompt) + 11  # its own trajectory's turn
    finally:
        moe.close()
        vlm.close()


# ---- the real SmolLM2 ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2() -> torch.nn.Module:
    return load_model("smollm2-135m-instruct").eval()


@pytest.mark.slow  # ~30 s on a loaded 2-core CPU
async def test_smollm2_group_with_a_shared_prompt_equals_the_no_sharing_path(engines, smollm2, smol_tokenizer):
    shared_eng, alone_eng = engines(smollm2)
    messages = [{"role": "system", "content": "You are a careful assistant. Use the calculator tool for arithmetic."},
                {"role": "user", "content": "A train leaves at 3 pm and travels 120 km at 80 km/h. When does it "
                                            "arrive? Explain step by step."}]
    prompt = smol_tokenizer.encode(smol_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=False), add_special_tokens=False)
    params = group_params()
    shared = await serve(shared_eng, [prompt] * 8, params)
    alone = await serve(alone_eng, [prompt] * 8, params)
    assert_same(shared, alone)
    assert sorted(o.cached_prompt_tokens for o in shared) == [0] + [len(prompt) - 1] * 7
    for out in shared[:2]:
        assert_logprobs_match(out, full_logprobs(smollm2, prompt, out.token_ids))
    # a second turn of one sample and a fork of another, against the no-sharing engine
    turn2 = [prompt + shared[2].token_ids + smol_tokenizer.encode("\nThe tool says 1.5 hours.\n"),
             prompt + shared[3].token_ids[:4] + smol_tokenizer.encode(" Let me think again.")]
    ids = ["g2", "g3/fork"]
    second = await asyncio.gather(*[shared_eng.generate(p, GREEDY, request_id=i) for p, i in zip(turn2, ids, strict=True)])
    second_alone = await asyncio.gather(*[alone_eng.generate(p, GREEDY, request_id=i)
                                          for p, i in zip(turn2, ids, strict=True)])
    assert_same(second, second_alone)
    assert second[0].cached_prompt_tokens == len(prompt) + len(shared[2].token_ids) - 1
    assert second[1].cached_prompt_tokens == len(prompt) + 4 and second_alone[1].cached_prompt_tokens == 0
