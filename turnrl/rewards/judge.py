"""LLM-as-judge rewards: a judge model behind any `Engine` scores a trajectory, or one turn of it inside an env.

    reward:
      function: judge
      judge:
        model: smollm2-135m-instruct       # the judge's tokenizer and chat template (its weights when embedded)
        engine: {kind: embedded}           # or http / vllm / sglang servers (engine.urls), vllm in process
        template: |                        # Jinja over the trajectory's messages and the dataset row
          Question: {{ question }}
          Reply: {{ response }}
          Is the reply correct? Answer with "Score: 1" or "Score: 0".
        score_range: [0, 1]

The template sees `messages` (the conversation, assistant text decoded from its tokens), `conversation` (the
same as `role: text` lines), `response` (the last assistant reply), `responses`, `sample` (the row), every
column of the row by its own name, and what a caller passes as extra keywords (an env: `reply`, `turn`...).
A name the template uses and nothing provides is an error that names it (StrictUndefined).

What a score is, and what it never is:
- the judge's reply (reasoning blocks removed) is parsed by `score_pattern` (its last match) or, with `labels`,
  by the last label word it contains (`{"yes": 1, "no": 0}`);
- a reply without a score, a score outside `score_range`, an engine failure or a call past `timeout_s` is a
  `JudgeError`: as a reward function the trajectory's reward stays None with `reward_error` saying why (never a
  silent 0.0); inside an env the step fails (the trajectory ends FAILED/env_error);
- the score is normalised to [0, 1] by `score_range` unless `normalize` is false.

Cost: at most `max_concurrency` judge calls are in flight, and engines batch those (the embedded engine and
vLLM decode them together). Identical prompts are judged once: verdicts are cached by the SHA-256 of (judge
model, sampling, rendered prompt), in memory and, with `cache_path`, in a JSONL file that later runs reuse;
concurrent identical prompts share one call. Failures are not cached.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.reasoning import strip_reasoning
from turnrl.types import Message, SamplingParams, Trajectory

log = logging.getLogger(__name__)

DEFAULT_SCORE_PATTERN = r"(?i)score\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)"


class JudgeError(RuntimeError):
    """The judge gave no usable score (the message says why and shows its reply)."""


@dataclass
class Verdict:
    score: float
    """The reward: `raw` normalised to [0, 1] by score_range (or `raw` itself without normalisation)."""
    raw: float
    """The score as the judge wrote it (or the value of its label)."""
    text: str
    """The judge's reply."""
    cached: bool = False


