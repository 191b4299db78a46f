"""GRPO for multi-turn agents, in one loop you can read top to bottom.

    producer: admit a prompt group whenever the buffer allows, roll it out (local, Ray or remote; rewards
              streamed), hand it to the buffer                                 # turnrl.train.buffer, in the background
    for step in steps:
        groups   = buffer.take(step)                          # earliest deadline first; waits for what is due
        samples  = advantages(groups)                         # per group, over the trajectories we train on
        update(samples)                                       # packed sequences, loss only where mask = 1
        engine.update_weights(policy)                         # the engine samples from the new policy
        log / evaluate (greedy, held-out) / checkpoint (with the buffer: nothing in flight is lost)

Sync and async training are this one loop: `trainer.mode=sync` is the buffer with max_staleness 0 (a step's
groups are sampled by the current policy and rollouts wait for the update); `trainer.mode=async` lets rollouts
go on while the update runs, within `trainer.max_staleness` versions (docs/async-training.md).

On N trainer ranks (`trainer.parallel: fsdp`, docs/distributed.md) it is still this loop: rank 0 holds the
producer, the buffer and the engines, takes the groups and broadcasts the samples (`_next_batch`); every rank
updates on its token-balanced share, takes part in the weight sync and writes its part of each checkpoint;
logging and evaluation happen on rank 0.

What is kept from GRPO/PPO and what is not (see turnrl.train.algos for the formulas):
- Advantages are group-relative (GRPO mean/std, Dr. GRPO mean-only, or RLOO), computed over the
  trajectories whose status is in `algo.train_on` and whose reward exists. Failed trajectories and reward
  errors never enter a group; a group left with one trajectory contributes zero advantage.
- Trajectories with exactly zero advantage (all rewards in their group equal) are skipped when there is no
  KL term: they add no policy gradient, only tokens to the denominator (DAPO's dynamic-sampling view).
- The loss is PPO's clipped surrogate with clip-higher, optional dual clip and GSPO's sequence ratio; with
  one epoch and one mini-batch the ratio is exactly 1 (the "old" logprobs are the current ones, detached).
- The engine's sampling logprobs correct the trainer/engine mismatch by importance sampling (TIS/MIS). A
  trajectory without usable rollout logprobs is trained without correction and counted in
  `train/is_fallback` with a warning; the others keep theirs.
- The KL-to-reference term (k1/k3/low-var) loads a frozen reference model only when `algo.kl_coef > 0`.
- No value function, no entropy bonus, no reward normalisation across groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ctypes
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console
from rich.progress import Progress

from turnrl.config import TrainConfig
from turnrl.models import DTYPES, freeze
from turnrl.observe.loggers import Loggers, build_loggers
from turnrl.observe.stats import RolloutStats, TrajectoryWriter, peak_rss_gb
from turnrl.observe.tracing import TrajectoryTracer
from turnrl.observe.watchdog import Watchdog
from turnrl.rollout.manager import Rollout
from turnrl.train import algos
from turnrl.train.buffer import Group, TrajectoryBuffer, produce
from turnrl.train.checkpoint import (
    checkpoint_problem,
    checkpoint_step,
    load_rng,
    load_training_state,
    publish_checkpoint,
    save_rng,
    save_training_state,
    select_checkpoint,
    staging_dir,
    supersede_newer,
    write_hf,
)
from turnrl.train.lora import apply_lora
from turnrl.train.packing import (
    PackedRow,
    pack_sequences,
    packed_token_logprobs,
    unpack_to_padded,
    use_varlen_attention,
)
from turnrl.train.parallel import Parallel
from turnrl.train.weights import push_weights
from turnrl.types import SamplingParams, Trajectory

log = logging.getLogger(__name__)


class PromptSampler:
    """Epoch-wise shuffled batches of rows; its state (epoch, position) makes a resumed run see the same data."""

    def __init__(self, n_rows: int, batch_size: int, seed: int, shuffle: bool = True):
        self.n_rows, self.batch_size, self.seed, self.shuffle = n_rows, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._cached: tuple[int, list[int]] = (-1, [])

    def _order(self) -> list[int]:
        order = list(range(self.n_rows))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        return [self.next_index() for _ in range(self.batch_size)]

    def next_index(self) -> int:
        if self.position >= self.n_rows:
            self.epoch, self.position = self.epoch + 1, 0
        if self._cached[0] != self.epoch:
            self._cached = (self.epoch, self._order())
        self.position += 1
        return self._cached[1][self.position - 1]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


@dataclass
class TrainSample:
    """One trajectory as the loss sees it."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float] | None  # aligned with response_ids (0.0 at mask 0), None = not usable
    advantage: float
    mm_inputs: dict[str, torch.Tensor] | None = None  # VLM processor tensors (pixel_values, image_grid_thw)
    versions: list[int] | None = None  # the policy version that sampled each response token (-1 at mask 0)


