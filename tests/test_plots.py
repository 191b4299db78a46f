"""The curves every run and recipe writes: each plot function gives a PNG from metrics.jsonl-shaped rows."""

from __future__ import annotations

from turnrl.observe.plots import plot_curves, plot_sft_curves, plot_sft_then_rl

TRAIN = [{"step": float(s), "rollout/reward_mean": 0.1 * s, "train/loss": 1.0 / s, "rollout/model_tokens_mean": 9.0, "rollout/turns_mean": 1.5,
          "rollout/tool_call_rate": 0.5, "rollout/tool_invalid_call_rate": 0.1} for s in range(1, 4)]
EVALS = [{"step": 0.0, "eval/tag": "before", "eval/reward_mean": 0.1, "eval/success_rate": 0.1, "eval/success": 0.1},
         {"step": 3.0, "eval/tag": "after", "eval/reward_mean": 0.5, "eval/success_rate": 0.5, "eval/success": 0.5}]


def is_png(path) -> bool:
    return path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_plot_writes_a_png(tmp_path):
    assert is_png(plot_curves(TRAIN + EVALS, tmp_path / "rl" / "curves.png"))
    assert is_png(plot_sft_curves(TRAIN + EVALS, tmp_path / "sft" / "curves.png"))
    assert is_png(plot_sft_then_rl(TRAIN + EVALS, TRAIN + EVALS, tmp_path / "recipe.png", "a recipe"))
