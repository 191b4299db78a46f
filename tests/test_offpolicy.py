"""What the engine sampled is what the trainer scores: top-k / top-p kept sets and MoE router replay (issue 26).

The must-show tests run the real embedded engine and the real turn loop on tiny-qwen3 / tiny-qwen3-moe, store the
trajectories as JSONL rows and read them back, and score them with the trainer's packed forward."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math

import pytest
import torch

from turnrl.agents import AGENTS
from turnrl.build import build_learner
from turnrl.config import AlgoConfig, ConfigError, RolloutConfig, SamplingConfig, TrainConfig, load_config
from turnrl.engines.embedded import EmbeddedEngine, sample_tokens
from turnrl.models import load_model
from turnrl.moe import UNROUTED, decode_routing, encode_routing, merge_routing, moe_routers, replay_routing
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutLimits, RolloutManager
from turnrl.testing.latency import build_env
from turnrl.train import algos
from turnrl.train.learner import Learner, MicroBatch
from turnrl.train.loop import PolicyLoss
from turnrl.train.packing import (
    pack_sequences,
    packed_kept_logprobs,
    row_kept_counts,
    row_routing,
    unpack_to_padded,
)
from turnrl.train.samples import to_sample
from turnrl.types import SamplingParams, Segment, SegmentSource, Trajectory

ROWS = [{"id": i, "prompt": f"Look up item {i} with the tool.", "latencies_s": [0.0, 0.0, 0.0]} for i in range(6)]


def record(tokenizer, model, sampling: SamplingParams, **engine_kwargs) -> list[Trajectory]:
    """Three-turn trajectories of `model` on the embedded engine (batched, KV reused across turns), written as
    JSONL rows and read back, as a trainer reads them."""
    renderer = ChatRenderer(tokenizer)
    engine = EmbeddedEngine(model, eos_token_ids=sorted(renderer.end_of_turn_ids), max_batch_size=8, **engine_kwargs)
    manager = RolloutManager(engine, renderer, agents=AGENTS, env_factory=build_env, sanity_mode="disable",
                             sampling=sampling, limits=RolloutLimits(max_turns=3, max_new_tokens=10))

    async def run():
        return [t async for t in manager.stream(ROWS, 2)]

    try:
        trajs = asyncio.run(run())
    finally:
        engine.close()
    return [Trajectory.from_json(t.to_json()) for t in trajs]


def trainer_logprobs(model, trajs: list[Trajectory], temperature: float = 1.0) -> tuple[list, list, list]:
    """(renormalised, full softmax, engine) logprobs of every mask-1 token, from the trainer's packed forward."""
    rows = pack_sequences([(t.prompt_ids, t.response_ids, t.loss_mask) for t in trajs], max_tokens=4096)
    vocab = model.get_input_embeddings().num_embeddings
    kept_all, full_all, engine_all = [], [], []
    with torch.no_grad():
        for row in rows:
            kept_N = row_kept_counts(row, [t.kept_counts for t in trajs], vocab)
            kept, full = packed_kept_logprobs(model, row, kept_N, temperature)
            engine = [trajs[row.sequence_index[s]].rollout_logprobs[k]
                      for s, k in zip(row.target_seq.tolist(), row.target_pos.tolist(), strict=True)]
            kept_all += kept.tolist()
            full_all += full.tolist()
            engine_all += engine
    return kept_all, full_all, engine_all


# ---- the kept set: pure functions ----------------------------------------------------------------------
def _brute_force(logits_N_V: torch.Tensor, targets_N: torch.Tensor, kept_N: torch.Tensor) -> torch.Tensor:
    """The definition, one row at a time: K = the k largest; when the target is not among them, the k - 1
    largest and the target."""
    out = []
    for i in range(logits_N_V.shape[0]):
        order = logits_N_V[i].detach().argsort(descending=True).tolist()
        k, y = int(kept_N[i]), int(targets_N[i])
        kept = order[:k] if y in order[:k] else order[: k - 1] + [y]
        out.append(logits_N_V[i, y] - logits_N_V[i][torch.tensor(kept)].logsumexp(0))
    return torch.stack(out)


