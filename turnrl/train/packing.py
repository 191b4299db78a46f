"""Packed sequences for training: no padding, attention that never crosses sequences, logits only where needed.

Sequences (prompt + response) are concatenated into rows of at most `max_tokens` tokens. Inside a row,
each sequence keeps its own positions (0..len-1) and attends only to itself: a registered attention
function runs causal SDPA per sequence (no block-diagonal mask, so no attention FLOPs on masked pairs).
The LM head runs only at the positions that predict a trained token (loss mask 1): with a 150k vocabulary
the head is most of the cost of a small model, and prompt/observation positions need no logits at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from turnrl.moe import UNROUTED
from turnrl.train.algos import kept_token_logprobs

VARLEN_ATTENTION = "turnrl_varlen"
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # SDPA's enable_gqa


def varlen_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention per packed sequence. query [1, H, T, D], key/value [1, H_kv, T, D] → [1, T, H, D]."""
    cu_seqlens: list[int] = kwargs["turnrl_cu_seqlens"]
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
    groups = query.shape[1] // key.shape[1]
    gqa = {"enable_gqa": True} if groups > 1 and _SDPA_GQA else {}
    if groups > 1 and not gqa:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    # One `split`, not a slice per sequence: a slice's backward writes a zero-filled gradient the size of the
    # whole row, so slicing costs n_seqs full-row buffers per tensor per layer (~5% of an update on CPU).
    outputs = [F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, **gqa).transpose(1, 2)
               for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)]
    return torch.cat(outputs, dim=1), None  # [1, T, H, D], contiguous


AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa_attention)


def use_varlen_attention(model: torch.nn.Module) -> None:
    """Switch a (text) model's attention to the packed-sequence kernel (training side only)."""
    for config in {id(c): c for c in _text_configs(model.config)}.values():
        config._attn_implementation_internal = VARLEN_ATTENTION


def _text_configs(config):
    yield config
    text = getattr(config, "text_config", None)
    if text is not None:
        yield text


@dataclass
class PackedRow:
    """Several sequences concatenated; `targets` are the trained next-token predictions."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    cu_seqlens: list[int]  # sequence boundaries, len = n_seqs + 1
    sequence_index: list[int]  # which input sample each packed sequence is
    predict_at: torch.Tensor  # [N] row positions whose logits predict a trained token
    targets: torch.Tensor  # [N] the token predicted at each of those positions
    target_seq: torch.Tensor  # [N] packed-sequence number of each target (0..n_seqs-1)
    target_pos: torch.Tensor  # [N] index of the target inside its sequence's response
    mm_inputs: list[dict[str, torch.Tensor] | None] | None = None  # per packed sequence (VLM), in row order

    def to(self, device: torch.device | str) -> PackedRow:
        """The same row with every tensor on `device` (the policy's)."""
        moved = {f: getattr(self, f).to(device) for f in ("input_ids", "position_ids", "predict_at", "targets",
                                                          "target_seq", "target_pos")}
        mm = None if self.mm_inputs is None else [
            None if m is None else {k: v.to(device) for k, v in m.items()} for m in self.mm_inputs]
        return dataclasses.replace(self, **moved, mm_inputs=mm)


def pack_sequences(
    sequences: Sequence[tuple[list[int], list[int], list[int]]], max_tokens: int,
    mm_inputs: Sequence[dict[str, torch.Tensor] | None] | None = None,
) -> list[PackedRow]:
    """Greedy first-fit packing of (prompt_ids, response_ids, loss_mask) triples, in order.

    A sequence longer than max_tokens gets a row of its own (never truncated: that would change the loss).
    `mm_inputs` (VLM processor tensors per sequence) travel with their sequences.
    """
    rows: list[list[int]] = []
    sizes: list[int] = []
    for i, (prompt, response, _) in enumerate(sequences):
        n = len(prompt) + len(response)
        for r, size in enumerate(sizes):
            if size + n <= max_tokens:
                rows[r].append(i)
                sizes[r] += n
                break
        else:
            rows.append([i])
            sizes.append(n)
    packed = [_build_row(sequences, members) for members in rows]
    if mm_inputs is not None:
        for row in packed:
            row.mm_inputs = [mm_inputs[i] for i in row.sequence_index]
    return packed


def _build_row(sequences, members: list[int]) -> PackedRow:
    ids: list[int] = []
    pos: list[int] = []
    cu = [0]
    predict_at, targets, target_seq, target_pos = [], [], [], []
    for s, i in enumerate(members):
        prompt, response, mask = sequences[i]
        offset = cu[-1]
        for k, m in enumerate(mask):
            if m:
                predict_at.append(offset + len(prompt) + k - 1)  # the logit at t predicts token t + 1
                targets.append(response[k])
                target_seq.append(s)
                target_pos.append(k)
        ids.extend(prompt + response)
        pos.extend(range(len(prompt) + len(response)))
        cu.append(offset + len(prompt) + len(response))
    return PackedRow(
        input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), cu_seqlens=cu, sequence_index=members,
        predict_at=torch.tensor(predict_at, dtype=torch.long), targets=torch.tensor(targets, dtype=torch.long),
        target_seq=torch.tensor(target_seq, dtype=torch.long), target_pos=torch.tensor(target_pos, dtype=torch.long),
    )


