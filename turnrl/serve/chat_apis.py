"""The Responses and Anthropic Messages APIs over the chat proxy, and server-sent events for all three APIs.

`turnrl.serve.sessions.ChatProxy` speaks chat-completions messages. This module converts the other two APIs to them and
back, so one recording path (exact token ids, continuation, trajectories) serves every client:

    OpenAI Responses   (`POST /v1/responses`: the OpenAI Agents SDK's default model)
        input items -> messages: `message` items by role (input_text / output_text parts), `function_call` items
        join the assistant message before them as its `tool_calls`, `function_call_output` items become `tool`
        messages, `reasoning` items are dropped (reasoning is never matched); `instructions` is the system
        message; `previous_response_id` prepends that response's conversation (kept in memory by the proxy).
        Reply -> output items: `reasoning` (its text as `reasoning_text` content), `message` (output_text),
        `function_call` (call_id = the chat tool-call id).
    Anthropic Messages (`POST /v1/messages`)
        `system` -> a system message; `text` blocks -> content; assistant `tool_use` blocks -> `tool_calls`;
        user `tool_result` blocks -> `tool` messages (before the user's text); `thinking` blocks -> reasoning.
        A last assistant message of text is a prefill: the reply continues it (its turn is left open).
        Reply -> `thinking`, `text` and `tool_use` blocks; stop_reason end_turn / tool_use / max_tokens /
        stop_sequence (with `stop_sequence`, the string matched).

Anything a text model cannot take (image or document parts, server-side tools) is refused with a 400 naming the
field. Streams (`stream: true`) follow each API's own event protocol: OpenAI chat `chat.completion.chunk`s with
`delta.content` / `delta.reasoning_content` / `delta.tool_calls` then `data: [DONE]`; Responses
`response.created` ... `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta` ... `response.completed`; Anthropic `message_start`,
`content_block_start`, `content_block_delta` (text_delta, thinking_delta, input_json_delta),
`content_block_stop`, `message_delta`, `message_stop`. Usage is in the final event of each (chat: only with
`stream_options.include_usage`, in a last chunk without choices, as OpenAI sends it).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from turnrl.serve.sessions import (
    ChatCall,
    ChatRequestError,
    RecordedCall,
    chat_logprobs,
    chat_usage,
    metadata_reward,
    sampling_fields,
)
from turnrl.types import FinishReason, GenerateOutput, Message


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _sse(event: str | None, data: dict[str, Any]) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _parts_text(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """Text of a string or a list of text parts of the given types; any other part (an image) is refused."""
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


# ---------------------------------------------------------------------------------------------------
# OpenAI Responses
# ---------------------------------------------------------------------------------------------------
_RESPONSES_TEXT = ("input_text", "output_text", "text", "refusal")


def call_from_responses(body: dict[str, Any], history: list[Message] | None = None) -> ChatCall:
    """A ChatCall from a Responses API body; `history`: the conversation of `previous_response_id`."""
    given = body.get("input")
    if isinstance(given, str):
        items: list[Any] = [{"type": "message", "role": "user", "content": given}]
    elif isinstance(given, list) and (given or history):
        items = given
    else:
        raise ChatRequestError("input must be a string or a non-empty list of input items", param="input")
    messages: list[Message] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ChatRequestError("instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    messages += [m for m in history or [] if m["role"] != "system"]
    for i, item in enumerate(items):
        _add_response_item(messages, item, f"input[{i}]")
    if not messages:
        raise ChatRequestError("input holds no message", param="input")
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
             "max_output_tokens": "max_new_tokens"}
    return ChatCall(messages=messages, tools=_responses_tools(body.get("tools")), tool_choice=body.get("tool_choice"),
                    sampling=sampling_fields(body, names, "stop"), reward=metadata_reward(body),
                    model=body.get("model"))


def _add_response_item(messages: list[Message], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise ChatRequestError(f"{where} must be an object", param=where)
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise ChatRequestError(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                                   param=f"{where}.role")
        messages.append({"role": role, "content": _parts_text(item.get("content"), f"{where}.content",
                                                              _RESPONSES_TEXT)})
    elif kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
            raise ChatRequestError(f"{where}: a function_call needs call_id and name", param=where)
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # the text the model wrote before its calls
            last.setdefault("tool_calls", []).append(call)
            last["content"] = last.get("content") or None
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _parts_text(output, f"{where}.output", _RESPONSES_TEXT)
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
    elif kind == "reasoning":
        return  # the model's own reasoning, echoed back: never part of continuation matching
    else:
        raise ChatRequestError(f"{where}.type {kind!r} is not supported (message, function_call, "
                               "function_call_output, reasoning)", param=f"{where}.type")


def _responses_tools(tools: Any) -> list[dict] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise ChatRequestError("tools must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else t
            raise ChatRequestError(f"tools[{i}]: only function tools ({{type: function, name, parameters}}) run "
                                   f"here, got {kind!r}", param=f"tools[{i}]")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def responses_body(call: RecordedCall, finish: str, body: dict[str, Any], response_id: str, model: str,
                   status: str | None = None) -> dict[str, Any]:
    """The Responses API `response` object of a recorded call."""
    usage = chat_usage(call)
    incomplete = finish == "length"
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
        "status": status or ("incomplete" if incomplete else "completed"),
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
        "output": response_items(call.reply), "parallel_tool_calls": True,
        "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
        "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
        "previous_response_id": body.get("previous_response_id"), "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"), "store": True,
        "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                  "total_tokens": usage["total_tokens"],
                  "input_tokens_details": {"cached_tokens": call.cached_prompt_tokens},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }


def response_items(reply: Message) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if reply.get("reasoning_content"):
        items.append({"type": "reasoning", "id": _id("rs"), "summary": [], "status": "completed",
                      "content": [{"type": "reasoning_text", "text": reply["reasoning_content"]}]})
    if reply.get("content"):
        items.append({"type": "message", "id": _id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": reply["content"], "annotations": [],
                                   "logprobs": []}]})
    for c in reply.get("tool_calls") or ():
        items.append({"type": "function_call", "id": _id("fc"), "call_id": c["id"], "name": c["function"]["name"],
                      "arguments": c["function"]["arguments"], "status": "completed"})
    return items


# ---------------------------------------------------------------------------------------------------
# Anthropic Messages
# ---------------------------------------------------------------------------------------------------
def call_from_anthropic(body: dict[str, Any]) -> ChatCall:
    """A ChatCall from an Anthropic Messages body (`max_tokens` is required, as Anthropic requires it)."""
    if body.get("max_tokens") is None:
        raise ChatRequestError("max_tokens: field required", param="max_tokens")
    messages: list[Message] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _parts_text(system, "system", ("text",))})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise ChatRequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    for i, m in enumerate(given):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise ChatRequestError(f"messages[{i}].role must be user or assistant, got {role!r}",
                                   param=f"messages[{i}].role")
        messages += _anthropic_message(role, m.get("content"), f"messages[{i}].content")
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_new_tokens"}
    last = messages[-1]
    prefill = last["role"] == "assistant" and bool(last.get("content")) and not last.get("tool_calls")
    return ChatCall(messages=messages, tools=_anthropic_tools(body.get("tools")),
                    tool_choice=_anthropic_tool_choice(body.get("tool_choice")),
                    sampling=sampling_fields(body, names, "stop_sequences"), reward=metadata_reward(body),
                    model=body.get("model"), continue_final=prefill)


def _anthropic_message(role: str, content: Any, where: str) -> list[Message]:
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ChatRequestError(f"{where} must be a string or a list of content blocks", param=where)
    texts, calls, reasoning, results = [], [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        at = f"{where}[{j}]"
        if kind == "text":
            texts.append(block.get("text") or "")
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "thinking" and role == "assistant":
            reasoning.append(block.get("thinking") or "")
        elif kind == "redacted_thinking" and role == "assistant":
            continue
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _parts_text(block.get("content"), f"{at}.content", ("text",))})
        else:
            raise ChatRequestError(f"{at}: a {kind!r} block in a {role} message is not supported here (a text "
                                   "model: text, tool_use, tool_result, thinking)", param=at)
    if role == "user":
        return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])
    message: Message = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return [message]


def _anthropic_tools(tools: Any) -> list[dict] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise ChatRequestError("tools must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
            raise ChatRequestError(f"tools[{i}]: only client tools ({{name, description, input_schema}}) run here",
                                   param=f"tools[{i}]")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _anthropic_tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise ChatRequestError("tool_choice must be {type: auto | any | tool | none}", param="tool_choice")
    return {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {
        "type": "function", "function": {"name": choice.get("name")}}


def _stop_reason(call: RecordedCall, finish: str) -> str:
    if call.stop is not None and finish == "stop":
        return "stop_sequence"
    return {"tool_calls": "tool_use", "length": "max_tokens"}.get(finish, "end_turn")


def anthropic_usage(call: RecordedCall) -> dict[str, int]:
    return {"input_tokens": len(call.prompt_ids) - call.cached_prompt_tokens,
            "output_tokens": len(call.completion_ids), "cache_read_input_tokens": call.cached_prompt_tokens,
            "cache_creation_input_tokens": 0}


def anthropic_blocks(reply: Message) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": reply["reasoning_content"], "signature": ""})
    if reply.get("content"):
        blocks.append({"type": "text", "text": reply["content"]})
    for c in reply.get("tool_calls") or ():
        blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                       "input": json.loads(c["function"]["arguments"])})
    return blocks


def anthropic_body(call: RecordedCall, finish: str, model: str, message_id: str) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": anthropic_blocks(call.reply), "stop_reason": _stop_reason(call, finish),
            "stop_sequence": call.stop,
            "usage": anthropic_usage(call)}


# ---------------------------------------------------------------------------------------------------
# Server-sent events: one class per API, fed the proxy's stream events
# ---------------------------------------------------------------------------------------------------
class ChatEvents:
    """OpenAI chat-completions chunks. With `logprobs_of` (the renderer, when the request asks for logprobs) the
    finish chunk carries every completion token's logprob: the text chunks are decoded text, not one per token,
    and clients add the chunks' logprobs up."""

    def __init__(self, model: str, include_usage: bool, logprobs_of: Any = None):
        self.model, self.include_usage, self.logprobs_of = model, include_usage, logprobs_of
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def _chunk(self, delta: dict[str, Any] | None, finish: str | None = None, logprobs: Any = None,
               **extra: Any) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish,
                                             "logprobs": logprobs}]
        return _sse(None, {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                           "model": self.model, "choices": choices, **extra})

    def start(self, prompt_tokens: int) -> str:
        return self._chunk({"role": "assistant", "content": ""})

    def delta(self, kind: str, text: str) -> str:
        return self._chunk({"reasoning_content" if kind == "reasoning" else "content": text})

    def finish(self, call: RecordedCall, finish: str) -> str:
        out = []
        for i, c in enumerate(call.reply.get("tool_calls") or ()):
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
        return _sse(None, {"error": {"message": message, "type": kind, "param": param, "code": status}})


