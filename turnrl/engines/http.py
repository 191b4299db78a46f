"""`HttpEngine`: the Engine protocol over HTTP, against turnrl's own token-level server (`turnrl serve`).

A trainer on one machine can sample from an engine on another: `turnrl serve --host 0.0.0.0 --token T` there,
`HttpEngine("http://host:8000", token="T")` here. Tokens travel as ids, never as text, so nothing is
re-tokenized on the way.

The wire format (JSON unless said otherwise; `turnrl/serve/engine_routes.py` is the other side):

    POST /generate      {"prompt_ids": [int], "sampling": {SamplingParams fields}, "request_id": str,
                         "images": [str]?}
                        -> {"token_ids": [int], "logprobs": [float], "finish_reason": "stop"|"length"|"abort",
                            "policy_version": int, "cached_prompt_tokens": int}
    POST /update_weights  body: a safetensors file (application/octet-stream), query `?version=N` (optional)
                        and `&final=false` (one bucket of a streamed update: the version is taken at the final),
                        or JSON {"path": "<file.safetensors or a folder of them, on the server>", "version": N?}
                        -> {"policy_version": int}
    POST /sleep, POST /wake_up                  -> {"ok": true}
    POST /release       {"request_id": str}     -> {"ok": true}
    GET  /health                                -> {"status": "ok", "model": str, "policy_version": int, ...}

Images are sent as strings: paths and URLs as they are, PIL images as PNG data URIs.
Every request carries `Authorization: Bearer <token>` when a token is set (argument, else the
`TURNRL_SERVE_TOKEN` environment variable, the same one `turnrl serve` reads).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import math
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import EllipsisType
from typing import Any

import httpx
import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes

from turnrl.engines.base import EngineError, InvalidRequest, NamedTensors, check_pause
from turnrl.moe import decode_routing, encode_routing
from turnrl.observe.watchdog import abandon_after
from turnrl.types import (
    JSON_SAMPLING_RULES,
    FinishReason,
    GenerateOutput,
    SamplingParams,
    broken_sampling_field,
)

TOKEN_ENV = "TURNRL_SERVE_TOKEN"


# ---------------------------------------------------------------------------------------------------
# Wire format (shared with turnrl/serve/engine_routes.py)
# ---------------------------------------------------------------------------------------------------
def sampling_to_json(params: SamplingParams) -> dict[str, Any]:
    body = dataclasses.asdict(params)
    body["stop_token_ids"] = list(params.stop_token_ids)
    return body


def sampling_from_json(body: Any, where: str = "sampling") -> SamplingParams:
    """SamplingParams from JSON, every field's type checked: raises InvalidRequest (a ValueError) naming the
    field (`sampling.top_k`) and what was expected."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"{where} must be a JSON object of SamplingParams fields, got {_json_type(body)}", where)
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(body) - known
    if unknown:
        raise InvalidRequest(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}",
                             f"{where}.{sorted(unknown)[0]}")
    broken = broken_sampling_field(body, JSON_SAMPLING_RULES)
    if broken is not None:
        name, expected = broken
        raise InvalidRequest(f"{where}.{name} must be {expected}, got {_json_type(body[name])} {body[name]!r}"[:300],
                             f"{where}.{name}")
    fields = dict(body)
    if "stop_token_ids" in fields:
        fields["stop_token_ids"] = tuple(fields["stop_token_ids"] or ())
    return SamplingParams(**fields)


def _json_type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def output_to_json(out: GenerateOutput) -> dict[str, Any]:
    body = {
        "token_ids": list(out.token_ids), "logprobs": list(out.logprobs), "finish_reason": str(out.finish_reason),
        "policy_version": out.policy_version, "cached_prompt_tokens": out.cached_prompt_tokens,
    }
    if out.token_versions is not None:  # a call that went on across a weight update (pause=keep)
        body["token_versions"] = list(out.token_versions)
    if out.preempted:  # stopped by a weight update (pause=abort): the caller resubmits
        body["preempted"] = True
    if out.kept_counts is not None:  # recorded kept sets (docs/off-policy.md)
        body["kept_counts"] = list(out.kept_counts)
    if out.routed_experts is not None:  # recorded MoE routing, in the trajectory format's encoding
        body["routed_experts"], body["routed_start"] = encode_routing(out.routed_experts), out.routed_start
    return body


