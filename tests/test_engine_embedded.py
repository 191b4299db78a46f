"""The embedded engine on a real (tiny) Qwen3: token-exact against `generate` and full forwards.

Every expected value comes from an independent computation on the same weights: `model.generate`, or a
full forward over prompt + output without any cache (no slab, no masks, no batching). The random-init
tiny-qwen3 only echoes its last token and has a near-uniform next-token distribution, which would make
token comparisons vacuous, so the module's model is a copy with its weights scrambled (deterministic seed)
and its logits sharpened.
"""

from __future__ import annotations

import asyncio
import copy
import math
import time

import pytest
import torch

from turnrl.engines.base import EngineError, InvalidRequest
from turnrl.engines.embedded import EmbeddedEngine, sample_tokens
from turnrl.models import load_model
from turnrl.types import FinishReason, GenerateOutput, SamplingParams

MAX_BATCH = 4
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
TEXTS = ["hi", "What is 2+2? Explain in detail please.", "The quick brown fox jumps over the lazy dog " * 5,
         "Once upon a time"]


def scramble(model: torch.nn.Module, seed: int, noise: float = 0.3, logit_scale: float = 30.0) -> None:
    """Add noise to every matrix but the embedding and scale the final norm (logit std ~0.1 -> ~3)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.add_(torch.randn(p.shape, generator=g) * noise)
        model.model.norm.weight.mul_(logit_scale)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m = load_model("tiny-qwen3")
    scramble(m, seed=0)
    return m.eval()


@pytest.fixture(scope="module")
def prompts(qwen3_tokenizer) -> list[list[int]]:
    ids = [qwen3_tokenizer.encode(t) for t in TEXTS]
    assert sorted(len(p) for p in ids) == [1, 4, 12, 46]  # lengths differ, one is a single token
    return ids


@pytest.fixture(scope="module")
def engine(model):
    eng = EmbeddedEngine(model, max_batch_size=MAX_BATCH)
    yield eng
    eng.close()


@pytest.fixture
def fresh_engine(model):
    """An engine of its own (empty prefix cache, fresh stats) over the module's model."""
    engines: list[EmbeddedEngine] = []

    def make(m: torch.nn.Module = model, **kwargs) -> EmbeddedEngine:
        engines.append(EmbeddedEngine(m, **{"max_batch_size": MAX_BATCH, **kwargs}))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


# ---- independent references ----------------------------------------------------------------------
@torch.no_grad()
def full_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Logits [len(output), V] predicting each output token, from one uncached forward."""
    ids = torch.tensor([prompt + output])
    return model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()


def full_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    logp_T_V = (full_logits(model, prompt, output) / temperature).log_softmax(-1)
    return logp_T_V.gather(1, torch.tensor(output)[:, None])[:, 0]


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by repeated full forwards (no KV cache at all)."""
    out: list[int] = []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([prompt + out]), use_cache=False).logits[0, -1]
        out.append(int(logits.argmax()))
    return out


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    seq = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
        max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
    )
    return seq[0, len(prompt):].tolist()


def assert_logprobs_match(out: GenerateOutput, expected: torch.Tensor, atol: float = 1e-4) -> None:
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=atol, rtol=0)


async def serve_all(engine, prompts, params, prefix="r") -> list[GenerateOutput]:
    return await asyncio.gather(
        *[engine.generate(p, params, request_id=f"{prefix}{i}") for i, p in enumerate(prompts)]
    )


# ---- greedy parity and batching --------------------------------------------------------------------
async def test_greedy_batched_equals_hf_generate(engine, model, prompts):
    steps_before = engine.stats["decode_steps"]
    outs = await serve_all(engine, prompts, GREEDY)
    steps = engine.stats["decode_steps"] - steps_before

    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(model, prompt, 16)
        assert out.finish_reason == FinishReason.LENGTH
        # greedy logprobs are those of the unscaled distribution
        assert_logprobs_match(out, full_logprobs(model, prompt, out.token_ids))
    assert len({tuple(o.token_ids) for o in outs}) == len(outs)  # the scrambled model is not degenerate
    # 4 x 16 tokens: the first token of each comes from its prefill, the rest from shared decode steps.
    # Served one by one that is 60 steps; batched it is 15 plus a few while requests trickle in.
    assert steps < 30, f"{steps} decode steps for {len(prompts)} x 16 tokens: requests were not batched"


