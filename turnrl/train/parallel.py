"""The trainer's parallelism: one process, or N ranks sharding the policy with FSDP2, behind one object.

The trainer runs one code path at every world size; what differs between 1 and N ranks lives here:

    parallel = Parallel.start(cfg.trainer, cfg.device)   # process group + DeviceMesh (torchrun's env or args)
    policy = parallel.shard(policy, compute_dtype=...)   # fully_shard per decoder layer, then at the root
    mine = parallel.my_share(token_counts)               # this rank's samples, balanced by token count
    total = parallel.all_sum([tokens, sequences])        # global counts (loss denominators, metrics)
    n_rows = parallel.all_max(len(rows))                 # every rank runs as many forwards (FSDP collectives)

Why the update is exact at any world size: every rank divides its loss by the *global* denominator (tokens
or sequences of the whole mini-batch) and FSDP *sums* the gradients over ranks instead of averaging them, so
the reduced gradient is the one a single process computes on the whole mini-batch, up to float rounding.
FSDP all-gathers a layer's shards in that layer's forward, so a rank that ran fewer forwards than the
others would leave them waiting: ranks with fewer packed rows run zero-weighted padding rows.

With `trainer.parallel: none` there is no process group: `shard` only moves the model to the device, the
reductions are the identity and `my_share` is every sample.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from turnrl.config import ConfigError, TrainerConfig

COLLECTIVE_TIMEOUT = timedelta(hours=2)
"""How long a rank waits in a collective: the other ranks wait in one while rank 0 runs a step's rollouts and
evaluations, which take far longer than torch's default (10 minutes for NCCL)."""


