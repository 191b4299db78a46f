"""VLLMServerEngine's weight update against a stand-in for the endpoints vLLM's server exposes for RL (dev mode):
`/pause?mode=...`, `/collective_rpc` (reload_weights), `/resume` — in that order, in every pause mode. The real
server is tested by `make vllm-test` (tests/test_vllm_server.py)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request

from turnrl.engines.base import InvalidRequest
from turnrl.engines.vllm import VLLMServerEngine
from turnrl.serve.app import ServerThread


@pytest.fixture(scope="module")
def server():
    app, calls = FastAPI(), []

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True):
        calls.append(f"pause(mode={mode}, clear_cache={clear_cache})")
        return {}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request):
        body = await request.json()
        calls.append(f"collective_rpc({body['method']})")
        return {"results": [None]}

    @app.post("/resume")
    async def resume():
        calls.append("resume")
        return {}

    thread = ServerThread(app)
    thread.start()
    yield thread.base_url, calls
    thread.stop()


@pytest.mark.parametrize(("pause", "clear"), [("keep", False), ("wait", True), ("abort", True)])
async def test_a_weight_update_pauses_reloads_and_resumes_in_the_pause_mode(server, tmp_path, pause, clear):
    import torch

    url, calls = server
    calls.clear()
    engine = VLLMServerEngine(url, weights_dir=tmp_path)
    options = {} if pause == "keep" else {"pause": pause}
    weights = {"w": torch.zeros(2)}
    assert await engine.update_weights(weights, version=4, final=False, **options) == 0  # a first bucket: staged
    assert calls == []
    assert await engine.update_weights(weights, version=4) == 4  # the final one: the mode of the first applies
    assert calls == [f"pause(mode={pause}, clear_cache={clear})", "collective_rpc(reload_weights)", "resume"]
    with pytest.raises(InvalidRequest, match="pause must be one of"):
        await engine.update_weights(weights, pause="never")
    engine.close()
