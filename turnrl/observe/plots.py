"""Reward and length curves as a PNG (O3); tool agents get a third panel (tool-call and invalid-call rates)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_curves(history: list[dict[str, Any]], out: str | Path) -> Path | None:
    """Training reward (mean ± std), eval reward and mean model tokens per trajectory, per step; with tool
    calls in the metrics, also the tool-call rate and the invalid-call rate (sampled rollouts and greedy eval)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [m for m in history if "rollout/reward_mean" in m and "eval/reward_mean" not in m]
    evals = [m for m in history if "eval/reward_mean" in m]
    if not train and not evals:
        return None
    tools = any("rollout/tool_call_rate" in m for m in train) or any("eval/tool_call_rate" in m for m in evals)
    fig, axes = plt.subplots(1, 3 if tools else 2, figsize=(16 if tools else 11, 4))
    ax_r, ax_l = axes[0], axes[1]
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
    if tools:
        plot_tool_rates(axes[2], train, evals)
    ax_r.set_ylabel("reward")
    for ax in (ax_r, ax_l):
        ax.set_xlabel("step")
        ax.legend()
        ax.grid(alpha=0.3)
    return _save(fig, out)


def plot_tool_rates(ax: Any, train: list[dict[str, Any]], evals: list[dict[str, Any]], offset: float = 0.0) -> None:
    """Tool-call rate and invalid-call rate per step on `ax` (train: lines, eval: markers); `offset` shifts the
    steps (a recipe that plots SFT and RL on one axis)."""
    for key, label, colour in (("tool_call_rate", "tool-call rate", "tab:blue"),
                               ("tool_invalid_call_rate", "invalid-call rate", "tab:red")):
        rows = [m for m in train if f"rollout/{key}" in m]
        if rows:
            ax.plot([m["step"] + offset for m in rows], [m[f"rollout/{key}"] for m in rows], color=colour,
                    label=f"{label} (train, sampled)")
        rows = [m for m in evals if f"eval/{key}" in m]
        if rows:
            ax.plot([m["step"] + offset for m in rows], [m[f"eval/{key}"] for m in rows], "o--", color=colour,
                    label=f"{label} (eval, greedy)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("step")
    ax.set_ylabel("fraction")
    ax.legend()
    ax.grid(alpha=0.3)


def plot_sft_curves(history: list[dict[str, Any]], out: str | Path) -> Path | None:
    """`turnrl sft`: the training loss per step, and the held-out evaluation (greedy reward and success)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m for m in history if "train/loss" in m]
    evals = [m for m in history if "eval/reward_mean" in m]
    if not steps:
        return None
    fig, axes = plt.subplots(1, 2 if evals else 1, figsize=(11 if evals else 6, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot([m["step"] for m in steps], [m["train/loss"] for m in steps], label="SFT loss (token-mean NLL)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    if evals:
        ax = axes[0][1]
        ax.plot([m["step"] for m in evals], [m["eval/reward_mean"] for m in evals], "o-", label="eval reward (greedy)")
        ax.plot([m["step"] for m in evals], [m["eval/success"] for m in evals], "s--", label="eval success (greedy)")
        if any("eval/tool_call_rate" in m for m in evals):
            ax.plot([m["step"] for m in evals], [m.get("eval/tool_call_rate", float("nan")) for m in evals], "^:",
                    label="eval tool-call rate")
        ax.set_xlabel("step")
        ax.set_ylim(-0.05, 1.05)
        ax.legend()
        ax.grid(alpha=0.3)
    return _save(fig, out)


def plot_sft_then_rl(sft: list[dict[str, Any]], rl: list[dict[str, Any]], out: str | Path,
                     title: str = "") -> Path:
    """A recipe's curves: the SFT loss; the held-out greedy reward before SFT, after SFT and along RL with the RL
    training reward (sampled), on one step axis (RL steps after the SFT steps); with tool calls, their rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sft_steps = max((m["step"] for m in sft if "train/loss" in m), default=0.0)
    rl_train = [{**m, "step": m["step"] + sft_steps} for m in rl if "rollout/reward_mean" in m and "eval/tag" not in m]
    evals = [m for m in sft if "eval/reward_mean" in m] + [{**m, "step": m["step"] + sft_steps}
                                                          for m in rl if "eval/reward_mean" in m]
    tools = any("rollout/tool_call_rate" in m for m in rl_train)
    fig, axes = plt.subplots(1, 3 if tools else 2, figsize=(16 if tools else 11, 4))
    ax = axes[0]
    loss = [m for m in sft if "train/loss" in m]
    ax.plot([m["step"] for m in loss], [m["train/loss"] for m in loss])
    ax.set(xlabel="SFT step", ylabel="SFT loss (token-mean NLL)", yscale="log", title="SFT")
    ax.grid(alpha=0.3)
    ax = axes[1]
    if rl_train:
        ax.plot([m["step"] for m in rl_train], [m["rollout/reward_mean"] for m in rl_train],
                label="RL training reward (sampled)")
    ax.plot([m["step"] for m in evals], [m["eval/reward_mean"] for m in evals], "o--", label="held-out reward (greedy)")
    ax.axvline(sft_steps, color="grey", linestyle=":", label="SFT → RL")
    ax.set(xlabel="step (SFT, then RL)", ylabel="reward", ylim=(-0.05, 1.05), title=title or "reward")
    ax.legend()
    ax.grid(alpha=0.3)
    if tools:
        plot_tool_rates(axes[2], rl_train, [m for m in evals if "eval/tool_call_rate" in m])
        axes[2].axvline(sft_steps, color="grey", linestyle=":")
    return _save(fig, out)


def _save(fig: Any, out: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
