"""turnrl.train.algos against values derived by hand; the arithmetic sits next to each expected number."""

import math

import pytest
import torch

from turnrl.train.algos import (
    aggregate_loss,
    group_reward_stats,
    grpo_advantages,
    kl_penalty,
    loss_denominator,
    masked_mean,
    policy_loss,
    rloo_advantages,
    rollout_is_weights,
)

ln = math.log


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        actual.double(), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


# ---------------------------------------------------------------------------------------------------------
# Advantages

# Three uneven groups with non-contiguous ids, interleaved in the batch:
#   id 7 at positions 0, 3, 5 -> rewards [1, 2, 3]        (size 3)
#   id 0 at position 1        -> reward  [5]              (size 1)
#   id 3 at positions 2, 4, 6, 7 -> rewards [0, 0, 1, 1]  (size 4)
UNEVEN_REWARDS = torch.tensor([1.0, 5.0, 0.0, 2.0, 0.0, 3.0, 1.0, 1.0])
UNEVEN_GROUPS = torch.tensor([7, 0, 3, 7, 3, 7, 3, 3])


def test_grpo_uneven_groups_use_unbiased_std():
    adv = grpo_advantages(UNEVEN_REWARDS, UNEVEN_GROUPS, eps=0.0)
    # [1,2,3]: mean 2, unbiased var (1+0+1)/(3-1) = 1 -> [-1, 0, 1]  (biased std would give ±1.2247)
    # [5]: singleton -> 0
    # [0,0,1,1]: mean 0.5, unbiased var 4*0.25/3 = 1/3, std 0.57735 -> ±0.5/0.57735 = ±sqrt(3)/2 = ±0.8660254
    s = 0.8660254
    close(adv, [-1.0, 0.0, -s, 0.0, -s, 1.0, s, s])
    assert adv.dtype == torch.float32


def test_grpo_eps_is_added_to_std():
    adv = grpo_advantages(torch.tensor([0.0, 2.0]), torch.tensor([0, 0]), eps=0.5)
    # mean 1, unbiased std sqrt((1+1)/1) = 1.4142136 -> ±1 / (1.4142136 + 0.5) = ±0.5224077
    close(adv, [-0.5224077, 0.5224077])


def test_dr_grpo_subtracts_mean_only():
    adv = grpo_advantages(UNEVEN_REWARDS, UNEVEN_GROUPS, normalize_std=False)
    # [1,2,3] - 2 = [-1, 0, 1];  [5] -> 0;  [0,0,1,1] - 0.5 = [-0.5, -0.5, 0.5, 0.5]
    close(adv, [-1.0, 0.0, -0.5, 0.0, -0.5, 1.0, 0.5, 0.5])


def test_rloo_uneven_groups():
    adv = rloo_advantages(UNEVEN_REWARDS, UNEVEN_GROUPS)
    # [1,2,3]: 1 - (2+3)/2 = -1.5;  2 - (1+3)/2 = 0;  3 - (1+2)/2 = 1.5
    # [5]: no other sample -> 0
    # [0,0,1,1]: 0 - (0+1+1)/3 = -2/3;  1 - (0+0+1)/3 = 2/3
    t = 2 / 3
    close(adv, [-1.5, 0.0, -t, 0.0, -t, 1.5, t, t])


ESTIMATORS = {
    "grpo": lambda r, g: grpo_advantages(r, g),
    "dr_grpo": lambda r, g: grpo_advantages(r, g, normalize_std=False),
    "rloo": lambda r, g: rloo_advantages(r, g),
}


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        (0.9, torch.float32),  # the classic trap: float32 0.9 is not 0.9
        (0.1, torch.float64),  # sum of three float64 0.1 is 0.30000000000000004, so mean - 0.1 = 1.4e-17
    ],
)
def test_constant_group_gives_exactly_zero(estimator, value, dtype):
    rewards = torch.tensor([value, value, value, 0.0, 1.0, 7.0], dtype=dtype)
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    adv = ESTIMATORS[estimator](rewards, groups)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]  # exact, not approximate
    assert adv[5].item() == 0.0  # singleton
    # The mixed group [0, 1] is untouched: grpo ±0.5/(sqrt(0.5)+1e-6) = ±0.7071058, dr_grpo ±0.5,
    # rloo 0 - 1 = -1 and 1 - 0 = 1.
    expected = {"grpo": 0.7071058, "dr_grpo": 0.5, "rloo": 1.0}[estimator]
    close(adv[3:5], [-expected, expected])


