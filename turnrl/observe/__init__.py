"""Seeing what a run does: rollout statistics and trajectory JSONL (stats.py), MLflow traces (tracing.py), the
watchdog that names a stuck component (watchdog.py), `turnrl view` (viewer.py) and curves (plots.py)."""
