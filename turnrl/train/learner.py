"""The policy as it trains, one object that RL (turnrl.train.loop) and SFT (turnrl.train.sft) share: LoRA
adapters, activation checkpointing, FSDP2 shards, the frozen KL reference, AdamW with its warm-up, the update
over packed micro-batches, and the weight push to the engines.

    learner = Learner(policy, parallel, options)            # options: turnrl.build.learner_options(cfg)
    metrics = learner.update(samples, loss_fn, step=k)      # epochs × mini-batches optimizer steps
    await learner.sync_weights(engine, version=k)           # the engines sample from the new policy

The update knows no advantages and no NLL: `loss_fn` maps one packed micro-batch (`MicroBatch`: the policy's
logprobs of its samples' response tokens, with the mask, the "old" and the reference logprobs) to a per-token
loss and its metrics. The learner does the rest, the same for any loss and at any world size: each rank takes
its token-balanced share of a mini-batch, packs it (`pack`, the one packing call: a tree packer would go
there), aggregates the loss over the mini-batch's global token or sequence count (`loss_agg`), backpropagates,
clips and steps. Built from plain arguments: nothing here reads a config.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import math
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from turnrl.models import freeze
from turnrl.moe import replay_routing
from turnrl.train import algos
from turnrl.train.packing import (
    PackedRow,
    pack_sequences,
    packed_kept_logprobs,
    row_kept_counts,
    row_routing,
    unpack_to_padded,
    use_varlen_attention,
)
from turnrl.train.parallel import Parallel, balanced_split
from turnrl.train.samples import TrainSample
from turnrl.train.tree import (
    TreeRow,
    families,
    pack_tree,
    tree_kept_logprobs,
    tree_row_routing,
    unique_tokens,
    use_tree_attention,
)
from turnrl.train.weights import push_weights


@dataclass(frozen=True)
class LearnerOptions:
    """How the policy trains; turnrl.build.learner_options fills it from the config's optim, algo, trainer and
    weight_sync sections (each field's meaning is documented there, docs/config.md)."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    warmup_steps: int
    """Linear learning-rate warm-up over this many optimizer steps, then constant."""
    lr_scale: Mapping[str, float]
    """lr × the value of the first key a parameter's name contains (`param_groups`)."""
    freeze: tuple[str, ...]
    """Parameters whose name contains one of these do not train."""
    epochs: int
    mini_batches: int
    """Optimizer steps per epoch: an update is epochs × mini_batches steps."""
    micro_batch_tokens: int
    """Tokens per packed forward and backward."""
    grad_clip: float | None
    gradient_checkpointing: bool
    loss_agg: algos.AggregationMode
    """How per-token losses add up to a mini-batch's loss (algos.aggregate_loss), over every rank's tokens."""
    norm_constant: float | None
    temperature: float
    """Logprobs of logits / temperature: the sampling temperature for RL (the engine's distribution), 1 for SFT."""
    kl_reference: bool
    """Keep the frozen reference policy and give every micro-batch its logprobs (`MicroBatch.ref_B_T`)."""
    dtype: torch.dtype
    """The weights' dtype: compute dtype when sharded (float32: none), and what engines and exports get."""
    cpu_offload: bool
    seed: int
    """With the step, the order samples are shuffled into mini-batches."""
    sync_bucket_bytes: int
    """Weight sync: tensors go to the engines in buckets of about this many bytes."""
    sync_pause: Literal["abort", "wait", "keep"]
    """Weight sync: what requests in flight do (Engine.update_weights' `pause`)."""
    lora: Callable[[nn.Module], nn.Module] | None = None
    """Wraps the policy in LoRA adapters that alone train (turnrl.train.lora.apply_lora); the KL reference is
    then the policy with its adapters off. None: every weight trains."""
    sampling_mask: Literal["renormalize", "ignore"] = "renormalize"
    """The logprobs the loss gets for tokens sampled from a kept set (`TrainSample.kept_counts`, top-k / top-p):
    renormalised over that set, as the engine sampled them, or under the full softmax (docs/off-policy.md)."""
    router_replay: bool = False
    """Force each sample's recorded MoE routing (`TrainSample.routed_experts`) in every forward and its backward."""
    packing: Literal["tree", "flat"] = "tree"
    """tree: each micro-batch a prefix trie, shared tokens forwarded once (turnrl.train.tree); flat: each sample
    packed separately (turnrl.train.packing). `micro_batch_tokens` bounds the tokens a row forwards either way."""
    attention: Literal["sdpa", "flex"] = "sdpa"
    """Tree rows' attention kernel (turnrl.train.tree.tree_attention)."""


@dataclass
class MicroBatch:
    """What a loss function sees of one packed micro-batch: its samples in row order and [B, T] tensors over
    their response tokens (T: the longest response), zero after each response and wherever the mask is 0."""

    samples: list[TrainSample]
    logp_B_T: torch.Tensor
    """The policy's logprobs of the response tokens, with gradients."""
    mask_B_T: torch.Tensor
    """1 where a token is trained."""
    old_B_T: torch.Tensor
    """Logprobs before this update (the proximal policy): `logp_B_T` detached when an update takes one step."""
    ref_B_T: torch.Tensor | None
    """The KL reference's logprobs (`LearnerOptions.kl_reference`), else None."""
    old_kept_B_T: torch.Tensor
    """`old_B_T` renormalised over each token's kept set (the full softmax for tokens without one): the engine's
    distribution where it sampled with top-k / top-p, for `train/mismatch_kl_k3`."""
    old_full_B_T: torch.Tensor
    """`old_B_T` under the full softmax, for `train/mismatch_kl_k3_unmasked`. `old_B_T` is one of the two, as
    `LearnerOptions.sampling_mask` says."""


LossFn = Callable[[MicroBatch], tuple[torch.Tensor, dict[str, float]]]
"""A micro-batch's per-token loss [B, T] (to minimise; the learner aggregates it) and metrics. A metric is a
mean over the micro-batch's trained tokens unless `_count/<name>` gives its own weight (e.g. its samples)."""


class Learner:
    """The policy as it trains over `parallel` (one process, or N FSDP2 ranks), its optimizer and scheduler,
    and the frozen KL reference (`options.kl_reference`)."""

    def __init__(self, policy: nn.Module, parallel: Parallel, options: LearnerOptions):
        self.parallel, self.options = parallel, options
        self.vocab_size = int(policy.get_output_embeddings().weight.shape[0])  # type: ignore[operator]  # a transformers model
        """Logits per position: a kept set of this size is the whole vocabulary (`TrainSample.kept_counts`)."""
        self.policy, self.reference = self._prepare(policy)
        self._through_backward = contextlib.ExitStack()
        """What a forward with gradients holds until its row's backward has run (router replay: activation
        checkpointing recomputes the forward there); `_optimizer_step` closes it after each row."""
        self.device = parallel.device
        if self.device.type == "cpu":
            map_large_allocations()
        o = options
        # fused: one kernel over all parameters instead of a Python loop over each (~4x faster step on CPU)
        self.optimizer = torch.optim.AdamW(param_groups(self.policy, o.lr, dict(o.lr_scale)), lr=o.lr,
                                           betas=o.betas, weight_decay=o.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda k: min(1.0, (k + 1) / o.warmup_steps) if o.warmup_steps else 1.0)

    def _prepare(self, policy: Any) -> tuple[Any, nn.Module | None]:
        """The policy as it trains (LoRA adapters, activation checkpointing, sharded over the ranks) and the
        frozen KL reference, sharded the same way; with LoRA the reference is the policy with its adapters
        off, so there is no second model."""
        o = self.options
        reference = None
        if o.kl_reference and o.lora is None:
            reference = copy.deepcopy(policy).eval().requires_grad_(False)
        if o.gradient_checkpointing:  # non-reentrant: works with frozen inputs (LoRA) and FSDP
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if o.lora is not None:
            policy = o.lora(policy)
        freeze(policy, list(o.freeze))
        compute = None if o.dtype == torch.float32 else o.dtype
        for m in (policy, reference):
            if m is not None:
                (use_tree_attention if o.packing == "tree" else use_varlen_attention)(m)
                self.parallel.shard(m, compute_dtype=compute, cpu_offload=o.cpu_offload)
        return policy, reference

    def update(self, samples: list[TrainSample], loss_fn: LossFn, *, step: int = 0) -> dict[str, float]:
        """Epochs over `samples` (every rank passes the same list), each shuffled into mini-batches of one
        optimizer step; the same update at any world size. `step` seeds the shuffle."""
        o = self.options
        self.policy.train()
        tally, t0 = _Tally(), time.perf_counter()
        old = self._old_logprobs(samples) if o.epochs * o.mini_batches > 1 else None
        rng = random.Random(o.seed * 7919 + step)
        for _ in range(o.epochs):
            order = list(range(len(samples)))
            rng.shuffle(order)
            for mb in _split(order, o.mini_batches):
                self._optimizer_step(samples, mb, old, loss_fn, tally)
        self.policy.eval()
        release_freed_memory()
        return tally.summary(self.parallel, time.perf_counter() - t0)

    def _optimizer_step(self, samples: list[TrainSample], mb: list[int], old: dict[int, torch.Tensor] | None,
                        loss_fn: LossFn, tally: _Tally) -> None:
        """One optimizer step on the mini-batch `mb`: this rank trains on its token-balanced share, packed into
        micro-batches of at most `micro_batch_tokens`, and divides by the mini-batch's global token (or
        sequence) count; FSDP sums the gradients over ranks, so the step is the one-process step."""
        o = self.options
        mine = self._my_share(samples, mb)
        local = float(algos.loss_denominator(_padded_masks(samples, mine), o.loss_agg)) if mine else 0.0
        denominator = torch.tensor(self.parallel.all_sum([local])[0], device=self.device)
        self.optimizer.zero_grad(set_to_none=True)
        rows = self.pack(samples, mine)
        for k in range(self.parallel.all_max(len(rows))):  # FSDP: every rank runs as many forwards
            if k >= len(rows):  # a padding row: the collectives of a forward and backward, zero gradient
                with self._through_backward:
                    loss, _ = self._row_loss(_padding_row().to(self.device), [_PADDING], None, loss_fn, denominator)
                    (loss * 0.0).backward()
                continue
            row = rows[k].to(self.device)
            with self._through_backward:
                loss, metrics = self._row_loss(row, samples, old, loss_fn, denominator)
                loss.backward()
            trained = sum(sum(samples[i].loss_mask) for i in row.sequence_index)
            tally.add_row(metrics, trained=trained, tokens=row.input_ids.shape[1],
                          raw=row.tokens_raw if isinstance(row, TreeRow) else row.input_ids.shape[1])
        if o.grad_clip:
            tally.grad_norms.append(self.parallel.clip_grad_norm(
                [p for p in self.policy.parameters() if p.requires_grad], o.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        tally.steps += 1

    def pack(self, samples: list[TrainSample], indices: list[int]) -> list[PackedRow]:
        """`samples[indices]` packed into micro-batch rows of at most `micro_batch_tokens` (unique tokens with tree
        packing: a `TreeRow` each); `sequence_index` holds indices into `samples`."""
        o = self.options
        sequences = [(samples[i].prompt_ids, samples[i].response_ids, samples[i].loss_mask) for i in indices]
        mm = [samples[i].mm_inputs for i in indices]
        rows: list[PackedRow]
        if o.packing == "tree":
            rows = list(pack_tree(sequences, o.micro_batch_tokens, mm, self._image_token_id))
            for row in rows:
                assert isinstance(row, TreeRow) and row.tree is not None
                row.tree.kernel = o.attention
        else:
            rows = list(pack_sequences(sequences, o.micro_batch_tokens, mm))
        return [dataclasses.replace(r, sequence_index=[indices[j] for j in r.sequence_index]) for r in rows]

    def _my_share(self, samples: list[TrainSample], indices: list[int]) -> list[int]:
        """This rank's part of `samples[indices]`, balanced over the ranks by the tokens it forwards: flat, each
        sample's; tree, each family's unique tokens, a family (samples sharing most of their prefix: a group,
        an episode's branches) kept on one rank."""
        sequences = [(samples[i].prompt_ids, samples[i].response_ids, samples[i].loss_mask) for i in indices]
        if self.options.packing == "flat":
            return [indices[k] for k in self.parallel.my_share([len(p) + len(r) for p, r, _ in sequences])]
        fams = families(sequences)
        share = balanced_split([unique_tokens(sequences, f) for f in fams], self.parallel.world_size)
        return [indices[k] for k in sorted(k for f in share[self.parallel.rank] for k in fams[f])]

    @property
    def _image_token_id(self) -> int | None:
        config = self.policy.config
        return getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)

    def _logprobs(self, model: nn.Module, row: PackedRow,
                  samples: list[TrainSample] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logprobs under `model` of the tokens `row` trains, at `temperature`, as the loss uses them
        (`sampling_mask`), renormalised over each token's kept set, and under the full softmax: [N] each, the first
        one of the other two. Under `router_replay` the forward takes the experts its samples record (held through
        the row's backward when it has gradients). With `pack`, the one place that knows how samples are packed
        (flat: turnrl.train.packing); `row.sequence_index` indexes `samples` (None: samples without kept sets or
        routing)."""
        o = self.options
        kept = [None] * (max(row.sequence_index) + 1) if samples is None else [s.kept_counts for s in samples]
        kept_N = row_kept_counts(row, kept, self.vocab_size)
        routing = None
        if o.router_replay and samples:
            experts = [s.routed_experts for s in samples]
            routing = tree_row_routing(row, experts) if isinstance(row, TreeRow) else row_routing(row, experts)
        with contextlib.ExitStack() as forward_only:
            if routing is not None:
                held = self._through_backward if torch.is_grad_enabled() else forward_only
                held.enter_context(replay_routing(model, routing.to(self.device)))
            kept_logp_N, full_logp_N = (tree_kept_logprobs(model, row, kept_N, o.temperature)
                                        if isinstance(row, TreeRow) else
                                        packed_kept_logprobs(model, row, kept_N, o.temperature))
        return (kept_logp_N if o.sampling_mask == "renormalize" else full_logp_N), kept_logp_N, full_logp_N

    def _row_loss(self, row: PackedRow, samples: list[TrainSample], old: dict[int, torch.Tensor] | None,
                  loss_fn: LossFn, denominator: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """`loss_fn` on one packed row of `samples`, aggregated into its share of the mini-batch's loss."""
        o = self.options
        batch = [samples[i] for i in row.sequence_index]
        lengths = [len(s.response_ids) for s in batch]
        logp_N, kept_N, full_N = self._logprobs(self.policy, row, samples)
        if old is not None:  # before this update
            kept_N, full_N = torch.cat([old[i] for i in row.sequence_index], dim=1)
        mask_B_T = unpack_to_padded(torch.ones_like(logp_N), row, lengths)
        kept_B_T, full_B_T = (unpack_to_padded(x.detach(), row, lengths) for x in (kept_N, full_N))
        ref_B_T = unpack_to_padded(self.reference_logprobs(row, samples), row, lengths) if o.kl_reference else None
        old_B_T = kept_B_T if o.sampling_mask == "renormalize" else full_B_T
        loss_B_T, metrics = loss_fn(MicroBatch(batch, unpack_to_padded(logp_N, row, lengths), mask_B_T, old_B_T,
                                               ref_B_T, kept_B_T, full_B_T))
        loss = algos.aggregate_loss(loss_B_T, mask_B_T, o.loss_agg, norm_constant=o.norm_constant,
                                    denominator=denominator)
        metrics["train/loss"] = float(loss.detach())
        return loss, metrics

    @torch.no_grad()
    def reference_logprobs(self, row: PackedRow, samples: list[TrainSample] | None = None) -> torch.Tensor:
        """Logprobs under the KL reference, scored as the policy's are (`_logprobs`; `row.sequence_index` indexes
        `samples`, None: without kept sets or routing): the frozen copy, or with LoRA the policy with its adapters
        off. [N]"""
        if self.reference is not None:
            return self._logprobs(self.reference, row, samples)[0]
        with self.policy.disable_adapter():
            return self._logprobs(self.policy, row, samples)[0]

    @torch.no_grad()
    def _old_logprobs(self, samples: list[TrainSample]) -> dict[int, torch.Tensor]:
        """Logprobs of the policy before this update, per sample: [2, its trained tokens], renormalised over the kept
        sets and under the full softmax (`_logprobs`; needed when the update takes more than one step). Each rank
        computes its token-balanced share; every rank gets all of them."""
        rows = self.pack(samples, self._my_share(samples, list(range(len(samples)))))
        old: dict[int, torch.Tensor] = {}
        for k in range(self.parallel.all_max(len(rows))):
            row, row_samples = (rows[k], samples) if k < len(rows) else (_padding_row(), [_PADDING])
            row = row.to(self.device)
            logp_2_N = torch.stack(self._logprobs(self.policy, row, row_samples)[1:])
            if k < len(rows):
                for j, i in enumerate(row.sequence_index):
                    old[i] = logp_2_N[:, row.target_seq == j].cpu()
        if self.parallel.sharded:
            old = {i: t for part in self.parallel.all_gather_object(old) for i, t in part.items()}
        return {i: t.to(self.device) for i, t in old.items()}

    async def sync_weights(self, engine: Any, version: int) -> dict[str, float]:
        """The engine samples from the policy as it is now, as `version`: whole weights streamed in buckets
        (rank 0 pushes, every rank gathers; with LoRA the merged adapted layers only); requests in flight
        pause as `sync_pause` says."""
        o = self.options
        return await push_weights(engine, self.policy, self.parallel, bucket_bytes=o.sync_bucket_bytes,
                                  dtype=o.dtype, version=version, pause=o.sync_pause)


class _Tally:
    """Update metrics that mean the same at any world size: `train/loss` is each mini-batch's loss (the sum of
    its micro-batches' shares over all ranks), averaged over optimizer steps; the other metrics are means,
    across all ranks, over what they are defined on: trained tokens, unless the loss function gave a metric
    its own weight (`_count/<name>`: e.g. the IS metrics' tokens with rollout logprobs, or samples). A value
    defined per micro-batch (`is_ess`) is averaged the same way."""

    def __init__(self):
        self.weighted: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.loss, self.tokens, self.raw, self.steps = 0.0, 0, 0, 0
        self.grad_norms: list[float] = []

    def add_row(self, metrics: dict[str, float], *, trained: int, tokens: int, raw: int) -> None:
        """One micro-batch's metrics: `trained` tokens (mask 1) of `raw` sample tokens, `tokens` forwarded."""
        self.loss += metrics.pop("train/loss")
        counts = {k.removeprefix("_count/"): metrics.pop(k) for k in [k for k in metrics if k.startswith("_count/")]}
        for k, v in metrics.items():
            weight = counts.get(k, trained)
            self.weighted[k] += v * weight
            self.weights[k] += weight
        self.tokens += tokens
        self.raw += raw

    def summary(self, parallel: Parallel, elapsed: float) -> dict[str, float]:
        parts = parallel.all_gather_object((dict(self.weighted), dict(self.weights), self.loss, self.tokens, self.raw))
        weighted: defaultdict[str, float] = defaultdict(float)
        weights: defaultdict[str, float] = defaultdict(float)
        for w, n, *_ in parts:
            for k in w:
                weighted[k] += w[k]
                weights[k] += n[k]
        out = {k: weighted[k] / weights[k] if weights[k] else 0.0 for k in sorted(weighted)}
        forwarded, tokens = sum(p[3] for p in parts), sum(p[4] for p in parts)
        out["train/loss"] = sum(p[2] for p in parts) / max(self.steps, 1)
        if self.grad_norms:
            out["train/grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        out.update({"train/tokens": float(tokens), "train/tokens_per_s": tokens / elapsed if elapsed else 0.0,
                    "train/tokens_forwarded": float(forwarded), "train/tokens_raw": float(tokens),
                    "train/packing_ratio": tokens / forwarded if forwarded else 1.0})
        return out


def param_groups(model: nn.Module, lr: float, scales: dict[str, float]) -> list[dict[str, Any]]:
    """The trainable parameters in optimizer groups: lr × the scale of the first key of `scales` its name
    contains (optim.lr_scale), else lr; a key that names no parameter is an error (a typo would train at lr)."""
    groups: dict[float, list[nn.Parameter]] = defaultdict(list)
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


_PADDING = TrainSample([0], [0], [1], None, 0.0)


def _padding_row() -> PackedRow:
    return pack_sequences([(_PADDING.prompt_ids, _PADDING.response_ids, _PADDING.loss_mask)], 64)[0]


def _padded_masks(samples: list[TrainSample], indices: list[int]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence([torch.tensor(samples[i].loss_mask) for i in indices], batch_first=True)


def _split(order: list[int], parts: int) -> list[list[int]]:
    size = math.ceil(len(order) / parts)
    return [order[i : i + size] for i in range(0, len(order), size)]