def test_groups_as_index_lists_match_group_ids():
    index_lists = [[0, 3, 5], [1], [2, 4, 6, 7]]
    from_lists = grpo_advantages(UNEVEN_REWARDS, index_lists, eps=0.0)
    s = 0.8660254  # same groups as test_grpo_uneven_groups_use_unbiased_std
    close(from_lists, [-1.0, 0.0, -s, 0.0, -s, 1.0, s, s])


@pytest.mark.parametrize("index_lists", [[[0, 1], [1, 2]], [[0, 1]], [[0, 1, 2, 3]]])
def test_groups_index_lists_must_partition(index_lists):
    with pytest.raises(ValueError, match="partition range"):
        grpo_advantages(torch.zeros(3), index_lists)


def test_group_reward_stats():
    stats = group_reward_stats(UNEVEN_REWARDS, UNEVEN_GROUPS)
    assert stats["num_groups"].item() == 3.0
    close(stats["mean_group_size"], 8 / 3)  # (3 + 1 + 4) / 3
    close(stats["constant_group_frac"], 1 / 3)  # only the singleton [5]


# ---------------------------------------------------------------------------------------------------------
# Policy loss


def _logp(ratios) -> torch.Tensor:
    """Log-probs whose ratio to old_logp = 0 is `ratios`."""
    return torch.tensor(ratios, dtype=torch.float64).log().float()


def test_policy_loss_clips_low_and_high_per_advantage_sign():
    logp = _logp([[1.5, 0.5, 1.1, 0.9, 1.0], [1.5, 0.5, 1.1, 0.9, 1.0]])
    logp[:, 4] = 50.0  # masked-out garbage: must not show up anywhere
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), torch.tensor([1.0, -1.0]), mask)
    # A=+1: loss = max(-r, -clip(r, 0.8, 1.2)):
    #   1.5 -> max(-1.5, -1.2) = -1.2 (clipped high);  0.5 -> max(-0.5, -0.8) = -0.5;  1.1 -> -1.1;  0.9 -> -0.9
    # A=-1: loss = max(r, clip(r, 0.8, 1.2)):
    #   1.5 -> max(1.5, 1.2) = 1.5;  0.5 -> max(0.5, 0.8) = 0.8 (clipped low);  1.1 -> 1.1;  0.9 -> 0.9
    close(loss, [[-1.2, -0.5, -1.1, -0.9, 0.0], [1.5, 0.8, 1.1, 0.9, 0.0]])
    close(metrics["clip_frac_high"], 1 / 8)
    close(metrics["clip_frac_low"], 1 / 8)
    close(metrics["clip_frac"], 2 / 8)
    close(metrics["dual_clip_frac"], 0.0)
    close(metrics["ratio_mean"], 1.0)  # 2 * (1.5 + 0.5 + 1.1 + 0.9) / 8
    # k3 = r - 1 - ln r: 1.5 -> 0.0945349, 0.5 -> 0.1931472, 1.1 -> 0.0046898, 0.9 -> 0.0053605; mean 0.0744331
    close(metrics["approx_kl"], 0.0744331)


def test_clip_higher_uses_separate_bounds():
    logp = _logp([[1.25], [0.75]])
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 1)
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), adv, mask, clip_low=0.2, clip_high=0.28)
    # A=+1, r=1.25 <= 1.28: not clipped -> -1.25.  A=-1, r=0.75 < 0.8: clipped -> max(0.75, 0.8) = 0.8
    close(loss, [[-1.25], [0.8]])
    close(metrics["clip_frac_high"], 0.0)
    close(metrics["clip_frac_low"], 0.5)
    symmetric, _ = policy_loss(logp, torch.zeros_like(logp), adv, mask, clip_low=0.2, clip_high=0.2)
    close(symmetric, [[-1.2], [0.8]])  # 1.25 > 1.2: clipped high -> -1.2


