"""The token-level routes, what `HttpEngine` speaks (wire format in turnrl/engines/http.py), and `/rollout`.

    POST /generate          {prompt_ids, sampling, request_id, images?} -> {token_ids, logprobs, finish_reason,
                            policy_version, cached_prompt_tokens}; a max_new_tokens beyond the context after the
                            prompt is capped, and the answer then holds `max_new_tokens` and `warnings`
    POST /update_weights    safetensors bytes (?version=N&final=false), or {"path": "...", "version": N?} -> {policy_version}
    POST /sleep | /wake_up  -> {"ok": true}
    POST /release           {request_id} -> {"ok": true}
A field that fails validation is a 422 naming it, `{"error": {"message", "type", "param", "code"}}`.

The rollout server (only when started with a rollout configuration: `--scheduler`, `--env`, `--agent`, `--plugin`,
`--tools` or `--rollout-config`; ms-swift's `swift rollout`) runs a RolloutManager over its engine, built by
`turnrl.build` as `turnrl rollout` builds it; the client is `turnrl.rollout.remote.RemoteRollout`:
    GET  /rollout           -> {model, policy_version, agent, agent_loop, agents, sampling, limits, concurrency,
                            chat_template_kwargs}
    POST /rollout           {rows: [...], n: 1, id_prefix: "", sampling?: {SamplingParams fields, over the
                            server's}} -> application/x-ndjson: one Trajectory JSON per line as each finishes,
                            blank heartbeat lines, then {"done": true, "trajectories": N}, or
                            {"error": {message, type}} if the server failed mid-stream. No rewards here (the
                            client scores); a failing trajectory arrives as a FAILED trajectory.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations, and `Request` is imported
# inside the functions that add the routes (fastapi stays an optional dependency: `turnrl[serve]`).

import asyncio
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from turnrl.engines.base import Engine, InvalidRequest
from turnrl.engines.http import (
    output_to_json,
    sampling_from_json,
    sampling_to_json,
    tensors_from_safetensors_bytes,
)
from turnrl.observe.stats import json_default
from turnrl.serve.http import json_body
from turnrl.types import SamplingParams, is_int

log = logging.getLogger(__name__)

FORMS = ["POST /generate", "POST /update_weights", "POST /sleep", "POST /wake_up", "POST /release"]
ROLLOUT_FORMS = ["GET /rollout", "POST /rollout"]


# ---- token level -------------------------------------------------------------------------------------
_GENERATE_FIELDS = {"prompt_ids", "sampling", "request_id", "images"}


def _generate_request(body: dict[str, Any], engine: Engine) -> tuple[list[int], SamplingParams, str, list | None,
                                                                     list[str]]:
    """(prompt_ids, sampling, request_id, images, warnings) of a /generate body; InvalidRequest (422) names the
    field. `max_new_tokens` beyond what fits the engine's context after the prompt is capped, with a warning."""
    unknown = set(body) - _GENERATE_FIELDS
    if unknown:
        raise InvalidRequest(f"/generate: unknown field(s) {sorted(unknown)}; known: {sorted(_GENERATE_FIELDS)}",
                             sorted(unknown)[0])
    prompt_ids, request_id, images = body.get("prompt_ids"), body.get("request_id"), body.get("images")
    if not isinstance(prompt_ids, list) or not prompt_ids:
        raise InvalidRequest("prompt_ids must be a non-empty list of token ids", "prompt_ids")
    for i, t in enumerate(prompt_ids):
        if not is_int(t) or t < 0:
            raise InvalidRequest(f"prompt_ids[{i}] must be a token id (an integer >= 0), got {t!r}", "prompt_ids")
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequest("request_id must be a non-empty string (the trajectory id)", "request_id")
    if images is not None and not (isinstance(images, list) and all(isinstance(im, str) for im in images)):
        raise InvalidRequest("images must be a list of strings (paths, URLs or data URIs)", "images")
    params = sampling_from_json(body.get("sampling") or {})
    warnings = []
    context = getattr(engine, "max_context", None)
    if isinstance(context, int) and len(prompt_ids) + params.max_new_tokens > context > len(prompt_ids):
        room = context - len(prompt_ids)
        warnings.append(f"sampling.max_new_tokens={params.max_new_tokens} capped to {room}: the prompt's "
                        f"{len(prompt_ids)} tokens leave {room} of the context's {context}")
        params = dataclasses.replace(params, max_new_tokens=room)
    return prompt_ids, params, request_id, images or None, warnings


