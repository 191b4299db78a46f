"""GRPO for multi-turn agents, in one loop you can read top to bottom.

    producer: admit a prompt group whenever the buffer allows, roll it out (local, Ray or remote; rewards
              streamed), hand it to the buffer                                 # turnrl.train.buffer, in the background
    for step in steps:
        groups   = buffer.take(step)                          # earliest deadline first; waits for what is due
        samples  = advantages(groups)                         # per group, over the trajectories we train on
        learner.update(samples, PolicyLoss)                   # packed sequences, loss only where mask = 1
        learner.sync_weights(engine)                          # the engine samples from the new policy
        log / evaluate (greedy, held-out) / checkpoint (with the buffer: nothing in flight is lost)

Sync and async training are this one loop: `trainer.mode=sync` is the buffer with max_staleness 0 (a step's
groups are sampled by the current policy and rollouts wait for the update); `trainer.mode=async` lets rollouts
go on while the update runs, within `trainer.max_staleness` versions (docs/async-training.md).

On N trainer ranks (`trainer.parallel: fsdp`, docs/distributed.md) it is still this loop: rank 0 holds the
producer, the buffer and the engines, takes the groups and broadcasts the samples (`_next_batch`); every rank
updates on its token-balanced share, takes part in the weight sync and writes its part of each checkpoint;
logging and evaluation happen on rank 0.

The policy as it trains (LoRA, FSDP, the KL reference, optimizer, the packed micro-batch step, weight sync) is
the `Learner` (turnrl.train.learner), which SFT shares; this module gives it GRPO's loss, `PolicyLoss`.

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
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console
from rich.progress import Progress

from turnrl.config import AlgoConfig, TrainConfig
from turnrl.observe.loggers import Loggers, build_loggers
from turnrl.observe.stats import RolloutStats, TrajectoryWriter, peak_rss_gb
from turnrl.observe.tracing import TrajectoryTracer
from turnrl.observe.watchdog import Watchdog
from turnrl.rollout.manager import Rollout
from turnrl.train import algos
from turnrl.train.buffer import Group, TrajectoryBuffer, produce
from turnrl.train.checkpoint import resume_checkpoint, save_checkpoint
from turnrl.train.evaluation import Evaluator, format_step_line
from turnrl.train.learner import Learner, MicroBatch
from turnrl.train.samples import PromptSampler, TrainSample, group_advantages, to_sample

log = logging.getLogger(__name__)

STALLED_STEPS = 3
"""Steps in a row without a group whose rewards differ before the loop says that training has stalled."""


class Trainer:
    """The RL loop over built components (turnrl.build makes them from a config): `learner` is the policy as
    it trains, `rollout` runs the trajectories on `engine`, which gets the new weights after each step;
    `tracer` exports trajectories (None: no tracing)."""

    def __init__(self, cfg: TrainConfig, learner: Learner, engine: Any, rollout: Rollout | None,
                 train_rows: list[dict], eval_rows: list[dict], console: Console | None = None,
                 tracer: TrajectoryTracer | None = None, loggers: Loggers | None = None):
        self.cfg, self.learner, self.engine, self.rollout = cfg, learner, engine, rollout
        self.parallel = learner.parallel
        self.train_rows, self.eval_rows = train_rows, eval_rows
        self.console = console or Console()
        self.out = Path(cfg.run_dir or cfg.output_dir)
        """The run directory (`turnrl train` sets cfg.run_dir: turnrl.train.runs); without one, output_dir itself."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.shares_weights = _same_tensors(getattr(engine, "model", None), learner.policy)
        """The engine samples from the policy's own tensors (turnrl.build.shares_weights), not a copy."""
        if self.shares_weights and cfg.trainer.mode != "sync":
            raise ValueError("an engine over the policy's own tensors needs trainer.mode sync: in async mode it would "
                             "sample from weights the optimizer is writing (engine.share_weights: false)")
        self.sampler = PromptSampler(len(train_rows), cfg.prompts_per_step, cfg.seed, cfg.shuffle)
        self.buffer = TrajectoryBuffer(cfg.prompts_per_step, cfg.trainer.max_staleness)
        self.engine_version = 0
        """The policy version the engines sample with (the step whose weights were last pushed)."""
        self._reissue: list[Group] = []
        self._unrecorded_said: set[str] = set()
        """The off-policy corrections already warned about missing from trajectories (`_warn_unrecorded`): once."""
        self._flat_steps = 0
        """Steps in a row whose groups all had equal rewards (nothing trained): said once at STALLED_STEPS."""
        self._started = self._last_step_end = time.perf_counter()
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.tracer = tracer if tracer is not None else TrajectoryTracer(None)
        self.loggers = loggers or build_loggers((), self.out, {}, self.tracer)
        """Where metrics go: metrics.jsonl and the backends of trainer.loggers (turnrl.observe.loggers)."""
        self.evaluator = Evaluator(rollout, eval_rows, out=self.out, tracer=self.tracer, console=self.console,
                                   greedy_n=cfg.eval_n, sampled_n=cfg.eval_sampled_n,
                                   max_new_tokens=cfg.rollout.max_new_tokens)
        self.watchdog = getattr(rollout, "watchdog", None) or Watchdog(cfg.rollout.watchdog_s)
        """Fails the run when no trajectory, engine call, env call or training phase progresses for watchdog_s."""

    # ---- the loop ---------------------------------------------------------------------------------
    async def train(self) -> list[dict[str, float]]:
        self.tracer.log_params(self.cfg.model_dump())
        if self.parallel.is_main:  # the resolved config, every key: what this run is (and marks its directory)
            (self.out / "config.yaml").write_text(yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False))
        if self.cfg.resume:
            self.load_checkpoint()
            await self.sync_weights()
        if self.step == 0:
            await self._evaluate_on_main("before")
        producer = self._start_producer()
        try:
            with Progress(console=self.console, transient=False, disable=not self.parallel.is_main) as progress:
                self.evaluator.progress = progress
                task = progress.add_task("training", total=self.cfg.steps, completed=self.step)
                while self.step < self.cfg.steps:
                    self.step += 1
                    self._log(await self.train_step())
                    if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 and self.step < self.cfg.steps:
                        await self._evaluate_on_main(f"step{self.step}")
                    if self.cfg.save_every and self.step % self.cfg.save_every == 0:
                        self.save_checkpoint(final=False)
                    progress.update(task, completed=self.step)
        finally:
            self.evaluator.progress = None
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
                "time/step_s": self._last_step_end - t0, "train/lr": self.learner.scheduler.get_last_lr()[0],
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
        samples = [to_sample(t, a) for t, a in scored if a != 0.0 or self.cfg.algo.kl_coef > 0]
        fallback = sum(s.rollout_logprobs is None for s in samples)
        if fallback:
            log.warning("step %d: %d trajectories have no usable rollout logprobs; trained without IS correction",
                        self.step, fallback)
        self._warn_unrecorded(samples)
        return samples, {**stats.summary(), **adv_stats, **self._rollout_metrics()}

    def _rollout_metrics(self) -> dict[str, float]:
        """rollout/turns_per_s, rollout/concurrency, rollout/kv_occupancy, rollout/preemptions (and per Ray rollout
        worker, rollout/worker<k>/...) from the rollout's `stats()`, where it has one."""
        report = getattr(self.rollout, "stats", None)
        if not callable(report):
            return {}
        try:
            return {f"rollout/{k}": float(v) for k, v in report().items()}
        except Exception as e:  # metrics never stop training
            log.warning("rollout stats failed: %s: %s", type(e).__name__, e)
            return {}

    def _warn_unrecorded(self, samples: list[TrainSample]) -> None:
        """Once per run and correction: trajectories that lack the kept sets (top-k / top-p) or the routing the
        config has the engine record (an engine that cannot report them, tokens a scheduler replaced, an older
        file) are scored under the full softmax / the trainer's own routing (docs/off-policy.md)."""
        a, r = self.cfg.algo, self.cfg.rollout
        trained = [s for s in samples if any(s.loss_mask)]
        missing = {"kept sets": sum(s.kept_counts is None for s in trained)
                   if a.sampling_mask == "renormalize" and r.records_sampling_mask else 0,
                   "routing": sum(s.routed_experts is None for s in trained) if a.router_replay else 0}
        instead = {"kept sets": "the full softmax", "routing": "the trainer's own routing"}
        for what, n in missing.items():
            if n and what not in self._unrecorded_said:
                self._unrecorded_said.add(what)
                log.warning("step %d: %d of %d trajectories carry no %s (the engine did not report them); their "
                            "tokens are scored under %s (said once)", self.step, n, len(samples), what, instead[what])

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


    # ---- the update, weight sync, evaluation, logs, checkpoints -------------------------------------
    def update(self, samples: list[TrainSample]) -> dict[str, float]:
        """PPO epochs over `samples` with GRPO's loss (every rank passes the same list): the learner's update."""
        return self.learner.update(samples, PolicyLoss(self.cfg.algo, version=self.step - 1), step=self.step)

    async def sync_weights(self) -> dict[str, float]:
        """The engine samples from the new policy: its weights streamed in buckets of weight_sync.bucket_mb
        (rank 0 pushes, every rank gathers); requests in flight pause as weight_sync.pause says."""
        metrics = await self.learner.sync_weights(self.engine, version=self.step)
        self.engine_version = self.step
        return metrics

    async def evaluate(self, tag: str, *, greedy: bool = True, sampled_n: int | None = None,
                       out: Path | None = None) -> dict[str, Any]:
        """The held-out rows: greedy decoding (temperature 0, `eval_n` samples per row) and, when `sampled_n`
        (default `eval_sampled_n`) > 0, the sampling policy (rollout.sampling: the training temperature) with
        that many samples per row (turnrl.train.evaluation)."""
        return await self.evaluator.evaluate(tag, self.step, greedy=greedy, sampled_n=sampled_n, out=out)

    def _log(self, metrics: dict[str, Any]) -> None:
        self.history.append(metrics)
        if "eval/tag" not in metrics:
            self._say_if_stalled(metrics)
        if self.parallel.is_main:
            self.loggers.log(metrics, self.step)
            self.console.print(format_step_line(metrics, self.cfg.steps))

    def _say_if_stalled(self, metrics: dict[str, Any]) -> None:
        """Warn once per stall when STALLED_STEPS steps in a row had no group whose samples' rewards differ."""
        self._flat_steps = self._flat_steps + 1 if metrics.get("train/constant_group_frac") == 1.0 else 0
        if self._flat_steps == STALLED_STEPS and self.parallel.is_main:
            log.warning("steps %d-%d: in every group all samples got the same reward, so every advantage was 0 and "
                        "nothing trained: the policy has stopped exploring these prompts (more samples per group, "
                        "rollout.n; a higher sampling temperature; or a graded reward give it signal again)",
                        self.step - STALLED_STEPS + 1, self.step)

    def save_checkpoint(self, final: bool = True) -> Path:
        """The learner's sharded state, this loop's (step, data position, history, the buffer: nothing in flight
        is lost) and a Hugging Face model dir (turnrl.train.checkpoint); the run keeps the newest
        trainer.keep_checkpoints. `final`: the run's last checkpoint (trainer.save_hf="final" gives it the
        Hugging Face weights; the others keep only what resuming needs)."""
        save_hf = self.cfg.trainer.save_hf
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "history": self.history,
                 "buffer": self.buffer.state_dict(), "config": self.cfg.model_dump()} if self.parallel.is_main else {}
        return save_checkpoint(self.learner, self.out / "checkpoints" / f"step_{self.step:06d}", state,
                               renderer=getattr(self.rollout, "renderer", None),
                               hf_weights=save_hf is True or (save_hf == "final" and final),
                               keep=self.cfg.trainer.keep_checkpoints)

    def load_checkpoint(self) -> None:
        """Restore weights, optimizer, scheduler, data position, the buffer, RNG and history from the checkpoint
        to resume (cfg.resume: turnrl.train.checkpoint.resume_point, a ValueError when there is none), whatever
        world size wrote it."""
        lora = self.cfg.trainer.lora
        state = resume_checkpoint(self.learner, self.out, self.cfg.resume, console=self.console,
                                  lora=lora.model_dump() if lora else None)
        self.sampler.load_state_dict(state["sampler"])
        self._reissue = self.buffer.load_state_dict(state["buffer"]) if "buffer" in state else []
        self.step, self.history = state["step"], state["history"]


