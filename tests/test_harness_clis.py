"""The real coding-agent CLIs as harness agents: Claude Code, Codex CLI and opencode at the versions `make harnesses`
pins, each run in the command sandbox against the in-process proxy on a scripted policy (tests/harness_policy.py;
the real Qwen3 tokenizer and chat template), on a Harbor-format task whose test needs a file the agent writes through
its own tool. Each CLI takes seconds to start (see the durations): marked slow.

    TURNRL_CAPTURE_HARNESS=tests/data/harness_requests pytest -m slow tests/test_harness_clis.py

writes every request body each CLI sent (the fixtures tests/test_harness_requests.py checks the APIs against)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from fakes import Call, ScriptedEngine
from harness_policy import claude_subagent_policy, codex_subagent_policy, harness_policy, is_subagent
from test_harness import TASKS, assert_token_exact, processes_of_uid

from turnrl.agents.harness import BUILTIN, find_cli, harness_search_path, make_harness_agent
from turnrl.agents.openai_agent import close_gateways, gateway
from turnrl.build import harness_settings
from turnrl.config import HarnessConfig
from turnrl.data import load_rows
from turnrl.engines.base import InvalidRequest
from turnrl.render import ChatRenderer
from turnrl.rollout.episode import RolloutLimits
from turnrl.rollout.manager import RolloutManager, run_groups
from turnrl.tools._sandbox_kernel import landlock_abi
from turnrl.types import RolloutStatus, SegmentSource

CAPTURE = os.environ.get("TURNRL_CAPTURE_HARNESS")


def installed(name: str) -> bool:
    try:
        find_cli(BUILTIN[name], harness_search_path(), name)
    except ValueError:
        return False
    return True


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not landlock_abi(), reason="the command sandbox needs root and Landlock"),
]
CLIS = [pytest.param(name, marks=pytest.mark.skipif(not installed(name), reason=f"{name} is not installed: make "
                                                                                "harnesses"))
        for name in ("claude-code", "codex", "opencode")]


@pytest.fixture(autouse=True)
def _stop_gateways():
    yield
    close_gateways()


def record_bodies(engine, renderer) -> list[dict]:
    """Every request the CLIs send to the gateway of (engine, renderer): method, path, body, answer status."""
    bodies: list[dict] = []
    app = gateway(engine, renderer).http.app  # the harness agent gets this same gateway

    @app.middleware("http")
    async def record(request, call_next):
        raw = await request.body()
        response = await call_next(request)
        bodies.append({"method": request.method, "path": request.url.path.split("/v1", 1)[-1],
                       "status": response.status_code, "body": json.loads(raw) if raw else None})
        return response

    return bodies


async def run_cli(name: str, qwen3_tokenizer, tmp_path: Path, rows: list[dict], policy=None):
    engine = ScriptedEngine(qwen3_tokenizer, policy or harness_policy())
    renderer = ChatRenderer(qwen3_tokenizer)
    bodies = record_bodies(engine, renderer)
    (tmp_path / "runs").mkdir()
    # a generous limit: on a loaded 2-core machine (load 15-19 seen) six CLIs starting at once take minutes
    settings = harness_settings(HarnessConfig(name=name, base_dir=str(tmp_path / "runs"), timeout_s=600))
    manager = RolloutManager(engine, renderer, agents={"harness": make_harness_agent(settings)},
                             default_agent="harness", limits=RolloutLimits(max_turns=8, max_new_tokens=512))
    groups = await run_groups(manager, rows)
    if CAPTURE:
        Path(CAPTURE).mkdir(parents=True, exist_ok=True)
        suffix = "" if policy is None else "-subagent"
        Path(CAPTURE, f"{name}{suffix}.json").write_text(json.dumps(bodies, indent=1, ensure_ascii=False) + "\n")
    return engine, bodies, groups


@pytest.mark.parametrize("name", CLIS)
async def test_a_real_cli_writes_the_file_through_its_own_tool_and_earns_reward_1(name, qwen3_tokenizer, tmp_path):
    engine, bodies, [episode] = await run_cli(name, qwen3_tokenizer, tmp_path, load_rows(TASKS / "write-greeting"))
    assert all(b["status"] == 200 for b in bodies), [(b["path"], b["status"]) for b in bodies]
    for traj in episode:
        assert traj.status == RolloutStatus.COMPLETED and traj.reward == 1.0, (traj.error, traj.info.get("harness"))
        assert traj.episode_id == episode[0].id and traj.info["tests"]["reward"] == 1.0
        assert_token_exact(traj, engine)
    worker = next(t for t in episode if any(s.source == SegmentSource.TOOL for s in t.segments))
    tool = [s for s in worker.segments if s.source == SegmentSource.TOOL]
    assert tool and all(set(s.loss_mask) == {0} for s in tool)  # the tool's output is never trained
    assert worker.info["harness"]["exit_code"] == 0 and worker.info["harness"]["sandbox"]["mounts"] == ["/app"]
    assert processes_of_uid(worker.info["harness"]["sandbox"]["uid"]) == []
    assert list((tmp_path / "runs").iterdir()) == []


@pytest.mark.skipif(not installed("codex"), reason="codex is not installed: make harnesses")
async def test_codex_with_its_namespace_and_hosted_tools_spawns_a_sub_agent(qwen3_tokenizer, tmp_path):
    """Codex offers a namespace tool (`multi_agent_v1`, its sub-agents) and a hosted one (`web_search`). The model
    sees the namespace's tools as `multi_agent_v1__<name>` functions and not web_search; its call of
    `multi_agent_v1__spawn_agent` goes back to Codex as `spawn_agent` in namespace `multi_agent_v1`, which Codex
    runs: the sub-agent's calls arrive in the same session and are a trajectory of their own in the episode (same
    episode_id, same reward: the sub-agent wrote the file)."""
    engine, bodies, [episode] = await run_cli("codex", qwen3_tokenizer, tmp_path, load_rows(TASKS / "write-greeting"),
                                              policy=codex_subagent_policy())
    first = bodies[0]["body"]
    assert {"namespace", "web_search"} <= {t["type"] for t in first["tools"]}
    assert {"include", "reasoning", "prompt_cache_key", "client_metadata", "store"} <= set(first)
    echoed = [item for b in bodies for item in b["body"]["input"] if item.get("type") == "function_call"]
    assert {"name": "spawn_agent", "namespace": "multi_agent_v1"}.items() <= echoed[0].items()
    assert len(episode) == 2 and {t.reward for t in episode} == {1.0} and {t.episode_id for t in episode} == {
        episode[0].id}
    main, sub = sorted(episode, key=lambda t: -t.num_turns)
    prompt = qwen3_tokenizer.decode(main.prompt_ids)
    assert '"name": "multi_agent_v1__spawn_agent"' in prompt and '"web_search"' not in prompt
    assert all(turn.extra.get("tools_not_offered") == ["web_search"] for turn in main.turns)
    assert "SUBAGENT" in qwen3_tokenizer.decode(sub.prompt_ids)
    assert main.parent is None and (sub.parent.id, sub.parent.kind) == (main.id, "subagent")  # the episode's tree
    for traj in episode:
        assert_token_exact(traj, engine)


@pytest.mark.skipif(not installed("codex"), reason="codex is not installed: make harnesses")
def test_turnrl_rollout_with_the_harness_flag_on_a_folder_of_tasks(tmp_path, monkeypatch, qwen3_tokenizer):
    """`turnrl rollout --harness codex --data <Harbor tasks>`: the user's command, end to end."""
    from fakes import script_the_cli
    from typer.testing import CliRunner

    from turnrl.cli import app

    script_the_cli(monkeypatch, qwen3_tokenizer, harness_policy())
    data = tmp_path / "tasks"
    for task in ("write-greeting", "write-farewell"):
        shutil.copytree(TASKS / task, data / task)
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["rollout", "--model", "tiny-qwen3", "--harness", "codex", "--data", str(data),
                                      "--out", str(out), "--max-turns", "8", "--max-new-tokens", "512"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == ["write-farewell-0", "write-greeting-0"]
    assert all(r["reward"] == 1.0 and r["status"] == "completed" and r["info"]["harness"]["name"] == "codex"
               for r in rows)


@pytest.mark.skipif(not installed("claude-code"), reason="claude-code is not installed: make harnesses")
async def test_claude_codes_agent_tool_runs_a_sub_agent_whose_calls_join_the_episode(qwen3_tokenizer, tmp_path):
    """Claude Code's Agent tool starts a sub-agent that calls the same session URL: its calls are a trajectory of
    the episode (same episode_id, same reward: the sub-agent wrote the file)."""
    engine, bodies, [episode] = await run_cli("claude-code", qwen3_tokenizer, tmp_path,
                                              load_rows(TASKS / "write-greeting"), policy=claude_subagent_policy())
    assert all(b["status"] == 200 for b in bodies)
    assert len(episode) == 2 and {t.reward for t in episode} == {1.0}, [(t.error, t.num_turns) for t in episode]
    assert {t.episode_id for t in episode} == {episode[0].id}
    sub = next(t for t in episode if is_subagent(qwen3_tokenizer.decode(t.prompt_ids)))
    assert any(s.source == SegmentSource.TOOL for s in sub.segments)  # its Write ran
    main = next(t for t in episode if t is not sub)
    assert main.parent is None and (sub.parent.id, sub.parent.kind) == (main.id, "subagent")  # the episode's tree
    for traj in episode:
        assert_token_exact(traj, engine)


# ---- training ----------------------------------------------------------------------------------------------
class RefusingEngine(ScriptedEngine):
    """The scripted policy, except that the third sample of each group gets its agent calls refused as a real
    engine refuses a prompt over its context (an InvalidRequest: a 400 the CLI does not retry)."""

    async def generate(self, prompt_ids, params, *, request_id, images=None):
        if request_id.endswith("-2") and "<tools>" in self.tokenizer.decode(prompt_ids[:4000]):
            self.calls.append(Call(request_id, list(prompt_ids), params))
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens, more than the engine's context")
        return await super().generate(prompt_ids, params, request_id=request_id, images=images)


@pytest.mark.skipif(not installed("opencode"), reason="opencode is not installed: make harnesses")
def test_turnrl_train_with_opencode_on_two_harbor_tasks(tmp_path, monkeypatch, qwen3_tokenizer):
    """`turnrl train` with `agent: harness` (opencode, tiny-qwen3): two steps on two Harbor tasks, three samples each.
    Sample 0 writes the right file (the tests say 1), sample 1 a wrong one (0), sample 2's engine refuses its calls
    (opencode exits 1: FAILED, not scored, out of its group's baseline). Rewards come from the tests; each group's
    advantages are +1/-1 over the two scored samples; the policy is updated and its weights pushed twice."""
    import torch
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from turnrl.cli import app
    from turnrl.models import load_model

    built: list[ScriptedEngine] = []
    policy = harness_policy(text_of=lambda rid, text: text if rid.endswith("-0") else "not what was asked")
    monkeypatch.setattr("turnrl.engines.embedded.EmbeddedEngine",
                        lambda *a, **k: built.append(RefusingEngine(qwen3_tokenizer, policy)) or built[-1])
    data = tmp_path / "tasks"
    for task in ("write-greeting", "write-farewell"):
        shutil.copytree(TASKS / task, data / task)
    (tmp_path / "harness-runs").mkdir()
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({
        "model": "tiny-qwen3", "train_data": str(data), "run_dir": str(tmp_path / "run"), "steps": 2,
        "prompts_per_step": 2, "optim": {"lr": 1e-3}, "algo": {"is_mode": "none"},  # the script's logprobs are not the
        # policy's: no importance correction (it would truncate every weight), the plain policy gradient
        "rollout": {"harness": {"name": "opencode", "timeout_s": 600, "base_dir": str(tmp_path / "harness-runs")},
                    "n": 3, "max_turns": 6, "max_new_tokens": 256},
    }))
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 0, (result.output, result.exception)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "train/trained_trajectories" in m]
    assert len(steps) == 2
    for step in steps:  # 2 groups x 2 scored episodes (opencode's title call is a piece of its own: 8 samples)
        assert step["train/num_groups"] == 2 and step["train/mean_group_size"] == 2  # the failed one is left out
        assert step["rollout/reward_mean"] == 0.5 and step["train/constant_group_frac"] == 0
        assert step["train/policy_version"] == step["step"] and step["train/grad_norm"] > 0
    trajectories = [json.loads(line) for f in sorted((tmp_path / "run" / "trajectories").glob("*.jsonl"))
                    for line in f.read_text().splitlines()]
    by_sample = {k: [t for t in trajectories if t["id"].split(".")[0].endswith(f"-{k}")] for k in range(3)}
    assert {t["reward"] for t in by_sample[0]} == {1.0} and {t["status"] for t in by_sample[0]} == {"completed"}
    assert {t["reward"] for t in by_sample[1]} == {0.0} and {t["status"] for t in by_sample[1]} == {"completed"}
    assert {t["status"] for t in by_sample[2]} == {"failed"} and {t["reward"] for t in by_sample[2]} == {None}
    assert all("more than the engine's context" in t["error"] for t in by_sample[2])
    assert list((tmp_path / "harness-runs").iterdir()) == []
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "step_000002" / "model" / "model.safetensors"))
    start = load_model("tiny-qwen3").state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in trained)  # an update was made
