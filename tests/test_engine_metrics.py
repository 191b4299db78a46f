"""vLLM and SGLang servers' KV reports from their Prometheus /metrics pages (turnrl/engines/metrics.py,
`engine.kv_metrics`): the metric names and page format as the servers write them (prometheus_client's text
exposition: HELP/TYPE lines, labels, a counter's `_total` and `_created` series), served over real HTTP."""

from __future__ import annotations

import asyncio
import http.server
import threading

import pytest

from turnrl.engines.base import KVStats, kv_stats
from turnrl.engines.metrics import SGLANG, VLLM, KVMetrics, kv_from_metrics, parse_metrics
from turnrl.engines.router import Router
from turnrl.engines.sglang import SGLangEngine
from turnrl.engines.vllm import VLLMServerEngine

MODEL = 'model_name="Qwen/Qwen3-0.6B"'

# vLLM v1 (vllm/v1/metrics/loggers.py): a gauge and a counter per engine (label engine), data parallel size 2
VLLM_PAGE = f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{MODEL}}} 12.0
vllm:num_requests_running{{engine="1",{MODEL}}} 9.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{MODEL}}} 0.4213
vllm:kv_cache_usage_perc{{engine="1",{MODEL}}} 0.6875
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",{MODEL}}} 3.0
vllm:num_preemptions_total{{engine="1",{MODEL}}} 4.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{{engine="0",{MODEL}}} 1.7646912345e+09
vllm:num_preemptions_created{{engine="1",{MODEL}}} 1.7646912345e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",{MODEL}}} 81234.0
"""

# vLLM before v1's rename: the v0 gauge name
VLLM_V0_PAGE = f"""# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{{MODEL}}} 0.25
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{{MODEL}}} 0.0
"""

# SGLang (python/sglang/srt/metrics/collector.py): labels model_name, engine_type, tp_rank, pp_rank...
SGLANG_LABELS = 'model_name="meta-llama/Llama-3.1-8B-Instruct",engine_type="unified",tp_rank="0",pp_rank="0"'
SGLANG_PAGE = f"""# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{SGLANG_LABELS}}} 48.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{{SGLANG_LABELS}}} 0.28
# HELP sglang:num_retracted_reqs The number of retracted requests.
# TYPE sglang:num_retracted_reqs gauge
sglang:num_retracted_reqs{{{SGLANG_LABELS}}} 2.0
# HELP sglang:num_retracted_requests_total Total number of retracted requests.
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{{{SGLANG_LABELS}}} 17.0
# HELP sglang:num_retracted_requests_created Total number of retracted requests.
# TYPE sglang:num_retracted_requests_created gauge
sglang:num_retracted_requests_created{{{SGLANG_LABELS}}} 1.7646912345e+09
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{{SGLANG_LABELS}}} 0.007507552643049313
"""

# SGLang versions with the cumulative retraction gauge instead of the counter
SGLANG_OLD_PAGE = f"""# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{{SGLANG_LABELS}}} 0.91
# HELP sglang:total_retracted_reqs The total number of retracted requests due to kvcache full.
# TYPE sglang:total_retracted_reqs gauge
sglang:total_retracted_reqs{{{SGLANG_LABELS}}} 5.0
"""


def test_the_servers_pages_give_occupancy_and_preemptions():
    assert kv_from_metrics(VLLM_PAGE, VLLM) == KVStats(0.6875, 7)  # the fullest engine, preemptions summed
    assert kv_from_metrics(VLLM_V0_PAGE, VLLM) == KVStats(0.25, 0)
    assert kv_from_metrics(SGLANG_PAGE, SGLANG) == KVStats(0.28, 17)  # the counter, not the last batch's gauge
    assert kv_from_metrics(SGLANG_OLD_PAGE, SGLANG) == KVStats(0.91, 5)
    assert kv_from_metrics(SGLANG_PAGE, VLLM) is None  # another server's page: no report
    assert kv_from_metrics("", SGLANG) is None


def test_the_parser_reads_the_exposition_format():
    page = ('# a comment\n\nm{a="x, y",b="q\\"uote}"} 1.5\nm{a="z"} NaN\nm_plain 2e3 1764691234000\nbad line\n'
            'n{a="1"} +Inf\n')
    assert parse_metrics(page) == {"m": [1.5, pytest.approx(float("nan"), nan_ok=True)], "m_plain": [2000.0],
                                   "n": [float("inf")]}
    assert kv_from_metrics('vllm:kv_cache_usage_perc{engine="0"} NaN\n', VLLM) is None  # no finite value
    assert kv_from_metrics('vllm:kv_cache_usage_perc 1.7\n', VLLM) == KVStats(1.0, 0)  # clamped to [0, 1]


class _Page(http.server.BaseHTTPRequestHandler):
    page = ""
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = self.page.encode()
        self.send_response(self.status if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    handler = type("Page", (_Page,), {})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


async def test_engines_read_the_page_behind_the_flag(server, caplog):
    handler, url = server
    handler.page = VLLM_PAGE
    off = VLLMServerEngine(url)
    assert off.kv_stats() is None and kv_stats(off) is None  # no flag: no report, nothing polled
    engine = VLLMServerEngine(url, kv_metrics=True)
    assert engine.kv_stats() is None  # nothing read yet: the poller starts on this loop
    for _ in range(100):
        await asyncio.sleep(0.02)
        if engine.kv_stats() is not None:
            break
    assert engine.kv_stats() == KVStats(0.6875, 7)
    handler.page = VLLM_PAGE.replace("0.6875", "0.9").replace("} 4.0", "} 6.0")
    assert await engine._kv.read() == KVStats(0.9, 9)  # the poller reads the page again
    sglang = SGLangEngine(url, kv_metrics=True)
    handler.page = SGLANG_PAGE
    assert await sglang._kv.read() == KVStats(0.28, 17)
    router = Router([engine, sglang])
    assert router.kv_stats() == KVStats(0.9, 26)  # the fullest replica, preemptions summed
    handler.page = "# nothing here\n"
    assert await sglang._kv.read() is None and sglang.kv_stats() == KVStats(0.28, 17)  # the last good report stays
    assert "--enable-metrics" in caplog.text
    handler.status = 500
    assert await engine._kv.read() is None and "failed" in caplog.text  # said, never raised
    engine._kv.idle_after_s = 0  # nobody asks any more: the poller ends
    await asyncio.sleep(engine._kv.interval_s + 0.1)
    assert engine._kv._task is not None and engine._kv._task.done()


async def test_an_unreachable_server_gives_no_report(caplog):
    metrics = KVMetrics(VLLMServerEngine("http://127.0.0.1:9").http, VLLM, timeout_s=1.0)
    assert await metrics.read() is None and metrics.last is None
    assert "127.0.0.1:9/metrics failed" in caplog.text
