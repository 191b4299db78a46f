"""VLLMEngine (in-process vLLM) on the real SmolLM2-135M-Instruct, checked against transformers.

Runs only in the vLLM venv (`make vllm-test`); elsewhere the module is skipped. One engine serves the whole
module (start-up is the slow part), in fp32 and eager mode, so its numbers can be compared with a full HF
forward of the same weights: logprobs to 1e-3, greedy tokens exactly. The weight-push test perturbs the HF
weights, pushes them, compares vLLM with the embedded engine over the perturbed model, and pushes the
original weights back.
"""

from __future__ import annotations

import asyncio
import copy

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from turnrl.engines.embedded import EmbeddedEngine  # noqa: E402
from turnrl.engines.vllm import VLLMEngine  # noqa: E402
from turnrl.models import load_model, load_tokenizer, resolve_model  # noqa: E402
from turnrl.render import ChatRenderer  # noqa: E402
from turnrl.rollout import RolloutContext, RolloutLimits, drive  # noqa: E402
from turnrl.types import FinishReason, RolloutStatus, SamplingParams, StepResult  # noqa: E402

pytestmark = pytest.mark.vllm

MODEL = "smollm2-135m-instruct"
IM_END = 2  # SmolLM2's <|im_end|>, its EOS
QUESTIONS = ["What is the capital of France?", "Name three colors.", "What is 2+2? Answer briefly."]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return load_model(MODEL).eval()


@pytest.fixture(scope="module")
def engine():
    eng = VLLMEngine(resolve_model(MODEL), dtype="float32", max_model_len=2048, enforce_eager=True)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    def render(question: str) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    return [render(q) for q in QUESTIONS]


@torch.no_grad()
def hf_logits(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Logits [len(output), V] that predict each output token, from one uncached forward."""
    logits = model(torch.tensor([prompt + output])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) + len(output) - 1]


def token_logprobs(logp_T_V: torch.Tensor, output: list[int]) -> torch.Tensor:
    return logp_T_V.gather(1, torch.tensor(output)[:, None])[:, 0]


async def generate_all(engine, prompts, params: SamplingParams, tag: str):
    return await asyncio.gather(*[engine.generate(p, params, request_id=f"{tag}{i}") for i, p in enumerate(prompts)])


# ---- generation -----------------------------------------------------------------------------------
async def test_greedy_tokens_logprobs_and_finish_reasons(engine, hf_model, tokenizer, prompts):
    outs = await generate_all(engine, prompts, SamplingParams(temperature=0.0, max_new_tokens=64), "greedy")
    assert tokenizer.decode(outs[0].token_ids) == "The capital of France is Paris.<|im_end|>"
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == FinishReason.STOP and out.token_ids[-1] == IM_END  # the stop token is kept
        assert len(out.logprobs) == len(out.token_ids) and out.policy_version == 0
        logits_T_V = hf_logits(hf_model, prompt, out.token_ids)
        assert out.token_ids == logits_T_V.argmax(-1).tolist()  # greedy under the HF model, token for token
        # greedy reports the unscaled logprob
        expected = token_logprobs(logits_T_V.log_softmax(-1), out.token_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-3, rtol=0)

    short = await engine.generate(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=4), request_id="short")
    assert short.finish_reason == FinishReason.LENGTH and short.token_ids == outs[0].token_ids[:4]

    stop_at = outs[0].token_ids[3]  # a requested stop id ends the output on that token, included
    stopped = await engine.generate(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=64,
                                                               stop_token_ids=(stop_at,)), request_id="stop")
    assert stopped.finish_reason == FinishReason.STOP and stopped.token_ids == outs[0].token_ids[:4]


@pytest.mark.parametrize("temperature, top_k", [(1.0, -1), (0.7, 20)])
async def test_sampled_logprobs_are_those_of_the_sampling_distribution(engine, hf_model, prompts, temperature,
                                                                       top_k):
    params = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=24, seed=7)
    outs = await generate_all(engine, prompts, params, f"t{temperature}")
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.logprobs) == len(out.token_ids) > 0
        scaled_T_V = hf_logits(hf_model, prompt, out.token_ids) / temperature
        if top_k > 0:  # processed_logprobs: renormalised over the top-k tokens, -inf elsewhere
            kth_T_1 = scaled_T_V.topk(top_k, dim=-1).values[:, -1:]
            scaled_T_V = scaled_T_V.masked_fill(scaled_T_V < kth_T_1, float("-inf"))
        expected = token_logprobs(scaled_T_V.log_softmax(-1), out.token_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-3, rtol=0)
    again = await generate_all(engine, prompts, params, "again")  # seeded requests reproduce
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


# ---- weight sync (the required test) -------------------------------------------------------
def perturbed(model: torch.nn.Module, seed: int = 0, scale: float = 0.5) -> torch.nn.Module:
    """A copy whose matrices (all but the tied embedding) get Gaussian noise of `scale` times their std."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * scale)
    return out


async def test_weight_push_makes_vllm_match_the_embedded_engine(engine, hf_model, prompts):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    before = await generate_all(engine, prompts, greedy, "before")
    new_model = perturbed(hf_model)
    embedded = EmbeddedEngine(new_model, eos_token_ids=[IM_END], max_batch_size=4)
    try:
        version = await engine.update_weights(new_model.state_dict())
        assert version == engine.policy_version == 1
        pushed = await generate_all(engine, prompts, greedy, "after")
        reference = await generate_all(embedded, prompts, greedy, "embedded")
    finally:
        embedded.close()
        restored_version = await engine.update_weights(hf_model.state_dict(), version=5)
    assert [o.token_ids for o in pushed] != [o.token_ids for o in before]  # the push changed the policy
    for got, want in zip(pushed, reference, strict=True):
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        # the noisy weights blow activations up: fp32 kernel differences reach ~1e-3 on logprobs of ~-1
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-3, rtol=1e-3)
        assert got.policy_version == 1
    restored = await generate_all(engine, prompts, greedy, "restored")
    assert restored_version == 5 and all(o.policy_version == 5 for o in restored)
    assert [o.token_ids for o in restored] == [o.token_ids for o in before]  # no stale prefix-cache KV


