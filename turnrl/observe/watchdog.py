"""The watchdog: a run that stops making progress fails, naming what was stuck and what it was doing.

Progress is an engine call, env call, trajectory or training phase that ends (a `busy` block exiting, a
`wait` returning, `progress()`). When nothing has progressed for `timeout_s` while something waits on the
watchdog (`wait`) or a watched sync phase runs (`phase`), the run fails with `Stalled`, e.g.

    no progress for 120 s: 12 trajectories waiting on engine.generate (replica replica0 (http://10.0.0.5:8000),
    oldest 118 s); 2 trajectories waiting on env.step (turnrl.envs.arithmetic.ArithmeticEnv, oldest 60 s)

and the stacks of the stuck asyncio tasks and of the threads go to the log at ERROR level (py-spy style).

    watchdog = Watchdog(120)
    with watchdog.busy("engine.generate", url):          # where progress happens
        out = await engine.generate(...)
    result = await watchdog.wait(aw)                      # Stalled instead of waiting forever
    with watchdog.phase("trainer.update", "step 3"):      # sync code: Stalled raised in its thread
        update()

A monitor thread watches, so a stall is reported, stacks included, even when the event loop itself is blocked
by sync code (the report says so and shows where). What can be failed: an async `wait` at once (what it waited
on is cancelled, never awaited), a sync `phase` at its next Python bytecode. A thread stuck in native code (a
hung collective, a blocked C call) cannot be interrupted from Python: the report still names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

Detail = str | Callable[[], str]
"""What an activity is doing; a callable is evaluated only when a report is written."""


class Stalled(RuntimeError):
    """Nothing progressed for `watchdog_s`; the message names the stuck components and what they were doing."""


@dataclass(eq=False)
class _Activity:
    component: str
    detail: Detail
    started: float
    owner: Any
    """The asyncio task (or thread id) it runs in: a report shows each owner's innermost activity."""


@dataclass(eq=False)
class _Phase:
    name: str
    thread_id: int
    interrupted: bool = False


@dataclass(eq=False)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    stalled: asyncio.Future = field(repr=False)