def output_from_json(body: Any, where: str) -> GenerateOutput:
    try:
        return GenerateOutput(
            token_ids=[int(t) for t in body["token_ids"]],
            logprobs=[float(lp) for lp in body["logprobs"]],
            finish_reason=FinishReason(body["finish_reason"]),
            policy_version=int(body.get("policy_version", 0)),
            cached_prompt_tokens=int(body.get("cached_prompt_tokens", 0)),
            token_versions=None if body.get("token_versions") is None else [int(v) for v in body["token_versions"]],
            preempted=bool(body.get("preempted", False)),
            kept_counts=None if body.get("kept_counts") is None else [int(k) for k in body["kept_counts"]],
            routed_experts=None if body.get("routed_experts") is None else decode_routing(body["routed_experts"]),
            routed_start=int(body.get("routed_start", 0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise EngineError(f"{where}: malformed generate response ({type(e).__name__}: {e}): {_excerpt(body)}") from None


def encode_image(image: Any) -> str:
    """A path, URL or data URI stays as it is; a PIL image becomes a PNG data URI."""
    if isinstance(image, str):
        return image
    if hasattr(image, "save"):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    raise EngineError(f"cannot send an image of type {type(image).__name__}: pass a path, URL, data URI or PIL image")


def safetensors_bytes(named_tensors: NamedTensors) -> bytes:
    """Serialise name -> tensor as a safetensors file. Tensors that share storage (tied embeddings) are
    copied, since the format refuses shared storage."""
    items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in items:
        t = tensor.detach().to("cpu").contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        out[name] = t
    return save_safetensors_bytes(out)


class WeightsFolder:
    """Weight pushes through a folder that a server reloads from (SGLang, vLLM server). A one-shot update is
    `model.safetensors`; a streamed one (buckets with final=False, then the final one) writes a file per
    bucket, and the server is asked to reload once, after the final. A file appears under its real name only
    when complete (tmp + rename); the previous update's files go when a new one starts."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.parts = 0  # buckets written of the update in progress
        self.pause = "keep"  # of the update in progress (given with its first bucket)

    async def stage(self, named_tensors: NamedTensors, final: bool, pause: str | None) -> str | None:
        """Write one bucket of an update; `pause` comes with the first bucket. At the final bucket, return the
        update's pause mode (the server reloads the folder now, pausing its requests that way); else None."""
        if pause is not None:
            self.pause = check_pause(pause)
        await self.write(named_tensors, final)
        if not final:
            return None
        mode, self.pause = self.pause, "keep"
        return mode

    async def write(self, named_tensors: NamedTensors, final: bool) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.parts == 0:
            for old in self.folder.glob("model*.safetensors"):
                old.unlink()
        name = "model.safetensors" if final and self.parts == 0 else f"model-{self.parts + 1:05d}.safetensors"
        payload = await asyncio.to_thread(safetensors_bytes, named_tensors)
        tmp = self.folder / f"{name}.tmp"
        await asyncio.to_thread(tmp.write_bytes, payload)
        os.replace(tmp, self.folder / name)  # never a half-written file under the real name
        self.parts = 0 if final else self.parts + 1


def tensors_from_safetensors_bytes(payload: bytes) -> dict[str, torch.Tensor]:
    return load_safetensors_bytes(payload)


def _excerpt(body: Any, limit: int = 300) -> str:
    text = body if isinstance(body, str) else repr(body)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


# ---------------------------------------------------------------------------------------------------
# HTTP plumbing shared by every server client (HttpEngine, SGLangEngine, VLLMServerEngine)
# ---------------------------------------------------------------------------------------------------
class JsonHttp:
    """JSON requests to one server whose failures are EngineErrors naming the URL, the status and the body.

    An httpx client belongs to the event loop that opened its connections, and a trainer may run several
    loops one after another (asyncio.run per phase), so there is one client per loop.

    `timeout_s` bounds a whole request (httpx's own timeouts are per read, so a server trickling bytes would
    hold a request forever); a request past it is abandoned, never waited for.

    A slow server and a dead one look the same until asked: a request that has had no answer for
    `probe_after_s` asks the server's `probe_path` (a cheap endpoint the server answers at once, on a connection
    of its own) and goes on waiting when the server answers it, with any HTTP status; when it gets no answer
    within `probe_timeout_s` the request fails at once, naming the server. Concurrent requests share one probe,
    and after a failed probe the next requests probe at once. Requests given a short `timeout_s` (control calls)
    are not probed.
    """

    def __init__(self, base_url: str, *, owner: str, token: str | None = None, timeout_s: float | None = 600.0,
                 connect_timeout_s: float = 10.0, hint: Callable[[int, str], str] | None = None,
                 probe_path: str = "/health", probe_after_s: float | None = 20.0, probe_timeout_s: float = 10.0):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"{owner}.base_url must start with http:// or https://, got {base_url!r}")
        if probe_after_s is not None and probe_after_s <= 0 or probe_timeout_s <= 0:
            raise ValueError(f"{owner}: probe_after_s must be > 0 or None (got {probe_after_s}) and probe_timeout_s "
                             f"> 0 (got {probe_timeout_s})")
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.hint = hint  # (status, path) -> extra text for an error message
        self.probe_path, self.probe_after_s, self.probe_timeout_s = probe_path, probe_after_s, probe_timeout_s
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._probe: asyncio.Task | None = None  # the probe in flight, shared by the requests waiting on it
        self._answered_at = self._failed_at = -math.inf  # when the server last answered / last failed a probe

    def client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
            self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=self.timeout)
            self._client_loop = loop
        return self._client

    async def request(self, method: str, path: str, *, expect_json: bool = True,
                      timeout_s: float | None | EllipsisType = ..., **kwargs: Any) -> Any:
        """The decoded JSON body (None for an empty one, or when `expect_json` is false). `timeout_s` replaces the
        client's limit for this request (short ones for control calls such as release and health)."""
        where = f"{method} {self.base_url}{path}"
        limit = self.timeout_s if isinstance(timeout_s, EllipsisType) else timeout_s
        call = self.client().request(method, path, timeout=httpx.Timeout(limit, connect=self.connect_timeout_s),
                                     **kwargs)
        probed = self.probe_after_s is not None and (limit is None or limit > self.probe_after_s)
        try:
            response = await abandon_after(self._probed(call, where) if probed else call, limit, where)
        except TimeoutError as e:
            raise EngineError(f"{e}: the server accepted the connection but did not answer") from None
        except httpx.HTTPError as e:
            raise EngineError(f"{where} failed: {type(e).__name__}: {e or 'no details'}") from e
        if response.status_code >= 400:
            hint = self.hint(response.status_code, path) if self.hint else ""
            message = f"{where} returned HTTP {response.status_code}{hint}: {_excerpt(response.text)}"
            if response.status_code == 422:  # the request is invalid: no replica could serve it (Router: no retry)
                raise InvalidRequest(message, _error_param(response))
            raise EngineError(message)
        if not expect_json or not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise EngineError(f"{where} returned a body that is not JSON: {_excerpt(response.text)}") from None

    async def _probed(self, call: Awaitable[httpx.Response], where: str) -> httpx.Response:
        """`call`'s response; while it has none, the server's health every `probe_after_s` (class docstring)."""
        task = asyncio.ensure_future(call)
        loop, t0 = asyncio.get_running_loop(), asyncio.get_running_loop().time()
        recently_failed = t0 - self._failed_at < (self.probe_after_s or 0)
        quiet = 0.0 if recently_failed else self.probe_after_s
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=quiet)
                if done:
                    return task.result()
                problem = await asyncio.shield(self._probe_once())
                if problem is not None and not task.done():
                    raise EngineError(f"{where}: no answer after {loop.time() - t0:.0f} s, and {problem}: the server "
                                      "accepts connections but does not respond (a slow server still answers it)")
                quiet = self.probe_after_s
        finally:
            if not task.done():
                task.cancel()
                task.add_done_callback(_consume)

    def _probe_once(self) -> asyncio.Task:
        """The shared probe: the one in flight, or a new one unless the server answered one a moment ago."""
        loop = asyncio.get_running_loop()
        if self._probe is None or self._probe.done() or self._probe.get_loop() is not loop:
            self._probe = asyncio.ensure_future(self._check())
        return self._probe

    async def _check(self) -> str | None:
        """None when the server answers `probe_path` (any status) within `probe_timeout_s`, else what happened."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._answered_at < (self.probe_after_s or 0) / 2:
            return None  # another request's probe just heard from it
        what = f"GET {self.base_url}{self.probe_path}"
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        try:  # a client of its own: the requests in flight may hold every connection of the shared one
            async with httpx.AsyncClient(timeout=httpx.Timeout(self.probe_timeout_s), headers=headers) as client:
                await abandon_after(client.get(f"{self.base_url}{self.probe_path}"), self.probe_timeout_s, what)
        except (TimeoutError, httpx.HTTPError) as e:
            self._failed_at = loop.time()
            if isinstance(e, TimeoutError | httpx.TimeoutException):
                return f"{what} gave no answer within probe_timeout_s={self.probe_timeout_s:g} s"
            return f"{what} failed ({type(e).__name__}: {e or 'no details'})"
        self._answered_at = loop.time()
        return None

    async def aclose(self) -> None:
        if self._client is not None and self._client_loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = self._client_loop = None

    def close(self) -> None:
        """Forget the client. Its event loop has usually finished by now (asyncio.run closes it), so its
        connections cannot be closed politely; they go with the loop."""
        self._client = self._client_loop = None


def _consume(task: asyncio.Future) -> None:
    """Retrieve an abandoned call's outcome, so asyncio never logs it as unretrieved."""
    if not task.cancelled():
        task.exception()


