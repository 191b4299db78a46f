"""`turnrl serve` as external agents expect it: the OpenAI chat and Responses APIs and the Anthropic Messages API at
the root URL and per session, streaming, the session rule, rewards from outside, the idle TTL. Each client is the
real library (openai, LangGraph, the OpenAI Agents SDK, anthropic) against a real server on 127.0.0.1, and each
episode's trajectory is checked token by token against what the engine returned."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from pathlib import Path
from urllib.parse import quote, unquote

import anthropic
import httpx
import openai
import pytest
from test_serve import QUESTION, RecordingEngine, calculator_script

from turnrl.engines.embedded import EmbeddedEngine
from turnrl.render import ChatRenderer
from turnrl.rollout.tree import common_prefix
from turnrl.serve.app import ServerThread, create_app
from turnrl.serve.openai import chat_completion
from turnrl.serve.sessions import ChatProxy
from turnrl.serve.streaming import ReplyStream
from turnrl.types import BranchKind, RolloutStatus, SegmentSource, TerminationReason, Trajectory

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "openai_agent"
MODEL, TEMPLATE, TOOL = SegmentSource.MODEL, SegmentSource.TEMPLATE, SegmentSource.TOOL
TOOL_LOOP = [MODEL, TEMPLATE, TOOL, MODEL]  # a call, the template's closing + the tool result (mask 0), the answer


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Served:
    """A scripted engine (real Qwen3 tokenizer and template) behind the real app on 127.0.0.1."""

    def __init__(self, tokenizer, script=calculator_script, **proxy_kwargs):
        self.engine = RecordingEngine(tokenizer, script)
        self.proxy = ChatProxy(self.engine, ChatRenderer(tokenizer), **proxy_kwargs)
        self.server = ServerThread(create_app(self.engine, self.proxy))
        self.url = self.server.start()

    def sessions(self) -> list[dict]:
        return httpx.get(f"{self.url}/sessions").json()["sessions"]

    def only_session(self) -> str:
        [session] = self.sessions()
        return session["id"]

    def trajectories(self, session_id: str) -> list[Trajectory]:
        body = httpx.get(f"{self.url}/sessions/{quote(session_id, safe='')}/trajectories").json()
        return [Trajectory.from_json(row) for row in body["trajectories"]]

    def check_episode(self, session_id: str, sources: list[SegmentSource] = TOOL_LOOP) -> Trajectory:
        """One trajectory whose mask-1 tokens are exactly the engine's outputs and whose mask-0 tokens are the
        template and the tool results."""
        [traj] = self.trajectories(session_id)
        traj.validate()
        calls = [(c, o) for c, o in zip(self.engine.calls, self.engine.outputs, strict=True)
                 if c.request_id == session_id]
        assert traj.prompt_ids == calls[0][0].prompt_ids
        assert [s.source for s in traj.segments] == sources
        model = [s for s in traj.segments if s.source == MODEL]
        assert [s.token_ids for s in model] == [o.token_ids for _, o in calls]
        assert [s.logprobs for s in model] == [o.logprobs for _, o in calls]
        for seg in traj.segments:
            assert seg.loss_mask == [int(seg.source == MODEL)] * len(seg)
        # every later call's prompt is the recorded stream, never a re-render of the text
        for k, (call, _) in enumerate(calls[1:], start=1):
            stream = traj.prompt_ids + traj.response_ids
            assert stream[: len(call.prompt_ids)] == call.prompt_ids, f"call {k} re-rendered the history"
        tool = [s for s in traj.segments if s.source == TOOL]
        if tool:
            assert "<tool_response>\n42\n</tool_response>" in self.engine.tokenizer.decode(tool[0].token_ids)
        return traj

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture()
def served(qwen3_tokenizer):
    s = Served(qwen3_tokenizer)
    yield s
    s.stop()


def _sse(text: str) -> list[tuple[str | None, dict | str]]:
    """(event name, data) of each server-sent event."""
    events = []
    for block in text.strip().split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        events.append((name, data if data == "[DONE]" else json.loads(data)))
    return events


# ---- OpenAI chat completions ---------------------------------------------------------------------------
async def test_openai_client_at_the_root_url_is_one_episode(served):
    """The unmodified example agent with base_url=http://HOST:PORT/v1, naming no session: its first call opens
    an episode, its second extends that conversation and continues it (the session rule)."""
    agent = _load("agent")
    assert await agent.run(f"{served.url}/v1", "any-key", QUESTION) == 1.0
    [session] = served.sessions()
    assert (session["rule"], session["calls"], session["status"]) == ("new", 2, "open")
    traj = served.check_episode(session["id"])
    assert traj.num_turns == 2 and traj.termination_reason == TerminationReason.NO_TOOL_CALL


def test_the_session_rule_header_then_user_then_metadata(served):
    hello = [{"role": "user", "content": "hi"}]
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="k", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="m", messages=hello,
                                                          extra_headers={"X-Session-Id": "by-header"}, user="loser")
    assert raw.headers["x-session-id"] == "by-header"
    client.chat.completions.create(model="m", messages=hello, user="by-user", metadata={"session_id": "loser"})
    client.chat.completions.create(model="m", messages=hello, metadata={"session_id": "by-metadata"})
    client.chat.completions.create(model="m", messages=hello)  # names nothing, extends nothing: a new episode
    rules = {s["id"]: s["rule"] for s in served.sessions()}
    assert {k: v for k, v in rules.items() if not k.startswith("ep-")} == {
        "by-header": "header", "by-user": "user", "by-metadata": "metadata"}
    assert sorted(rules.values()) == ["header", "metadata", "new", "user"]
    assert [c.request_id for c in served.engine.calls][:3] == ["by-header", "by-user", "by-metadata"]


def test_openai_streaming_with_tools_assembles_to_the_recorded_reply(served):
    client = openai.OpenAI(base_url=f"{served.url}/sessions/s1/v1", api_key="k", max_retries=0)
    agent = _load("agent")
    messages = [{"role": "user", "content": QUESTION["prompt"]}]
    with client.chat.completions.stream(model="m", messages=messages, tools=agent.TOOLS,
                                        stream_options={"include_usage": True}) as stream:
        for _ in stream:
            pass
        first = stream.get_final_completion()
    [call] = first.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "6*7"})
    assert first.choices[0].finish_reason == "tool_calls" and first.usage.completion_tokens == len(
        served.engine.outputs[0].token_ids)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    chunks = list(client.chat.completions.create(model="m", messages=messages, tools=agent.TOOLS, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The answer is 42." == served.proxy.session("s1").calls[1].reply["content"]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(served.engine.calls[1].prompt_ids)
    served.check_episode("s1")


@pytest.mark.parametrize("reply", ["Grüße, 世界! 🎉🎉 ½ — naïve café ✓", "数学：六乘七等于四十二。🧮"])
def test_streamed_text_is_decoded_from_the_token_ids_without_splitting_characters(qwen3_tokenizer, reply):
    served = Served(qwen3_tokenizer, script=lambda rid, turn, text: reply)
    try:
        ids = qwen3_tokenizer(reply, add_special_tokens=False)["input_ids"]
        split = [i for i in range(1, len(ids)) if "\ufffd" in qwen3_tokenizer.decode(ids[:i])]
        assert split, "the reply must hold characters whose bytes span several tokens"
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "stream_options": {"include_usage": True}}
        response = httpx.post(f"{served.url}/v1/chat/completions", json=body)
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse(response.text)
        assert events[-1] == (None, "[DONE]")
        deltas = [d["choices"][0]["delta"].get("content") for _, d in events[:-1] if d["choices"]]
        deltas = [d for d in deltas if d]
        assert len(deltas) > 3 and all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == reply == served.proxy.session(served.only_session()).calls[0].reply["content"]
        assert events[-2][1]["usage"]["completion_tokens"] == len(ids) + 1  # and the end-of-turn token
    finally:
        served.stop()


async def test_tokens_stream_while_the_embedded_engine_generates(tiny_qwen3, qwen3_tokenizer):
    """True token streaming: the first text reaches the client while the engine is still generating."""
    renderer = ChatRenderer(qwen3_tokenizer)
    engine = EmbeddedEngine(tiny_qwen3, eos_token_ids=sorted(renderer.end_of_turn_ids))
    proxy = ChatProxy(engine, renderer)
    server = ServerThread(create_app(engine, proxy))
    url = server.start()
    try:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Tell me a story."}], stream=True, max_tokens=48,
            seed=5, extra_headers={"X-Session-Id": "live"})
        seen_at_first_text, text = None, ""
        async for chunk in stream:
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta and seen_at_first_text is None:
                seen_at_first_text = engine.stats["generated_tokens"]
            text += delta or ""
        [call] = proxy.session("live").calls
        assert seen_at_first_text is not None and seen_at_first_text < len(call.completion_ids)
        assert text == call.reply["content"]
        [traj] = proxy.trajectories("live")
        assert traj.response_ids == call.completion_ids and traj.segments[0].loss_mask == [1] * len(text and
                                                                                                     call.completion_ids)
    finally:
        server.stop()
        engine.close()


# ---- OpenAI Responses ----------------------------------------------------------------------------------
RESPONSES_TOOL = {"type": "function", "name": "calculator", "description": "Evaluate arithmetic.",
                  "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}


def test_openai_responses_api_with_tools_and_streaming(served):
    client = openai.OpenAI(base_url=f"{served.url}/sessions/r1/v1", api_key="k", max_retries=0)
    first = client.responses.create(model="m", input=QUESTION["prompt"], tools=[RESPONSES_TOOL])
    [call] = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "calculator", {"expression": "6*7"})
    assert first.usage.input_tokens == len(served.engine.calls[0].prompt_ids)
    follow_up = [{"role": "user", "content": QUESTION["prompt"]}, call.model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": call.call_id, "output": "42"}]
    events = list(client.responses.create(model="m", input=follow_up, tools=[RESPONSES_TOOL], stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "The answer is 42."
    assert events[-1].response.output_text == "The answer is 42."
    assert events[-1].response.usage.output_tokens == len(served.engine.outputs[1].token_ids)
    served.check_episode("r1")
    # previous_response_id: the server keeps the conversation of each response
    again = client.responses.create(model="m", input=[{"role": "user", "content": "And 7*6?"}],
                                    tools=[RESPONSES_TOOL], previous_response_id=events[-1].response.id)
    third = served.proxy.session("r1").calls[2]
    assert third.messages[-1] == {"role": "user", "content": "And 7*6?"} and third.base_len is not None
    assert again.output_text == "The answer is 42."


def test_responses_stream_sends_function_call_events(served):
    body = {"model": "m", "input": QUESTION["prompt"], "tools": [RESPONSES_TOOL], "stream": True}
    events = _sse(httpx.post(f"{served.url}/v1/responses", json=body).text)
    names = [name for name, _ in events]
    added = [d for n, d in events if n == "response.output_item.added"]
    assert [d["item"]["type"] for d in added] == ["function_call"]
    [delta] = [d["delta"] for n, d in events if n == "response.function_call_arguments.delta"]
    assert json.loads(delta) == {"expression": "6*7"}
    assert names.index("response.function_call_arguments.done") < names.index("response.output_item.done")
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))


# ---- tools as coding-agent harnesses declare them (turnrl.serve.tools) -----------------------------------
def _calls(name: str, arguments: dict):
    """A script that calls `name` first and answers once its result came back."""
    call = "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
    return lambda rid, turn, prompt: "The answer is 42." if "<tool_response>" in prompt else call


NAMESPACED = {"type": "namespace", "name": "math_v1", "description": "Arithmetic tools.",
              "tools": [RESPONSES_TOOL]}


def test_a_namespace_tool_is_flattened_and_its_calls_go_back_under_the_namespace(qwen3_tokenizer, caplog):
    """Codex's shape: the model sees `math_v1__calculator`, never the hosted web_search; its call goes back as
    `calculator` in namespace `math_v1` (and so streamed); echoed back that way, it continues the recorded tokens.
    The hosted tool is named in the log once per session and in each call's notes."""
    served = Served(qwen3_tokenizer, _calls("math_v1__calculator", {"expression": "6*7"}))
    try:
        body = {"model": "m", "input": QUESTION["prompt"], "tools": [NAMESPACED, {"type": "web_search"}]}
        with caplog.at_level("WARNING", logger="turnrl.serve.sessions"):
            first = httpx.post(f"{served.url}/sessions/ns/v1/responses", json=body).json()
            [item] = first["output"]
            assert (item["type"], item["name"], item["namespace"]) == ("function_call", "calculator", "math_v1")
            prompt = qwen3_tokenizer.decode(served.engine.calls[0].prompt_ids)
            assert '"name": "math_v1__calculator"' in prompt and "web_search" not in prompt
            follow_up = {**body, "stream": True, "input": [{"role": "user", "content": QUESTION["prompt"]}, item,
                                                           {"type": "function_call_output", "call_id": item["call_id"],
                                                            "output": "42"}]}
            events = _sse(httpx.post(f"{served.url}/sessions/ns/v1/responses", json=follow_up).text)
        assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == "The answer is 42."
        served.check_episode("ns")
        calls = served.proxy.session("ns").calls
        assert calls[1].base_len is not None and [c.notes["tools_not_offered"] for c in calls] == [["web_search"]] * 2
        assert len([r for r in caplog.records if "not offered to the model" in r.getMessage()]) == 1
        streamed = _sse(httpx.post(f"{served.url}/sessions/ns2/v1/responses", json={**body, "stream": True}).text)
        [added] = [d["item"] for n, d in streamed if n == "response.output_item.added"]
        assert (added["name"], added["namespace"]) == ("calculator", "math_v1")
    finally:
        served.stop()


PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"


def test_a_custom_tool_takes_free_form_input_in_the_responses_api(qwen3_tokenizer):
    served = Served(qwen3_tokenizer, _calls("apply_patch", {"input": PATCH}))
    try:
        tools = [{"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
                  "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}]
        body = {"model": "m", "input": QUESTION["prompt"], "tools": tools}
        [item] = httpx.post(f"{served.url}/sessions/c1/v1/responses", json=body).json()["output"]
        assert (item["type"], item["name"], item["input"]) == ("custom_tool_call", "apply_patch", PATCH)
        assert '"input": {"type": "string"' in qwen3_tokenizer.decode(served.engine.calls[0].prompt_ids)
        follow_up = {**body, "input": [{"role": "user", "content": QUESTION["prompt"]}, item,
                                       {"type": "custom_tool_call_output", "call_id": item["call_id"], "output": "42"}]}
        answer = httpx.post(f"{served.url}/sessions/c1/v1/responses", json=follow_up).json()
        assert answer["output"][0]["content"][0]["text"] == "The answer is 42."
        served.check_episode("c1")
        events = _sse(httpx.post(f"{served.url}/sessions/c2/v1/responses", json={**body, "stream": True}).text)
        assert [d["delta"] for n, d in events if n == "response.custom_tool_call_input.delta"] == [PATCH]
        [done] = [d["item"] for n, d in events if n == "response.output_item.done"]
        assert (done["type"], done["input"]) == ("custom_tool_call", PATCH)
    finally:
        served.stop()


def test_a_custom_tool_in_chat_completions(served):
    served.engine.script = _calls("apply_patch", {"input": PATCH})
    tools = [{"type": "custom", "custom": {"name": "apply_patch", "description": "Apply a patch."}}]
    messages = [{"role": "user", "content": QUESTION["prompt"]}]
    reply = httpx.post(f"{served.url}/sessions/cc/v1/chat/completions",
                       json={"model": "m", "messages": messages, "tools": tools}).json()["choices"][0]["message"]
    [call] = reply["tool_calls"]
    assert call["type"] == "custom" and call["custom"] == {"name": "apply_patch", "input": PATCH}
    follow_up = [*messages, reply, {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
    answer = httpx.post(f"{served.url}/sessions/cc/v1/chat/completions",
                        json={"model": "m", "messages": follow_up, "tools": tools}).json()
    assert answer["choices"][0]["message"]["content"] == "The answer is 42."
    served.check_episode("cc")
    chunks = _sse(httpx.post(f"{served.url}/sessions/cc2/v1/chat/completions",
                             json={"model": "m", "messages": messages, "tools": tools, "stream": True}).text)
    [streamed] = [c["choices"][0]["delta"]["tool_calls"][0] for _, c in chunks
                  if isinstance(c, dict) and c.get("choices") and c["choices"][0]["delta"].get("tool_calls")]
    assert streamed["type"] == "custom" and streamed["custom"]["input"] == PATCH


def test_anthropic_server_and_deferred_tools_are_not_offered_and_system_messages_keep_their_place(served):
    """Claude Code's shapes: a `system` message inside `messages`, a tool with defer_loading, a server tool, and a
    tool result holding a tool_reference (its tool search's answer)."""
    tools = [{"name": "calculator", "description": "Evaluate arithmetic.", "input_schema": {"type": "object"}},
             {"name": "Later", "description": "x", "input_schema": {"type": "object"}, "defer_loading": True},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]
    messages = [{"role": "user", "content": QUESTION["prompt"]}, {"role": "system", "content": "# Environment\ncwd /app"}]
    body = {"model": "m", "max_tokens": 64, "messages": messages, "tools": tools, "thinking": {"type": "adaptive"},
            "context_management": {"edits": []}, "output_config": {"effort": "high"}}
    first = httpx.post(f"{served.url}/sessions/a1/v1/messages", json=body).json()
    [use] = [b for b in first["content"] if b["type"] == "tool_use"]
    prompt = qwen3_tokenizer_text(served, 0)
    assert '"name": "calculator"' in prompt and "Later" not in prompt and "web_search" not in prompt
    assert prompt.index("What is 6*7?") < prompt.index("# Environment")
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": [
        {"type": "text", "text": "42"}, {"type": "tool_reference", "tool_name": "Later"}]}]}
    second = httpx.post(f"{served.url}/sessions/a1/v1/messages",
                        json={**body, "messages": [*messages, {"role": "assistant", "content": first["content"]},
                                                   result]}).json()
    assert second["content"][0]["text"] == "The answer is 42."
    assert "Tool loaded: Later" in qwen3_tokenizer_text(served, 1)
    assert served.proxy.session("a1").calls[1].notes["tools_not_offered"] == ["Later", "web_search"]


