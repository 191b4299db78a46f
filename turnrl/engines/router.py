"""Router: one `Engine` in front of several replica engines, with sticky sessions and failover.

The policy follows verl's `GlobalRequestLoadBalancer` (research/verl.md 2.5):

1. **Sticky trajectories.** Every turn of a trajectory carries the same `request_id`, and the router sends
   it to the replica that served the previous turn. That replica still holds the conversation in its
   prefix/KV cache, so turn t+1 prefills only the new observation tokens instead of the whole history.
   The map is a bounded LRU (`sticky_capacity`): an evicted trajectory is routed afresh, which costs a
   cache miss, never an error.
2. **Fewest in flight.** A new trajectory goes to the healthy replica with the fewest requests running
   now (ties: fewer requests served so far, then first registered, so routing is deterministic). In-flight
   counts go down when a request ends, so a replica that was slow for a while is not penalised forever.
3. **Failover.** A replica that raises or does not answer within `request_timeout_s` (600 s by default; the
   call is then abandoned, never waited for) is taken out of rotation (the error is kept in `stats()`), its trajectories are unpinned, and the request is retried
   on a replica not yet tried, at most `max_retries` times; then `EngineError`. `restore(name)` or
   `add_replica(name, ...)` brings a replica back.

**Removal is graceful:** `remove_replica` stops routing to the replica at once and unpins its
trajectories (they are re-routed on their next turn), but requests already running on it finish and
return normally. Cancelling and retrying them elsewhere would throw away tokens already sampled and, for
a sampled turn, silently change the trajectory's output.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from turnrl.engines.base import Engine, EngineError, InvalidRequest, KVStats, NamedTensors, kv_stats
from turnrl.observe.watchdog import abandon_after
from turnrl.types import GenerateOutput, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ReplicaStats:
    """One replica's state and counters."""

    name: str
    healthy: bool = True
    """False once a request failed on it; it gets no new requests until restored."""
    in_flight: int = 0
    """Generate calls running on it now."""
    requests: int = 0
    """Generate calls sent to it, retries included."""
    failures: int = 0
    """Calls that raised or timed out (generate, or a fanned-out update_weights/sleep/wake_up)."""
    last_error: str | None = None


@dataclass
class RouterStats:
    replicas: dict[str, ReplicaStats]
    """Registered replicas (removed ones are gone), in registration order."""
    sticky_entries: int
    """Trajectories currently pinned to a replica."""


@dataclass
class _Replica:
    engine: Engine
    stats: ReplicaStats


