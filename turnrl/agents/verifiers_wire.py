"""The client side of a verifiers v1 env server's protocol (verifiers 0.4 `verifiers.v1.serve`), without verifiers.

An env server is a ZMQ ROUTER; a client is a DEALER sending three frames `[request_id, method, msgpack payload]`
(methods `run`, `health`, `cancel`). A run streams `[request_id, b"delta", payload]` frames as the episode grows
(each trace's header once, then appended nodes / calls / errors and changed scalar fields) and ends with
`[request_id, b"reply", payload]`: `{success, error, head, traces: [{id, nodes, calls}]}`, the episode without its
traces and each trace's size, which the assembled traces must match. This module speaks that protocol with
`pyzmq` and `msgpack` alone (the `turnrl[verifiers-client]` extra), so turnrl's venv needs no verifiers (whose pins
clash with it): `EnvServer.run` returns the episode record as verifiers' own `EnvClient` assembles it, as plain
dicts (its traces are what `turnrl.agents.verifiers.trajectories_from_trace` takes).

Faults are bounded: while a run is in flight the server is asked for its health every `health_interval_s`; a
server that leaves `health_timeout_s` without answering (it died, or its event loop is stuck) fails the run with
`VerifiersServerError` naming the address, and the whole run is bounded by its `timeout_s`. A run given up (a
timeout, a cancelled trajectory) is cancelled on the server, as verifiers' client does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import weakref
from typing import Any

log = logging.getLogger(__name__)

LIST_FIELDS = ("nodes", "calls", "errors", "extra_usage", "request_rewrites", "response_rewrites")
"""A trace's append-only fields: a delta carries the items past those already sent."""


class VerifiersServerError(RuntimeError):
    """The env server failed a request, stopped answering, or sent what the protocol does not allow."""


class EpisodeTimeout(VerifiersServerError):
    """The server answers, but the episode ran past its bound (`timeout_s`)."""


def _zmq() -> Any:
    try:
        import msgpack  # noqa: F401
        import zmq.asyncio
    except ImportError:
        raise ImportError("talking to a verifiers env server needs pyzmq and msgpack: "
                          "pip install 'turnrl[verifiers-client]'") from None
    return zmq


def pack(payload: Any) -> bytes:
    import msgpack

    return msgpack.packb(payload, use_bin_type=True)


def unpack(data: bytes) -> Any:
    import msgpack

    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class EpisodeAssembly:
    """The traces of one run, built from its delta frames (verifiers' `serve.delta.EpisodeAssembly`)."""

    def __init__(self) -> None:
        self.traces: dict[str, dict[str, Any]] = {}

    def apply(self, delta: dict[str, Any]) -> None:
        trace_id = delta["trace"]
        if delta.get("discard"):  # a retried attempt's trace
            self.traces.pop(trace_id, None)
            return
        trace = self.traces.get(trace_id)
        if trace is None:
            if "open" not in delta:
                raise VerifiersServerError(f"a delta for trace {trace_id} before its header")
            trace = self.traces[trace_id] = {**delta["open"], **{f: [] for f in LIST_FIELDS}}
        for index, links in (delta.get("links") or {}).items():
            trace["nodes"][int(index)].setdefault("semantic_parents", []).extend(links)
        for name in LIST_FIELDS:
            trace[name].extend(delta.get(name) or [])
        trace.update(delta.get("set") or {})

    def finish(self, head: dict[str, Any], summaries: list[dict[str, Any]]) -> dict[str, Any]:
        traces = []
        for summary in summaries:
            trace = self.traces.get(summary["id"])
            if trace is None:
                raise VerifiersServerError(f"the env server's episode is missing trace {summary['id']}")
            if len(trace["nodes"]) != summary["nodes"] or len(trace["calls"]) != summary["calls"]:
                raise VerifiersServerError(
                    f"trace {summary['id']}: assembled {len(trace['nodes'])} nodes / {len(trace['calls'])} calls, "
                    f"the server reports {summary['nodes']} / {summary['calls']}")
            traces.append(trace)
        return {**head, "traces": traces}