def test_dual_clip_caps_negative_advantage_loss_and_its_gradient():
    logp = _logp([[5.0], [2.0], [5.0]]).requires_grad_()
    adv, mask = torch.tensor([-1.0, -2.0, 1.0]), torch.ones(3, 1)
    plain, _ = policy_loss(logp, torch.zeros_like(logp), adv, mask)
    close(plain, [[5.0], [4.0], [-1.2]])  # |A|·max(r, 1.2): 5, 2·2 = 4;  A=+1: -1.2
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), adv, mask, dual_clip=3.0)
    # caps at -A·3: min(5, 3) = 3 (capped);  min(4, 6) = 4;  A > 0 is never capped: -1.2
    close(loss, [[3.0], [4.0], [-1.2]])
    close(metrics["dual_clip_frac"], 1 / 3)
    aggregate_loss(loss, mask).backward()
    # token mean over 3: capped -> 0;  d(-A·r)/dlogp = -A·r = 2·2 = 4 -> 4/3;  clipped high -> 0
    close(logp.grad, [[0.0], [4 / 3], [0.0]])


def test_policy_loss_clamps_log_ratio_at_20():
    logp = torch.tensor([[1000.0]])  # e^1000 is inf in float32
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), torch.tensor([-1.0]), torch.ones(1, 1))
    # log ratio clamped to 20: loss = max(e^20, 1.2) = 4.8516520e8, finite
    torch.testing.assert_close(loss, torch.tensor([[math.exp(20.0)]]), rtol=1e-6, atol=0)
    torch.testing.assert_close(metrics["approx_kl"], torch.tensor(math.exp(20.0) - 21.0), rtol=1e-6, atol=0)


def test_dual_clip_must_exceed_one():
    logp = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, logp, torch.ones(1), torch.ones(1, 1), dual_clip=0.5)


def test_policy_loss_gradient_token_level():
    logp = _logp([[1.1, 1.5, 0.9]]).requires_grad_()
    loss, _ = policy_loss(logp, torch.zeros_like(logp), torch.tensor([1.0]), torch.ones(1, 3))
    aggregate_loss(loss, torch.ones(1, 3), "token_mean").backward()
    # loss_t = -A·r_t, d/dlogp_t = -A·r_t (r = e^(logp - old)); the clipped token (1.5 > 1.2) gets 0;
    # token mean divides by 3: [-1.1/3, 0, -0.9/3]
    close(logp.grad, [[-1.1 / 3, 0.0, -0.3]])


def test_gspo_sequence_ratio_and_gradient():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.2, 0.4, 5.0], [-0.1, -0.1, -0.1]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, 1.0])
    loss, metrics = policy_loss(logp, old, adv, mask, ratio_level="sequence")
    # row 0: s = exp(mean(0.2, 0.4)) = e^0.3 = 1.3498588 > 1.2 -> clipped: -1.2 on both masked tokens
    # row 1: s = exp(-0.1) = 0.9048374, inside [0.8, 1.2] -> -0.9048374 on every token
    close(loss, [[-1.2, -1.2, 0.0], [-0.9048374] * 3])
    close(metrics["clip_frac_high"], 2 / 5)
    close(metrics["ratio_mean"], 1.0828460)  # (2·1.3498588 + 3·0.9048374) / 5

    loss, _ = policy_loss(logp, old, adv, mask, clip_high=0.4, ratio_level="sequence")
    close(loss, [[-1.3498588, -1.3498588, 0.0], [-0.9048374] * 3])  # 1.3499 < 1.4: unclipped
    aggregate_loss(loss, mask, "seq_mean_token_mean").backward()
    # Sequence objective -A·s_i with s_i = exp(mean_t logp_t): ds_i/dlogp_t = s_i / |y_i|,
    # and the mean over 2 sequences halves it: row 0: -1.3498588/2/2 = -0.3374647,
    # row 1: -0.9048374/3/2 = -0.1508062; the masked token gets 0.
    close(logp.grad, [[-0.3374647, -0.3374647, 0.0], [-0.1508062] * 3])