def qwen3_tokenizer_text(served: Served, call: int) -> str:
    return served.proxy.renderer.decode(served.engine.calls[call].prompt_ids)


# ---- LangGraph -----------------------------------------------------------------------------------------
async def test_langgraph_react_agent_and_its_streaming_version(served):
    pytest.importorskip("langgraph")
    agent = _load("langgraph_agent")
    assert await agent.run(f"{served.url}/sessions/lg/v1", "k", QUESTION) == 1.0
    assert await agent.run_streaming(f"{served.url}/sessions/lg-stream/v1", "k", QUESTION) == 1.0
    for session in ("lg", "lg-stream"):
        assert served.check_episode(session).num_turns == 2


# ---- the OpenAI Agents SDK -----------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["run", "run_chat_completions", "run_streamed"])
async def test_openai_agents_sdk(served, entry):
    """Its default model (Responses API), its chat-completions model, and Runner.run_streamed, at the root URL."""
    pytest.importorskip("agents")
    agent = _load("agents_sdk_agent")
    assert await getattr(agent, entry)(f"{served.url}/v1", "k", QUESTION) == 1.0
    traj = served.check_episode(served.only_session())
    assert traj.num_turns == 2 and "Use the calculator tool" in served.engine.tokenizer.decode(traj.prompt_ids)


