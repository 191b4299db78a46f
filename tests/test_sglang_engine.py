"""SGLangEngine against tests/fake_sglang.py (SGLang's native API, served over real HTTP in a thread)."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path

import pytest
from fake_sglang import FakeSGLang
from fakes import ScriptedEngine

from turnrl.build import build_engine
from turnrl.config import EngineConfig
from turnrl.engines.base import EngineError, InvalidRequest
from turnrl.engines.embedded import EmbeddedEngine
from turnrl.engines.http import HttpEngine
from turnrl.engines.router import Router
from turnrl.engines.sglang import SGLangEngine
from turnrl.render import ChatRenderer
from turnrl.serve.app import ServerThread
from turnrl.testing.faults import SilentServer
from turnrl.types import FinishReason, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def _load_check_script():
    spec = importlib.util.spec_from_file_location("check_sglang", ROOT / "scripts" / "check_sglang.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def embedded(tiny_qwen3, qwen3_tokenizer):
    renderer = ChatRenderer(qwen3_tokenizer)
    engine = EmbeddedEngine(tiny_qwen3, eos_token_ids=sorted(renderer.end_of_turn_ids), max_batch_size=4)
    yield engine, renderer
    engine.close()


@pytest.fixture(scope="module")
def fake_server(embedded):
    fake = FakeSGLang(embedded[0])
    server = ServerThread(fake.app)
    server.start()
    yield fake, server.base_url
    server.stop()


def _prompt(renderer: ChatRenderer) -> list[int]:
    return renderer.initial_ids([{"role": "user", "content": "Count to five."}])


async def test_greedy_tokens_and_logprobs_equal_a_direct_engine_call(embedded, fake_server):
    engine, renderer = embedded
    fake, url = fake_server
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    direct = await engine.generate(_prompt(renderer), params, request_id="direct")
    sglang = SGLangEngine(url)
    out = await sglang.generate(_prompt(renderer), params, request_id="traj-1")
    assert out.token_ids == direct.token_ids
    assert out.logprobs == pytest.approx(direct.logprobs, abs=1e-6)
    assert out.finish_reason == direct.finish_reason
    sent = fake.requests[-1]  # what the adapter put on the wire
    assert sent["input_ids"] == _prompt(renderer) and sent["return_logprob"] and sent["logprob_start_len"] == -1
    assert sent["sampling_params"]["no_stop_trim"] and not sent["sampling_params"]["skip_special_tokens"]
    assert sent["sampling_params"]["temperature"] == 0.0 and sent["sampling_params"]["max_new_tokens"] == 12
    assert sent["rid"].startswith("traj-1#")


async def test_stop_token_is_kept_and_finish_reasons_map(embedded, fake_server):
    engine, renderer = embedded
    _, url = fake_server
    sglang = SGLangEngine(url)
    first = await sglang.generate(_prompt(renderer), SamplingParams(temperature=0.0, max_new_tokens=8), request_id="a")
    assert first.finish_reason == FinishReason.LENGTH and len(first.token_ids) == 8
    stop = first.token_ids[3]
    out = await sglang.generate(_prompt(renderer), SamplingParams(temperature=0.0, max_new_tokens=8,
                                                                  stop_token_ids=(stop,)), request_id="b")
    assert out.finish_reason == FinishReason.STOP
    assert out.token_ids == first.token_ids[: first.token_ids.index(stop) + 1]  # the stop token is in the output


async def test_update_weights_writes_safetensors_the_server_loads(embedded, fake_server, tiny_qwen3, tmp_path):
    engine, renderer = embedded
    _, url = fake_server
    sglang = SGLangEngine(url, weights_dir=tmp_path / "weights")
    before = await sglang.generate(_prompt(renderer), SamplingParams(temperature=0.0, max_new_tokens=6), request_id="c")
    assert await sglang.update_weights(tiny_qwen3.state_dict(), version=3) == 3  # tied embeddings included
    assert (tmp_path / "weights" / "model.safetensors").exists()
    after = await sglang.generate(_prompt(renderer), SamplingParams(temperature=0.0, max_new_tokens=6), request_id="d")
    assert after.policy_version == 3 and after.token_ids == before.token_ids
    with pytest.raises(EngineError, match="weights_dir"):
        await SGLangEngine(url).update_weights(tiny_qwen3.state_dict())


async def test_a_streamed_update_stages_a_file_per_bucket_and_reloads_once(embedded, fake_server, tiny_qwen3,
                                                                           tmp_path):
    fake, url = fake_server
    sglang = SGLangEngine(url, weights_dir=tmp_path / "weights")
    params = list(tiny_qwen3.named_parameters())
    version = fake.weight_version
    assert await sglang.update_weights(params[:3], version=8, final=False) == 0
    assert await sglang.update_weights(params[3:9], version=8, final=False) == 0
    assert fake.weight_version == version  # nothing reloaded from a half-written folder
    assert await sglang.update_weights(params[9:], version=8) == 8
    assert fake.weight_version == "8"
    files = sorted(f.name for f in (tmp_path / "weights").iterdir())
    assert files == ["model-00001.safetensors", "model-00002.safetensors", "model-00003.safetensors"]
    assert await sglang.update_weights(dict(params), version=9) == 9  # a one-shot update replaces the parts
    assert sorted(f.name for f in (tmp_path / "weights").iterdir()) == ["model.safetensors"]


async def test_sleep_wake_abort_and_errors(qwen3_tokenizer):
    slow = ScriptedEngine(qwen3_tokenizer, lambda rid, turn, text: "a b c", latency_s=3.0)
    fake = FakeSGLang(slow, max_context=50)
    server = ServerThread(fake.app)
    url = server.start()
    try:
        sglang = SGLangEngine(url, sleep_tags=["kv_cache"])
        await sglang.sleep()
        await sglang.wake_up()
        assert fake.memory_calls == [("release", ["kv_cache"]), ("resume", ["kv_cache"])]
        assert await sglang.health()

        # the caller cancels: the adapter tells the server to abort its rid
        task = asyncio.ensure_future(sglang.generate([1, 2, 3], SamplingParams(), request_id="cancel-me"))
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(100):  # the abort goes out in the background: cancelling never waits on the server
            if fake.aborted:
                break
            await asyncio.sleep(0.02)
        assert fake.aborted and fake.aborted[-1].startswith("cancel-me#")

        # the server aborts (e.g. a weight update): finish_reason abort
        task = asyncio.ensure_future(sglang.generate([1, 2, 3], SamplingParams(), request_id="server-abort"))
        await asyncio.sleep(0.3)
        await sglang._request("POST", "/abort_request", json={"rid": fake.requests[-1]["rid"]}, expect_json=False)
        out = await task
        assert out.finish_reason == FinishReason.ABORT and out.token_ids == []

        with pytest.raises(EngineError, match=r"/generate returned HTTP 400.*context length"):
            await sglang.generate(list(range(60)), SamplingParams(), request_id="too-long")
    finally:
        server.stop()
    with pytest.raises(EngineError, match="failed: ConnectError"):
        await SGLangEngine(url, connect_timeout_s=1).generate([1], SamplingParams(), request_id="down")


def test_response_parsing_rejects_disagreeing_ids():
    engine = SGLangEngine("http://sglang.invalid")
    meta = {"finish_reason": {"type": "stop", "matched": 7}, "output_token_logprobs": [[-0.5, 5, None], [-0.1, 7, None]],
            "weight_version": "default", "cached_tokens": 4}
    out = engine._parse_output({"output_ids": [5, 7], "meta_info": meta}, "r")
    assert (out.token_ids, out.logprobs, out.finish_reason, out.cached_prompt_tokens) == ([5, 7], [-0.5, -0.1],
                                                                                         FinishReason.STOP, 4)
    assert engine._parse_output({"output_ids": [5], "meta_info": meta}, "r").token_ids == [5, 7]  # trimmed stop
    with pytest.raises(EngineError, match="disagree"):
        engine._parse_output({"output_ids": [6, 7], "meta_info": meta}, "r")
    with pytest.raises(EngineError, match="output_token_logprobs"):
        engine._parse_output({"meta_info": {"finish_reason": {"type": "stop"}}}, "r")


async def test_the_gpu_check_script_passes_against_the_fake(embedded, fake_server, tiny_qwen3, tmp_path):
    _, renderer = embedded
    _, url = fake_server
    lines: list[str] = []
    await _load_check_script().run_checks(url, _prompt(renderer), weights=tiny_qwen3.state_dict(),
                                          weights_dir=str(tmp_path), sleep=True, say=lines.append)
    assert len(lines) == 8 and all(line.startswith("ok") for line in lines)


def test_build_server_engine_from_config(tmp_path):
    one = build_engine(None, EngineConfig(kind="sglang", urls=["http://a:1"]))
    assert isinstance(one, SGLangEngine) and one.weights_dir is None
    many = build_engine(None, EngineConfig(kind="http", urls=["http://a:1", "http://b:2"]))
    assert isinstance(many, Router) and all(isinstance(r.engine, HttpEngine) for r in many._replicas.values())
    with pytest.raises(ValueError, match="engine.urls is required"):
        build_engine(None, EngineConfig(kind="sglang"))


@pytest.mark.parametrize(("pause", "calls"), [
    ("keep", ["pause_generation(in_place)", "update_weights_from_disk(abort_all_requests=False, flush_cache=False)",
              "continue_generation"]),
    ("wait", ["update_weights_from_disk(abort_all_requests=False, flush_cache=True)"]),
    ("abort", ["update_weights_from_disk(abort_all_requests=True, flush_cache=True)"]),
])
async def test_pause_modes_map_onto_sglangs_pause_and_update_calls(embedded, fake_server, tiny_qwen3, tmp_path, pause,
                                                                    calls):
    engine, renderer = embedded
    fake, url = fake_server
    sglang = SGLangEngine(url, weights_dir=tmp_path / "weights")
    params = SamplingParams(temperature=1.0, max_new_tokens=200, seed=2, stop_token_ids=())
    running = asyncio.create_task(sglang.generate(_prompt(renderer), params, request_id=f"long-{pause}"))
    while engine.stats["generated_tokens"] == 0 or not engine._active:  # the request is decoding on the server
        await asyncio.sleep(0.01)
    fake.calls.clear()
    options = {} if pause == "keep" else {"pause": pause}  # how turnrl.train.weights passes it
    await sglang.update_weights(tiny_qwen3.state_dict(), version=11 + len(pause), **options)
    out = await running
    assert fake.calls == calls
    assert out.preempted is (pause == "abort") and (out.finish_reason == FinishReason.ABORT) is (pause == "abort")
    if pause == "abort":
        assert 0 < len(out.token_ids) < 200  # its tokens so far, for turnrl.rollout to resubmit
    with pytest.raises(InvalidRequest, match="pause must be one of"):
        await sglang.update_weights({}, pause="soon")


async def test_cancelling_a_call_to_a_hung_server_returns_at_once():
    """The abort of a cancelled call goes to the server that may be the one that hung: it was awaited (shielded,
    with the 600 s request limit) before, holding the cancelled trajectory; now it goes out in the background."""
    with SilentServer() as server:
        sglang = SGLangEngine(server.url, control_timeout_s=0.5)
        task = asyncio.ensure_future(sglang.generate([1, 2, 3], SamplingParams(), request_id="stuck"))
        await asyncio.sleep(0.3)
        start = time.perf_counter()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled() and time.perf_counter() - start < 1.0
        assert await sglang.health() is False  # control calls have their own short limit
        await sglang.aclose()