async def test_sampled_logprobs_match_full_forward_at_temperature_1_and_0_7(engine, model, prompts):
    for temperature in (1.0, 0.7):
        params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=7)
        outs = await serve_all(engine, prompts, params)
        for prompt, out in zip(prompts, outs, strict=True):
            assert len(out.token_ids) == 12
            assert_logprobs_match(out, full_logprobs(model, prompt, out.token_ids, temperature))


def nucleus_logprob(logits_V: torch.Tensor, token: int, temperature: float, top_p: float) -> float:
    """By hand: the smallest set of most likely tokens whose mass reaches top_p, renormalised."""
    probs = (logits_V / temperature).softmax(-1).double()
    order = probs.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    for t in order:
        kept.append(t)
        mass += float(probs[t])
        if mass >= top_p:
            break
    assert token in kept, "sampled a token outside the nucleus"
    return float(torch.log(probs[token] / mass))


async def test_top_p_logprob_is_that_of_the_renormalised_nucleus(engine, model, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.3, max_new_tokens=4, seed=3)
    for prompt in prompts[:2]:
        out = await engine.generate(prompt, params, request_id="top-p")
        logits_T_V = full_logits(model, prompt, out.token_ids)
        for step in range(len(out.token_ids)):
            expected = nucleus_logprob(logits_T_V[step], out.token_ids[step], 0.8, 0.3)
            assert out.logprobs[step] == pytest.approx(expected, abs=1e-4)
            # the nucleus made it more likely than under the plain tempered distribution
            assert expected > float((logits_T_V[step] / 0.8).log_softmax(-1)[out.token_ids[step]])


async def test_top_k_logprob_is_renormalised_over_the_k_best(engine, model, prompts):
    out = await engine.generate(prompts[1], SamplingParams(top_k=5, max_new_tokens=6, seed=1), request_id="k")
    logits_T_V = full_logits(model, prompts[1], out.token_ids)
    top_T_K = logits_T_V.topk(5, -1)
    for step, token in enumerate(out.token_ids):
        assert token in top_T_K.indices[step].tolist()
        expected = logits_T_V[step, token] - top_T_K.values[step].logsumexp(-1)
        assert out.logprobs[step] == pytest.approx(float(expected), abs=1e-4)


def test_sampler_frequencies_follow_the_distribution():
    # probabilities 0.5, 0.3, 0.15, 0.05 and two excluded tokens: one by -inf, one by top_k=4
    logits_V = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.01]).log()
    n = 40_000
    tokens_N, logp_N, kept_N = sample_tokens(
        logits_V.expand(n, -1), [SamplingParams(top_k=4)] * n, [None] * n, torch.Generator().manual_seed(0)
    )
    assert kept_N.tolist() == [4] * n  # the kept set: the 4 most likely tokens
    freq = torch.bincount(tokens_N, minlength=6).float() / n
    # binomial standard deviation is at most sqrt(0.25 / 40000) = 0.0025; allow four of them
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.0]), atol=0.01, rtol=0)
    # renormalised over the 4 kept tokens: log(p / (0.5 + 0.3 + 0.15 + 0.05)), the 0.01 token is cut
    torch.testing.assert_close(logp_N, logits_V[tokens_N] - math.log(0.5 + 0.3 + 0.15 + 0.05), atol=1e-5, rtol=0)


# ---- stopping ----------------------------------------------------------------------------------------
async def test_stop_token_ends_the_output_and_is_included(engine, model, prompts):
    reference = greedy_reference(model, prompts[1], 16)
    stop = reference[5]
    first = reference.index(stop)  # the stop token may already occur earlier
    out = await engine.generate(
        prompts[1], SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(stop,)), request_id="s"
    )
    assert out.token_ids == reference[: first + 1]
    assert out.finish_reason == FinishReason.STOP
    assert len(out.logprobs) == first + 1


