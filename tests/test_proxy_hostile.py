"""The serve path (`turnrl serve`'s OpenAI proxy) on hostile model output: the reply goes out as valid JSON
with the parse errors noted, never a 500 blamed on the client."""

from __future__ import annotations

import json

import httpx
import pytest
from fakes import ScriptedEngine

from turnrl.render import ChatRenderer
from turnrl.serve.app import ServerThread, create_app
from turnrl.serve.sessions import ChatProxy
from turnrl.types import SamplingParams

TOOLS = [{"type": "function", "function": {"name": "f", "description": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}}]


@pytest.mark.parametrize("arguments", ["{\"x\": NaN}", "{\"x\": 1e999}", "[" * 5000 + "]" * 5000,
                                       "{\"x\": " + "9" * 5000 + "}"])
def test_hostile_tool_call_is_a_plain_reply_with_the_error_noted(qwen3_tokenizer, arguments):
    reply = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    engine = ScriptedEngine(qwen3_tokenizer, lambda rid, turn, prompt: reply)
    proxy = ChatProxy(engine, ChatRenderer(qwen3_tokenizer), sampling=SamplingParams(max_new_tokens=12_000))
    server = ServerThread(create_app(engine, proxy))
    server.start()
    try:
        response = httpx.post(f"{server.base_url}/sessions/s/v1/chat/completions", timeout=30, json={
            "model": "m", "messages": [{"role": "user", "content": "call f"}], "tools": TOOLS})
        assert response.status_code == 200, response.text
        json.loads(response.text, parse_constant=lambda name: pytest.fail(f"{name} in the response"))
        message = response.json()["choices"][0]["message"]
        assert "tool_calls" not in message or not message["tool_calls"]
        assert message["content"].startswith("<tool_call>")  # the malformed call as the model wrote it
        notes = proxy.session("s").calls[0].notes["tool_call_errors"]
        assert len(notes) == 1 and notes[0].startswith("invalid JSON in <tool_call> #1")
    finally:
        server.stop()
