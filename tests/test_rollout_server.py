"""Rollout-server mode (`turnrl serve --scheduler X --plugin F.py`, client `turnrl.rollout.remote.RemoteRollout`): the
scheduler scenarios of test_scheduler.py re-run through the server give the same trajectories as in one process;
plugins are imported by the server; rewards are computed by the client; weights pushed through the client reach
the server's engine; `/rollout` needs the bearer token."""

from __future__ import annotations

import asyncio
import contextlib
import json
import textwrap
import threading

import httpx
import pytest
import test_scheduler as scenarios  # its schedulers register on import; its test functions are re-run below
import yaml
from fakes import ScriptedEngine
from typer.testing import CliRunner

from turnrl.agents.scheduler import multi_turns
from turnrl.build import build_rollout_manager
from turnrl.cli import app as cli_app
from turnrl.config import RolloutConfig, TrainConfig
from turnrl.engines.base import EngineError
from turnrl.render import ChatRenderer
from turnrl.rollout import run_groups
from turnrl.rollout.remote import RemoteRollout
from turnrl.serve.app import ServerThread, create_app
from turnrl.types import RolloutStatus, SamplingParams, TerminationReason, Trajectory

ROW = scenarios.ROW


@contextlib.contextmanager
def rollout_server(engine, tok, cfg: RolloutConfig, *, token=None, heartbeat_s=15.0, model_name="turnrl"):
    """A server as `turnrl serve` builds it: build_rollout_manager over the server's own engine."""
    manager = build_rollout_manager(cfg, engine, ChatRenderer(tok))
    server = ServerThread(create_app(engine, None, token=token, model_name=model_name, rollout=manager,
                                     heartbeat_s=heartbeat_s))
    try:
        yield server.start(), manager
    finally:
        server.stop()


def scheduler_name(scheduler) -> str:
    if isinstance(scheduler, str):
        return scheduler
    name = f"remote_{scheduler.__name__}"  # a class defined in a test: the server resolves names
    multi_turns[name] = scheduler
    return name


def remote_rollout(tok, script, scheduler, rows=None, *, n=1, max_turns=4, max_new_tokens=64, reward=None,
                   env_config=None, latency_s=0.0, trajectory_timeout_s=None):
    """test_scheduler.rollout, through a rollout server and RemoteRollout (the reward is the client's)."""
    engine = ScriptedEngine(tok, script, latency_s=latency_s)
    cfg = RolloutConfig(scheduler=scheduler_name(scheduler), max_turns=max_turns, max_new_tokens=max_new_tokens,
                        env_config=env_config or {}, trajectory_timeout_s=trajectory_timeout_s, concurrency=8)
    with rollout_server(engine, tok, cfg) as (url, _):
        remote = RemoteRollout(url, renderer=ChatRenderer(tok), reward_fn=reward)
        groups = asyncio.run(run_groups(remote, rows or [ROW], n=n))
    return [t for g in groups for t in g], engine


def local_rollout(tok, script, scheduler, rows=None, *, n=1, max_turns=4, max_new_tokens=64, reward=None,
                  env_config=None, latency_s=0.0, trajectory_timeout_s=None):
    """The single-process path of `turnrl rollout` / `train`: build_rollout_manager from the same config."""
    engine = ScriptedEngine(tok, script, latency_s=latency_s)
    cfg = RolloutConfig(scheduler=scheduler_name(scheduler), max_turns=max_turns, max_new_tokens=max_new_tokens,
                        env_config=env_config or {}, trajectory_timeout_s=trajectory_timeout_s, concurrency=8)
    manager = build_rollout_manager(cfg, engine, ChatRenderer(tok), reward)
    groups = asyncio.run(run_groups(manager, rows or [ROW], n=n))
    return [t for g in groups for t in g], engine


def compared_rollout(tok, *args, **kwargs):
    """Both paths on the same scenario: the server's trajectories must be the single-process ones (the scenario's
    own assertions then run on the server's). Hook side effects of the local run are undone first."""
    state = [scenarios.EVENTS, scenarios.Endless.steps]
    saved = [list(x) for x in state]
    local, local_engine = local_rollout(tok, *args, **kwargs)
    for current, before in zip(state, saved, strict=True):
        current[:] = before
    remote, remote_engine = remote_rollout(tok, *args, **kwargs)
    assert [comparable(t) for t in remote] == [comparable(t) for t in local]  # ids, tokens, masks, infos, statuses
    assert [t.rollout_logprobs for t in remote] == [t.rollout_logprobs for t in local]
    assert [t.reward for t in remote] == [t.reward for t in local]

    def calls(engine):  # per trajectory, in order (trajectories run concurrently)
        return sorted([(c.request_id, c.prompt_ids) for c in engine.calls], key=lambda call: call[0])

    assert calls(remote_engine) == calls(local_engine)
    assert sorted(remote_engine.released) == sorted(local_engine.released)
    return remote, remote_engine


