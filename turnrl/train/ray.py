"""Trainer ranks as Ray actors (`trainer.launcher: ray`): `train_on_ray` starts `trainer.world_size` TrainerActors
that join one process group at rank 0's address; each builds and runs its trainer as a torchrun rank does
(`turnrl.cli.run_training`). Rank 0 holds the rollout and the engines (turnrl.rollout.ray); the other ranks only
train. The first rank to fail stops all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from turnrl.rollout.ray import init_ray


# ---------------------------------------------------------------------------------------------------
# Trainer ranks (trainer.launcher: ray)
# ---------------------------------------------------------------------------------------------------
@ray.remote
class TrainerActor:
    """One trainer rank in its own process: `run` calls `train(rank, world_size, init_method)`, which the
    driver's CLI gives (`turnrl.cli._train_rank`: join the process group at `init_method`, build the trainer,
    train). Rank 0 builds the engines and the rollout there, as torchrun's rank 0 does; with
    engine.distributed: ray those are further actors, started by this one."""

    def __init__(self, train: Callable[[int, int, str], Any]):
        self.train = train

    def address(self) -> str:
        """Where rank 0 listens for the others: this node's address and a port free on it."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def run(self, rank: int, world_size: int, init_method: str) -> Any:
        return self.train(rank, world_size, init_method)


def train_on_ray(train: Callable[[int, int, str], Any], world_size: int, *, address: str | None = None,
                 gpus_per_rank: float = 0.0) -> Any:
    """Start `world_size` trainer actors (on the cluster at `address`, else a local one), each with
    `gpus_per_rank` GPUs, run `train` on all of them and return rank 0's result. The first rank to fail stops
    the others (they would wait for it in their next collective) and its error is raised here."""
    init_ray(address)
    gpus = ray.cluster_resources().get("GPU", 0.0)
    if gpus < world_size * gpus_per_rank:  # else the actors would wait for GPUs that never come
        raise ValueError(f"trainer.world_size={world_size} Ray trainer actors need {world_size * gpus_per_rank:g} GPUs "
                         f"(device cuda: one each) but the Ray cluster at {address or 'this machine'} has {gpus:g}")
    actors = [TrainerActor.options(num_gpus=gpus_per_rank).remote(train)  # type: ignore[attr-defined]
              for _ in range(world_size)]
    try:
        init_method = ray.get(actors[0].address.remote())
        runs = [actor.run.remote(rank, world_size, init_method) for rank, actor in enumerate(actors)]
        pending = list(runs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done[0])  # a failed rank raises here; `finally` stops the rest
        return ray.get(runs[0])
    finally:
        for actor in actors:
            ray.kill(actor)

