"""`SGLangEngine`: the Engine protocol over a running SGLang server's native HTTP API.

Start the server yourself (GPU), e.g. `python -m sglang.launch_server --model-path Qwen/Qwen3-4B --port 30000
--enable-memory-saver`, then `SGLangEngine("http://localhost:30000", weights_dir="/shared/turnrl-weights")`.
`scripts/check_sglang.py URL` runs this adapter's checks against a real server.

What is used, as documented by SGLang (docs.sglang.io: basic_usage/native_api and sampling_params; source:
python/sglang/srt/entrypoints/http_server.py, managers/io_struct.py, sampling/sampling_params.py,
managers/tokenizer_manager.py, managers/detokenizer_manager.py, managers/schedule_batch.py):

- `POST /generate` with a `GenerateReqInput`:
  `{"input_ids": [...], "sampling_params": {...}, "return_logprob": true, "logprob_start_len": -1,
  "rid": "...", "image_data": [...]?}`. `sampling_params` fields used: `temperature` (0 = greedy; SGLang turns
  it into top_k=1), `top_p`, `top_k` (-1 = whole vocabulary), `max_new_tokens`, `stop_token_ids`,
  `sampling_seed` (honoured only under `--enable-deterministic-inference`), `skip_special_tokens: false`, and
  `no_stop_trim: true`: without it the detokenizer trims a matched stop token from `output_ids`
  (`trim_matched_stop`), while turnrl's contract keeps the stop token in the output.
  The response is `{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "cached_tokens", "weight_version", "output_token_logprobs"}}`, where
  `output_token_logprobs` is a list of `[logprob, token_id, text_or_null]`, one per generated token, and
  `finish_reason` is `{"type": "stop", "matched": id_or_str}`, `{"type": "length", "length": n}` or
  `{"type": "abort", "message": ...}`. Token ids and logprobs are both read from `output_token_logprobs`
  (every sampled token, never trimmed); `output_ids`, when present, must agree with them (or lack only a
  trailing stop token, as a server that ignores `no_stop_trim` returns it).
- `POST /update_weights_from_disk` `{"model_path", "weight_version"}` -> `{"success", "message",
  "num_paused_requests"}`: `update_weights` writes the tensors as `model.safetensors` in `weights_dir`, a
  folder that the SGLang server must see at the same path (same machine or a shared filesystem), and asks
  the server to load it; SGLang flushes its radix cache after loading. Without `weights_dir`,
  `update_weights` raises: in-memory transfers (`/update_weights_from_tensor`, `/update_weights_from_distributed`)
  need a process on the GPU node and are not wired here.
- `POST /release_memory_occupation` / `POST /resume_memory_occupation` `{"tags": [...] | null}` for
  `sleep` / `wake_up` (the server needs `--enable-memory-saver`). Releasing the `weights` tag discards them:
  call `update_weights` after `wake_up`, as colocated trainers do.
- `POST /abort_request` `{"rid"}` when a generate call is cancelled; `POST /flush_cache`; `GET /health`.

`rid`: SGLang refuses two live requests with one rid, and its radix cache reuses a conversation's KV by prefix,
not by id, so each call gets `"<request_id>#<n>"` (the trajectory id stays readable in SGLang's logs).
`release` is a no-op for the same reason.

Logprobs: SGLang reports `log_softmax(logits / temperature)` *before* top-k/top-p filtering (unless the server
sets `SGLANG_RETURN_ORIGINAL_LOGPROB`, which gives the raw distribution: leave it unset). With top_k/top_p off,
as turnrl's trainer assumes, that is exactly the sampling distribution; a request with top_k or top_p set logs
a warning once. Greedy requests return the unscaled logprob, as the Engine contract says.

Kept sets and routing (`record`, docs/off-policy.md; SGLang 0.5.23, managers/io_struct.py, tokenizer_manager.py,
state_capturer/routed_experts.py): with `record.sampling_mask` each request sends `return_sampling_mask: true`, and
`meta_info.output_token_sampling_mask` (each token's kept ids; turnrl keeps their count) and
`output_token_sampling_logprobs` (the logprob of each token under the distribution it was drawn from, after
top-k/top-p: these replace the pre-filter logprobs above, so the warning does not apply) come back. With
`record.routing` (server started with `--enable-return-routed-experts`) it sends `return_routed_experts: true` and
reads `meta_info.routed_experts`, base64 of int32 expert ids for stream positions [0, prompt + output - 1),
reshaped with `routing_shape` (MoE layers, top_k), which SGLang does not send.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from pathlib import Path
from typing import Any

from turnrl.engines.base import EngineError, KVStats, NamedTensors, Recording
from turnrl.engines.http import JsonHttp, WeightsFolder, _excerpt, encode_image
from turnrl.engines.metrics import SGLANG, KVMetrics
from turnrl.types import FinishReason, GenerateOutput, SamplingParams

log = logging.getLogger(__name__)

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


class SGLangEngine:
    """An Engine backed by an SGLang server (API and its sources in the module docstring).

    Args:
        base_url: the server root, e.g. `http://localhost:30000`.
        api_key: sent as `Authorization: Bearer` (SGLang's `--api-key`).
        weights_dir: a folder both this process and the server can read at this path; `update_weights`
            writes `model.safetensors` there (a file per bucket when streamed, see `WeightsFolder`). None:
            `update_weights` raises.
        sleep_tags: memory regions released by `sleep` ("weights", "kv_cache"); None releases all.
        timeout_s / connect_timeout_s: per request / to open a connection.
        control_timeout_s: limit of abort and health requests (a working server answers them at once).
        probe_after_s / probe_timeout_s: a call without an answer this long asks GET /get_model_info (answered by
            the HTTP server at once; SGLang's /health may generate a token, up to 20 s) and fails naming the
            server when that gets no answer in time (JsonHttp); None: never probe.
        kv_metrics: `kv_stats()` reads the server's Prometheus /metrics (`sglang:token_usage`, retractions;
            turnrl.engines.metrics; the server needs --enable-metrics) for rollout.concurrency auto.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, weights_dir: str | os.PathLike | None = None,
                 sleep_tags: list[str] | None = None, timeout_s: float | None = 600.0, connect_timeout_s: float = 10.0,
                 control_timeout_s: float = 10.0, record: Recording = Recording(),
                 routing_shape: tuple[int, int] | None = None, probe_after_s: float | None = 20.0,
                 probe_timeout_s: float = 10.0, kv_metrics: bool = False):
        if record.routing and routing_shape is None:
            raise ValueError("SGLangEngine(record=Recording(routing=True)) needs routing_shape=(MoE layers, top_k): "
                             "SGLang returns the expert ids as a flat array")
        self.record, self.routing_shape = record, routing_shape
        self.http = JsonHttp(base_url, owner="SGLangEngine", token=api_key, timeout_s=timeout_s,
                             connect_timeout_s=connect_timeout_s, probe_path="/get_model_info",
                             probe_after_s=probe_after_s, probe_timeout_s=probe_timeout_s)
        self.base_url, self.api_key = self.http.base_url, api_key
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self._weights = WeightsFolder(self.weights_dir) if self.weights_dir is not None else None
        self.sleep_tags = sleep_tags
        self.policy_version = 0
        self._rid_counter = itertools.count()
        self._warned_filters = False
        self._updates = 0  # weight updates finished, and of them with pause=abort: to tell what a call went through
        self._aborting_updates = 0
        self.control_timeout_s = control_timeout_s
        self._aborts: set[asyncio.Task] = set()
        self._kv = KVMetrics(self.http, SGLANG) if kv_metrics else None

    def kv_stats(self) -> KVStats | None:
        """The KV token pool's usage and retractions so far, from the server's /metrics (`kv_metrics`), else None."""
        return self._kv.stats() if self._kv is not None else None

    # ---- Engine protocol -------------------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str, images: list[Any] | None = None
    ) -> GenerateOutput:
        if not prompt_ids:
            raise EngineError(f"request {request_id!r}: empty prompt")
        rid = f"{request_id}#{next(self._rid_counter)}"
        body: dict[str, Any] = {
            "input_ids": list(prompt_ids), "sampling_params": self._sampling_params(params),
            "return_logprob": True, "logprob_start_len": -1, "rid": rid,
        }
        if self.record.sampling_mask and not params.greedy:
            body["return_sampling_mask"] = True
        if self.record.routing:
            body["return_routed_experts"] = True
        if images:
            body["image_data"] = [encode_image(im) for im in images]
        start_version, updates, aborting = self.policy_version, self._updates, self._aborting_updates
        try:
            data = await self._request("POST", "/generate", json=body)
        except asyncio.CancelledError:
            self._abort(rid)
            raise
        out = self._parse_output(data, rid)
        if self._updates != updates:  # an update landed meanwhile: its tokens span versions; the oldest anchors
            out.policy_version = start_version
        out.preempted = out.finish_reason == FinishReason.ABORT and self._aborting_updates != aborting
        return out

    async def update_weights(self, named_tensors: NamedTensors, version: int | None = None, *,
                             final: bool = True, pause: str | None = None) -> int:
        """Stage the weights in `weights_dir`, and at the final bucket reload them, with the pause mode of the first
        bucket mapped onto SGLang's: keep → `/pause_generation {mode: in_place}`, reload without flushing the KV
        cache, `/continue_generation`; wait → a plain reload (the server holds it until the running requests are
        done); abort → `abort_all_requests` (they return their tokens so far, which this client marks
        preempted)."""
        if self._weights is None:
            raise EngineError(
                "SGLangEngine.update_weights needs weights_dir: a folder the SGLang server can read at the same "
                "path (its /update_weights_from_disk loads safetensors from there)"
            )
        new_version = self.policy_version + 1 if version is None else int(version)
        mode = await self._weights.stage(named_tensors, final, pause)
        if mode is None:  # one bucket of several: the server reloads the folder after the last
            return self.policy_version
        body: dict[str, Any] = {"model_path": str(self.weights_dir), "weight_version": str(new_version)}
        if mode == "keep":
            await self._request("POST", "/pause_generation", json={"mode": "in_place"})
            body["flush_cache"] = False  # in place: the running requests keep their KV
        elif mode == "abort":
            self._aborting_updates += 1
            body["abort_all_requests"] = True
        try:
            data = await self._request("POST", "/update_weights_from_disk", json=body)
        finally:
            if mode == "keep":
                await self._request("POST", "/continue_generation", json={})
        if not (isinstance(data, dict) and data.get("success")):
            raise EngineError(f"POST {self.base_url}/update_weights_from_disk did not succeed: {_excerpt(data)}")
        self.policy_version, self._updates = new_version, self._updates + 1
        return new_version

    async def sleep(self) -> None:
        await self._request("POST", "/release_memory_occupation", json={"tags": self.sleep_tags})

    async def wake_up(self) -> None:
        await self._request("POST", "/resume_memory_occupation", json={"tags": self.sleep_tags})

    async def release(self, request_id: str) -> None:
        return None  # the radix cache is shared by prefix and evicted by SGLang itself

    # ---- extras ----------------------------------------------------------------------------------
    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache", expect_json=False)

    async def health(self) -> bool:
        try:
            await self._request("GET", "/health", expect_json=False, timeout_s=self.control_timeout_s)
        except EngineError:
            return False
        return True

    async def aclose(self) -> None:
        await self.http.aclose()

    def close(self) -> None:
        self.http.close()

    # ---- request and response --------------------------------------------------------------------
    def _sampling_params(self, params: SamplingParams) -> dict[str, Any]:
        if (not params.greedy and (params.top_k > 0 or params.top_p < 1.0) and not self._warned_filters
                and not self.record.sampling_mask):
            self._warned_filters = True
            log.warning("SGLang reports logprobs before top-k/top-p filtering; with top_k=%s top_p=%s they are not "
                        "the logprobs of the distribution sampled from", params.top_k, params.top_p)
        sampling: dict[str, Any] = {
            "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "max_new_tokens": params.max_new_tokens, "skip_special_tokens": False, "no_stop_trim": True,
        }
        if params.stop_token_ids:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        return sampling

    def _parse_output(self, data: Any, rid: str) -> GenerateOutput:
        where = f"POST {self.base_url}/generate (rid {rid!r})"
        meta = data.get("meta_info") if isinstance(data, dict) else None
        if not isinstance(meta, dict):
            raise EngineError(f"{where}: response has no meta_info: {_excerpt(data)}")
        try:
            pairs = [(float(entry[0]), int(entry[1])) for entry in meta["output_token_logprobs"]]
        except (KeyError, TypeError, ValueError, IndexError):
            raise EngineError(f"{where}: meta_info.output_token_logprobs missing or malformed "
                              f"(is return_logprob supported?): {_excerpt(meta)}") from None
        token_ids = [t for _, t in pairs]
        output_ids = data.get("output_ids")
        trimmed_stop = output_ids is not None and list(output_ids) == token_ids[:-1]  # a server ignoring no_stop_trim
        if output_ids is not None and list(output_ids) != token_ids and not trimmed_stop:
            raise EngineError(f"{where}: output_ids {_excerpt(output_ids, 120)} disagree with the token ids of "
                              f"output_token_logprobs {_excerpt(token_ids, 120)}")
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind not in _FINISH:
            raise EngineError(f"{where}: unknown finish_reason {finish!r}")
        logprobs, kept = self._sampling_mask(meta, [lp for lp, _ in pairs], where)
        return GenerateOutput(
            token_ids=token_ids, logprobs=logprobs, finish_reason=_FINISH[kind],
            policy_version=self._weight_version(meta), cached_prompt_tokens=int(meta.get("cached_tokens") or 0),
            kept_counts=kept, routed_experts=self._routing(meta, where),
        )

    def _sampling_mask(self, meta: dict[str, Any], logprobs: list[float], where: str
                       ) -> tuple[list[float], list[int] | None]:
        """(logprobs, kept counts): with `return_sampling_mask`, the post-filter logprobs and each kept set's size."""
        masks = meta.get("output_token_sampling_mask")
        if masks is None:
            return logprobs, None
        behaviour = meta.get("output_token_sampling_logprobs")
        if not isinstance(behaviour, list) or len(masks) != len(logprobs) or len(behaviour) != len(logprobs):
            raise EngineError(f"{where}: {len(logprobs)} tokens but output_token_sampling_mask / _logprobs of "
                              f"{_excerpt(masks, 80)} / {_excerpt(behaviour, 80)}")
        return [float(lp) for lp in behaviour], [len(ids) for ids in masks]

    def _routing(self, meta: dict[str, Any], where: str) -> Any:
        """meta_info.routed_experts (base64 int32, flat) as an int16 tensor [tokens, layers, top_k]."""
        encoded = meta.get("routed_experts")
        if encoded is None or not self.record.routing:
            return None
        import base64

        import numpy as np
        import torch

        assert self.routing_shape is not None  # checked in __init__
        flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
        layers, top_k = self.routing_shape
        if flat.size % (layers * top_k):
            raise EngineError(f"{where}: routed_experts holds {flat.size} ids, not a multiple of {layers} layers x "
                              f"{top_k} experts (routing_shape)")
        return torch.from_numpy(flat.astype(np.int16)).reshape(-1, layers, top_k)

    def _weight_version(self, meta: dict[str, Any]) -> int:
        try:
            return int(meta["weight_version"])
        except (KeyError, TypeError, ValueError):  # "default" before any update, or an older server
            return self.policy_version

    # ---- HTTP ------------------------------------------------------------------------------------
    async def _request(self, method: str, path: str, *, expect_json: bool = True, **kwargs: Any) -> Any:
        return await self.http.request(method, path, expect_json=expect_json, **kwargs)

    def _abort(self, rid: str) -> None:
        """Ask the server to stop generating `rid`, in the background: the caller is being cancelled, maybe
        because this very server hung, so its cancellation must not wait on it (the abort gets a short limit)."""
        task = asyncio.get_running_loop().create_task(self._send_abort(rid))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _send_abort(self, rid: str) -> None:
        try:
            await self._request("POST", "/abort_request", json={"rid": rid}, expect_json=False,
                                timeout_s=self.control_timeout_s)
        except (EngineError, asyncio.CancelledError) as e:
            log.warning("SGLang abort of %s failed: %r", rid, e)
