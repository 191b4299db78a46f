"""Ray: engine replicas and rollout workers as actors around the components a single process uses.

    driver (Trainer)                              worker processes
    RayRollout.run_groups(rows, n)  ─ shard k ─▶  RolloutWorker k: build_rollout_manager(...)   (imports
      rows round-robin, results in row order        RolloutManager.stream ─▶ drive ─▶ Router     plugins)
                                                                                          │ RayEngine
    RayEngineGroup.update_weights(state_dict)                                             ▼
      ray.put once ─────────────────────────────────────────────────▶  EngineActor j: build_engine(...)

What crosses a process boundary is what already crosses the Engine and RolloutManager APIs: token ids,
`SamplingParams` and `GenerateOutput` between a worker's Router and the engine actors; rows in and
`Trajectory` objects out between the driver and the workers. There is no second turn loop.

- Ids and seeds: the driver derives every row's group id as one process would (`rollout.group_ids`) and
  sends each worker the ids of its shard, so trajectory ids, and the per-request sampling seeds `drive`
  derives from them, are those of a single-process run: the same seed gives the same tokens.
- Plugins: a worker builds its manager with `build_rollout_manager` in its own process, which imports
  `rollout.plugins` there, so a scheduler registered by a plugin file exists where it runs.
- Weights: the trainer's state dict is put in the object store once and every engine actor reads it from
  there. A failure on any actor raises: a replica left on stale weights must not keep serving.
- Failures: a worker's Router fails over between engine actors as between local replicas; a failing env or
  agent fails its own trajectory inside the worker, as in one process; a dead worker raises in `stream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import ray

from turnrl.config import ConfigError, EngineConfig, RewardConfig, RolloutConfig
from turnrl.engines.base import NamedTensors
from turnrl.engines.router import Router
from turnrl.rollout import RewardFn, collect_groups, group_ids
from turnrl.types import GenerateOutput, SamplingParams, Trajectory

log = logging.getLogger(__name__)


def init_ray(address: str | None = None, **kwargs: Any) -> None:
    """Connect to the cluster at `address`, or start a local one (no dashboard); no-op if already connected."""
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING, **kwargs)


def _put_weights(named_tensors: NamedTensors | ray.ObjectRef) -> ray.ObjectRef:
    if isinstance(named_tensors, ray.ObjectRef):
        return named_tensors
    items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
    return ray.put({name: t.detach() for name, t in items})


# ---------------------------------------------------------------------------------------------------
# Engine replicas
# ---------------------------------------------------------------------------------------------------
@ray.remote
class EngineActor:
    """One engine replica in its own process. It loads `model` itself (no weights travel at start-up) and
    builds the engine a single process would build (`turnrl.build.build_engine`, one replica)."""

    def __init__(self, model: str, engine_cfg: EngineConfig, *, dtype: str = "float32",
                 eos_token_ids: Sequence[int] = (), image_processor: Any = None):
        import transformers

        from turnrl.build import DTYPES, build_engine
        from turnrl.models import load_model

        transformers.utils.logging.disable_progress_bar()  # one loading bar per actor clutters the driver's log
        one = engine_cfg.model_copy(update={"replicas": 1, "distributed": "none"})
        policy = load_model(model, dtype=DTYPES[dtype]).eval()
        self.engine = build_engine(policy, one, eos_token_ids=list(eos_token_ids), image_processor=image_processor,
                                   model_path=model)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       images: list[Any] | None = None) -> GenerateOutput:
        return await self.engine.generate(prompt_ids, params, request_id=request_id, images=images)

    async def update_weights(self, weights: dict[str, Any] | ray.ObjectRef, version: int | None = None,
                             final: bool = True) -> int:
        if isinstance(weights, ray.ObjectRef):  # Ray resolves a top-level ref argument, not one in a container
            weights = await weights
        return await self.engine.update_weights(weights, version, final=final)

    async def sleep(self) -> None:
        await self.engine.sleep()

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    async def release(self, request_id: str) -> None:
        await self.engine.release(request_id)

    def stats(self) -> dict[str, Any]:
        return dict(getattr(self.engine, "stats", {}))

    def ready(self) -> bool:
        return True


class RayEngine:
    """The Engine protocol over an `EngineActor` handle (Ray object refs are awaitable), so a `Router` fronts
    engine actors exactly as it fronts local engines."""

    def __init__(self, actor: Any):
        self.actor = actor

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str,
                       images: list[Any] | None = None) -> GenerateOutput:
        ref = self.actor.generate.remote(list(prompt_ids), params, request_id, images)
        try:
            return await ref
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                ray.cancel(ref)  # the actor's engine drops the request instead of finishing it for no one
            raise

    async def update_weights(self, named_tensors: NamedTensors | ray.ObjectRef, version: int | None = None, *,
                             final: bool = True) -> int:
        """Accepts tensors (put in the object store here) or a ref of a state dict already put there."""
        return await self.actor.update_weights.remote(_put_weights(named_tensors), version, final)

    async def sleep(self) -> None:
        await self.actor.sleep.remote()

    async def wake_up(self) -> None:
        await self.actor.wake_up.remote()

    async def release(self, request_id: str) -> None:
        await self.actor.release.remote(request_id)


class RayEngineGroup:
    """The driver's engine: `generate` through a Router over every engine actor (evaluation, serving from the
    driver), and `update_weights` / `sleep` / `wake_up` sent to all of them."""

    def __init__(self, actors: Sequence[Any]):
        if not actors:
            raise ValueError("RayEngineGroup needs at least one EngineActor")
        self.actors = list(actors)
        self.router = Router({f"engine{i}": RayEngine(a) for i, a in enumerate(self.actors)})

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str,
                       images: list[Any] | None = None) -> GenerateOutput:
        return await self.router.generate(prompt_ids, params, request_id=request_id, images=images)

    async def update_weights(self, named_tensors: NamedTensors | ray.ObjectRef, version: int | None = None, *,
                             final: bool = True) -> int:
        """Put the tensors (a whole state dict or one bucket of it) in the object store once, then load them
        on every actor; raises if any fails."""
        ref = _put_weights(named_tensors)
        versions = await asyncio.gather(*(a.update_weights.remote(ref, version, final) for a in self.actors))
        return max(versions)

    async def sleep(self) -> None:
        await asyncio.gather(*(a.sleep.remote() for a in self.actors))

    async def wake_up(self) -> None:
        await asyncio.gather(*(a.wake_up.remote() for a in self.actors))

    async def release(self, request_id: str) -> None:
        await self.router.release(request_id)

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)


# ---------------------------------------------------------------------------------------------------
# Rollout workers
# ---------------------------------------------------------------------------------------------------
@ray.remote
class RolloutWorker:
    """Rolls out a shard of rows with the RolloutManager a single process builds (`build_rollout_manager`, in
    this process), its engine a Router over the engine actors it is given."""

    def __init__(self, model: str, rollout_cfg: RolloutConfig, engines: Sequence[Any],
                 reward: RewardConfig | RewardFn | None = None):
        from turnrl.build import build_policy_renderer, build_reward_fn, build_rollout_manager

        renderer, _ = build_policy_renderer(model, rollout_cfg)
        reward_fn = build_reward_fn(reward) if isinstance(reward, RewardConfig) else reward
        router = Router({f"engine{i}": RayEngine(a) for i, a in enumerate(engines)})
        self.manager = build_rollout_manager(rollout_cfg, router, renderer, reward_fn)

    async def stream(self, rows: list[dict[str, Any]], n: int, row_group_ids: list[str],
                     sampling: SamplingParams | None = None) -> AsyncIterator[Trajectory]:
        """Trajectories of these rows as they finish (a Ray streaming generator on the caller's side)."""
        async for traj in self.manager.stream(rows, n, sampling=sampling, row_group_ids=row_group_ids):
            yield traj

    def agents(self) -> list[str]:
        """Agent names registered in this worker (a plugin scheduler shows up as `scheduler`)."""
        return sorted(self.manager.agents)

    def ready(self) -> bool:
        return True


_DONE = object()


class RayRollout:
    """The driver's stand-in for a RolloutManager: `run_groups` and `stream` take the same arguments and give
    the same results (groups in row order, each sorted by sample index); rows go round-robin to the workers."""

    def __init__(self, workers: Sequence[Any], engine: RayEngineGroup, renderer: Any):
        if not workers:
            raise ValueError("RayRollout needs at least one RolloutWorker")
        self.workers, self.engine, self.renderer = list(workers), engine, renderer

    @classmethod
    def start(cls, model: str, rollout_cfg: RolloutConfig, engine_cfg: EngineConfig, *, renderer: Any,
              reward: RewardConfig | RewardFn | None = None, weights: str | None = None, dtype: str = "float32",
              image_processor: Any = None) -> RayRollout:
        """Start `engine_cfg.replicas` engine actors and `engine_cfg.ray_workers` rollout workers.

        `model` names the policy (workers load its tokenizer); `weights` is where the engines load weights
        from when it differs (a checkpoint directory). `renderer` is the driver's, for end-of-turn ids."""
        if engine_cfg.kind != "embedded":
            raise ConfigError(f"engine.distributed=ray runs embedded engines as Ray actors; engine.kind="
                              f"{engine_cfg.kind!r} servers are already separate processes (use distributed=none)")
        init_ray(engine_cfg.ray_address)
        eos = sorted(renderer.end_of_turn_ids)
        actors = [EngineActor.remote(weights or model, engine_cfg, dtype=dtype, eos_token_ids=eos,
                                     image_processor=image_processor) for _ in range(engine_cfg.replicas)]
        workers = [RolloutWorker.remote(model, rollout_cfg, actors, reward) for _ in range(engine_cfg.ray_workers)]
        ray.get([a.ready.remote() for a in [*actors, *workers]])  # start-up errors surface here, not mid-step
        return cls(workers, RayEngineGroup(actors), renderer)

    async def stream(self, rows: Sequence[dict[str, Any]], n: int = 1, *, id_prefix: str = "",
                     sampling: SamplingParams | None = None) -> AsyncIterator[Trajectory]:
        """Yield trajectories as they finish in any worker (rewards already computed there)."""
        ids = group_ids(rows, id_prefix)
        shards = [range(k, len(rows), len(self.workers)) for k in range(len(self.workers))]
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [
            asyncio.create_task(_pump(worker, [rows[i] for i in shard], n, [ids[i] for i in shard], sampling, queue))
            for worker, shard in zip(self.workers, shards, strict=True) if len(shard)
        ]
        try:
            running = len(pumps)
            while running:
                item = await queue.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def run_groups(
        self, rows: Sequence[dict[str, Any]], n: int = 1, *, id_prefix: str = "",
        sampling: SamplingParams | None = None, on_trajectory: Callable[[Trajectory], None] | None = None,
    ) -> list[list[Trajectory]]:
        """All trajectories grouped by prompt, in row order (each group sorted by sample index)."""
        return await collect_groups(self.stream(rows, n, id_prefix=id_prefix, sampling=sampling), rows, id_prefix,
                                    on_trajectory)

    def close(self) -> None:
        """Stop the workers and the engine actors."""
        for worker in self.workers:
            ray.kill(worker)
        self.engine.close()


async def _pump(worker: Any, rows: list[dict[str, Any]], n: int, ids: list[str], sampling: SamplingParams | None,
                queue: asyncio.Queue) -> None:
    """Move one worker's streamed trajectories into `queue`, then `_DONE` (or the worker's error)."""
    trajectories = worker.stream.remote(rows, n, ids, sampling)
    try:
        async for ref in trajectories:
            queue.put_nowait(await ref)
        queue.put_nowait(_DONE)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            ray.cancel(trajectories)
        raise
    except Exception as e:  # a dead worker or a bug in it: the caller's batch fails loudly
        queue.put_nowait(e)