@pytest.mark.parametrize("targets", ["top", "fixed", "unlikely"])
def test_kept_token_logprobs_equal_the_definition_with_gradients(targets):
    torch.manual_seed(0)
    logits_N_V = torch.randn(7, 50, dtype=torch.float64, requires_grad=True)
    kept_N = torch.tensor([1, 3, 25, 26, 40, 49, 50])  # 1..25: from the top; 26..49: from the bottom; 50: all
    targets_N = {"top": logits_N_V.argmax(-1), "fixed": torch.full((7,), 4),
                 "unlikely": logits_N_V.argmin(-1)}[targets]  # "unlikely": the target is outside the k largest
    ours = algos.kept_token_logprobs(logits_N_V, targets_N, kept_N)
    expected = _brute_force(logits_N_V, targets_N, kept_N)
    torch.testing.assert_close(ours, expected, atol=1e-12, rtol=0)
    grad_ours, = torch.autograd.grad(ours.sum(), logits_N_V)
    grad_expected, = torch.autograd.grad(expected.sum(), logits_N_V)
    torch.testing.assert_close(grad_ours, grad_expected, atol=1e-12, rtol=0)


def test_kept_token_logprobs_by_hand():
    # probabilities 0.5, 0.3, 0.15, 0.05: keeping 2 gives log(0.3 / 0.8) for token 1; keeping 4 is log_softmax
    logits_1_V = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    got = algos.kept_token_logprobs(logits_1_V.expand(2, -1), torch.tensor([1, 1]), torch.tensor([2, 4]))
    torch.testing.assert_close(got, torch.tensor([math.log(0.3 / 0.8), math.log(0.3)]), atol=1e-6, rtol=0)


def test_mismatch_kl_k3_by_hand():
    # ρ = π / π_rollout = 0.5 / 0.25 = 2 on one token, 1 on another: k3 = mean(2 - 1 - ln 2, 0); padding ignored
    logp_B_T = torch.tensor([[math.log(0.5), math.log(0.3), float("nan")]])
    rollout_B_T = torch.tensor([[math.log(0.25), math.log(0.3), 0.0]])
    mask_B_T = torch.tensor([[1, 1, 0]])
    got = algos.mismatch_kl_k3(logp_B_T, rollout_B_T, mask_B_T)
    assert float(got) == pytest.approx((1 - math.log(2)) / 2, abs=1e-6)


def test_sampler_reports_the_size_of_the_kept_set():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0.5, 0.3} (the mass before 0.15 already reaches 0.7)
    logits_V = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    params = [SamplingParams(top_p=0.7), SamplingParams(top_k=3), SamplingParams(), SamplingParams(temperature=0)]
    _, _, kept_N = sample_tokens(logits_V.expand(4, -1), params, [None] * 4, torch.Generator().manual_seed(0))
    assert kept_N.tolist() == [2, 3, 4, 4]  # no filter and greedy: the whole vocabulary


# ---- the must-show tests: tiny-qwen3 with top-p 0.9 / top-k 20 -------------------------------------------
@pytest.mark.parametrize(("top_p", "top_k", "temperature"), [(0.9, -1, 1.0), (1.0, 20, 1.0), (0.9, 20, 0.7)])
def test_renormalised_trainer_logprobs_equal_the_engines(qwen3_tokenizer, tiny_qwen3, top_p, top_k, temperature):
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=3)
    trajs = record(qwen3_tokenizer, tiny_qwen3, sampling, record_sampling_mask=True)
    assert all(t.num_turns == 3 and t.kept_counts is not None for t in trajs)
    kept, full, engine = trainer_logprobs(tiny_qwen3, trajs, temperature)
    assert len(engine) == sum(t.num_model_tokens for t in trajs) > 100
    kept_gap = max(abs(a - b) for a, b in zip(kept, engine, strict=True))
    full_gap = [abs(a - b) for a, b in zip(full, engine, strict=True)]
    assert kept_gap < 1e-5, kept_gap
    # the full softmax misses the mass top-k / top-p cut: every token's logprob is off (on this random model by
    # at least -log 0.9 ≈ 0.1, the cut top_p leaves)
    assert min(full_gap) > 0.05, min(full_gap)


