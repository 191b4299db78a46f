"""Ray mode on a local 2-CPU cluster: engine actors and rollout workers around the single-process components.

One cluster, two EngineActors on tiny-qwen3 and two RolloutWorkers are shared by the module (each actor is a
process that imports torch; starting them dominates the runtime). The trainer launcher (`trainer.launcher: ray`,
two trainer actors) runs on the same cluster.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import textwrap
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from turnrl.build import (  # noqa: E402
    build_engine,
    build_renderer,
    build_rollout_manager,
    build_worker_manager,
    load_engine,
)
from turnrl.config import EngineConfig, RolloutConfig, SamplingConfig, TrainConfig  # noqa: E402
from turnrl.models import load_model  # noqa: E402
from turnrl.rollout import group_ids, run_groups  # noqa: E402
from turnrl.rollout.ray import EngineActor, RayEngineGroup, RayRollout, RolloutWorker  # noqa: E402
from turnrl.testing.latency import LatencyDraw, latency_rows  # noqa: E402
from turnrl.types import SamplingParams, TerminationReason, Trajectory  # noqa: E402

MODEL = "tiny-qwen3"
ENV_CFG = RolloutConfig(env="turnrl.testing.latency", max_turns=6, max_new_tokens=8, sanity_check="disable",
                        sampling=SamplingConfig(temperature=1.0, seed=3))


@pytest.fixture(scope="module")
def cluster():
    previous = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # token auth would write ~/.ray/auth_token
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()
    if previous is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = previous


@pytest.fixture(scope="module")
def renderer(qwen3_tokenizer):
    return build_renderer(qwen3_tokenizer, ENV_CFG)


@pytest.fixture(scope="module")
def engines(cluster, renderer):
    eos = sorted(renderer.end_of_turn_ids)
    actors = [EngineActor.remote(functools.partial(load_engine, MODEL, EngineConfig(), eos_token_ids=eos))
              for _ in range(2)]
    ray.get([a.ready.remote() for a in actors])
    return actors


def start_rollout(engines, renderer, cfg, workers=2):
    handles = [RolloutWorker.remote(functools.partial(build_worker_manager, MODEL, cfg, None), engines)
               for _ in range(workers)]
    ray.get([w.ready.remote() for w in handles])
    return RayRollout(handles, RayEngineGroup(engines), renderer, SamplingParams())


@pytest.fixture(scope="module")
def env_rollout(engines, renderer):
    return start_rollout(engines, renderer, ENV_CFG)


def flat(groups):
    return [t for g in groups for t in g]


def test_two_workers_two_engines_give_the_single_process_trajectories(env_rollout, engines, renderer):
    rows = latency_rows(6, LatencyDraw(mean_s=0.0, seed=5))  # 1 to 6 turns, no tool latency
    ray_groups = asyncio.run(run_groups(env_rollout, rows, n=2, id_prefix="s1-"))
    local_engine = build_engine(load_model(MODEL), EngineConfig(), eos_token_ids=sorted(renderer.end_of_turn_ids))
    try:
        local = build_rollout_manager(ENV_CFG, local_engine, renderer)
        local_groups = asyncio.run(run_groups(local, rows, n=2, id_prefix="s1-"))
    finally:
        local_engine.close()
    assert [g[0].group_id for g in ray_groups] == group_ids(rows, "s1-")  # row order kept
    assert [[t.sample_index for t in g] for g in ray_groups] == [[0, 1]] * 6

    def key(trajs):
        return {(t.group_id, t.id, tuple(t.response_ids), tuple(t.loss_mask), t.num_turns) for t in trajs}

    assert key(flat(ray_groups)) == key(flat(local_groups))
    assert [t.num_turns for t in flat(ray_groups)] == [len(r["latencies_s"]) for r in rows for _ in range(2)]
    for a, b in zip(flat(ray_groups), flat(local_groups), strict=True):
        assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=1e-4)
    served = [s["requests"] for s in ray.get([e.stats.remote() for e in engines])]
    assert min(served) > 0, served  # both replicas took trajectories


def test_a_failing_env_in_one_worker_fails_only_its_trajectory(env_rollout, monkeypatch):
    import turnrl.rollout.ray as ray_module

    rows = latency_rows(4, LatencyDraw(mean_s=0.0, min_turns=3, max_turns=3, seed=1))
    rows[1]["fail_on_turn"] = 2  # row 1 goes to worker 1 (round-robin), rows 0, 2 to worker 0
    prepared = []  # the driver prepares its collector too (it unpickles every trajectory): turnrl.rollout.manager
    monkeypatch.setattr(ray_module, "freeze_heap", lambda: prepared.append(1))
    trajs = flat(asyncio.run(run_groups(env_rollout, rows, n=1)))
    assert prepared == [1]
    assert [t.status for t in trajs] == ["completed", "failed", "completed", "completed"]
    assert trajs[1].termination_reason == TerminationReason.ENV_ERROR and "fail_on_turn" in trajs[1].error
    assert trajs[1].num_turns == 2 and all(t.num_turns == 3 for t in trajs if t.status == "completed")


def test_weight_update_reaches_every_engine_actor(engines, renderer):
    prompt = renderer.initial([{"role": "user", "content": "Hello there"}]).ids
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)

    def generate_on_each(tag):
        return ray.get([e.generate.remote(prompt, greedy, f"{tag}-{i}") for i, e in enumerate(engines)])

    before = generate_on_each("before")
    policy = load_model(MODEL)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    group = RayEngineGroup(engines)
    try:
        assert asyncio.run(group.update_weights(policy.state_dict(), version=7)) == 7
        after = generate_on_each("after")
        local = build_engine(policy, EngineConfig(), eos_token_ids=sorted(renderer.end_of_turn_ids))
        try:
            expected = asyncio.run(local.generate(prompt, greedy, request_id="local"))
        finally:
            local.close()
    finally:  # the other tests expect the original weights
        asyncio.run(group.update_weights(load_model(MODEL).state_dict(), version=0))
    assert before[0].logprobs == before[1].logprobs and before[0].policy_version == 0
    assert [o.policy_version for o in after] == [7, 7]
    assert after[0].token_ids == after[1].token_ids == expected.token_ids
    assert after[0].logprobs == after[1].logprobs  # identical weights on both actors
    assert after[0].logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    assert after[0].logprobs != pytest.approx(before[0].logprobs, abs=1e-3)


PLUGIN = """
import os
from turnrl.agents.scheduler import MultiTurnScheduler, multi_turns

