"""TextArena games as environments: `--env textarena:GAME-v0` (`pip install 'turnrl[textarena]'`;
docs/ecosystems.md).

The game is `textarena.make(GAME-v0)`, with the wrappers TextArena registers for that id (the plain id formats the
action and shows the game's transcript; `GAME-v0-raw` has none). The policy plays one seat (`seat`, default 0):

- reset: `env.reset(num_players, seed)` (the row's `seed`, else one derived from the row: a group plays one game);
  the other seats move until it is the policy's turn, and its observation is the episode's first message.
- each reply (reasoning removed) is the seat's action, `env.step(action)`; the others move again; the part of the
  seat's observation it has not seen yet (TextArena's observation is the game's whole transcript) is the next user
  message. TextArena itself tells the model about invalid moves.
- when the game is done, `env.close()` gives every player's reward: the seat's is the step's reward (the
  trajectory's), all of them are in rollout_infos (`game_rewards`, with `game_info`, `seed`, `seat`).

Multi-player games need `opponent` in env_config: a callable `observation -> action`, by path (`file.py:fn`,
`pkg.module:fn`) or a class instantiated with `opponent_kwargs`, e.g. TextArena's own agents
(`textarena.agents:OpenAIAgent` with `{model_name, base_url}`: another engine, such as `turnrl serve` or vLLM).
`opponent: self` puts the policy in every seat (`SelfPlay`, a turnrl.envs.seats Table): one episode, each seat's
turns a trajectory of their own (a `seat` branch of seat 0's), each seat's reward its game reward.

env_config keys: num_players (1, or 2 or more with an opponent; 2 by default with one), seat (not with `self`),
opponent, opponent_kwargs, env_kwargs (for `textarena.make`), system_prompt.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from turnrl.envs.base import EnvError, EnvFactory, episode_seed, episode_settings
from turnrl.envs.seats import Table
from turnrl.loading import load_object
from turnrl.reasoning import split_reasoning
from turnrl.types import Message, StepResult

SETTINGS = frozenset({"num_players", "seat", "opponent", "opponent_kwargs", "env_kwargs", "system_prompt",
                      "max_turns", "label_key"})


def _textarena() -> Any:
    try:
        import textarena
    except ImportError as e:
        raise ImportError(f"--env textarena:... needs the textarena package ({e}): pip install 'turnrl[textarena]'"
                          ) from None
    return textarena


def env_factory(spec: str) -> EnvFactory:
    game = spec.partition(":")[2]
    registry = _textarena().envs.registration.ENV_REGISTRY
    if game not in registry:
        close = difflib.get_close_matches(game, registry, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f" ({len(registry)} are registered)"
        raise ValueError(f"--env {spec}: {game!r} is not a TextArena game{hint}")

    def build_env(sample: dict[str, Any], config: dict[str, Any]) -> TextArenaEnv | SelfPlay:
        settings = episode_settings(sample, config)
        if settings.get("opponent") == "self":
            return SelfPlay(game, settings, episode_seed(sample))
        return TextArenaEnv(game, settings, episode_seed(sample))

    build_env.opens_episode = True  # type: ignore[attr-defined]
    build_env.check = _check  # type: ignore[attr-defined]
    return build_env


def _check(config: dict[str, Any]) -> None:
    unknown = sorted(set(config) - SETTINGS)
    if unknown:
        raise ValueError(f"textarena env_config: unknown key(s) {unknown}; allowed: {sorted(SETTINGS)}")
    if config.get("opponent") == "self":
        _self_play_check(config, "textarena env_config")
    elif config.get("opponent") is not None:
        opponent(config)  # a bad path fails at start-up


def _self_play_check(settings: dict[str, Any], where: str) -> None:
    if "seat" in settings:
        raise ValueError(f"{where}: `seat` has no meaning with opponent: self (the policy plays every seat)")
    if int(settings.get("num_players", 2)) < 2:
        raise ValueError(f"{where}: opponent: self needs num_players >= 2, got {settings['num_players']}")


def opponent(settings: dict[str, Any]) -> Any:
    """The other seats' policy of `settings` (module docstring), None for a single-player game."""
    spec = settings.get("opponent")
    if spec is None:
        return None
    if spec == "self":
        raise ValueError("textarena: opponent 'self' is played by SelfPlay (every seat the policy's), not by one seat")
    target = load_object(str(spec), what="TextArena opponent")
    if inspect.isclass(target):
        return target(**(settings.get("opponent_kwargs") or {}))
    return target