def group_advantages(groups: list[list[Trajectory]], cfg: TrainConfig) -> tuple[list[tuple[Trajectory, float]], dict]:
    """Advantages per group over the trajectories we train on. Split episodes (several samples with one
    `episode_id`) count once in their group and share the episode's advantage."""
    train_on = set(cfg.algo.train_on)
    kept: list[Trajectory] = []
    group_ids: list[int] = []
    episode_keys: list[tuple[int, str]] = []
    for g, group in enumerate(groups):
        for traj in group:
            if str(traj.status) in train_on and traj.reward is not None:
                kept.append(traj)
                group_ids.append(g)
                episode_keys.append((g, traj.episode_id or traj.id))
    if not kept:
        return [], {"train/trained_trajectories": 0.0}
    episodes = list(dict.fromkeys(episode_keys))
    episode_reward: dict[tuple[int, str], float] = {}
    for key, traj in zip(episode_keys, kept, strict=True):
        if key in episode_reward and episode_reward[key] != traj.reward:
            raise ValueError(f"split episode {key[1]!r} has unequal rewards ({episode_reward[key]} vs {traj.reward}); "
                             "samples of one episode must share its reward")
        episode_reward[key] = float(traj.reward)  # type: ignore[arg-type]  # kept trajectories are scored
    rewards_E = torch.tensor([episode_reward[e] for e in episodes], dtype=torch.float64)
    groups_E = torch.tensor([e[0] for e in episodes])
    if cfg.algo.advantage == "rloo":
        adv_E = algos.rloo_advantages(rewards_E, groups_E)
    else:
        adv_E = algos.grpo_advantages(rewards_E, groups_E, normalize_std=cfg.algo.normalize_std)
    adv_of = dict(zip(episodes, adv_E.tolist(), strict=True))
    stats = {f"train/{k}": float(v) for k, v in algos.group_reward_stats(rewards_E, groups_E).items()}
    stats["train/trained_trajectories"] = float(len(kept))
    return [(traj, adv_of[key]) for traj, key in zip(kept, episode_keys, strict=True)], stats


def to_sample(traj: Trajectory, advantage: float) -> TrainSample:
    logprobs = traj.rollout_logprobs
    behaviour = None
    if logprobs is not None and len(logprobs) == len(traj.response_ids):
        behaviour = [0.0 if lp is None else lp for lp in logprobs]
    versions = [-1 if s.policy_version is None or not m else s.policy_version
                for s in traj.segments for m in s.loss_mask]
    return TrainSample(traj.prompt_ids, traj.response_ids, traj.loss_mask,
                       behaviour, advantage, traj.mm_train_inputs or None, versions)