def add_token_routes(app: Any, engine: Engine) -> None:
    from fastapi import Request

    @app.post("/generate")
    async def generate(request: Request):
        prompt_ids, params, request_id, images, warnings = _generate_request(await json_body(request), engine)
        out = await engine.generate(prompt_ids, params, request_id=request_id, images=images)
        body = output_to_json(out)
        if warnings:
            body["max_new_tokens"], body["warnings"] = params.max_new_tokens, warnings
        return body

    @app.post("/update_weights")
    async def update_weights(request: Request):
        if request.headers.get("content-type", "").startswith("application/json"):
            body = await json_body(request)
            tensors = await asyncio.to_thread(_load_safetensors_path, body.get("path"))
            version = body.get("version")
        else:
            tensors = tensors_from_safetensors_bytes(await request.body())
            version = request.query_params.get("version")
        # final=false: one bucket of a streamed update, pause=...: what requests in flight do (each passed on only
        # when given, so any engine takes a default push)
        options: dict[str, Any] = {"final": False} if request.query_params.get("final", "").lower() == "false" else {}
        if request.query_params.get("pause", "keep") != "keep":
            options["pause"] = request.query_params["pause"]
        new_version = await engine.update_weights(tensors, None if version is None else int(version), **options)
        return {"policy_version": new_version}

    @app.post("/sleep")
    async def sleep():
        await engine.sleep()
        return {"ok": True}

    @app.post("/wake_up")
    async def wake_up():
        await engine.wake_up()
        return {"ok": True}

    @app.post("/release")
    async def release(request: Request):
        await engine.release(str((await json_body(request)).get("request_id", "")))
        return {"ok": True}


def _load_safetensors_path(path: Any) -> dict[str, Any]:
    from safetensors.torch import load_file

    if not isinstance(path, str) or not path:
        raise ValueError('update_weights JSON needs "path": a .safetensors file or a folder of them on the server')
    where = Path(path)
    files = sorted(where.glob("*.safetensors")) if where.is_dir() else [where]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"update_weights: no safetensors file at {path}")
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


# ---- the rollout server ------------------------------------------------------------------------------
def add_rollout_routes(app: Any, manager: Any, model_name: str, heartbeat_s: float) -> None:
    from fastapi import Request
    from fastapi.responses import StreamingResponse

    @app.get("/rollout")
    async def describe():
        agent = manager.agents[manager.default_agent]
        return {
            "model": model_name, "policy_version": getattr(manager.engine, "policy_version", None),
            "agent": manager.default_agent, "agent_loop": getattr(agent, "__name__", manager.default_agent),
            "agents": sorted(manager.agents), "sampling": sampling_to_json(manager.sampling),
            "limits": dataclasses.asdict(manager.limits), "concurrency": manager.concurrency,
            "chat_template_kwargs": getattr(manager.renderer, "chat_template_kwargs", {}),
        }

    @app.post("/rollout")
    async def rollout(request: Request):
        rows, n, id_prefix, sampling = _rollout_request(await json_body(request), manager)
        return StreamingResponse(_rollout_lines(manager, rows, n, id_prefix, sampling, heartbeat_s),
                                 media_type="application/x-ndjson")


def _rollout_request(body: dict[str, Any], manager: Any) -> tuple[list[dict[str, Any]], int, str, Any]:
    """Validate a /rollout body (ValueError -> 400 before anything streams)."""
    from turnrl.rollout.manager import group_ids

    unknown = set(body) - {"rows", "n", "id_prefix", "sampling"}
    if unknown:
        raise ValueError(f"/rollout: unknown field(s) {sorted(unknown)}; known: id_prefix, n, rows, sampling")
    rows, n, id_prefix = body.get("rows"), body.get("n", 1), body.get("id_prefix", "")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError("/rollout: rows must be a list of JSON objects (dataset rows)")
    if not is_int(n) or n < 1:
        raise ValueError(f"/rollout: n must be an integer >= 1, got {n!r}")
    if not isinstance(id_prefix, str):
        raise ValueError(f"/rollout: id_prefix must be a string, got {id_prefix!r}")
    given = body.get("sampling") or {}
    if not isinstance(given, dict):
        raise ValueError("/rollout: sampling must be a JSON object of SamplingParams fields")
    sampling = sampling_from_json({**sampling_to_json(manager.sampling), **given})
    for row, group in zip(rows, group_ids(rows, id_prefix), strict=True):
        manager.context(row, f"{group}-0", group, 0)  # an unknown agent_name fails the request now, with a 400
    return rows, n, id_prefix, sampling


_STREAM_END = object()


async def _rollout_lines(manager: Any, rows: list[dict[str, Any]], n: int, id_prefix: str, sampling: Any,
                         heartbeat_s: float):
    """NDJSON lines of `manager.stream` (module docstring). Leaving early (the client went away) cancels the
    rollout: its trajectories are cancelled and their engine caches released."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for traj in manager.stream(rows, n, id_prefix=id_prefix, sampling=sampling):
                queue.put_nowait(traj)
            queue.put_nowait(_STREAM_END)
        except Exception as e:  # trajectories fail on their own; this is a bug or a dead engine
            log.exception("/rollout failed after it started streaming")
            queue.put_nowait(e)

    task = asyncio.create_task(pump())
    count = 0
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), heartbeat_s)
            except TimeoutError:
                yield "\n"  # keeps proxies and the client's read timeout from closing an idle stream
                continue
            if item is _STREAM_END:
                yield json.dumps({"done": True, "trajectories": count}) + "\n"
                return
            if isinstance(item, Exception):
                error = {"message": f"{type(item).__name__}: {item}", "type": "server_error"}
                yield json.dumps({"error": error}) + "\n"
                return
            count += 1
            yield json.dumps(item.to_json(), ensure_ascii=False, default=json_default) + "\n"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
