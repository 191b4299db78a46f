"""VLLMServerEngine: its requests and response parsing against a scripted `/v1/completions` (any venv), and
against a real `vllm serve` of SmolLM2 (`vllm` marker: only in the vLLM venv, `make vllm-test`).

Also the config wiring: `engine.kind: vllm` with urls builds server clients, without urls an in-process
VLLMEngine over `model_path`.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from turnrl.build import build_engine
from turnrl.config import ConfigError, EngineConfig
from turnrl.engines.base import EngineError, Recording
from turnrl.engines.router import Router
from turnrl.engines.vllm import VLLMServerEngine
from turnrl.types import FinishReason, SamplingParams


# ---- scripted server -------------------------------------------------------------------------------
def completion(token_ids, logprobs, finish="stop"):
    return {"choices": [{"index": 0, "text": "", "token_ids": token_ids, "finish_reason": finish,
                         "logprobs": {"tokens": [f"token_id:{t}" for t in token_ids], "token_logprobs": logprobs}}]}


def scripted(engine: VLLMServerEngine, handler) -> list[httpx.Request]:
    """Route the engine's HTTP client to `handler(request) -> httpx.Response`; returns the requests seen."""
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)

    client = httpx.AsyncClient(base_url=engine.base_url, transport=httpx.MockTransport(record))
    engine.http.client = lambda: client
    return seen


async def test_request_body_and_output_mapping():
    engine = VLLMServerEngine("http://vllm:8000/", model="smol", eos_token_ids=[2])
    seen = scripted(engine, lambda r: httpx.Response(200, json=completion([5, 6, 2], [-0.5, -0.25, -0.125])))
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(7,), seed=3)
    out = await engine.generate([1, 2, 3], params, request_id="traj")
    again = await engine.generate([1, 2, 3], params, request_id="traj")
    assert out.token_ids == [5, 6, 2] and out.logprobs == [-0.5, -0.25, -0.125]
    assert out.finish_reason == FinishReason.STOP and out.policy_version == 0 and again.token_ids == out.token_ids
    assert [str(r.url) for r in seen] == ["http://vllm:8000/v1/completions"] * 2
    body = json.loads(seen[0].content)
    assert body == {
        "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "logprobs": 0,
        "return_token_ids": True, "skip_special_tokens": False, "request_id": "traj#0", "repetition_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0, "stop_token_ids": [2, 7], "seed": 3,
        "model": "smol",
    }
    assert json.loads(seen[1].content)["request_id"] == "traj#1"  # vLLM refuses duplicate live ids


@pytest.mark.parametrize("data, message", [
    ({"choices": []}, "expected choices"),
    ({"choices": [{"token_ids": [1], "finish_reason": "stop"}]}, "expected choices"),
    (completion([1, 2], [-1.0]), "2 token ids but 1 logprobs"),
    (completion([1], [-1.0], finish="error"), "unknown finish_reason 'error'"),
])
def test_malformed_responses_raise(data, message):
    with pytest.raises(EngineError, match=message):
        VLLMServerEngine("http://vllm:8000").parse_completion(data, "r#0")


def test_length_and_abort_finish_reasons():
    engine = VLLMServerEngine("http://vllm:8000")
    assert engine.parse_completion(completion([1], [-1.0], "length"), "r").finish_reason == FinishReason.LENGTH
    assert engine.parse_completion(completion([1], [-1.0], "abort"), "r").finish_reason == FinishReason.ABORT


async def test_weight_push_writes_safetensors_and_reloads(tmp_path):
    with pytest.raises(EngineError, match="needs weights_dir"):
        await VLLMServerEngine("http://vllm:8000").update_weights({"w": torch.ones(2)})
    engine = VLLMServerEngine("http://vllm:8000", weights_dir=tmp_path / "w")
    seen = scripted(engine, lambda r: httpx.Response(200, json={"success": True} if "reset" in r.url.path else {}))
    assert await engine.update_weights({"w": torch.arange(3.0)}, version=4) == 4 and engine.policy_version == 4
    # weight_sync.pause=keep: the running requests are frozen with their KV around the reload (tests/test_vllm_pause.py)
    assert [r.url.path for r in seen] == ["/pause", "/collective_rpc", "/resume"]
    assert seen[0].url.params["mode"] == "keep"
    assert json.loads(seen[1].content) == {"method": "reload_weights",
                                           "kwargs": {"weights_path": str(tmp_path / "w")}}
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "w" / "model.safetensors")["w"], torch.arange(3.0))

    scripted(engine, lambda r: httpx.Response(404, json={"detail": "Not Found"}))
    with pytest.raises(EngineError, match="VLLM_SERVER_DEV_MODE=1"):
        await engine.update_weights({"w": torch.ones(2)})


async def test_images_are_refused():
    with pytest.raises(EngineError, match="text prompts only"):
        await VLLMServerEngine("http://vllm:8000").generate([1], SamplingParams(), request_id="r", images=["a.png"])