def _error_param(response: httpx.Response) -> str | None:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("param") if isinstance(error, dict) else None


def _token_hint(status: int, path: str) -> str:
    return " (set the server's token: HttpEngine(token=...) or TURNRL_SERVE_TOKEN)" if status == 401 else ""


# ---------------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------------
class HttpEngine:
    """The Engine protocol against a `turnrl serve` server (wire format in the module docstring).

    Args:
        base_url: e.g. `http://10.0.0.5:8000` (the server root, not a session URL).
        token: bearer token; defaults to the `TURNRL_SERVE_TOKEN` environment variable.
        timeout_s: limit of one request (a long generation included); None waits forever.
        connect_timeout_s: limit of opening the connection, so a dead host fails fast.
        control_timeout_s: limit of release and health, which answer at once from a working server: a finished
            trajectory never waits long on a server that hung.
        probe_after_s / probe_timeout_s: a call without an answer this long asks GET /health, and fails naming
            the server when that gets no answer in time (JsonHttp); None: never probe.
    """

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float | None = 600.0,
                 connect_timeout_s: float = 10.0, control_timeout_s: float = 10.0,
                 probe_after_s: float | None = 20.0, probe_timeout_s: float = 10.0):
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.http = JsonHttp(base_url, owner="HttpEngine", token=self.token, timeout_s=timeout_s,
                             connect_timeout_s=connect_timeout_s, hint=_token_hint, probe_after_s=probe_after_s,
                             probe_timeout_s=probe_timeout_s)
        self.base_url = self.http.base_url
        self.control_timeout_s = control_timeout_s

    # ---- Engine protocol -------------------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str, images: list[Any] | None = None
    ) -> GenerateOutput:
        body: dict[str, Any] = {"prompt_ids": list(prompt_ids), "sampling": sampling_to_json(params),
                                "request_id": request_id}
        if images:
            body["images"] = [encode_image(im) for im in images]
        data = await self._request("POST", "/generate", json=body)
        return output_from_json(data, f"POST {self.base_url}/generate")

    async def update_weights(self, named_tensors: NamedTensors, version: int | None = None, *,
                             final: bool = True, pause: str = "keep") -> int:
        payload = safetensors_bytes(named_tensors)
        params = {k: v for k, v in (("version", version), ("final", None if final else "false"),
                                    ("pause", None if pause == "keep" else pause)) if v is not None}
        data = await self._request("POST", "/update_weights", content=payload,
                                   headers={"content-type": "application/octet-stream"}, params=params or None)
        return self._version(data)

    async def update_weights_from_path(self, path: str, version: int | None = None) -> int:
        """Load weights from a safetensors file (or a folder of them) on the *server's* filesystem."""
        data = await self._request("POST", "/update_weights", json={"path": path, "version": version})
        return self._version(data)

    async def sleep(self) -> None:
        await self._request("POST", "/sleep")

    async def wake_up(self) -> None:
        await self._request("POST", "/wake_up")

    async def release(self, request_id: str) -> None:
        await self._request("POST", "/release", json={"request_id": request_id}, timeout_s=self.control_timeout_s)

    # ---- extras ----------------------------------------------------------------------------------
    async def health(self) -> dict[str, Any]:
        return await self._request("GET", "/health", timeout_s=self.control_timeout_s)

    async def aclose(self) -> None:
        await self.http.aclose()

    def close(self) -> None:
        self.http.close()

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        return await self.http.request(method, path, **kwargs)

    def _version(self, data: Any) -> int:
        try:
            return int(data["policy_version"])
        except (KeyError, TypeError, ValueError):
            raise EngineError(f"POST {self.base_url}/update_weights: no policy_version in {_excerpt(data)}") from None