class Router:
    """An `Engine` that spreads trajectories over replica engines (policy in the module docstring)."""

    def __init__(
        self,
        replicas: Mapping[str, Engine] | Sequence[Engine] = (),
        *,
        sticky_capacity: int = 10_000,
        max_retries: int = 2,
        request_timeout_s: float | None = 600.0,
        release_timeout_s: float = 10.0,
    ) -> None:
        """`replicas` as a name -> engine mapping, or a list (named `replica0`, `replica1`, ...). A generate call
        gets `request_timeout_s` (None: no limit of the router's own), a `release` `release_timeout_s`."""
        if sticky_capacity < 1:
            raise ValueError(f"Router.sticky_capacity must be >= 1, got {sticky_capacity}")
        if max_retries < 0:
            raise ValueError(f"Router.max_retries must be >= 0, got {max_retries}")
        if request_timeout_s is not None and request_timeout_s <= 0:
            raise ValueError(f"Router.request_timeout_s must be > 0 or None, got {request_timeout_s}")
        self.sticky_capacity = sticky_capacity
        self.max_retries = max_retries
        self.request_timeout_s = request_timeout_s
        self.release_timeout_s = release_timeout_s
        self._replicas: dict[str, _Replica] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()  # request_id -> replica name, oldest first
        named = replicas.items() if isinstance(replicas, Mapping) else enumerate(replicas)
        for key, engine in named:
            self.add_replica(key if isinstance(key, str) else f"replica{key}", engine)

    # ---- membership and observability -----------------------------------------------------------
    def add_replica(self, name: str, engine: Engine) -> None:
        """Register `engine` as `name`. An existing `name` is replaced: fresh counters, no pinned trajectories."""
        if name in self._replicas:
            self.remove_replica(name)
        self._replicas[name] = _Replica(engine, ReplicaStats(name))

    def remove_replica(self, name: str) -> None:
        """Stop routing to `name` and unpin its trajectories; requests running on it finish normally."""
        self._get(name)
        del self._replicas[name]
        self._unpin(name)

    def restore(self, name: str) -> None:
        """Put a replica taken out of rotation by a failure back in (its counters are kept)."""
        self._get(name).stats.healthy = True

    def kv_stats(self) -> KVStats | None:
        """Over the replicas that report KV (None if none does): the fullest one's occupancy (admission must not
        overfill any of them), the sum of their preemptions."""
        reports = [r for r in (kv_stats(replica.engine) for replica in self._replicas.values()) if r is not None]
        if not reports:
            return None
        return KVStats(max(r.occupancy for r in reports), sum(r.preemptions for r in reports))

    def replica_for(self, request_id: str) -> str | None:
        """The replica `request_id` is pinned to, if any (does not refresh its LRU position)."""
        return self._sticky.get(request_id)

    def replica_label(self, request_id: str) -> str:
        """`replica NAME (URL)` serving `request_id`, for progress reports (turnrl.observe.watchdog)."""
        name = self._sticky.get(request_id)
        replica = self._replicas.get(name) if name is not None else None
        if replica is None:
            return f"no replica yet ({len(self._replicas)} registered)"
        url = getattr(replica.engine, "base_url", None)
        return f"replica {name} ({url})" if url else f"replica {name}"

    def engines(self) -> dict[str, Engine]:
        """The registered replicas by name, in registration order."""
        return {name: r.engine for name, r in self._replicas.items()}

    def stats(self) -> RouterStats:
        """A snapshot: per-replica health and counters, and the sticky map's size."""
        return RouterStats({n: replace(r.stats) for n, r in self._replicas.items()}, len(self._sticky))

    # ---- Engine protocol ------------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        images: list[Any] | None = None,
    ) -> GenerateOutput:
        tried: list[str] = []
        last_error = ""
        for _ in range(1 + self.max_retries):
            replica = self._acquire(request_id, exclude=tried)
            if replica is None:
                break
            tried.append(replica.stats.name)
            try:
                return await self._call(replica, prompt_ids, params, request_id, images)
            except InvalidRequest:  # the request is at fault, not the replica: no other replica could serve it
                raise
            except Exception as exc:  # any failure takes the replica out; the request moves on
                last_error = self._mark_failed(replica, exc)
        if not tried:
            raise EngineError(f"Router: no healthy replica for request {request_id!r} ({self._describe()})")
        why = "retries exhausted" if len(tried) == 1 + self.max_retries else "no healthy replica left"
        raise EngineError(
            f"Router: request {request_id!r} failed on replicas {tried} ({why}, max_retries="
            f"{self.max_retries}); last error: {last_error}"
        )

    async def update_weights(self, named_tensors: NamedTensors, version: int | None = None, *,
                             final: bool = True, pause: str = "keep") -> int:
        # `named_tensors` may be a one-shot iterator, and every replica needs all of it.
        weights = dict(named_tensors)
        # `final` and `pause` only when not the default, so engines written before them still take default updates
        options: dict[str, Any] = {} if final else {"final": False}
        if pause != "keep":
            options["pause"] = pause
        versions = await self._broadcast("update_weights", lambda e: e.update_weights(weights, version, **options))
        if len(set(versions.values())) > 1:
            logger.warning(
                "Router.update_weights: replicas disagree on the version %s; using the max", versions
            )
        return max(versions.values())

    async def sleep(self) -> None:
        await self._broadcast("sleep", lambda e: e.sleep())

    async def wake_up(self) -> None:
        await self._broadcast("wake_up", lambda e: e.wake_up())

    async def release(self, request_id: str) -> None:
        name = self._sticky.pop(request_id, None)
        replica = self._replicas.get(name) if name is not None else None
        if replica is None:
            return
        try:
            await abandon_after(replica.engine.release(request_id), self.release_timeout_s, f"release on {name!r}")
        except Exception as exc:  # cleanup only: a cache that was not dropped must not fail the trajectory
            logger.warning("Router.release(%r) on replica %r failed: %r", request_id, name, exc)

    def close(self) -> None:
        """Close every replica; one that raises is logged and the others still close."""
        for name, replica in self._replicas.items():
            try:
                replica.engine.close()
            except Exception as exc:
                logger.warning("Router.close: replica %r raised %r", name, exc)

    # ---- internals ------------------------------------------------------------------------------
    def _acquire(self, request_id: str, exclude: list[str]) -> _Replica | None:
        """The pinned replica if still usable, else the least loaded one (which becomes the pin).

        No await between this choice and `_call`'s in-flight increment, so concurrent new trajectories
        see each other's load."""
        name = self._sticky.get(request_id)
        pinned = self._replicas.get(name) if name is not None else None
        if pinned is not None and pinned.stats.healthy and name not in exclude:
            self._sticky.move_to_end(request_id)
            return pinned
        candidates = [r for n, r in self._replicas.items() if r.stats.healthy and n not in exclude]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda r: (r.stats.in_flight, r.stats.requests))
        self._sticky[request_id] = chosen.stats.name
        self._sticky.move_to_end(request_id)
        if len(self._sticky) > self.sticky_capacity:
            self._sticky.popitem(last=False)
        return chosen

    async def _call(
        self, replica: _Replica, prompt_ids: list[int], params: SamplingParams, request_id: str, images: Any
    ) -> GenerateOutput:
        replica.stats.in_flight += 1
        replica.stats.requests += 1
        try:
            call = replica.engine.generate(prompt_ids, params, request_id=request_id, images=images)
            return await abandon_after(call, self.request_timeout_s, f"replica {replica.stats.name!r}")
        finally:
            replica.stats.in_flight -= 1

    def _mark_failed(self, replica: _Replica, exc: BaseException) -> str:
        if isinstance(exc, TimeoutError) and str(exc).startswith(f"replica {replica.stats.name!r} gave no answer"):
            error = f"TimeoutError: no answer within request_timeout_s={self.request_timeout_s}"
        else:
            error = f"{type(exc).__name__}: {exc}"
        stats = replica.stats
        if stats.healthy:
            logger.warning("Router: replica %r taken out of rotation: %s", stats.name, error)
        stats.healthy, stats.failures, stats.last_error = False, stats.failures + 1, error
        if self._replicas.get(stats.name) is replica:  # not a replica since replaced under the same name
            self._unpin(stats.name)
        return error

    async def _broadcast(self, what: str, call: Callable[[Engine], Awaitable[T]]) -> dict[str, T]:
        """Run `call` on every healthy replica concurrently; failing replicas are taken out of rotation
        (one left on stale weights must not keep serving). Raises if none succeeded."""
        targets = [r for r in self._replicas.values() if r.stats.healthy]
        if not targets:
            raise EngineError(f"Router.{what}: no healthy replica ({self._describe()})")
        results = await asyncio.gather(*(call(r.engine) for r in targets), return_exceptions=True)
        succeeded: dict[str, T] = {}
        for replica, result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                self._mark_failed(replica, result)
            else:
                succeeded[replica.stats.name] = result
        if not succeeded:
            raise EngineError(f"Router.{what} failed on every replica ({self._describe()})")
        return succeeded

    def _unpin(self, name: str) -> None:
        for request_id in [rid for rid, n in self._sticky.items() if n == name]:
            del self._sticky[request_id]

    def _get(self, name: str) -> _Replica:
        if name not in self._replicas:
            raise KeyError(f"Router: no replica named {name!r} (replicas: {list(self._replicas)})")
        return self._replicas[name]

    def _describe(self) -> str:
        parts = [
            n if r.stats.healthy else f"{n} unhealthy: {r.stats.last_error}"
            for n, r in self._replicas.items()
        ]
        return f"replicas: {parts or 'none registered'}"
