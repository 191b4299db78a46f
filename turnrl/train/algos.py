"""The math of policy-gradient RL for LLMs: advantages, the clipped policy loss, KL, loss aggregation.

Everything here is pure: tensors in, tensors out, no config objects, no I/O, no distributed calls, so every
function can be checked against numbers worked out by hand (tests/test_algos.py). Shapes are in the names:
B = sequences, T = response tokens (padded), G = groups.

The GRPO variants implemented, each a combination of the pieces below:
- GRPO (Shao et al. 2024, DeepSeekMath): `grpo_advantages`, `policy_loss`, `kl_penalty(kind="k3")`,
  `aggregate_loss(mode="seq_mean_token_mean")`.
- Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): `grpo_advantages(normalize_std=False)`
  and `aggregate_loss(mode="seq_mean_token_sum_norm")`.
- DAPO (Yu et al. 2025): clip-higher (`clip_high > clip_low`) and `aggregate_loss(mode="token_mean")`.
  Dynamic sampling (dropping groups with one reward) is the trainer's; `group_reward_stats` counts them.
- GSPO (Zheng et al. 2025): `policy_loss(ratio_level="sequence")`.
- RLOO (Ahmadian et al. 2024, "Back to Basics"): `rloo_advantages`.
- Dual-clip PPO (Ye et al. 2020): `policy_loss(dual_clip=...)`.
- Rollout/trainer mismatch correction: `rollout_is_weights`, truncated (TIS, Yao et al. 2025, "Your efficient
  RL framework secretly brings you off-policy RL training") or masked (MIS, Liu et al. 2025, "When speed
  kills stability"), per token or per sequence.

Conventions a trainer relies on:
- Masks are bool or 0/1; nonzero means "train on this token". Values at masked-out positions never leak
  into results, even NaN.
- `policy_loss` returns a loss to *minimise* (the negated surrogate objective), per token. Per-token
  terms are combined first, then reduced once:
      loss_B_T = pg_loss_B_T * is_weights_B_T + kl_coef * kl_penalty(logp_B_T, ref_logp_B_T, kind)
      loss = aggregate_loss(loss_B_T, mask_B_T, mode, denominator=...)
- Metrics are dicts of detached 0-dim tensors; call `.item()` when logging, not in the hot path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor

AggregationMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
RatioLevel = Literal["token", "sequence"]
ISMode = Literal["truncate", "mask"]
Groups = Tensor | Sequence[Sequence[int]]
"""Group membership: an integer id per sample (`group_B`, any values), or one list of sample indices per group."""

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to ±20 before `exp`: e^20 ≈ 5e8 is far past any clip bound, and the clamp keeps
one garbage logprob from turning a loss into inf or NaN."""

CONSTANT_GROUP_ATOL = 1e-9
"""A group whose rewards span at most this (max - min) is constant: its advantages are exactly 0. Without it,
float rounding in the group mean (e.g. three float64 rewards of 0.1) gives advantages of ±1e-17 / eps."""


