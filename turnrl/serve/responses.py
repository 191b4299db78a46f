"""The OpenAI Responses API (`POST /v1/responses`: the OpenAI Agents SDK's default model) over the chat proxy.

Input items -> chat messages: `message` items by role (input_text / output_text parts), `function_call` and
`custom_tool_call` items join the assistant message before them as its `tool_calls`, `function_call_output` and
`custom_tool_call_output` items become `tool` messages, `reasoning` items are dropped (reasoning is never matched);
`instructions` is the system message; `previous_response_id` prepends that response's conversation
(`ChatProxy.remember`, kept in memory) and names its session. Tools (turnrl.serve.tools): function tools, custom
(free-form) tools as functions of one string, namespace tools flattened to `<namespace>__<name>` functions, hosted
tools (web_search, file_search, code_interpreter, ...) accepted and not offered to the model. Reply -> output items:
`reasoning` (its text as `reasoning_text` content), `message` (output_text), `function_call` (call_id = the chat
tool-call id; a namespaced tool's with `namespace` and its own `name`) or `custom_tool_call` (`input`). Streams:
`response.created` ... `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta` (`response.custom_tool_call_input.delta`) ... `response.completed` (or
`response.incomplete`), with usage.

Request fields read: input, instructions, tools, tool_choice, temperature, top_p, top_k, seed, max_output_tokens,
stop, metadata (its `reward`), previous_response_id, stream, model. Every other field is accepted and ignored, as
none changes what a text model on this server can do: the ones Codex 0.171 sends (`include`, `reasoning`, `store`,
`prompt_cache_key`, `client_metadata`, `parallel_tool_calls`) and `text`, `truncation`, `service_tier`, `user`,
`safety_identifier`, `background`, `max_tool_calls`, `stream_options` (docs/harnesses.md).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from turnrl.serve import openai
from turnrl.serve.http import metadata_reward, new_id, parts_text, sampling_fields
from turnrl.serve.sessions import (
    ChatCall,
    ChatProxy,
    ChatRequestError,
    RecordedCall,
)
from turnrl.serve.streaming import sse
from turnrl.serve.tools import Origin, custom_arguments, custom_input, flat_name, responses_tools
from turnrl.types import Message

PATH = "/responses"
"""The call's URL after /v1 (at the root and per session)."""
PATHS: tuple[str, ...] = (PATH,)
"""URL forms after /v1 whose errors take this API's shape (OpenAI's)."""

error_body = openai.error_body


# ---- what chat_routes calls (turnrl.serve.chat_routes.ChatApi) ----------------------------------------
def parse(body: dict[str, Any], proxy: ChatProxy) -> tuple[ChatCall, str | None]:
    """The call, and the session that `previous_response_id` names (its conversation comes first)."""
    previous = body.get("previous_response_id")
    if previous is None:
        return call_from_responses(body), None
    if not isinstance(previous, str):
        raise ChatRequestError(f"previous_response_id must be a string (a response's id), got {previous!r}"[:300],
                               param="previous_response_id")
    remembered = proxy.recall(previous)
    if remembered is None:
        raise ChatRequestError(f"previous_response_id {previous!r} is unknown here (responses are kept in "
                               "memory; send the whole input instead)", param="previous_response_id")
    session_id, history = remembered
    return call_from_responses(body, history), session_id


def answer(call: RecordedCall, finish: str, body: dict[str, Any], model: str, proxy: ChatProxy,
           session_id: str) -> dict[str, Any]:
    response_id = f"resp_{uuid.uuid4().hex}"
    proxy.remember(response_id, call, session_id)
    return responses_body(call, finish, body, response_id, model)


def _origins(body: dict[str, Any]) -> dict[str, Origin]:
    """What the model's functions are in the request's terms (custom and namespaced tools)."""
    return responses_tools(body.get("tools")).origins


def events(body: dict[str, Any], model: str, proxy: ChatProxy, session_id: str) -> ResponsesEvents:
    return ResponsesEvents(body, model, f"resp_{uuid.uuid4().hex}", proxy, session_id)


# ---- the request and the response -------------------------------------------------------------------
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
    offered = responses_tools(body.get("tools"))
    return ChatCall(messages=messages, tools=offered.functions or None, tool_choice=body.get("tool_choice"),
                    sampling=sampling_fields(body, names, "stop"), reward=metadata_reward(body),
                    model=body.get("model"), not_offered=offered.not_offered)