class ResponsesEvents:
    """Responses API events (each with `sequence_number`)."""

    def __init__(self, body: dict[str, Any], model: str, response_id: str):
        self.body, self.model, self.id = body, model, response_id
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: tuple[str, dict[str, Any]] | None = None  # (kind, item) of the output item being streamed

    def _event(self, kind: str, **data: Any) -> str:
        self.seq += 1
        return _sse(kind, {"type": kind, "sequence_number": self.seq - 1, **data})

    def _shell(self, status: str) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": int(time.time()), "model": self.model,
                "status": status, "output": [], "error": None, "incomplete_details": None,
                "tools": self.body.get("tools") or [], "tool_choice": self.body.get("tool_choice") or "auto",
                "parallel_tool_calls": True, "metadata": self.body.get("metadata") or {}}

    def start(self, prompt_tokens: int) -> str:
        return (self._event("response.created", response=self._shell("in_progress"))
                + self._event("response.in_progress", response=self._shell("in_progress")))

    def delta(self, kind: str, text: str) -> str:
        out = ""
        if self.open is None or self.open[0] != kind:
            out += self._close()
            out += self._open_text(kind)
        assert self.open is not None
        item = self.open[1]
        index = len(self.items) - 1
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        return out + self._event(name, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra)

    def _open_text(self, kind: str) -> str:
        item: dict[str, Any]
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.items.append(item)
        self.open = (kind, item)
        index = len(self.items) - 1
        out = self._event("response.output_item.added", output_index=index, item={**item, "content": []})
        if kind == "content":
            out += self._event("response.content_part.added", item_id=item["id"], output_index=index,
                               content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        return out

    def _close(self) -> str:
        if self.open is None:
            return ""
        kind, item = self.open
        self.open, index = None, len(self.items) - 1
        item["status"] = "completed"
        text = item["content"][0]["text"]
        if kind == "reasoning":
            out = self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=text)
        else:
            out = (self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=text, logprobs=[])
                   + self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=item["content"][0]))
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def finish(self, call: RecordedCall, finish: str) -> str:
        out = self._close()
        for c in call.reply.get("tool_calls") or ():
            fn = c["function"]
            item = {"type": "function_call", "id": _id("fc"), "call_id": c["id"], "name": fn["name"],
                    "arguments": "", "status": "in_progress"}
            self.items.append(item)
            index = len(self.items) - 1
            out += self._event("response.output_item.added", output_index=index, item=dict(item))
            out += self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=fn["arguments"])
            out += self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               arguments=fn["arguments"], name=fn["name"])
            item.update(arguments=fn["arguments"], status="completed")
            out += self._event("response.output_item.done", output_index=index, item=item)
        response = responses_body(call, finish, self.body, self.id, self.model)
        response["output"] = self.items  # the items as streamed (their ids)
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + self._event(done, response=response)

    def error(self, status: int, message: str, kind: str, param: str | None) -> str:
        return self._event("error", code=kind, message=message, param=param)


