"""Fault injection, for tests and `bench/faults.py`: hostile model output, silent servers, misbehaving envs.

- `adversarial_texts` / `fuzz_parsers`: strings built to break tool-call parsers (deep brackets, huge and
  non-finite numbers, NaN, lone surrogates, truncated and nested tags, mixed formats), and a run of every
  registered parser over them that counts exceptions and outputs that cannot go out as JSON.
- `SilentServer`: a TCP server that accepts connections, reads what is sent and never answers: the engine
  that hangs (a wedged GPU server) without refusing connections.
- `FaultyEnv`: an env whose steps raise, hang or return a NaN reward with given probabilities, drawn per
  trajectory from a seed (the same row always misbehaves the same way).
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from turnrl.types import StepResult, TerminationReason

# ---------------------------------------------------------------------------------------------------
# Hostile model output
# ---------------------------------------------------------------------------------------------------
_FRAGMENTS = (
    "<tool_call>", "</tool_call>", "<tool_call>\n", "\n</tool_call>", "<think>", "</think>", "<|channel>thought",
    "<channel|>", "<function=", "<function=f>", "<function=add>\n", "</function>", "<parameter=", "<parameter=x>",
    "<parameter=a>\n", "</parameter>", "{", "}", "[", "]", '"', "\\", '\\"', "\\u", "\\ud800", "\\udc00",
    "\\ud83d\\ude00", "\\u0000", ":", ",", '"name"', '"arguments"', '"parameters"', '"function"', '"id"', '"type"',
    "NaN", "-NaN", "Infinity", "-Infinity", "1e999", "-1e400", "1e-999", "0", "-0", "1.5", "-", "+1", "01", "1e",
    "null", "true", "false", "nul", "tru", " ", "\n", "\t", "\r\n", "\x00", "\x1b[31m", "é", "😀", "\u202e",
    "\u200b", "\ufeff", "\ud800", "\udfff", "中文", "x" * 300, ">", "<", "=", "'", "`", "#", "\\n",
)


def _valid_call(rng: random.Random) -> str:
    args = {"a": rng.randint(-10, 10), "s": rng.choice(["x", "é😀", ""]), "l": [1, [2, {"k": None}]]}
    if rng.random() < 0.5:
        return f"<tool_call>\n{json.dumps({'name': rng.choice(['add', 'f', '']), 'arguments': args})}\n</tool_call>"
    params = "".join(f"<parameter={k}>\n{json.dumps(v)}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={rng.choice(['add', 'f', ''])}>\n{params}</function>\n</tool_call>"


def _deep(rng: random.Random) -> str:
    depth = rng.choice([63, 64, 65, 200, 999, 1001, 5000, 100_000])
    open_, close = rng.choice([("[", "]"), ('{"a":', "}"), ('{"a":[', "]}")])
    inner = open_ * depth + rng.choice(["1", "", "NaN"]) + close * (depth if rng.random() < 0.7 else depth // 2)
    if rng.random() < 0.5:
        return f'<tool_call>{{"name": "f", "arguments": {inner}}}</tool_call>'
    if rng.random() < 0.5:
        return f"<tool_call><function=f><parameter=x>{inner}</parameter></function></tool_call>"
    return f'<tool_call>{{"name": "f", "arguments": {json.dumps(inner)}}}</tool_call>'


def _number(rng: random.Random) -> str:
    digits = rng.choice([4300, 4301, 5000, 20_000, 100_000])
    number = rng.choice(["", "-"]) + "9" * digits + rng.choice(["", ".5", "e5", "e999999"])
    if rng.random() < 0.5:
        return f'<tool_call>{{"name": "f", "arguments": {{"x": {number}}}, "id": {number}}}</tool_call>'
    return f"<tool_call><function=f><parameter=x>\n{number}\n</parameter></function></tool_call>"


def _non_finite(rng: random.Random) -> str:
    value = rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "[NaN]", '{"y": Infinity}'])
    if rng.random() < 0.5:
        return f'<tool_call>{{"name": "f", "arguments": {{"x": {value}}}}}</tool_call>'
    if rng.random() < 0.5:
        return f'<tool_call>{{"name": "f", "arguments": "{{\\"x\\": {value}}}"}}</tool_call>'
    return f"<tool_call><function=f><parameter=x>{value}</parameter></function></tool_call>"


def _mutated(rng: random.Random) -> str:
    text = list(_valid_call(rng))
    for _ in range(rng.randint(1, 6)):
        at = rng.randrange(len(text) + 1)
        kind = rng.random()
        if kind < 0.4:
            text[at:at] = [rng.choice(_FRAGMENTS)]
        elif kind < 0.7 and text:
            del text[min(at, len(text) - 1)]
        else:
            text = text[:at]  # truncated mid-call
    return "".join(text)


def _soup(rng: random.Random) -> str:
    return "".join(rng.choice(_FRAGMENTS) for _ in range(rng.randint(0, 40)))


def _nested(rng: random.Random) -> str:
    inner = _valid_call(rng)
    for _ in range(rng.randint(1, 50)):
        inner = rng.choice(["<tool_call>{}</tool_call>", "<think>{}</think>", "<tool_call>{}", "{}</tool_call>",
                            "<function=f>{}</function>", '{{"name": "f", "arguments": {}}}']).format(inner)
    return inner


def _repeated(rng: random.Random) -> str:
    fragment = rng.choice(_FRAGMENTS)
    return fragment * (rng.choice([1000, 10_000, 50_000]) // max(1, len(fragment) // 8)) + rng.choice(_FRAGMENTS)


_GENERATORS = ((_mutated, 32), (_soup, 26), (_valid_call, 10), (_nested, 11), (_non_finite, 12), (_deep, 4),
               (_number, 3), (_repeated, 2))


def adversarial_texts(n: int, seed: int = 0) -> Iterator[str]:
    """`n` hostile assistant replies, the same for the same seed (the mix is in `_GENERATORS`)."""
    rng = random.Random(seed)
    makers = [g for g, _ in _GENERATORS]
    weights = [w for _, w in _GENERATORS]
    for _ in range(n):
        yield rng.choices(makers, weights)[0](rng)


@dataclass
class FuzzReport:
    inputs: int = 0
    calls: int = 0
    """Parser calls made (parse and has_call_syntax of each parser, with and without tool schemas)."""
    exceptions: Counter = field(default_factory=Counter)
    """(parser, exception type) -> count."""
    bad_outputs: int = 0
    """Parsed calls whose name/arguments cannot be written as JSON (NaN, non-dict arguments...)."""
    tool_calls: int = 0
    parse_errors: int = 0
    slowest_s: float = 0.0
    slowest: str = ""
    """The parser and input (length, first characters) of the slowest call."""
    wall_s: float = 0.0
    examples: list[str] = field(default_factory=list)
    """The first few failures, each with the input's first characters."""

    @property
    def failures(self) -> int:
        return sum(self.exceptions.values()) + self.bad_outputs