class PidScheduler(MultiTurnScheduler):
    '''Two turns; records which process ran the hooks.'''

    async def on_turn_end(self, request, response, turn):
        return {"rollout_infos": {"pid": os.getpid()}}

    def check_finished(self, request, response, turn):
        return turn >= 2

    def step(self, request, response, turn):
        request.messages.append({"role": "user", "content": "Again."})
        return {"infer_request": request}

multi_turns["ray_pid_plugin"] = PidScheduler
"""


def test_a_plugin_scheduler_is_registered_in_the_worker_processes(engines, renderer, tmp_path):
    from turnrl.agents.scheduler import multi_turns

    plugin = tmp_path / "pid_plugin.py"
    plugin.write_text(textwrap.dedent(PLUGIN))
    cfg = RolloutConfig(scheduler="ray_pid_plugin", plugins=[str(plugin)], max_turns=4, max_new_tokens=4,
                        sanity_check="disable")
    rollout = start_rollout(engines, renderer, cfg)
    try:
        assert all("scheduler" in names for names in ray.get([w.agents.remote() for w in rollout.workers]))
        trajs = flat(asyncio.run(run_groups(rollout, [{"prompt": f"q{i}"} for i in range(4)], n=1)))
    finally:
        for w in rollout.workers:
            ray.kill(w)
    assert "ray_pid_plugin" not in multi_turns  # never imported by the driver
    assert [t.num_turns for t in trajs] == [2, 2, 2, 2]
    pids = {t.rollout_infos["pid"] for t in trajs}
    assert len(pids) == 2 and os.getpid() not in pids  # ran in both worker processes


def test_build_trainer_builds_the_ray_rollout_when_configured(cluster, tmp_path):
    from turnrl.build import build_trainer

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in latency_rows(2, LatencyDraw(mean_s=0.0, seed=2))))
    cfg = TrainConfig(model=MODEL, train_data=str(data), output_dir=str(tmp_path / "run"), prompts_per_step=2,
                      steps=1, rollout=ENV_CFG.model_copy(update={"n": 2}), eval_data=str(data), eval_sampled_n=1,
                      engine=EngineConfig(distributed="ray", ray_workers=1))
    trainer, stack = build_trainer(cfg)
    try:
        assert isinstance(trainer.rollout, RayRollout) and trainer.engine is stack.engine is trainer.rollout.engine
        history = asyncio.run(trainer.train())  # one step (train_step alone would wait for a producer)
        metrics = next(m for m in history if m.get("step") == 1.0 and "train/samples" in m)
        version = ray.get(stack.engine.actors[0].generate.remote([1, 2, 3], SamplingParams(max_new_tokens=1), "v"))
        workers = trainer.rollout.workers
    finally:
        stack.close()
    deadline = time.time() + 30  # ray.kill is asynchronous: the worker may answer once more
    with pytest.raises(ray.exceptions.RayActorError):  # the stack stopped the workers with the engines
        while time.time() < deadline:
            ray.get(workers[0].ready.remote(), timeout=10)
            time.sleep(0.2)
    assert metrics["rollout/trajectories"] == 4.0 and metrics["rollout/reward_mean"] == 1.0
    assert metrics["train/policy_version"] == 1.0 and version.policy_version == 1
    # the sampled evaluation runs with the Ray rollout's sampling (it had none: AttributeError)
    assert [m["eval/tag"] for m in history if "eval/sampled_reward_mean" in m] == ["before", "after"]


@pytest.mark.filterwarnings("ignore")  # ~17 s: two rollout workers and an engine actor start, then 3 async steps
def test_async_training_with_two_rollout_workers_keeps_the_ledger_and_the_staleness_bound(cluster, tmp_path):
    """`rollout.workers: 2` under `trainer.mode: async`: every admitted group trained exactly once (groups.jsonl),
    each within `max_staleness` of the step that trained it, the trajectories' versions in order."""
    from turnrl.build import build_trainer

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in latency_rows(8, LatencyDraw(mean_s=0.01, seed=4))))
    cfg = TrainConfig(model=MODEL, train_data=str(data), output_dir=str(tmp_path / "run"), prompts_per_step=2,
                      steps=3, seed=3, rollout=ENV_CFG.model_copy(update={"n": 2, "workers": 2}),
                      engine=EngineConfig(max_batch_size=4), trainer={"mode": "async", "max_staleness": 1})
    trainer, stack = build_trainer(cfg)
    try:
        assert isinstance(trainer.rollout, RayRollout) and len(trainer.rollout.workers) == 2
        history = asyncio.run(trainer.train())
    finally:
        stack.close()
    steps = [m for m in history if "async/staleness_max" in m]
    assert len(steps) == 3 and all(m["async/staleness_max"] <= 1 for m in steps)
    assert all(m["async/lost"] == 0.0 for m in steps)
    assert {k for m in steps for k in m if k.startswith("rollout/worker1/")}  # per-worker metrics
    ledger = [json.loads(line) for line in (tmp_path / "run" / "groups.jsonl").read_text().splitlines()]
    assert sorted(g["index"] for g in ledger) == list(range(6))  # 3 steps x 2 groups, each trained once
    for g in ledger:
        assert g["admitted_version"] <= g["oldest_version"] and g["step"] - 1 - g["oldest_version"] <= 1
    last = (tmp_path / "run" / "trajectories" / "last_step.jsonl").read_text().splitlines()
    assert len(last) == 4  # the last step's 2 groups x 2 samples, sampled by the workers
    for line in last:
        versions = [s.policy_version for s in Trajectory.from_json(json.loads(line)).segments if s.source == "model"]
        assert versions == sorted(versions) and max(versions) <= 2