def test_without_recording_trajectories_carry_no_kept_sets(qwen3_tokenizer, tiny_qwen3):
    trajs = record(qwen3_tokenizer, tiny_qwen3, SamplingParams(top_p=0.9, seed=3))
    assert all(t.kept_counts is None and "kept_counts" not in str(t.to_json()["segments"]) for t in trajs)


# ---- storage ---------------------------------------------------------------------------------------------
def test_kept_counts_are_stored_per_segment_and_old_rows_still_load():
    traj = Trajectory("t", "g", 0, [1, 2], [
        Segment(SegmentSource.MODEL, [5, 6], [1, 1], [-0.1, -0.2], 1, 0, kept_counts=[3, 7]),
        Segment(SegmentSource.ENV, [8], [0], [None], 1),
    ])
    traj.validate()
    row = traj.to_json()
    assert row["segments"][0]["kept_counts"] == [3, 7] and "kept_counts" not in row["segments"][1]
    assert Trajectory.from_json(row).kept_counts == [3, 7, None]
    del row["segments"][0]["kept_counts"]  # a row written before kept sets existed
    assert Trajectory.from_json(row).kept_counts is None


@pytest.mark.parametrize("kept", [[3], [0, 1], [3, None]])
def test_kept_counts_that_break_the_invariants_are_refused(kept):
    traj = Trajectory("t", "g", 0, [1], [Segment(SegmentSource.MODEL, [5, 6], [1, 1], [-0.1, -0.2], 1,
                                                 kept_counts=kept)])
    with pytest.raises(ValueError, match="kept count"):
        traj.validate()


@pytest.mark.parametrize("experts", [300, 8])
def test_routing_round_trips_through_json(experts):
    routing = torch.randint(0, experts, (5, 3, 2), dtype=torch.int16)
    routing[4] = UNROUTED
    row = encode_routing(routing)
    assert row["dtype"] == ("int16" if experts > 255 else "uint8")
    assert torch.equal(decode_routing(row), routing)
    with pytest.raises(ValueError, match="shape"):
        decode_routing({**row, "shape": [6, 3, 2]})


def test_merge_routing_replaces_what_a_call_routed_again_and_marks_gaps():
    first = torch.ones(4, 1, 2, dtype=torch.int16)
    merged = merge_routing(merge_routing(None, 0, first), 2, torch.full((3, 1, 2), 2, dtype=torch.int16))
    assert merged[:, 0, 0].tolist() == [1, 1, 2, 2, 2]
    gap = merge_routing(merged, 7, torch.zeros(1, 1, 2, dtype=torch.int16))
    assert gap[:, 0, 0].tolist() == [1, 1, 2, 2, 2, UNROUTED, UNROUTED, 0]


def test_config_records_kept_sets_by_default_when_sampling_is_truncated():
    assert not RolloutConfig().records_sampling_mask
    assert RolloutConfig(sampling=SamplingConfig(top_p=0.9)).records_sampling_mask
    assert RolloutConfig(sampling=SamplingConfig(top_k=20)).records_sampling_mask
    assert not RolloutConfig(sampling=SamplingConfig(top_k=20), sampling_mask="none").records_sampling_mask
    assert AlgoConfig().sampling_mask == "renormalize"
    with pytest.raises(ConfigError, match="rollout.router_replay: record"):
        load_config(TrainConfig, None, ["model=tiny-qwen3-moe", "train_data=x.jsonl", "algo.router_replay=true"])
    assert TrainConfig(model="m", train_data="d", algo=AlgoConfig(router_replay=True),
                       rollout=RolloutConfig(router_replay="record")).algo.router_replay