def packed_token_logprobs(model: torch.nn.Module, row: PackedRow, temperature: float = 1.0) -> torch.Tensor:
    """Logprob of each target token under `model` with logits / temperature (as the engine sampled). [N]

    Through the model's own forward with `logits_to_keep` = the predicting positions, so the LM head runs
    only there and wrappers that hook the top-level call (FSDP2's all-gathers, peft) see an ordinary one."""
    return _packed_logits(model, row, temperature).log_softmax(-1).gather(1, row.targets[:, None])[:, 0]


def _packed_logits(model: torch.nn.Module, row: PackedRow, temperature: float) -> torch.Tensor:
    """[N, V] fp32 logits / temperature at the predicting positions."""
    inputs = _vl_inputs(model, row) if hasattr(model.config, "vision_config") else {"position_ids": row.position_ids}
    logits_N_V = model(input_ids=row.input_ids, turnrl_cu_seqlens=row.cu_seqlens, logits_to_keep=row.predict_at,
                       use_cache=False, **inputs).logits[0].float()
    if temperature > 0 and temperature != 1.0:
        logits_N_V = logits_N_V / temperature
    return logits_N_V


def packed_kept_logprobs(model: torch.nn.Module, row: PackedRow, kept_N: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(renormalised, full) logprob of each target: under the distribution renormalised over the kept set the engine
    sampled from (`kept_N`, see `row_kept_counts`; algos.kept_token_logprobs), and under the full softmax, from one
    forward. [N] each."""
    logits_N_V = _packed_logits(model, row, temperature)
    full_N = logits_N_V.log_softmax(-1).gather(1, row.targets[:, None])[:, 0]
    if bool((kept_N >= logits_N_V.shape[1]).all()):  # nothing was cut (or nothing recorded): the full softmax
        return full_N, full_N
    return kept_token_logprobs(logits_N_V, row.targets, kept_N), full_N


def _vl_inputs(model: torch.nn.Module, row: PackedRow) -> dict[str, torch.Tensor]:
    """VLM inputs of a packed row: each sequence's positions from 0 (M-RoPE for Qwen VL, 1-D for LLaVA), pixels
    of all its images."""
    from turnrl.multimodal import uses_mrope, vl_positions

    mms = row.mm_inputs or [None] * (len(row.cu_seqlens) - 1)
    with_images = [mm for mm in mms if mm]
    pixels = {key: torch.cat([mm[key] for mm in with_images]) for key in with_images[0]} if with_images else {}
    if not uses_mrope(model.config):
        return {"position_ids": row.position_ids, **pixels}
    ids = row.input_ids[0].tolist()
    positions = []
    for k, (a, b) in enumerate(zip(row.cu_seqlens[:-1], row.cu_seqlens[1:], strict=True)):
        grid = (mms[k] or {}).get("image_grid_thw")
        positions.append(vl_positions(model, ids[a:b], grid)[0])
    return {"position_ids": torch.cat(positions, dim=2), **pixels}


def unpack_to_padded(values_N: torch.Tensor, row: PackedRow, lengths: list[int]) -> torch.Tensor:
    """Scatter per-target values into [n_seqs, max_response_len] (zeros elsewhere) for the loss functions."""
    out = values_N.new_zeros(len(row.sequence_index), max(lengths, default=0))
    return out.index_put((row.target_seq, row.target_pos), values_N)


def row_kept_counts(row: PackedRow, kept: Sequence[Sequence[int | None] | None], vocab_size: int) -> torch.Tensor:
    """[N] kept-set size of each target of `row`, from each input sample's kept counts aligned with its response
    (`kept[i]`, indexed like `row.sequence_index`); a sample without them (None) counts as the full vocabulary, so
    its tokens are scored under the full softmax."""
    out = []
    for s, k in zip(row.target_seq.tolist(), row.target_pos.tolist(), strict=True):
        counts = kept[row.sequence_index[s]]
        value = None if counts is None else counts[k]
        out.append(vocab_size if value is None else value)
    return torch.tensor(out, dtype=torch.long, device=row.targets.device)


def row_routing(row: PackedRow, routing: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """[T, layers, top_k] routing of the row's input tokens for `turnrl.moe.replay_routing`, from each input
    sample's routing over its prompt + response (`routing[i]`, indexed like `row.sequence_index`; rows it does not
    cover, and samples without any, are UNROUTED: the model routes them itself). None when no sample has any."""
    known = [r for r in (routing[i] for i in row.sequence_index) if r is not None]
    if not known:
        return None
    out = known[0].new_full((row.input_ids.shape[1], *known[0].shape[1:]), UNROUTED)
    for s, i in enumerate(row.sequence_index):
        experts, start = routing[i], row.cu_seqlens[s]
        if experts is not None:
            n = min(experts.shape[0], row.cu_seqlens[s + 1] - start)
            out[start : start + n] = experts[:n]
    return out
