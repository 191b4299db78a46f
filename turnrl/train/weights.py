"""Whole weights out of the (sharded, LoRA-wrapped) policy, in Hugging Face names and in buckets: what weight
sync streams to the engines and what a Hugging Face export writes.

    for bucket in weight_buckets(weight_sources(policy), bucket_bytes, dtype, keep=parallel.is_main):
        if parallel.is_main: await engine.update_weights(bucket.tensors, version, final=bucket.final)

Each tensor is gathered from its shards on its own (`DTensor.full_tensor`, a collective: every rank walks
the same sources in the same order) and kept, cast to the engines' dtype, only on rank 0 and only until its
bucket is sent. Rank 0 so holds its shards plus one bucket (a tensor larger than a bucket goes alone), never
a second whole model; the other ranks hold one gathered tensor at a time.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from turnrl.train import lora
from turnrl.train.parallel import Parallel, full_tensor


@dataclass
class WeightSource:
    """One tensor the engines load: its Hugging Face name and how to make it whole (collective)."""

    name: str
    numel: int
    gather: Callable[[], torch.Tensor]


@dataclass
class Bucket:
    tensors: list[tuple[str, torch.Tensor]]  # empty on ranks that only take part in the gathers
    index: int  # 0..count-1
    count: int  # buckets in this pass
    nbytes: int

    @property
    def final(self) -> bool:
        return self.index == self.count - 1


def weight_sources(model: nn.Module, *, adapted_only: bool = False) -> list[WeightSource]:
    """Every parameter and persistent buffer under its HF name (a tied weight once), LoRA layers merged.
    `adapted_only`: just the merged weights of LoRA layers (what changes when only adapters train)."""
    layers = lora.adapted_layers(model)
    sources = [_merged_source(name, m) for name, m in layers]
    if adapted_only and layers:
        return sources
    skip = {id(p) for _, m in layers for p in (m.base_layer.weight, *m.lora_A.parameters(), *m.lora_B.parameters())}
    persistent = set(model.state_dict().keys())
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in persistent)]
    for name, t in tensors:
        if id(t) not in skip and ".lora_" not in name:
            sources.append(WeightSource(lora.hf_name(name), t.numel(), _gather(t)))
    return sources


def _gather(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: full_tensor(t.detach())


def _merged_source(name: str, layer: Any) -> WeightSource:  # a peft LoraLayer
    weight = layer.base_layer.weight

    def gather() -> torch.Tensor:
        a, b = (full_tensor(x[lora.ADAPTER].weight.detach()) for x in (layer.lora_A, layer.lora_B))
        return lora.merged_weight(full_tensor(weight.detach()), a, b, layer.scaling[lora.ADAPTER])

    return WeightSource(lora.hf_name(f"{name}.weight"), weight.numel(), gather)


def plan_buckets(names: list[str], sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of consecutive tensors grouped into buckets of at most `bucket_bytes`, a layer never split
    across two (engines such as vLLM reload fused layers, e.g. qkv, from all their parts at once); a layer
    larger than a bucket goes alone."""
    layers: list[list[int]] = []
    for i, name in enumerate(names):
        if layers and _layer_of(name) is not None and _layer_of(name) == _layer_of(names[layers[-1][0]]):
            layers[-1].append(i)
        else:
            layers.append([i])
    plan: list[list[int]] = []
    used = bucket_bytes
    for layer in layers:
        size = sum(sizes[i] for i in layer)
        if used + size > bucket_bytes:
            plan.append([])
            used = 0
        plan[-1].extend(layer)
        used += size
    return plan


def _layer_of(name: str) -> str | None:
    """`model.layers.3` for `model.layers.3.mlp.up_proj.weight`: the name up to its first number."""
    match = re.match(r"(.*?\.\d+)\.", name)
    return match.group(1) if match else None


def weight_buckets(sources: list[WeightSource], bucket_bytes: int, dtype: torch.dtype, *,
                   keep: bool = True) -> Iterator[Bucket]:
    """Gather `sources` in order, cast to `dtype`, in buckets of at most `bucket_bytes` (planned from the
    sizes up front, so the last bucket knows it is final). `keep=False`: gather (every rank must) but drop."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    plan = plan_buckets([s.name for s in sources], [s.numel * itemsize for s in sources], bucket_bytes)
    for k, members in enumerate(plan):
        tensors = []
        for i in members:
            whole = sources[i].gather()
            if keep:
                tensors.append((sources[i].name, whole.to(dtype)))
            del whole
        yield Bucket(tensors, k, len(plan), sum(sources[i].numel for i in members) * itemsize)


async def push_weights(engine: Any, model: nn.Module, parallel: Parallel, *, bucket_bytes: int,
                       dtype: torch.dtype, version: int, pause: str = "keep") -> dict[str, float]:
    """Stream the policy's weights to `engine` from rank 0 (`update_weights(bucket, version, final=...)` per
    bucket); every rank takes part in the gathers. With LoRA only the adapted layers' merged weights go.
    `pause` (weight_sync.pause) goes with the first bucket: what the engine's requests in flight do meanwhile;
    it is passed only when it is not the default `keep`, so any engine takes a default push.
    An engine error on rank 0 does not stop the gathers (the other ranks are inside them); every rank raises
    it at the end."""
    t0 = time.perf_counter()
    error: BaseException | None = None
    sent, buckets, largest, new_version = 0, 0, 0, version
    sources = weight_sources(model, adapted_only=True)
    for bucket in weight_buckets(sources, bucket_bytes, dtype, keep=parallel.is_main):
        if parallel.is_main and error is None:
            try:
                options: dict[str, Any] = {} if bucket.count == 1 else {"final": bucket.final}  # any engine takes 1
                if pause != "keep" and buckets == 0:
                    options["pause"] = pause
                new_version = await engine.update_weights(bucket.tensors, version=version, **options)
            except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
                error = e
        sent, buckets, largest = sent + bucket.nbytes, buckets + 1, max(largest, bucket.nbytes)
        del bucket
    failure, new_version = parallel.broadcast_object(
        (None if error is None else f"{type(error).__name__}: {error}", new_version))
    if failure is not None:
        if error is not None:
            raise error
        raise RuntimeError(f"weight sync failed on rank 0: {failure}")
    return {"train/policy_version": float(new_version), "time/weight_sync_s": time.perf_counter() - t0,
            "weight_sync/mb": sent / 2**20, "weight_sync/buckets": float(buckets),
            "weight_sync/largest_bucket_mb": largest / 2**20}