async def test_max_new_tokens_ends_with_length(engine, prompts):
    outs = await asyncio.gather(
        *[engine.generate(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=n), request_id=f"m{n}")
          for n in (1, 3, 9)]
    )
    assert [len(o.token_ids) for o in outs] == [1, 3, 9]
    assert all(o.finish_reason == FinishReason.LENGTH for o in outs)
    assert outs[2].token_ids[:3] == outs[1].token_ids  # greedy: shorter runs are prefixes


async def test_engine_eos_token_ids_stop(fresh_engine, model, prompts):
    reference = greedy_reference(model, prompts[0], 6)
    eng = fresh_engine(eos_token_ids=[reference[3]])
    out = await eng.generate(prompts[0], GREEDY, request_id="eos")
    assert out.token_ids == reference[: reference.index(reference[3]) + 1]
    assert out.finish_reason == FinishReason.STOP


# ---- seeded sampling -----------------------------------------------------------------------------
async def test_seeded_sampling_is_independent_of_the_batch(engine, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=1234)
    alone = await engine.generate(prompts[1], params, request_id="alone")
    crowd = await asyncio.gather(
        engine.generate(prompts[2], SamplingParams(max_new_tokens=20), request_id="other0"),  # engine RNG
        engine.generate(prompts[1], params, request_id="crowded"),
        engine.generate(prompts[0], SamplingParams(max_new_tokens=5, seed=99), request_id="other1"),
        engine.generate(prompts[3], SamplingParams(max_new_tokens=15), request_id="other2"),
    )
    assert crowd[1].token_ids == alone.token_ids
    assert crowd[1].logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    other_seed = await engine.generate(prompts[1], SamplingParams(max_new_tokens=12, seed=4321), request_id="o")
    assert other_seed.token_ids != alone.token_ids


# ---- per-trajectory prefix reuse -----------------------------------------------------------------
async def test_prefix_reuse_is_exact_and_released(fresh_engine, model, prompts, qwen3_tokenizer):
    """A trajectory's own parked KV (share_prefixes off: no other request's KV is copied; tests/test_engine_prefix.py
    covers sharing)."""
    engine = fresh_engine(share_prefixes=False)
    observation = qwen3_tokenizer.encode("\nObservation: the tool says 42.\n")
    turn1 = await engine.generate(prompts[1], GREEDY, request_id="traj")
    await engine.generate(prompts[2], GREEDY, request_id="in-between")  # overwrites the slot turn 1 used
    prompt2 = prompts[1] + turn1.token_ids + observation
    turn2 = await engine.generate(prompt2, GREEDY, request_id="traj")

    # KV exists for the prompt and every output token but the last sampled one
    assert turn2.cached_prompt_tokens == len(prompts[1]) + len(turn1.token_ids) - 1
    uncached = await fresh_engine().generate(prompt2, GREEDY, request_id="traj")
    assert uncached.cached_prompt_tokens == 0
    assert turn2.token_ids == uncached.token_ids == greedy_reference(model, prompt2, 16)
    assert turn2.logprobs == pytest.approx(uncached.logprobs, abs=1e-4)
    assert_logprobs_match(turn2, full_logprobs(model, prompt2, turn2.token_ids))

    await engine.release("traj")
    prompt3 = prompt2 + turn2.token_ids + observation
    turn3 = await engine.generate(prompt3, GREEDY, request_id="traj")
    assert turn3.cached_prompt_tokens == 0

    diverged = list(prompt3)
    diverged[len(prompts[1])] = (diverged[len(prompts[1])] + 1) % 1000  # differs inside the parked tokens
    turn4 = await engine.generate(diverged + observation, GREEDY, request_id="traj")
    assert turn4.cached_prompt_tokens == 0
    assert turn4.token_ids == greedy_reference(model, diverged + observation, 16)


async def test_prefix_is_reused_across_request_ids_only_when_sharing(fresh_engine, prompts):
    for share, expected in ((False, 0), (True, len(prompts[3]) + 15)):
        engine = fresh_engine(share_prefixes=share)
        first = await engine.generate(prompts[3], GREEDY, request_id="traj-a")
        other = await engine.generate(prompts[3] + first.token_ids, GREEDY, request_id="traj-b")
        assert other.cached_prompt_tokens == expected