def comparable(traj: Trajectory) -> dict:
    """The trajectory's JSON without wall-clock values (timings, timestamps)."""

    def scrub(value):
        if isinstance(value, dict):
            return {k: scrub(v) for k, v in value.items() if not k.endswith(("_s", "_ns"))}
        if isinstance(value, list):
            return [scrub(v) for v in value]
        return value

    return scrub(json.loads(json.dumps(traj.to_json(), default=str)))


# ---- the scheduler scenarios, through the server --------------------------------------------------
SCENARIOS = [
    "test_default_loop_appends_observations_token_exactly", "test_max_turns_safety_net",
    "test_done_from_on_turn_end_overrides_check_finished_and_length",
    "test_token_edits_continue_one_segment_with_masked_tool_output",
    "test_mask_length_mismatch_fails_the_trajectory_loudly",
    "test_logprob_count_mismatch_turns_correction_off_for_that_trajectory_only",
    "test_text_continuation_is_one_model_segment", "test_on_trajectory_end_runs_once_also_after_failures",
    "test_data_dict_reaches_hooks_and_rollout_infos_reach_rewards", "test_history_rewrite_splits_the_episode",
    "test_run_override_with_a_growing_history_stays_one_sample",
    "test_thinking_tips_one_sample_per_turn_and_split_rewards", "test_math_tip_trick_wrong_then_right",
    "test_gym_frozenlake_reaches_the_goal", "test_gym_length_stop_does_not_end_the_episode_and_unknown_env_fails",
]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scheduler_scenarios_give_the_same_trajectories_through_the_server(scenario, qwen3_tokenizer, monkeypatch):
    monkeypatch.setattr(scenarios, "rollout", compared_rollout)
    getattr(scenarios, scenario)(qwen3_tokenizer)


def test_a_timed_out_trajectory_through_the_server(qwen3_tokenizer, monkeypatch):
    monkeypatch.setattr(scenarios, "rollout", remote_rollout)  # timing: a local run would be no reference
    scenarios.test_a_timed_out_trajectory_still_runs_on_trajectory_end(qwen3_tokenizer, scenarios.SlowTwice)


# ---- the real `turnrl serve` with a plugin, the embedded engine, weight updates -----------------------
PLUGIN = """
import inspect
import threading
from turnrl.agents.scheduler import MultiTurnScheduler, multi_turns

IMPORTED_BY = [frame.function for frame in inspect.stack()]

class WhereScheduler(MultiTurnScheduler):
    '''Two turns; records where it was imported and which thread ran its hooks.'''

    async def on_turn_end(self, request, response, turn):
        return {"rollout_infos": {"hook_thread": threading.current_thread().name,
                                  "imported_by_the_build": "build_rollout_manager" in IMPORTED_BY}}

    def check_finished(self, request, response, turn):
        return turn >= 2

    def step(self, request, response, turn):
        request.messages.append({"role": "user", "content": "Again."})
        return {"infer_request": request}

multi_turns["serve_where_plugin"] = WhereScheduler
"""


