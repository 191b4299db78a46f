"""The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the chat proxy.

`system` -> a system message; `text` blocks -> content; assistant `tool_use` blocks -> `tool_calls`; user
`tool_result` blocks -> `tool` messages (before the user's text; a `tool_reference` in one, as Claude Code's tool
search returns, is the line `Tool loaded: <name>`); `thinking` blocks -> reasoning; a `system` message inside
`messages` (Claude Code 2.1 sends its environment so) -> a system message at its place. A last assistant message of
text is a prefill: the reply continues it (its turn is left open). Reply -> `thinking`, `text` and `tool_use`
blocks; stop_reason end_turn / tool_use / max_tokens / stop_sequence (with `stop_sequence`, the string matched).
Client tools are offered to the model; server tools (`web_search_20250305`, `code_execution_*`, ...: any tool with
another `type`) and tools with `defer_loading` are accepted and not offered (turnrl.serve.tools). Streams:
`message_start`, `content_block_start`, `content_block_delta` (text_delta, thinking_delta, input_json_delta),
`content_block_stop`, `message_delta` (with usage), `message_stop`. Errors in Anthropic's shape `{"type": "error",
"error": {type, message}}`.

Request fields read: system, messages, tools, tool_choice, max_tokens (required, as Anthropic requires it),
temperature, top_p, top_k, stop_sequences, metadata (its `reward`), stream, model. Every other field is accepted and
ignored, as none changes what a text model on this server can do: the ones Claude Code 2.1 sends (`thinking`,
`context_management`, `output_config`, `metadata.user_id`) and `service_tier`, `container`, `mcp_servers`; block
and tool fields such as `cache_control`, `citations`, `strict`, `input_examples` (docs/harnesses.md).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from turnrl.serve.http import metadata_reward, new_id, parts_text, sampling_fields
from turnrl.serve.sessions import (
    ChatCall,
    ChatProxy,
    ChatRequestError,
    RecordedCall,
)
from turnrl.serve.streaming import sse
from turnrl.serve.tools import function_tool
from turnrl.types import Message

PATH = "/messages"
"""The call's URL after /v1 (at the root and per session)."""
COUNT_PATH = "/messages/count_tokens"
"""`messages.count_tokens`, at the root and per session (no session is opened or used)."""
PATHS: tuple[str, ...] = (PATH, COUNT_PATH)
"""URL forms after /v1 whose errors take this API's shape."""

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                    413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error"}


# ---- what chat_routes calls (turnrl.serve.chat_routes.ChatApi) ----------------------------------------
def parse(body: dict[str, Any], proxy: ChatProxy) -> tuple[ChatCall, str | None]:
    """The call, and the session its body names by history (none in this API)."""
    return call_from_anthropic(body), None


def answer(call: RecordedCall, finish: str, body: dict[str, Any], model: str, proxy: ChatProxy,
           session_id: str) -> dict[str, Any]:
    return anthropic_body(call, finish, model, new_id("msg"))


def events(body: dict[str, Any], model: str, proxy: ChatProxy, session_id: str) -> AnthropicEvents:
    return AnthropicEvents(model, new_id("msg"))


def error_body(status: int, message: str, kind: str, param: str | None = None, code: Any = None) -> dict[str, Any]:
    """Anthropic's error shape: its own type names by status."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


async def count_tokens(proxy: ChatProxy, body: dict[str, Any]) -> dict[str, int]:
    """`messages.count_tokens`: the prompt tokens of the body rendered afresh with the chat template."""
    chat = call_from_anthropic({**body, "max_tokens": body.get("max_tokens") or 1})  # not required here
    return {"input_tokens": await asyncio.to_thread(proxy.count_tokens, chat)}


# ---- the request and the response -------------------------------------------------------------------
def call_from_anthropic(body: dict[str, Any]) -> ChatCall:
    """A ChatCall from an Anthropic Messages body (`max_tokens` is required, as Anthropic requires it)."""
    if body.get("max_tokens") is None:
        raise ChatRequestError("max_tokens: field required", param="max_tokens")
    messages: list[Message] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": parts_text(system, "system", ("text",))})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise ChatRequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    for i, m in enumerate(given):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            raise ChatRequestError(f"messages[{i}].role must be user, assistant or system, got {role!r}",
                                   param=f"messages[{i}].role")
        if role == "system":
            messages.append({"role": "system", "content": parts_text(m.get("content"), f"messages[{i}].content",
                                                                     ("text",))})
        else:
            messages += _anthropic_message(role, m.get("content"), f"messages[{i}].content")
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_tokens": "max_new_tokens"}
    last = messages[-1]
    prefill = last["role"] == "assistant" and bool(last.get("content")) and not last.get("tool_calls")
    tools, not_offered = _anthropic_tools(body.get("tools"))
    return ChatCall(messages=messages, tools=tools, tool_choice=_anthropic_tool_choice(body.get("tool_choice")),
                    sampling=sampling_fields(body, names, "stop_sequences"), reward=metadata_reward(body),
                    model=body.get("model"), continue_final=prefill, not_offered=not_offered)


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
                            "content": parts_text(_references_as_text(block.get("content")), f"{at}.content",
                                                  ("text",))})
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


def _references_as_text(content: Any) -> Any:
    """A tool result's `tool_reference` blocks (a tool search's answer) as text blocks naming the tool."""
    if not isinstance(content, list):
        return content
    return [{"type": "text", "text": f"Tool loaded: {b.get('tool_name')}"}
            if isinstance(b, dict) and b.get("type") == "tool_reference" else b for b in content]


def _anthropic_tools(tools: Any) -> tuple[list[dict] | None, list[str]]:
    """(the client tools as functions, the tools not offered: server tools and deferred ones)."""
    if not tools:
        return None, []
    if not isinstance(tools, list):
        raise ChatRequestError("tools must be a list", param="tools")
    out, not_offered = [], []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name") or t.get("type"), str):
            raise ChatRequestError(f"tools[{i}] must be a tool object ({{name, description, input_schema}})",
                                   param=f"tools[{i}]")
        if t.get("type") not in (None, "custom") or t.get("defer_loading"):  # a server tool, or one loaded later
            not_offered.append(str(t.get("name") or t["type"]))
        elif not isinstance(t.get("name"), str):
            raise ChatRequestError(f"tools[{i}]: a client tool needs a `name`", param=f"tools[{i}]")
        else:
            out.append(function_tool(t["name"], t.get("description"), t.get("input_schema")))
    return out or None, not_offered


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


# ---- events ----------------------------------------------------------------------------------------
class AnthropicEvents:
    """Anthropic Messages stream events."""

    def __init__(self, model: str, message_id: str):
        self.model, self.id = model, message_id
        self.index, self.open = -1, None  # the content block being streamed: its kind

    def start(self, prompt_tokens: int) -> str:
        message: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
        return sse("message_start", {"type": "message_start", "message": message}) + sse("ping", {"type": "ping"})

    def _block(self, block: dict[str, Any]) -> str:
        out = self._stop()
        self.index += 1
        self.open = block["type"]
        return out + sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block})

    def _stop(self) -> str:
        if self.open is None:
            return ""
        self.open = None
        return sse("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

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
        out += sse("message_delta", {"type": "message_delta", "usage": usage,
                                     "delta": {"stop_reason": _stop_reason(call, finish), "stop_sequence": call.stop}})
        return out + sse("message_stop", {"type": "message_stop"})

    def error(self, status: int, message: str, kind: str, param: str | None) -> str:
        return sse("error", {"type": "error", "error": {"type": kind, "message": message}})