def test_policy_loss_rejects_unknown_ratio_level_and_bad_shapes():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="ratio_level"):
        policy_loss(logp, logp, torch.ones(2), torch.ones(2, 3), ratio_level="turn")
    with pytest.raises(ValueError, match=r"adv_B must have shape \(2,\)"):
        policy_loss(logp, logp, torch.ones(3), torch.ones(2, 3))


# ---------------------------------------------------------------------------------------------------------
# KL penalty

KL_D = [0.5, -0.5, 0.0, -30.0, 30.0]  # d = logp - ref_logp


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", KL_D),  # d
        ("k2", [0.125, 0.125, 0.0, 450.0, 450.0]),  # d²/2
        # e^-d + d - 1: e^-0.5 - 0.5 = 0.1065307;  e^0.5 - 1.5 = 0.1487213;  0;
        # e^30 - 31 = 1.0686475e13;  e^-30 + 29 = 29
        ("k3", [0.1065307, 0.1487213, 0.0, 1.0686474581493463e13, 29.0]),
        # d clamped to ±20 first (e^20 - 21 = 4.9e8, e^-20 + 19 = 19), then the result to 10
        ("low_var_kl", [0.1065307, 0.1487213, 0.0, 10.0, 10.0]),
    ],
)
def test_kl_penalty_values(kind, expected):
    d = torch.tensor([KL_D], dtype=torch.float64)
    kl = kl_penalty(d, torch.zeros_like(d), kind)
    torch.testing.assert_close(kl, torch.tensor([expected], dtype=torch.float64), rtol=1e-7, atol=1e-6)


@pytest.mark.parametrize(
    ("kind", "expected_grad"),
    [
        ("k2", [0.5, -0.5, 0.0]),  # d(d²/2)/dd = d
        ("k3", [0.3934693, -0.6487213, 0.0]),  # d(e^-d + d - 1)/dd = 1 - e^-d
    ],
)
def test_kl_penalty_gradient(kind, expected_grad):
    logp = torch.tensor([[0.5, -0.5, 0.0]], requires_grad=True)
    kl_penalty(logp, torch.zeros(1, 3), kind).sum().backward()
    close(logp.grad, [expected_grad])


def test_kl_penalty_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ---------------------------------------------------------------------------------------------------------
# Loss aggregation

AGG_LOSS = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]]
AGG_MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
# Masked tokens: row 0 -> 1, 2 (sum 3, mean 1.5);  row 1 -> 5..8 (sum 26, mean 6.5);  row 2 -> none
AGG_CASES = [
    ("token_mean", None, 29 / 6),  # (3 + 26) / 6 tokens = 4.8333
    ("seq_mean_token_mean", None, 4.0),  # (1.5 + 6.5) / 2 sequences; row 2 is not counted
    ("seq_mean_token_sum_norm", 4.0, 3.625),  # (3/4 + 26/4) / 2 = (0.75 + 6.5) / 2
]


@pytest.mark.parametrize(("mode", "norm_constant", "expected"), AGG_CASES)
def test_aggregate_loss_modes(mode, norm_constant, expected):
    loss = torch.tensor(AGG_LOSS)
    loss[0, 3] = float("nan")  # masked out: must not leak
    loss[2] = float("nan")
    close(aggregate_loss(loss, AGG_MASK, mode, norm_constant=norm_constant), expected)


@pytest.mark.parametrize(("mode", "norm_constant", "expected"), AGG_CASES)
def test_aggregate_loss_all_masked_is_zero_with_zero_grad(mode, norm_constant, expected):
    loss = torch.tensor(AGG_LOSS, requires_grad=True)
    total = aggregate_loss(loss, torch.zeros(3, 4), mode, norm_constant=norm_constant)
    assert total.item() == 0.0
    total.backward()
    assert torch.equal(loss.grad, torch.zeros(3, 4))