class AnthropicEvents:
    """Anthropic Messages stream events."""

    def __init__(self, model: str, message_id: str):
        self.model, self.id = model, message_id
        self.index, self.open = -1, None  # the content block being streamed: its kind

    def start(self, prompt_tokens: int) -> str:
        message: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
        return _sse("message_start", {"type": "message_start", "message": message}) + _sse("ping", {"type": "ping"})

    def _block(self, block: dict[str, Any]) -> str:
        out = self._stop()
        self.index += 1
        self.open = block["type"]
        return out + _sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})

    def _stop(self) -> str:
        if self.open is None:
            return ""
        self.open = None
        return _sse("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _delta(self, delta: dict[str, Any]) -> str:
        return _sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def delta(self, kind: str, text: str) -> str:
        if kind == "reasoning":
            out = "" if self.open == "thinking" else self._block({"type": "thinking", "thinking": "", "signature": ""})
            return out + self._delta({"type": "thinking_delta", "thinking": text})
        out = "" if self.open == "text" else self._block({"type": "text", "text": ""})
        return out + self._delta({"type": "text_delta", "text": text})

    def finish(self, call: RecordedCall, finish: str) -> str:
        out = ""
        for c in call.reply.get("tool_calls") or ():
            out += self._block({"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": {}})
            out += self._delta({"type": "input_json_delta", "partial_json": c["function"]["arguments"]})
        out += self._stop()
        usage = anthropic_usage(call)
        out += _sse("message_delta", {"type": "message_delta", "usage": usage,
                                      "delta": {"stop_reason": _stop_reason(call, finish),
                                                "stop_sequence": call.stop}})
        return out + _sse("message_stop", {"type": "message_stop"})

    def error(self, status: int, message: str, kind: str, param: str | None) -> str:
        return _sse("error", {"type": "error", "error": {"type": kind, "message": message}})


# ---------------------------------------------------------------------------------------------------
# OpenAI legacy text completions (`POST /v1/completions`): raw text in and out, not recorded
# ---------------------------------------------------------------------------------------------------
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
    if logprobs not in (None, 0) and not (isinstance(logprobs, int) and not isinstance(logprobs, bool)):
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
    return {"id": _id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": completion_finish(out)}],
            "usage": completion_usage(prompt_tokens, out)}


class CompletionEvents:
    """OpenAI text-completion chunks: the text as it is generated, the finish chunk, usage with
    `stream_options.include_usage`, `data: [DONE]`."""

    def __init__(self, model: str, include_usage: bool):
        self.model, self.include_usage, self.id, self.created = model, include_usage, _id("cmpl"), int(time.time())

    def _chunk(self, text: str | None, finish: str | None = None, **extra: Any) -> str:
        choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
        return _sse(None, {"id": self.id, "object": "text_completion", "created": self.created,
                           "model": self.model, "choices": choices, **extra})

    def delta(self, text: str) -> str:
        return self._chunk(text)

    def finish(self, out: GenerateOutput, prompt_tokens: int) -> str:
        done = self._chunk("", completion_finish(out))
        if self.include_usage:
            done += self._chunk(None, usage=completion_usage(prompt_tokens, out))
        return done + "data: [DONE]\n\n"

    def error(self, status: int, message: str, kind: str, param: str | None) -> str:
        return _sse(None, {"error": {"message": message, "type": kind, "param": param, "code": status}})
