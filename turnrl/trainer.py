"""GRPO for multi-turn agents, in one loop you can read top to bottom.

    for step in steps:
        rows     = sampler.next_batch()                       # deterministic, resumable data order
        groups   = run_groups(rollout, rows, n)               # local, Ray or remote: async, rewards streamed
        samples  = advantages(groups)                         # per group, over the trajectories we train on
        update(samples)                                       # packed sequences, loss only where mask = 1
        engine.update_weights(policy)                         # the engine samples from the new policy
        log / evaluate (greedy, held-out) / checkpoint

What is kept from GRPO/PPO and what is not (see turnrl.algos for the formulas):
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

import copy
import json
import logging
import math
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from turnrl import algos
from turnrl.config import TrainConfig
from turnrl.observe import RolloutStats, TrajectoryWriter
from turnrl.packing import pack_sequences, packed_token_logprobs, unpack_to_padded, use_varlen_attention
from turnrl.rollout import Rollout, run_groups
from turnrl.tracing import TrajectoryTracer
from turnrl.types import SamplingParams, Trajectory
from turnrl.watchdog import Watchdog

log = logging.getLogger(__name__)


class PromptSampler:
    """Epoch-wise shuffled batches of rows; its state (epoch, position) makes a resumed run see the same data."""

    def __init__(self, n_rows: int, batch_size: int, seed: int, shuffle: bool = True):
        self.n_rows, self.batch_size, self.seed, self.shuffle = n_rows, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        order = list(range(self.n_rows))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        batch: list[int] = []
        while len(batch) < self.batch_size:
            if self.position >= self.n_rows:
                self.epoch, self.position = self.epoch + 1, 0
            take = min(self.batch_size - len(batch), self.n_rows - self.position)
            batch += self._order()[self.position : self.position + take]
            self.position += take
        return batch

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
        episode_reward[key] = float(traj.reward)
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
    usable = logprobs is not None and len(logprobs) == len(traj.response_ids)
    return TrainSample(traj.prompt_ids, traj.response_ids, traj.loss_mask,
                       [0.0 if lp is None else lp for lp in logprobs] if usable else None, advantage,
                       traj.mm_train_inputs or None)


class Trainer:
    """The training loop over built components (turnrl.build makes them from a config): `rollout` runs the
    trajectories on `engine`, which gets the new weights after each step; `tracer` exports trajectories
    (None: no tracing)."""

    def __init__(self, cfg: TrainConfig, policy: torch.nn.Module, engine: Any, rollout: Rollout,
                 train_rows: list[dict], eval_rows: list[dict], console: Console | None = None,
                 tracer: TrajectoryTracer | None = None):
        self.cfg, self.policy, self.engine, self.rollout = cfg, policy, engine, rollout
        self.device = next(policy.parameters()).device
        self.train_rows, self.eval_rows = train_rows, eval_rows
        self.console = console or Console()
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.reference = None
        if cfg.algo.kl_coef > 0:
            self.reference = copy.deepcopy(policy).eval().requires_grad_(False)
        use_varlen_attention(policy)
        if self.reference is not None:
            use_varlen_attention(self.reference)
        if cfg.optim.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        o = cfg.optim
        # fused: one kernel over all parameters instead of a Python loop over each (~4x faster step on CPU)
        self.optimizer = torch.optim.AdamW(policy.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay,
                                           fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda k: min(1.0, (k + 1) / o.warmup_steps) if o.warmup_steps else 1.0)
        self.sampler = PromptSampler(len(train_rows), cfg.prompts_per_step, cfg.seed, cfg.shuffle)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.tracer = tracer if tracer is not None else TrajectoryTracer(None)
        self.watchdog = getattr(rollout, "watchdog", None) or Watchdog(cfg.rollout.watchdog_s)
        """Fails the run when no trajectory, engine call, env call or training phase progresses for watchdog_s."""

    # ---- the loop ---------------------------------------------------------------------------------
    async def train(self) -> list[dict[str, float]]:
        self.tracer.log_params(self.cfg.model_dump())
        if self.cfg.resume and self.load_checkpoint():
            await self.engine.update_weights(self.policy.state_dict(), version=self.step)
        if self.step == 0 and self.eval_rows:
            self._log(await self.evaluate("before"))
        from rich.progress import Progress

        with Progress(console=self.console, transient=False) as progress:
            task = progress.add_task("training", total=self.cfg.steps, completed=self.step)
            while self.step < self.cfg.steps:
                self.step += 1
                self._log(await self.train_step())
                if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 and self.step < self.cfg.steps:
                    self._log(await self.evaluate(f"step{self.step}"))
                if self.cfg.save_every and self.step % self.cfg.save_every == 0:
                    self.save_checkpoint()
                progress.update(task, completed=self.step)
        if self.eval_rows:
            self._log(await self.evaluate("after"))
        self.save_checkpoint()
        return self.history

    async def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        rows = [self.train_rows[i] for i in self.sampler.next_batch()]
        stats = RolloutStats()
        rollout = run_groups(self.rollout, rows, self.cfg.rollout.n, id_prefix=f"s{self.step}-",
                             on_trajectory=self.watchdog.counting(stats.add))
        groups = await self.watchdog.wait(rollout, "trainer.rollout", f"step {self.step}")
        t_rollout = time.perf_counter() - t0
        with TrajectoryWriter(self.out / "trajectories" / "last_step.jsonl") as writer:
            for group in groups:
                for traj in group:
                    self.tracer.export(traj, self.step, "train")
                    writer.write(traj)
        scored, adv_stats = group_advantages(groups, self.cfg)
        samples = [to_sample(t, a) for t, a in scored if a != 0.0 or self.reference is not None]
        fallback = sum(s.rollout_logprobs is None for s in samples)
        if fallback:
            log.warning("step %d: %d trajectories have no usable rollout logprobs; trained without IS correction",
                        self.step, fallback)
        t1 = time.perf_counter()
        with self.watchdog.phase("trainer.update", f"step {self.step}, {len(samples)} samples"):
            update = self.update(samples) if samples else {}
        t_update = time.perf_counter() - t1
        version = await self.watchdog.wait(self.engine.update_weights(self.policy.state_dict(), version=self.step),
                                           "engine.update_weights", f"step {self.step}")
        metrics = {"step": float(self.step), **stats.summary(), **adv_stats, **update,
                   "train/samples": float(len(samples)), "train/is_fallback": float(fallback),
                   "train/policy_version": float(version), "time/rollout_s": t_rollout, "time/update_s": t_update,
                   "time/step_s": time.perf_counter() - t0, "train/lr": self.scheduler.get_last_lr()[0]}
        return metrics

    # ---- the update -------------------------------------------------------------------------------
    def update(self, samples: list[TrainSample]) -> dict[str, float]:
        cfg, a = self.cfg, self.cfg.algo
        temperature = cfg.rollout.sampling.temperature or 1.0
        self.policy.train()
        sums: dict[str, list[float]] = defaultdict(list)
        tokens, t0 = 0, time.perf_counter()
        old = self._old_logprobs(samples, temperature) if cfg.optim.epochs * cfg.optim.mini_batches > 1 else None
        rng = random.Random(cfg.seed * 7919 + self.step)
        for _ in range(cfg.optim.epochs):
            order = list(range(len(samples)))
            rng.shuffle(order)
            for mb in _split(order, cfg.optim.mini_batches):
                masks = [torch.tensor(samples[i].loss_mask) for i in mb]
                mask_B_T = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True)
                denominator = algos.loss_denominator(mask_B_T, a.loss_agg).to(self.device)
                self.optimizer.zero_grad(set_to_none=True)
                rows = pack_sequences([(samples[i].prompt_ids, samples[i].response_ids, samples[i].loss_mask)
                                       for i in mb], cfg.optim.micro_batch_tokens,
                                      [samples[i].mm_inputs for i in mb])
                for row in rows:
                    row = row.to(self.device)
                    members = [mb[k] for k in row.sequence_index]
                    loss, m = self._row_loss(row, [samples[i] for i in members], members, old, temperature,
                                             denominator)
                    loss.backward()
                    tokens += row.input_ids.shape[1]
                    for k, v in m.items():
                        sums[k].append(v)
                if cfg.optim.grad_clip:
                    sums["train/grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(
                        self.policy.parameters(), cfg.optim.grad_clip)))
                self.optimizer.step()
                self.scheduler.step()
        self.policy.eval()
        elapsed = time.perf_counter() - t0
        out = {k: sum(v) / len(v) for k, v in sums.items()}
        out.update({"train/tokens": float(tokens), "train/tokens_per_s": tokens / elapsed if elapsed else 0.0})
        return out

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
        loss_B_T, pg = algos.policy_loss(logp_B_T, old_B_T, adv_B, mask_B_T, clip_low=a.clip_low,
                                         clip_high=a.clip_high, dual_clip=a.dual_clip, ratio_level=a.ratio_level)
        metrics = {f"train/{k}": float(v) for k, v in pg.items()}
        if a.is_mode != "none":
            valid_B = torch.tensor([s.rollout_logprobs is not None for s in batch], device=logp_N.device)
            rollout_B_T = torch.nn.utils.rnn.pad_sequence(
                [torch.tensor(s.rollout_logprobs or [0.0] * len(s.response_ids)) for s in batch], batch_first=True,
            ).to(logp_N.device)
            weights_B_T, ism = algos.rollout_is_weights(old_B_T, rollout_B_T.to(old_B_T.dtype), mask_B_T,
                                                        valid_B=valid_B, mode=a.is_mode, level=a.is_level,
                                                        threshold=a.is_threshold)
            loss_B_T = loss_B_T * weights_B_T
            metrics.update({f"train/{k}": float(v) for k, v in ism.items()})
        if self.reference is not None:
            with torch.no_grad():
                ref_B_T = unpack_to_padded(packed_token_logprobs(self.reference, row, temperature), row, lengths)
            kl_B_T = algos.kl_penalty(logp_B_T, ref_B_T, a.kl_type)
            loss_B_T = loss_B_T + a.kl_coef * kl_B_T
            metrics["train/kl"] = float(algos.masked_mean(kl_B_T.detach(), mask_B_T))
        loss = algos.aggregate_loss(loss_B_T, mask_B_T, a.loss_agg, norm_constant=a.norm_constant,
                                    denominator=denominator)
        metrics["train/loss"] = float(loss.detach())
        return loss, metrics

    @torch.no_grad()
    def _old_logprobs(self, samples: list[TrainSample], temperature: float) -> dict[int, torch.Tensor]:
        """Logprobs of the policy before this step's updates, per sample (needed when it takes >1 update)."""
        old: dict[int, torch.Tensor] = {}
        for row in pack_sequences([(s.prompt_ids, s.response_ids, s.loss_mask) for s in samples],
                                  self.cfg.optim.micro_batch_tokens, [s.mm_inputs for s in samples]):
            row = row.to(self.device)
            logp_N = packed_token_logprobs(self.policy, row, temperature)
            for k, i in enumerate(row.sequence_index):
                old[i] = logp_N[row.target_seq == k]
        return old

    # ---- evaluation, logging, checkpoints -----------------------------------------------------------
    async def evaluate(self, tag: str) -> dict[str, float]:
        """Greedy on the held-out rows (and the sampling policy too when `eval_sampled_n` > 0)."""
        greedy = SamplingParams(temperature=0.0, max_new_tokens=self.cfg.rollout.max_new_tokens)
        metrics = {"step": float(self.step), "eval/tag": tag,
                   **await self._eval_pass(f"{tag}", greedy, self.cfg.eval_n, "eval/")}
        if self.cfg.eval_sampled_n:
            metrics.update(await self._eval_pass(f"{tag}-sampled", self.rollout.sampling, self.cfg.eval_sampled_n,
                                                 "eval/sampled_"))
        return metrics

    async def _eval_pass(self, tag: str, sampling: SamplingParams, n: int, prefix: str) -> dict[str, float]:
        stats = RolloutStats()
        with TrajectoryWriter(self.out / "trajectories" / f"eval_{tag}.jsonl") as writer:
            async for traj in self.rollout.stream(self.eval_rows, n, id_prefix=f"eval-{tag}-", sampling=sampling):
                stats.add(traj)
                self.tracer.export(traj, self.step, "eval")
                writer.write(traj)
        s = stats.summary()
        return {f"{prefix}reward_mean": s.get("rollout/reward_mean", float("nan")),
                f"{prefix}success": sum(r > 0 for r in stats.rewards) / max(len(stats.rewards), 1),
                f"{prefix}turns_mean": s["rollout/turns_mean"], f"{prefix}trajectories": float(stats.count),
                f"{prefix}model_tokens_mean": s["rollout/model_tokens_mean"]}

    def _log(self, metrics: dict[str, Any]) -> None:
        self.history.append(metrics)
        self.tracer.log_metrics(metrics, self.step)
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")
        self.console.print(format_step_line(metrics, self.cfg.steps))

    def save_checkpoint(self) -> Path:
        path = self.out / "checkpoints" / f"step_{self.step:06d}"
        path.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(path / "model")
        self._save_tokenizer(path / "model")
        torch.save({
            "step": self.step, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(), "history": self.history,
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        }, path / "trainer_state.pt")
        (self.out / "checkpoints" / "latest").write_text(path.name)
        return path

    def _save_tokenizer(self, where: Path) -> None:
        """Tokenizer (and a VLM's image processor and chat template) beside the weights: a self-contained dir.
        The processor is saved piecewise: without a video processor its own save_pretrained fails."""
        renderer = getattr(self.rollout, "renderer", None)
        if getattr(renderer, "tokenizer", None) is not None:
            renderer.tokenizer.save_pretrained(where)
        processor = getattr(renderer, "processor", None)
        if processor is not None:
            processor.image_processor.save_pretrained(where)
            (where / "chat_template.jinja").write_text(processor.chat_template)

    def load_checkpoint(self) -> bool:
        """Restore model, optimizer, scheduler, data position, RNG and history from the latest checkpoint."""
        latest = self.out / "checkpoints" / "latest"
        if not latest.exists():
            log.warning("resume: no checkpoint in %s; starting from scratch", self.out)
            return False
        path = self.out / "checkpoints" / latest.read_text().strip()
        from safetensors.torch import load_file

        weights = {}
        for f in sorted((path / "model").glob("*.safetensors")):
            weights.update(load_file(f))
        missing, unexpected = self.policy.load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if "lm_head" not in k]:  # tied heads are not saved twice
            raise RuntimeError(f"checkpoint {path}: missing {missing[:3]} unexpected {unexpected[:3]}")
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.step, self.history = state["step"], state["history"]
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        self.console.print(f"resumed from {path} (step {self.step})")
        return True


