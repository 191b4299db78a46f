"""`RemoteRollout`: the trainer's stand-in for a RolloutManager whose turn loop runs in a rollout server.

ms-swift's `swift rollout --multi_turn_scheduler X --external_plugins F` runs the scheduler next to the
inference engine and hands the trainer finished trajectories. The turnrl equivalent:

    turnrl serve --model M --scheduler X --plugin F.py                  # the server imports F.py, resolves X
    rollout = RemoteRollout("http://host:8000", reward_fn=reward)       # here: same interface as RolloutManager
    groups = await run_groups(rollout, rows, n=4)                       # the server runs the turns
    await rollout.engine.update_weights(policy.state_dict(), version=1) # new weights to the server's engine

or `rollout_server: http://host:8000` in a training config, or `turnrl rollout --server URL`.

What runs where:
- server: the RolloutManager built by `turnrl.build.build_rollout_manager` from the server's RolloutConfig
  (plugins imported, scheduler / agent / env / tools resolved *in the server process*), its limits
  (max_turns, max_new_tokens, token_budget, timeouts) and its engine. It never computes rewards.
- here: rows, `n`, the id prefix and the sampling settings of each request; the reward function, applied to
  each trajectory as it arrives (concurrently, while later ones are still generating); weight updates, through
  `engine` (an HttpEngine on the same server, `POST /update_weights`).

Wire format (turnrl/serve/engine_routes.py is the other side): `POST /rollout` with
`{"rows": [...], "n": int, "id_prefix": str, "sampling": {SamplingParams fields}?}` answers a stream of
NDJSON lines, `application/x-ndjson`: one Trajectory JSON (docs/trajectory-format.md) per finished trajectory,
in completion order; blank heartbeat lines while nothing finishes; and a last line `{"done": true,
"trajectories": N}`, or `{"error": {"message", "type"}}` when the server failed mid-stream (a failing
trajectory is not such a failure: it arrives as a FAILED trajectory). `GET /rollout` describes the server's
rollout configuration (model, agent, sampling, limits). A stream that ends without its last line raises.

Rows must be JSON (images as paths or URLs). Each trajectory's `sample` is the caller's own row object again.
VLM processor tensors (`Trajectory.mm_train_inputs`) are not part of the JSON, so text models only for now.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx

from turnrl.engines.base import EngineError
from turnrl.engines.http import TOKEN_ENV, HttpEngine, _excerpt, sampling_from_json, sampling_to_json
from turnrl.rollout.manager import RewardFn, drain, freeze_heap, group_ids, score_episodes
from turnrl.types import SamplingParams, TerminationReason, Trajectory

log = logging.getLogger(__name__)

class RemoteRollout:
    """A `turnrl.rollout.Rollout` (`stream` / `sampling` / `renderer` / `engine`, and `reward_fn` as a
    RolloutManager scores) against a `turnrl serve` rollout server (module docstring).

    Args:
        base_url: the server root, e.g. `http://10.0.0.5:8000`.
        token: bearer token; defaults to the `TURNRL_SERVE_TOKEN` environment variable.
        model: the policy's name, for the local renderer; defaults to the server's model (a different name
            only warns: a checkpoint directory may hold the same model).
        renderer: the local renderer (tracing, decoding); defaults to `ChatRenderer(tokenizer of model)`.
        sampling: sent with every request that passes none; defaults to the server's sampling settings.
        reward_fn: scores each trajectory as it arrives (as RolloutManager does); None leaves rewards as they
            come (None unless the agent set one).
        timeout_s: longest silence between two lines of a stream (the server sends a heartbeat line every
            15 s while nothing finishes); None waits forever.
        connect_timeout_s: limit of opening a connection, so a dead host fails fast.
    """

    def __init__(self, base_url: str, *, token: str | None = None, model: str | None = None, renderer: Any = None,
                 sampling: SamplingParams | None = None, reward_fn: RewardFn | None = None,
                 timeout_s: float | None = 300.0, connect_timeout_s: float = 10.0):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"RemoteRollout.base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.info = self._describe(connect_timeout_s)
        server_model = self.info.get("model")
        if model is not None and server_model is not None and model != server_model:
            log.warning("rollout server %s serves %r, this side names the policy %r: make sure they are the same "
                        "model (the trainer's weights are pushed to the server after each step)",
                        self.base_url, server_model, model)
        if self.info.get("policy_version"):
            log.warning("rollout server %s holds weights of policy version %s (pushed by an earlier run?); "
                        "rollouts use them until new weights are pushed", self.base_url, self.info["policy_version"])
        if renderer is None:
            from turnrl.models import load_tokenizer
            from turnrl.render import ChatRenderer

            name = model or server_model
            if not name:
                raise ValueError(f"rollout server {self.base_url} does not name its model: pass model= (the policy's "
                                 "name or path) so this side can load its tokenizer")
            renderer = ChatRenderer(load_tokenizer(name), self.info.get("chat_template_kwargs"))
        from turnrl.multimodal import VisionRenderer

        if isinstance(renderer, VisionRenderer):
            raise ValueError("a rollout server serves text models only for now: VLM processor tensors "
                             "(Trajectory.mm_train_inputs) do not travel over HTTP; roll out in process instead")
        self.renderer = renderer
        self.sampling = sampling if sampling is not None else sampling_from_json(self.info.get("sampling") or {})
        self.reward_fn = reward_fn
        self.engine = HttpEngine(self.base_url, token=self.token, connect_timeout_s=connect_timeout_s)
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    # ---- the RolloutManager interface ------------------------------------------------------------
    async def stream(self, rows: Sequence[dict[str, Any]], n: int = 1, *, id_prefix: str = "",
                     sampling: SamplingParams | None = None) -> AsyncIterator[Trajectory]:
        """Yield trajectories as they arrive from the server, each scored by `reward_fn` first."""
        freeze_heap()  # this process parses every trajectory, as a Ray driver unpickles them (turnrl.rollout.ray)
        rows = list(rows)
        body = {"rows": rows, "n": n, "id_prefix": id_prefix, "sampling": sampling_to_json(sampling or self.sampling)}
        try:
            payload = json.dumps(body, ensure_ascii=False).encode()
        except (TypeError, ValueError) as e:
            raise ValueError(f"rows sent to a rollout server must be JSON (images as paths or URLs): {e}") from None
        row_of = dict(zip(group_ids(rows, id_prefix), rows, strict=True))
        async for traj in drain([functools.partial(self._read, payload, row_of)]):
            yield traj

    def close(self) -> None:
        self.engine.close()
        self._client = self._client_loop = None

    # ---- internals -------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    def _describe(self, timeout_s: float) -> dict[str, Any]:
        where = f"GET {self.base_url}/rollout"
        try:
            response = httpx.get(f"{self.base_url}/rollout", headers=self._headers(), timeout=timeout_s)
        except httpx.HTTPError as e:
            raise EngineError(f"{where} failed: {type(e).__name__}: {e or 'no details'}") from e
        if response.status_code == 404:
            raise EngineError(f"{self.base_url} is not a rollout server: start it with a rollout configuration "
                              "(turnrl serve --scheduler NAME / --env ENV / --agent NAME / --rollout-config FILE)")
        if response.status_code == 401:
            raise EngineError(f"{where} returned HTTP 401: set the server's token (RemoteRollout(token=...) or "
                              f"{TOKEN_ENV})")
        if response.status_code >= 400:
            raise EngineError(f"{where} returned HTTP {response.status_code}: {_excerpt(response.text)}")
        return response.json()

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()  # one client per event loop, as in HttpEngine
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(base_url=self.base_url, headers=self._headers(), timeout=self.timeout)
            self._client_loop = loop
        return self._client

    async def _read(self, payload: bytes, row_of: dict[str, dict[str, Any]], put: Callable[[Trajectory], None]) -> None:
        """Read the stream, scoring each episode as it arrives (while later ones are still read) and putting it once
        scored; raises what ended the stream early. A branch the episode went on from (termination `split`: a
        compaction, a scheduler's split) waits for the rest of its episode, which is scored once (`score_episodes`)."""
        where = f"POST {self.base_url}/rollout"
        scoring: set[asyncio.Task] = set()
        held: dict[str, list[Trajectory]] = {}

        def score_and_put(episode: list[Trajectory]) -> None:
            task = asyncio.create_task(self._score_and_put(episode, put))
            scoring.add(task)
            task.add_done_callback(scoring.discard)

        try:
            async with self._http().stream("POST", "/rollout", content=payload,
                                           headers={"content-type": "application/json"}) as response:
                async for item in _trajectory_lines(response, where):
                    traj = Trajectory.from_json(item)
                    traj.sample = row_of.get(traj.group_id, traj.sample)  # the caller's own row object
                    key = traj.episode_id or traj.id
                    if traj.termination_reason == TerminationReason.SPLIT:
                        held.setdefault(key, []).append(traj)
                    else:
                        score_and_put([*held.pop(key, []), traj])
            for episode in held.values():  # its last branch never came: scored on what did
                score_and_put(episode)
            await asyncio.gather(*scoring)
        except httpx.HTTPError as e:
            raise EngineError(f"{where} failed: {type(e).__name__}: {e or 'no details'}") from e
        finally:
            for task in scoring:
                task.cancel()
            await asyncio.gather(*scoring, return_exceptions=True)

    async def _score_and_put(self, episode: list[Trajectory], put: Callable[[Trajectory], None]) -> None:
        await score_episodes(episode, self.reward_fn)
        for traj in episode:
            put(traj)


async def _trajectory_lines(response: httpx.Response, where: str) -> AsyncIterator[dict[str, Any]]:
    """The Trajectory JSON objects of a /rollout response; raises on an HTTP error, on the server's error
    line and on a stream that ends without its last line."""
    if response.status_code >= 400:
        text = (await response.aread()).decode(errors="replace")
        hint = f" (set the server's token: RemoteRollout(token=...) or {TOKEN_ENV})" if response.status_code == 401 else ""
        raise EngineError(f"{where} returned HTTP {response.status_code}{hint}: {_excerpt(text)}")
    async for line in response.aiter_lines():
        if not line.strip():
            continue  # heartbeat
        item = _parse_line(line, where)
        if "format_version" in item:
            yield item
        elif item.get("done") is True:
            return
        else:  # the server failed after it started streaming
            error = item.get("error")
            message = error.get("message", error) if isinstance(error, dict) else _excerpt(line)
            raise EngineError(f"{where}: the server failed mid-stream: {message}")
    raise EngineError(f"{where}: the stream ended before its last line (did the server stop?)")


def _parse_line(line: str, where: str) -> dict[str, Any]:
    try:
        item = json.loads(line)
    except ValueError:
        raise EngineError(f"{where}: a stream line is not JSON: {_excerpt(line)}") from None
    if not isinstance(item, dict):
        raise EngineError(f"{where}: a stream line is not a JSON object: {_excerpt(line)}")
    return item
