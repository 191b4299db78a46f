"""The composition root: what `build_stack` / `build_trainer` build, in which order, and what `close` stops."""

from __future__ import annotations

import json

import pytest
from fakes import ScriptedEngine

import turnrl.models
from turnrl.build import Stack, build_stack, build_trainer
from turnrl.config import EngineConfig, RolloutConfig, TrainConfig
from turnrl.data import DataError
from turnrl.engines.http import HttpEngine
from turnrl.observe.tracing import TrajectoryTracer
from turnrl.render import ChatRenderer
from turnrl.rollout import RolloutManager


@pytest.fixture
def no_weights(monkeypatch):
    """Any weight load fails the test: what it checks must fail (or pass) before a model loads."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(turnrl.models, "load_model", refuse)


def _rows(tmp_path, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    return str(path)


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"train_data": "/nonexistent/train.jsonl"}, DataError, "data file /nonexistent/train.jsonl does not exist"),
    ({"eval_data": "/nonexistent/eval.jsonl"}, DataError, "data file /nonexistent/eval.jsonl does not exist"),
    ({"reward": {"function": "/nonexistent/reward.py:score"}}, FileNotFoundError, "/nonexistent/reward.py"),
    ({"rollout": {"env": "/nonexistent/env.py"}}, FileNotFoundError, "environment file /nonexistent/env.py"),
    ({"rollout": {"env": "single_turn", "scheduler": "nope"}}, ValueError, "unknown scheduler 'nope'"),
])
def test_build_trainer_checks_data_reward_and_env_before_any_weights_load(tmp_path, no_weights, change, error, message):
    cfg = TrainConfig(**{"model": "tiny-qwen3", "train_data": _rows(tmp_path), "output_dir": str(tmp_path / "run"),
                         **change})
    with pytest.raises(error, match=message):
        build_trainer(cfg)


def test_server_engines_load_no_weights_and_no_config_builds_no_rollout(no_weights):
    stack = build_stack("tiny-qwen3", None, EngineConfig(kind="http", urls=["http://127.0.0.1:9"]))
    assert isinstance(stack.engine, HttpEngine) and stack.rollout is None and not stack.tracer.enabled
    stack.close()
    stack.close()  # idempotent


def test_the_local_rollout_runs_on_the_stack_engine(no_weights):
    cfg = RolloutConfig(env="single_turn", max_turns=1)
    stack = build_stack("tiny-qwen3", cfg, EngineConfig(kind="http", urls=["http://127.0.0.1:9"]))
    assert isinstance(stack.rollout, RolloutManager) and stack.rollout.engine is stack.engine
    assert stack.rollout.renderer is stack.renderer and stack.stops == (stack.engine.close,)


def test_close_stops_the_engine_and_flushes_the_tracer(qwen3_tokenizer):
    closed = []

    class Tracer(TrajectoryTracer):
        def close(self) -> None:
            closed.append("tracer")

    engine = ScriptedEngine(qwen3_tokenizer, lambda *a: "ok")
    stack = Stack(engine, ChatRenderer(qwen3_tokenizer), None, Tracer(None), (engine.close,))
    stack.close()
    stack.close()
    assert engine.closed == 1 and closed == ["tracer"]  # once
