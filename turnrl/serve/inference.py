"""vLLM's token-in, token-out route, `POST /inference/v1/generate`, recorded per session like every chat call.

What a verifiers v1 env server's train client (the `renderers` package's `generate`) and prime-rl's orchestrator
call: the client renders the conversation with its own chat template and sends token ids; the answer is the
sampled token ids with their logprobs. turnrl serves it at the root and per session
(`/sessions/<id>/inference/v1/generate`, what a client whose base_url is `.../sessions/<id>/v1` calls) and records
each call in its session exactly as given and sampled (`ChatProxy.complete_tokens`), so `GET
/sessions/<id>/trajectories` returns the episode token-exactly, as for the chat APIs. A root call names its
session by X-Session-Id (verifiers sends its trace id there), else continues the open session whose token
stream its prompt extends, else opens one (`ChatProxy.resolve_tokens`).

    request   {"token_ids": [...], "sampling_params": {...}, "model"?, "request_id"?, "cache_salt"?, "priority"?}
    answer    {"request_id", "choices": [{"index": 0, "token_ids": [...], "finish_reason": "stop" | "length" |
              "abort", "logprobs": {"content": [{"token": "token_id:<id>", "logprob": x, ...}, ...]}}],
              "prompt_token_ids", "usage", "policy_version", "session_id"} (X-Session-Id header too)

`sampling_params` are vLLM's: `temperature`, `top_p`, `top_k` (0 or -1: off), `seed`, `max_tokens` (null: the
session's cap), `stop_token_ids` (added to the model's end-of-turn tokens; a stop token ends the completion and
is in it), `n` (1 only), `logprobs` (each sampled token's logprob is always returned). Fields that only shape
vLLM's text output are accepted and have no effect here (`OUTPUT_ONLY`); fields that would change the sampling
distribution are refused unless they hold their neutral value (`NEUTRAL`: penalties, `min_p`, `min_tokens`,
stop strings, `ignore_eos`, ...), since the logprobs must be those of the distribution sampled. Anything else is
refused naming the field. A session with fixed sampling (a trainer's) keeps its own temperature, top_p and top_k
whatever the request asks, as in the chat APIs. Multimodal `features` and `content_parts` are refused: this route
serves text token ids.
"""

from __future__ import annotations

from typing import Any

from turnrl.serve.http import sampling_fields
from turnrl.serve.sessions import ChatRequestError, RecordedCall
from turnrl.types import is_int

PATH = "/inference/v1/generate"

_BODY_FIELDS = {"token_ids", "sampling_params", "model", "request_id", "cache_salt", "priority", "stream",
                "features", "content_parts", "return_token_ids", "kv_transfer_params"}
_HONOURED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
             "max_tokens": "max_new_tokens"}
OUTPUT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "detokenize",
               "output_kind", "logprobs", "routed_experts_prompt_start", "return_routed_experts", "extra_args"}
"""vLLM sampling fields that shape its text output (or ask for data this route always or never returns)."""
NEUTRAL: dict[str, Any] = {"min_p": 0.0, "min_tokens": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                           "repetition_penalty": 1.0, "ignore_eos": False, "prompt_logprobs": None, "stop": None,
                           "bad_words": None, "allowed_token_ids": None, "logit_bias": None,
                           "structured_outputs": None, "guided_decoding": None, "truncate_prompt_tokens": None,
                           "n": 1}
"""vLLM sampling fields this route cannot honour: accepted only with these values (or their empty forms)."""


def parse(body: dict[str, Any]) -> tuple[list[int], dict[str, Any], tuple[int, ...]]:
    """(prompt token ids, sampling fields by SamplingParams' names, stop token ids) of a request body;
    ChatRequestError (400) naming the field at fault."""
    unknown = sorted(set(body) - _BODY_FIELDS)
    if unknown:
        raise ChatRequestError(f"{PATH}: unknown field(s) {unknown}; known: {sorted(_BODY_FIELDS)}", param=unknown[0])
    for name in ("features", "content_parts"):
        if body.get(name):
            raise ChatRequestError(f"{name}: multimodal inputs are not supported by this route; it takes text "
                                   "token ids", param=name)
    if body.get("stream"):
        raise ChatRequestError("stream: this route answers whole completions only", param="stream")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise ChatRequestError("token_ids must be a non-empty list of token ids", param="token_ids")
    for i, t in enumerate(ids):
        if not is_int(t) or t < 0:
            raise ChatRequestError(f"token_ids[{i}] must be a token id (an integer >= 0), got {t!r}"[:200],
                                   param="token_ids")
    given = body.get("sampling_params") or {}
    if not isinstance(given, dict):
        raise ChatRequestError("sampling_params must be an object of vLLM sampling parameters",
                               param="sampling_params")
    return ids, _sampling(given), _stop_token_ids(given.get("stop_token_ids"))


def _sampling(given: dict[str, Any]) -> dict[str, Any]:
    for name, value in given.items():
        where = f"sampling_params.{name}"
        if name in _HONOURED or name in OUTPUT_ONLY or name == "stop_token_ids":
            continue
        if name not in NEUTRAL:
            known = sorted([*_HONOURED, *OUTPUT_ONLY, *NEUTRAL, "stop_token_ids"])
            raise ChatRequestError(f"{where} is not supported by this route; known fields: {', '.join(known)}",
                                   param=where)
        if value is not None and value != NEUTRAL[name] and value not in ([], {}, ""):
            raise ChatRequestError(f"{where}={value!r} is not supported here (it would change the sampling "
                                   f"distribution whose logprobs are returned); leave it at {NEUTRAL[name]!r}"[:300],
                                   param=where)
    fields = {k: v for k, v in given.items() if k in _HONOURED}
    if fields.get("top_k") in (0, -1):
        fields["top_k"] = -1
    try:
        return sampling_fields(fields, _HONOURED, "stop")
    except ChatRequestError as e:  # name the field as the client sent it
        raise ChatRequestError(f"sampling_params.{e}", param=f"sampling_params.{e.param}") from None


def _stop_token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(is_int(t) and t >= 0 for t in value):
        raise ChatRequestError(f"sampling_params.stop_token_ids must be a list of token ids, got {value!r}"[:200],
                               param="sampling_params.stop_token_ids")
    return tuple(value)


def answer(call: RecordedCall, request_id: str, session_id: str) -> dict[str, Any]:
    """The call in vLLM's GenerateResponse shape (module docstring), with turnrl's policy version and session."""
    content: list[dict[str, Any]] = [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
               for t, lp in zip(call.completion_ids, call.logprobs, strict=True)]
    n_prompt, n_out = len(call.prompt_ids), len(call.completion_ids)
    return {
        "request_id": request_id,
        "choices": [{"index": 0, "token_ids": list(call.completion_ids), "finish_reason": str(call.finish_reason),
                     "logprobs": {"content": content}}],
        "prompt_token_ids": list(call.prompt_ids),
        "prompt_logprobs": None,
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
        "policy_version": call.policy_version,
        "session_id": session_id,
    }
