"""Router: least-in-flight spread, sticky trajectories, LRU, elastic membership, failover, fan-out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
import torch

from turnrl.engines.base import Engine, EngineError, InvalidRequest, NamedTensors
from turnrl.engines.router import Router
from turnrl.types import FinishReason, GenerateOutput, SamplingParams

PARAMS = SamplingParams(max_new_tokens=4)


class FakeEngine:
    """Answers `[token, len(prompt)]` after `latency` s; can be told to fail, hang, or wait on a gate."""

    def __init__(self, token: int, *, latency: float = 0.001, fail_after: int | None = None) -> None:
        self.token = token
        self.latency = latency
        self.fail_after = fail_after
        """Raise on every call after this many calls."""
        self.hang = False
        self.gate: asyncio.Event | None = None
        """When set, each call waits for the event before answering."""
        self.version = 0
        self.calls: list[str] = []
        self.released: list[str] = []
        self.weights_seen: list[dict[str, torch.Tensor]] = []
        self.asleep = False
        self.closed = 0
        self.fail_close = False

    async def generate(self, prompt_ids, params, *, request_id, images=None) -> GenerateOutput:
        self.calls.append(request_id)
        if self.fail_after is not None and len(self.calls) > self.fail_after:
            await asyncio.sleep(self.latency)
            raise RuntimeError(f"engine {self.token} crashed")
        if self.hang:
            await asyncio.sleep(3600)
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(self.latency)
        return GenerateOutput([self.token, len(prompt_ids)], [-0.5, -0.25], FinishReason.STOP, self.version)

    async def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> int:
        self.weights_seen.append(dict(named_tensors))
        self.version = self.version + 1 if version is None else version
        return self.version

    async def sleep(self) -> None:
        self.asleep = True

    async def wake_up(self) -> None:
        self.asleep = False

    async def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def close(self) -> None:
        self.closed += 1
        if self.fail_close:
            raise RuntimeError(f"engine {self.token} cannot close")


async def gen(router: Router, request_id: str, prompt_len: int = 3) -> GenerateOutput:
    return await router.generate(list(range(prompt_len)), PARAMS, request_id=request_id)


async def until_in_flight(router: Router, name: str, n: int) -> None:
    for _ in range(200):
        if router.stats().replicas[name].in_flight == n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{name} never reached {n} in flight: {router.stats()}")


def test_router_is_an_engine_and_names_list_replicas() -> None:
    router = Router([FakeEngine(1), FakeEngine(2)])
    assert isinstance(router, Engine)
    assert list(router.stats().replicas) == ["replica0", "replica1"]
    assert list(Router({"x": FakeEngine(1)}).stats().replicas) == ["x"]
    with pytest.raises(ValueError, match="sticky_capacity"):
        Router(sticky_capacity=0)
    with pytest.raises(KeyError, match="no replica named 'nope'"):
        router.remove_replica("nope")


async def test_concurrent_new_trajectories_spread_evenly() -> None:
    a, b = FakeEngine(1), FakeEngine(2)
    router = Router({"a": a, "b": b})
    outs = await asyncio.gather(*(gen(router, f"t{i}") for i in range(8)))
    assert len(a.calls) == len(b.calls) == 4
    assert sorted(o.token_ids[0] for o in outs) == [1] * 4 + [2] * 4
    stats = router.stats()
    assert (stats.replicas["a"].requests, stats.replicas["b"].requests, stats.sticky_entries) == (4, 4, 8)
    assert stats.replicas["a"].in_flight == stats.replicas["b"].in_flight == 0


async def test_new_trajectory_goes_to_least_in_flight_replica() -> None:
    a, b = FakeEngine(1), FakeEngine(2)
    a.gate, b.gate = asyncio.Event(), asyncio.Event()
    router = Router({"a": a, "b": b})
    t1, t2, t3 = (asyncio.create_task(gen(router, f"t{i}")) for i in (1, 2, 3))
    await until_in_flight(router, "a", 2)  # t1 -> a, t2 -> b, t3 -> a (a full tie: first registered)
    b.gate.set()
    await t2
    b.gate.clear()
    # a: 2 in flight, b: 0 -> t4 and t5 both go to b; then 2/2, and a has served fewer -> t6 to a.
    rest = [asyncio.create_task(gen(router, f"t{i}")) for i in (4, 5, 6)]
    await until_in_flight(router, "a", 3)
    assert [router.replica_for(f"t{i}") for i in range(1, 7)] == ["a", "b", "a", "b", "b", "a"]
    a.gate.set()
    b.gate.set()
    await asyncio.gather(t1, t3, *rest)


async def test_every_turn_of_a_trajectory_stays_on_its_replica() -> None:
    engines = {"a": FakeEngine(1), "b": FakeEngine(2), "c": FakeEngine(3)}
    router = Router(engines)

    async def trajectory(tid: str) -> list[int]:
        return [(await gen(router, tid, prompt_len=3 * turn)).token_ids[0] for turn in range(1, 5)]

    served = await asyncio.gather(*(trajectory(f"t{i}") for i in range(6)))
    assert all(len(set(tokens)) == 1 for tokens in served)  # one replica per trajectory
    assert sorted(len(e.calls) for e in engines.values()) == [8, 8, 8]  # 2 trajectories x 4 turns each


async def test_sticky_map_is_an_lru_of_bounded_size() -> None:
    router = Router({"a": FakeEngine(1), "b": FakeEngine(2)}, sticky_capacity=2)
    for tid in ("t1", "t2", "t1", "t3"):  # the second t1 refreshes it, so t2 is the oldest when t3 arrives
        await gen(router, tid)
    assert router.stats().sticky_entries == 2
    assert router.replica_for("t2") is None
    assert router.replica_for("t1") is not None and router.replica_for("t3") is not None


async def test_replica_added_at_run_time_takes_new_trajectories() -> None:
    a, b = FakeEngine(1), FakeEngine(2)
    a.gate = asyncio.Event()
    router = Router({"a": a})
    busy = [asyncio.create_task(gen(router, f"old{i}")) for i in range(2)]
    await until_in_flight(router, "a", 2)
    router.add_replica("b", b)
    assert (await gen(router, "new")).token_ids[0] == 2
    assert router.replica_for("new") == "b"
    a.gate.set()
    await asyncio.gather(*busy)


async def test_removed_replica_finishes_in_flight_work_and_loses_its_trajectories() -> None:
    a, b = FakeEngine(1), FakeEngine(2)
    router = Router({"a": a, "b": b})
    await asyncio.gather(gen(router, "t1"), gen(router, "t2"))
    assert (router.replica_for("t1"), router.replica_for("t2")) == ("a", "b")

    b.gate = asyncio.Event()
    running = asyncio.create_task(gen(router, "t2"))  # turn 2 of t2, running on b
    await until_in_flight(router, "b", 1)
    router.remove_replica("b")
    assert router.replica_for("t2") is None and list(router.stats().replicas) == ["a"]
    b.gate.set()
    assert (await running).token_ids[0] == 2  # graceful: the running turn completes on b

    assert (await gen(router, "t2")).token_ids[0] == 1  # turn 3 is re-routed
    assert router.replica_for("t2") == "a"
    assert b.calls == ["t2", "t2"]


async def test_replica_failing_mid_rollout_is_taken_out_and_all_trajectories_finish() -> None:
    a, b = FakeEngine(1), FakeEngine(2, fail_after=5)
    router = Router({"a": a, "b": b})

    async def trajectory(tid: str) -> list[GenerateOutput]:
        return [await gen(router, tid, prompt_len=2 + turn) for turn in range(3)]

    results = await asyncio.gather(*(trajectory(f"t{i}") for i in range(16)))
    assert all(len(r) == 3 for r in results)
    # Every answer came from a, or from b before it started failing.
    b_answers = sum(out.token_ids[0] == 2 for r in results for out in r)
    assert b_answers == 5 and sum(out.token_ids[0] == 1 for r in results for out in r) == 48 - 5
    stats = router.stats().replicas
    assert not stats["b"].healthy and stats["a"].healthy
    assert stats["b"].failures >= 1 and stats["b"].last_error == "RuntimeError: engine 2 crashed"
    assert stats["b"].failures == len(b.calls) - 5  # each failed call counted once, none retried on b
    assert all(router.replica_for(f"t{i}") == "a" for i in range(16))


async def test_hanging_replica_times_out_and_request_is_retried() -> None:
    a, b = FakeEngine(1), FakeEngine(2)
    a.hang = True
    router = Router({"a": a, "b": b}, request_timeout_s=0.05)
    out = await gen(router, "t1")
    assert out.token_ids[0] == 2 and router.replica_for("t1") == "b"
    stats = router.stats().replicas["a"]
    assert (stats.healthy, stats.failures, stats.in_flight) == (False, 1, 0)
    assert "no answer within request_timeout_s=0.05" in (stats.last_error or "")


async def test_no_replica_left_raises_engine_error_naming_request_and_replicas() -> None:
    router = Router({"a": FakeEngine(1, fail_after=0), "b": FakeEngine(2, fail_after=0)})
    with pytest.raises(EngineError) as err:
        await gen(router, "traj-7")
    message = str(err.value)
    assert "'traj-7'" in message and "['a', 'b']" in message and "no healthy replica left" in message
    assert "RuntimeError: engine 2 crashed" in message
    with pytest.raises(EngineError, match="no healthy replica for request 'traj-8'.*a unhealthy"):
        await gen(router, "traj-8")


async def test_retries_are_bounded_by_max_retries() -> None:
    engines = {n: FakeEngine(i, fail_after=0) for i, n in enumerate("abc")}
    router = Router(engines, max_retries=1)
    with pytest.raises(EngineError, match=r"\['a', 'b'\] \(retries exhausted, max_retries=1\)"):
        await gen(router, "t1")
    assert engines["c"].calls == [] and router.stats().replicas["c"].healthy


async def test_failed_replica_can_be_restored_or_replaced() -> None:
    a, b = FakeEngine(1, fail_after=0), FakeEngine(2)
    router = Router({"a": a, "b": b})
    await gen(router, "t1")  # a fails, b answers
    a.fail_after = None
    router.restore("a")
    assert router.stats().replicas["a"].healthy and router.stats().replicas["a"].failures == 1
    assert (await gen(router, "t2")).token_ids[0] == 1  # a full tie: a was registered first

    router.add_replica("b", FakeEngine(3))  # replacing drops b's pins and counters
    assert router.replica_for("t1") is None and router.stats().replicas["b"].requests == 0


async def test_update_weights_fans_out_a_materialised_iterator() -> None:
    a, b, c = FakeEngine(1), FakeEngine(2), FakeEngine(3, fail_after=0)
    router = Router({"a": a, "b": b, "c": c})
    await gen(router, "t1")  # goes to a
    await gen(router, "t2")  # goes to b
    await gen(router, "t3")  # c fails, leaves rotation; retried on a

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        yield "w", torch.ones(2)
        yield "b", torch.zeros(1)

    assert await router.update_weights(weights(), version=7) == 7
    assert [sorted(e.weights_seen[0]) for e in (a, b)] == [["b", "w"], ["b", "w"]]
    assert c.weights_seen == []  # unhealthy replicas are skipped
    assert (await gen(router, "t1")).policy_version == 7


async def test_update_weights_takes_max_version_when_replicas_disagree(caplog) -> None:
    a, b = FakeEngine(1), FakeEngine(2)
    b.version = 4
    router = Router({"a": a, "b": b})
    with caplog.at_level(logging.WARNING, logger="turnrl.engines.router"):
        assert await router.update_weights({"w": torch.ones(1)}) == 5
    assert (a.version, b.version) == (1, 5) and "disagree" in caplog.text


async def test_sleep_wake_up_fan_out_and_release_unpins() -> None:
    a, b = FakeEngine(1), FakeEngine(2)
    router = Router({"a": a, "b": b})
    await router.sleep()
    assert a.asleep and b.asleep
    await router.wake_up()
    assert not a.asleep and not b.asleep

    await asyncio.gather(gen(router, "t1"), gen(router, "t2"))
    await router.release("t2")
    await router.release("never-seen")  # no pin: nothing to forward
    assert b.released == ["t2"] and a.released == []
    assert router.replica_for("t2") is None and router.stats().sticky_entries == 1


async def test_cancelled_caller_is_not_a_replica_failure() -> None:
    a = FakeEngine(1)
    a.hang = True
    router = Router({"a": a})
    task = asyncio.create_task(gen(router, "t1"))
    await until_in_flight(router, "a", 1)
    task.cancel()  # rollout shutdown: the replica did nothing wrong
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = router.stats().replicas["a"]
    assert (stats.healthy, stats.failures, stats.in_flight) == (True, 0, 0)


def test_close_closes_every_current_replica_even_when_one_raises(caplog) -> None:
    a, b, gone = FakeEngine(1), FakeEngine(2), FakeEngine(3)
    a.fail_close = True
    router = Router({"a": a, "b": b, "gone": gone})
    router.remove_replica("gone")  # no longer the router's to close
    with caplog.at_level(logging.WARNING):
        router.close()
        router.close()
    assert (a.closed, b.closed, gone.closed) == (2, 2, 0)
    assert "replica 'a' raised RuntimeError('engine 1 cannot close')" in caplog.text


async def test_an_invalid_request_is_not_retried_and_keeps_the_replica_healthy() -> None:
    class Refusing(FakeEngine):
        async def generate(self, prompt_ids, params, *, request_id, images=None):
            if -1 in prompt_ids:
                self.calls.append(request_id)
                raise InvalidRequest("prompt_ids[0] = -1 is not a token id", "prompt_ids")
            return await super().generate(prompt_ids, params, request_id=request_id, images=images)

    a, b = Refusing(1), Refusing(2)
    router = Router({"a": a, "b": b})
    with pytest.raises(InvalidRequest, match="not a token id"):
        await router.generate([-1], PARAMS, request_id="bad")
    assert len(a.calls + b.calls) == 1  # tried once: another replica would refuse it too
    assert all(r.healthy and r.failures == 0 for r in router.stats().replicas.values())
    assert (await router.generate([5], PARAMS, request_id="good")).token_ids[1] == 1
