"""`turnrl serve` against bad input: every client error is a 4xx naming the field, a bad request never reaches a
batch (nor fails the good ones beside it), bodies are bounded before they are read, a long conversation is
tokenised off the event loop, and `max_new_tokens` is capped by the context. A real engine (tiny Qwen3) behind
the real app on 127.0.0.1; bench/serve_inputs.py fires the same matrix at a `turnrl serve` process."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from test_serve import RecordingEngine, calculator_script

from turnrl.engines.embedded import EmbeddedEngine
from turnrl.render import ChatRenderer
from turnrl.serve.app import ServerThread, create_app
from turnrl.serve.sessions import ChatProxy

CONTEXT = 96


@pytest.fixture(scope="module")
def live(tiny_qwen3, qwen3_tokenizer):
    """The embedded engine over tiny Qwen3 with a short context, served with the chat proxy."""
    renderer = ChatRenderer(qwen3_tokenizer)
    engine = EmbeddedEngine(tiny_qwen3, eos_token_ids=sorted(renderer.end_of_turn_ids), max_context=CONTEXT,
                            max_batch_size=16)
    server = ServerThread(create_app(engine, ChatProxy(engine, renderer)))
    url = server.start()
    yield url, engine, renderer
    server.stop()
    engine.close()


def _generate(prompt_ids=(1, 2, 3), request_id="r", **sampling):
    return {"prompt_ids": list(prompt_ids), "request_id": request_id,
            "sampling": {"temperature": 0.0, "max_new_tokens": 4, **sampling}}


GENERATE_ERRORS = [  # (name, body, the field the error must name)
    ("string temperature", _generate(temperature="x"), "sampling.temperature"),
    ("NaN temperature", _generate(temperature=float("nan")), "sampling.temperature"),
    ("string max_new_tokens", _generate(max_new_tokens="5"), "sampling.max_new_tokens"),
    ("max_new_tokens [1]", _generate(max_new_tokens=[1]), "sampling.max_new_tokens"),
    ("seed 'x'", _generate(seed="x"), "sampling.seed"),
    ("stop_token_ids 5", _generate(stop_token_ids=5), "sampling.stop_token_ids"),
    ("top_k 'x'", _generate(top_k="x"), "sampling.top_k"),
    ("unknown sampling field", _generate(temprature=1.0), "sampling.temprature"),
    ("empty prompt", _generate(prompt_ids=()), "prompt_ids"),
    ("negative id", _generate(prompt_ids=(-1, 2)), "prompt_ids"),
    ("boolean id", _generate(prompt_ids=(True, 2)), "prompt_ids"),
    ("out-of-vocabulary id", _generate(prompt_ids=(1, 10**7)), "prompt_ids"),
    ("prompt longer than the context", _generate(prompt_ids=[1] * CONTEXT), "prompt_ids"),
    ("images to a text model", {**_generate(), "images": ["a.png"]}, "images"),
    ("images not strings", {**_generate(), "images": [5]}, "images"),
    ("no request_id", {"prompt_ids": [1, 2]}, "request_id"),
    ("sampling not an object", {**_generate(), "sampling": 3}, "sampling"),
]


@pytest.mark.parametrize(("name", "body", "param"), GENERATE_ERRORS, ids=[e[0] for e in GENERATE_ERRORS])
def test_generate_refuses_bad_fields_with_a_422_naming_the_field(live, name, body, param):
    url, engine, _ = live
    before = engine.stats["requests"]
    response = httpx.post(f"{url}/generate", content=json.dumps(body))  # json.dumps writes NaN as JSON's NaN
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split(".")[-1] in error["message"]
    assert engine.stats["requests"] == before  # it never reached a batch


def test_a_body_that_is_not_json_is_a_400(live):
    url, _, _ = live
    for content in (b"{not json", b"[1, 2]", b""):
        response = httpx.post(f"{url}/generate", content=content)
        assert response.status_code == 400 and "JSON object" in response.json()["error"]["message"]


async def test_bad_requests_never_fail_the_good_ones_beside_them(live):
    url, _, _ = live
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        alone = (await client.post("/generate", json=_generate(max_new_tokens=8, request_id="alone"))).json()
        good = [client.post("/generate", json=_generate(max_new_tokens=8, request_id=f"g{i}")) for i in range(10)]
        bad = [client.post("/generate", json=_generate(prompt_ids=(1, 10**7), request_id="oov")),
               client.post("/generate", json=_generate(top_k="x", request_id="k")),
               client.post("/generate", json=_generate(prompt_ids=[5] * CONTEXT, request_id="long"))]
        responses = await asyncio.gather(*bad[:2], *good, bad[2])
    statuses = [r.status_code for r in responses]
    assert statuses == [422, 422] + [200] * 10 + [422]
    assert all(r.json()["token_ids"] == alone["token_ids"] for r in responses[2:12])


def test_max_new_tokens_is_capped_by_the_context_and_says_so(live):
    url, _, _ = live
    body = httpx.post(f"{url}/generate", json=_generate(prompt_ids=range(1, 11), max_new_tokens=10**9,
                                                        temperature=1.0, seed=1)).json()
    room = CONTEXT - 10
    assert body["max_new_tokens"] == room and len(body["token_ids"]) <= room
    assert body["warnings"] == [f"sampling.max_new_tokens=1000000000 capped to {room}: the prompt's 10 tokens "
                                f"leave {room} of the context's {CONTEXT}"]
    within = httpx.post(f"{url}/generate", json=_generate(max_new_tokens=4)).json()
    assert "warnings" not in within


CHAT_ERRORS = [  # (name, body fields over a valid chat request, the field the error must name)
    ("string temperature", {"temperature": "x"}, "temperature"),
    ("NaN temperature", {"temperature": float("nan")}, "temperature"),
    ("max_tokens [1]", {"max_tokens": [1]}, "max_tokens"),
    ("string max_tokens", {"max_tokens": "5"}, "max_tokens"),
    ("seed 'x'", {"seed": "x"}, "seed"),
    ("stop 5", {"stop": 5}, "stop"),
    ("top_p 1.5", {"top_p": 1.5}, "top_p"),
    ("top_logprobs 3 (alternatives are not available)", {"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ("logprobs 'yes'", {"logprobs": "yes"}, "logprobs"),
    ("top_k 'x'", {"top_k": "x"}, "top_k"),
    ("stream 'yes'", {"stream": "yes"}, "stream"),
    ("n 2", {"n": 2}, "n"),
    ("empty messages", {"messages": []}, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("an image to a text model", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content"),
    ("tools not a list of functions", {"tools": "calculator"}, "tools"),
    ("prompt longer than the context", {"messages": [{"role": "user", "content": "word " * CONTEXT}]}, "messages"),
    ("metadata not an object", {"metadata": "x"}, "metadata"),
]


@pytest.mark.parametrize(("name", "fields", "param"), CHAT_ERRORS, ids=[e[0] for e in CHAT_ERRORS])
def test_chat_refuses_bad_fields_with_a_400_naming_the_field(live, name, fields, param):
    url, engine, _ = live
    before = engine.stats["requests"]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    for path in ("/v1/chat/completions", "/sessions/bad-input/v1/chat/completions"):
        response = httpx.post(f"{url}{path}", content=json.dumps(body))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param, error
    assert engine.stats["requests"] == before


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/responses", {"input": 5}, "input"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function"}]}, "tools[0]"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "namespace", "name": "ns"}]}, "tools[0]"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": "x"}, "max_output_tokens"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ("/v1/responses", {"input": "hi", "previous_response_id": ["resp_x"]}, "previous_response_id"),  # was a 500
])
def test_responses_api_refuses_bad_fields(live, path, body, param):
    url, _, _ = live
    response = httpx.post(f"{url}{path}", json={"model": "m", **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize(("fields", "words"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image' block"),
    ({"top_k": "x"}, "top_k"),
    ({"stop_sequences": 5}, "stop_sequences"),
    ({"tools": [{"description": "no name"}]}, "tools[0]"),
])
def test_anthropic_api_refuses_bad_fields_in_its_error_shape(live, fields, words):
    url, _, _ = live
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}
    response = httpx.post(f"{url}/v1/messages", json={k: v for k, v in body.items() if v is not None})
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"]


# ---- bodies: bounded before they are read, parsed and tokenised off the event loop ----------------------
def test_a_body_over_the_limit_gets_a_413_before_it_is_read(qwen3_tokenizer):
    engine = RecordingEngine(qwen3_tokenizer, calculator_script)
    server = ServerThread(create_app(engine, ChatProxy(engine, ChatRenderer(qwen3_tokenizer)), max_body_mb=0.01))
    url = server.start()
    try:
        # headers announcing 100 MB and no body at all: the answer comes at once, without waiting for the body
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000000\r\n\r\n")
            t0 = time.monotonic()
            answer = b""
            while b"}}" not in answer:
                answer += sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 413") and time.monotonic() - t0 < 2
            assert b"over the server's limit of 10485 bytes" in answer and b"--max-body-mb" in answer
        anthropic_shape = httpx.post(f"{url}/v1/messages", content=b"x" * 20_000).json()
        assert anthropic_shape["error"]["type"] == "request_too_large"

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b" " * 4096

        chunked = httpx.post(f"{url}/v1/chat/completions", content=chunks())
        assert chunked.status_code == 413 and chunked.json()["error"]["type"] == "request_too_large"
        small = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(f"{url}/v1/chat/completions", json=small).status_code == 200
    finally:
        server.stop()


class SlowEncodingRenderer(ChatRenderer):
    """Tokenising a long text takes seconds, as it does on a slower machine or for a longer prompt (turnrl's own
    encode got fast enough that a 2 MB body no longer shows where it runs)."""

    def encode(self, text: str) -> list[int]:
        if len(text) > 1_000_000:
            time.sleep(2.0)  # blocking, like the tokenizer: on the event loop it would stall /health
        return super().encode(text)


def test_a_long_conversation_is_tokenised_off_the_event_loop(qwen3_tokenizer):
    engine = RecordingEngine(qwen3_tokenizer, calculator_script)
    server = ServerThread(create_app(engine, ChatProxy(engine, SlowEncodingRenderer(qwen3_tokenizer)),
                                     max_body_mb=64))
    url = server.start()
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "lorem ipsum dolor sit amet " * 80_000}]}
        result = {}
        worker = threading.Thread(target=lambda: result.setdefault(
            "response", httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)))
        worker.start()
        time.sleep(0.3)  # the 2 MB body is in, its tokenisation under way (2 s)
        latencies = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)
        assert worker.is_alive(), "the long request finished before /health was probed; make it longer"
        assert max(latencies) < 0.5, latencies
        worker.join(120)
        assert result["response"].status_code == 200
    finally:
        server.stop()



def test_a_short_conversation_is_prepared_on_the_loop_a_long_one_in_a_thread(qwen3_tokenizer, monkeypatch):
    """INLINE_PREPARE_CHARS: under it a call's prompt is rendered on the event loop (a thread hand-over costs more
    than the work), from it on in a worker thread; images always go to the thread. The record's copies of the
    messages are deep (the caller's later edits do not reach it), equal to a deepcopy."""
    import copy

    from turnrl.serve import sessions
    from turnrl.serve.payload import INLINE_PREPARE_CHARS, copied, text_size

    threads = []
    real = asyncio.to_thread
    monkeypatch.setattr(sessions.asyncio, "to_thread", lambda fn, *a: threads.append(fn) or real(fn, *a))
    engine = RecordingEngine(qwen3_tokenizer, calculator_script)
    proxy = ChatProxy(engine, ChatRenderer(qwen3_tokenizer))

    async def call(text: str) -> None:
        session = proxy.resolve(None, "", [{"role": "user", "content": text}])
        chat = sessions.ChatCall(messages=[{"role": "user", "content": text}])
        await proxy.complete(session, chat)

    asyncio.run(call("What is 2 + 2?"))
    assert threads == []
    asyncio.run(call("x " * INLINE_PREPARE_CHARS))
    assert len(threads) == 1
    image = {"role": "user", "content": [{"type": "image", "image": object()}, {"type": "text", "text": "hi"}]}
    assert text_size([image], 100) == 100 and text_size([{"role": "user", "content": "abc"}], 100) == 7
    messages = [{"role": "assistant", "content": "a", "tool_calls": [{"function": {"name": "f", "arguments": {
        "x": [1, 2.5, None, True]}}}]}, image]
    copied_messages = copied(messages)
    assert copied_messages == copy.deepcopy(messages)[:1] + [copied_messages[1]]
    assert copied_messages[1]["content"][1] == image["content"][1]
    messages[0]["tool_calls"][0]["function"]["arguments"]["x"].append(3)
    messages[1]["content"][1]["text"] = "changed"
    assert copied_messages[0]["tool_calls"][0]["function"]["arguments"]["x"] == [1, 2.5, None, True]
    assert copied_messages[1]["content"][1]["text"] == "hi"
    assert copied_messages[1]["content"][0]["image"] is not image["content"][0]["image"]  # deepcopy'd


def test_a_streamed_request_the_engine_refuses_is_an_http_error_not_a_broken_stream(live):
    url, _, _ = live
    body = {"model": "m", "messages": [{"role": "user", "content": "word " * CONTEXT}], "stream": True}
    response = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    anthropic_body = {"model": "m", "max_tokens": 8, "stream": True, "messages": body["messages"]}
    refused = httpx.post(f"{url}/v1/messages", json=anthropic_body)
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"


def test_head_cors_preflight_and_allow(qwen3_tokenizer):
    """HEAD answers like GET without a body; a browser's CORS preflight passes without the token (the request after
    it still needs one); OPTIONS on a session form lists that form's methods."""
    engine = RecordingEngine(qwen3_tokenizer, calculator_script)
    server = ServerThread(create_app(engine, ChatProxy(engine, ChatRenderer(qwen3_tokenizer)), token="s3cret"))
    url = server.start()
    auth = {"Authorization": "Bearer s3cret"}
    try:
        for path in ("/health", "/v1/models", "/sessions/s1/v1/models"):
            head, get = httpx.head(url + path, headers=auth), httpx.get(url + path, headers=auth)
            assert (head.status_code, head.content) == (200, b"") and get.status_code == 200
            assert head.headers["content-type"] == get.headers["content-type"]
        preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        for path in ("/v1/chat/completions", "/v1/messages", "/sessions/s1/v1/responses"):
            answer = httpx.options(url + path, headers=preflight)
            assert answer.status_code == 200, answer.text
            assert answer.headers["access-control-allow-origin"] == "*"
            assert "authorization" in answer.headers["access-control-allow-headers"].lower()
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        origin = {"Origin": "http://localhost:3000"}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, headers=origin).status_code == 401
        done = httpx.post(f"{url}/v1/chat/completions", json=body, headers={**origin, **auth})
        assert done.status_code == 200 and done.headers["access-control-allow-origin"] == "*"
        assert "x-session-id" in done.headers["access-control-expose-headers"].lower()
        allow = httpx.options(f"{url}/sessions/s1/v1/responses", headers=auth)
        assert (allow.status_code, allow.headers["allow"]) == (204, "POST, OPTIONS")
        wrong = httpx.delete(f"{url}/sessions/s1/v1/responses", headers=auth)
        assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
    finally:
        server.stop()