# ---- router replay on tiny-qwen3-moe ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_moe():
    return load_model("tiny-qwen3-moe")


@pytest.fixture(scope="module")
def moe_trajs(qwen3_tokenizer, tiny_moe):
    return record(qwen3_tokenizer, tiny_moe, SamplingParams(seed=5), record_routing=True)


def test_the_engine_records_the_routing_of_every_token_it_fed(moe_trajs):
    for t in moe_trajs:
        stream = len(t.prompt_ids) + len(t.response_ids)
        # every token but the last (never fed), at both MoE layers, 2 experts each, across 3 turns of KV reuse
        assert tuple(t.routed_experts.shape) == (stream - 1, 2, 2)
        assert not (t.routed_experts == UNROUTED).any() and int(t.routed_experts.max()) < 8


def _experts_seen(model, row, routing) -> list[torch.Tensor]:
    """What each MoE layer's experts module received as its top-k expert ids in one packed forward."""
    seen: list[torch.Tensor] = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
             for layer in model.model.layers]
    try:
        with torch.no_grad(), replay_routing(model, routing) if routing is not None else contextlib.nullcontext():
            model(input_ids=row.input_ids, position_ids=row.position_ids, turnrl_cu_seqlens=row.cu_seqlens,
                  logits_to_keep=row.predict_at, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_replay_makes_the_trainer_route_every_token_and_layer_as_the_engine(tiny_moe, moe_trajs):
    from turnrl.train.packing import use_varlen_attention

    trainer = copy.deepcopy(tiny_moe)
    use_varlen_attention(trainer)
    _perturb_routers(trainer, 0.01)  # a trainer whose numbers differ: on its own it routes some tokens elsewhere
    rows = pack_sequences([(t.prompt_ids, t.response_ids, t.loss_mask) for t in moe_trajs], max_tokens=4096)
    differed = 0
    for row in rows:
        routing = row_routing(row, [t.routed_experts for t in moe_trajs])
        engine_N_L_K = routing.long()
        fed = (engine_N_L_K[:, 0, 0] != UNROUTED)  # the last token of each sequence was never fed to the engine
        replayed = torch.stack(_experts_seen(trainer, row, routing), dim=1)
        own = torch.stack(_experts_seen(trainer, row, None), dim=1)
        assert torch.equal(replayed[fed], engine_N_L_K[fed])  # every token, every layer, both experts
        differed += int((own[fed].sort(-1).values != engine_N_L_K[fed].sort(-1).values).any(-1).any(-1).sum())
    assert differed > 0  # without replay the perturbed trainer picked other experts for some tokens


def test_replay_lowers_the_engine_trainer_mismatch_and_the_router_still_learns(tiny_moe, moe_trajs):
    from turnrl.train.packing import packed_token_logprobs, use_varlen_attention

    trainer = copy.deepcopy(tiny_moe)
    use_varlen_attention(trainer)
    _perturb_routers(trainer, 0.01)
    kl = {}
    for replay in (False, True):
        values = []
        for row in pack_sequences([(t.prompt_ids, t.response_ids, t.loss_mask) for t in moe_trajs], 4096):
            routing = row_routing(row, [t.routed_experts for t in moe_trajs]) if replay else None
            with replay_routing(trainer, routing) if routing is not None else contextlib.nullcontext():
                logp_N = packed_token_logprobs(trainer, row)
            lengths = [len(moe_trajs[i].response_ids) for i in row.sequence_index]
            rollout_B_T = torch.nn.utils.rnn.pad_sequence(
                [torch.tensor([lp or 0.0 for lp in moe_trajs[i].rollout_logprobs]) for i in row.sequence_index],
                batch_first=True)
            mask_B_T = unpack_to_padded(torch.ones_like(logp_N), row, lengths)
            values.append(algos.mismatch_kl_k3(unpack_to_padded(logp_N.detach(), row, lengths), rollout_B_T, mask_B_T))
            if replay:  # the forced experts' gate values come from the router's softmax: its weights get gradients
                logp_N.sum().backward()
        kl[replay] = float(torch.stack(values).mean())
    # the routing part of the mismatch is gone (what remains: gate values from slightly different router logits;
    # measured 2e-6 against 1.2e-4 mean |Δ logprob|, bench/offpolicy.py)
    assert kl[True] < 0.1 * kl[False], kl
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(trainer))