# ---- weight updates ------------------------------------------------------------------------------
async def test_update_weights_serves_the_new_policy(fresh_engine, model, prompts):
    served = copy.deepcopy(model)
    eng = fresh_engine(served)
    before = await eng.generate(prompts[1], GREEDY, request_id="traj")
    assert before.policy_version == 0

    perturbed = copy.deepcopy(model)
    scramble(perturbed, seed=1, noise=0.1, logit_scale=1.0)
    assert await eng.update_weights(perturbed.state_dict()) == 1  # tied lm_head.weight included

    outs = await serve_all(eng, prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(perturbed, prompt, 16)
        assert_logprobs_match(out, full_logprobs(perturbed, prompt, out.token_ids))
        assert out.policy_version == 1
    assert outs[1].token_ids != before.token_ids
    # KV parked before the update was computed by the old weights: it must not be reused (the prompt KV of "r1",
    # computed by the new weights, is)
    again = await eng.generate(prompts[1] + before.token_ids, GREEDY, request_id="traj")
    assert again.cached_prompt_tokens == len(prompts[1])
    assert again.token_ids == hf_greedy(perturbed, prompts[1] + before.token_ids, 16)

    assert await eng.update_weights(perturbed.named_parameters(), version=7) == 7
    out = await eng.generate(prompts[0], GREEDY, request_id="v7")
    assert out.policy_version == 7


async def test_a_streamed_update_holds_generation_until_the_final_bucket(fresh_engine, model, prompts):
    eng = fresh_engine(copy.deepcopy(model))
    perturbed = copy.deepcopy(model)
    scramble(perturbed, seed=2, noise=0.1, logit_scale=1.0)
    params = list(perturbed.named_parameters())
    half = len(params) // 2
    assert await eng.update_weights(params[:half], version=5, final=False) == 0  # not the new version yet
    waiting = asyncio.ensure_future(eng.generate(prompts[0], GREEDY, request_id="during"))
    await asyncio.sleep(0.5)
    assert not waiting.done()  # no token from half-updated weights
    assert await eng.update_weights(params[half:], version=5, final=True) == 5
    out = await waiting
    assert out.policy_version == 5 and out.token_ids == hf_greedy(perturbed, prompts[0], 16)
    assert_logprobs_match(out, full_logprobs(perturbed, prompts[0], out.token_ids))


async def test_update_weights_rejects_bad_tensors_and_changes_nothing(fresh_engine, model, prompts):
    eng = fresh_engine(copy.deepcopy(model))
    before = await eng.generate(prompts[1], GREEDY, request_id="a")
    state = {k: v + 1.0 for k, v in model.state_dict().items()}

    with pytest.raises(EngineError, match=r"unknown parameter names.*model\.nope\.weight"):
        await eng.update_weights({**state, "model.nope.weight": torch.zeros(3)})
    bad_shape = {**state, "model.norm.weight": torch.zeros(7)}
    with pytest.raises(EngineError, match=r"model\.norm\.weight has shape \(7,\), expected \(32,\)"):
        await eng.update_weights(bad_shape)

    after = await eng.generate(prompts[1], GREEDY, request_id="b")
    assert after.cached_prompt_tokens == len(prompts[1]) - 1  # "a"'s KV survived: the weights did not change
    assert after.token_ids == before.token_ids and after.logprobs == pytest.approx(before.logprobs, abs=1e-5)
    assert after.policy_version == 0


# ---- scheduling: queueing, cancellation, failures ----------------------------------------------------
async def test_more_requests_than_slots_all_complete(engine, model, prompts, qwen3_tokenizer):
    many = prompts + [qwen3_tokenizer.encode(f"Request number {i} asks something else.") for i in range(7)]
    lengths = [3 + (i % 5) * 3 for i in range(len(many))]  # rows finish at different steps
    outs = await asyncio.gather(
        *[engine.generate(p, SamplingParams(temperature=0.0, max_new_tokens=n), request_id=f"q{i}")
          for i, (p, n) in enumerate(zip(many, lengths, strict=True))]
    )
    assert len(many) > 2 * MAX_BATCH
    for prompt, n, out in zip(many, lengths, outs, strict=True):
        assert out.token_ids == greedy_reference(model, prompt, n)
        assert_logprobs_match(out, full_logprobs(model, prompt, out.token_ids))


async def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_cancelling_frees_the_slot(fresh_engine, model, prompts):
    eng = fresh_engine()
    long = SamplingParams(temperature=0.0, max_new_tokens=4000)
    hogs = [asyncio.create_task(eng.generate(prompts[0], long, request_id=f"hog{i}")) for i in range(MAX_BATCH - 1)]
    neighbour = asyncio.create_task(eng.generate(prompts[1], GREEDY, request_id="neighbour"))
    queued = asyncio.create_task(eng.generate(prompts[0], long, request_id="queued"))  # no slot left
    await wait_for(lambda: eng.stats["requests"] == MAX_BATCH)
    for t in [*hogs, queued]:
        t.cancel()
    await asyncio.gather(*hogs, queued, return_exceptions=True)
    assert all(t.cancelled() for t in [*hogs, queued])
    steps_at_cancel = eng.stats["decode_steps"]

    assert (await neighbour).token_ids == greedy_reference(model, prompts[1], 16)
    out = await eng.generate(prompts[2], GREEDY, request_id="after")
    assert out.token_ids == greedy_reference(model, prompts[2], 16)
    # the hogs were dropped at once: had they kept their slots, "after" would have waited ~4000 steps
    assert eng.stats["decode_steps"] - steps_at_cancel < 40
    assert eng.stats["requests"] == MAX_BATCH + 1  # the cancelled queued request was never prefilled
    generated = eng.stats["generated_tokens"]
    await asyncio.sleep(0.05)
    assert eng.stats["generated_tokens"] == generated  # nothing is decoding any more


async def test_a_failing_step_fails_its_requests_and_the_engine_recovers(fresh_engine, model, prompts, monkeypatch):
    eng = fresh_engine()
    original = model.forward
    failures = []

    def forward_failing_once_on_a_batch(*args, **kwargs):
        rows, queries = kwargs["input_ids"].shape
        if not failures and rows > 1 and queries == 1:  # a decode step of several rows
            failures.append(rows)
            raise RuntimeError("simulated kernel failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward_failing_once_on_a_batch)
    results = await asyncio.gather(
        *[eng.generate(p, GREEDY, request_id=f"f{i}") for i, p in enumerate(prompts)], return_exceptions=True
    )
    failed = [r for r in results if isinstance(r, EngineError)]
    # every row of the broken decode step failed, and only those
    assert failures and len(failed) == failures[0] >= 2
    assert all("simulated kernel failure" in str(e) for e in failed)
    for prompt, result in zip(prompts, results, strict=True):
        if not isinstance(result, EngineError):
            assert result.token_ids == greedy_reference(model, prompt, 16)

    outs = await serve_all(eng, prompts, GREEDY, prefix="later")
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == greedy_reference(model, prompt, 16)


async def test_close_fails_every_pending_call(fresh_engine, model, prompts, monkeypatch):
    eng = fresh_engine()
    original = model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.2)
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", slow_forward)
    running = asyncio.create_task(eng.generate(prompts[0], GREEDY, request_id="running"))
    await wait_for(lambda: eng.stats["requests"] == 1)  # the thread is inside a step now
    # still in the inbox when the engine closes: neither must wait forever
    submitted = asyncio.create_task(eng.generate(prompts[1], GREEDY, request_id="submitted"))
    command = asyncio.create_task(eng.release("running"))
    await asyncio.sleep(0.01)
    eng.close()
    for task in (running, submitted, command):
        with pytest.raises(EngineError, match="engine closed"):
            await asyncio.wait_for(task, timeout=5)
    with pytest.raises(EngineError, match="engine is closed"):
        await eng.generate(prompts[0], GREEDY, request_id="late")


async def test_rejects_images_empty_and_too_long_prompts(fresh_engine):
    eng = fresh_engine(max_context=32)
    with pytest.raises(EngineError, match="images"):
        await eng.generate([1, 2], GREEDY, request_id="i", images=["x.png"])
    with pytest.raises(EngineError, match="empty prompt"):
        await eng.generate([], GREEDY, request_id="e")
    with pytest.raises(EngineError, match="holds 40 tokens, which do not fit the context of 32"):
        await eng.generate(list(range(40)), GREEDY, request_id="l")
    out = await eng.generate(list(range(1, 29)), SamplingParams(temperature=0.0, max_new_tokens=100), request_id="c")
    assert len(out.token_ids) == 4 and out.finish_reason == FinishReason.LENGTH  # capped by the context


async def test_batched_prefill_mixes_cached_and_fresh_requests_exactly(model, prompts, qwen3_tokenizer):
    """Waiting requests are prefilled together (left-padded, one forward): second turns that reuse their
    trajectory's KV and a fresh first turn in one group give exactly what one-at-a-time serving gives."""
    batched = EmbeddedEngine(model, max_batch_size=MAX_BATCH)
    alone = EmbeddedEngine(model, max_batch_size=1)
    observation = qwen3_tokenizer.encode(" Now tell me more about it, briefly.")
    try:
        results = []
        for eng in (batched, alone):
            first = await serve_all(eng, prompts[:2], GREEDY, prefix="t")
            second_prompts = [p + o.token_ids + observation for p, o in zip(prompts[:2], first, strict=True)]
            tasks = [eng.generate(p, GREEDY, request_id=f"t{k}") for k, p in enumerate(second_prompts)]
            tasks.append(eng.generate(prompts[2], GREEDY, request_id="fresh"))
            results.append((first, await asyncio.gather(*tasks)))
        (first_b, second_b), (first_a, second_a) = results
        assert [o.token_ids for o in first_b] == [o.token_ids for o in first_a]
        assert [o.token_ids for o in second_b] == [o.token_ids for o in second_a]
        for b, a in zip(second_b, second_a, strict=True):
            assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4)
        assert [o.cached_prompt_tokens > 0 for o in second_b] == [True, True, False]
        assert batched.stats["requests"] == 5 and batched.stats["prefill_forwards"] <= 5
    finally:
        batched.close()
        alone.close()