class Watchdog:
    """Fails a run that makes no progress for `timeout_s` seconds (None: off, every method a cheap no-op)."""

    def __init__(self, timeout_s: float | None, *, poll_s: float | None = None):
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"watchdog_s must be > 0 or None, got {timeout_s}")
        self.timeout_s = timeout_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, (timeout_s or 10) / 10)
        self._lock = threading.Lock()
        self._activities: list[_Activity] = []
        self._waiters: list[_Waiter] = []
        self._phases: list[_Phase] = []
        self._last = time.monotonic()
        self._monitor: threading.Thread | None = None
        self.stalls: list[str] = []
        """The message of every stall so far."""

    @property
    def enabled(self) -> bool:
        return self.timeout_s is not None

    # ---- where progress happens --------------------------------------------------------------------
    def progress(self) -> None:
        self._last = time.monotonic()

    def busy(self, component: str, detail: Detail = "") -> _Busy:
        """An activity (`with` or `async with`), shown in a stall report while it runs; its end, however it
        ends, is progress."""
        return _Busy(self, component, detail)

    def counting(self, fn: Callable[[T], Any]) -> Callable[[T], Any]:
        """`fn` that counts each call as progress (e.g. a trajectory arriving from a remote rollout)."""
        def counted(item: T) -> Any:
            self.progress()
            return fn(item)
        return counted

    # ---- what fails on a stall ---------------------------------------------------------------------
    async def wait(self, aw: Awaitable[T], component: str | None = None, detail: Detail = "") -> T:
        """Await `aw`; on a stall cancel it without waiting for it, and raise Stalled. `component` (and
        `detail`) show this wait in reports (else only the activities under it show)."""
        if not self.enabled:
            return await aw
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(aw)
        waiter = _Waiter(loop, loop.create_future())
        self._watch(waiter, self._waiters)
        try:
            with self.busy(component, detail) if component else contextlib.nullcontext():
                await asyncio.wait({task, waiter.stalled}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            task.add_done_callback(_consume)
            raise
        finally:
            self._unwatch(waiter, self._waiters)
        if task.done():
            return task.result()
        task.cancel()  # whatever it waits on hung: never wait for its cancellation to finish
        task.add_done_callback(_consume)
        raise Stalled(waiter.stalled.result())

    @contextlib.contextmanager
    def phase(self, name: str, detail: Detail = "") -> Iterator[None]:
        """Sync code watched as a phase: on a stall Stalled is raised in this thread, where it runs."""
        if not self.enabled:
            yield
            return
        phase = _Phase(name, threading.get_ident())
        self._watch(phase, self._phases)
        try:
            with self.busy(name, detail):
                yield
        finally:
            with self._lock:
                self._phases.remove(phase)
                if phase.interrupted and not isinstance(sys.exc_info()[1], Stalled):
                    _raise_in(phase.thread_id, None)  # ended before the interrupt landed: it must not land later

    # ---- the monitor ---------------------------------------------------------------------------------
    def _watch(self, item: Any, into: list) -> None:
        with self._lock:
            if not self._waiters and not self._phases:
                self._last = time.monotonic()  # time spent with nothing watched is not a stall
            into.append(item)
            if self._monitor is None:
                self._monitor = threading.Thread(target=self._run, name="turnrl-watchdog", daemon=True)
                self._monitor.start()

    def _unwatch(self, item: Any, into: list) -> None:
        with self._lock:  # the monitor exits by itself once nothing is watched
            into.remove(item)

    def _run(self) -> None:
        while True:
            time.sleep(self.poll_s)
            with self._lock:
                if not self._waiters and not self._phases:
                    self._monitor = None
                    return
                idle = time.monotonic() - self._last
            if idle > self.timeout_s:  # type: ignore[operator]  # enabled
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        blocked = self._blocked_loops()
        message = self.report(idle, blocked)
        self.stalls.append(message)
        log.error("%s\n%s", message, self.stacks())
        interrupt = type("Stalled", (Stalled,), {"__init__": lambda exc: Stalled.__init__(exc, message)})
        with self._lock:
            for waiter in self._waiters:
                with contextlib.suppress(RuntimeError):  # its loop has closed
                    waiter.loop.call_soon_threadsafe(_settle, waiter.stalled, message)
            for phase in self._phases:
                if not phase.interrupted:
                    phase.interrupted = True
                    _raise_in(phase.thread_id, interrupt)
            self._last = time.monotonic()  # one report per timeout_s of silence

    def _blocked_loops(self) -> list[asyncio.AbstractEventLoop]:
        """Loops of the waiters that do not run a callback within a second: blocked by sync code."""
        with self._lock:
            loops = list({id(w.loop): w.loop for w in self._waiters}.values())
        blocked = []
        for loop in loops:
            answered = threading.Event()
            try:
                loop.call_soon_threadsafe(answered.set)
            except RuntimeError:
                continue
            if not answered.wait(1.0):
                blocked.append(loop)
        return blocked

    # ---- reports -------------------------------------------------------------------------------------
    def report(self, idle: float, blocked: Sequence[asyncio.AbstractEventLoop] = ()) -> str:
        """`no progress for N s: <what each stuck owner was doing>`."""
        now = time.monotonic()
        innermost, trajectories = self._innermost()
        groups: dict[tuple[str, str, bool], list[float]] = {}
        for owner, a in innermost.items():
            groups.setdefault((a.component, _text(a.detail), owner in trajectories), []).append(now - a.started)
        parts = [_describe(component, detail, is_trajectory, ages)
                 for (component, detail, is_trajectory), ages in sorted(groups.items(), key=lambda g: -len(g[1]))]
        if blocked:
            parts.append("the event loop is blocked by sync code (its thread's stack is in the log)")
        return f"no progress for {idle:.0f} s: " + ("; ".join(parts) or "nothing was running")

    def stacks(self, limit: int = 25) -> str:
        """The stack of one stuck task per kind of activity, then of every thread (identical ones once)."""
        out: list[str] = []
        seen: set[tuple[str, str]] = set()
        for a in self._innermost()[0].values():
            key = (a.component, _text(a.detail))
            if isinstance(a.owner, asyncio.Task) and key not in seen and len(seen) < 8:
                seen.add(key)
                frames = traceback.StackSummary.extract((f, f.f_lineno) for f in _task_frames(a.owner)[-limit:])
                out.append(f"asyncio task {a.owner.get_name()} ({key[0]}, {key[1]}):\n" + "".join(frames.format()))
        names = {t.ident: t.name for t in threading.enumerate()}
        by_stack: dict[str, list[str]] = {}
        for ident, frame in sys._current_frames().items():
            if names.get(ident) != "turnrl-watchdog":
                stack = "".join(traceback.format_stack(frame, limit=limit))
                by_stack.setdefault(stack, []).append(names.get(ident, str(ident)))
        for stack, threads in by_stack.items():
            shown = ", ".join(threads[:4]) + (f" and {len(threads) - 4} more" if len(threads) > 4 else "")
            out.append(f"thread {shown}:\n{stack}")
        return "\n".join(out)

    def _innermost(self) -> tuple[dict[int, _Activity], set[int]]:
        """Each owner's innermost (latest started) activity, and the owners that are trajectories."""
        with self._lock:
            activities = list(self._activities)
        innermost: dict[int, _Activity] = {}
        for a in activities:
            if id(a.owner) not in innermost or a.started >= innermost[id(a.owner)].started:
                innermost[id(a.owner)] = a
        return innermost, {id(a.owner) for a in activities if a.component == "trajectory"}


class _Busy:
    def __init__(self, watchdog: Watchdog, component: str, detail: Detail):
        self.watchdog, self.component, self.detail = watchdog, component, detail
        self.activity: _Activity | None = None

    def __enter__(self) -> None:
        w = self.watchdog
        if w.enabled:
            self.activity = _Activity(self.component, self.detail, time.monotonic(), _owner())
            with w._lock:
                w._activities.append(self.activity)

    def __exit__(self, *exc: object) -> None:
        w = self.watchdog
        if self.activity is not None:
            with w._lock:
                w._activities.remove(self.activity)
            w.progress()

    async def __aenter__(self) -> None:
        self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)


