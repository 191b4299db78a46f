"""Mixture-of-experts routing: record which experts a model's routers chose, and force those choices again.

Router replay (R3, "rollout routing replay"): an MoE policy's engine and trainer compute the router logits with
slightly different numbers (kernels, batch shapes, dtype), and where two experts score almost alike they pick
different ones: the trainer then scores a token through other experts than those that sampled it, and its
logprob differs far more than a dense model's would. The engine records its choices (`RoutingRecorder`), the
trajectory stores them (`Trajectory.routed_experts`), and the trainer forces them (`replay_routing`): each router
still computes its softmax, and the gate values of the forced experts are read from it, so the router's weights
keep their gradients; only the top-k *selection* is replaced.

Where it hooks: the router module of transformers' MoE blocks, the narrowest point that decides the experts.
In transformers 5.x these routers share one shape, `forward(hidden [tokens, hidden]) -> (router_logits
[tokens, experts], scores [tokens, top_k], indices [tokens, top_k])`, computed as softmax over the logits, top-k,
and (where `norm_topk_prob`, or always for the routers without that attribute) the kept scores divided by their
sum. `ROUTER_CLASSES` lists the ones checked against the installed sources: Qwen3-MoE, Qwen2-MoE, Qwen3-Next,
Qwen3.5-MoE, Qwen3-VL-MoE's and Qwen3-Omni-MoE's text routers, OLMoE, FlexOlmo, Mixtral, MiniMax. Routers that
add a bias or group-limited selection (DeepSeek-V3, GLM-4.5 MoE, GPT-OSS's) compute other scores and are not
covered. A forward hook on the router replaces its output, so it works through FSDP2 (the hook runs inside the
sharded layer's forward), LoRA (peft wraps the linear layers, not the router) and any packing of the sequence.
"""

from __future__ import annotations

import base64
import contextlib
import threading
from collections.abc import Iterator
from typing import cast

import torch
import torch.nn.functional as F

ROUTER_CLASSES = frozenset({
    "Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "Qwen3NextTopKRouter", "Qwen3_5MoeTopKRouter",
    "Qwen3VLMoeTextTopKRouter", "Qwen3OmniMoeTextTopKRouter", "Qwen3OmniMoeThinkerTextTopKRouter",
    "Qwen3OmniMoeTalkerTextTopKRouter", "OlmoeTopKRouter", "FlexOlmoTopKRouter", "MixtralTopKRouter",
    "MiniMaxTopKRouter",
})
"""Router classes whose forward is softmax → top-k → optional renormalisation (see the module docstring)."""

UNROUTED = -1
"""A routing row the engine did not record (the last token of a call, a gap): the trainer routes it itself."""


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order (empty for a dense model). Raises ValueError for an MoE block whose
    router is not one of ROUTER_CLASSES (its choices could not be replayed exactly)."""
    routers = [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]
    if not routers:
        unknown = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Router")})
        if unknown:
            raise ValueError(f"{type(model).__name__}: router replay supports {sorted(ROUTER_CLASSES)}, not "
                             f"{unknown}")
    return routers


def routing_shape(config) -> tuple[int, int]:
    """(MoE layers, experts per token) of a model from its transformers config alone: the model is built on the
    meta device, so no weights load."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router: router replay is for MoE policies")
    return len(routers), router_top_k(routers[0])


def router_top_k(router: torch.nn.Module) -> int:
    """Experts per token of a router of ROUTER_CLASSES (its `top_k` attribute)."""
    return cast(int, router.top_k)  # an int attribute (nn.Module types every attribute as Tensor | Module)


def is_moe(model: torch.nn.Module) -> bool:
    return any(type(m).__name__ in ROUTER_CLASSES for m in model.modules())


