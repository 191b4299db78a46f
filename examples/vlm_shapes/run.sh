#!/usr/bin/env bash
# The whole recipe, timed: data, SFT warm start, GRPO, curves (from the repository root).
#   bash examples/vlm_shapes/run.sh
set -euo pipefail
TURNRL=${TURNRL:-.venv/bin/turnrl}
PYTHON=${PYTHON:-.venv/bin/python}
rm -rf runs/vlm_shapes  # sft.yaml's and rl.yaml's run_dir must be empty: start clean
start=$(date +%s)
$PYTHON examples/vlm_shapes/prepare_data.py --out data/vlm_shapes
$TURNRL sft examples/vlm_shapes/sft.yaml "$@"
sft_done=$(date +%s)
$TURNRL train examples/vlm_shapes/rl.yaml
end=$(date +%s)
$PYTHON examples/plot_recipe.py runs/vlm_shapes --out runs/vlm_shapes/curves.png \
    --title "vlm_shapes: held-out reward"
echo "wall time: SFT $((sft_done - start)) s, RL $((end - sft_done)) s, total $((end - start)) s"
