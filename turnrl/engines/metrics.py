"""KV occupancy and preemptions of a vLLM or SGLang server, read from its Prometheus `/metrics` endpoint (behind a
flag: `engine.kv_metrics`, docs/rollout.md), for `Engine.kv_stats()` and so for `rollout.concurrency: auto`.

The metric names, from the servers' own sources:

- vLLM (v1 engine, vllm/v1/metrics/loggers.py): the gauge `vllm:kv_cache_usage_perc` ("KV-cache usage. 1 means
  100 percent usage"), before it `vllm:gpu_cache_usage_perc` (the v0 name, later kept as a deprecated alias); the
  counter `vllm:num_preemptions` ("Cumulative number of preemption from the engine"), which prometheus_client
  exposes as `vllm:num_preemptions_total` (v0 named it that way already). One series per engine (data
  parallel ranks: label `engine`).
- SGLang (python/sglang/srt/metrics/collector.py, server started with `--enable-metrics`): the gauge
  `sglang:token_usage` (the fraction of the KV token pool in use); the counter
  `sglang:num_retracted_requests_total` (requests retracted, their KV freed to be recomputed, because the pool ran
  full: SGLang's preemption), before it the gauge `sglang:total_retracted_reqs` of older versions. (The gauge
  `sglang:num_retracted_reqs` is the count of the last batch only, not a total: not used.)

Several series of one metric (data-parallel engines, ranks) give the fullest one's occupancy and the sum of their
preemptions, as a Router does over its replicas. A server whose page lacks the occupancy metric reports nothing
(said once in the log, naming the names looked for).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from turnrl.engines.base import KVStats
from turnrl.observe.watchdog import abandon_after

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVMetricNames:
    """Where a server's page keeps the KV report: the first name present of each tuple is read."""

    occupancy: tuple[str, ...]
    preemptions: tuple[str, ...]
    hint: str = ""
    """What to do when the page has none of them (how to start the server with its metrics on)."""


VLLM = KVMetricNames(("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), ("vllm:num_preemptions_total",),
                     "vLLM serves /metrics unless started with --disable-log-stats")
SGLANG = KVMetricNames(("sglang:token_usage",),
                       ("sglang:num_retracted_requests_total", "sglang:total_retracted_reqs"),
                       "start the SGLang server with --enable-metrics")

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)')


def parse_metrics(text: str) -> dict[str, list[float]]:
    """The samples of a Prometheus text exposition page: metric name -> the values of its series (labels
    dropped; comments, blank lines and unparseable values skipped)."""
    samples: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        samples.setdefault(m.group(1), []).append(value)
    return samples


def kv_from_metrics(text: str, names: KVMetricNames) -> KVStats | None:
    """The KV report in a /metrics page, or None when it has no occupancy metric of `names`."""
    samples = parse_metrics(text)
    occupancy = _first(samples, names.occupancy)
    if occupancy is None:
        return None
    preemptions = _first(samples, names.preemptions) or []
    finite = [v for v in occupancy if math.isfinite(v)]
    if not finite:
        return None
    return KVStats(min(1.0, max(0.0, max(finite))), int(sum(v for v in preemptions if math.isfinite(v))))


def _first(samples: dict[str, list[float]], names: tuple[str, ...]) -> list[float] | None:
    return next((samples[n] for n in names if n in samples), None)


class KVMetrics:
    """A server's KV report, read from its /metrics page in the background while someone asks for it.

    `stats()` is synchronous (admission reads it between trajectories): it returns the last report read (None
    before the first), and keeps a poller running on the caller's event loop that reads the page every
    `interval_s` and stops once nobody asked for `idle_after_s`. A page that cannot be read, or lacks the
    metrics, is said once in the log; the last good report stays.
    """

    def __init__(self, http: Any, names: KVMetricNames, *, path: str = "/metrics", interval_s: float = 0.5,
                 timeout_s: float = 5.0, idle_after_s: float = 10.0):
        self.http, self.names, self.path = http, names, path
        self.interval_s, self.timeout_s, self.idle_after_s = interval_s, timeout_s, idle_after_s
        self.last: KVStats | None = None
        self._task: asyncio.Task | None = None
        self._asked = -math.inf
        self._warned: set[str] = set()

    def stats(self) -> KVStats | None:
        self._asked = time.monotonic()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: nothing to poll on; the last report stands
            return self.last
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._poll())
        return self.last

    async def _poll(self) -> None:
        while time.monotonic() - self._asked < self.idle_after_s:
            await self.read()
            await asyncio.sleep(self.interval_s)

    async def read(self) -> KVStats | None:
        """Read the page once; the report (also kept as `last`), or None when it could not be read."""
        where = f"GET {self.http.base_url}{self.path}"
        try:
            response = await abandon_after(self.http.client().get(self.path, timeout=self.timeout_s),
                                           self.timeout_s, where)
            response.raise_for_status()
        except Exception as e:  # the page is a hint for admission: a failure is said, never raised
            self._warn("read", f"{where} failed ({type(e).__name__}: {e or 'no details'}): no KV report for "
                               "rollout.concurrency auto until it answers")
            return None
        report = kv_from_metrics(response.text, self.names)
        if report is None:
            self._warn("names", f"{where} has none of {list(self.names.occupancy)}: no KV report for "
                                f"rollout.concurrency auto ({self.names.hint})")
            return None
        self.last = report
        return report

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("%s", message)