def _owner() -> Any:
    try:
        return asyncio.current_task() or threading.get_ident()
    except RuntimeError:  # no running loop: a sync caller
        return threading.get_ident()


def _text(detail: Detail) -> str:
    if callable(detail):
        try:
            return detail()
        except Exception as e:  # a report must never fail
            return f"<detail unavailable: {type(e).__name__}>"
    return detail


def _describe(component: str, detail: str, is_trajectory: bool, ages: list[float]) -> str:
    what = f"{component} ({detail + ', ' if detail else ''}oldest {max(ages):.0f} s)"
    if is_trajectory:
        noun = "trajectory" if len(ages) == 1 else "trajectories"
        if component != "trajectory":
            return f"{len(ages)} {noun} waiting on {what}"
        return f"{len(ages)} {noun} in the agent ({detail or 'no engine or env call'}, oldest {max(ages):.0f} s)"
    return what if len(ages) == 1 else f"{len(ages)} × {what}"


def _task_frames(task: asyncio.Task) -> list[Any]:
    """The frames of a suspended task from its outermost coroutine to the innermost awaited one."""
    frames: list[Any] = []
    coro: Any = task.get_coro()
    while coro is not None and len(frames) < 1000:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames


def _settle(future: asyncio.Future, message: str) -> None:
    if not future.done():
        future.set_result(message)


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" at shutdown


def _raise_in(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Raise `exc_type` in a thread at its next bytecode (None: clear one still pending)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc_type) if exc_type else None)


async def abandon_after(aw: Awaitable[T], timeout_s: float | None, what: str = "the call") -> T:
    """Await `aw` for at most `timeout_s`; past it, cancel it WITHOUT waiting for it to finish cancelling
    (`asyncio.wait_for` waits, so a call stuck in its cancellation handler would hold the caller) and raise
    TimeoutError naming `what`. Cancelling the caller cancels `aw` the same way."""
    task = asyncio.ensure_future(aw)
    if timeout_s is None:
        return await task
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(_consume)
        raise
    if done:
        return task.result()
    task.cancel()
    task.add_done_callback(_consume)
    raise TimeoutError(f"{what} gave no answer within {timeout_s:g} s")


def engine_label(engine: Any, request_id: str) -> str:
    """Where a request goes, for reports: the router's replica for it, else the engine's URL, else its type."""
    replica_label = getattr(engine, "replica_label", None)
    if callable(replica_label):
        return replica_label(request_id)
    return getattr(engine, "base_url", None) or type(engine).__name__
