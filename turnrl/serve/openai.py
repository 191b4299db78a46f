"""The OpenAI chat-completions API (`POST /v1/chat/completions`) and legacy text completions (`POST /v1/completions`).

Chat: the body's messages and tools are the proxy's own terms (`ChatCall`), checked field by field; custom
(free-form) tools `{type: custom, custom: {name, ...}}` are functions of one string for the model and their calls go
back as `{type: custom, custom: {name, input}}`; a tool of another type is accepted and not offered
(turnrl.serve.tools). The reply is a `chat.completion` (tool calls parsed into `tool_calls`, reasoning in
`reasoning_content`, `logprobs` on request), streamed as `chat.completion.chunk`s with `delta.content` /
`delta.reasoning_content` / `delta.tool_calls` then `data: [DONE]` (usage only with `stream_options.include_usage`,
in a last chunk without choices, as OpenAI sends it). Refused with a 400 naming the field: a field of the wrong type
or range, `n > 1`, `top_logprobs > 0`, non-text content parts (a text model). Fields this server has no use for
(`parallel_tool_calls`, `reasoning_effort`, `store`, `prompt_cache_key`, `user`, `service_tier`, ...) are accepted
and ignored.

Legacy completions: the raw prompt's tokens, no chat template, not recorded (docs/serving.md).
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from turnrl.render import ChatRenderer
from turnrl.serve.http import metadata_reward, new_id, sampling_fields, stream_flag
from turnrl.serve.sessions import (
    ChatCall,
    ChatProxy,
    ChatRequestError,
    RecordedCall,
    Session,
    message_text,
)
from turnrl.serve.streaming import sse
from turnrl.serve.tools import custom_arguments, custom_input, custom_tool
from turnrl.types import FinishReason, GenerateOutput, is_int

PATH = "/chat/completions"
"""The call's URL after /v1 (at the root and per session)."""
COMPLETIONS_PATH = "/completions"
"""Legacy text completions, at the root only (not recorded, so not a session's)."""
PATHS: tuple[str, ...] = (PATH, COMPLETIONS_PATH)
"""URL forms after /v1 whose errors take this API's shape."""

ROLES = {"system", "user", "assistant", "tool", "developer"}


# ---- what chat_routes calls (turnrl.serve.chat_routes.ChatApi) ----------------------------------------
def parse(body: dict[str, Any], proxy: ChatProxy) -> tuple[ChatCall, str | None]:
    """The call, and the session its body names by history (none in this API)."""
    return call_from_openai(body), None


def answer(call: RecordedCall, finish: str, body: dict[str, Any], model: str, proxy: ChatProxy,
           session_id: str) -> dict[str, Any]:
    return chat_response(call, finish, model, bool(body.get("logprobs")), proxy.renderer, _custom_names(body))


def events(body: dict[str, Any], model: str, proxy: ChatProxy, session_id: str) -> ChatEvents:
    options = body.get("stream_options") or {}
    return ChatEvents(model, bool(isinstance(options, dict) and options.get("include_usage")),
                      proxy.renderer if body.get("logprobs") else None, _custom_names(body))