@pytest.mark.parametrize(
    ("mode", "norm_constant", "expected_parts"),
    [
        ("token_mean", None, [3 / 6, 26 / 6]),  # mini-batch denominator: 2 + 4 = 6 tokens
        ("seq_mean_token_mean", None, [1.5 / 2, 6.5 / 2]),  # denominator: 1 + 1 = 2 sequences
        ("seq_mean_token_sum_norm", 4.0, [0.75 / 2, 6.5 / 2]),  # 3/4 and 26/4 over 2 sequences
    ],
)
def test_aggregate_loss_micro_batches_sum_to_mini_batch(mode, norm_constant, expected_parts):
    loss = torch.tensor(AGG_LOSS)
    micro_batches = [(loss[:1], AGG_MASK[:1]), (loss[1:], AGG_MASK[1:])]
    denominator = sum(loss_denominator(mask, mode) for _, mask in micro_batches)
    parts = [
        aggregate_loss(lo, m, mode, norm_constant=norm_constant, denominator=denominator)
        for lo, m in micro_batches
    ]
    close(torch.stack(parts), expected_parts)
    whole = dict((m, e) for m, _, e in AGG_CASES)[mode]
    close(sum(parts), whole)


def test_loss_denominator_counts():
    assert loss_denominator(AGG_MASK, "token_mean").item() == 6  # 2 + 4 + 0 tokens
    assert loss_denominator(AGG_MASK, "seq_mean_token_mean").item() == 2  # rows 0 and 1


def test_seq_mean_token_sum_norm_requires_norm_constant():
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate_loss(torch.tensor(AGG_LOSS), AGG_MASK, "seq_mean_token_sum_norm")