@pytest.mark.slow  # ~65 s here: two trainer actors, an engine actor and a rollout worker start (torch each)
@pytest.mark.filterwarnings("ignore")
def test_trainer_launcher_ray_trains_on_two_actor_ranks(cluster, tmp_path):
    """`trainer.launcher: ray`: two trainer actors share one process group; rank 0 holds the Ray engine and
    rollout workers, both ranks train and checkpoint, and the weights pushed from the two ranks reach the
    engine actor (step 2's logprobs are those of the step-1 policy, as `turnrl export` writes it)."""
    from test_launch import _assert_sampled_by, _write_config

    from turnrl.cli import run_training
    from turnrl.config import load_config
    from turnrl.train.checkpoint import export_checkpoint

    config = _write_config(tmp_path, "run", steps=2, trainer={"parallel": "fsdp", "world_size": 2, "launcher": "ray"},
                           engine={"max_batch_size": 1, "distributed": "ray", "ray_workers": 1})
    history = run_training(load_config(TrainConfig, config, [f"run_dir={tmp_path / 'run'}"]))  # rank 0's, returned
    # through the driver, which chose the run directory every rank writes into
    steps = [m for m in history if "train/samples" in m]
    assert [m["step"] for m in steps] == [1.0, 2.0] and steps[-1]["train/policy_version"] == 2.0
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    assert sorted(f.name for f in (ckpt / "state").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(f.name for f in (ckpt / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    step2 = [Trajectory.from_json(json.loads(line))
             for line in (tmp_path / "run" / "trajectories" / "last_step.jsonl").read_text().splitlines()]
    assert {s.policy_version for t in step2 for s in t.segments if s.source == "model"} == {1}
    _assert_sampled_by(step2, export_checkpoint(ckpt.with_name("step_000001"), tmp_path / "hf1"))


def test_trainer_launcher_ray_raises_the_error_of_a_failing_rank(cluster, tmp_path):
    from turnrl.train.ray import train_on_ray

    def train(rank, world_size, init_method):
        if rank == 1:
            raise ValueError(f"rank {rank} of {world_size} failed")
        time.sleep(60)  # stands for a rank waiting in a collective: stopped by the driver, not waited for

    t0 = time.perf_counter()
    with pytest.raises(ray.exceptions.RayTaskError, match="rank 1 of 2 failed"):
        train_on_ray(train, 2)
    assert time.perf_counter() - t0 < 30
    # device: cuda asks one GPU per rank; a cluster without them is refused at once instead of waiting
    with pytest.raises(ValueError, match="trainer.world_size=2 Ray trainer actors need 2 GPUs .* has 0"):
        train_on_ray(train, 2, gpus_per_rank=1.0)


def test_trainer_actors_join_one_process_group(cluster):
    from turnrl.config import TrainerConfig
    from turnrl.train.ray import train_on_ray

    def train(rank, world_size, init_method):
        from turnrl.train.parallel import Parallel

        cfg = TrainerConfig(parallel="fsdp", world_size=world_size, launcher="ray")
        parallel = Parallel.start(cfg, rank=rank, world_size=world_size, init_method=init_method)
        try:
            return parallel.all_gather_object((parallel.rank, os.getpid())), parallel.all_sum([rank + 1])
        finally:
            parallel.close()

    ranks, total = train_on_ray(train, 2)  # rank 0's result
    assert [r for r, _ in ranks] == [0, 1] and total == [3.0]
    pids = {pid for _, pid in ranks}
    assert len(pids) == 2 and os.getpid() not in pids  # two actor processes, one group


def test_a_killed_worker_has_its_groups_reissued_and_the_rollout_goes_on(engines, renderer):
    rollout = start_rollout(engines, renderer, ENV_CFG, workers=2)
    victim = rollout.workers[1]
    rows = latency_rows(6, LatencyDraw(mean_s=0.4, min_turns=3, max_turns=3, seed=2))  # ~1 s of tool time each

    async def run():
        got = []
        async for traj in rollout.stream(rows, n=2, id_prefix="k-"):
            got.append(traj)
            if len(got) == 1:  # mid-run: the other worker's groups are still in flight
                ray.kill(victim)
        return got

    try:
        trajs = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        for worker in rollout.workers:  # not rollout.close(): the engine actors are the module's
            ray.kill(worker)
    ids = [t.id for t in trajs]
    assert len(ids) == len(set(ids)) == 12  # every trajectory once: nothing lost, nothing twice
    assert {t.group_id for t in trajs} == set(group_ids(rows, "k-"))
    assert all(t.status == "completed" for t in trajs) and victim not in rollout.workers