@dataclass(frozen=True)
class PolicyLoss:
    """GRPO's per-token loss of one micro-batch (the learner aggregates it as algo.loss_agg says): PPO's clipped
    surrogate against the proximal policy (`algo.decoupled`) or the behaviour one, importance weights against
    the engine's logprobs, and the KL term. The formulas are turnrl.train.algos'."""

    algo: AlgoConfig
    version: int
    """The policy version being updated (step - 1): a sampled token's staleness is this minus its version."""

    def __call__(self, batch: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        a, samples, logp_B_T, mask_B_T, old_B_T = self.algo, batch.samples, batch.logp_B_T, batch.mask_B_T, batch.old_B_T
        adv_B = torch.tensor([s.advantage for s in samples], dtype=logp_B_T.dtype, device=logp_B_T.device)
        valid_B = torch.tensor([s.rollout_logprobs is not None for s in samples], device=logp_B_T.device)
        rollout_B_T = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(s.rollout_logprobs or [0.0] * len(s.response_ids)) for s in samples], batch_first=True,
        ).to(logp_B_T.device, old_B_T.dtype)
        metrics = mismatch_by_staleness(old_B_T, rollout_B_T, mask_B_T, valid_B, samples, self.version)
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
        # the mismatch with the engine's distribution over each token's kept set, and with the full softmax
        metrics["train/mismatch_kl_k3"] = float(algos.mismatch_kl_k3(batch.old_kept_B_T, rollout_B_T, mask_B_T, valid_B))
        metrics["train/mismatch_kl_k3_unmasked"] = float(
            algos.mismatch_kl_k3(batch.old_full_B_T, rollout_B_T, mask_B_T, valid_B))
        if a.kl_coef > 0:
            assert batch.ref_B_T is not None  # the learner keeps a reference when kl_coef > 0 (build.learner_options)
            kl_B_T = algos.kl_penalty(logp_B_T, batch.ref_B_T, a.kl_type)
            loss_B_T = loss_B_T + a.kl_coef * kl_B_T
            metrics["train/kl"] = float(algos.masked_mean(kl_B_T.detach(), mask_B_T))
        return loss_B_T, _weigh_correction_metrics(metrics, samples)