def test_masked_mean_along_dim_and_empty():
    x = torch.tensor([[1.0, 3.0, float("nan")], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    close(masked_mean(x, mask, dim=-1), [2.0, 0.0])  # (1+3)/2; empty row -> 0, not NaN
    close(masked_mean(x, mask), 2.0)


# ---------------------------------------------------------------------------------------------------------
# Rollout importance sampling

# rollout_logp = 0, so ρ = exp(old_logp) is the listed ratio.
#   row 0 (valid):   ρ = [3, 1.5, 0.25, 1], all masked in
#   row 1 (invalid): rollout logprobs are NaN; weights must be exactly 1, and it is left out of metrics
#   row 2 (valid):   ρ = [4, 4] on two masked-in tokens, then padding holding ρ = 7
IS_RATIOS = [[3.0, 1.5, 0.25, 1.0], [1.0, 1.0, 1.0, 1.0], [4.0, 4.0, 7.0, 7.0]]
IS_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
IS_VALID = torch.tensor([True, False, True])
SEQ0 = 1.0298836  # row 0 geometric mean: (3 · 1.5 · 0.25 · 1)^(1/4) = 1.125^0.25


def _is_inputs():
    old = torch.tensor(IS_RATIOS, dtype=torch.float64).log()
    rollout = torch.zeros(3, 4, dtype=torch.float64)
    rollout[1] = float("nan")
    return old, rollout


@pytest.mark.parametrize(
    ("mode", "level", "expected"),
    [
        # min(ρ, 2)
        ("truncate", "token", [[2.0, 1.5, 0.25, 1.0], [1.0] * 4, [2.0, 2.0, 1.0, 1.0]]),
        # ρ kept inside [1/2, 2], else 0: 3 -> 0, 0.25 -> 0, 4 -> 0
        ("mask", "token", [[0.0, 1.5, 0.0, 1.0], [1.0] * 4, [0.0, 0.0, 1.0, 1.0]]),
        # row 0: SEQ0 = 1.0298836 on each token; row 2: sqrt(4 · 4) = 4 -> min(4, 2) = 2
        ("truncate", "sequence", [[SEQ0] * 4, [1.0] * 4, [2.0, 2.0, 1.0, 1.0]]),
        # row 2: 4 > 2 -> the whole sequence gets 0
        ("mask", "sequence", [[SEQ0] * 4, [1.0] * 4, [0.0, 0.0, 1.0, 1.0]]),
    ],
)
def test_rollout_is_weights(mode, level, expected):
    old, rollout = _is_inputs()
    weights, _ = rollout_is_weights(old, rollout, IS_MASK, valid_B=IS_VALID, mode=mode, level=level)
    close(weights, expected)
    assert weights[1].tolist() == [1.0] * 4  # invalid sample: exactly 1, no NaN


def test_rollout_is_metrics_truncate_token():
    old, rollout = _is_inputs()
    _, metrics = rollout_is_weights(old, rollout, IS_MASK, valid_B=IS_VALID, mode="truncate", level="token")
    # Over the 6 masked tokens of valid rows, ρ = [3, 1.5, 0.25, 1, 4, 4], w = [2, 1.5, 0.25, 1, 2, 2]
    close(metrics["mismatch_kl_k1"], -0.4817286)  # mean(-ln ρ) = -ln(3·1.5·0.25·1·4·4)/6 = -ln(18)/6
    # ρ - 1 - ln ρ: 0.9013877 + 0.0945349 + 0.6362944 + 0 + 2·1.6137056 = 4.8596283; / 6
    close(metrics["mismatch_kl_k3"], 0.8099380)
    close(metrics["is_weight_mean"], 8.75 / 6)  # (2 + 1.5 + 0.25 + 1 + 2 + 2) / 6
    close(metrics["is_truncated_frac"], 3 / 6)  # 3, 4, 4 exceed 2
    close(metrics["is_masked_frac"], 0.0)
    close(metrics["is_ess"], 5 / 6)  # (Σw)² / (n·Σw²) = 8.75² / (6 · 15.3125) = 76.5625 / 91.875
    close(metrics["is_valid_frac"], 2 / 3)


def test_rollout_is_metrics_mask_token():
    old, rollout = _is_inputs()
    _, metrics = rollout_is_weights(old, rollout, IS_MASK, valid_B=IS_VALID, mode="mask", level="token")
    close(metrics["is_masked_frac"], 4 / 6)  # 3, 0.25, 4, 4 are outside [0.5, 2]
    close(metrics["is_truncated_frac"], 0.0)
    close(metrics["is_weight_mean"], 2.5 / 6)  # (1.5 + 1) / 6


def test_rollout_is_mask_mode_lower_bound():
    old = torch.tensor([[0.1, 0.1]], dtype=torch.float64).log()
    rollout, mask = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2)
    for level in ("token", "sequence"):
        truncated, _ = rollout_is_weights(old, rollout, mask, mode="truncate", level=level)
        close(truncated, [[0.1, 0.1]])  # TIS only bounds from above
        masked, _ = rollout_is_weights(old, rollout, mask, mode="mask", level=level)
        close(masked, [[0.0, 0.0]])  # 0.1 < 1/2


def test_rollout_is_invalid_samples_match_dropping_them():
    old, rollout = _is_inputs()
    _, with_invalid = rollout_is_weights(old, rollout, IS_MASK, valid_B=IS_VALID)
    keep = torch.tensor([0, 2])
    _, without = rollout_is_weights(old[keep], rollout[keep], IS_MASK[keep])
    for name in ("mismatch_kl_k1", "mismatch_kl_k3", "is_weight_mean", "is_truncated_frac", "is_ess"):
        close(with_invalid[name], without[name].item())
    close(without["is_valid_frac"], 1.0)  # valid_B=None means every sample is valid


def test_rollout_is_weights_are_detached():
    old = torch.zeros(1, 2, requires_grad=True)
    weights, _ = rollout_is_weights(old, torch.full((1, 2), -0.1), torch.ones(1, 2))
    assert not weights.requires_grad
    close(weights, [[1.1051709, 1.1051709]])  # e^0.1