def _add_response_item(messages: list[Message], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise ChatRequestError(f"{where} must be an object", param=where)
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise ChatRequestError(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                                   param=f"{where}.role")
        messages.append({"role": role, "content": parts_text(item.get("content"), f"{where}.content",
                                                              _RESPONSES_TEXT)})
    elif kind in ("function_call", "custom_tool_call"):
        if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
            raise ChatRequestError(f"{where}: a {kind} needs call_id and name", param=where)
        arguments = (item.get("arguments") or "{}") if kind == "function_call" else custom_arguments(item.get("input"))
        _add_call(messages, {"id": item["call_id"], "type": "function", "function": {
            "name": flat_name(item.get("namespace"), item["name"]), "arguments": arguments}})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output")
        text = output if isinstance(output, str) else parts_text(output, f"{where}.output", _RESPONSES_TEXT)
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
    elif kind == "reasoning":
        return  # the model's own reasoning, echoed back: never part of continuation matching
    else:
        raise ChatRequestError(f"{where}.type {kind!r} is not supported (message, function_call, "
                               "function_call_output, custom_tool_call, custom_tool_call_output, reasoning)",
                               param=f"{where}.type")


def _add_call(messages: list[Message], call: dict[str, Any]) -> None:
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":  # the text the model wrote before its calls
        last.setdefault("tool_calls", []).append(call)
        last["content"] = last.get("content") or None
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def responses_body(call: RecordedCall, finish: str, body: dict[str, Any], response_id: str, model: str,
                   status: str | None = None) -> dict[str, Any]:
    """The Responses API `response` object of a recorded call."""
    usage = openai.chat_usage(call)
    incomplete = finish == "length"
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
        "status": status or ("incomplete" if incomplete else "completed"),
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
        "output": response_items(call.reply, _origins(body)), "parallel_tool_calls": True,
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


def response_items(reply: Message, origins: dict[str, Origin] | None = None) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if reply.get("reasoning_content"):
        items.append({"type": "reasoning", "id": new_id("rs"), "summary": [], "status": "completed",
                      "content": [{"type": "reasoning_text", "text": reply["reasoning_content"]}]})
    if reply.get("content"):
        items.append({"type": "message", "id": new_id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": reply["content"], "annotations": [],
                                   "logprobs": []}]})
    for c in reply.get("tool_calls") or ():
        items.append(call_item(c, (origins or {}).get(c["function"]["name"])))
    return items


def call_item(call: dict[str, Any], origin: Origin | None, status: str = "completed") -> dict[str, Any]:
    """The output item of one tool call: a `function_call` (with `namespace` and the tool's own name for a
    namespaced one) or a `custom_tool_call` carrying the model's free-form input."""
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    if origin is not None and origin.kind == "custom":
        item = {"type": "custom_tool_call", "id": new_id("ctc"), "call_id": call["id"], "name": origin.name,
                "input": custom_input(arguments), "status": status}
    else:
        item = {"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": name,
                "arguments": arguments, "status": status}
    if origin is not None and origin.namespace:
        item.update(name=origin.name, namespace=origin.namespace)
    return item


# ---- events ----------------------------------------------------------------------------------------
class ResponsesEvents:
    """Responses API events (each with `sequence_number`)."""

    def __init__(self, body: dict[str, Any], model: str, response_id: str, proxy: ChatProxy, session_id: str):
        self.body, self.model, self.id = body, model, response_id
        self.proxy, self.session_id = proxy, session_id
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: tuple[str, dict[str, Any]] | None = None  # (kind, item) of the output item being streamed

    def _event(self, kind: str, **data: Any) -> str:
        self.seq += 1
        return sse(kind, {"type": kind, "sequence_number": self.seq - 1, **data})

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
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
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
        self.proxy.remember(self.id, call, self.session_id)  # a later previous_response_id continues from here
        out = self._close()
        origins = _origins(self.body)
        for c in call.reply.get("tool_calls") or ():
            out += self._call(call_item(c, origins.get(c["function"]["name"]), "in_progress"))
        response = responses_body(call, finish, self.body, self.id, self.model)
        response["output"] = self.items  # the items as streamed (their ids)
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + self._event(done, response=response)

    def _call(self, item: dict[str, Any]) -> str:
        """A tool call's events: added (empty), its arguments (a custom tool's input) in one delta, done."""
        custom = item["type"] == "custom_tool_call"
        field, prefix = ("input", "response.custom_tool_call_input") if custom else (
            "arguments", "response.function_call_arguments")
        text, index = item[field], len(self.items)
        self.items.append(item)
        out = self._event("response.output_item.added", output_index=index, item={**item, field: ""})
        out += self._event(f"{prefix}.delta", item_id=item["id"], output_index=index, delta=text)
        done = {"name": item["name"]} if not custom else {}
        out += self._event(f"{prefix}.done", item_id=item["id"], output_index=index, **{field: text}, **done)
        item["status"] = "completed"
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def error(self, status: int, message: str, kind: str, param: str | None) -> str:
        return self._event("error", code=kind, message=message, param=param)