class Trainer:
    """The training loop over built components (turnrl.build makes them from a config): `rollout` runs the
    trajectories on `engine`, which gets the new weights after each step; `tracer` exports trajectories
    (None: no tracing); `parallel` is the process group the policy is sharded over (None: one process)."""

    def __init__(self, cfg: TrainConfig, policy: torch.nn.Module, engine: Any, rollout: Rollout | None,
                 train_rows: list[dict], eval_rows: list[dict], console: Console | None = None,
                 tracer: TrajectoryTracer | None = None, parallel: Parallel | None = None,
                 loggers: Loggers | None = None):
        self.cfg, self.engine, self.rollout = cfg, engine, rollout
        self.parallel = parallel or Parallel.start(cfg.trainer, cfg.device)
        self.train_rows, self.eval_rows = train_rows, eval_rows
        self.console = console or Console()
        self.out = Path(cfg.run_dir or cfg.output_dir)
        """The run directory (`turnrl train` sets cfg.run_dir: turnrl.train.runs); without one, output_dir itself."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.policy, self.reference = self._prepare(policy)
        self.device = self.parallel.device
        self.shares_weights = _same_tensors(getattr(engine, "model", None), self.policy)
        """The engine samples from the policy's own tensors (turnrl.build.shares_weights), not a copy."""
        if self.shares_weights and cfg.trainer.mode != "sync":
            raise ValueError("an engine over the policy's own tensors needs trainer.mode sync: in async mode it would "
                             "sample from weights the optimizer is writing (engine.share_weights: false)")
        self.uses_kl = cfg.algo.kl_coef > 0
        if self.device.type == "cpu":
            map_large_allocations()
        o = cfg.optim
        # fused: one kernel over all parameters instead of a Python loop over each (~4x faster step on CPU)
        self.optimizer = torch.optim.AdamW(param_groups(self.policy, o.lr, o.lr_scale), lr=o.lr,
                                           betas=o.betas, weight_decay=o.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda k: min(1.0, (k + 1) / o.warmup_steps) if o.warmup_steps else 1.0)
        self.sampler = PromptSampler(len(train_rows), cfg.prompts_per_step, cfg.seed, cfg.shuffle)
        self.buffer = TrajectoryBuffer(cfg.prompts_per_step, cfg.trainer.max_staleness)
        self.engine_version = 0
        """The policy version the engines sample with (the step whose weights were last pushed)."""
        self._reissue: list[Group] = []
        self._started = self._last_step_end = time.perf_counter()
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.tracer = tracer if tracer is not None else TrajectoryTracer(None)
        self.loggers = loggers or build_loggers((), self.out, {}, self.tracer)
        """Where metrics go: metrics.jsonl and the backends of trainer.loggers (turnrl.observe.loggers)."""
        self._progress: Progress | None = None
        """The training progress bar while it shows (evaluation passes add their own bar to it)."""
        self.watchdog = getattr(rollout, "watchdog", None) or Watchdog(cfg.rollout.watchdog_s)
        """Fails the run when no trajectory, engine call, env call or training phase progresses for watchdog_s."""

    def _prepare(self, policy: Any) -> tuple[Any, torch.nn.Module | None]:
        """The policy as it trains (LoRA adapters, activation checkpointing, sharded over the ranks) and the
        frozen KL reference, sharded the same way; with LoRA the reference is the policy with its adapters
        off, so there is no second model."""
        cfg = self.cfg
        reference = None
        if cfg.algo.kl_coef > 0 and cfg.trainer.lora is None:
            reference = copy.deepcopy(policy).eval().requires_grad_(False)
        if cfg.optim.gradient_checkpointing:  # non-reentrant: works with frozen inputs (LoRA) and FSDP
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.trainer.lora is not None:
            policy = apply_lora(policy, cfg.trainer.lora)
        freeze(policy, cfg.optim.freeze)
        compute = None if cfg.dtype == "float32" else DTYPES[cfg.dtype]
        models = [m for m in (policy, reference) if m is not None]
        for m in models:
            use_varlen_attention(m)
            self.parallel.shard(m, compute_dtype=compute, cpu_offload=cfg.trainer.cpu_offload)
        return policy, reference

    # ---- the loop ---------------------------------------------------------------------------------
    async def train(self) -> list[dict[str, float]]:
        self.tracer.log_params(self.cfg.model_dump())
        if self.parallel.is_main:  # the resolved config, every key: what this run is (and marks its directory)
            (self.out / "config.yaml").write_text(yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False))
        if self.cfg.resume and self.load_checkpoint():
            await self.sync_weights()
        if self.step == 0:
            await self._evaluate_on_main("before")
        producer = self._start_producer()
        try:
            with Progress(console=self.console, transient=False, disable=not self.parallel.is_main) as self._progress:
                task = self._progress.add_task("training", total=self.cfg.steps, completed=self.step)
                while self.step < self.cfg.steps:
                    self.step += 1
                    self._log(await self.train_step())
                    if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 and self.step < self.cfg.steps:
                        await self._evaluate_on_main(f"step{self.step}")
                    if self.cfg.save_every and self.step % self.cfg.save_every == 0:
                        self.save_checkpoint(final=False)
                    self._progress.update(task, completed=self.step)
        finally:
            self._progress = None
            await _stop(producer)
        await self._evaluate_on_main("after")
        self.save_checkpoint()
        return self.history

    async def _evaluate_on_main(self, tag: str) -> None:
        """Evaluation runs where the rollout is, on rank 0; the other ranks wait for it in their next collective."""
        if self.eval_rows and self.parallel.is_main:
            self._log(await self.evaluate(tag))

    def _start_producer(self) -> asyncio.Task | None:
        """Rollouts in the background, admitted by the buffer's rule (the main rank runs them); groups in flight
        at the checkpoint a run resumed from are re-issued first."""
        if self.rollout is None:
            return None
        reissue, self._reissue = self._reissue, []
        return asyncio.create_task(produce(self.rollout, self.buffer, self.train_rows, self.cfg.rollout.n,
                                           self.sampler.next_index, lambda: self.engine_version, reissue))

    async def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        samples, metrics = await self._next_batch()
        t_wait = time.perf_counter() - t0
        t1 = time.perf_counter()
        update = (await self._update_beside_rollouts(samples)) if samples else {}
        t_update = time.perf_counter() - t1
        sync = await self.watchdog.wait(self.sync_weights(), "engine.update_weights", f"step {self.step}")
        self.buffer.version_changed()
        self._last_step_end = time.perf_counter()
        if self.parallel.is_main:
            metrics.update(self._buffer_metrics(t_wait))
        return {"step": float(self.step), **metrics, **update, **sync, "train/samples": float(len(samples)),
                "train/is_fallback": float(sum(s.rollout_logprobs is None for s in samples)),
                "time/rollout_s": t_wait, "time/update_s": t_update,
                "time/step_s": self._last_step_end - t0, "train/lr": self.scheduler.get_last_lr()[0],
                **({"memory/peak_rss_gb": peak} if (peak := peak_rss_gb()) is not None else {})}

    async def _next_batch(self) -> tuple[list[TrainSample], dict[str, float]]:
        """This step's samples, and what their rollouts measured: rank 0 takes them from the buffer (the producer
        and the prompt sampler live there); every other rank receives rank 0's samples (and waits for them)."""
        samples, metrics = await self._samples_from_buffer() if self.parallel.is_main else ([], {})
        return self.parallel.broadcast_object(samples), metrics

    async def _samples_from_buffer(self) -> tuple[list[TrainSample], dict[str, float]]:
        groups = await self.watchdog.wait(self.buffer.take(self.step), "trainer.rollout", f"step {self.step}")
        self._record_groups(groups)
        stats = RolloutStats(started=self._last_step_end)  # the trained trajectories over the step interval
        with TrajectoryWriter(self.out / "trajectories" / "last_step.jsonl") as writer:
            for group in groups:
                for traj in group.trajectories or []:
                    stats.add(traj)
                    self.tracer.export(traj, self.step, "train")
                    writer.write(traj)
        scored, adv_stats = group_advantages([g.trajectories or [] for g in groups], self.cfg)
        samples = [to_sample(t, a) for t, a in scored if a != 0.0 or self.uses_kl]
        fallback = sum(s.rollout_logprobs is None for s in samples)
        if fallback:
            log.warning("step %d: %d trajectories have no usable rollout logprobs; trained without IS correction",
                        self.step, fallback)
        return samples, {**stats.summary(), **adv_stats}

    def _record_groups(self, groups: list[Group]) -> None:
        """groups.jsonl: one line per trained group (its admission index, row, versions, whether it was re-issued
        after a resume): the ledger that shows no admitted prompt was lost."""
        if not self.parallel.is_main:
            return
        with open(self.out / "groups.jsonl", "a", encoding="utf-8") as f:
            for g in groups:
                f.write(json.dumps({"step": self.step, "index": g.index, "row_index": g.row_index,
                                    "admitted_version": g.admitted_version, "oldest_version": g.oldest_version,
                                    "reissued": g.reissued, "trajectories": len(g.trajectories or [])}) + "\n")

    async def _update_beside_rollouts(self, samples: list[TrainSample]) -> dict[str, float]:
        """async mode: the update runs in a worker thread, so the event loop (rollouts, envs, tools) goes on;
        sync mode: in place (no rollout could start meanwhile anyway). Watched either way, in its own thread. An
        engine over the policy's own tensors (turnrl.build.shares_weights: sync mode only) sleeps meanwhile: its KV
        cache gives the update room."""
        if self.cfg.trainer.mode == "async":
            return await asyncio.to_thread(self._watched_update, samples)
        if not self.shares_weights:
            return self._watched_update(samples)
        await self.engine.sleep()
        try:
            return self._watched_update(samples)
        finally:
            await self.engine.wake_up()

    def _watched_update(self, samples: list[TrainSample]) -> dict[str, float]:
        with self.watchdog.phase("trainer.update", f"step {self.step}, {len(samples)} samples"):
            return self.update(samples)

    def _buffer_metrics(self, t_wait: float) -> dict[str, float]:
        b = self.buffer
        trained = max(sum(b.stats.staleness.values()), 1)
        out = {"async/buffer_depth": float(b.depth), "async/in_flight": float(b.in_flight),
               "async/staleness_mean": sum(k * v for k, v in b.stats.staleness.items()) / trained,
               "async/staleness_max": float(max(b.stats.staleness, default=0)),
               "async/reissued": float(b.stats.reissued), "async/dropped": float(b.stats.dropped),
               "async/lost": float(b.lost),
               "async/trainer_idle": b.stats.wait_s / max(time.perf_counter() - self._started, 1e-9),
               "time/trainer_wait_s": t_wait}
        out.update({f"async/staleness_hist/{k}": v / trained for k, v in sorted(b.stats.staleness.items())})
        per_traj = max(sum(b.stats.versions_per_trajectory.values()), 1)
        out.update({f"async/versions_per_trajectory/{k}": v / per_traj
                    for k, v in sorted(b.stats.versions_per_trajectory.items())})
        idle = _engine_idle(self.engine, time.perf_counter() - self._started)
        if idle is not None:
            out["async/engine_idle"] = idle
        return out

    # ---- the update ----------------------------------------------------------------------------------
    def update(self, samples: list[TrainSample]) -> dict[str, float]:
        """PPO epochs over `samples` (every rank passes the same list); the same update at any world size."""
        cfg = self.cfg
        temperature = cfg.rollout.sampling.temperature or 1.0
        self.policy.train()
        tally, t0 = _Tally(), time.perf_counter()
        old = self._old_logprobs(samples, temperature) if cfg.optim.epochs * cfg.optim.mini_batches > 1 else None
        rng = random.Random(cfg.seed * 7919 + self.step)
        for _ in range(cfg.optim.epochs):
            order = list(range(len(samples)))
            rng.shuffle(order)
            for mb in _split(order, cfg.optim.mini_batches):
                self._optimizer_step(samples, mb, old, temperature, tally)
        self.policy.eval()
        release_freed_memory()
        return tally.summary(self.parallel, time.perf_counter() - t0)

    def _optimizer_step(self, samples: list[TrainSample], mb: list[int], old: dict | None, temperature: float,
                        tally: _Tally) -> None:
        """One optimizer step on the mini-batch `mb`: this rank trains on its token-balanced share, packed into
        micro-batches of at most `optim.micro_batch_tokens`, and divides by the mini-batch's global token (or
        sequence) count; FSDP sums the gradients over ranks, so the step is the one-process step."""
        a = self.cfg.algo
        mine = [mb[k] for k in self.parallel.my_share([len(samples[i].prompt_ids) + len(samples[i].response_ids)
                                                       for i in mb])]
        local = float(algos.loss_denominator(_padded_masks(samples, mine), a.loss_agg)) if mine else 0.0
        denominator = torch.tensor(self.parallel.all_sum([local])[0], device=self.device)
        self.optimizer.zero_grad(set_to_none=True)
        rows = self._pack(samples, mine)
        for k in range(self.parallel.all_max(len(rows))):  # FSDP: every rank runs as many forwards
            if k >= len(rows):  # a padding row: the collectives of a forward and backward, zero gradient
                loss, _ = self._row_loss(_padding_row().to(self.device), [_PADDING], [], None, temperature,
                                         denominator)
                (loss * 0.0).backward()
                continue
            row = rows[k].to(self.device)
            loss, metrics = self._row_loss(row, [samples[i] for i in row.sequence_index], row.sequence_index, old,
                                           temperature, denominator)
            loss.backward()
            tally.add_row(metrics, [samples[i] for i in row.sequence_index], tokens=row.input_ids.shape[1])
        if self.cfg.optim.grad_clip:
            tally.grad_norms.append(self.parallel.clip_grad_norm(
                [p for p in self.policy.parameters() if p.requires_grad], self.cfg.optim.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        tally.steps += 1

    def _pack(self, samples: list[TrainSample], indices: list[int]) -> list[PackedRow]:
        """`samples[indices]` packed into rows of at most optim.micro_batch_tokens; `sequence_index` holds
        indices into `samples`."""
        rows = pack_sequences([(samples[i].prompt_ids, samples[i].response_ids, samples[i].loss_mask) for i in indices],
                              self.cfg.optim.micro_batch_tokens, [samples[i].mm_inputs for i in indices])
        return [dataclasses.replace(r, sequence_index=[indices[j] for j in r.sequence_index]) for r in rows]

    def _row_loss(self, row, batch: list[TrainSample], members: list[int], old: dict | None, temperature: float,
                  denominator: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        a = self.cfg.algo
        lengths = [len(s.response_ids) for s in batch]
        logp_N = packed_token_logprobs(self.policy, row, temperature)
        logp_B_T = unpack_to_padded(logp_N, row, lengths)
        mask_B_T = unpack_to_padded(torch.ones_like(logp_N), row, lengths)
        old_B_T = logp_B_T.detach() if old is None else unpack_to_padded(
            torch.cat([old[i] for i in members]), row, lengths)
        adv_B = torch.tensor([s.advantage for s in batch], dtype=logp_N.dtype, device=logp_N.device)
        valid_B = torch.tensor([s.rollout_logprobs is not None for s in batch], device=logp_N.device)
        rollout_B_T = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(s.rollout_logprobs or [0.0] * len(s.response_ids)) for s in batch], batch_first=True,
        ).to(logp_N.device, old_B_T.dtype)
        metrics = self._mismatch_by_staleness(old_B_T, rollout_B_T, mask_B_T, valid_B, batch)
        if not a.decoupled:  # PPO anchored at the behaviour policy: the ratio itself corrects, no IS weights
            old_B_T = torch.where(valid_B[:, None], rollout_B_T, old_B_T)
        loss_B_T, pg = algos.policy_loss(logp_B_T, old_B_T, adv_B, mask_B_T, clip_low=a.clip_low,
                                         clip_high=a.clip_high, dual_clip=a.dual_clip, ratio_level=a.ratio_level)
        metrics.update({f"train/{k}": float(v) for k, v in pg.items()})
        if a.is_mode != "none" and a.decoupled:
            weights_B_T, ism = algos.rollout_is_weights(old_B_T, rollout_B_T, mask_B_T, valid_B=valid_B,
                                                        mode=a.is_mode, level=a.is_level, threshold=a.is_threshold)
            loss_B_T = loss_B_T * weights_B_T
            metrics.update({f"train/{k}": float(v) for k, v in ism.items()})
        if self.uses_kl:
            ref_B_T = unpack_to_padded(self._reference_logprobs(row, temperature), row, lengths)
            kl_B_T = algos.kl_penalty(logp_B_T, ref_B_T, a.kl_type)
            loss_B_T = loss_B_T + a.kl_coef * kl_B_T
            metrics["train/kl"] = float(algos.masked_mean(kl_B_T.detach(), mask_B_T))
        loss = algos.aggregate_loss(loss_B_T, mask_B_T, a.loss_agg, norm_constant=a.norm_constant,
                                    denominator=denominator)
        metrics["train/loss"] = float(loss.detach())
        return loss, metrics

    @torch.no_grad()
    def _mismatch_by_staleness(self, old_B_T: torch.Tensor, rollout_B_T: torch.Tensor, mask_B_T: torch.Tensor,
                               valid_B: torch.Tensor, batch: list[TrainSample]) -> dict[str, float]:
        """k3 estimate of KL(behaviour ‖ proximal) per token staleness (versions between the policy being updated
        and the one that sampled the token): how far each age of data is off-policy. Token counts ride along
        under `_count/` keys so the tally weights each bucket by its own tokens."""
        if not any(s.versions for s in batch):
            return {}
        versions_B_T = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(s.versions or [-1] * len(s.response_ids)) for s in batch], batch_first=True,
            padding_value=-1).to(old_B_T.device)
        used_B_T = mask_B_T.bool() & valid_B[:, None] & (versions_B_T >= 0)
        log_ratio_B_T = (old_B_T - rollout_B_T).clamp(-20, 20)
        k3_B_T = log_ratio_B_T.exp() - 1 - log_ratio_B_T
        staleness_B_T = (self.step - 1) - versions_B_T
        out: dict[str, float] = {}
        for d in staleness_B_T[used_B_T].unique().tolist():
            bucket = used_B_T & (staleness_B_T == d)
            key = f"train/mismatch_kl_k3/staleness_{int(d)}"
            out[key], out[f"_count/{key}"] = float(k3_B_T[bucket].mean()), float(bucket.sum())
        return out

    @torch.no_grad()
    def _reference_logprobs(self, row: PackedRow, temperature: float) -> torch.Tensor:
        """Logprobs under the KL reference: the frozen copy, or with LoRA the policy with its adapters off."""
        if self.reference is not None:
            return packed_token_logprobs(self.reference, row, temperature)
        with self.policy.disable_adapter():
            return packed_token_logprobs(self.policy, row, temperature)

    @torch.no_grad()
    def _old_logprobs(self, samples: list[TrainSample], temperature: float) -> dict[int, torch.Tensor]:
        """Logprobs of the policy before this step's updates, per sample (needed when it takes >1 update).
        Each rank computes its token-balanced share; every rank gets all of them."""
        mine = self.parallel.my_share([len(s.prompt_ids) + len(s.response_ids) for s in samples])
        rows = self._pack(samples, mine)
        old: dict[int, torch.Tensor] = {}
        for k in range(self.parallel.all_max(len(rows))):
            row = (rows[k] if k < len(rows) else _padding_row()).to(self.device)
            logp_N = packed_token_logprobs(self.policy, row, temperature)
            if k < len(rows):
                for j, i in enumerate(row.sequence_index):
                    old[i] = logp_N[row.target_seq == j].cpu()
        if self.parallel.sharded:
            old = {i: t for part in self.parallel.all_gather_object(old) for i, t in part.items()}
        return {i: t.to(self.device) for i, t in old.items()}

    async def sync_weights(self) -> dict[str, float]:
        """The engine samples from the new policy: its weights streamed in buckets of weight_sync.bucket_mb
        (rank 0 pushes, every rank gathers; with LoRA the merged adapted layers only); requests in flight pause
        as weight_sync.pause says."""
        metrics = await push_weights(self.engine, self.policy, self.parallel,
                                     bucket_bytes=int(self.cfg.weight_sync.bucket_mb * 2**20),
                                     dtype=DTYPES[self.cfg.dtype], version=self.step, pause=self.cfg.weight_sync.pause)
        self.engine_version = self.step
        return metrics

    # ---- evaluation, logging, checkpoints -----------------------------------------------------------
    async def evaluate(self, tag: str, *, greedy: bool = True, sampled_n: int | None = None,
                       out: Path | None = None) -> dict[str, Any]:
        """The held-out rows: greedy decoding (temperature 0, `eval_n` samples per row) and, when `sampled_n`
        (default `eval_sampled_n`) > 0, the sampling policy (rollout.sampling: the training temperature) with
        that many samples per row. Trajectories go to `out` (greedy; default trajectories/eval_{tag}.jsonl)
        and `sampled_path(out)`."""
        sampled_n = self.cfg.eval_sampled_n if sampled_n is None else sampled_n
        path = out or self.out / "trajectories" / f"eval_{tag}.jsonl"
        metrics: dict[str, Any] = {"step": float(self.step), "eval/tag": tag}
        if greedy:
            params = SamplingParams(temperature=0.0, max_new_tokens=self.cfg.rollout.max_new_tokens)
            metrics.update(await self._eval_pass(tag, params, self.cfg.eval_n, "eval/", path))
        if sampled_n:
            assert self.rollout is not None  # evaluation runs on rank 0, where the rollout is
            metrics.update(await self._eval_pass(f"{tag}-sampled", self.rollout.sampling, sampled_n, "eval/sampled_",
                                                 sampled_path(path)))
        return metrics

    async def _eval_pass(self, tag: str, sampling: SamplingParams, n: int, prefix: str,
                         path: Path) -> dict[str, float]:
        stats = RolloutStats()
        assert self.rollout is not None  # evaluation runs on rank 0, where the rollout is
        mode = "greedy" if sampling.temperature == 0 else f"sampled at T={sampling.temperature:g}"
        with TrajectoryWriter(path) as writer, self._task(f"eval {tag} ({mode})", len(self.eval_rows) * n) as advance:
            async for traj in self.rollout.stream(self.eval_rows, n, id_prefix=f"eval-{tag}-", sampling=sampling):
                stats.add(traj)
                self.tracer.export(traj, self.step, "eval")
                writer.write(traj)
                advance()
        s = stats.summary()
        tools = {f"{prefix}{k.removeprefix('rollout/')}": v for k, v in s.items() if k.startswith("rollout/tool_")}
        return {f"{prefix}reward_mean": s.get("rollout/reward_mean", float("nan")),
                f"{prefix}success": sum(r > 0 for r in stats.rewards) / max(len(stats.rewards), 1),
                f"{prefix}turns_mean": s["rollout/turns_mean"], f"{prefix}trajectories": float(stats.count),
                f"{prefix}model_tokens_mean": s["rollout/model_tokens_mean"], **tools}

    @contextlib.contextmanager
    def _task(self, description: str, total: int) -> Iterator[Callable[[], None]]:
        """A progress bar for `description` (on the training one while it shows, else its own); yields advance.
        Into a file or a pipe, where no bar is drawn, a line says what started."""
        if not self.console.is_terminal:
            self.console.print(f"{description}: {total} trajectories")
        if self._progress is not None:
            bar: Progress = self._progress
            task = bar.add_task(description, total=total)
            try:
                yield lambda: bar.advance(task)
            finally:
                bar.remove_task(task)
            return
        with Progress(console=self.console, transient=True) as progress:
            task = progress.add_task(description, total=total)
            yield lambda: progress.advance(task)

    def _log(self, metrics: dict[str, Any]) -> None:
        self.history.append(metrics)
        if not self.parallel.is_main:
            return
        self.loggers.log(metrics, self.step)
        self.console.print(self.format_line(metrics))

    def format_line(self, metrics: dict[str, Any]) -> str:
        """The console line of a step's or an evaluation's metrics (turnrl.train.sft prints its own step lines)."""
        return format_step_line(metrics, self.cfg.steps)

    def save_checkpoint(self, final: bool = True) -> Path:
        """Sharded state that resumes exactly (every rank writes its part) and a Hugging Face model dir
        (turnrl.train.checkpoint), written into a staging folder and renamed into place once complete (with its
        manifest), then named by `latest`. `final`: the run's last checkpoint (trainer.save_hf="final" gives
        it the Hugging Face weights; the others keep only what resuming needs)."""
        path = self.out / "checkpoints" / f"step_{self.step:06d}"
        staged = staging_dir(path)
        if self.parallel.is_main:
            shutil.rmtree(staged, ignore_errors=True)  # left by a run that died while saving
            staged.mkdir(parents=True)
        self.parallel.barrier()
        save_rng(staged, self.parallel.rank)
        save_training_state(staged, self.policy, self.optimizer)
        save_hf = self.cfg.trainer.save_hf
        write_hf(self.policy, staged / "model", self.parallel, DTYPES[self.cfg.dtype],
                 weights=save_hf is True or (save_hf == "final" and final))
        if self.parallel.is_main:
            self._save_tokenizer(staged / "model")
            torch.save({"step": self.step, "scheduler": self.scheduler.state_dict(),
                        "sampler": self.sampler.state_dict(), "history": self.history,
                        "buffer": self.buffer.state_dict(),
                        "world_size": self.parallel.world_size, "config": self.cfg.model_dump()},
                       staged / "trainer_state.pt")
        self.parallel.barrier()  # every rank's files are written before the checkpoint is published
        if self.parallel.is_main:
            publish_checkpoint(staged, path)
        self.parallel.barrier()
        return path

    def _save_tokenizer(self, where: Path) -> None:
        save_tokenizer(getattr(self.rollout, "renderer", None), where)

    def load_checkpoint(self) -> bool:
        """Restore weights, optimizer, scheduler, data position, RNG and history from the checkpoint to resume
        (`resume_point`), whatever world size wrote it."""
        choice: Path | ValueError | None = None
        if self.parallel.is_main:  # rank 0 reads and checks the checkpoints; the other ranks take its choice
            try:
                choice = self.resume_point()
            except ValueError as e:
                choice = e
        path = self.parallel.broadcast_object(choice)
        if isinstance(path, ValueError):
            raise path
        if path is None:
            return False
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        saved_lora = state["config"]["trainer"]["lora"]
        lora = self.cfg.trainer.lora
        if saved_lora != (lora.model_dump() if lora else None):
            raise ValueError(f"checkpoint {path}: trainer.lora was {saved_lora}, the config now has {lora}; "
                             "resume with the same adapters")
        load_training_state(path, self.policy, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self._reissue = self.buffer.load_state_dict(state["buffer"]) if "buffer" in state else []
        self.step, self.history = state["step"], state["history"]
        load_rng(path, self.parallel.rank)
        if self.parallel.is_main:  # what was logged after the checkpoint is done again: never log a step twice
            for name in ("metrics.jsonl", "groups.jsonl"):
                _truncate_after(self.out / name, self.step)
            moved = supersede_newer(path) if path.parent.resolve() == (self.out / "checkpoints").resolve() else []
            self.console.print(f"resumed from {path} (step {self.step}, written by {state['world_size']} ranks, "
                               f"now {self.parallel.world_size})"
                               + (f"; moved the newer {', '.join(moved)} to checkpoints/superseded/" if moved else ""),
                               soft_wrap=True)
        return True

    def resume_point(self) -> Path | None:
        """The checkpoint `cfg.resume` names (a checkpoint folder), else the newest valid one of this run;
        the newer ones skipped (broken, incomplete) are named in one line. None: nothing to resume."""
        if isinstance(self.cfg.resume, str) and checkpoint_step(Path(self.cfg.resume)) is not None:
            path = Path(self.cfg.resume)
            problem = checkpoint_problem(path)
            if problem is not None:
                raise ValueError(f"resume: checkpoint {path} {problem}")
            return path
        found, notes = select_checkpoint(self.out)
        if found is None:
            log.warning("resume: no valid checkpoint in %s%s; starting from scratch", self.out,
                        f" ({'; '.join(notes)})" if notes else "")
        elif notes:
            self.console.print(f"[yellow]resume:[/] {'; '.join(notes)}; resuming from {found.name}", soft_wrap=True)
        return found


def _same_tensors(engine_model: torch.nn.Module | None, policy: torch.nn.Module) -> bool:
    if not isinstance(engine_model, torch.nn.Module):
        return False
    return next(engine_model.parameters()) is next(policy.parameters())


MMAP_THRESHOLD_BYTES = 1 << 20


def map_large_allocations() -> None:
    """Allocations of 1 MiB and more (activations, logits, gradients on the CPU) get their own pages, returned
    to the OS when freed. glibc otherwise raises its mmap threshold to the largest block freed so far, after
    which such tensors come from the heap and its fragments stay resident: the demo's peak RSS was 4.57 GB
    after 4 steps with the default and 3.56 GB with this, at the same step time (`MALLOC_MMAP_THRESHOLD_`
    in the environment does the same; an explicit value there wins)."""
    if sys.platform.startswith("linux") and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        with contextlib.suppress(OSError, AttributeError):  # not glibc (musl): its allocator differs
            ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD_BYTES)  # -3: M_MMAP_THRESHOLD


