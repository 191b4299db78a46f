"""The server input matrix: bad requests fired at a real `turnrl serve` process, with the statuses it answered.

Starts `turnrl serve --model tiny-qwen3` on a free port (default --max-body-mb 8), then sends, to every API
(token-level /generate, OpenAI chat, Responses, Anthropic messages, the session routes):

- one request per client error (wrong types, NaN, empty or too long prompts, images to a text model, ids outside
  the vocabulary, unknown fields and routes, a 50 MB body), each expected to be a 4xx;
- 10 good /generate requests at once with 2 bad ones among them (before: the bad ones failed all 10);
- `max_new_tokens: 10**9` on /generate (capped to the context, and the response says so; every token is a stop
  token there, so the engine returns after one token);
- /health probed while a 4 MB conversation is tokenised (before: the event loop was blocked for the whole of it).

Prints one table row per request (expected class, status, time) and the totals; exits 1 if any client error got
a 5xx or any expectation failed.

    python bench/serve_inputs.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

GEN = {"prompt_ids": [1, 2, 3], "request_id": "r", "sampling": {"temperature": 0.0, "max_new_tokens": 4}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
RESP = {"model": "m", "input": "hi", "max_output_tokens": 4}
MSG = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
LONG = "word " * 41_000  # over tiny-qwen3's context (8,192 tokens)


def sampling(**fields) -> dict:
    return {**GEN, "sampling": {**GEN["sampling"], **fields}}


CASES: list[tuple[str, str, str, object]] = [  # (name, method, path, JSON body or raw bytes)
    ("string temperature", "POST", "/generate", sampling(temperature="x")),
    ("NaN temperature", "POST", "/generate", sampling(temperature=float("nan"))),
    ("string max_new_tokens", "POST", "/generate", sampling(max_new_tokens="5")),
    ("max_new_tokens [1]", "POST", "/generate", sampling(max_new_tokens=[1])),
    ("seed 'x'", "POST", "/generate", sampling(seed="x")),
    ("stop_token_ids 5", "POST", "/generate", sampling(stop_token_ids=5)),
    ("top_k 'x'", "POST", "/generate", sampling(top_k="x")),
    ("empty prompt", "POST", "/generate", {**GEN, "prompt_ids": []}),
    ("negative id", "POST", "/generate", {**GEN, "prompt_ids": [-1]}),
    ("boolean id", "POST", "/generate", {**GEN, "prompt_ids": [True]}),
    ("out-of-vocabulary id", "POST", "/generate", {**GEN, "prompt_ids": [10**7]}),
    ("prompt longer than the context", "POST", "/generate", {**GEN, "prompt_ids": [1] * 41_000}),
    ("images to a text model", "POST", "/generate", {**GEN, "images": ["a.png"]}),
    ("body not JSON", "POST", "/generate", b"{oops"),
    ("chat: string temperature", "POST", "/v1/chat/completions", {**CHAT, "temperature": "x"}),
    ("chat: NaN temperature", "POST", "/v1/chat/completions", {**CHAT, "temperature": float("nan")}),
    ("chat: max_tokens [1]", "POST", "/v1/chat/completions", {**CHAT, "max_tokens": [1]}),
    ("chat: seed 'x'", "POST", "/v1/chat/completions", {**CHAT, "seed": "x"}),
    ("chat: stop 5", "POST", "/v1/chat/completions", {**CHAT, "stop": 5}),
    ("chat: top_k 'x'", "POST", "/v1/chat/completions", {**CHAT, "top_k": "x"}),
    ("chat: empty messages", "POST", "/v1/chat/completions", {**CHAT, "messages": []}),
    ("chat: image to a text model", "POST", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
    ("chat: prompt longer than the context", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": LONG}]}),
    ("chat: stream 'yes'", "POST", "/v1/chat/completions", {**CHAT, "stream": "yes"}),
    ("responses: input 5", "POST", "/v1/responses", {**RESP, "input": 5}),
    ("responses: web_search tool", "POST", "/v1/responses", {**RESP, "tools": [{"type": "web_search"}]}),
    ("responses: max_output_tokens 'x'", "POST", "/v1/responses", {**RESP, "max_output_tokens": "x"}),
    ("messages: no max_tokens", "POST", "/v1/messages", {k: v for k, v in MSG.items() if k != "max_tokens"}),
    ("messages: image block", "POST", "/v1/messages", {**MSG, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}),
    ("messages: top_k 'x'", "POST", "/v1/messages", {**MSG, "top_k": "x"}),
    ("session: POST .../v1/responses (was 405)", "POST", "/sessions/s1/v1/responses", RESP),
    ("session: DELETE .../v1/responses", "DELETE", "/sessions/s1/v1/responses", None),
    ("unknown route /v1/completions", "POST", "/v1/completions", {}),
    ("unknown session", "GET", "/sessions/nope/trajectories", None),
    ("reward: not a number", "POST", "/sessions/s1/reward", {"reward": "high"}),
    ("50 MB chat body", "POST", "/v1/chat/completions", None),  # built below
]
GOOD = {"session: POST .../v1/responses (was 405)"}  # the requests that must succeed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    turnrl = str(Path(sys.executable).with_name("turnrl"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([turnrl, "serve", "--model", "tiny-qwen3", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"turnrl serve did not start: {proc.stderr.read()[-2000:]}")


def send(client: httpx.Client, method: str, path: str, body: object) -> tuple[int, str, float]:
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    t0 = time.perf_counter()
    try:
        response = client.request(method, path, content=content, headers={"content-type": "application/json"})
    except httpx.HTTPError as e:  # no answer at all (the connection was dropped): worse than a 5xx
        return 599, f"no answer: {type(e).__name__}", time.perf_counter() - t0
    elapsed = time.perf_counter() - t0
    try:
        payload = response.json()
        error = payload.get("error") or {}
        detail = error.get("param") or error.get("type") or ""
    except ValueError:
        detail = response.text[:40]
    return response.status_code, str(detail), elapsed


def concurrency(url: str) -> tuple[list[int], bool]:
    """10 good /generate requests at once with 2 bad ones among them."""
    import asyncio

    async def fire():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            good = [client.post("/generate", json={**sampling(max_new_tokens=8), "request_id": f"g{i}"})
                    for i in range(10)]
            bad = [client.post("/generate", json={**GEN, "prompt_ids": [10**7], "request_id": "oov"}),
                   client.post("/generate", json={**sampling(top_k="x"), "request_id": "k"})]
            return await asyncio.gather(bad[0], *good, bad[1])

    responses = asyncio.run(fire())
    tokens = {tuple(r.json()["token_ids"]) for r in responses[1:11] if r.status_code == 200}
    return [r.status_code for r in responses], len(tokens) == 1


def health_while_tokenising(url: str) -> tuple[float, int, float]:
    """(max /health latency, status of the 4 MB chat, its time) while that conversation is tokenised."""
    body = {**CHAT, "messages": [{"role": "user", "content": "lorem ipsum dolor sit amet " * 150_000}]}
    result: dict = {}

    def post() -> None:
        t0 = time.perf_counter()
        result["status"] = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).status_code
        result["time"] = time.perf_counter() - t0

    worker = threading.Thread(target=post)
    worker.start()
    time.sleep(0.5)
    latencies = []
    while worker.is_alive():
        t0 = time.perf_counter()
        httpx.get(f"{url}/health", timeout=60)
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.2)
    worker.join()
    return max(latencies or [0.0]), result["status"], result["time"]


def main() -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port)
    console = Console(width=150)
    table = Table(title=f"turnrl serve --model tiny-qwen3 (127.0.0.1:{port}): server input matrix")
    for column in ("request", "path", "expected", "status", "param / type", "s"):
        table.add_column(column)
    failures, server_errors = 0, 0
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            for name, method, path, body in CASES:
                if name == "50 MB chat body":
                    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 50_000_000}]}).encode()
                status, detail, elapsed = send(client, method, path, body)
                expected = "2xx" if name in GOOD else "4xx"
                ok = (200 <= status < 300) if expected == "2xx" else (400 <= status < 500)
                failures += not ok
                server_errors += status >= 500
                table.add_row(name, f"{method} {path}", expected, f"[{'green' if ok else 'red'}]{status}", detail,
                              f"{elapsed:.2f}")
            capped = client.post("/generate", json={**GEN, "sampling": {"max_new_tokens": 10**9,
                                                                        "stop_token_ids": list(range(151_936))}})
            warning = (capped.json().get("warnings") or ["none"])[0]
            ok = capped.status_code == 200 and "capped" in warning
            failures += not ok
            table.add_row("max_new_tokens 10**9", "POST /generate", "capped + warning", str(capped.status_code),
                          warning[:60], f"{capped.elapsed.total_seconds():.2f}")
        statuses, same = concurrency(url)
        ok = statuses == [422] + [200] * 10 + [422] and same
        failures += not ok
        table.add_row("10 good + 2 bad at once", "POST /generate", "10x200, 2x422",
                      " ".join(map(str, statuses)), "good ones identical" if same else "good ones differ", "")
        latency, status, took = health_while_tokenising(url)
        ok = latency < 0.5 and status == 400  # 4 MB of text is far past the 8,192-token context
        failures += not ok
        table.add_row("/health during a 4 MB chat", "GET /health", "< 0.5 s", f"max {latency:.3f} s",
                      f"the chat: {status} after {took:.1f} s", "")
    finally:
        proc.terminate()
        proc.wait(30)
    console.print(table)
    client_errors = sum(1 for name, *_ in CASES if name not in GOOD)
    console.print(f"client errors: {client_errors} requests, 5xx answers: {server_errors}; "
                  f"expectations failed: {failures}")
    return 1 if failures or server_errors else 0


if __name__ == "__main__":
    sys.exit(main())
