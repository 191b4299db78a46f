"""What the routes and the API modules share: JSON bodies, the request fields every API has, the status of an
exception, model objects, ids."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from turnrl.engines.base import EngineError, InvalidRequest
from turnrl.serve.sessions import ChatRequestError, SessionNotFound
from turnrl.types import CHAT_SAMPLING_RULES

TOKEN_PATHS = {"/generate", "/update_weights", "/release", "/sleep", "/wake_up"}
"""turnrl's own token-level routes (turnrl/serve/engine_routes.py): a bad field there is a 422."""


def classify(exc: BaseException, path: str) -> tuple[int, str, str, str | None, Any]:
    """(status, type, message, param, code) of an exception raised while serving `path`."""
    if isinstance(exc, ChatRequestError):
        return exc.status, "invalid_request_error", str(exc), exc.param, exc.code
    if isinstance(exc, InvalidRequest):  # turnrl's own token-level routes: 422; the OpenAI/Anthropic APIs: 400
        if path in TOKEN_PATHS:
            return 422, "invalid_request_error", str(exc), exc.param, None
        param = "messages" if exc.param == "prompt_ids" else exc.param  # the chat client sent messages, not ids
        return 400, "invalid_request_error", str(exc), param, "context_length_exceeded" if param == "messages" else None
    if isinstance(exc, SessionNotFound):
        return 404, "not_found_error", f"no session {exc.args[0]!r} (GET /sessions lists them)", None, None
    if isinstance(exc, EngineError):
        return 502, "engine_error", f"engine error: {exc}", None, None
    if isinstance(exc, ValueError):
        return 400, "invalid_request_error", str(exc), getattr(exc, "param", None), None
    return 500, "server_error", f"{type(exc).__name__}: {exc}", None, None


_BIG_BODY = 1 << 20


async def json_body(request: Any) -> dict[str, Any]:
    raw = await request.body()
    try:  # a large body is parsed off the event loop, which goes on serving /health and the other sessions
        body = await asyncio.to_thread(json.loads, raw) if len(raw) > _BIG_BODY else json.loads(raw)
    except ValueError:
        raise ValueError("the request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def stream_flag(body: dict[str, Any]) -> bool:
    """The body's `stream` (false when absent); ChatRequestError for anything but a boolean."""
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise ChatRequestError(f"stream must be a boolean, got {body['stream']!r}", param="stream")
    return bool(body.get("stream"))


# ---- request fields every API has -------------------------------------------------------------------
def sampling_fields(body: dict[str, Any], names: dict[str, str], stop_field: str) -> dict[str, Any]:
    """The sampling fields of a request body, each checked by its rule in `CHAT_SAMPLING_RULES`: `names` maps the
    body's field names to SamplingParams' (temperature, top_p, top_k, seed, max_new_tokens); `stop_field` holds a
    string or a list of strings. A field sent as null is absent."""
    out: dict[str, Any] = {}
    for name, ours in names.items():
        value = body.get(name)
        if value is None:
            continue
        rule = CHAT_SAMPLING_RULES[ours]
        if not rule.check(value):
            raise ChatRequestError(f"{name} must be {rule.expected}, got {value!r}"[:300], param=name)
        out[ours] = value
    stop = body.get(stop_field)
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ChatRequestError(f"{stop_field} must be a string or a list of non-empty strings, got {stop!r}"[:300],
                                   param=stop_field)
        out["stop"] = stops
    return out


def metadata_reward(body: dict[str, Any]) -> Any:
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ChatRequestError(f"metadata must be an object, got {metadata!r}"[:200], param="metadata")
    return (metadata or {}).get("reward")


def parts_text(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """Text of a string or a list of text parts of the given types (the Responses and Anthropic APIs'); any other
    part (an image) is refused."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ChatRequestError(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds:
            raise ChatRequestError(f"{where}[{j}]: a {kind!r} part; this server runs a text model and takes only "
                                   f"{', '.join(kinds)} parts", param=f"{where}[{j}]")
        texts.append(part.get("text") or "")
    return "".join(texts)


# ---- answers -----------------------------------------------------------------------------------------
def model_object(name: str) -> dict[str, Any]:
    """A model object in OpenAI's shape and Anthropic's (both SDKs' `models.retrieve` read the same URL)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "turnrl",
            "type": "model", "display_name": name, "created_at": "1970-01-01T00:00:00Z"}


def models_list(model_name: str, max_model_len: Any = None) -> dict[str, Any]:
    """The model list; with the engine's context length as vLLM's `max_model_len` (clients such as `renderers`
    refuse an over-long prompt before sending it)."""
    card = model_object(model_name)
    if isinstance(max_model_len, int) and max_model_len > 0:
        card["max_model_len"] = max_model_len
    return {"object": "list", "data": [card], "has_more": False, "first_id": model_name, "last_id": model_name}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"
