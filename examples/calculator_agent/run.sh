#!/usr/bin/env bash
# The whole recipe, timed: data, SFT warm start, GRPO, curves (from the repository root).
#   bash examples/calculator_agent/run.sh
set -euo pipefail
TURNRL=${TURNRL:-.venv/bin/turnrl}
PYTHON=${PYTHON:-.venv/bin/python}
rm -rf runs/calculator_agent  # sft.yaml's and rl.yaml's run_dir must be empty: start clean
start=$(date +%s)
$PYTHON examples/calculator_agent/prepare_data.py --out data/calculator_agent
$TURNRL sft examples/calculator_agent/sft.yaml "$@"
sft_done=$(date +%s)
$TURNRL train examples/calculator_agent/rl.yaml
end=$(date +%s)
$PYTHON examples/plot_recipe.py runs/calculator_agent --out runs/calculator_agent/curves.png \
    --title "calculator agent: held-out success"
echo "wall time: SFT $((sft_done - start)) s, RL $((end - sft_done)) s, total $((end - start)) s"