class Judge:
    """Scores conversations with a judge model; a Judge is also a reward function (`await judge(trajectory)`).

    `engine` is any turnrl Engine serving the judge, `renderer` its chat template (a ChatRenderer);
    `turnrl.build.build_judge` makes both from a JudgeConfig. See the module docstring for the rest."""

    def __init__(self, engine: Any, renderer: Any, template: str, *, system: str | None = None,
                 score_pattern: str = DEFAULT_SCORE_PATTERN, labels: Mapping[str, float] | None = None,
                 score_range: tuple[float, float] = (0.0, 10.0), normalize: bool = True,
                 sampling: SamplingParams | None = None, max_concurrency: int = 16, timeout_s: float | None = 60.0,
                 cache: bool = True, cache_path: str | Path | None = None, name: str = "judge",
                 owns_engine: bool = True):
        import jinja2.sandbox

        self.engine, self.renderer, self.system, self.name = engine, renderer, system, name
        env = jinja2.sandbox.SandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        try:
            self.template = env.from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"judge template: {e.message} (line {e.lineno})") from None
        self.pattern = re.compile(score_pattern)
        if self.pattern.groups < 1 and not labels:
            raise ValueError(f"judge score_pattern {score_pattern!r} needs a group that captures the number")
        self.labels = {k.lower(): float(v) for k, v in (labels or {}).items()}
        lo, hi = score_range
        if not hi > lo:
            raise ValueError(f"judge score_range must be [low, high] with high > low, got {list(score_range)}")
        self.score_range, self.normalize = (float(lo), float(hi)), normalize
        self.sampling = sampling or SamplingParams(temperature=0.0, max_new_tokens=256)
        self.timeout_s, self.owns_engine = timeout_s, owns_engine
        self.max_concurrency = max_concurrency
        self._slots: tuple[Any, asyncio.Semaphore] | None = None  # (event loop, its semaphore)
        self.cache_enabled = cache
        self.cache_path = Path(cache_path) if cache_path else None
        self._cache: dict[str, tuple[float, str]] = self._load_cache() if cache else {}
        self._inflight: dict[str, asyncio.Task] = {}
        self.stats = {"calls": 0, "cache_hits": 0, "errors": 0}
        self._ids = 0

    # ---- the prompt ------------------------------------------------------------------------------
    def prompt(self, messages: list[Message], sample: Mapping[str, Any] | None = None, **extra: Any) -> str:
        """The judge's user message for a conversation (the template rendered, see the module docstring)."""
        import jinja2

        sample = dict(sample or {})
        responses = [_text(m.get("content")) for m in messages if m.get("role") == "assistant"]
        names = {**sample, "sample": sample, "messages": messages, "responses": responses,
                 "response": responses[-1] if responses else "",
                 "conversation": "\n".join(f"{m.get('role')}: {_text(m.get('content'))}" for m in messages), **extra}
        try:
            return self.template.render(**names)
        except jinja2.UndefinedError as e:
            raise JudgeError(f"{self.name}: the template uses {(e.message or '').split(' is undefined')[0]}, which is "
                             f"neither a column of the row ({sorted(sample)}) nor a judge variable "
                             "(messages, conversation, response, responses, sample)") from None

    # ---- scoring --------------------------------------------------------------------------------
    async def score(self, messages: list[Message], sample: Mapping[str, Any] | None = None, **extra: Any) -> Verdict:
        """The judge's verdict on `messages` (raises JudgeError when it gives no usable score)."""
        text = self.prompt(messages, sample, **extra)
        key = self._key(text)
        if self.cache_enabled and key in self._cache:
            self.stats["cache_hits"] += 1
            raw, reply = self._cache[key]
            return Verdict(self._normalised(raw), raw, reply, cached=True)
        task = self._inflight.get(key)
        if task is not None and task.get_loop() is not asyncio.get_running_loop():
            task = None  # a call left in flight by another event loop
        if task is None:
            task = self._inflight[key] = asyncio.ensure_future(self._judge(key, text))
            task.add_done_callback(lambda _: self._inflight.pop(key, None))
        else:
            self.stats["cache_hits"] += 1
        raw, reply = await asyncio.shield(task)
        return Verdict(self._normalised(raw), raw, reply)

    async def __call__(self, trajectory: Trajectory) -> float:
        """A reward function: the verdict on the whole trajectory."""
        return (await self.score(trajectory.messages, trajectory.sample)).score

    async def _judge(self, key: str, text: str) -> tuple[float, str]:
        async with self._semaphore():
            reply = await self._generate(text)
        try:
            raw = self.parse(reply)
        except JudgeError:
            self.stats["errors"] += 1
            raise
        if self.cache_enabled:
            self._store(key, raw, reply)
        return raw, reply

    async def _generate(self, text: str) -> str:
        messages: list[Message] = [{"role": "system", "content": self.system}] if self.system else []
        ids = self.renderer.initial_ids([*messages, {"role": "user", "content": text}])
        params = SamplingParams(temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                top_k=self.sampling.top_k, seed=self.sampling.seed,
                                max_new_tokens=self.sampling.max_new_tokens,
                                stop_token_ids=tuple(sorted(self.renderer.end_of_turn_ids)))
        self._ids += 1
        request_id = f"{self.name}-{self._ids}"
        self.stats["calls"] += 1
        try:
            out = await asyncio.wait_for(self.engine.generate(ids, params, request_id=request_id), self.timeout_s)
        except TimeoutError:
            self.stats["errors"] += 1
            raise JudgeError(f"{self.name}: no verdict within timeout_s={self.timeout_s}") from None
        except Exception as e:
            self.stats["errors"] += 1
            raise JudgeError(f"{self.name}: the judge engine failed: {type(e).__name__}: {e}") from e
        finally:
            try:
                await self.engine.release(request_id)
            except Exception as e:  # releasing a cache entry never decides a verdict
                log.warning("%s: engine.release(%s) raised %r", self.name, request_id, e)
        return self.renderer.assistant_text(out.token_ids)

    def _semaphore(self) -> asyncio.Semaphore:
        """`max_concurrency` slots on the running event loop (a semaphore belongs to one loop; a judge may serve
        several asyncio.run calls)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(self.max_concurrency))
        return self._slots[1]

    def parse(self, reply: str) -> float:
        """The raw score in the judge's reply (JudgeError when there is none or it is out of range)."""
        body = strip_reasoning(reply)
        if self.labels:
            words = re.findall(r"[\w-]+", body.lower())
            found = [w for w in words if w in self.labels]
            if not found:
                raise JudgeError(f"{self.name}: the reply has none of the labels {sorted(self.labels)}: {reply[:200]!r}")
            return self.labels[found[-1]]
        matches = self.pattern.findall(body)
        if not matches:
            raise JudgeError(f"{self.name}: no score in the reply (score_pattern {self.pattern.pattern!r}): "
                             f"{reply[:200]!r}")
        last = matches[-1]
        raw = float(last[0] if isinstance(last, tuple) else last)
        lo, hi = self.score_range
        if not lo <= raw <= hi:
            raise JudgeError(f"{self.name}: score {raw:g} is outside score_range [{lo:g}, {hi:g}]: {reply[:200]!r}")
        return raw

    def _normalised(self, raw: float) -> float:
        lo, hi = self.score_range
        return (raw - lo) / (hi - lo) if self.normalize else raw

    # ---- the cache ------------------------------------------------------------------------------
    def _key(self, text: str) -> str:
        s = self.sampling
        ident = [self.name, self.system, s.temperature, s.top_p, s.top_k, s.seed, s.max_new_tokens, text]
        return hashlib.sha256(json.dumps(ident).encode()).hexdigest()

    def _load_cache(self) -> dict[str, tuple[float, str]]:
        if self.cache_path is None or not self.cache_path.exists():
            return {}
        cache = {}
        for n, line in enumerate(self.cache_path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                row = json.loads(line)
                cache[row["key"]] = (float(row["raw"]), row["text"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                log.warning("%s: judge cache line %d is unreadable; ignored", self.cache_path, n)
        return cache

    def _store(self, key: str, raw: float, reply: str) -> None:
        self._cache[key] = (raw, reply)
        if self.cache_path is not None:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.cache_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"key": key, "raw": raw, "text": reply}) + "\n")

    def close(self) -> None:
        """Stop the judge's engine (when this judge built it); a second call does nothing."""
        if self.owns_engine:
            self.owns_engine = False
            self.engine.close()


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") if p.get("type") == "text" else "<image>" for p in content)
    return "" if content is None else str(content)