def error_body(status: int, message: str, kind: str, param: str | None = None, code: Any = None) -> dict[str, Any]:
    """OpenAI's error shape (the Responses API's and turnrl's own routes' too)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


async def chat_completion(proxy: ChatProxy, session_id: str | Session, body: dict[str, Any]) -> dict[str, Any]:
    """Serve one `chat.completions.create` body in process (without streaming); returns the response body."""
    chat = call_from_openai(body)
    if body.get("stream"):
        raise ChatRequestError("stream=true: use ChatProxy.complete with on_delta (the HTTP server does)",
                               param="stream")
    session = session_id if isinstance(session_id, Session) else proxy.session(
        session_id, create=proxy.create_sessions)
    call, finish = await proxy.complete(session, chat)
    return answer(call, finish, body, body.get("model") or proxy.model_name, proxy, session.id)


# ---- the request -------------------------------------------------------------------------------------
def call_from_openai(request: dict[str, Any]) -> ChatCall:
    """A ChatCall from an OpenAI chat-completions body; ChatRequestError names the first bad field."""
    stream_flag(request)
    n = request.get("n")
    if n is not None and n != 1:
        raise ChatRequestError(f"n={n!r} is not supported; send one request per sample", param="n")
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise ChatRequestError(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}",
                                   param=f"messages[{i}].role")
        message_text(m.get("content"), f"messages[{i}].content")
        _check_tool_calls(m.get("tool_calls"), f"messages[{i}].tool_calls")
    _check_logprobs(request)
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
             "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
    tools, not_offered = _chat_tools(request.get("tools"))
    return ChatCall(messages=[_as_function_calls(m) for m in messages], tools=tools,
                    tool_choice=request.get("tool_choice"), sampling=sampling_fields(request, names, "stop"),
                    reward=metadata_reward(request), model=request.get("model"), not_offered=not_offered)


def _chat_tools(tools: Any) -> tuple[list[dict] | None, list[str]]:
    """(the request's tools in the proxy's terms: functions, and custom tools as functions of one string; the
    tools of other types, not offered)."""
    if not tools:
        return None, []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ChatRequestError('tools must be a list of {"type": "function", "function": {"name", ...}} objects',
                               param="tools")
    out, not_offered = [], []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "function")
        if kind not in ("function", "custom"):
            not_offered.append(str(kind))
            continue
        spec: Any = tool.get(kind)
        if not (isinstance(spec, dict) and isinstance(spec.get("name"), str)):
            raise ChatRequestError(f'tools[{i}] must be {{"type": "{kind}", "{kind}": {{"name", ...}}}}',
                                   param=f"tools[{i}]")
        out.append(tool if kind == "function" else custom_tool(spec["name"], spec.get("description")))
    return out or None, not_offered


def _custom_names(body: dict[str, Any]) -> set[str]:
    tools: Any = body.get("tools") if isinstance(body.get("tools"), list) else []
    return {t["custom"]["name"] for t in tools if isinstance(t, dict) and t.get("type") == "custom"
            and isinstance(t.get("custom"), dict) and isinstance(t["custom"].get("name"), str)}


def _as_function_calls(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose custom tool calls (echoed back) are written as the functions the model saw."""
    calls = message.get("tool_calls")
    if not calls or all(c.get("type", "function") == "function" for c in calls):
        return message
    return {**message, "tool_calls": [c if c.get("type", "function") == "function" else {
        "id": c.get("id"), "type": "function",
        "function": {"name": c["custom"].get("name"), "arguments": custom_arguments(c["custom"].get("input"))}}
        for c in calls]}


def as_api_calls(calls: list[dict[str, Any]], custom: set[str]) -> list[dict[str, Any]]:
    """The reply's tool calls as this API gives them back: a custom tool's as `{type: custom, custom: {name,
    input}}`."""
    return [c if c["function"]["name"] not in custom else {
        "id": c["id"], "type": "custom", "custom": {"name": c["function"]["name"],
                                                    "input": custom_input(c["function"]["arguments"])}}
        for c in calls]


def _check_logprobs(request: dict[str, Any]) -> None:
    logprobs, top = request.get("logprobs"), request.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ChatRequestError(f"logprobs must be a boolean, got {logprobs!r}", param="logprobs")
    if top is not None and not (is_int(top) and 0 <= top <= 20):
        raise ChatRequestError(f"top_logprobs must be an integer 0..20, got {top!r}", param="top_logprobs")
    if top:
        raise ChatRequestError("top_logprobs > 0 is not available: the engine returns the logprob of each sampled "
                               "token only, not its alternatives; send top_logprobs=0 (or none)", param="top_logprobs")


def _check_tool_calls(calls: Any, where: str) -> None:
    if calls is None:
        return
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get(c.get("type") if c.get("type") == "custom" else "function"), dict)
            for c in calls):
        raise ChatRequestError(f'{where} must be a list of {{"id", "type": "function", "function": {{"name", '
                               f'"arguments"}}}} objects (or custom: {{"name", "input"}})', param=where)


# ---- the response ------------------------------------------------------------------------------------
def chat_response(call: RecordedCall, finish: str, model: str, logprobs: bool, renderer: ChatRenderer,
                  custom: set[str] | None = None) -> dict[str, Any]:
    """The OpenAI `chat.completion` body of a recorded call (`custom`: the request's custom tools)."""
    message = copy.deepcopy(call.reply)
    if message.get("tool_calls") and custom:
        message["tool_calls"] = as_api_calls(message["tool_calls"], custom)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish,
                     "logprobs": chat_logprobs(call, renderer) if logprobs else None}],
        "usage": chat_usage(call),
    }


def chat_logprobs(call: RecordedCall, renderer: ChatRenderer) -> dict[str, Any]:
    """OpenAI's `choices[0].logprobs`: each completion token's logprob (its top alternatives are not available:
    a request for them is refused, see `call_from_openai`)."""
    return {"content": [{"token": renderer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []} for t, lp in zip(call.completion_ids, call.logprobs, strict=True)]}