def _weigh_correction_metrics(metrics: dict[str, float], samples: list[TrainSample]) -> dict[str, float]:
    """The IS and mismatch metrics are means over the trained tokens of samples with rollout logprobs, and
    is_valid_frac over samples: their weights in the update's tally (`_count/`; the rest weigh by trained tokens)."""
    corrected = float(sum(sum(s.loss_mask) for s in samples if s.rollout_logprobs is not None))
    for k in [k for k in metrics if k.startswith(("train/is_", "train/mismatch_")) and f"_count/{k}" not in metrics]:
        metrics[f"_count/{k}"] = float(len(samples)) if k == "train/is_valid_frac" else corrected
    return metrics


@torch.no_grad()
def mismatch_by_staleness(old_B_T: torch.Tensor, rollout_B_T: torch.Tensor, mask_B_T: torch.Tensor,
                          valid_B: torch.Tensor, samples: list[TrainSample], version: int) -> dict[str, float]:
    """k3 estimate of KL(behaviour ‖ proximal) per token staleness (versions between the policy being updated,
    `version`, and the one that sampled the token): how far each age of data is off-policy. Token counts ride
    along under `_count/` keys so the tally weights each bucket by its own tokens."""
    if not any(s.versions for s in samples):
        return {}
    versions_B_T = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(s.versions or [-1] * len(s.response_ids)) for s in samples], batch_first=True,
        padding_value=-1).to(old_B_T.device)
    used_B_T = mask_B_T.bool() & valid_B[:, None] & (versions_B_T >= 0)
    log_ratio_B_T = (old_B_T - rollout_B_T).clamp(-20, 20)
    k3_B_T = log_ratio_B_T.exp() - 1 - log_ratio_B_T
    staleness_B_T = version - versions_B_T
    out: dict[str, float] = {}
    for d in staleness_B_T[used_B_T].unique().tolist():
        bucket = used_B_T & (staleness_B_T == d)
        key = f"train/mismatch_kl_k3/staleness_{int(d)}"
        out[key], out[f"_count/{key}"] = float(k3_B_T[bucket].mean()), float(bucket.sum())
    return out


def _same_tensors(engine_model: torch.nn.Module | None, policy: torch.nn.Module) -> bool:
    if not isinstance(engine_model, torch.nn.Module):
        return False
    return next(engine_model.parameters()) is next(policy.parameters())


async def _stop(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _engine_idle(engine: Any, wall_s: float) -> float | None:
    """The engine's idle share of `wall_s`, where it counts its busy time (the embedded engine does)."""
    busy = getattr(engine, "stats", {}).get("busy_s") if isinstance(getattr(engine, "stats", None), dict) else None
    return None if busy is None or wall_s <= 0 else max(0.0, 1.0 - busy / wall_s)
