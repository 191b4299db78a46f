"""A stand-in for an SGLang server's native API (SGLang is GPU-only), backed by any turnrl Engine.

It speaks the request/response format documented in turnrl/engines/sglang.py, strictly: request fields this
fake does not know are refused (400), so a typo in the adapter cannot pass unnoticed. Behaviours copied from
SGLang: `temperature: 0` means greedy; a matched stop token is trimmed from `output_ids` unless `no_stop_trim`
(logprobs keep it); `finish_reason` is a dict; `weight_version` is a string ("default" before any update);
`/abort_request` ends a running request with `finish_reason.type == "abort"`; an over-long prompt is a 400.
`return_sampling_mask` / `return_routed_experts` answer from the engine behind the fake, which must record them
(EmbeddedEngine(record_sampling_mask=..., record_routing=...)): the kept sets' sizes are real, their ids are
placeholders (the engine reports sizes only), and routing covers [0, prompt + output - 1) as SGLang's does.
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict
from safetensors.torch import load_file

from turnrl.types import FinishReason, SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SGLangSamplingParams(_Strict):
    max_new_tokens: int | None = 128
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None


class GenerateReqInput(_Strict):
    input_ids: list[int]
    sampling_params: SGLangSamplingParams = SGLangSamplingParams()
    return_logprob: bool = False
    logprob_start_len: int = -1
    rid: str | None = None
    image_data: list[str] | None = None
    stream: bool = False
    return_sampling_mask: bool | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0


class UpdateWeightFromDiskReqInput(_Strict):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class PauseGenerationReqInput(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class MemoryOccupationReqInput(_Strict):
    tags: list[str] | None = None


class AbortReq(_Strict):
    rid: str = ""
    abort_all: bool = False


class FakeSGLang:
    """`FakeSGLang(engine).app` is the ASGI app; the attributes record what the server was asked."""

    def __init__(self, engine: Any, *, max_context: int = 4096):
        self.engine, self.max_context = engine, max_context
        self.weight_version = "default"
        self.requests: list[dict[str, Any]] = []
        self.memory_calls: list[tuple[str, list[str] | None]] = []
        self.aborted: list[str] = []
        self.calls: list[str] = []  # the pause / update / continue endpoints, in order
        self.paused = False
        self._running: dict[str, asyncio.Task] = {}
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.post("/generate")
        async def generate(req: GenerateReqInput):
            self.requests.append(req.model_dump())
            if req.stream:
                return JSONResponse({"error": {"message": "stream is not faked"}}, status_code=400)
            if len(req.input_ids) >= self.max_context:
                return JSONResponse({"error": {"message": f"The input ({len(req.input_ids)} tokens) is longer than "
                                               f"the model's context length ({self.max_context} tokens)."}},
                                    status_code=400)
            rid = req.rid or f"rid{len(self.requests)}"
            task = asyncio.ensure_future(self.engine.generate(req.input_ids, _params(req.sampling_params),
                                                              request_id=rid))
            self._running[rid] = task
            try:
                out = await task
            except asyncio.CancelledError:
                return self._response(req, rid, [], [], {"type": "abort", "message": "Abort request"}, 0)
            finally:
                self._running.pop(rid, None)
            if out.finish_reason == FinishReason.STOP:
                finish = {"type": "stop", "matched": out.token_ids[-1]}
            elif out.finish_reason == FinishReason.ABORT:  # abort_all_requests at a weight update
                finish = {"type": "abort", "message": "Abort before update weights"}
            else:
                finish = {"type": "length", "length": len(out.token_ids)}
            response = self._response(req, rid, out.token_ids, out.logprobs, finish, out.cached_prompt_tokens)
            response["meta_info"].update(_recorded(req, out))
            return response

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(req: UpdateWeightFromDiskReqInput):
            files = sorted(Path(req.model_path).glob("*.safetensors"))
            if not files:
                return JSONResponse({"success": False, "message": f"no safetensors in {req.model_path}",
                                     "num_paused_requests": 0}, status_code=400)
            tensors = {}
            for f in files:
                tensors.update(load_file(str(f)))
            self.calls.append(f"update_weights_from_disk(abort_all_requests={req.abort_all_requests}, "
                              f"flush_cache={req.flush_cache})")
            if req.flush_cache and self.paused:  # SGLang: a flush needs no request holding KV in place
                return JSONResponse({"success": False, "message": "flush_cache while paused in place",
                                     "num_paused_requests": 0}, status_code=400)
            # the embedded engine's pause modes stand in for SGLang's scheduler: abort_all_requests returns the
            # running requests with their tokens so far; a paused-in-place scheduler keeps them; else they finish
            pause = "abort" if req.abort_all_requests else "keep" if self.paused else "wait"
            await self.engine.update_weights(tensors, pause=pause)
            if req.weight_version is not None:
                self.weight_version = req.weight_version
            return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

        @app.post("/pause_generation")
        async def pause_generation(req: PauseGenerationReqInput):
            self.calls.append(f"pause_generation({req.mode})")
            self.paused = req.mode == "in_place"
            return {}

        @app.post("/continue_generation")
        async def continue_generation():
            self.calls.append("continue_generation")
            self.paused = False
            return {}

        @app.post("/release_memory_occupation")
        async def release(req: MemoryOccupationReqInput):
            self.memory_calls.append(("release", req.tags))
            await self.engine.sleep()

        @app.post("/resume_memory_occupation")
        async def resume(req: MemoryOccupationReqInput):
            self.memory_calls.append(("resume", req.tags))
            await self.engine.wake_up()

        @app.post("/abort_request")
        async def abort(req: AbortReq):
            self.aborted.append(req.rid)
            task = self._running.get(req.rid)
            if task is not None:
                task.cancel()
            return PlainTextResponse("")

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache():
            return PlainTextResponse("Cache flushed.\n")

        @app.get("/health")
        async def health():
            return PlainTextResponse("")

        @app.get("/get_model_info")
        async def model_info():
            return {"model_path": "fake", "is_generation": True, "weight_version": self.weight_version}

        return app

    def _response(self, req: GenerateReqInput, rid: str, ids: list[int], logprobs: list[float],
                  finish: dict[str, Any], cached: int) -> dict[str, Any]:
        output_ids = list(ids)
        if finish["type"] == "stop" and not req.sampling_params.no_stop_trim:
            output_ids = output_ids[:-1]  # SGLang's detokenizer trims the matched stop token
        meta: dict[str, Any] = {
            "id": rid, "finish_reason": finish, "prompt_tokens": len(req.input_ids), "completion_tokens": len(ids),
            "cached_tokens": cached, "weight_version": self.weight_version,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(ids, logprobs, strict=True)]
        return {"text": "", "output_ids": output_ids, "meta_info": meta}


def _recorded(req: GenerateReqInput, out: Any) -> dict[str, Any]:
    """SGLang's sampling-mask and routed-experts fields of meta_info, when asked, from what the engine recorded."""
    meta: dict[str, Any] = {}
    if req.return_sampling_mask and out.kept_counts is not None:
        meta["output_token_sampling_mask"] = [list(range(k)) for k in out.kept_counts]  # sizes real, ids not
        meta["output_token_sampling_logprobs"] = list(out.logprobs)
        meta["output_token_sampling_mask_length"] = len(out.kept_counts)
    if req.return_routed_experts and out.routed_experts is not None:
        assert out.routed_start == req.routed_experts_start_len == 0, "the fake serves whole-stream routing only"
        meta["routed_experts"] = base64.b64encode(out.routed_experts.int().numpy().astype("<i4").tobytes()).decode()
    return meta


def _params(p: SGLangSamplingParams) -> SamplingParams:
    greedy = p.temperature < 1e-6 or p.top_k == 1  # SGLang: temperature 0 becomes top_k = 1
    return SamplingParams(
        temperature=0.0 if greedy else p.temperature, top_p=p.top_p, top_k=-1 if greedy else p.top_k,
        max_new_tokens=p.max_new_tokens or 128, stop_token_ids=tuple(p.stop_token_ids or ()), seed=p.sampling_seed,
    )