# ---- Anthropic Messages --------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["run", "run_streaming"])
async def test_anthropic_client_messages_and_tool_use(served, entry):
    agent = _load("anthropic_agent")
    assert await getattr(agent, entry)(f"{served.url}/sessions/a1/v1", "k", QUESTION) == 1.0
    traj = served.check_episode("a1")
    assert traj.num_turns == 2


def test_anthropic_stream_events(served):
    client = anthropic.Anthropic(base_url=served.url, api_key="k", max_retries=0)
    agent = _load("anthropic_agent")
    with client.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "6*7?"}],
                                tools=agent.TOOLS) as stream:
        events = list(stream)
        message = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["tool_use"]
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    [block] = message.content
    assert (block.name, block.input, message.stop_reason) == ("calculator", {"expression": "6*7"}, "tool_use")
    assert message.usage.output_tokens == len(served.engine.outputs[0].token_ids)


def test_errors_come_in_each_apis_own_shape(served):
    anthropic_error = httpx.post(f"{served.url}/v1/messages", json={"model": "m", "messages": []})
    assert anthropic_error.status_code == 400
    assert anthropic_error.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: field required"}}
    client = anthropic.Anthropic(base_url=served.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    openai_error = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": [], "model": "m"}).json()
    assert set(openai_error["error"]) == {"message", "type", "param", "code"}
    assert openai_error["error"]["param"] == "messages"


# ---- routes: every URL form answers itself, unknown ones say what exists ---------------------------------
def test_no_route_falls_into_another(served):
    url = served.url
    # this was a 405: the session DELETE route caught every path under /sessions/
    assert httpx.post(f"{url}/sessions/x/v1/responses", json={"model": "m", "input": "hi"}).status_code == 200
    wrong = httpx.delete(f"{url}/sessions/x/v1/responses")
    assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
    assert httpx.get(f"{url}/sessions/x").json()["calls"] == 1
    for method, path in [("POST", "/v1/embeddings"), ("GET", "/v2/models"), ("POST", "/sessions/x/v1/embeddings"),
                         ("GET", "/sessions/x/v1")]:
        response = httpx.request(method, f"{url}{path}")
        assert response.status_code == 404, path
        message = response.json()["error"]["message"]
        assert f"no route {method} {path}" in message and "POST /v1/chat/completions" in message
        assert "POST /sessions/<id>/v1/responses" in message
    gone = httpx.post(f"{url}/sessions/x/v1/messagesx", json={})
    assert gone.status_code == 404
    assert httpx.get(f"{url}/v1/chat/completions").status_code == 405
    assert httpx.get(f"{url}/sessions/nope").status_code == 404
    assert httpx.delete(f"{url}/sessions/x").json() == {"ok": True, "calls": 1}


# ---- rewards from outside and the idle TTL ---------------------------------------------------------------
def test_posted_rewards_scalar_and_per_turn(served):
    agent = _load("agent")
    for session in ("scalar", "per-turn"):
        asyncio.run(agent.run(f"{served.url}/sessions/{session}/v1", "k", QUESTION))
    assert httpx.post(f"{served.url}/sessions/scalar/reward", json={"reward": 0.5}).json()["status"] == "finished"
    [traj] = served.trajectories("scalar")
    assert (traj.reward, traj.turn_rewards) == (0.5, [])
    wrong = httpx.post(f"{served.url}/sessions/per-turn/reward", json={"reward": [1.0]})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "reward"
    assert "1 per-turn rewards for 2 model calls" in wrong.json()["error"]["message"]
    for bad in ({"reward": "high"}, {"reward": None}, {"reward": [1, "x"]}, {"score": 1}, {"reward": 1, "done": "y"}):
        response = httpx.post(f"{served.url}/sessions/per-turn/reward", json=bad)
        assert response.status_code == 400, bad
    httpx.post(f"{served.url}/sessions/per-turn/reward", json={"reward": [0.25, 1.0]})
    [traj] = served.trajectories("per-turn")
    assert (traj.reward, traj.turn_rewards) == (1.25, [0.25, 1.0])
    listed = {s["id"]: (s["status"], s["reward"]) for s in served.sessions()}
    assert listed == {"scalar": ("finished", 0.5), "per-turn": ("finished", 1.25)}
    assert sorted(served.engine.released) == ["per-turn", "scalar"]
    late = httpx.post(f"{served.url}/sessions/scalar/v1/chat/completions",
                      json={"model": "m", "messages": [{"role": "user", "content": "more?"}]})
    assert late.status_code == 409 and "finished" in late.json()["error"]["message"]
    assert httpx.post(f"{served.url}/sessions/none/reward", json={"reward": 1}).status_code == 404


def test_a_reward_in_the_final_calls_metadata_finishes_the_episode(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="k", max_retries=0)
    agent = _load("agent")
    messages = [{"role": "user", "content": QUESTION["prompt"]}]
    first = client.chat.completions.create(model="m", messages=messages, tools=agent.TOOLS, user="meta")
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "42"}]
    client.chat.completions.create(model="m", messages=messages, tools=agent.TOOLS, user="meta",
                                   metadata={"reward": "1.0"})  # OpenAI's metadata values are strings
    [session] = served.sessions()
    assert (session["status"], session["reward"], session["calls"]) == ("finished", 1.0, 2)
    assert served.check_episode("meta").reward == 1.0