def _perturb_routers(model: torch.nn.Module, scale: float) -> None:
    """Relative Gaussian noise on the routers' weights, seeded: router logits that differ slightly from the
    engine's, as another kernel's or dtype's do, so that tokens whose top experts score almost alike flip."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.mul_(1 + scale * torch.randn(router.weight.shape, generator=generator))


# ---- server engines: what they ask for and how they read it --------------------------------------------
def test_sglang_engine_reads_kept_sets_and_routing(qwen3_tokenizer, tiny_moe):
    from fake_sglang import FakeSGLang

    from turnrl.engines.base import Recording
    from turnrl.engines.sglang import SGLangEngine
    from turnrl.serve.app import ServerThread

    renderer = ChatRenderer(qwen3_tokenizer)
    engine = EmbeddedEngine(tiny_moe, eos_token_ids=sorted(renderer.end_of_turn_ids), record_sampling_mask=True,
                            record_routing=True)
    fake = FakeSGLang(engine)
    server = ServerThread(fake.app)
    server.start()
    client = SGLangEngine(server.base_url, record=Recording(sampling_mask=True, routing=True), routing_shape=(2, 2))
    prompt = renderer.initial_ids([{"role": "user", "content": "Count to five."}])
    try:
        out = asyncio.run(client.generate(prompt, SamplingParams(top_k=20, max_new_tokens=6, seed=1), request_id="r"))
    finally:
        client.close()
        server.stop()
        engine.close()
    assert fake.requests[-1]["return_sampling_mask"] and fake.requests[-1]["return_routed_experts"]
    assert out.kept_counts == [20] * len(out.token_ids)
    assert tuple(out.routed_experts.shape) == (len(prompt) + len(out.token_ids) - 1, 2, 2)
    with pytest.raises(ValueError, match="routing_shape"):
        SGLangEngine("http://127.0.0.1:9", record=Recording(routing=True))


def test_vllm_outputs_map_onto_kept_counts_and_routing():
    import base64
    import io
    from types import SimpleNamespace

    import numpy as np

    from turnrl.engines.base import Recording
    from turnrl.engines.vllm import VLLMServerEngine, output_from_vllm

    logprob = SimpleNamespace(logprob=-0.5)
    routed = np.arange(12, dtype=np.int32).reshape(3, 2, 2)
    completion = SimpleNamespace(  # a vllm.outputs.CompletionOutput of vLLM 0.32, with its SamplingMask
        finish_reason="length", stop_reason=None, token_ids=[7, 8], logprobs=[{7: logprob}, {8: logprob}],
        sampling_mask=SimpleNamespace(token_ids=[[7, 1, 2], [8]]), routed_experts=routed)
    out = output_from_vllm(completion, "r#0", 0, 0)
    assert out.kept_counts == [3, 1] and out.routed_experts.tolist() == routed.tolist()
    server = VLLMServerEngine("http://127.0.0.1:9", record=Recording(sampling_mask=True, routing=True))
    assert server.record == Recording(routing=True)  # /v1/completions has no sampling masks: said once, not asked
    assert server.completion_body([1, 2], SamplingParams(), "r")["routed_experts_prompt_start"] == 0
    buffer = io.BytesIO()
    np.save(buffer, routed)
    data = {"choices": [{"token_ids": [7, 8], "logprobs": {"token_logprobs": [-0.5, -0.5]}, "finish_reason": "stop",
                         "routed_experts": base64.b64encode(buffer.getvalue()).decode()}]}
    assert server.parse_completion(data, "r").routed_experts.tolist() == routed.tolist()
    server.close()


def test_build_sizes_sglangs_routing_from_the_policy_config():
    from turnrl.build import build_engine
    from turnrl.config import EngineConfig
    from turnrl.engines.base import Recording

    engine = build_engine(None, EngineConfig(kind="sglang", urls=["http://127.0.0.1:9"]), model_path="tiny-qwen3-moe",
                          record=Recording(sampling_mask=True, routing=True))
    try:
        assert engine.routing_shape == (2, 2) and engine.record == Recording(sampling_mask=True, routing=True)
    finally:
        engine.close()


def test_the_http_generate_body_carries_kept_sets_and_routing():
    from turnrl.engines.http import output_from_json, output_to_json
    from turnrl.types import FinishReason, GenerateOutput

    routing = torch.tensor([[[1, 2]], [[3, UNROUTED]]], dtype=torch.int16)
    out = GenerateOutput([5, 6], [-0.1, -0.2], FinishReason.STOP, kept_counts=[20, 3], routed_experts=routing,
                         routed_start=4)
    back = output_from_json(output_to_json(out), "test")
    assert back.kept_counts == [20, 3] and back.routed_start == 4 and torch.equal(back.routed_experts, routing)
    plain = output_from_json(output_to_json(GenerateOutput([5], [-0.1], FinishReason.STOP)), "test")
    assert plain.kept_counts is None and plain.routed_experts is None


def test_token_edits_keep_kept_counts_and_routing_only_for_the_engines_own_tokens():
    from turnrl.rollout.builder import TrajectoryBuilder
    from turnrl.types import FinishReason, GenerateOutput, TokenEdit

    def builder_after_one_turn() -> TrajectoryBuilder:
        b = TrajectoryBuilder(Trajectory("t", "g", 0, [1, 2]))
        routing = torch.arange(5 * 2, dtype=torch.int16).reshape(5, 1, 2)  # prompt 2 + 4 tokens - 1 (last not fed)
        b.add_model(GenerateOutput([5, 6, 7, 8], [-0.1] * 4, FinishReason.STOP, kept_counts=[3, 4, 5, 6],
                                   routed_experts=routing), 1)
        return b

    cut = builder_after_one_turn()  # keep the reply's first two tokens, then a tip the model did not sample
    cut.apply_edit(TokenEdit(token_ids=[5, 6, 9], loss_mask=[1, 1, 0]), [5, 6, 7, 8], [-0.1] * 4)
    assert cut.trajectory.kept_counts == [3, 4, None]
    assert cut.trajectory.routed_experts.shape[0] == 4  # rows of positions 0..3 (prompt, 5, 6) stay; 9 was never fed
    own = builder_after_one_turn()  # tokens with logprobs of the scheduler's own: their kept sets are unknown
    own.apply_edit(TokenEdit(token_ids=[5, 6], loss_mask=[1, 1], logprobs=[-0.3, -0.4]), [5, 6, 7, 8], [-0.1] * 4)
    assert own.trajectory.kept_counts is None


# ---- through the Learner: the seam the update scores with ------------------------------------------------
def _learner(policy, out, **overrides) -> tuple[TrainConfig, Learner]:
    data = {"model": "tiny-qwen3", "train_data": "x", "output_dir": str(out),
            "optim": {"lr": 1e-3, "micro_batch_tokens": 512}}
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    cfg = TrainConfig.model_validate(data)
    return cfg, build_learner(cfg, copy.deepcopy(policy))


def _update(learner: Learner, cfg: TrainConfig, trajs: list[Trajectory]) -> tuple[dict[str, float], list[MicroBatch]]:
    """One Learner.update with GRPO's PolicyLoss on `trajs`, and every micro-batch its loss saw."""
    seen: list[MicroBatch] = []
    policy_loss = PolicyLoss(cfg.algo, version=0)

    def probe(batch: MicroBatch):
        seen.append(batch)
        return policy_loss(batch)

    return learner.update([to_sample(t, 1.0 if k % 2 else -1.0) for k, t in enumerate(trajs)], probe), seen