_SCHEMAS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "string"}, "a": {"type": "integer"}}}}}]


def fuzz_parsers(n: int, seed: int = 0) -> FuzzReport:
    """Run every registered tool-call parser on `adversarial_texts(n, seed)` and count what went wrong."""
    from turnrl.tools.parsers import PARSERS

    parsers = [factory(schemas) for factory in PARSERS.values() for schemas in (None, _SCHEMAS)]
    report, start = FuzzReport(), time.perf_counter()
    for text in adversarial_texts(n, seed):
        report.inputs += 1
        for parser in parsers:
            t0 = time.perf_counter()
            _fuzz_one(parser, text, report)
            if (took := time.perf_counter() - t0) > report.slowest_s:
                report.slowest_s, report.slowest = took, f"{parser.name} on {len(text):,} chars {text[:40]!r}"
    report.wall_s = time.perf_counter() - start
    return report


def _fuzz_one(parser: Any, text: str, report: FuzzReport) -> None:
    report.calls += 2
    try:
        parser.has_call_syntax(text)
        result = parser.parse(text)
    except Exception as e:
        report.exceptions[(parser.name, type(e).__name__)] += 1
        if len(report.examples) < 5:
            report.examples.append(f"{parser.name}: {type(e).__name__}: {str(e)[:80]} on {text[:60]!r}")
        return
    report.tool_calls += len(result.calls)
    report.parse_errors += len(result.errors)
    for call in result.calls:
        try:
            if not isinstance(call.arguments, dict) or not isinstance(call.name, str):
                raise TypeError(f"arguments {type(call.arguments).__name__}, name {type(call.name).__name__}")
            json.dumps({"name": call.name, "arguments": call.arguments, "id": call.id}, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            report.bad_outputs += 1
            if len(report.examples) < 5:
                report.examples.append(f"{parser.name}: output {type(e).__name__}: {str(e)[:80]} on {text[:60]!r}")


# ---------------------------------------------------------------------------------------------------
# A server that never answers
# ---------------------------------------------------------------------------------------------------
class SilentServer:
    """Accepts TCP connections on 127.0.0.1, reads and discards what arrives, never answers, never closes.

        with SilentServer() as server:
            engine = HttpEngine(server.url)     # every request hangs until the client's own limit

    `answers`: the first requests that many get `200 {}` (a start-up health check passes), then the server goes
    silent: an engine that hangs in the middle of a run.
    """

    def __init__(self, answers: int = 0) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self.answers = answers
        self._open: list[socket.socket] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="turnrl-silent-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._listener.settimeout(0.05)
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                conn = None
            if conn is not None:
                conn.setblocking(False)
                self._open.append(conn)
                self.connections += 1
            for c in self._open:  # drain so the client's writes never block; answer nothing (or the first few)
                with contextlib.suppress(OSError):
                    if b"\r\n\r\n" in c.recv(65536) and self.answers > 0:
                        self.answers -= 1
                        c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        for c in [*self._open, self._listener]:
            c.close()

    def __enter__(self) -> SilentServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------
# Envs that misbehave
# ---------------------------------------------------------------------------------------------------
@dataclass
class Faults:
    """Per-step probabilities of each misbehaviour (drawn per trajectory and turn from `seed`)."""

    raise_p: float = 0.0
    hang_p: float = 0.0
    nan_p: float = 0.0
    hang_s: float = 3600.0
    """How long a hung step sleeps (a sync env sleeps in its thread: the call is abandoned, not killed)."""
    seed: int = 0
    injected: Counter = field(default_factory=Counter)
    """What was injected so far: raise, hang, nan (counted as the steps happen)."""


class FaultyEnv:
    """A sync, token-aware env (it sees every turn, cut or not) of `turns` steps, reward 1.0 at the end; each step
    may raise, hang or return a NaN reward."""

    def __init__(self, key: str, faults: Faults, turns: int = 2):
        self.key, self.faults, self.turns, self.turn = key, faults, turns, 0

    def step_turn(self, turn: Any) -> StepResult:
        self.turn += 1
        draw = random.Random(f"{self.faults.seed}/{self.key}/{self.turn}").random()
        f = self.faults
        if draw < f.raise_p:
            f.injected["raise"] += 1
            raise RuntimeError(f"injected env failure ({self.key} turn {self.turn})")
        if draw < f.raise_p + f.hang_p:
            f.injected["hang"] += 1
            time.sleep(f.hang_s)
        if draw < f.raise_p + f.hang_p + f.nan_p:
            f.injected["nan"] += 1
            return StepResult(reward=float("nan"), done=True, termination_reason=TerminationReason.ENV_DONE)
        if self.turn >= self.turns:
            return StepResult(reward=1.0, done=True, termination_reason=TerminationReason.ENV_DONE)
        return StepResult(f"step {self.turn} ok, go on")


def faulty_env_factory(faults: Faults, turns: int = 2) -> Any:
    """An env factory (`build_env(sample, config)`) of FaultyEnvs keyed by the row's `id`."""

    def build_env(sample: dict[str, Any], config: dict[str, Any]) -> FaultyEnv:
        return FaultyEnv(str(sample.get("id")), faults, turns)

    return build_env