def test_idle_sessions_are_aborted_with_a_reason(qwen3_tokenizer):
    served = Served(qwen3_tokenizer, session_ttl_s=0.3)
    try:
        client = openai.OpenAI(base_url=f"{served.url}/sessions/idle/v1", api_key="k", max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert served.sessions()[0]["status"] == "open"
        time.sleep(0.5)
        [session] = served.sessions()
        assert session["status"] == "aborted" and "idle for" in session["end_reason"]
        assert "session_ttl_s=0.3" in session["end_reason"] and served.engine.released == ["idle"]
        [traj] = served.trajectories("idle")
        assert (traj.status, traj.termination_reason) == (RolloutStatus.ABORTED, TerminationReason.CANCELLED)
        assert "idle for" in traj.error
    finally:
        served.stop()


# ---- training them: `turnrl train` with the Agents SDK and Anthropic agents (slow) ------------------------
WRAPPER = '''
import sys
sys.path.insert(0, {examples!r})
from {module} import {entry} as agent_run


async def run(base_url, api_key, sample):
    await agent_run(base_url, api_key, sample)
    return None  # scored by reward.function: the random tiny model never answers right, so rewards would not vary


def by_length(response: str) -> float:
    return float(len(response))
'''


@pytest.mark.slow
@pytest.mark.parametrize(("module", "entry"), [("agents_sdk_agent", "run_streamed"),
                                               ("anthropic_agent", "run_streaming")])
def test_turnrl_train_trains_the_agents_sdk_and_anthropic_agents(tmp_path, module, entry):
    import subprocess
    import sys

    agent = tmp_path / "agent.py"
    agent.write_text(WRAPPER.format(examples=str(EXAMPLES), module=module, entry=entry))
    out = tmp_path / "run"
    turnrl = str(Path(sys.executable).with_name("turnrl"))
    result = subprocess.run(
        [turnrl, "train", str(EXAMPLES / "config.yaml"), f"rollout.env_config.openai_agent={agent}:run",
         f"reward.function={agent}:by_length", f"run_dir={out}", "steps=1", "prompts_per_step=2", "rollout.n=2",
         "rollout.max_new_tokens=24"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [step] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert step["rollout/trajectories"] == 4.0 and step["train/samples"] > 0 and "train/loss" in step
    rows = [json.loads(line) for line in (out / "trajectories" / "last_step.jsonl").read_text().splitlines()]
    for row in rows:
        traj = Trajectory.from_json(row)
        traj.validate()
        assert traj.agent == "openai_agent" and traj.status != RolloutStatus.FAILED, traj.error
        model = [s for s in traj.segments if s.source == MODEL]
        assert model and all(s.loss_mask == [1] * len(s) and len(s.logprobs) == len(s) for s in model)
        assert traj.reward == float(len(traj.messages[-1]["content"] or ""))



THINKING = "<think>\nI multiply six by seven.\n</think>\n\nThe answer is 42."


def test_reasoning_streams_apart_from_the_answer_in_each_api(qwen3_tokenizer):
    served = Served(qwen3_tokenizer, script=lambda rid, turn, text: THINKING)
    try:
        chat = {"model": "m", "messages": [{"role": "user", "content": "6*7?"}], "stream": True}
        events = _sse(httpx.post(f"{served.url}/sessions/c/v1/chat/completions", json=chat).text)[:-1]
        deltas = [d["choices"][0]["delta"] for _, d in events if d["choices"]]
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        assert (reasoning, content) == ("I multiply six by seven.", "The answer is 42.")
        reply = served.proxy.session("c").calls[0].reply
        assert (reply["reasoning_content"], reply["content"]) == (reasoning, content)
        client = anthropic.Anthropic(base_url=f"{served.url}/sessions/a", api_key="k",
                                     max_retries=0)
        with client.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "6*7?"}]) as s:
            message = s.get_final_message()
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
            ("thinking", "I multiply six by seven."), ("text", "The answer is 42.")]
        response = openai.OpenAI(base_url=f"{served.url}/v1", api_key="k", max_retries=0).responses.create(
            model="m", input="6*7?")
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output_text == "The answer is 42."
    finally:
        served.stop()