def test_turnrl_serve_imports_the_plugin_and_takes_weight_updates(tmp_path, tiny_qwen3, monkeypatch):
    import uvicorn

    monkeypatch.delenv("TURNRL_SERVE_TOKEN", raising=False)
    plugin = tmp_path / "where_plugin.py"
    plugin.write_text(textwrap.dedent(PLUGIN))
    config = tmp_path / "rollout.yaml"
    config.write_text(yaml.safe_dump({"max_new_tokens": 4, "max_turns": 6, "sanity_check": "disable"}))
    reward_threads: list[str] = []

    def reward(traj):
        reward_threads.append(threading.current_thread().name)
        return float(traj.num_turns)

    seen = {}

    def serve_and_check(app, **_):  # stands in for uvicorn.run: the app `turnrl serve` built, on a free port
        server = ServerThread(app)
        url = server.start()
        try:
            remote = RemoteRollout(url, reward_fn=reward)  # no plugin, no scheduler: the server has them
            seen["info"] = remote.info
            seen["tokenizer"] = type(remote.renderer.tokenizer).__name__
            greedy = SamplingParams(temperature=0.0)
            rows = [{"id": "a", "prompt": "Hi."}, {"id": "b", "prompt": "Bye."}]
            seen["before"] = asyncio.run(run_groups(remote, rows, n=2, sampling=greedy))
            seen["version"] = asyncio.run(remote.engine.update_weights(tiny_qwen3.state_dict(), version=7))
            seen["after"] = asyncio.run(run_groups(remote, rows, n=1, id_prefix="s1-", sampling=greedy))
            remote.close()
        finally:
            server.stop()

    monkeypatch.setattr(uvicorn, "run", serve_and_check)
    assert "serve_where_plugin" not in multi_turns
    result = CliRunner().invoke(cli_app, ["serve", "--model", "tiny-qwen3", "--rollout-config", str(config),
                                          "--scheduler", "serve_where_plugin", "--plugin", str(plugin),
                                          "--max-turns", "2"])
    if result.exception is not None:
        raise result.exception
    assert result.exit_code == 0, result.output
    assert "serve_where_plugin" in multi_turns  # imported by the server's build (build_stack), in this process
    # the start-up banner: URLs, model, auth mode
    assert "serving tiny-qwen3 (embedded engine) at http://127.0.0.1:8000\n" in result.output
    assert "http://127.0.0.1:8000/v1 " in result.output and "POST http://127.0.0.1:8000/rollout (default agent " \
        "scheduler)" in result.output and "auth: none (loopback only" in result.output

    info = seen["info"]
    assert (info["model"], info["agent"], info["agent_loop"]) == ("tiny-qwen3", "scheduler", "scheduler[WhereScheduler]")
    assert (info["limits"]["max_turns"], info["limits"]["max_new_tokens"]) == (2, 4)  # the flag beats the YAML
    assert seen["tokenizer"].startswith("Qwen2Tokenizer")  # the client's renderer, from the server's model name
    before = [t for g in seen["before"] for t in g]
    assert [t.id for t in before] == ["a-0", "a-1", "b-0", "b-1"]
    for traj in before:
        traj.validate()
        assert traj.num_turns == 2 and traj.status != RolloutStatus.FAILED
        infos = traj.rollout_infos
        assert infos["imported_by_the_build"] and infos["hook_thread"].startswith("turnrl-http-")
        assert traj.policy_versions == [0]
    assert [t.reward for t in before] == [2.0] * 4 and set(reward_threads) == {threading.main_thread().name}
    assert seen["version"] == 7
    after = [t for g in seen["after"] for t in g]
    assert [t.id for t in after] == ["s1-a-0", "s1-b-0"] and all(t.policy_versions == [7] for t in after)
    # identical weights, greedy: the same tokens as before the update
    assert [t.response_ids for t in after] == [before[0].response_ids, before[2].response_ids]


def test_serve_refuses_rollout_flags_without_a_rollout_configuration():
    def run(*args):
        result = CliRunner().invoke(cli_app, list(args))
        return result.exit_code, " ".join(result.output.split())

    code, output = run("serve", "--model", "tiny-qwen3", "--max-turns", "3")
    assert code == 2 and "configure a rollout server" in output
    code, output = run("serve", "--model", "tiny-qwen3", "--scheduler", "nope")  # before the model loads
    assert code == 2 and "unknown scheduler 'nope'" in output
    code, output = run("rollout", "--model", "tiny-qwen3", "--data", "x.jsonl", "--out", "o.jsonl",
                       "--server", "http://127.0.0.1:1", "--scheduler", "gym")
    assert code == 2 and "pass these to `turnrl serve`" in output