@pytest.fixture(scope="module")
def truncated_trajs(qwen3_tokenizer, tiny_qwen3):
    return record(qwen3_tokenizer, tiny_qwen3, SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=3),
                  record_sampling_mask=True)


@pytest.mark.parametrize(("sampling_mask", "mini_batches"), [("renormalize", 1), ("ignore", 1), ("renormalize", 2)])
def test_the_learner_scores_each_sampled_token_over_the_engines_kept_set(truncated_trajs, tiny_qwen3, tmp_path,
                                                                         sampling_mask, mini_batches):
    trajs = truncated_trajs
    cfg, learner = _learner(tiny_qwen3, tmp_path, rollout={"sampling": {"temperature": 0.7, "top_p": 0.9, "top_k": 20}},
                            algo={"sampling_mask": sampling_mask}, optim={"mini_batches": mini_batches})
    metrics, seen = _update(learner, cfg, trajs)
    kept, full, engine = [], [], []
    for batch in seen:
        mask_B_T = batch.mask_B_T.bool()
        engine += [lp for s in batch.samples for lp, m in zip(s.rollout_logprobs, s.loss_mask, strict=True) if m]
        kept += batch.old_kept_B_T[mask_B_T].tolist()
        full += batch.old_full_B_T[mask_B_T].tolist()
        scored = batch.old_kept_B_T if sampling_mask == "renormalize" else batch.old_full_B_T
        assert torch.equal(batch.old_B_T, scored)  # what the ratio and the IS weights use
        if mini_batches == 1:  # one step: the loss's logprobs are the old ones, with gradients
            assert torch.equal(batch.logp_B_T.detach(), scored)
    assert len(engine) == sum(t.num_model_tokens for t in trajs) > 100
    assert max(abs(a - b) for a, b in zip(kept, engine, strict=True)) < 1e-5  # every token, before the update
    assert min(abs(a - b) for a, b in zip(full, engine, strict=True)) > 0.05  # the cut mass, on every token
    assert metrics["train/mismatch_kl_k3"] < 1e-9 < 1e-3 < metrics["train/mismatch_kl_k3_unmasked"]


