"""Test doubles: a scripted engine that speaks the real token-level contract with real tokenizers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from turnrl.types import FinishReason, GenerateOutput, SamplingParams


@dataclass
class Call:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class ScriptedEngine:
    """Replies with scripted text, encoded by a real tokenizer, followed by the end-of-turn token.

    `script(request_id, turn, prompt_text) -> str | None`: the reply of a call (None → raise EngineError-like
    failure). The reply is cut at `params.max_new_tokens` (finish_reason length) like a real engine.
    Logprobs are deterministic: token k of a reply gets -(k + 1) / 100.
    """

    tokenizer: object
    script: Callable[[str, int, str], str | None]
    end_token_id: int | None = None
    latency_s: float = 0.0
    calls: list[Call] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    policy_version: int = 0
    closed: int = 0
    """How many times close() was called."""

    def __post_init__(self):
        if self.end_token_id is None:
            self.end_token_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def turns_of(self, request_id: str) -> int:
        return sum(c.request_id == request_id for c in self.calls)

    async def generate(self, prompt_ids, params, *, request_id, images=None) -> GenerateOutput:
        turn = self.turns_of(request_id) + 1
        self.calls.append(Call(request_id, list(prompt_ids), params))
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        text = self.script(request_id, turn, self.tokenizer.decode(prompt_ids))
        if text is None:
            raise RuntimeError(f"scripted engine failure on {request_id} turn {turn}")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.end_token_id]
        finish = FinishReason.STOP
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], FinishReason.LENGTH
        logprobs = [-(k + 1) / 100 for k in range(len(ids))]
        return GenerateOutput(ids, logprobs, finish, policy_version=self.policy_version)

    async def update_weights(self, named_tensors, version=None) -> int:
        self.policy_version = self.policy_version + 1 if version is None else version
        return self.policy_version

    async def sleep(self) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    async def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def close(self) -> None:
        self.closed += 1

def script_the_cli(monkeypatch, tokenizer, script: Callable[[str, int, str], str | None]) -> list[ScriptedEngine]:
    """Make the public CLI (`turnrl rollout` through typer's CliRunner) generate with a ScriptedEngine in place of
    its embedded engine; returns the engines it built (their `calls` are what the model was asked)."""
    built: list[ScriptedEngine] = []

    def scripted(*args, **kwargs) -> ScriptedEngine:
        built.append(ScriptedEngine(tokenizer, script))
        return built[-1]

    monkeypatch.setattr("turnrl.engines.embedded.EmbeddedEngine", scripted)
    return built