def _unchecked(**fields) -> SamplingParams:
    """SamplingParams holding what a server could pass through unchecked (its own checks bypassed)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


async def test_a_bad_request_fails_alone_and_never_joins_a_batch(fresh_engine, model, prompts):
    eng = fresh_engine(max_batch_size=16)
    vocab = model.get_input_embeddings().num_embeddings
    bad = {  # each would break the step it joined (embedding lookup, sampling, generator), failing its neighbours
        "out of vocabulary": ([*prompts[1], vocab], GREEDY, "prompt_ids"),
        "negative id": ([-1, *prompts[1]], GREEDY, "prompt_ids"),
        "boolean id": ([True, *prompts[1]], GREEDY, "prompt_ids"),
        "empty prompt": ([], GREEDY, "prompt_ids"),
        "longer than the context": ([1] * eng.max_context, GREEDY, "prompt_ids"),
        "top_k 'x'": (prompts[1], _unchecked(top_k="x"), "sampling.top_k"),
        "NaN temperature": (prompts[1], _unchecked(temperature=float("nan")), "sampling.temperature"),
        "string max_new_tokens": (prompts[1], _unchecked(max_new_tokens="5"), "sampling.max_new_tokens"),
        "seed 'x'": (prompts[1], _unchecked(seed="x"), "sampling.seed"),
        "stop_token_ids 5": (prompts[1], _unchecked(stop_token_ids=5), "sampling.stop_token_ids"),
        "stop id out of vocabulary": (prompts[1], _unchecked(stop_token_ids=(vocab,)), "sampling.stop_token_ids"),
    }
    good = [eng.generate(p, GREEDY, request_id=f"good{i}") for i, p in enumerate(prompts)]
    bad_calls = [eng.generate(ids, params, request_id=name) for name, (ids, params, _) in bad.items()]
    results = await asyncio.gather(*good, *bad_calls, return_exceptions=True)
    for prompt, out in zip(prompts, results[: len(prompts)], strict=True):
        assert isinstance(out, GenerateOutput) and out.token_ids == greedy_reference(model, prompt, 16)
    for (name, (_, _, param)), error in zip(bad.items(), results[len(prompts):], strict=True):
        assert isinstance(error, InvalidRequest), (name, error)
        assert error.param == param and repr(name) in str(error), (name, str(error))
    assert eng.stats["requests"] == len(prompts)  # no bad request was ever prefilled


async def test_a_failing_batched_prefill_retries_its_requests_alone(fresh_engine, model, prompts, monkeypatch):
    eng = fresh_engine()
    original = model.forward
    poison = prompts[2][3]  # a token only prompt 2 holds: its prefill fails, alone or grouped

    def forward(*args, **kwargs):
        if kwargs["input_ids"].shape[1] > 1 and (kwargs["input_ids"] == poison).any():
            raise RuntimeError("this prompt cannot be prefilled")
        return original(*args, **kwargs)

    assert all(poison not in p for i, p in enumerate(prompts) if i != 2)
    monkeypatch.setattr(model, "forward", forward)
    results = await asyncio.gather(*[eng.generate(p, GREEDY, request_id=f"p{i}") for i, p in enumerate(prompts)],
                                   return_exceptions=True)
    assert isinstance(results[2], EngineError) and "cannot be prefilled" in str(results[2])
    for i, (prompt, out) in enumerate(zip(prompts, results, strict=True)):
        if i != 2:
            assert out.token_ids == greedy_reference(model, prompt, 16)


async def test_on_token_streams_every_token_before_the_call_returns(engine, prompts):
    streamed: list[int] = []
    params = SamplingParams(max_new_tokens=12, seed=3)
    out = await engine.generate(prompts[1], params, request_id="stream", on_token=streamed.append)
    assert streamed == out.token_ids and len(streamed) == 12


@pytest.mark.parametrize("pause", ["keep", "wait", "abort"])
async def test_pause_modes_at_a_weight_update(fresh_engine, model, prompts, pause):
    """A long request is running when new weights arrive: keep goes on in place (its later tokens from the new
    weights), wait finishes it on the old weights first, abort returns its tokens so far as preempted."""
    engine = fresh_engine(copy.deepcopy(model))
    new = copy.deepcopy(model)
    scramble(new, seed=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=120, seed=3)
    prompt = prompts[2]
    task = asyncio.create_task(engine.generate(prompt, params, request_id="long"))
    while engine.stats["generated_tokens"] < 5:  # a few tokens in
        await asyncio.sleep(0.005)
    version = await engine.update_weights(new.state_dict(), version=1, pause=pause)
    out = await task
    assert version == 1
    versions = out.versions()
    n_old = versions.count(0)
    assert n_old >= 5 and versions == sorted(versions)
    expected_old = full_logprobs(model, prompt, out.token_ids)[:n_old]  # what the old weights give
    torch.testing.assert_close(torch.tensor(out.logprobs[:n_old]), expected_old, atol=2e-4, rtol=0)
    if pause == "wait":
        assert n_old == len(out.token_ids) == 120 and out.policy_version == 0 and not out.preempted
    elif pause == "abort":
        assert out.preempted and out.finish_reason == FinishReason.ABORT and n_old == len(out.token_ids) < 120
        more = await engine.generate(prompt + out.token_ids, params, request_id="long")  # the resubmission
        assert more.policy_version == 1 and set(more.versions()) == {1}
        expected_new = full_logprobs(new, prompt + out.token_ids, more.token_ids)  # re-prefilled: exactly the new policy's
        torch.testing.assert_close(torch.tensor(more.logprobs), expected_new, atol=2e-4, rtol=0)
    else:  # keep: one call, its tokens split at the update, KV of the old tokens kept
        assert len(out.token_ids) == 120 and 0 < n_old < 120 and set(versions) == {0, 1} and not out.preempted
    with pytest.raises(InvalidRequest, match="pause must be one of"):
        await engine.update_weights({}, pause="later")