class _RoutingProbe:
    """Checks every MoE layer's experts, in every forward of the learner's policy and every recompute of one in the
    backward, against the engine's record for the row being trained (found by its sequences' tokens)."""

    def __init__(self, policy: torch.nn.Module, trajs: list[Trajectory]):
        self.routing = {tuple(t.prompt_ids + t.response_ids): t.routed_experts.long() for t in trajs}
        self.any = next(iter(self.routing.values()))
        self.expected: torch.Tensor | None = None
        self.calls = self.checked = self.differed = 0
        experts = [m for name, m in policy.named_modules() if name.endswith("mlp.experts")]
        self.handles = [policy.register_forward_pre_hook(self._row, with_kwargs=True)]
        self.handles += [m.register_forward_pre_hook(self._layer(i)) for i, m in enumerate(experts)]

    def _row(self, module, args, kwargs):
        ids = kwargs["input_ids"][0].tolist()
        if "turnrl_tree" in kwargs:  # a tree row: each node's routing from a sequence through it that fed it
            end = kwargs["turnrl_tree"].subtree_end.tolist()
            expected = []
            for q in range(len(ids)):
                prefix = tuple(ids[k] for k in range(q + 1) if k <= q < end[k])  # q's root-to-node path
                fed = [r for seq, r in self.routing.items() if seq[:len(prefix)] == prefix and len(r) >= len(prefix)]
                expected.append(fed[0][len(prefix) - 1] if fed else torch.full_like(self.any[0], UNROUTED))
            self.expected = torch.stack(expected)
            return
        cu = kwargs["turnrl_cu_seqlens"]
        rows = [self.routing[tuple(ids[a:b])] for a, b in zip(cu[:-1], cu[1:], strict=True)]
        # the last token of each sequence was never fed to the engine: the trainer routes it itself
        self.expected = torch.cat([torch.cat([r, r.new_full((1, *r.shape[1:]), UNROUTED)]) for r in rows])

    def _layer(self, layer: int):
        def hook(module, args):
            self.calls += 1
            expected_N_K, got_N_K = self.expected[:, layer], args[1].cpu()
            fed = expected_N_K[:, 0] != UNROUTED
            self.checked += int(fed.sum())
            self.differed += int((got_N_K[fed].sort(-1).values != expected_N_K[fed].sort(-1).values).any(-1).sum())
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("setting", ["plain", "checkpointing", "lora", "tree"])
def test_the_learner_replays_the_engines_routing_for_every_token_and_layer(tiny_moe, moe_trajs, tmp_path, setting):
    trainer = copy.deepcopy(tiny_moe)
    _perturb_routers(trainer, 0.01)  # router logits that differ slightly from the engine's
    # flat rows (every token of every sequence checked), but "tree": tree rows, each shared node checked once
    extra = {"optim": {"gradient_checkpointing": setting == "checkpointing"},
             "trainer": {"packing": "tree" if setting == "tree" else "flat"}}
    if setting == "lora":
        extra["trainer"]["lora"] = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
    results = {}
    for replay in (False, True):
        cfg, learner = _learner(trainer, tmp_path / str(replay), model="tiny-qwen3-moe",
                                rollout={"router_replay": "record"}, algo={"router_replay": replay}, **extra)
        probe = _RoutingProbe(learner.policy, moe_trajs)
        try:
            metrics, seen = _update(learner, cfg, moe_trajs)
        finally:
            probe.close()
        forwards = len(seen) * (2 if setting == "checkpointing" else 1)  # checkpointing: again in the backward
        fed = sum(len(t.prompt_ids) + len(t.response_ids) - 1 for t in moe_trajs) * (forwards // len(seen))
        assert probe.calls == 2 * forwards
        assert probe.checked == 2 * fed if setting != "tree" else 0 < probe.checked < 2 * fed
        results[replay] = (probe.differed, metrics["train/mismatch_kl_k3"])
        if replay and setting != "lora":  # the forced experts' gates come from the router: it still trains
            assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0
                       for r in moe_routers(learner.policy))
    assert results[True][0] == 0 < results[False][0]  # every token and layer as the engine; not so on its own
    assert results[True][1] < 0.1 * results[False][1], results