class RoutingRecorder:
    """Records the experts a model's routers choose in the forwards run inside `capture()` on this thread.

        recorder = RoutingRecorder(model)
        with recorder.capture():
            model(...)
        experts_N_L_K = recorder.take()   # rows: the forward's flattened tokens (batch-major), L: MoE layers
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router: there is no routing to record")
        self._layers: list[torch.Tensor | None] = [None] * len(self.routers)
        self._thread: int | None = None
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self._thread == threading.get_ident():  # another thread's forward of a shared model: not ours
                self._layers[layer] = output[2].detach().to(torch.int16)
        return hook

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        self._thread = threading.get_ident()
        try:
            yield
        finally:
            self._thread = None

    def take(self) -> torch.Tensor:
        """[tokens, layers, top_k] int16 of the last captured forward."""
        if any(t is None for t in self._layers):
            raise RuntimeError("RoutingRecorder.take: no complete forward was captured")
        experts = torch.stack([t for t in self._layers if t is not None], dim=1)
        self._layers = [None] * len(self.routers)
        return experts

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, experts_N_L_K: torch.Tensor) -> Iterator[None]:
    """Force the routers of `model` to choose `experts_N_L_K` for the N flattened tokens of each forward inside
    the block (rows of UNROUTED keep the router's own choice). Hold the block around the backward pass too when
    activation checkpointing recomputes the forward there.

    The gate value of each forced expert is the router's own softmax probability of it (renormalised over the k
    forced experts where the router renormalises), so the router's weights still get gradients."""
    routers = moe_routers(model)
    if experts_N_L_K.dim() != 3 or experts_N_L_K.shape[1] != len(routers):
        raise ValueError(f"replay_routing: expected experts [tokens, {len(routers)} MoE layers, top_k], got "
                         f"{tuple(experts_N_L_K.shape)}")
    handles = [r.register_forward_hook(_forced(experts_N_L_K[:, i].long(), i)) for i, r in enumerate(routers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _forced(forced_N_K: torch.Tensor, layer: int):
    def hook(module, args, output):
        logits_N_E, scores_N_K, own_N_K = output
        if forced_N_K.shape != own_N_K.shape:
            raise ValueError(f"replay_routing: MoE layer {layer} routes {tuple(own_N_K.shape)} (tokens, top_k) but "
                             f"the replayed routing is {tuple(forced_N_K.shape)}")
        forced = forced_N_K.to(own_N_K.device)
        chosen_N_K = torch.where(forced >= 0, forced, own_N_K)
        gates_N_K = F.softmax(logits_N_E.float(), dim=-1).gather(-1, chosen_N_K)
        if getattr(module, "norm_topk_prob", True):
            gates_N_K = gates_N_K / gates_N_K.sum(dim=-1, keepdim=True)
        return logits_N_E, gates_N_K.to(scores_N_K.dtype), chosen_N_K
    return hook


def merge_routing(current: torch.Tensor | None, start: int, rows: torch.Tensor) -> torch.Tensor:
    """A token stream's routing after a call reported `rows` from stream position `start`: the rows replace what
    was there (a re-prefill under the same weights routes again), a gap before `start` is UNROUTED."""
    rows = rows.to(torch.int16)
    if current is None:
        current = rows.new_full((0, *rows.shape[1:]), UNROUTED)
    if current.shape[1:] != rows.shape[1:]:
        raise ValueError(f"routing rows of shape {tuple(rows.shape[1:])} do not match the stream's "
                         f"{tuple(current.shape[1:])} (layers, top_k)")
    end = max(current.shape[0], start + rows.shape[0])
    out = current.new_full((end, *rows.shape[1:]), UNROUTED)
    out[: current.shape[0]] = current
    out[start : start + rows.shape[0]] = rows
    return out


def encode_routing(experts: torch.Tensor) -> dict:
    """`{dtype, shape, data}` for JSON: uint8 (255 = unrouted) when every id fits, else int16 (-1 = unrouted), as
    base64 of the little-endian bytes, row-major [token, layer, k]."""
    experts = experts.to(torch.int16).contiguous()
    if experts.numel() == 0 or int(experts.max()) < 255:
        data, dtype = torch.where(experts < 0, 255, experts).to(torch.uint8), "uint8"
    else:
        data, dtype = experts, "int16"
    raw = data.numpy().astype("<i2" if dtype == "int16" else "u1").tobytes()
    return {"dtype": dtype, "shape": list(experts.shape), "data": base64.b64encode(raw).decode("ascii")}


def decode_routing(row: dict) -> torch.Tensor:
    """The [tokens, layers, k] int16 tensor of `encode_routing`'s dict (-1 = unrouted)."""
    import numpy as np

    dtypes: dict[str, np.dtype] = {"uint8": np.dtype("u1"), "int16": np.dtype("<i2")}
    dtype = dtypes.get(row.get("dtype", ""))
    if dtype is None:
        raise ValueError(f"routed_experts.dtype must be uint8 or int16, got {row.get('dtype')!r}")
    flat = np.frombuffer(base64.b64decode(row["data"]), dtype=dtype)
    shape = tuple(row["shape"])
    if len(shape) != 3 or flat.size != shape[0] * shape[1] * shape[2]:
        raise ValueError(f"routed_experts: {flat.size} values do not fill shape {list(shape)} (tokens, layers, k)")
    experts = torch.from_numpy(flat.astype(np.int16)).reshape(shape)
    return torch.where(experts == 255, UNROUTED, experts) if row["dtype"] == "uint8" else experts