# ---- config wiring ---------------------------------------------------------------------------------
def test_engine_kind_vllm_with_urls_builds_server_clients():
    one = build_engine(None, EngineConfig(kind="vllm", urls=["http://a:1"]))
    assert isinstance(one, VLLMServerEngine) and one.base_url == "http://a:1"
    many = build_engine(None, EngineConfig(kind="vllm", urls=["http://a:1", "http://b:2"]))
    assert isinstance(many, Router) and all(isinstance(r.engine, VLLMServerEngine) for r in many._replicas.values())


def test_engine_kind_vllm_without_urls_builds_an_in_process_engine(monkeypatch):
    import turnrl.engines.vllm as vllm_engines
    from turnrl.build import build_engine

    built = {}
    monkeypatch.setattr(vllm_engines, "VLLMEngine", lambda model, **kw: built.update(model=model, **kw) or "engine")
    monkeypatch.setattr("turnrl.models.check_hub_model", lambda repo_id: None)  # org/model is in no cache
    cfg = EngineConfig(kind="vllm", max_batch_size=8)
    with pytest.raises(ConfigError, match="needs model_path"):
        build_engine(torch.nn.Linear(1, 1), cfg)
    with pytest.raises(ConfigError, match="one in-process vLLM engine"):
        build_engine(torch.nn.Linear(1, 1), EngineConfig(kind="vllm", replicas=2), model_path="/m")
    assert build_engine(torch.nn.Linear(1, 1), cfg, eos_token_ids=[2], model_path="org/model") == "engine"
    assert built == {"model": "org/model", "eos_token_ids": [2], "max_num_seqs": 8, "record": Recording()}


# ---- a real `vllm serve` ---------------------------------------------------------------------------
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """`vllm serve` of SmolLM2 in fp32 with processed logprobs and the dev endpoints (weight pushes)."""
    pytest.importorskip("vllm")
    from turnrl.models import resolve_model

    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its EngineCore in a child process
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", resolve_model(MODEL),
           "--served-model-name", "smol", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
           "--enforce-eager", "--logprobs-mode", "processed_logprobs"]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail(f"vllm serve did not answer /health in 240 s:\n{log_path.read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.vllm
async def test_real_server_greedy_logprobs_and_weight_push(vllm_server, tmp_path):
    from turnrl.engines.embedded import EmbeddedEngine
    from turnrl.models import load_model, load_tokenizer

    tokenizer, hf_model = load_tokenizer(MODEL), load_model(MODEL).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    engine = VLLMServerEngine(vllm_server, model="smol", weights_dir=tmp_path / "weights")
    try:
        greedy = await engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=32), request_id="t")
        assert tokenizer.decode(greedy.token_ids) == "The capital of France is Paris.<|im_end|>"
        assert greedy.finish_reason == FinishReason.STOP

        # logprobs of the sampling distribution: temperature 0.7 and top-k 20 applied, renormalised
        params = SamplingParams(temperature=0.7, top_k=20, max_new_tokens=16, seed=3)
        sampled = await engine.generate(prompt, params, request_id="t")
        with torch.no_grad():
            logits_T_V = hf_model(torch.tensor([prompt + sampled.token_ids])).logits[0, len(prompt) - 1 : -1] / 0.7
        kth_T_1 = logits_T_V.topk(20, dim=-1).values[:, -1:]
        logp_T_V = logits_T_V.masked_fill(logits_T_V < kth_T_1, float("-inf")).log_softmax(-1)
        expected = logp_T_V.gather(1, torch.tensor(sampled.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(sampled.logprobs), expected, atol=1e-3, rtol=0)

        # a cancelled call closes its connection and vLLM stops the request
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=1000, seed=0), request_id="c"))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(1.0)
        metrics = httpx.get(f"{vllm_server}/metrics", timeout=5).text
        assert 'vllm:num_requests_running{engine="0",model_name="smol"} 0.0' in metrics

        # weight push through the shared folder: the server then matches the embedded engine
        new_model = copy.deepcopy(hf_model)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in new_model.named_parameters():
                if p.dim() == 2 and "embed" not in name:
                    p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.5)
        assert await engine.update_weights(new_model.state_dict()) == 1
        pushed = await engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=24), request_id="t")
        embedded = EmbeddedEngine(new_model, eos_token_ids=[2])
        try:
            want = await embedded.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=24), request_id="t")
        finally:
            embedded.close()
        assert pushed.token_ids == want.token_ids and pushed.token_ids != greedy.token_ids[:24]
        # the noisy weights blow activations up: fp32 kernel differences reach ~1e-3 on logprobs of ~-1
        torch.testing.assert_close(torch.tensor(pushed.logprobs), torch.tensor(want.logprobs), atol=1e-3, rtol=1e-3)
    finally:
        await engine.aclose()