def test_trajectories_without_the_recorded_corrections_are_warned_about_once(caplog):
    from types import SimpleNamespace

    from turnrl.train.loop import Trainer
    from turnrl.train.samples import TrainSample

    def trainer(**overrides):
        cfg = TrainConfig.model_validate({"model": "tiny-qwen3-moe", "train_data": "x", **overrides})
        return SimpleNamespace(cfg=cfg, step=2, _unrecorded_said=set())

    recorded = TrainSample([1], [2, 3], [1, 1], [-0.1, -0.2], 1.0, kept_counts=[4, 5],
                           routed_experts=torch.zeros(2, 2, 2, dtype=torch.int16))
    bare = TrainSample([1], [2, 3], [1, 1], [-0.1, -0.2], 1.0)
    truncated = trainer(rollout={"sampling": {"top_p": 0.9}, "router_replay": "record"}, algo={"router_replay": True})
    with caplog.at_level("WARNING", logger="turnrl.train.loop"):
        Trainer._warn_unrecorded(truncated, [recorded, recorded])
        assert not caplog.records
        for _ in range(2):
            Trainer._warn_unrecorded(truncated, [recorded, bare, bare])
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "2 of 3 trajectories carry no kept sets" in said[0] and "no routing" in said[1]
    caplog.clear()
    with caplog.at_level("WARNING", logger="turnrl.train.loop"):  # nothing was cut, or the full softmax is asked for
        Trainer._warn_unrecorded(trainer(), [bare])
        Trainer._warn_unrecorded(trainer(rollout={"sampling": {"top_k": 20}}, algo={"sampling_mask": "ignore"}), [bare])
    assert not caplog.records