def test_a_history_rewrite_starts_a_new_trajectory_of_the_episode(served):
    """An Anthropic client that rewrites its first message: the second call is rendered afresh, a new trajectory
    of the same episode whose only mask-1 tokens are the engine's, never the old reply re-tokenised."""
    client = anthropic.Anthropic(base_url=f"{served.url}/sessions/rw", api_key="k", max_retries=0)
    tools = _load("anthropic_agent").TOOLS
    first = client.messages.create(model="m", max_tokens=64, tools=tools,
                                   messages=[{"role": "user", "content": QUESTION["prompt"]}])
    rewritten = [{"role": "user", "content": "What is 6 times 7?"},
                 {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[0].id,
                                               "content": "42"}]}]
    client.messages.create(model="m", max_tokens=64, tools=tools, messages=rewritten)
    main, split = served.trajectories("rw")
    assert (main.id, split.id, split.episode_id) == ("rw", "rw.1", "rw")
    assert split.parent is not None and (split.parent.id, split.parent.kind) == ("rw", BranchKind.FORK)
    assert split.prompt_ids == served.engine.calls[1].prompt_ids
    assert [(s.source, s.token_ids) for s in split.segments] == [(MODEL, served.engine.outputs[1].token_ids)]
    assert served.proxy.session("rw").calls[1].base_len is None


def test_a_history_rewritten_mid_episode_gives_one_episode_tree(served):
    """A tool loop whose tool result is rewritten and retried after the answer (a fork at the first token the two
    histories differ in), with a sub-agent (named by a header) spawned while the first call waits on its tool:
    one episode tree, every branch self-contained, one reward."""
    client = openai.OpenAI(base_url=f"{served.url}/sessions/tree/v1", api_key="k", max_retries=0)
    agent = _load("agent")
    messages = [{"role": "system", "content": agent.SYSTEM}, {"role": "user", "content": QUESTION["prompt"]}]
    first = client.chat.completions.create(model="m", messages=messages, tools=agent.TOOLS)
    call = first.choices[0].message
    sub = [{"role": "system", "content": agent.SYSTEM}, {"role": "user", "content": "The calculator said 42. Answer?"}]
    client.chat.completions.create(model="m", messages=sub, extra_headers={"X-Turnrl-Subagent": "explorer"})
    history = [*messages, call.model_dump(exclude_none=True)]
    client.chat.completions.create(model="m", tools=agent.TOOLS, messages=[
        *history, {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "42"}])
    retried = [*history, {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "41"}]
    client.chat.completions.create(model="m", tools=agent.TOOLS, messages=retried)
    httpx.post(f"{served.url}/sessions/tree/reward", json={"reward": 1.0}).raise_for_status()

    main, subagent, fork = trajs = served.trajectories("tree")
    assert [t.id for t in trajs] == ["tree", "tree.1", "tree.2"] and main.parent is None
    assert {t.episode_id for t in trajs} == {"tree"} and {t.reward for t in trajs} == {1.0}
    for traj in trajs:
        traj.validate()
    assert main.num_turns == 2 and fork.num_turns == 1 and subagent.num_turns == 1
    # the fork: both streams hold the same tokens up to parent.at, the tool result's first differing token
    assert (fork.parent.id, fork.parent.kind) == ("tree", BranchKind.FORK)
    at = fork.parent.at
    first_call = served.engine.calls[0]
    assert len(first_call.prompt_ids) + len(served.engine.outputs[0].token_ids) < at < len(fork.prompt_ids)
    assert main.stream[:at] == fork.stream[:at] and main.stream[at] != fork.stream[at]
    assert served.engine.tokenizer.decode(main.stream[at:at + 1]) == "2"
    assert served.engine.tokenizer.decode(fork.stream[at:at + 1]) == "1"
    # the sub-agent: a branch of the trajectory whose tool call was pending, its header recorded
    assert (subagent.parent.id, subagent.parent.kind) == ("tree", BranchKind.SUBAGENT)
    assert subagent.parent.at == common_prefix(main.stream, subagent.stream)
    assert subagent.turns[0].extra["subagent"] == {"kind": "explorer"}