class TextArenaEnv:
    """One game of TextArena with the policy in one seat (module docstring)."""

    opens_episode = True

    def __init__(self, game: str, settings: dict[str, Any], seed: int):
        self.game, self.settings, self.seed = game, settings, seed
        self.opponent = opponent(settings)
        self.num_players = int(settings.get("num_players", 2 if self.opponent is not None else 1))
        self.seat = int(settings.get("seat", 0))
        if self.num_players > 1 and self.opponent is None:
            raise EnvError(f"textarena:{game} with {self.num_players} players needs env_config.opponent for the "
                           "other seats (a file.py:fn or pkg.module:Class policy)")
        if not 0 <= self.seat < self.num_players:
            raise EnvError(f"textarena:{game}: seat {self.seat} is not one of the {self.num_players} players' seats")
        self.env: Any = None
        self.shown = ""
        """The seat's observation as last shown (the next message is what it added)."""
        self._pending: Any = ""
        self.moves = 0

    def reset(self) -> list[Message]:
        self.env = _textarena().make(self.game, **(self.settings.get("env_kwargs") or {}))
        self.env.reset(num_players=self.num_players, seed=self.seed)
        done = self._others_move()
        if done:
            raise EnvError(f"textarena:{self.game} ended before the policy's seat {self.seat} could move")
        system = self.settings.get("system_prompt")
        return [*([{"role": "system", "content": system}] if system else []), self._observation()]

    def step(self, text: str) -> StepResult:
        action = split_reasoning(text)[1].strip()
        done, _ = self.env.step(action)
        self.moves += 1
        done = done or self._others_move()
        if not done:
            return StepResult(self._observation(), reward=None, done=False, info={"action": action})
        rewards, game_info = self.env.close()
        self.env = None
        infos = {"game_rewards": {str(p): float(r) for p, r in (rewards or {}).items()}, "seat": self.seat,
                 "seed": self.seed, "game_info": {str(p): v for p, v in (game_info or {}).items()}}
        reward = float((rewards or {}).get(self.seat, 0.0))
        return StepResult(None, reward=reward, done=True, info={"action": action}, rollout_infos=infos)

    def _others_move(self) -> bool:
        """The other seats play until it is the policy's turn; True when the game ended meanwhile."""
        for _ in range(10_000):  # a game that never hands the turn back is a bug there, not a hang here
            player, observation = self.env.get_observation()
            if player == self.seat:
                self._pending = observation
                return False
            done, _ = self.env.step(self.opponent(observation))
            if done:
                return True
        raise EnvError(f"textarena:{self.game}: the other seats moved 10000 times without handing the turn back")

    def _observation(self) -> Message:
        message, self.shown = _unseen(self._pending, self.shown)
        return message

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


def _unseen(pending: Any, shown: str) -> tuple[Message, str]:
    """What a seat has not seen of its observation (TextArena's default observation is the whole transcript), and
    the observation as now shown."""
    observation = pending if isinstance(pending, str) else str(pending)
    new = observation[len(shown):] if observation.startswith(shown) else observation
    return {"role": "user", "content": new.strip() or observation.strip()}, observation


class SelfPlay(Table):
    """One game of TextArena with the policy in every seat (`opponent: self`; turnrl.envs.seats): each seat's
    observation is TextArena's for that player, each seat's reply its action, each seat's reward its game reward;
    every seat's last trajectory has `game_rewards`, `game_info`, `seed` and its `seat` in rollout_infos."""

    def __init__(self, game: str, settings: dict[str, Any], seed: int):
        try:
            _self_play_check(settings, f"textarena:{game}")
        except ValueError as e:
            raise EnvError(str(e)) from None
        super().__init__(f"textarena:{game}", int(settings.get("num_players", 2)))
        self.game, self.settings, self.seed = game, settings, seed
        self.env: Any = None
        self._pending: dict[int, Any] = {}
        self._shown = [""] * self.num_seats

    def start(self) -> None:
        self.env = _textarena().make(self.game, **(self.settings.get("env_kwargs") or {}))
        self.env.reset(num_players=self.num_seats, seed=self.seed)

    def to_move(self) -> int:
        player, observation = self.env.get_observation()
        if not 0 <= int(player) < self.num_seats:
            raise EnvError(f"textarena:{self.game}: player {player!r} to move is not one of {self.num_seats} seats")
        self._pending[int(player)] = observation
        return int(player)

    def observation(self, seat: int, first: bool) -> list[Message]:
        message, self._shown[seat] = _unseen(self._pending.pop(seat, ""), self._shown[seat])
        system = self.settings.get("system_prompt") if first else None
        return [*([{"role": "system", "content": system}] if system else []), message]

    def play(self, seat: int, reply: str) -> tuple[bool, dict[str, Any]]:
        action = split_reasoning(reply)[1].strip()
        done, _ = self.env.step(action)
        return bool(done), {"action": action}

    def outcome(self) -> tuple[dict[int, float], dict[str, Any]]:
        rewards, game_info = self.env.close()
        self.env = None
        infos = {"game_rewards": {str(p): float(r) for p, r in (rewards or {}).items()}, "seed": self.seed,
                 "game_info": {str(p): v for p, v in (game_info or {}).items()}}
        return {int(p): float(r) for p, r in (rewards or {}).items()}, infos

    def shutdown(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