@dataclass
class Parallel:
    """Where this process sits among the trainer ranks, and the collectives the trainer needs."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: Any = None  # a 1-D DeviceMesh over the ranks; None: one process, no process group (parallel: none)

    @classmethod
    def start(cls, cfg: TrainerConfig, device: str = "cpu", *, rank: int | None = None,
              world_size: int | None = None, init_method: str | None = None) -> Parallel:
        """Join (or create) the trainer's process group: from torchrun's environment (RANK, WORLD_SIZE,
        LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or from explicit `rank`, `world_size` and `init_method`
        ("tcp://host:port", what Ray trainer actors pass). gloo on CPU, NCCL on CUDA."""
        if cfg.launcher == "ray" and world_size is None:
            raise ConfigError("trainer.launcher is ray: the trainer ranks are the Ray actors `turnrl train` starts "
                              "(turnrl.train.ray.train_on_ray), each given its rank, world_size and init_method")
        check_launch(cfg, world_size)
        if cfg.parallel == "none":
            return cls(device=torch.device(device))
        _check_fsdp_support()
        env_world = os.environ.get("WORLD_SIZE")
        world_size = world_size or int(env_world or 1)
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        where = torch.device(device)
        if where.type == "cuda":  # one GPU per rank, by its rank on this node
            where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1))))
            if where.index >= torch.cuda.device_count():
                raise ConfigError(f"device={device}: rank {rank} needs CUDA device {where.index} (LOCAL_RANK) but "
                                  f"this node has {torch.cuda.device_count()}; start at most that many ranks per node")
            torch.cuda.set_device(where)
        if not dist.is_initialized():
            if init_method is None and env_world is None:  # a group of one (fsdp on a single device)
                init_method = f"tcp://127.0.0.1:{_free_port()}"
            dist.init_process_group("nccl" if where.type == "cuda" else "gloo", init_method=init_method,
                                    rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        from torch.distributed.device_mesh import init_device_mesh

        return cls(rank, world_size, where, init_device_mesh(where.type, (world_size,)))

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, writes files and pushes weights to the engines."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    def close(self) -> None:
        """Leave the process group, after every rank got here (a rank leaving early fails the others' last
        collectives)."""
        if self.sharded and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # ---- the model ---------------------------------------------------------------------------------
    def shard(self, model: nn.Module, *, compute_dtype: torch.dtype | None = None,
              cpu_offload: bool = False) -> nn.Module:
        """FSDP2 `fully_shard` on each decoder layer, then on the root (embeddings, final norm, LM head and
        whatever else is left, e.g. a VLM's vision tower). The shards stay fp32 (the optimizer's master
        weights); `compute_dtype` (e.g. bfloat16) is what the gathered weights are cast to for forward and
        backward, and gradients are reduced in fp32. Without a process group the model only moves."""
        if not self.sharded:
            return model.to(self.device)
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        if any(p.dtype != torch.float32 for p in model.parameters()):
            model.float()  # before sharding: fully_shard keeps the module's dtype for the shards
        options = {"mesh": self.mesh,
                   "mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32),
                   "offload_policy": CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if cpu_offload
                   else OffloadPolicy()}
        for layer in decoder_layers(model):
            fully_shard(layer, **options)
        fully_shard(model, **options)
        vision = hasattr(getattr(model, "config", None), "vision_config")
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # sum over ranks: the loss is divided by the global count
                module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
                if vision:  # a rank without images in its rows gives its vision tower no gradient at all
                    module.set_reduce_scatter_unused_params(True, recurse=False)
        return model

    # ---- samples -----------------------------------------------------------------------------------
    def my_share(self, token_counts: Sequence[int]) -> list[int]:
        """Indices of the samples this rank trains on (see `balanced_split`); all of them on one rank."""
        return balanced_split(token_counts, self.world_size)[self.rank]

    # ---- collectives (the identity on one process) -------------------------------------------------
    def all_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks, in float64."""
        if not self.sharded:
            return [float(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def all_max(self, value: int) -> int:
        if not self.sharded:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """One picklable object from every rank, in rank order."""
        if not self.sharded:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s object on every rank."""
        if not self.sharded:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, device=self.device)
        return box[0]

    def barrier(self) -> None:
        if self.sharded:
            dist.barrier()

    def clip_grad_norm(self, params: Sequence[nn.Parameter], max_norm: float) -> float:
        """Scale the gradients so their global L2 norm is at most `max_norm` (torch's clip_grads_with_norm_);
        returns the norm before clipping. The squares are summed in float64, shard by shard (each element
        lives on one rank), then over ranks: in float32 the norm of a large gradient (SmolLM2's 28M-element
        embedding) is off by ~1e-5, more than the gradients themselves differ between world sizes."""
        grads = [p.grad for p in params if p.grad is not None]
        local = float(torch.stack([_sum_of_squares(_local(g)) for g in grads]).sum()) if grads else 0.0
        total = self.all_sum([local])[0] ** 0.5
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm,
                                             torch.tensor(total, dtype=torch.float32))
        return total


def check_launch(cfg: TrainerConfig, world_size: int | None = None) -> None:
    """Raise a ConfigError naming the `trainer.*` field when the ranks this process was started among do not
    match the config: `world_size` ranks when given (what a Ray trainer actor is told), else torchrun's
    WORLD_SIZE (none: one process). Cheap: `turnrl train` calls it before anything loads."""
    env_world = os.environ.get("WORLD_SIZE")
    if cfg.launcher == "ray" and world_size is None:  # the driver, which starts the ranks itself
        if env_world is not None:
            raise ConfigError(f"trainer.launcher is ray: `turnrl train` starts the {cfg.world_size} trainer ranks "
                              f"itself, as Ray actors, but this process was started by torchrun (WORLD_SIZE="
                              f"{env_world}); run it once without torchrun, or set trainer.launcher: torchrun")
        return
    started = world_size or int(env_world or 1)
    if cfg.parallel == "none":
        if started > 1:
            raise ConfigError(f"{started} trainer ranks were started but trainer.parallel is none; set "
                              f"trainer.parallel: fsdp and trainer.world_size: {started}")
        return
    if world_size is None and env_world is None and cfg.world_size > 1:
        raise ConfigError(f"trainer.world_size is {cfg.world_size} but this process was not started by torchrun "
                          f"(no WORLD_SIZE in the environment): run torchrun --nproc-per-node {cfg.world_size} "
                          "$(which turnrl) train CONFIG, or set trainer.launcher: ray")
    if started != cfg.world_size:
        where = f"WORLD_SIZE={env_world}" if world_size is None else "Ray trainer actors"
        raise ConfigError(f"trainer.world_size is {cfg.world_size} but {started} ranks were started ({where}); "
                          "make them equal")


def balanced_split(token_counts: Sequence[int], parts: int) -> list[list[int]]:
    """Indices into `token_counts` for each of `parts` ranks, longest first onto the least loaded rank (ties:
    lower index, lower rank), so token totals are nearly equal. Deterministic: every rank computes the same
    split from the same counts. Each part is in index order."""
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        p = min(range(parts), key=lambda p: (loads[p], p))
        out[p].append(i)
        loads[p] += token_counts[i]
    return [sorted(part) for part in out]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of the language model, each its own FSDP unit: `get_decoder().layers` of a HF
    causal LM or VLM (through a peft wrapper too). A VLM's vision blocks are not returned: a rank whose rows
    have no image never calls them, and a sharded unit that one rank skips would leave the others waiting in
    its all-gather; they stay in the root unit, gathered with it on every rank."""
    decoder = getattr(model, "get_decoder", lambda: getattr(model, "model", None))()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(model).__name__}: no decoder layers found (expected get_decoder().layers, a "
                         "ModuleList of transformer blocks) to shard with trainer.parallel: fsdp")
    return list(layers)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a shard (a collective: every rank calls it in the same order); a plain tensor
    is returned as is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """Σ t² accumulated in float64 on t's device, in chunks (never a float64 copy of a whole tensor)."""
    return torch.stack([chunk.double().square().sum() for chunk in t.detach().reshape(-1).split(1 << 22)]).sum()


def _check_fsdp_support() -> None:
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        raise RuntimeError(f"trainer.parallel: fsdp needs torch >= 2.8 (FSDP2 with sum reduction); this is "
                           f"torch {torch.__version__}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