# ---- protocol: auth, heartbeats, errors ------------------------------------------------------------
def test_rollout_endpoint_needs_the_token_and_streams_heartbeats(qwen3_tokenizer, monkeypatch):
    monkeypatch.delenv("TURNRL_SERVE_TOKEN", raising=False)
    engine = ScriptedEngine(qwen3_tokenizer, scenarios.replies("It is 4."), latency_s=0.15)
    cfg = RolloutConfig(scheduler="test_retry", max_turns=2, max_new_tokens=16)
    with rollout_server(engine, qwen3_tokenizer, cfg, token="s3cret", heartbeat_s=0.03) as (url, _):
        with pytest.raises(EngineError, match="HTTP 401"):
            RemoteRollout(url, renderer=ChatRenderer(qwen3_tokenizer))
        body = {"rows": [ROW], "n": 1}
        assert httpx.post(f"{url}/rollout", json=body).status_code == 401
        assert httpx.post(f"{url}/rollout", json=body, headers={"authorization": "Bearer wrong"}).status_code == 401
        with httpx.stream("POST", f"{url}/rollout", json=body, headers={"authorization": "Bearer s3cret"}) as response:
            assert response.headers["content-type"].startswith("application/x-ndjson")
            lines = list(response.iter_lines())
        assert "" in lines  # heartbeats while the engine was busy
        data = [json.loads(line) for line in lines if line]
        assert data[-1] == {"done": True, "trajectories": 1} and data[0]["id"] == "0-0"
        monkeypatch.setenv("TURNRL_SERVE_TOKEN", "s3cret")  # the client reads the server's variable
        [[traj]] = asyncio.run(run_groups(RemoteRollout(url, renderer=ChatRenderer(qwen3_tokenizer)), [ROW]))
        assert traj.termination_reason == TerminationReason.ENV_DONE


def test_bad_requests_and_a_server_failure_mid_stream(qwen3_tokenizer, monkeypatch):
    monkeypatch.delenv("TURNRL_SERVE_TOKEN", raising=False)
    engine = ScriptedEngine(qwen3_tokenizer, scenarios.replies("It is 4."))
    cfg = RolloutConfig(scheduler="test_retry", max_turns=2, max_new_tokens=16)
    with rollout_server(engine, qwen3_tokenizer, cfg) as (url, manager):
        remote = RemoteRollout(url, renderer=ChatRenderer(qwen3_tokenizer))
        with pytest.raises(EngineError, match="HTTP 400.*unknown agent_name 'nope'"):
            asyncio.run(run_groups(remote, [{**ROW, "agent_name": "nope"}]))
        with pytest.raises(EngineError, match="HTTP 400.*n must be an integer >= 1"):
            asyncio.run(run_groups(remote, [ROW], n=0))
        with pytest.raises(ValueError, match="must be JSON"):
            asyncio.run(run_groups(remote, [{**ROW, "blob": object()}]))
        real_stream = manager.stream

        async def broken(*args, **kwargs):
            async for traj in real_stream(*args, **kwargs):
                yield traj
                raise RuntimeError("engine died")

        monkeypatch.setattr(manager, "stream", broken)
        got = []
        with pytest.raises(EngineError, match="failed mid-stream: RuntimeError: engine died"):
            asyncio.run(run_groups(remote, [ROW, {**ROW, "id": "x"}], on_trajectory=got.append))
        assert len(got) == 1  # what arrived before the failure was delivered


def test_a_client_that_goes_away_cancels_its_rollout(qwen3_tokenizer):
    import time

    engine = ScriptedEngine(qwen3_tokenizer, scenarios.replies("no"), latency_s=0.2)
    cfg = RolloutConfig(scheduler="test_endless", max_turns=8, max_new_tokens=16, concurrency=2)
    with rollout_server(engine, qwen3_tokenizer, cfg) as (url, _):
        body = {"rows": [{"id": i, "prompt": "x"} for i in range(4)]}
        with httpx.stream("POST", f"{url}/rollout", json=body):
            time.sleep(0.3)
        time.sleep(0.2)
        calls = len(engine.calls)
        time.sleep(0.5)
        assert len(engine.calls) == calls < 8  # nothing generates for a client that left
        assert sorted(engine.released) == ["0-0", "1-0"]  # the cancelled trajectories' caches are released


def test_turnrl_rollout_to_a_rollout_server(qwen3_tokenizer, tmp_path, monkeypatch):
    monkeypatch.delenv("TURNRL_SERVE_TOKEN", raising=False)
    data, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    data.write_text(json.dumps({"id": "q", **ROW}) + "\n")
    engine = ScriptedEngine(qwen3_tokenizer, lambda rid, turn, prompt: "\\boxed{4}" if rid == "q-1" else "\\boxed{5}")
    cfg = RolloutConfig(scheduler="test_retry", max_turns=2, max_new_tokens=16)
    with rollout_server(engine, qwen3_tokenizer, cfg, model_name="tiny-qwen3") as (url, _):
        result = CliRunner().invoke(cli_app, ["rollout", "--model", "tiny-qwen3", "--data", str(data), "--out", str(out),
                                              "--server", url, "--n", "2", "--reward", "math", "--seed", "3"])
    assert result.exit_code == 0, result.output
    trajs = sorted((Trajectory.from_json(json.loads(line)) for line in out.read_text().splitlines()), key=lambda t: t.id)
    assert [(t.id, t.num_turns, t.reward) for t in trajs] == [("q-0", 2, 0.0), ("q-1", 1, 1.0)]  # rewards from here
    assert {c.params.seed is not None for c in engine.calls} == {True}  # the client's sampling went along