def release_freed_memory() -> None:
    """Hand the memory freed after an update (activations, logits) back to the OS. glibc keeps freed
    blocks in its heap, where fragmentation stops it from reusing them for other sizes, so without this the
    resident size of a CPU run creeps up by a step's activations every few steps (the demo: +2 GB in 7 steps)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc (musl): nothing to trim
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def param_groups(model: torch.nn.Module, lr: float, scales: dict[str, float]) -> list[dict[str, Any]]:
    """The trainable parameters in optimizer groups: lr × the scale of the first key of `scales` its name
    contains (optim.lr_scale), else lr; a key that names no parameter is an error (a typo would train at lr)."""
    groups: dict[float, list[torch.nn.Parameter]] = defaultdict(list)
    used: set[str] = set()
    for name, p in model.named_parameters():
        if p.requires_grad:
            key = next((k for k in scales if k in name), None)
            if key is not None:
                used.add(key)
            groups[scales[key] if key is not None else 1.0].append(p)
    unused = sorted(set(scales) - used)
    if unused:
        raise ValueError(f"optim.lr_scale: {unused} match no trainable parameter name of {type(model).__name__}")
    return [{"params": params, "lr": lr * scale} for scale, params in sorted(groups.items())]


def save_tokenizer(renderer: Any, where: Path) -> None:
    """Tokenizer (and a VLM's image processor and chat template) beside the weights: a self-contained dir.
    The processor is saved piecewise: without a video processor its own save_pretrained fails."""
    if getattr(renderer, "tokenizer", None) is not None:
        renderer.tokenizer.save_pretrained(where)
    processor = getattr(renderer, "processor", None)
    if processor is not None:
        processor.image_processor.save_pretrained(where)
        (where / "chat_template.jinja").write_text(processor.chat_template)


def _truncate_after(path: Path, step: int) -> None:
    """Keep the JSONL lines of `path` whose `step` is at most `step` (a resumed run writes the later ones again)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


async def _stop(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _engine_idle(engine: Any, wall_s: float) -> float | None:
    """The engine's idle share of `wall_s`, where it counts its busy time (the embedded engine does)."""
    busy = getattr(engine, "stats", {}).get("busy_s") if isinstance(getattr(engine, "stats", None), dict) else None
    return None if busy is None or wall_s <= 0 else max(0.0, 1.0 - busy / wall_s)


class _Tally:
    """Update metrics that mean the same at any world size: `train/loss` is each mini-batch's loss (the sum of
    its micro-batches' shares over all ranks), averaged over optimizer steps; the other metrics are means
    over what they are defined on, across all ranks: trained tokens, trained tokens of samples with rollout
    logprobs (the IS metrics), samples (`is_valid_frac`). `is_ess` is not a mean: its value is per
    micro-batch, averaged the same way."""

    def __init__(self):
        self.weighted: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.loss, self.tokens, self.steps = 0.0, 0, 0
        self.grad_norms: list[float] = []

    def add_row(self, metrics: dict[str, float], batch: list[TrainSample], *, tokens: int) -> None:
        self.loss += metrics.pop("train/loss")
        trained = sum(sum(s.loss_mask) for s in batch)
        corrected = sum(sum(s.loss_mask) for s in batch if s.rollout_logprobs is not None)
        counts = {k.removeprefix("_count/"): metrics.pop(k) for k in [k for k in metrics if k.startswith("_count/")]}
        for k, v in metrics.items():
            weight = (counts[k] if k in counts else len(batch) if k == "train/is_valid_frac" else
                      corrected if k.startswith(("train/is_", "train/mismatch_")) else trained)
            self.weighted[k] += v * weight
            self.weights[k] += weight
        self.tokens += tokens

    def summary(self, parallel: Parallel, elapsed: float) -> dict[str, float]:
        parts = parallel.all_gather_object((dict(self.weighted), dict(self.weights), self.loss, self.tokens))
        weighted: defaultdict[str, float] = defaultdict(float)
        weights: defaultdict[str, float] = defaultdict(float)
        for w, n, _, _ in parts:
            for k in w:
                weighted[k] += w[k]
                weights[k] += n[k]
        out = {k: weighted[k] / weights[k] if weights[k] else 0.0 for k in sorted(weighted)}
        tokens = sum(p[3] for p in parts)
        out["train/loss"] = sum(p[2] for p in parts) / max(self.steps, 1)
        if self.grad_norms:
            out["train/grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        out.update({"train/tokens": float(tokens), "train/tokens_per_s": tokens / elapsed if elapsed else 0.0})
        return out


_PADDING = TrainSample([0], [0], [1], None, 0.0)


def _padding_row() -> PackedRow:
    return pack_sequences([(_PADDING.prompt_ids, _PADDING.response_ids, _PADDING.loss_mask)], 64)[0]


def _padded_masks(samples: list[TrainSample], indices: list[int]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence([torch.tensor(samples[i].loss_mask) for i in indices], batch_first=True)


def _split(order: list[int], parts: int) -> list[list[int]]:
    size = math.ceil(len(order) / parts)
    return [order[i : i + size] for i in range(0, len(order), size)]


def sampled_path(path: Path) -> Path:
    """Where the sampled evaluation pass goes beside the greedy one's `path`: eval.jsonl -> eval-sampled.jsonl."""
    return path.with_name(f"{path.stem}-sampled{path.suffix}")


def format_step_line(m: dict[str, Any], total: int) -> str:
    if "eval/tag" in m:
        passes = []
        if "eval/reward_mean" in m:
            passes.append(f"greedy reward {m['eval/reward_mean']:.3f}  success {m['eval/success']:.0%}  turns "
                          f"{m['eval/turns_mean']:.2f}  ({m['eval/trajectories']:.0f} trajectories)")
        if "eval/sampled_reward_mean" in m:
            passes.append(f"sampled reward {m['eval/sampled_reward_mean']:.3f}  success {m['eval/sampled_success']:.0%}"
                          f"  turns {m['eval/sampled_turns_mean']:.2f}  ({m['eval/sampled_trajectories']:.0f} "
                          "trajectories)")
        return f"[bold cyan]eval {m['eval/tag']}[/]: " + "  |  ".join(passes)
    reasons = Counter({k.split("/")[-1]: v for k, v in m.items() if k.startswith("rollout/reason/")})
    reason_text = " ".join(f"{k} {v:.0%}" for k, v in reasons.most_common(3))
    loss = f"loss {m['train/loss']:.4f}" if "train/loss" in m else "no trainable samples"
    return (f"step {m['step']:.0f}/{total}  reward {m.get('rollout/reward_mean', float('nan')):.3f}"
            f"±{m.get('rollout/reward_std', float('nan')):.2f}  turns {m['rollout/turns_mean']:.2f}  ({reason_text})  "
            f"gen {m['rollout/tokens_per_s']:.0f} tok/s  train {m.get('train/tokens_per_s', 0):.0f} tok/s  {loss}  "
            f"step {m['time/step_s']:.1f}s")
