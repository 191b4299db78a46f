"""Ray: engine replicas and rollout workers as actors around the components a single process uses.

    driver (Trainer)                              worker processes
    RayRollout.stream(rows, n)      ─ shard k ─▶  RolloutWorker k: build_manager(engine)        (imports
      rows round-robin, results in row order        RolloutManager.stream ─▶ drive ─▶ Router     plugins)
                                                                                          │ RayEngine
    RayEngineGroup.update_weights(state_dict)                                             ▼
      ray.put once ─────────────────────────────────────────────────▶  EngineActor j: build_engine()

Each actor builds its part in its own process with the function it is given, which the driver's composition
root (`turnrl.build`, `engine.distributed: ray`) makes from the config with the builders a single process uses:
nothing here reads a config.

What crosses a process boundary is what already crosses the Engine and RolloutManager APIs: token ids,
`SamplingParams` and `GenerateOutput` between a worker's Router and the engine actors; rows in and
`Trajectory` objects out between the driver and the workers. There is no second turn loop.

- Ids and seeds: the driver derives every row's group id as one process would (`rollout.group_ids`) and
  sends each worker the ids of its shard, so trajectory ids, and the per-request sampling seeds `drive`
  derives from them, are those of a single-process run: the same seed gives the same tokens.
- Plugins: a worker builds its manager (`turnrl.build.build_rollout_manager`) in its own process, which
  imports `rollout.plugins` there, so a scheduler registered by a plugin file exists where it runs.
- Weights: the trainer's state dict is put in the object store once and every engine actor reads it from
  there. A failure on any actor raises: a replica left on stale weights must not keep serving.
- Failures: a worker's Router fails over between engine actors as between local replicas; a failing env or
  agent fails its own trajectory inside the worker, as in one process; a dead worker's unfinished groups are
  re-issued to the workers left (same ids, no trajectory delivered twice); with none left `stream` raises.
- `rollout.workers: N` (or engine.distributed ray with engine.ray_workers) starts N workers; each runs its
  share of the groups with the same RolloutManager (its own admission: `rollout.concurrency` is per worker).
- Trainer ranks (`trainer.launcher: ray`) live in turnrl.train.ray; rank 0 is the "driver" of the picture
  above (it holds the RayRollout and the RayEngineGroup, or an engine in its own process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import ray

from turnrl.engines.base import Engine, NamedTensors
from turnrl.engines.router import Router
from turnrl.rollout.manager import RolloutManager, freeze_heap, group_ids
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
    """One engine replica in its own process, made there by `build_engine()` (`turnrl.build.load_engine` for
    one replica: it loads the weights itself, so none travel at start-up)."""

    def __init__(self, build_engine: Callable[[], Engine]):
        import transformers

        transformers.utils.logging.disable_progress_bar()  # one loading bar per actor clutters the driver's log
        self.engine = build_engine()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       images: list[Any] | None = None) -> GenerateOutput:
        return await self.engine.generate(prompt_ids, params, request_id=request_id, images=images)

    async def update_weights(self, weights: dict[str, Any] | ray.ObjectRef, version: int | None = None,
                             final: bool = True, pause: str = "keep") -> int:
        # Ray resolves a top-level ref argument, not one in a container
        tensors: NamedTensors = await weights if isinstance(weights, ray.ObjectRef) else weights
        options = {} if pause == "keep" else {"pause": pause}
        return await self.engine.update_weights(tensors, version, final=final, **options)

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
                             final: bool = True, pause: str = "keep") -> int:
        """Accepts tensors (put in the object store here) or a ref of a state dict already put there."""
        return await self.actor.update_weights.remote(_put_weights(named_tensors), version, final, pause)

    async def sleep(self) -> None:
        await self.actor.sleep.remote()

    async def wake_up(self) -> None:
        await self.actor.wake_up.remote()

    async def release(self, request_id: str) -> None:
        await self.actor.release.remote(request_id)

    def close(self) -> None:
        return None  # a handle: the actor belongs to the RayEngineGroup that started it, which stops it


class RayEngineGroup:
    """The driver's engine: `generate` through a Router over every engine actor (evaluation, serving from the
    driver), and `update_weights` / `sleep` / `wake_up` sent to all of them."""

    def __init__(self, actors: Sequence[Any]):
        if not actors:
            raise ValueError("RayEngineGroup needs at least one EngineActor")
        self.actors = list(actors)
        self._closed = False
        self.router = Router({f"engine{i}": RayEngine(a) for i, a in enumerate(self.actors)})

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str,
                       images: list[Any] | None = None) -> GenerateOutput:
        return await self.router.generate(prompt_ids, params, request_id=request_id, images=images)

    async def update_weights(self, named_tensors: NamedTensors | ray.ObjectRef, version: int | None = None, *,
                             final: bool = True, pause: str = "keep") -> int:
        """Put the tensors (a whole state dict or one bucket of it) in the object store once, then load them
        on every actor; raises if any fails."""
        ref = _put_weights(named_tensors)
        versions = await asyncio.gather(*(a.update_weights.remote(ref, version, final, pause) for a in self.actors))
        return max(versions)

    async def sleep(self) -> None:
        await asyncio.gather(*(a.sleep.remote() for a in self.actors))

    async def wake_up(self) -> None:
        await asyncio.gather(*(a.wake_up.remote() for a in self.actors))

    async def release(self, request_id: str) -> None:
        await self.router.release(request_id)

    def close(self) -> None:
        """Stop the engine actors (once: a later call does nothing)."""
        if not self._closed:
            self._closed = True
            for actor in self.actors:
                ray.kill(actor)


# ---------------------------------------------------------------------------------------------------
# Rollout workers
# ---------------------------------------------------------------------------------------------------
BATCH_MAX = 256
"""The most trajectories a rollout worker sends the driver as one object."""


@ray.remote
class RolloutWorker:
    """Rolls out a shard of rows with the RolloutManager `build_manager(engine)` makes in this process (the one
    a single process builds), its engine a Router over the engine actors it is given."""

    def __init__(self, build_manager: Callable[[Engine], RolloutManager], engines: Sequence[Any]):
        self.manager = build_manager(Router({f"engine{i}": RayEngine(a) for i, a in enumerate(engines)}))

    async def stream(self, rows: list[dict[str, Any]], n: int, row_group_ids: list[str],
                     sampling: SamplingParams | None = None) -> AsyncIterator[list[Trajectory]]:
        """Trajectories of these rows as they finish, in batches (a Ray streaming generator on the caller's
        side): each batch is what finished since the last one was sent, at most BATCH_MAX. One object per
        batch rather than per trajectory: at thousands of turns a second the driver's cost per object (a round
        trip, a deserialisation) is what stops a second worker from adding throughput."""
        async for batch in self.manager.stream_batches(rows, n, sampling=sampling, row_group_ids=row_group_ids):
            for i in range(0, len(batch), BATCH_MAX):
                yield batch[i : i + BATCH_MAX]

    def stats(self) -> dict[str, float]:
        """This worker's RolloutManager.stats() (turns_per_s, concurrency, kv_occupancy, preemptions)."""
        return self.manager.stats()

    def agents(self) -> list[str]:
        """Agent names registered in this worker (a plugin scheduler shows up as `scheduler`)."""
        return sorted(self.manager.agents)

    def ready(self) -> bool:
        return True