def test_codex_subagent_headers_mark_a_call():
    from turnrl.serve.chat_routes import subagent_of

    meta = json.dumps({"thread_source": "subagent", "subagent_kind": "thread_spawn", "parent_thread_id": "p"})
    assert subagent_of({"x-openai-subagent": "collab_spawn"}, {}) == {"kind": "collab_spawn"}
    assert subagent_of({}, {"client_metadata": {"x-codex-turn-metadata": meta}}) == {
        "kind": "thread_spawn", "parent_thread_id": "p"}
    assert subagent_of({"x-codex-turn-metadata": json.dumps({"turn_id": "t"})}, {}) is None
    assert subagent_of({"x-openai-subagent": "false", "x-codex-turn-metadata": "not json"}, {}) is None


def test_the_training_gateway_serves_only_the_sessions_it_opened(qwen3_tokenizer):
    served = Served(qwen3_tokenizer, create_sessions=False)
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        root = httpx.post(f"{served.url}/v1/chat/completions", json=body)
        assert root.status_code == 404 and "/sessions/<id>/v1" in root.json()["error"]["message"]
        assert httpx.post(f"{served.url}/sessions/x/v1/chat/completions", json=body).status_code == 404
        assert served.sessions() == [] and not served.engine.calls
    finally:
        served.stop()


# ---- stop strings ----------------------------------------------------------------------------------------
REACT_REPLY = "Thought: check.\nObservation: sunny"  # Qwen3 tokens: Thought : ␣check .\n Observ ation : ␣sunny


@pytest.mark.parametrize(("stop", "text", "kept"), [
    (["Observation:", "Calling tools:"], "Thought: check.\n", 7),  # smolagents' stops: three tokens, the 7th ends it
    (["\n"], "Thought: check.", 4),  # inside the token ".\n"
])
def test_stop_strings_of_any_length_end_the_reply_before_them(qwen3_tokenizer, stop, text, kept):
    """OpenAI's semantics: the reply stops before the stop string, finish_reason stop; the recorded completion is
    the engine's tokens (and logprobs) through the one that completed it; Anthropic reports the string."""
    served = Served(qwen3_tokenizer, script=lambda rid, turn, prompt: REACT_REPLY)
    try:
        hello = [{"role": "user", "content": "weather?"}]
        client = openai.OpenAI(base_url=f"{served.url}/sessions/s1/v1", api_key="k", max_retries=0)
        choice = client.chat.completions.create(model="m", messages=hello, stop=stop).choices[0]
        assert (choice.message.content, choice.finish_reason) == (text, "stop")
        streamed = client.chat.completions.create(model="m", messages=hello, stop=stop, stream=True)
        deltas = [c.choices[0].delta.content or "" for c in streamed if c.choices]
        assert "".join(deltas) == text
        claude = anthropic.Anthropic(base_url=f"{served.url}/sessions/s2", api_key="k", max_retries=0)
        message = claude.messages.create(model="m", max_tokens=64, messages=hello, stop_sequences=stop)
        assert (message.content[0].text, message.stop_reason, message.stop_sequence) == (
            text, "stop_sequence", stop[0])
        for session in ("s1", "s2"):
            for call in served.proxy.session(session).calls:
                whole = served.engine.outputs[0]
                assert call.completion_ids == whole.token_ids[:kept] and call.logprobs == whole.logprobs[:kept]
                assert call.stop == stop[0] and call.finish_reason == "stop"
        [traj] = served.trajectories("s2")
        assert traj.response_ids == served.engine.outputs[0].token_ids[:kept]
        assert traj.segments[0].loss_mask == [1] * kept
    finally:
        served.stop()


def test_a_stream_holds_back_what_may_begin_a_stop_string(qwen3_tokenizer):
    """Token by token, no chunk carries text of the stop string, even its first part ("Observ")."""
    served = Served(qwen3_tokenizer, script=lambda rid, turn, prompt: REACT_REPLY)
    chunks: list[str] = []
    stream = ReplyStream(served.proxy.renderer, None, None, lambda kind, delta: chunks.append(delta), ["Observation:"])
    try:
        for token in qwen3_tokenizer(REACT_REPLY, add_special_tokens=False)["input_ids"]:
            stream.push(token)
            assert "Obs" not in "".join(chunks)
        assert "".join(chunks) == "Thought: check."  # the trailing newline waits for the end, as the reply strips
    finally:
        served.stop()


async def test_the_embedded_engine_stops_as_soon_as_a_stop_string_appears(tiny_qwen3, qwen3_tokenizer):
    """A real engine: the call ends at the stop string (far fewer tokens generated than max_tokens), and its
    recorded tokens are the greedy continuation up to the token that completed it."""
    renderer = ChatRenderer(qwen3_tokenizer)
    engine = EmbeddedEngine(tiny_qwen3, eos_token_ids=sorted(renderer.end_of_turn_ids))
    proxy = ChatProxy(engine, renderer)
    hello = [{"role": "user", "content": "Tell me a story."}]
    try:
        free = await chat_completion(proxy, "free", {"messages": hello, "temperature": 0, "max_tokens": 64})
        ids = proxy.session("free").calls[0].completion_ids
        assert len(ids) == 64, "the tiny model must not end its turn by itself here"
        stop = renderer.decode(ids[10:13])  # three tokens from the middle
        assert free["choices"][0]["message"]["content"].count(stop) >= 1
        before = engine.stats["generated_tokens"]
        answer = await chat_completion(proxy, "stopped", {"messages": hello, "temperature": 0, "max_tokens": 64,
                                                         "stop": [stop]})
        [call] = proxy.session("stopped").calls
        whole = renderer.decode(ids)
        assert answer["choices"][0]["message"]["content"] == whole[: whole.index(stop)]
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert call.completion_ids == ids[: len(call.completion_ids)] and len(call.completion_ids) <= 13
        assert engine.stats["generated_tokens"] - before <= len(call.completion_ids) + 2
    finally:
        engine.close()


