"""What the update trains on: trajectories become `TrainSample`s with group-relative advantages, and the prompt
rows of each step come from a resumable sampler.

    scored, stats = group_advantages(groups, cfg)          # per group, over the trajectories we train on
    samples = [to_sample(traj, adv) for traj, adv in scored]
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from turnrl.config import TrainConfig
from turnrl.train import algos
from turnrl.types import Trajectory


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
    kept_counts: list[int | None] | None = None
    """Aligned with response_ids: the size of the kept set each sampled token was drawn from (top-k / top-p; None at
    mask 0); None: not recorded, the trainer scores under the full softmax (Trajectory.kept_counts)."""
    routed_experts: torch.Tensor | None = None
    """[tokens, MoE layers, top_k] experts the engine routed prompt + response through (Trajectory.routed_experts),
    forced in the trainer's forward under algo.router_replay; None: not recorded."""


def group_advantages(groups: list[list[Trajectory]], cfg: TrainConfig) -> tuple[list[tuple[Trajectory, float]], dict]:
    """Advantages per group over the trajectories we train on. The branches of an episode (several trajectories with
    one `episode_id`: splits, compactions, forks, sub-agents) count once in their group, with the episode's reward:
    its last branch's (where it ended). A branch whose own reward differs (an env or harness that rewards branches)
    is scored against the same group baseline: its advantage is the episode's plus (its reward − the episode's)
    over the group's std (GRPO; 1 with normalize_std off, and RLOO); a constant group gives every branch 0.
    In a game the policy plays in every seat (`rollout_infos["seat"]` on each seat's trajectories), each seat is an
    episode of its own against the group's other games' same seat: in a zero-sum game a shared baseline would push
    the loser's advantage off centre and give a seat that always loses no signal."""
    train_on = set(cfg.algo.train_on)
    kept: list[Trajectory] = []
    episode_keys: list[tuple[int, int, str]] = []  # (group, seat, episode): a seat plays against its own kind
    for g, group in enumerate(groups):
        for traj in group:
            if str(traj.status) in train_on and traj.reward is not None:
                kept.append(traj)
                episode_keys.append((g, int(traj.rollout_infos.get("seat", 0)), traj.episode_id or traj.id))
    if not kept:
        return [], {"train/trained_trajectories": 0.0}
    episode_reward: dict[tuple[int, int, str], float] = {}
    for key, traj in zip(episode_keys, kept, strict=True):
        episode_reward[key] = float(traj.reward)  # type: ignore[arg-type]  # the last branch's wins
    episodes = list(episode_reward)
    baselines = {b: i for i, b in enumerate(dict.fromkeys(e[:2] for e in episodes))}
    rewards_E = torch.tensor([episode_reward[e] for e in episodes], dtype=torch.float64)
    groups_E = torch.tensor([baselines[e[:2]] for e in episodes])
    if cfg.algo.advantage == "rloo":
        adv_E = algos.rloo_advantages(rewards_E, groups_E)
    else:
        adv_E = algos.grpo_advantages(rewards_E, groups_E, normalize_std=cfg.algo.normalize_std)
    adv_of = dict(zip(episodes, adv_E.tolist(), strict=True))
    slope = _reward_slope(rewards_E, groups_E, cfg)
    stats = {f"train/{k}": float(v) for k, v in algos.group_reward_stats(rewards_E, groups_E).items()}
    stats["train/trained_trajectories"] = float(len(kept))
    return [(traj, adv_of[key] + (float(traj.reward) - episode_reward[key]) * slope[baselines[key[:2]]])  # type: ignore[arg-type]
            for traj, key in zip(kept, episode_keys, strict=True)], stats


def _reward_slope(rewards_E: torch.Tensor, groups_E: torch.Tensor, cfg: TrainConfig) -> dict[int, float]:
    """d advantage / d reward of each group with its baseline fixed: 1 / (std + eps) for GRPO, 1 with normalize_std
    off and for RLOO, 0 for a constant group (no learning signal)."""
    out = {}
    for g in groups_E.unique().tolist():
        r = rewards_E[groups_E == g]
        if bool((r == r[0]).all()):
            out[g] = 0.0
        elif cfg.algo.advantage == "grpo" and cfg.algo.normalize_std:
            out[g] = 1.0 / (float(r.std()) + 1e-6)
        else:
            out[g] = 1.0
    return out


def to_sample(traj: Trajectory, advantage: float) -> TrainSample:
    logprobs = traj.rollout_logprobs
    behaviour = None
    if logprobs is not None and len(logprobs) == len(traj.response_ids):
        behaviour = [0.0 if lp is None else lp for lp in logprobs]
    versions = [-1 if s.policy_version is None or not m else s.policy_version
                for s in traj.segments for m in s.loss_mask]
    return TrainSample(traj.prompt_ids, traj.response_ids, traj.loss_mask, behaviour, advantage,
                       traj.mm_train_inputs or None, versions, traj.kept_counts, traj.routed_experts)