def _split(order: list[int], parts: int) -> list[list[int]]:
    size = math.ceil(len(order) / parts)
    return [order[i : i + size] for i in range(0, len(order), size)]


def format_step_line(m: dict[str, Any], total: int) -> str:
    if "eval/reward_mean" in m:
        line = (f"[bold cyan]eval {m['eval/tag']}[/]: greedy reward {m['eval/reward_mean']:.3f}  success "
                f"{m['eval/success']:.0%}  turns {m['eval/turns_mean']:.2f}")
        if "eval/sampled_reward_mean" in m:
            line += (f"  |  sampled reward {m['eval/sampled_reward_mean']:.3f}  success {m['eval/sampled_success']:.0%}"
                     f"  turns {m['eval/sampled_turns_mean']:.2f}")
        return line + f"  ({m['eval/trajectories']:.0f} held-out prompts)"
    reasons = Counter({k.split("/")[-1]: v for k, v in m.items() if k.startswith("rollout/reason/")})
    reason_text = " ".join(f"{k} {v:.0%}" for k, v in reasons.most_common(3))
    loss = f"loss {m['train/loss']:.4f}" if "train/loss" in m else "no trainable samples"
    return (f"step {m['step']:.0f}/{total}  reward {m.get('rollout/reward_mean', float('nan')):.3f}"
            f"±{m.get('rollout/reward_std', float('nan')):.2f}  turns {m['rollout/turns_mean']:.2f}  ({reason_text})  "
            f"gen {m['rollout/tokens_per_s']:.0f} tok/s  train {m.get('train/tokens_per_s', 0):.0f} tok/s  {loss}  "
            f"step {m['time/step_s']:.1f}s")