# ---- the Engine protocol around generation ---------------------------------------------------------
async def test_cancelled_request_is_aborted_in_vllm(engine, prompts):
    long = SamplingParams(temperature=1.0, max_new_tokens=1000, seed=0)
    task = asyncio.create_task(engine.generate(prompts[0], long, request_id="cancel-me"))
    await asyncio.sleep(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(50):  # the abort is applied by the engine thread between two steps
        if engine.engine.get_num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.1)
    assert engine.engine.get_num_unfinished_requests() == 0 and not engine._pending
    # the same trajectory id can be used again at once (vLLM request ids are unique per call)
    out = await engine.generate(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=4), request_id="cancel-me")
    assert len(out.token_ids) == 4


async def test_images_and_empty_prompts_are_refused(engine):
    from turnrl.engines.base import EngineError

    with pytest.raises(EngineError, match="text prompts only"):
        await engine.generate([1, 2], SamplingParams(), request_id="img", images=["x.png"])
    with pytest.raises(EngineError, match="empty prompt"):
        await engine.generate([], SamplingParams(), request_id="empty")


async def test_sleep_and_wake_up_are_noops_on_cpu(engine, prompts):
    await engine.sleep()
    await engine.wake_up()
    out = await engine.generate(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=4), request_id="awake")
    assert len(out.token_ids) == 4


class GuessEnv:
    """Asks again until the reply names Paris (at most `max_turns` model turns)."""

    def __init__(self):
        self.replies: list[str] = []

    async def step(self, text: str) -> StepResult:
        self.replies.append(text)
        if "Paris" in text:
            return StepResult(None, reward=1.0, done=True)
        return StepResult("Not quite. Which city is it?", reward=0.0)

    def format_observation(self, observation: str) -> dict:
        return {"role": "user", "content": observation}


async def test_turn_loop_runs_on_vllm(engine, tokenizer):
    ctx = RolloutContext(
        engine=engine, renderer=ChatRenderer(tokenizer), sampling=SamplingParams(temperature=0.0),
        limits=RolloutLimits(max_turns=2, max_new_tokens=48), trajectory_id="traj0", group_id="g0",
        sample_index=0, sample={"prompt": "What is the capital of France?"},
    )
    env = GuessEnv()
    traj = await drive(ctx, env)
    assert traj.status == RolloutStatus.COMPLETED, traj.error
    assert traj.num_turns == 1 and env.replies == ["The capital of France is Paris."]
    assert traj.turn_rewards == [1.0] and traj.policy_versions == [engine.policy_version]
    sampled = [lp for lp, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if m == 1]
    assert len(sampled) == sum(traj.loss_mask) > 0 and all(lp is not None and lp <= 0 for lp in sampled)
    traj.validate()