class RayRollout:
    """The driver's stand-in for a RolloutManager (a `turnrl.rollout.Rollout`): `stream` takes the same
    arguments and gives the same trajectories; rows go round-robin to the workers."""

    def __init__(self, workers: Sequence[Any], engine: RayEngineGroup, renderer: Any, sampling: SamplingParams):
        if not workers:
            raise ValueError("RayRollout needs at least one RolloutWorker")
        self.workers, self.engine, self.renderer = list(workers), engine, renderer
        self.sampling = sampling
        """The workers' default sampling (rollout.sampling); what the trainer's sampled evaluation uses."""
        self._closed = False

    @classmethod
    def start(cls, build_engine: Callable[[], Engine], build_manager: Callable[[Engine], RolloutManager], *,
              replicas: int, workers: int, renderer: Any, sampling: SamplingParams,
              address: str | None = None) -> RayRollout:
        """Start `replicas` engine actors and `workers` rollout workers (on the cluster at `address`, else a
        local one) and wait until all are built. `renderer` is the driver's; `sampling` the workers' default."""
        init_ray(address)
        actors = [EngineActor.remote(build_engine) for _ in range(replicas)]  # type: ignore[attr-defined]
        handles = [RolloutWorker.remote(build_manager, actors) for _ in range(workers)]  # type: ignore[attr-defined]
        ray.get([a.ready.remote() for a in [*actors, *handles]])  # start-up errors surface here, not mid-step
        return cls(handles, RayEngineGroup(actors), renderer, sampling)

    async def stream(self, rows: Sequence[dict[str, Any]], n: int = 1, *, id_prefix: str = "",
                     sampling: SamplingParams | None = None) -> AsyncIterator[Trajectory]:
        """Yield trajectories as they finish in any worker (rewards already computed there). A worker that dies
        (its process killed, its node lost) is dropped and its groups not yet fully delivered are re-issued to
        the workers left, under the same ids (same seeds); a trajectory delivered before is not delivered twice.
        With no worker left, the stream raises."""
        freeze_heap()  # the driver unpickles every trajectory: with the defaults its collections cost it 2.5x
        ids = group_ids(rows, id_prefix)
        delivered: dict[str, set[str]] = {g: set() for g in ids}  # group id -> trajectory ids delivered
        queue: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        turn = running = 0

        def issue(indices: list[int]) -> None:
            nonlocal turn, running
            live = self.workers
            if not indices:
                return
            if not live:
                raise RuntimeError("every Ray rollout worker died; the rollout cannot go on")
            shards: dict[int, list[int]] = {}
            for i in indices:  # round-robin from where the last issue stopped
                shards.setdefault(turn % len(live), []).append(i)
                turn += 1
            for k, shard in shards.items():
                task = asyncio.create_task(_pump_worker(live[k], [rows[i] for i in shard], n, [ids[i] for i in shard],
                                                        sampling, shard, queue))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                running += 1

        issue(list(range(len(rows))))
        try:
            while running:
                item = await queue.get()
                if item is _FINISHED:
                    running -= 1
                elif isinstance(item, Trajectory):
                    if item.id not in delivered.setdefault(item.group_id, set()):
                        delivered[item.group_id].add(item.id)
                        yield item
                elif isinstance(item, _WorkerDied):
                    log.warning("Ray rollout worker died (%s); re-issuing its unfinished groups to the %d left",
                                item.error, len(self.workers) - 1)
                    running -= 1
                    self.workers = [w for w in self.workers if w is not item.worker]
                    issue([i for i in item.shard if len(delivered[ids[i]]) < n])
                elif isinstance(item, BaseException):
                    raise item
        finally:
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def stats(self, timeout_s: float = 10.0) -> dict[str, float]:
        """Every worker's RolloutManager.stats() as `worker<k>/<name>`, and their sums (turns_per_s, concurrency,
        preemptions) and the fullest worker's kv_occupancy under the plain names."""
        reports = ray.get([w.stats.remote() for w in self.workers], timeout=timeout_s)
        out: dict[str, float] = {}
        for k, report in enumerate(reports):
            out.update({f"worker{k}/{name}": v for name, v in report.items()})
            for name, v in report.items():
                if name == "kv_occupancy":
                    out[name] = max(out.get(name, 0.0), v)
                elif name in ("turns_per_s", "concurrency", "preemptions", "in_flight"):
                    out[name] = out.get(name, 0.0) + v
        return out

    def close(self) -> None:
        """Stop the workers and the engine actors (once: a later call does nothing)."""
        if not self._closed:
            self._closed = True
            for worker in self.workers:
                ray.kill(worker)
            self.engine.close()


_FINISHED = object()


class _WorkerDied:
    def __init__(self, worker: Any, shard: list[int], error: BaseException):
        self.worker, self.shard, self.error = worker, shard, error


async def _pump_worker(worker: Any, rows: list[dict[str, Any]], n: int, ids: list[str], sampling: SamplingParams | None,
                       shard: list[int], queue: asyncio.Queue) -> None:
    """Put one worker's streamed trajectories, then `_FINISHED`; a dead worker puts `_WorkerDied` (its groups are
    re-issued), any other error itself (the caller's batch fails loudly)."""
    batches = worker.stream.remote(rows, n, ids, sampling)
    try:
        async for ref in batches:
            for traj in await ref:
                queue.put_nowait(traj)
        queue.put_nowait(_FINISHED)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            ray.cancel(batches)
        raise
    except ray.exceptions.RayActorError as e:
        queue.put_nowait(_WorkerDied(worker, shard, e))
    except Exception as e:
        queue.put_nowait(e)
