"""Games the policy plays against itself: a `Table` puts the policy in every seat of a turn-based game.

An env factory that returns a `Table` (e.g. `--env textarena:TicTacToe-v0` with `env_config.opponent: self`) gets
one episode with a trajectory per seat: `env_agent` (turnrl.agents) drives every seat with the turn loop (`drive`),
concurrently, each seat an env of its own (`Table.seats()`), and links them into one episode tree: each seat's
first trajectory after seat 0's is a `seat` branch of seat 0's first trajectory (docs/trees.md). Each seat sees only
its own observations (mask 0) and is trained on its own moves (mask 1); when the game ends, each seat's trajectories
take that seat's game reward.

A seat's `reset` waits until it is the seat's turn (its first observation), its `step` plays the seat's move and
waits until it is the seat's turn again, or the game ended (done, with the seat's reward). The wait holds the other
seats' model turns, so a seat's step is not bounded by `env_timeout_s` (`waits_for_others`); the table bounds each
call into the game by `call_timeout_s`, and a seat whose trajectory ends before the game did (max_turns, a length
stop, an engine error, a failure) stops the game: the seats waiting for their turn fail with a message naming it,
never wait forever.

A subclass implements the game with plain sync methods (run in a thread, one at a time): `start`, `to_move`,
`observation`, `play`, `outcome`, and optionally `shutdown`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from turnrl.envs.base import EnvError
from turnrl.types import Message, StepResult


class Table:
    """A turn-based game every seat of which the policy plays (module docstring)."""

    def __init__(self, name: str, num_seats: int, call_timeout_s: float | None = 60.0):
        if num_seats < 2:
            raise EnvError(f"{name}: a table needs at least 2 seats, got {num_seats}")
        self.name, self.num_seats, self.call_timeout_s = name, num_seats, call_timeout_s
        self.rewards: dict[int, float] | None = None
        """Each seat's reward, once the game ended."""
        self.infos: dict[str, Any] = {}
        """What every seat's last trajectory gets in rollout_infos when the game ended."""
        self._cond = asyncio.Condition()
        self._started = False
        self._current: int | None = None
        self._stopped: str | None = None  # why the game stopped before it ended
        self._closed: set[int] = set()
        self._seats = [Seat(self, k) for k in range(num_seats)]

    def seats(self) -> list[Seat]:
        """The seats' envs, seat k at index k."""
        return list(self._seats)

    # ---- the game: a subclass implements these (sync; run in a thread, one call at a time) -------------------
    def start(self) -> None:
        """Set the game up."""
        raise NotImplementedError

    def to_move(self) -> int:
        """The seat whose turn it is (the game not over)."""
        raise NotImplementedError

    def observation(self, seat: int, first: bool) -> list[Message]:
        """What `seat` is shown now that it is its turn: its first messages (`first`), later what is new to it."""
        raise NotImplementedError

    def play(self, seat: int, reply: str) -> tuple[bool, dict[str, Any]]:
        """Play `seat`'s reply: (the game is over, the step's info)."""
        raise NotImplementedError

    def outcome(self) -> tuple[dict[int, float], dict[str, Any]]:
        """The ended game's reward of each seat, and the rollout_infos every seat's last trajectory gets."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Free the game's resources (called once, when every seat has left)."""

    # ---- the seats' side --------------------------------------------------------------------------------
    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), self.call_timeout_s)
        except TimeoutError:
            raise EnvError(f"{self.name}.{fn.__name__} exceeded the table's call_timeout_s={self.call_timeout_s}"
                           ) from None

    def _over(self) -> bool:
        return self.rewards is not None or self._stopped is not None

    async def _wait_turn(self, seat: int) -> None:
        """Wait (holding the condition) until it is `seat`'s turn or the game is over; raise if it stopped."""
        await self._cond.wait_for(lambda: self._over() or self._current == seat)
        if self._stopped is not None and self.rewards is None:
            raise EnvError(f"{self.name}: seat {seat} cannot go on: {self._stopped}")

    async def sit(self, seat: int) -> list[Message]:
        """Seat `seat`'s reset: its first messages, once it is its turn."""
        async with self._cond:
            if not self._started:
                self._started = True
                await self._guarded(seat, self._start)
            await self._wait_turn(seat)
            if self.rewards is not None:
                raise EnvError(f"{self.name} ended before seat {seat} could move")
            return list(await self._call(self.observation, seat, True))

    async def _start(self) -> None:
        await self._call(self.start)
        self._current = await self._call(self.to_move)

    async def move(self, seat: int, reply: str) -> StepResult:
        """Seat `seat`'s step: play its reply, then wait for its next turn (its new observation) or the end."""
        async with self._cond:
            if self._stopped is not None:
                raise EnvError(f"{self.name}: seat {seat} cannot go on: {self._stopped}")
            if self.rewards is not None or self._current != seat:
                raise EnvError(f"{self.name}: seat {seat} moved out of turn")
            info: dict[str, Any] = {}

            async def play() -> None:
                done, info_ = await self._call(self.play, seat, reply)
                info.update(info_)
                if done:
                    self.rewards, self.infos = await self._call(self.outcome)
                else:
                    self._current = await self._call(self.to_move)

            await self._guarded(seat, play)
            await self._wait_turn(seat)
            if self.rewards is not None:
                return StepResult(None, reward=float(self.rewards.get(seat, 0.0)), done=True, info=info,
                                  rollout_infos={**self.infos, "seat": seat})
            return StepResult(await self._call(self.observation, seat, False), reward=None, done=False, info=info)

    async def _guarded(self, seat: int, fn: Callable[[], Any]) -> None:
        """Run a game call for `seat`; if it raises (or is cancelled), the game stops for every seat."""
        try:
            await fn()
        except BaseException as e:
            self._stopped = f"the game failed on seat {seat}'s move: {type(e).__name__}: {e}"
            raise
        finally:
            self._cond.notify_all()

    async def leave(self, seat: int) -> None:
        """Seat `seat`'s trajectory ended (its env's close): an unfinished game stops for the others; the last seat
        to leave shuts the game down."""
        async with self._cond:
            if not self._over():
                self._stopped = f"seat {seat}'s trajectory ended before the game did (see that trajectory)"
            self._closed.add(seat)
            self._cond.notify_all()
            last = len(self._closed) == self.num_seats
        if last:
            await self._call(self.shutdown)


class Seat:
    """One seat of a `Table` as an env of its own (its trajectory's)."""

    opens_episode = True
    waits_for_others = True
    """Its step waits for the other seats' model turns: not bounded by env_timeout_s (module docstring)."""

    def __init__(self, table: Table, index: int):
        self.table, self.index = table, index

    async def reset(self) -> list[Message]:
        return await self.table.sit(self.index)

    async def step(self, text: str) -> StepResult:
        return await self.table.move(self.index, text)

    async def close(self) -> None:
        await self.table.leave(self.index)
