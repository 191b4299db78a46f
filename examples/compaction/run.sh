#!/usr/bin/env bash
# The compaction recipe, timed: data, SFT warm start, GRPO with rollout.context (summarize); held-out evaluations.
#   bash examples/compaction/run.sh            (from the repository root)
set -euo pipefail
TURNRL=${TURNRL:-.venv/bin/turnrl}
PYTHON=${PYTHON:-.venv/bin/python}
rm -rf runs/compaction  # config.yaml's run_dir must be empty: start clean
start=$(date +%s)
$PYTHON examples/compaction/prepare_data.py --out data/compaction
$TURNRL sft examples/compaction/sft.yaml "$@"
sft_done=$(date +%s)
$TURNRL train examples/compaction/config.yaml
echo "wall time: SFT $((sft_done - start)) s, RL $(( $(date +%s) - sft_done )) s"