def test_client_side_reward_errors_are_recorded_not_scored(qwen3_tokenizer):
    def reward(traj):
        if traj.group_id == "bad":
            raise KeyError("answer")
        return 1.0

    rows = [{"id": "good", "prompt": "a", "answer": "4"}, {"id": "bad", "prompt": "b", "answer": "4"}]
    good, bad = remote_rollout(qwen3_tokenizer, scenarios.replies("It is 4."), "test_retry", rows, reward=reward)[0]
    assert good.reward == 1.0 and "reward_error" not in good.info
    assert bad.status == "completed" and bad.reward is None and bad.reward_error == "KeyError: 'answer'"
    assert good.sample is rows[0]  # the caller's own row object


# ---- the trainer over a rollout server -------------------------------------------------------------
def test_build_trainer_uses_the_rollout_server_and_pushes_weights(qwen3_tokenizer, tmp_path, monkeypatch):
    from turnrl.build import build_trainer

    monkeypatch.delenv("TURNRL_SERVE_TOKEN", raising=False)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", **ROW}) + "\n" for i in range(2)))
    engine = ScriptedEngine(qwen3_tokenizer, lambda rid, turn, prompt: "\\boxed{4}" if rid.endswith("-0") else "\\boxed{5}")
    server_cfg = RolloutConfig(scheduler="test_retry", max_turns=1, max_new_tokens=16)
    with rollout_server(engine, qwen3_tokenizer, server_cfg, model_name="tiny-qwen3") as (url, _):
        cfg = TrainConfig(model="tiny-qwen3", train_data=str(data), output_dir=str(tmp_path / "run"), steps=1,
                          prompts_per_step=2, rollout_server=url, reward={"function": "math"},
                          rollout={"n": 2, "sampling": {"temperature": 0.7}})
        trainer, stack = build_trainer(cfg)
        remote = trainer.rollout
        assert isinstance(remote, RemoteRollout) and trainer.engine is stack.engine is remote.engine
        assert (remote.sampling.temperature, remote.sampling.seed) == (0.7, cfg.seed)  # the trainer's sampling
        history = asyncio.run(trainer.train())  # one step (train_step alone would wait for a producer)
        stack.close()
    metrics = next(m for m in history if m.get("step") == 1.0 and "train/samples" in m)
    assert engine.calls and {c.params.temperature for c in engine.calls} == {0.7}
    assert metrics["rollout/reward_mean"] == 0.5 and metrics["train/samples"] == 4.0  # rewards computed here
    assert metrics["train/policy_version"] == 1.0 and engine.policy_version == 1  # weights reached the server


def test_rollout_lines_hold_what_a_trajectory_file_holds(qwen3_tokenizer, tmp_path, monkeypatch):
    """A value JSON has no type for (a PIL image in a message) goes over /rollout as TrajectoryWriter writes it:
    the server had its own copy of the JSON default, which had drifted and sent `str(image)`."""
    from PIL import Image

    from turnrl.observe.stats import TrajectoryWriter

    image = Image.new("RGB", (2, 2), "red")
    traj = Trajectory(id="0-0", group_id="0", sample_index=0, prompt_ids=[1, 2],
                      messages=[{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text",
                                                                                                "text": "colour?"}]}])
    engine = ScriptedEngine(qwen3_tokenizer, scenarios.replies("red"))
    cfg = RolloutConfig(scheduler="test_retry", max_turns=1, max_new_tokens=16)
    with rollout_server(engine, qwen3_tokenizer, cfg) as (url, manager):
        async def stream(*args, **kwargs):
            yield traj

        monkeypatch.setattr(manager, "stream", stream)
        lines = httpx.post(f"{url}/rollout", json={"rows": [ROW]}, timeout=30).text.splitlines()
    with TrajectoryWriter(tmp_path / "t.jsonl") as writer:
        writer.write(traj)
    assert lines[0] == (tmp_path / "t.jsonl").read_text().strip()
    assert json.loads(lines[0])["messages"][0]["content"][0]["image"].startswith("sha256:")
