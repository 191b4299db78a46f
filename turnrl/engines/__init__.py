"""Inference engines: the `Engine` protocol (base.py) and its backends (embedded, http, sglang, vllm, router)."""

from __future__ import annotations

from typing import Any


def check_servers(engine: Any, timeout_s: float = 10.0) -> None:
    """Fail at start-up, naming the URL, when a server engine (or a replica behind a Router) does not answer at
    all: otherwise every trajectory of the first step fails on it, one by one. Any HTTP answer counts as alive."""
    import httpx

    from turnrl.engines.base import EngineError

    replicas = engine.engines().values() if hasattr(engine, "engines") else [engine]
    dead = []
    for replica in replicas:
        url = getattr(replica, "base_url", None)
        if url is None:
            continue  # in process: nothing to reach
        try:
            httpx.get(f"{url}/health", timeout=timeout_s)
        except httpx.HTTPError as e:
            dead.append(f"{url} ({type(e).__name__}: {e or 'no answer'})")
    if dead:
        raise EngineError(f"engine.urls: no answer from {', '.join(dead)}; start the server(s) or fix engine.urls")
