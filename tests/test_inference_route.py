"""vLLM's token-in, token-out route on `turnrl serve` (`POST [/sessions/<id>]/inference/v1/generate`, what a
verifiers v1 env server's train client calls): the answer's shape, each call recorded token-exactly in its
session (the session named by path or X-Session-Id, or continued by its token stream), and the sampling fields
it honours, ignores and refuses. A scripted engine with the real Qwen3 tokenizer; the verifiers client itself
calls this route in tests/test_verifiers.py (its own venv)."""

from __future__ import annotations

import httpx
import pytest
from fakes import ScriptedEngine

from turnrl.engines.base import InvalidRequest
from turnrl.render import ChatRenderer
from turnrl.serve.app import ServerThread, create_app
from turnrl.serve.sessions import ChatProxy
from turnrl.types import SamplingParams, SegmentSource


def _reply(request_id: str, turn: int, prompt_text: str) -> str:
    return f"reply {turn}"


@pytest.fixture()
def served(qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, _reply)
    proxy = ChatProxy(engine, ChatRenderer(qwen3_tokenizer))
    server = ServerThread(create_app(engine, proxy))
    server.start()
    yield engine, proxy, server.base_url
    server.stop()


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_two_turn_episode_is_recorded_token_exactly(served, qwen3_tokenizer):
    engine, proxy, url = served
    prompt = _ids(qwen3_tokenizer, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    im_end = qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")
    body = {"model": "m", "token_ids": prompt, "sampling_params": {
        "temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_tokens": 64, "stop_token_ids": [im_end], "logprobs": 1,
        "skip_special_tokens": False, "seed": 3, "repetition_penalty": 1.0, "min_p": 0.0, "n": 1}}
    with httpx.Client(base_url=url) as client:
        first = client.post("/inference/v1/generate", json=body, headers={"X-Session-ID": "trace-1"})
        assert first.status_code == 200, first.text
        out = first.json()
        assert first.headers["x-session-id"] == "trace-1" and out["session_id"] == "trace-1"
        choice = out["choices"][0]
        assert choice["token_ids"] == _ids(qwen3_tokenizer, "reply 1") + [im_end]
        assert choice["finish_reason"] == "stop" and out["prompt_token_ids"] == prompt
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert [c["logprob"] for c in content] == [-(k + 1) / 100 for k in range(len(content))]
        assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(content),
                                "total_tokens": len(prompt) + len(content)}
        params = engine.calls[0].params
        assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, -1, 3)
        assert params.max_new_tokens == 64 and im_end in params.stop_token_ids

        # the next turn: the client's own rendering of the tool result after the recorded completion, per session URL
        observation = _ids(qwen3_tokenizer, "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
        second = client.post("/sessions/trace-1/inference/v1/generate",
                             json={"token_ids": prompt + choice["token_ids"] + observation})
        assert second.status_code == 200, second.text
        trajectories = client.get("/sessions/trace-1/trajectories").json()["trajectories"]
    assert len(trajectories) == 1
    session = proxy.session("trace-1")
    assert [c.notes["api"] for c in session.calls] == ["generate", "generate"]
    traj = proxy.trajectories("trace-1")[0]
    second_ids = second.json()["choices"][0]["token_ids"]
    assert traj.prompt_ids == prompt
    assert traj.response_ids == choice["token_ids"] + observation + second_ids
    assert [(s.source, sum(s.loss_mask)) for s in traj.segments] == [
        (SegmentSource.MODEL, len(choice["token_ids"])), (SegmentSource.ENV, 0), (SegmentSource.MODEL, len(second_ids))]
    assert traj.num_turns == 2 and [m["content"] for m in traj.messages] == ["reply 1", "reply 2"]


def test_a_call_naming_no_session_continues_the_one_whose_tokens_it_extends(served, qwen3_tokenizer):
    _, proxy, url = served
    prompt = _ids(qwen3_tokenizer, "<|im_start|>user\nsolo<|im_end|>\n<|im_start|>assistant\n")
    with httpx.Client(base_url=url) as client:
        first = client.post("/inference/v1/generate", json={"token_ids": prompt}).json()
        other = client.post("/inference/v1/generate", json={"token_ids": prompt[:-1]}).json()
        follow = client.post("/inference/v1/generate",
                             json={"token_ids": prompt + first["choices"][0]["token_ids"] + prompt}).json()
    assert other["session_id"] != first["session_id"]  # a prompt extending no call is another episode
    assert follow["session_id"] == first["session_id"]
    assert len(proxy.session(first["session_id"]).calls) == 2


def test_a_fixed_sampling_session_keeps_its_own_distribution(served, qwen3_tokenizer):
    engine, proxy, url = served
    proxy.open_session("train-1", sampling=SamplingParams(temperature=1.0, top_p=1.0, seed=7), max_new_tokens=32)
    body = {"token_ids": _ids(qwen3_tokenizer, "hello"), "sampling_params": {"temperature": 0.1, "max_tokens": 500}}
    with httpx.Client(base_url=url) as client:
        assert client.post("/sessions/train-1/inference/v1/generate", json=body).status_code == 200
    params = engine.calls[-1].params
    assert params.temperature == 1.0 and params.max_new_tokens == 32
    assert proxy.session("train-1").calls[0].notes["ignored_request_sampling"] == {"temperature": 0.1}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"token_ids": [1], "prompt": "x"}, "prompt", "unknown field"),
    ({"token_ids": []}, "token_ids", "non-empty list"),
    ({"token_ids": [1, -2]}, "token_ids", "token_ids[1]"),
    ({"token_ids": [1], "sampling_params": {"repetition_penalty": 1.3}}, "sampling_params.repetition_penalty",
     "change the sampling distribution"),
    ({"token_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n", "leave it at 1"),
    ({"token_ids": [1], "sampling_params": {"stop": ["\n"]}}, "sampling_params.stop", "not supported"),
    ({"token_ids": [1], "sampling_params": {"frobnicate": 1}}, "sampling_params.frobnicate", "known fields"),
    ({"token_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature", "must be"),
    ({"token_ids": [1], "sampling_params": {"stop_token_ids": ["x"]}}, "sampling_params.stop_token_ids", "list of"),
    ({"token_ids": [1], "features": {"mm_hashes": {}}}, "features", "multimodal"),
    ({"token_ids": [1], "stream": True}, "stream", "whole completions"),
])
def test_bad_requests_are_refused_naming_the_field(served, body, param, words):
    engine, proxy, url = served
    with httpx.Client(base_url=url) as client:
        r = client.post("/inference/v1/generate", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert engine.calls == [] and proxy.sessions() == []  # refused before any session or engine call


def test_an_engine_refusal_is_a_400_naming_the_token_ids(qwen3_tokenizer):
    class Refusing(ScriptedEngine):
        async def generate(self, prompt_ids, params, *, request_id, images=None):
            raise InvalidRequest("prompt of 9 tokens does not fit the context", "prompt_ids")

    engine = Refusing(qwen3_tokenizer, _reply)
    engine.max_context = 8
    server = ServerThread(create_app(engine, ChatProxy(engine, ChatRenderer(qwen3_tokenizer)), model_name="pol"))
    server.start()
    try:
        with httpx.Client(base_url=server.base_url) as client:
            r = client.post("/inference/v1/generate", json={"token_ids": list(range(9))})
            models = client.get("/sessions/x/v1/models").json()
    finally:
        server.stop()
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids"
    assert models["data"][0]["max_model_len"] == 8  # what renderers' pre-flight check reads
