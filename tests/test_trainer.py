"""The GRPO trainer on tiny-qwen3: an update lowers the loss, weight sync, advantages, exact resume."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from turnrl.build import build_learner
from turnrl.cli import run_training
from turnrl.config import TrainConfig, load_config
from turnrl.engines.embedded import EmbeddedEngine
from turnrl.train.loop import Trainer
from turnrl.train.packing import pack_sequences, packed_token_logprobs, use_varlen_attention
from turnrl.train.samples import PromptSampler, TrainSample, group_advantages
from turnrl.types import RolloutStatus, SamplingParams, TerminationReason, Trajectory


def _traj(tid, group, reward, status=RolloutStatus.COMPLETED, episode=None):
    t = Trajectory(id=tid, group_id=group, sample_index=0, prompt_ids=[1], reward=reward, status=status)
    if episode:
        t.episode_id = episode
    return t


def test_group_advantages_drop_failed_and_share_split_episodes():
    cfg = TrainConfig(model="tiny-qwen3", train_data="x")
    failed = _traj("c", "g0", 1.0, RolloutStatus.FAILED)
    failed.finish(TerminationReason.ENV_ERROR, "boom")
    groups = [
        [_traj("a", "g0", 1.0), _traj("b", "g0", 0.0), failed],
        [_traj("d", "g1", 0.5)],  # singleton: zero advantage
        # one episode split into two samples (same reward) plus a second episode
        [_traj("e1", "g2", 1.0, episode="e"), _traj("e2", "g2", 1.0, episode="e"), _traj("f", "g2", 0.0)],
    ]
    scored, stats = group_advantages(groups, cfg)
    adv = {t.id: a for t, a in scored}
    # g0: rewards [1, 0] (the failed one is excluded): mean 0.5, unbiased std 0.7071 → ±0.5/0.7071 = ±0.7071
    assert adv["a"] == pytest.approx(0.70710, abs=1e-4) and adv["b"] == pytest.approx(-0.70710, abs=1e-4)
    assert "c" not in adv and adv["d"] == 0.0
    # g2 counts episode e once: rewards [1, 0] → e1 and e2 share +0.7071
    assert adv["e1"] == adv["e2"] == pytest.approx(0.70710, abs=1e-4)
    assert stats["train/trained_trajectories"] == 6.0

    # a per-branch reward: the episode counts once with its last branch's reward (1.0: baseline unchanged), and the
    # branch rewarded 0.5 is scored against the same baseline: 0.7071 + (0.5 - 1) / 0.7071 = 0
    groups[2][0].reward = 0.5
    adv = {t.id: a for t, a in group_advantages(groups, cfg)[0]}
    assert adv["e2"] == pytest.approx(0.70710, abs=1e-4) and adv["f"] == pytest.approx(-0.70710, abs=1e-4)
    assert adv["e1"] == pytest.approx(0.0, abs=1e-4)


def test_each_seat_of_a_self_play_game_has_a_baseline_of_its_own():
    """Three zero-sum games the policy played in both seats: seat 0 won two. Against one shared baseline (the
    episode's, i.e. the last seat's reward) seat 0's advantages would not be centred; each seat against its own
    seat in the other games gives centred advantages per seat, opposite in sign."""
    cfg = TrainConfig(model="tiny-qwen3", train_data="x")
    group = []
    for game, seat0 in enumerate([1.0, 1.0, -1.0]):
        for seat, reward in enumerate([seat0, -seat0]):
            t = _traj(f"g{game}s{seat}", "g", reward, episode=f"g{game}")
            t.rollout_infos["seat"] = seat
            group.append(t)
    scored, stats = group_advantages([group], cfg)
    adv = {t.id: a for t, a in scored}
    # each seat: rewards ±[1, 1, -1], mean ±1/3, std 1.1547 → ±0.5774, ±0.5774, ∓1.1547
    assert [adv[f"g{k}s0"] for k in range(3)] == pytest.approx([0.5774, 0.5774, -1.1547], abs=1e-4)
    assert [adv[f"g{k}s1"] for k in range(3)] == pytest.approx([-0.5774, -0.5774, 1.1547], abs=1e-4)
    assert stats["train/trained_trajectories"] == 6.0


def test_prompt_sampler_is_resumable():
    a = PromptSampler(5, 2, seed=3)
    first = [a.next_batch() for _ in range(4)]
    b = PromptSampler(5, 2, seed=3)
    b.next_batch()
    c = PromptSampler(5, 2, seed=3)
    c.load_state_dict(b.state_dict())
    assert [c.next_batch() for _ in range(3)] == first[1:]
    assert sorted(first[0] + first[1] + first[2][:1]) == [0, 1, 2, 3, 4]  # an epoch sees every row once


def _fixed_samples(tokenizer):
    g = torch.Generator().manual_seed(0)
    samples = []
    for k in range(4):
        prompt = tokenizer("Say something nice.", add_special_tokens=False)["input_ids"]
        response = torch.randint(0, 150000, (12,), generator=g).tolist()
        samples.append(TrainSample(prompt, response, [1] * 12, None, 1.0 if k % 2 == 0 else -1.0))
    return samples


def test_one_update_changes_parameters_and_lowers_the_loss(tiny_qwen3, qwen3_tokenizer, tmp_path):
    policy = copy.deepcopy(tiny_qwen3)
    cfg = TrainConfig(model="tiny-qwen3", train_data="x", output_dir=str(tmp_path),
                      optim={"lr": 1e-2, "grad_clip": None}, algo={"is_mode": "none"})
    trainer = Trainer(cfg, build_learner(cfg, policy), engine=None, rollout=None, train_rows=[{}], eval_rows=[])
    samples = _fixed_samples(qwen3_tokenizer)

    def surrogate() -> float:  # -mean(A * logp) over tokens: what the first PPO step decreases
        with torch.no_grad():
            row = pack_sequences([(s.prompt_ids, s.response_ids, s.loss_mask) for s in samples], 4096)[0]
            logp = packed_token_logprobs(policy, row)
            adv = torch.tensor([samples[i].advantage for i in row.sequence_index])[row.target_seq]
            return float(-(adv * logp).mean())

    before_params = {n: p.detach().clone() for n, p in policy.named_parameters()}
    before = surrogate()
    metrics = trainer.update(samples)
    after = surrogate()
    changed = [n for n, p in policy.named_parameters() if not torch.equal(p, before_params[n])]
    assert len(changed) == len(before_params)  # every parameter moved
    assert after < before - 1e-3, (before, after)
    assert metrics["train/tokens"] > 0 and metrics["train/clip_frac"] == 0.0  # ratio is exactly 1 in one step


async def test_engine_logprobs_equal_trainer_logprobs_after_a_weight_push(tiny_qwen3, qwen3_tokenizer):
    policy = copy.deepcopy(tiny_qwen3)
    engine = EmbeddedEngine(copy.deepcopy(tiny_qwen3), max_batch_size=4)
    try:
        with torch.no_grad():  # the trainer's weights move away from the engine's
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        version = await engine.update_weights(policy.state_dict(), version=7)
        prompt = qwen3_tokenizer("Count to three.", add_special_tokens=False)["input_ids"]
        out = await engine.generate(prompt, SamplingParams(temperature=0.8, max_new_tokens=12, seed=1),
                                    request_id="r")
        assert version == 7 and out.policy_version == 7
        use_varlen_attention(policy)
        row = pack_sequences([(prompt, out.token_ids, [1] * len(out.token_ids))], 4096)[0]
        with torch.no_grad():
            trainer_logp = packed_token_logprobs(policy, row, temperature=0.8)
        assert torch.allclose(trainer_logp, torch.tensor(out.logprobs), atol=1e-4)
    finally:
        engine.close()


def _config(tmp_path, data, out, steps, **extra):
    cfg = {
        "model": "tiny-qwen3", "train_data": str(data), "run_dir": str(out), "steps": steps,
        "prompts_per_step": 2, "seed": 5, "save_every": 1,
        "rollout": {"env": "single_turn", "n": 3, "max_new_tokens": 6},
        # batch 1, no prefix copied across requests: every call computed alone (bit-for-bit comparisons)
        "engine": {"max_batch_size": 1, "share_prefixes": False}, "optim": {"lr": 1e-3, "epochs": 2},
        "reward": {"function": f"{tmp_path / 'reward.py'}:reward"}, **extra,
    }
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(json.dumps(cfg))
    return load_config(TrainConfig, path)


@pytest.mark.filterwarnings("ignore")
def test_kill_and_resume_matches_an_uninterrupted_run(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Say {i}."}) + "\n" for i in range(5)))
    (tmp_path / "reward.py").write_text("def reward(response):\n    return float(len(response) % 3)\n")

    full = run_training(_config(tmp_path, data, tmp_path / "full", steps=3))
    run_training(_config(tmp_path, data, tmp_path / "resumed", steps=2))  # "killed" after step 2
    resumed = run_training(_config(tmp_path, data, tmp_path / "resumed", steps=3, resume=True))

    last_full = [m for m in full if m.get("step") == 3.0 and "train/loss" in m][-1]
    last_resumed = [m for m in resumed if m.get("step") == 3.0 and "train/loss" in m][-1]
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
        assert last_resumed[key] == pytest.approx(last_full[key], rel=1e-5, abs=1e-7), key

    def rows_of(run):
        lines = (tmp_path / run / "trajectories" / "last_step.jsonl").read_text().splitlines()
        return sorted((json.loads(x)["group_id"], tuple(json.loads(x)["response_ids"])) for x in lines)

    assert rows_of("resumed") == rows_of("full")  # same prompts, same sampled tokens at step 3


def test_config_errors_are_precise(tmp_path):
    from turnrl.config import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text("model: tiny-qwen3\ntrain_data: x\nalgo: {clpi_low: 0.1}\n")
    with pytest.raises(ConfigError, match=r"algo.clpi_low: unknown key \(did you mean 'clip_low'\?\)"):
        load_config(TrainConfig, path)
    with pytest.raises(ConfigError, match=r"optim.lr: .*greater than 0"):
        load_config(TrainConfig, None, ["model=m", "train_data=x", "optim.lr=-1"])
    with pytest.raises(ConfigError, match="steps: Input should be a valid integer"):
        load_config(TrainConfig, None, ["model=m", "train_data=x", "steps=many"])
    cfg = load_config(TrainConfig, None, ["model=m", "train_data=x", "algo.clip_high=0.28", "rollout.n=8"])
    assert cfg.algo.clip_high == 0.28 and cfg.rollout.n == 8


def test_a_misspelt_key_in_an_optional_section_gets_a_suggestion():
    from turnrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"trainer.lora.alpah: unknown key \(did you mean 'alpha'\?\)"):
        load_config(TrainConfig, None, ["model=m", "train_data=x", "trainer.lora.alpah=8"])


@pytest.mark.filterwarnings("ignore")
def test_an_engine_sharing_the_policy_tensors_samples_what_an_engine_with_a_copy_samples(tmp_path):
    from turnrl.build import build_trainer

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Say {i}."}) + "\n" for i in range(5)))
    (tmp_path / "reward.py").write_text("def reward(response):\n    return float(len(response) % 3)\n")
    trainer, stack = build_trainer(_config(tmp_path, data, tmp_path / "probe", steps=1))
    try:  # sync mode on the CPU: one copy of the weights, the engine's module over the policy's tensors
        assert trainer.shares_weights and trainer.engine.model is not trainer.learner.policy
        assert trainer.engine.model.lm_head.weight is trainer.learner.policy.lm_head.weight
        assert trainer.engine.model.config._attn_implementation != trainer.learner.policy.config._attn_implementation
    finally:
        stack.close()
    trainer, stack = build_trainer(_config(tmp_path, data, tmp_path / "probe", steps=1,
                                           trainer={"mode": "async", "max_staleness": 1}))
    try:  # async: rollouts go on during the update, so the engine has its own copy
        assert trainer.engine.model.lm_head.weight.data_ptr() != trainer.learner.policy.lm_head.weight.data_ptr()
        assert not trainer.shares_weights
    finally:
        stack.close()

    shared = run_training(_config(tmp_path, data, tmp_path / "shared", steps=3, save_every=0))
    copied = run_training(_config(tmp_path, data, tmp_path / "copied", steps=3, save_every=0,
                                  engine={"max_batch_size": 1, "share_prefixes": False, "share_weights": False}))

    def sampled(run):  # the last step's trajectories: sampled after two updates
        rows = [json.loads(x) for x in (tmp_path / run / "trajectories" / "last_step.jsonl").read_text().splitlines()]
        return sorted((r["id"], tuple(r["response_ids"]), tuple(r["rollout_logprobs"])) for r in rows)

    assert sampled("shared") == sampled("copied")  # the same tokens with the same logprobs, bit for bit
    losses = [[m["train/loss"] for m in h if "train/loss" in m] for h in (shared, copied)]
    assert losses[0] == losses[1] and len(losses[0]) == 3


def _behaviour_samples(tokenizer, policy, shift: float):
    """Samples whose rollout logprobs are the policy's own minus `shift` per token, half sampled by version 0
    (two versions stale at step 3) and half by version 2 (fresh)."""
    samples = _fixed_samples(tokenizer)
    rows = pack_sequences([(s.prompt_ids, s.response_ids, s.loss_mask) for s in samples], 4096)
    for row in rows:
        with torch.no_grad():
            logp = packed_token_logprobs(policy, row)
        for j, i in enumerate(row.sequence_index):
            s = samples[i]
            s.rollout_logprobs = (logp[row.target_seq == j] - shift).tolist()
            s.versions = [0 if i % 2 == 0 else 2] * len(s.response_ids)
    return samples


@pytest.mark.parametrize("decoupled", [True, False])
def test_mismatch_is_reported_per_staleness_and_the_anchor_is_chosen(tiny_qwen3, qwen3_tokenizer, tmp_path, decoupled):
    policy = copy.deepcopy(tiny_qwen3)
    cfg = TrainConfig(model="tiny-qwen3", train_data="x", output_dir=str(tmp_path), optim={"lr": 1e-4},
                      algo={"is_mode": "truncate", "decoupled": decoupled})
    trainer = Trainer(cfg, build_learner(cfg, policy), engine=None, rollout=None, train_rows=[{}], eval_rows=[])
    trainer.step = 3  # updating policy version 2
    metrics = trainer.update(_behaviour_samples(qwen3_tokenizer, policy, shift=0.1))
    # log ratio proximal/behaviour = 0.1 on every token: k3 = e^0.1 - 1 - 0.1, for both ages of data
    k3 = math.exp(0.1) - 1.1
    assert metrics["train/mismatch_kl_k3/staleness_2"] == pytest.approx(k3, rel=1e-3)
    assert metrics["train/mismatch_kl_k3/staleness_0"] == pytest.approx(k3, rel=1e-3)
    if decoupled:  # clipped ratio against the proximal policy (1 here) and TIS weights e^0.1 on each token
        assert metrics["train/ratio_mean"] == pytest.approx(1.0) and "train/is_weight_mean" in metrics
        assert metrics["train/is_weight_mean"] == pytest.approx(math.exp(0.1), rel=1e-3)
    else:  # anchored at behaviour: the ratio itself is e^0.1 and no importance weights are applied
        assert metrics["train/ratio_mean"] == pytest.approx(math.exp(0.1), rel=1e-3)
        assert "train/is_weight_mean" not in metrics


PROBE = """
import os, sys, torch
from turnrl.train.learner import map_large_allocations
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
if sys.argv[1] == "on":
    map_large_allocations()
x = torch.ones(4 << 20); del x  # 16 MiB freed: glibc raises its mmap threshold above it
a = torch.ones(2 << 20)         # 8 MiB: from the heap, unless large blocks get their own pages
b = torch.ones(1024)            # a small block above it keeps the heap from shrinking at its top
before = rss_mb(); del a
print(round(before - rss_mb()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_large_cpu_tensors_give_their_memory_back_when_freed():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    freed = {mode: int(subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True,
                                      check=True).stdout) for mode in ("off", "on")}
    assert freed == {"off": 0, "on": 8}  # MiB returned to the OS by freeing the 8 MiB tensor