# ---- the other endpoints standard clients call -------------------------------------------------------------
def test_models_retrieve_and_count_tokens_for_both_sdks(served):
    for base in (served.url, f"{served.url}/sessions/m1"):
        assert openai.OpenAI(base_url=f"{base}/v1", api_key="k").models.retrieve("policy").id == "policy"
        claude = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0)
        assert claude.models.retrieve("policy").id == "policy"
        hello = [{"role": "user", "content": "Hi"}]
        counted = claude.messages.count_tokens(model="m", messages=hello, system="Be brief.")
        expected = served.proxy.renderer.initial_ids([{"role": "system", "content": "Be brief."}, *hello])
        assert counted.input_tokens == len(expected)
    error = httpx.post(f"{served.url}/v1/messages/count_tokens", json={"messages": []})
    assert error.status_code == 400 and error.json()["type"] == "error"  # Anthropic's shape
    assert served.sessions() == []  # counting opens no session


def test_legacy_text_completions_raw_prompt_stop_and_stream(qwen3_tokenizer):
    """`completions.create`: the prompt's own tokens (no chat template), OpenAI's fields; nothing is recorded."""
    served = Served(qwen3_tokenizer, script=lambda rid, turn, prompt: REACT_REPLY)
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="k", max_retries=0)
        done = client.completions.create(model="m", prompt="Question: weather?\n", max_tokens=32,
                                         stop=["Observation:"], logprobs=0)
        assert served.engine.calls[0].prompt_ids == qwen3_tokenizer("Question: weather?\n")["input_ids"]
        [choice] = done.choices
        assert (choice.text, choice.finish_reason) == ("Thought: check.\n", "stop")
        assert choice.logprobs.token_logprobs == served.engine.outputs[0].logprobs[:7]
        assert done.usage.completion_tokens == 7
        chunks = list(client.completions.create(model="m", prompt=["Hi"], max_tokens=32, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == REACT_REPLY
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(served.engine.outputs[1].token_ids)
        assert served.sessions() == []
        with pytest.raises(openai.BadRequestError, match="echo"):
            client.completions.create(model="m", prompt="Hi", echo=True)
    finally:
        served.stop()


def test_any_session_id_fits_the_header_and_control_characters_are_refused_first(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="k", max_retries=0)
    hello = [{"role": "user", "content": "hi"}]
    raw = client.chat.completions.with_raw_response.create(model="m", messages=hello, user="用户-42%")
    assert raw.headers["x-session-id"] == "%E7%94%A8%E6%88%B7-42%25" and unquote(raw.headers["x-session-id"]) == "用户-42%"
    assert served.proxy.session("用户-42%").calls
    per_session = openai.OpenAI(base_url=f"{served.url}/sessions/{quote('会话')}/v1", api_key="k", max_retries=0)
    assert per_session.chat.completions.with_raw_response.create(model="m", messages=hello).headers[
        "x-session-id"] == quote("会话")
    calls = len(served.engine.calls)
    for where, kwargs in [("user", {"user": "line1\r\nline2"}),
                          ("metadata.session_id", {"metadata": {"session_id": "a\x00b"}})]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="m", messages=hello, **kwargs)
        assert refused.value.body["param"] == where
    assert len(served.engine.calls) == calls  # refused before the model ran


def test_streamed_chat_sends_usage_only_when_asked_in_a_last_chunk(served):
    """OpenAI's protocol (autogen reads finish_reason from the chunks without usage)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    plain = [d for _, d in _sse(httpx.post(f"{served.url}/v1/chat/completions", json=body).text)[:-1]]
    assert not any(d.get("usage") for d in plain) and plain[-1]["choices"][0]["finish_reason"] == "stop"
    body["stream_options"] = {"include_usage": True}
    asked = [d for _, d in _sse(httpx.post(f"{served.url}/v1/chat/completions", json=body).text)[:-1]]
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] > 0
    assert not any(d.get("usage") for d in asked[:-1]) and asked[-2]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_streamed_and_top_p_zero_is_the_most_likely_token(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="k", max_retries=0)
    hello = [{"role": "user", "content": "hi"}]
    chunks = list(client.chat.completions.create(model="m", messages=hello, logprobs=True, stream=True))
    streamed = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == served.engine.outputs[0].logprobs
    client.chat.completions.create(model="m", messages=hello, top_p=0, user="greedy")
    params = served.engine.calls[-1].params
    assert (params.top_p, params.top_k) == (1.0, 1)


def test_anthropic_assistant_prefill_is_continued(qwen3_tokenizer):
    """Anthropic's prefill: a last assistant message of text is continued (its turn left open), and the reply is
    the continuation only."""
    served = Served(qwen3_tokenizer, script=lambda rid, turn, prompt: ' {"name": "Bob"}')
    try:
        claude = anthropic.Anthropic(base_url=f"{served.url}/sessions/p1", api_key="k", max_retries=0)
        message = claude.messages.create(model="m", max_tokens=32, messages=[
            {"role": "user", "content": "JSON please"}, {"role": "assistant", "content": "Here:"}])
        assert message.content[0].text == ' {"name": "Bob"}' and message.stop_reason == "end_turn"
        prompt = qwen3_tokenizer.decode(served.engine.calls[0].prompt_ids)
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nHere:"), prompt
        assert prompt.count("<|im_start|>assistant") == 1
    finally:
        served.stop()