def chat_usage(call: RecordedCall) -> dict[str, Any]:
    prompt_tokens, completion_tokens = len(call.prompt_ids), len(call.completion_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": call.cached_prompt_tokens}}


class ChatEvents:
    """OpenAI chat-completions chunks. With `logprobs_of` (the renderer, when the request asks for logprobs) the
    finish chunk carries every completion token's logprob: the text chunks are decoded text, not one per token,
    and clients add the chunks' logprobs up."""

    def __init__(self, model: str, include_usage: bool, logprobs_of: Any = None, custom: set[str] | None = None):
        self.model, self.include_usage, self.logprobs_of = model, include_usage, logprobs_of
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.custom = custom or set()

    def _chunk(self, delta: dict[str, Any] | None, finish: str | None = None, logprobs: Any = None,
               **extra: Any) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish,
                                             "logprobs": logprobs}]
        return sse(None, {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                          "model": self.model, "choices": choices, **extra})

    def start(self, prompt_tokens: int) -> str:
        return self._chunk({"role": "assistant", "content": ""})

    def delta(self, kind: str, text: str) -> str:
        return self._chunk({"reasoning_content" if kind == "reasoning" else "content": text})

    def finish(self, call: RecordedCall, finish: str) -> str:
        out = []
        for i, c in enumerate(as_api_calls(call.reply.get("tool_calls") or [], self.custom)):
            if c["type"] == "custom":  # a custom tool's call in one chunk
                out.append(self._chunk({"tool_calls": [{"index": i, **c}]}))
                continue
            fn = c["function"]
            out.append(self._chunk({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                                    "function": {"name": fn["name"], "arguments": ""}}]}))
            out.append(self._chunk({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]}))
        logprobs = chat_logprobs(call, self.logprobs_of) if self.logprobs_of is not None else None
        out.append(self._chunk({}, finish, logprobs))
        if self.include_usage:  # as OpenAI does: only when asked, in a last chunk without choices
            out.append(self._chunk(None, usage=chat_usage(call)))
        return "".join(out) + "data: [DONE]\n\n"

    def error(self, status: int, message: str, kind: str, param: str | None) -> str:
        return sse(None, {"error": {"message": message, "type": kind, "param": param, "code": status}})


# ---- legacy text completions (`POST /v1/completions`): raw text in and out, not recorded --------------
def completion_request(body: dict[str, Any]) -> tuple[str, dict[str, Any], bool]:
    """(prompt, sampling fields, logprobs wanted) of a `completions.create` body; ChatRequestError names the
    first field this server cannot serve."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ChatRequestError("prompt must be a non-empty string (or a list of one string)", param="prompt")
    for name, allowed in (("n", 1), ("best_of", 1), ("echo", False), ("suffix", None)):
        if body.get(name) not in (None, allowed):
            raise ChatRequestError(f"{name}={body[name]!r} is not supported here", param=name)
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0) and not is_int(logprobs):
        raise ChatRequestError(f"logprobs must be an integer 0..5, got {logprobs!r}", param="logprobs")
    if logprobs:
        raise ChatRequestError("logprobs > 0 (top alternatives) is not available: the engine returns the logprob of "
                               "the sampled token only; send logprobs=0", param="logprobs")
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
             "max_tokens": "max_new_tokens"}
    sampling = {"max_new_tokens": 16, **sampling_fields(body, names, "stop")}  # 16: OpenAI's default here
    return prompt, sampling, logprobs is not None


def completion_logprobs(out: GenerateOutput, decode: Any) -> dict[str, Any]:
    tokens = [decode([t]) for t in out.token_ids]
    offsets = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": list(out.logprobs), "top_logprobs": None, "text_offset": offsets}


def completion_usage(prompt_tokens: int, out: GenerateOutput) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(out.token_ids),
            "total_tokens": prompt_tokens + len(out.token_ids)}


def completion_finish(out: GenerateOutput) -> str:
    return "stop" if out.finish_reason == FinishReason.STOP else "length"


def completion_body(out: GenerateOutput, text: str, prompt_tokens: int, model: str,
                    logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": completion_finish(out)}],
            "usage": completion_usage(prompt_tokens, out)}


class CompletionEvents:
    """OpenAI text-completion chunks: the text as it is generated, the finish chunk, usage with
    `stream_options.include_usage`, `data: [DONE]`."""

    def __init__(self, model: str, include_usage: bool):
        self.model, self.include_usage, self.id, self.created = model, include_usage, new_id("cmpl"), int(time.time())

    def _chunk(self, text: str | None, finish: str | None = None, **extra: Any) -> str:
        choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
        return sse(None, {"id": self.id, "object": "text_completion", "created": self.created,
                          "model": self.model, "choices": choices, **extra})

    def delta(self, text: str) -> str:
        return self._chunk(text)

    def finish(self, out: GenerateOutput, prompt_tokens: int) -> str:
        done = self._chunk("", completion_finish(out))
        if self.include_usage:
            done += self._chunk(None, usage=completion_usage(prompt_tokens, out))
        return done + "data: [DONE]\n\n"

    def error(self, status: int, message: str, kind: str, param: str | None) -> str:
        return sse(None, {"error": {"message": message, "type": kind, "param": param, "code": status}})
