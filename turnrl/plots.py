"""Reward and length curves as a PNG (O3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_curves(history: list[dict[str, Any]], out: str | Path) -> Path | None:
    """Training reward (mean ± std), eval reward and mean model tokens per trajectory, per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [m for m in history if "rollout/reward_mean" in m and "eval/reward_mean" not in m]
    evals = [m for m in history if "eval/reward_mean" in m]
    if not train and not evals:
        return None
    fig, (ax_r, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        steps = [m["step"] for m in train]
        mean = [m["rollout/reward_mean"] for m in train]
        std = [m.get("rollout/reward_std", 0.0) for m in train]
        ax_r.plot(steps, mean, label="train reward (sampled)")
        ax_r.fill_between(steps, [a - b for a, b in zip(mean, std, strict=True)],
                          [a + b for a, b in zip(mean, std, strict=True)], alpha=0.15, label="± std")
        ax_l.plot(steps, [m["rollout/model_tokens_mean"] for m in train], label="model tokens / trajectory")
        ax_l.plot(steps, [m["rollout/turns_mean"] * 10 for m in train], label="turns × 10", linestyle="--")
    if evals:
        ax_r.plot([m["step"] for m in evals], [m["eval/reward_mean"] for m in evals], "o-", label="eval reward (greedy)")
        sampled = [m for m in evals if "eval/sampled_reward_mean" in m]
        if sampled:
            ax_r.plot([m["step"] for m in sampled], [m["eval/sampled_reward_mean"] for m in sampled], "s--",
                      label="eval reward (sampled)")
    ax_r.set_xlabel("step")
    ax_r.set_ylabel("reward")
    ax_r.legend()
    ax_r.grid(alpha=0.3)
    ax_l.set_xlabel("step")
    ax_l.legend()
    ax_l.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
