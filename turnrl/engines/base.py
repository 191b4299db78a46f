"""The engine contract: token ids in, token ids and sampling logprobs out.

Never chat text: a decode/encode round trip changes tokens, and RL must train on exactly the tokens the
policy sampled. Every backend (embedded, vLLM, SGLang, remote HTTP) and the router implement `Engine`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from turnrl.types import GenerateOutput, SamplingParams

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

PAUSE_MODES = ("keep", "wait", "abort")
"""What requests in flight do at a weight update (`update_weights(..., pause=...)`, config weight_sync.pause)."""


@dataclass(frozen=True)
class Recording:
    """What an engine reports beside tokens and logprobs, where it can (docs/off-policy.md)."""

    sampling_mask: bool = False
    """Each token's kept set under top-k / top-p (`GenerateOutput.kept_counts`; rollout.sampling_mask)."""
    routing: bool = False
    """The MoE experts chosen for every token fed (`GenerateOutput.routed_experts`; rollout.router_replay)."""


@dataclass(frozen=True)
class KVStats:
    """What an engine reports of its KV cache, where it can (`kv_stats()`): adaptive admission reads it
    (turnrl.rollout.admission, `rollout.concurrency: auto`)."""

    occupancy: float
    """The fraction of the KV cache in use, 0 to 1."""
    preemptions: int
    """Requests (or cached prefixes of live trajectories) evicted so far, each to be recomputed: cumulative."""


def kv_stats(engine: Any) -> KVStats | None:
    """The engine's `kv_stats()` (an optional method), or None for an engine that reports none. A router
    reports over its replicas (the fullest one's occupancy, the sum of preemptions)."""
    report = getattr(engine, "kv_stats", None)
    return report() if callable(report) else None


class EngineError(RuntimeError):
    """An engine failed to serve a request (the driver ends that trajectory as FAILED/engine_error)."""


class InvalidRequest(EngineError, ValueError):
    """The request itself is wrong (a token id outside the vocabulary, a sampling field of the wrong type, images
    for a text model, a prompt longer than the context): no engine could serve it. It is refused before it joins
    a batch, so it fails alone; a router does not retry it elsewhere; a server answers it with a 4xx naming
    `param`, the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def check_pause(pause: str) -> str:
    """`pause` if it is one of PAUSE_MODES, else InvalidRequest naming it."""
    if pause not in PAUSE_MODES:
        raise InvalidRequest(f"update_weights: pause must be one of {', '.join(PAUSE_MODES)}, got {pause!r}", "pause")
    return pause


@runtime_checkable
class Engine(Protocol):
    """What the turn loop and the trainer need from an inference backend.

    `request_id` is the trajectory id: every turn of a trajectory uses the same id, so a router can keep
    the trajectory on one replica (prefix-cache reuse) and an engine can reuse that request's KV cache.
    """

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        images: list[Any] | None = None,
    ) -> GenerateOutput:
        """Sample a continuation of `prompt_ids` (with `images`, in order, for a VLM)."""
        ...

    async def update_weights(self, named_tensors: NamedTensors, version: int | None = None, *,
                             final: bool = True) -> int:
        """Load new weights (name -> tensor, HF parameter names; any subset of the model's). Returns the
        policy version (the new one after a final call).

        A trainer streaming a large model sends it in buckets: every call but the last has `final=False`,
        and the engine takes the version (and drops caches computed with the old weights) at the final
        call. Between the first and the final bucket the weights are half old, half new: backends that
        can hold generation meanwhile do (embedded); trainers sync between rollout phases anyway.

        An engine that takes `pause=` (one of PAUSE_MODES, with the first bucket) applies it to its requests in
        flight: keep (in place, KV kept, later tokens from the new weights: `GenerateOutput.token_versions`),
        wait (finish them on the old weights first), abort (return their tokens so far as `preempted`, for the
        caller to resubmit). Callers pass it only when it is not `keep`, so an engine without it takes any
        default push; one that cannot honour a mode raises InvalidRequest naming it."""
        ...

    async def sleep(self) -> None:
        """Free what the backend can (KV cache, weights) between rollout phases; no-op where unsupported."""
        ...

    async def wake_up(self) -> None:
        """Undo `sleep`."""
        ...

    async def release(self, request_id: str) -> None:
        """The trajectory `request_id` is finished: drop anything cached for it (sticky entries, KV)."""
        ...

    def close(self) -> None:
        """Stop what the engine runs (threads, actors, client connections); a second call does nothing.
        Synchronous: it runs after the event loops that used the engine have finished."""
        ...