# ---------------------------------------------------------------------------------------------------------
# Masked reductions


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` over positions where `mask` is nonzero (all of them, or along `dim`)."""
    # `where`, not `x * mask`: NaN * 0 is NaN, and padding positions may hold anything.
    return torch.where(mask.bool(), x, 0.0).sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is nonzero; 0 (not NaN) where there are none."""
    count = mask.bool().sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def _check_shapes(expected: torch.Size, **tensors: Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.shape != expected:
            raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(tensor.shape)}")


# ---------------------------------------------------------------------------------------------------------
# Group advantages


class _GroupView(NamedTuple):
    reward_B: Tensor  # float64
    gid_B: Tensor  # contiguous group id in 0..G-1
    size_G: Tensor
    mean_G: Tensor  # float64
    constant_G: Tensor  # bool: max - min <= CONSTANT_GROUP_ATOL (singletons included)


def _group_ids(group: Groups, batch_size: int) -> Tensor:
    """Contiguous group ids 0..G-1 per sample, from arbitrary integer ids or from index lists."""
    if isinstance(group, Tensor):
        _check_shapes(torch.Size([batch_size]), group_B=group)
        return torch.unique(group, return_inverse=True)[1]
    owner = [-1] * batch_size
    for g, indices in enumerate(group):
        for i in indices:
            if not 0 <= i < batch_size or owner[i] != -1:
                raise ValueError(
                    f"group index lists must partition range({batch_size}); index {i} is "
                    "out of range or in two groups"
                )
            owner[i] = g
    if -1 in owner:
        raise ValueError(
            f"group index lists must partition range({batch_size}); sample {owner.index(-1)} is in no group"
        )
    return torch.tensor(owner, dtype=torch.long)


def _group_view(rewards_B: Tensor, group: Groups) -> _GroupView:
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards_B must be 1-D (one scalar per sample), got shape {tuple(rewards_B.shape)}")
    # float64: float32 rewards are exactly representable, so sums of up to 2^29 of them are exact.
    reward_B = rewards_B.detach().double()
    gid_B = _group_ids(group, reward_B.shape[0]).to(reward_B.device)
    num_groups = int(gid_B.max()) + 1 if gid_B.numel() else 0
    size_G = torch.bincount(gid_B, minlength=num_groups)
    zeros_G = reward_B.new_zeros(num_groups)
    mean_G = zeros_G.index_add(0, gid_B, reward_B) / size_G.clamp(min=1)
    max_G = zeros_G.scatter_reduce(0, gid_B, reward_B, "amax", include_self=False)
    min_G = zeros_G.scatter_reduce(0, gid_B, reward_B, "amin", include_self=False)
    return _GroupView(reward_B, gid_B, size_G, mean_G, (max_G - min_G) <= CONSTANT_GROUP_ATOL)


def _advantage_dtype(rewards_B: Tensor) -> torch.dtype:
    return rewards_B.dtype if rewards_B.is_floating_point() else torch.get_default_dtype()


def grpo_advantages(
    rewards_B: Tensor, group_B: Groups, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages: A_i = (r_i - mean_g) / (std_g + eps), over the group g that sample i belongs to.

    std_g is the *unbiased* sample std (divides by n - 1), like `torch.std` in verl and TRL, so a group
    [1, 2, 3] gets exactly [-1, 0, 1]. `normalize_std=False` is Dr. GRPO: A_i = r_i - mean_g, which drops
    the std division's bias toward groups that are nearly all right or all wrong. Groups may differ in
    size; a constant group (all rewards equal, singletons included) gets exactly 0. Computed in float64,
    returned in the rewards' dtype, detached.
    """
    view = _group_view(rewards_B, group_B)
    centered_B = view.reward_B - view.mean_G[view.gid_B]
    if normalize_std:
        sq_dev_G = torch.zeros_like(view.mean_G).index_add(0, view.gid_B, centered_B**2)
        std_G = (sq_dev_G / (view.size_G - 1).clamp(min=1)).sqrt()
        centered_B = centered_B / (std_G[view.gid_B] + eps)
    adv_B = torch.where(view.constant_G[view.gid_B], 0.0, centered_B)
    return adv_B.to(_advantage_dtype(rewards_B))


def rloo_advantages(rewards_B: Tensor, group_B: Groups) -> Tensor:
    """REINFORCE leave-one-out: A_i = r_i - mean of the *other* rewards in i's group.

    Equals n/(n-1) · (r_i - mean_g) for a group of size n. Singletons (no other sample to compare with)
    and constant groups get exactly 0. Computed in float64, returned in the rewards' dtype, detached.
    """
    view = _group_view(rewards_B, group_B)
    size_B = view.size_G[view.gid_B].double()
    centered_B = view.reward_B - view.mean_G[view.gid_B]
    adv_B = torch.where(view.constant_G[view.gid_B], 0.0, centered_B * size_B / (size_B - 1).clamp(min=1))
    return adv_B.to(_advantage_dtype(rewards_B))


def group_reward_stats(rewards_B: Tensor, group_B: Groups) -> dict[str, Tensor]:
    """How many groups, their mean size, and the fraction that is constant: every reward equal, so zero
    advantage and no learning signal (what DAPO's dynamic sampling filters out)."""
    view = _group_view(rewards_B, group_B)
    return {
        "num_groups": torch.tensor(float(view.size_G.numel())),
        "mean_group_size": view.size_G.double().mean(),
        "constant_group_frac": view.constant_G.double().mean(),
    }


# ---------------------------------------------------------------------------------------------------------
# Policy loss and KL


def policy_loss(
    logp_B_T: Tensor,
    old_logp_B_T: Tensor,
    adv_B: Tensor,
    mask_B_T: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_level: RatioLevel = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO clipped surrogate, as a loss to minimise, and its diagnostics.

    With ratio ρ = π_θ / π_old and advantage A (PPO, Schulman et al. 2017; separate bounds = DAPO's
    clip-higher):
        loss = max(-A·ρ, -A·clip(ρ, 1 - clip_low, 1 + clip_high))
    `dual_clip=c` (c > 1, e.g. 3) also caps the loss of negative-advantage tokens at -A·c (Ye et al. 2020):
    a token whose ratio exploded pushes with at most c times its advantage, and gets no gradient past it.

    `ratio_level="sequence"` is GSPO: every token of sequence i uses s_i = exp(mean_t log ρ_i,t), the
    geometric-mean token ratio, and clipping acts on s_i (GSPO uses clip ranges near 3e-4, not 0.2). It is
    written in GSPO-token form, s_i · π_θ(y_t) / sg[π_θ(y_t)]: the value at each token is s_i, and the
    "seq_mean_token_mean" aggregate has exactly the gradient of the sequence-level objective.

    Returns loss_B_T (0 where the mask is 0) and metrics over masked tokens: clip_frac_low / clip_frac_high
    (the clipped branch is taken, so no gradient: A < 0 and ρ < 1 - clip_low / A > 0 and ρ > 1 + clip_high),
    clip_frac (their sum), dual_clip_frac (A < 0 and ρ > c), ratio_mean, and approx_kl, the k3 estimate of
    KL(π_old ‖ π_θ) from the token ratios.
    """
    _check_shapes(logp_B_T.shape, old_logp_B_T=old_logp_B_T, mask_B_T=mask_B_T)
    _check_shapes(logp_B_T.shape[:1], adv_B=adv_B)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (e.g. 3.0) or None, got {dual_clip}")
    mask_B_T = mask_B_T.bool()
    # Masked before exp, so padding can't produce inf/NaN values or gradients.
    token_log_ratio_B_T = (logp_B_T - old_logp_B_T.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_log_ratio_B_T = torch.where(mask_B_T, token_log_ratio_B_T, 0.0)
    if ratio_level == "token":
        log_ratio_B_T = token_log_ratio_B_T
    elif ratio_level == "sequence":
        seq_log_ratio_B = masked_mean(token_log_ratio_B_T, mask_B_T, dim=-1).detach()
        token_grad_B_T = torch.where(mask_B_T, logp_B_T - logp_B_T.detach(), 0.0)
        log_ratio_B_T = seq_log_ratio_B[:, None] + token_grad_B_T
    else:
        raise ValueError(f"ratio_level must be 'token' or 'sequence', got {ratio_level!r}")

    ratio_B_T = log_ratio_B_T.exp()
    adv_B_1 = adv_B.detach()[:, None].to(ratio_B_T.dtype)
    clipped_ratio_B_T = ratio_B_T.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_B_T = torch.maximum(-adv_B_1 * ratio_B_T, -adv_B_1 * clipped_ratio_B_T)
    if dual_clip is not None:
        loss_B_T = torch.where(adv_B_1 < 0, torch.minimum(loss_B_T, -adv_B_1 * dual_clip), loss_B_T)
    loss_B_T = torch.where(mask_B_T, loss_B_T, 0.0)

    return loss_B_T, _clip_metrics(ratio_B_T.detach(), token_log_ratio_B_T.detach(), adv_B_1, mask_B_T,
                                   clip_low, clip_high, dual_clip)


@torch.no_grad()
def _clip_metrics(ratio_B_T: Tensor, token_log_ratio_B_T: Tensor, adv_B_1: Tensor, mask_B_T: Tensor,
                  clip_low: float, clip_high: float, dual_clip: float | None) -> dict[str, Tensor]:
    """policy_loss's diagnostics over masked tokens (see its docstring)."""
    low_B_T = (adv_B_1 < 0) & (ratio_B_T < 1.0 - clip_low)
    high_B_T = (adv_B_1 > 0) & (ratio_B_T > 1.0 + clip_high)
    dual_B_T = (adv_B_1 < 0) & (ratio_B_T > (dual_clip if dual_clip is not None else float("inf")))
    return {
        "clip_frac": masked_mean((low_B_T | high_B_T).double(), mask_B_T),
        "clip_frac_low": masked_mean(low_B_T.double(), mask_B_T),
        "clip_frac_high": masked_mean(high_B_T.double(), mask_B_T),
        "dual_clip_frac": masked_mean(dual_B_T.double(), mask_B_T),
        "ratio_mean": masked_mean(ratio_B_T, mask_B_T),
        "approx_kl": masked_mean(token_log_ratio_B_T.exp() - 1 - token_log_ratio_B_T, mask_B_T),
    }


def kl_penalty(logp_B_T: Tensor, ref_logp_B_T: Tensor, kind: KLKind = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from tokens sampled by π_θ (Schulman 2020, "Approximating
    KL Divergence"). With d = logp - ref_logp, i.e. r = π_ref / π_θ = e^-d:

        k1 = d                                 unbiased, high variance, can be negative
        k2 = d² / 2                            biased, low variance, >= 0
        k3 = r - 1 - log r = e^-d + d - 1      unbiased, low variance, >= 0 (GRPO's choice)
        low_var_kl = k3 with -d clamped to ±20 and the result clamped to [-10, 10] (verl's guard; k3 >= 0,
                     so only the upper bound ever acts)

    Used as a loss term on on-policy samples, the *gradients* are what matter: E[∇k1] = 0,
    E[∇k2] = ∇KL(π_θ ‖ π_ref), and E[∇k3] = ∇KL(π_ref ‖ π_θ). Not masked: `aggregate_loss` does that.
    """
    _check_shapes(logp_B_T.shape, ref_logp_B_T=ref_logp_B_T)
    d_B_T = logp_B_T - ref_logp_B_T.detach()
    if kind == "k1":
        return d_B_T
    if kind == "k2":
        return 0.5 * d_B_T.square()
    if kind == "k3":
        return (-d_B_T).exp() + d_B_T - 1
    if kind == "low_var_kl":
        d_B_T = d_B_T.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return ((-d_B_T).exp() + d_B_T - 1).clamp(-10.0, 10.0)
    raise ValueError(f"kind must be one of 'k1', 'k2', 'k3', 'low_var_kl', got {kind!r}")


# ---------------------------------------------------------------------------------------------------------
# Loss aggregation


def loss_denominator(mask_B_T: Tensor, mode: AggregationMode) -> Tensor:
    """What `aggregate_loss` divides by: masked tokens for "token_mean"; for the seq_* modes, sequences with
    at least one masked token. Sum it over micro-batches to get a mini-batch's `denominator`."""
    mask_B_T = mask_B_T.bool()
    if mode == "token_mean":
        return mask_B_T.sum()
    if mode in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        return mask_B_T.any(dim=-1).sum()
    raise ValueError(f"mode must be one of {get_args(AggregationMode)}, got {mode!r}")


def aggregate_loss(
    loss_B_T: Tensor,
    mask_B_T: Tensor,
    mode: AggregationMode = "token_mean",
    *,
    norm_constant: float | None = None,
    denominator: Tensor | float | None = None,
) -> Tensor:
    """Reduce a per-token loss ℓ to a scalar, over positions where the mask m is nonzero:

        token_mean               Σ_i Σ_t m·ℓ / Σ_i Σ_t m              (DAPO: every token weighs the same)
        seq_mean_token_mean      mean_i (Σ_t m·ℓ / Σ_t m)             (GRPO: every sequence weighs the same)
        seq_mean_token_sum_norm  mean_i (Σ_t m·ℓ / norm_constant)     (Dr. GRPO: no length bias)

    "Sequences" are rows with at least one masked token: fully masked rows add nothing and are not counted.
    `norm_constant` (required by the last mode) should be fixed for the run, e.g. the max response length,
    not the padded width, which changes from batch to batch. With nothing to count (an all-zero mask) the
    result is 0, not NaN, still attached to the graph so `backward()` gives zero gradients.

    Micro-batches: with `denominator` = the sum of `loss_denominator(mask, mode)` over all micro-batches
    of a mini-batch, each micro-batch's result is its share, and the sum over micro-batches equals this
    function on the whole mini-batch. So call `backward()` on each and do not divide by the number of
    micro-batches. (If data-parallel ranks average gradients, sum the denominator over ranks too and divide
    it by the world size.) A denominator of 0 is treated as 1; the numerator is then 0 as well.
    """
    _check_shapes(loss_B_T.shape, mask_B_T=mask_B_T)
    mask_B_T = mask_B_T.bool()
    if mode == "token_mean":
        numerator = masked_sum(loss_B_T, mask_B_T)
    elif mode == "seq_mean_token_mean":
        numerator = masked_mean(loss_B_T, mask_B_T, dim=-1).sum()
    elif mode == "seq_mean_token_sum_norm":
        if norm_constant is None or norm_constant <= 0:
            raise ValueError(
                "mode 'seq_mean_token_sum_norm' needs a positive norm_constant (e.g. the max "
                f"response length), got {norm_constant}"
            )
        numerator = masked_sum(loss_B_T, mask_B_T, dim=-1).sum() / norm_constant
    else:
        raise ValueError(f"mode must be one of {AggregationMode.__args__}, got {mode!r}")
    if denominator is None:
        denominator = loss_denominator(mask_B_T, mode)
    denominator = torch.as_tensor(denominator, dtype=numerator.dtype, device=numerator.device)
    return numerator / torch.where(denominator > 0, denominator, 1.0)


# ---------------------------------------------------------------------------------------------------------
# Rollout importance sampling


def rollout_is_weights(
    old_logp_B_T: Tensor,
    rollout_logp_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    valid_B: Tensor | None = None,
    mode: ISMode = "truncate",
    level: RatioLevel = "token",
    threshold: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights for the gap between the inference engine and the trainer.

    The engine samples from π_rollout; the trainer recomputes π_old for the same tokens and they differ
    (kernels, precision, batch shapes), so the loss, which assumes π_old sampled, is off-policy. With
    ρ = π_old / π_rollout = exp(old_logp - rollout_logp), log ρ clamped to ±20:

        mode="truncate" (TIS): w = min(ρ, threshold)
        mode="mask"     (MIS): w = ρ if 1/threshold <= ρ <= threshold else 0

    MIS drops tokens (or whole sequences) whose mismatch is too large in either direction; dropped tokens
    still count in `aggregate_loss`'s denominator, so they shrink the step instead of reweighting the rest.
    level="token" uses ρ per token; level="sequence" gives every token of sequence i the same
    ρ_i = exp(mean_t log ρ_i,t), the geometric mean (the product would explode or vanish with length).

    Weights are detached and multiply the per-token policy loss. They are 1 where the mask is 0, and exactly
    1 on every token of samples whose `valid_B` is False (no rollout logprobs: no correction for them;
    their rollout_logp may hold anything, NaN included). Metrics are over masked tokens of valid samples:
    mismatch_kl_k1 / mismatch_kl_k3 (estimates of KL(π_rollout ‖ π_old)), is_weight_mean,
    is_truncated_frac (ρ > threshold, truncate mode), is_masked_frac (weight set to 0, mask mode),
    is_ess ((Σw)² / (n·Σw²), the effective sample size as a fraction of n), and is_valid_frac (of samples).
    """
    _check_shapes(old_logp_B_T.shape, rollout_logp_B_T=rollout_logp_B_T, mask_B_T=mask_B_T)
    if valid_B is None:
        valid_B = torch.ones(old_logp_B_T.shape[0], dtype=torch.bool, device=old_logp_B_T.device)
    _check_shapes(old_logp_B_T.shape[:1], valid_B=valid_B)
    if threshold < 1.0:
        raise ValueError(f"threshold must be >= 1 (e.g. 2.0), got {threshold}")
    used_B_T = mask_B_T.bool() & valid_B.bool()[:, None]
    token_log_ratio_B_T = torch.where(used_B_T, old_logp_B_T.detach() - rollout_logp_B_T.detach(), 0.0)
    token_log_ratio_B_T = token_log_ratio_B_T.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if level == "token":
        log_ratio_B_T = token_log_ratio_B_T
    elif level == "sequence":
        seq_log_ratio_B = masked_mean(token_log_ratio_B_T, used_B_T, dim=-1)
        log_ratio_B_T = torch.where(used_B_T, seq_log_ratio_B[:, None], 0.0)
    else:
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")

    weights_B_T, truncated_B_T, rejected_B_T = _is_weights(log_ratio_B_T.exp(), mode, threshold)
    weights_B_T = torch.where(used_B_T, weights_B_T, 1.0)
    return weights_B_T, _is_metrics(weights_B_T, token_log_ratio_B_T, used_B_T, truncated_B_T, rejected_B_T, valid_B)


def _is_weights(ratio_B_T: Tensor, mode: ISMode, threshold: float) -> tuple[Tensor, Tensor, Tensor]:
    """(weights, truncated, rejected) of TIS or MIS for ratios ρ (see rollout_is_weights)."""
    none_B_T = torch.zeros_like(ratio_B_T, dtype=torch.bool)
    if mode == "truncate":
        return ratio_B_T.clamp(max=threshold), ratio_B_T > threshold, none_B_T
    if mode == "mask":
        rejected_B_T = (ratio_B_T < 1.0 / threshold) | (ratio_B_T > threshold)
        return torch.where(rejected_B_T, 0.0, ratio_B_T), none_B_T, rejected_B_T
    raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")


def _is_metrics(weights_B_T: Tensor, token_log_ratio_B_T: Tensor, used_B_T: Tensor, truncated_B_T: Tensor,
                rejected_B_T: Tensor, valid_B: Tensor) -> dict[str, Tensor]:
    """rollout_is_weights's diagnostics over the masked tokens of valid samples (see its docstring)."""
    weight_mean = masked_mean(weights_B_T, used_B_T)
    weight_sq_mean = masked_mean(weights_B_T.square(), used_B_T)
    return {
        "mismatch_kl_k1": masked_mean(-token_log_ratio_B_T, used_B_T),
        "mismatch_kl_k3": masked_mean(token_log_ratio_B_T.exp() - 1 - token_log_ratio_B_T, used_B_T),
        "is_weight_mean": weight_mean,
        "is_truncated_frac": masked_mean(truncated_B_T.to(weights_B_T.dtype), used_B_T),
        "is_masked_frac": masked_mean(rejected_B_T.to(weights_B_T.dtype), used_B_T),
        "is_ess": torch.where(weight_sq_mean > 0, weight_mean.square() / weight_sq_mean, 0.0),
        "is_valid_frac": valid_B.double().mean(),
    }


# ---------------------------------------------------------------------------------------------------------
# The kept set of truncated sampling (top-k / top-p)

_CHUNK_ELEMENTS = 1 << 24
"""Rows are processed in chunks of at most this many selected values (64 MiB of float32), bounding memory."""


def kept_token_logprobs(logits_N_V: Tensor, targets_N: Tensor, kept_N: Tensor) -> Tensor:
    """Logprob of each target token under its row's distribution renormalised over the kept set: what an engine
    that sampled with top-k / top-p reports, log p(y) - log Σ_{v ∈ K} p(v).

    The kept set K of row n is its kept_N[n] largest logits (`GenerateOutput.kept_counts`: top-k and top-p always
    keep a prefix of the tokens sorted by probability). Only the kept *values* enter, so which of several tied
    logits at the boundary is in K does not matter. The target was kept by the engine, so it is in K; when this
    model's logits put it below the kept_N-th (the engine's and the trainer's numbers differ), K is taken as the
    kept_N - 1 largest plus the target. kept_N = V (or more) is the full softmax. Differentiable in the logits;
    the cost is one top-k over min(k, V - k + 1) values per row, never a sort of the vocabulary.
    """
    _check_shapes(logits_N_V.shape[:1], targets_N=targets_N, kept_N=kept_N)
    target_N = logits_N_V.gather(1, targets_N[:, None].long())[:, 0]
    return target_N - kept_logsumexp(logits_N_V, kept_N, target_N)


def kept_logsumexp(logits_N_V: Tensor, kept_N: Tensor, target_N: Tensor) -> Tensor:
    """log Σ exp(logits) over each row's kept set (see `kept_token_logprobs`); `target_N` is the logit of the token
    that must be in it."""
    n, vocab = logits_N_V.shape
    kept_N = kept_N.to(logits_N_V.device).long().clamp(1, vocab)
    lse_N = logits_N_V.logsumexp(-1)  # rows that keep everything
    out_N = lse_N.clone() if n else lse_N
    from_top = (kept_N < vocab) & (kept_N <= vocab // 2)
    from_bottom = (kept_N < vocab) & ~from_top
    for rows in _chunks(from_top.nonzero()[:, 0], kept_N):
        out_N = out_N.index_put((rows,), _lse_from_top(logits_N_V[rows], kept_N[rows], target_N[rows]))
    for rows in _chunks(from_bottom.nonzero()[:, 0], vocab - kept_N + 1):
        out_N = out_N.index_put((rows,), _lse_from_bottom(logits_N_V[rows], kept_N[rows], target_N[rows],
                                                          lse_N[rows]))
    return out_N


def _chunks(rows: Tensor, width_N: Tensor) -> list[Tensor]:
    """`rows` in chunks whose rows × widest selection stays under _CHUNK_ELEMENTS."""
    if rows.numel() == 0:
        return []
    width = int(width_N[rows].max())
    per_chunk = max(1, _CHUNK_ELEMENTS // width)
    return list(rows.split(per_chunk))


def _lse_from_top(logits_R_V: Tensor, kept_R: Tensor, target_R: Tensor) -> Tensor:
    """The kept sets from the k largest values: lse over the top k (or the top k-1 and the target)."""
    top_R_W = logits_R_V.topk(int(kept_R.max()), dim=-1).values  # sorted, largest first
    cum_R_W = top_R_W.logcumsumexp(-1)
    lse_k_R = cum_R_W.gather(1, (kept_R - 1)[:, None])[:, 0]
    threshold_R = top_R_W.gather(1, (kept_R - 1)[:, None])[:, 0]
    lse_k1_R = torch.where(kept_R > 1, cum_R_W.gather(1, (kept_R - 2).clamp(min=0)[:, None])[:, 0], -torch.inf)
    return torch.where(target_R >= threshold_R, lse_k_R, torch.logaddexp(lse_k1_R, target_R))


def _lse_from_bottom(logits_R_V: Tensor, kept_R: Tensor, target_R: Tensor, lse_R: Tensor) -> Tensor:
    """Kept sets larger than half the vocabulary: the whole mass minus the d = V - k smallest values.

    log(e^lse - e^lse_dropped) = lse + log(1 - e^(lse_dropped - lse)); the dropped tokens are the least likely,
    at most half of them, so their share stays below 1/2 and the subtraction is well conditioned."""
    dropped_R = logits_R_V.shape[1] - kept_R  # >= 1
    bottom_R_W = -((-logits_R_V).topk(int(dropped_R.max()) + 1, dim=-1).values)  # smallest first
    cum_R_W = bottom_R_W.logcumsumexp(-1)

    def without(count_R: Tensor) -> Tensor:  # lse over everything but the count_R smallest
        share_R = cum_R_W.gather(1, (count_R - 1)[:, None])[:, 0] - lse_R
        return lse_R + torch.log(-torch.expm1(share_R))

    threshold_R = bottom_R_W.gather(1, dropped_R[:, None])[:, 0]  # the k-th largest
    return torch.where(target_R >= threshold_R, without(dropped_R), torch.logaddexp(without(dropped_R + 1), target_R))


def mismatch_kl_k3(logp_B_T: Tensor, rollout_logp_B_T: Tensor, mask_B_T: Tensor,
                   valid_B: Tensor | None = None) -> Tensor:
    """The k3 estimate of KL(π_rollout ‖ π) over masked tokens of valid samples, from the tokens the engine
    sampled: mean of ρ - 1 - log ρ with ρ = π / π_rollout (as `rollout_is_weights`'s mismatch_kl_k3). With π the
    trainer's logprob renormalised over the kept sets it is `train/mismatch_kl_k3`; with the full softmax,
    `train/mismatch_kl_k3_unmasked`, which also counts the mass top-k / top-p cut (the bias the kept set removes)."""
    _check_shapes(logp_B_T.shape, rollout_logp_B_T=rollout_logp_B_T, mask_B_T=mask_B_T)
    used_B_T = mask_B_T.bool() if valid_B is None else mask_B_T.bool() & valid_B.bool()[:, None]
    log_ratio_B_T = torch.where(used_B_T, logp_B_T.detach() - rollout_logp_B_T.detach(), 0.0)
    log_ratio_B_T = log_ratio_B_T.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return masked_mean(log_ratio_B_T.exp() - 1 - log_ratio_B_T, used_B_T)