class EnvServer:
    """One DEALER connection to an env server at `address` (`tcp://HOST:PORT`), on the event loop it is first
    used from (`EnvServer.on_loop` keeps one per address and loop)."""

    _open: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, EnvServer]] = weakref.WeakKeyDictionary()

    def __init__(self, address: str):
        zmq = _zmq()
        self.address = address
        self.ctx = zmq.asyncio.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        for option in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
            self.socket.setsockopt(option, 0)
        self.socket.connect(address)
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._deltas: dict[str, EpisodeAssembly] = {}
        self._receiver: asyncio.Task | None = None

    @classmethod
    def on_loop(cls, address: str) -> EnvServer:
        servers = cls._open.setdefault(asyncio.get_running_loop(), {})
        if address not in servers:
            servers[address] = cls(address)
        return servers[address]

    async def _receive(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            try:
                request_id, kind, data = (frames[0].decode(), frames[1], frames[2])
                if kind == b"delta":
                    assembly = self._deltas.get(request_id)
                    if assembly is not None:
                        assembly.apply(unpack(data))
                    continue
                reply = unpack(data)
                future = self._pending.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_result(reply)
            except Exception as e:  # one bad frame fails its own request at most, never the receiver
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                log.warning("verifiers env server %s: a malformed frame (%d parts): %s", self.address, len(frames), why)
                if len(frames) == 3:
                    future = self._pending.pop(frames[0].decode(errors="replace"), None)
                    if future is not None and not future.done():
                        future.set_exception(VerifiersServerError(
                            f"the verifiers env server at {self.address} sent a malformed reply: {why}"))

    async def _send(self, method: str, payload: dict[str, Any], request_id: str | None = None
                    ) -> tuple[str, asyncio.Future[Any]]:
        if self._receiver is None or self._receiver.done():
            self._receiver = asyncio.create_task(self._receive())
        request_id = request_id or uuid.uuid4().hex
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        await self.socket.send_multipart([request_id.encode(), method.encode(), pack(payload)])
        return request_id, future

    async def health(self, timeout_s: float = 2.0) -> bool:
        request_id, future = await self._send("health", {})
        try:
            reply = await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            self._pending.pop(request_id, None)
            return False
        return bool(reply.get("success"))

    async def run(self, request: dict[str, Any], *, timeout_s: float, health_interval_s: float = 5.0,
                  health_timeout_s: float = 30.0) -> dict[str, Any]:
        """Run one episode (`request`: verifiers' RunRequest fields `task_data`, `client`, `model`, `sampling`)
        and return its record; VerifiersServerError when the server fails the run or stops answering, EpisodeTimeout
        after `timeout_s`."""
        request_id = uuid.uuid4().hex
        assembly = self._deltas[request_id] = EpisodeAssembly()
        deadline = time.monotonic() + timeout_s
        try:
            _, future = await self._send("run", request, request_id)
            last_answer = time.monotonic()
            while not future.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EpisodeTimeout(f"the verifiers env server at {self.address} did not finish the episode "
                                         f"in {timeout_s:g} s (env_config.timeout_s)")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(future), min(health_interval_s, left))
                if future.done():
                    break
                if await self.health(min(health_interval_s, 2.0, max(deadline - time.monotonic(), 0.1))):
                    last_answer = time.monotonic()
                elif time.monotonic() - last_answer > health_timeout_s:
                    raise VerifiersServerError(f"the verifiers env server at {self.address} does not answer (no "
                                               f"health reply for {health_timeout_s:g} s into the episode): it died, "
                                               "hangs, or was never there")
            reply = future.result()
        except BaseException:
            self._pending.pop(request_id, None)
            with contextlib.suppress(Exception):  # best effort: the server stops spending inference on it
                await self._send("cancel", {"request_id": request_id})
            raise
        finally:
            self._deltas.pop(request_id, None)
        if not reply.get("success", False):
            raise VerifiersServerError(f"the verifiers env server at {self.address} failed the run: "
                                       f"{reply.get('error') or 'no error given'}")
        if not isinstance(reply.get("head"), dict):
            raise VerifiersServerError("the env server's run reply has no episode head")
        return assembly.finish(reply["head"], reply.get("traces") or [])

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        self.socket.close(0)
        self.ctx.term()
