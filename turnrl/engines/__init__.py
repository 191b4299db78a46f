"""Inference engines: the `Engine` protocol (base.py) and its backends (embedded, http, sglang, vllm, router)."""

from __future__ import annotations

from typing import Any


def build_server_engine(cfg: Any) -> Any:
    """An Engine for `engine.kind` http, sglang or vllm (with urls): one client per URL in `engine.urls`, behind a
    Router when there are several. `cfg` is a turnrl.config.EngineConfig; `weights_dir` is where SGLang and vLLM
    server clients write pushed weights for their servers to load (a sub-folder per replica)."""
    from turnrl.engines.router import Router

    if not cfg.urls:
        raise ValueError(f"engine.urls is required for engine.kind={cfg.kind!r} (one server URL per replica)")
    replicas: list[Any]
    probe = {"probe_after_s": cfg.probe_after_s, "probe_timeout_s": cfg.probe_timeout_s}
    if cfg.kind == "http":
        from turnrl.engines.http import HttpEngine

        replicas = [HttpEngine(url, **probe) for url in cfg.urls]
    elif cfg.kind == "sglang":
        from turnrl.engines.sglang import SGLangEngine

        replicas = [SGLangEngine(url, weights_dir=_replica_dir(cfg, i), **probe) for i, url in enumerate(cfg.urls)]
    elif cfg.kind == "vllm":
        from turnrl.engines.vllm import VLLMServerEngine

        replicas = [VLLMServerEngine(url, weights_dir=_replica_dir(cfg, i), **probe) for i, url in enumerate(cfg.urls)]
    else:
        raise ValueError(f"engine.kind={cfg.kind!r} has no server client here; use http, sglang or vllm")
    return replicas[0] if len(replicas) == 1 else Router(replicas)


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


def _replica_dir(cfg: Any, index: int) -> str | None:
    """A folder per replica: they write concurrently when the router broadcasts an update."""
    if cfg.weights_dir is None:
        return None
    return cfg.weights_dir if len(cfg.urls) == 1 else f"{cfg.weights_dir}/replica{index}"
