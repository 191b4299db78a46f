"""Cascade attention for the embedded engine's decode step: rows that share a prefix's KV read it once.

When the samples of a group copied their prompt's KV from one another (turnrl.engines.prefix), every one of
their slots holds the same K/V, bit for bit, in columns [0, P). A decode step over those rows would read P
columns of K and V per row; here it reads them once for the whole group (as FlashInfer's cascade attention,
vLLM's cascade attention and Hydragen do):

- **prefix**: the group's queries (every row, every query head) attend to one slot's first P columns at once:
  q [Hkv, rows * g, d] against K[:P] [Hkv, P, d], g = query heads per KV head (GQA folded into the rows), in
  one call of torch's CPU flash kernel (the kernel SDPA runs on the CPU; it also returns each query's
  log-sum-exp), or float32 matmuls off the CPU;
- **suffix**: each row attends to its own columns P..len (its sampled tokens and anything after the shared
  part), masked per row, over the window [min P, width) only;
- **merge**: the two partial softmaxes combine exactly, out = out_p + (out_s - out_p) * sigmoid(lse_s - lse_p)
  in float32 (= (out_p e^lse_p + out_s e^lse_s) / (e^lse_p + e^lse_s)).

Rows in no group go through transformers' SDPA attention exactly as without cascade. Every row keeps its own
full KV copy (parking, export, `move_row`, retirement are untouched): cascade changes only what decode reads.
The engine switches a model to this attention (`use_cascade_attention`) only with `share_prefixes`; the
function behaves as plain SDPA for every call that carries no plan (prefill, steps without a group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

CASCADE_ATTENTION = "turnrl_cascade"
PLAN_KWARG = "turnrl_cascade"
MIN_ROWS = 2
"""A group decodes by cascade from this many rows (one row gains nothing from reading its prefix once)."""
MIN_PREFIX = 16
"""...and when its shared prefix has at least this many columns."""

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""SDPA's CPU kernel, which also returns the log-sum-exp of every query (None: not in this torch)."""
Rows = slice | torch.Tensor  # a contiguous range of rows (a view, no copy) or their indices
_WHOLE = 1 << 62  # the row that holds a block's original: all of its columns are the block's


@dataclass(frozen=True)
class Shared:
    """Columns [0, length) of a row (or parked entry) hold the KV of `block`, bit for bit.

    A block is the token stream of the first request another one copied from (its `length` is unbounded: every
    column of that stream is the block's); a request that copies P columns from a holder of (block, L) holds
    (block, min(P, L)). So any rows holding the same block share its first min(length) columns."""

    block: object
    length: int


def share(holder: Shared | None, tokens: int) -> tuple[Shared, Shared]:
    """A copy of `tokens` columns from a row or entry holding `holder`: (what the source holds now, what the copy
    holds). A source that held no block becomes one's original."""
    source = holder if holder is not None else Shared(object(), _WHOLE)
    return source, Shared(source.block, min(tokens, source.length))


def decode_groups(held: list[Shared | None], lens: torch.Tensor) -> list[tuple[int, list[int]]]:
    """(P, rows) for each block held by several of a decode step's rows (row i holds held[i] and has KV in
    columns [0, lens[i])): P is the shortest prefix of it any of them holds."""
    rows_by_block: dict[object, list[int]] = {}
    for i, h in enumerate(held):
        if h is not None:
            rows_by_block.setdefault(h.block, []).append(i)
    lens_list = lens.tolist()
    return [(min(min(cast(Shared, held[i]).length, lens_list[i]) for i in rows), rows)
            for rows in rows_by_block.values() if len(rows) > 1]


@dataclass
class CascadePlan:
    """One decode step's split of its n rows (row i sees columns 0..lens[i]).

    `groups`: (row whose slot holds the shared K/V, P, positions of the group's rows within `grouped`);
    `grouped`: the rows decoded by cascade; `plain`: the rest, as runs of consecutive rows (slab views, no copy)
    with each run's mask [rows, 1, 1, width] (columns 0..lens[i]); `start`: the first column of the suffix
    window (the smallest P); `suffix_mask` [grouped, 1, 1, width - start]: row i's columns P_i..lens[i]."""

    groups: list[tuple[int, int, Rows]]
    grouped: Rows
    plain: list[tuple[slice, torch.Tensor]]
    start: int
    suffix_mask: torch.Tensor

    def suffix_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """`suffix_mask` as an additive mask (0 / -inf) of `dtype`, made once per step."""
        bias = self._bias.get(dtype)
        if bias is None:
            bias = self._bias[dtype] = torch.zeros(self.suffix_mask.shape, dtype=dtype).masked_fill_(
                ~self.suffix_mask, float("-inf"))
        return bias

    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)


def _as_rows(indices: list[int]) -> Rows:
    """A slice when the indices are consecutive and ascending (indexing with it is a view), else a tensor."""
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return slice(indices[0], indices[0] + len(indices))
    return torch.tensor(indices)


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as runs of consecutive ones: (first, last) each."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _take(t: torch.Tensor, rows: Rows) -> torch.Tensor:
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def plan_cascade(lens: torch.Tensor, groups: list[tuple[int, list[int]]], *, min_rows: int = MIN_ROWS,
                 min_prefix: int = MIN_PREFIX) -> CascadePlan | None:
    """The plan of a decode step over rows with `lens` (row i writes column lens[i] and sees 0..lens[i]), given
    groups (P, rows) whose rows hold the same K/V in columns [0, P). Groups under `min_rows` rows or `min_prefix`
    columns decode as plain rows; None when no group is left."""
    n = lens.shape[0]
    kept = [(p, sorted(rows)) for p, rows in groups if len(rows) >= min_rows and p >= max(min_prefix, 1)]
    if not kept:
        return None
    for p, rows in kept:
        if any(not 0 <= r < n for r in rows):
            raise ValueError(f"cascade group of rows {rows}: rows out of [0, {n})")
        if p > int(lens[rows].min()):
            raise ValueError(f"cascade group of rows {rows} with a {p}-column prefix: longer than a row's KV "
                             f"(lens {lens[rows].tolist()})")
    order = [r for _, rows in kept for r in rows]
    if len(set(order)) != len(order):
        raise ValueError(f"cascade groups overlap: rows {order}")
    width = int(lens.max()) + 1
    start = min(p for p, _ in kept)
    prefix_N = torch.zeros(n, dtype=torch.long)
    plan_groups: list[tuple[int, int, Rows]] = []
    at = 0
    for p, rows in kept:
        prefix_N[rows] = p
        plan_groups.append((rows[0], p, _as_rows(list(range(at, at + len(rows))))))
        at += len(rows)
    grouped = torch.tensor(order)
    cols_W = torch.arange(start, width)
    suffix_mask = (cols_W >= prefix_N[grouped, None]) & (cols_W <= lens[grouped, None])
    rest = sorted(set(range(n)) - set(order))
    plain = []
    for first, last in _runs(rest):
        mask = (torch.arange(width)[None, :] <= lens[first : last + 1, None])[:, None, None, :]
        plain.append((slice(first, last + 1), mask))
    return CascadePlan(plan_groups, _as_rows(order), plain, start, suffix_mask[:, None, None, :])


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised attention of q [..., L, d] over k, v [..., S, d]: (sum_j e^(s_j - m) v_j, m = max_j s_j,
    sum_j e^(s_j - m)), as a flash kernel's running state; normalised once, after the merge (dividing by a sum,
    not subtracting a rounded log-sum-exp, keeps the result within float32 rounding of SDPA's)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    top = scores.amax(dim=-1)
    weights = scores.sub_(top[..., None]).exp_()
    return torch.matmul(weights, v), top, weights.sum(dim=-1)


def _merge(o_p: torch.Tensor, lse_p: torch.Tensor, o_s: torch.Tensor, lse_s: torch.Tensor) -> torch.Tensor:
    """Two normalised partial attentions over disjoint keys, merged: weights e^lse / (e^lse_p + e^lse_s). The
    weight of the suffix is sigmoid(lse_s - lse_p), so the rounding of the log-sum-exps only touches the smaller
    part (a prompt of 2,000 columns against a suffix of a few hundred)."""
    w = torch.sigmoid(lse_s.float() - lse_p.float())[..., None]
    return o_p.float() + (o_s.float() - o_p.float()) * w


def _cpu_flash(o_G, q_G, key, value, plan: CascadePlan, scale: float) -> torch.Tensor:
    """The CPU path: torch's flash kernel (what SDPA runs on the CPU) for both parts, merged by log-sum-exp."""
    assert _CPU_FLASH is not None
    k_s = _take(key[:, :, plan.start:], plan.grouped)  # [G, Hkv, S, d]: the suffix window only
    v_s = _take(value[:, :, plan.start:], plan.grouped)
    o_s, lse_s = _CPU_FLASH(q_G, k_s, v_s, 0.0, False, attn_mask=plan.suffix_bias(q_G.dtype), scale=scale)
    kv_heads, g, dim = q_G.shape[1:]
    for src, p, rows in plan.groups:  # the shared prefix: the group's queries against one slot's first p columns
        m = q_G[rows].shape[0]
        q_Hkv = q_G[rows].permute(1, 0, 2, 3).reshape(1, kv_heads, m * g, dim)
        o_p, lse_p = _CPU_FLASH(q_Hkv, key[src : src + 1, :, :p], value[src : src + 1, :, :p], 0.0, False,
                                scale=scale)
        o_G[rows] = _merge(o_p.reshape(kv_heads, m, g, dim).permute(1, 0, 2, 3),
                           lse_p.reshape(kv_heads, m, g).permute(1, 0, 2), o_s[rows], lse_s[rows])
    return o_G


def _portable(o_G, q_G, key, value, plan: CascadePlan, scale: float) -> torch.Tensor:
    """Any device: the same in float32 matmuls (unnormalised partials, normalised once after the merge)."""
    acc = torch.float32
    q_G = q_G.to(acc)
    k_s = _take(key[:, :, plan.start:], plan.grouped).to(acc)
    v_s = _take(value[:, :, plan.start:], plan.grouped).to(acc)
    o_s, top_s, sum_s = _partial(q_G, k_s, v_s, scale, plan.suffix_mask)
    kv_heads, g, dim = q_G.shape[1:]
    for src, p, rows in plan.groups:
        m = q_G[rows].shape[0]
        q_Hkv = q_G[rows].permute(1, 0, 2, 3).reshape(kv_heads, m * g, dim)
        o_p, top_p, sum_p = _partial(q_Hkv, key[src, :, :p].to(acc), value[src, :, :p].to(acc), scale)
        o_p = o_p.view(kv_heads, m, g, dim).permute(1, 0, 2, 3)
        top_p, sum_p = top_p.view(kv_heads, m, g).permute(1, 0, 2), sum_p.view(kv_heads, m, g).permute(1, 0, 2)
        top = torch.maximum(top_p, top_s[rows])
        a, b = (top_p - top).exp_(), (top_s[rows] - top).exp_()  # one of the two is 1
        sum_s[rows] = sum_p * a + sum_s[rows] * b
        o_s[rows] = o_p * a[..., None] + o_s[rows] * b[..., None]
    o_G.copy_(o_s / sum_s[..., None])
    return o_G


def cascade_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Decode attention by cascade when the call carries a plan (`turnrl_cascade`), else transformers' SDPA.
    query [n, H, 1, d], key/value [n, Hkv, width, d] (the engine's slab rows) → [n, 1, H, d]."""
    plan: CascadePlan | None = kwargs.get(PLAN_KWARG)
    if plan is None or query.shape[2] != 1 or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    n, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else dim ** -0.5
    out = torch.empty(n, 1, heads, dim, dtype=query.dtype, device=query.device)
    for rows, mask in plan.plain:  # rows in no group: the plain path, on views of their slots
        out[rows], _ = sdpa_attention_forward(module, query[rows], key[rows], value[rows], mask, dropout=dropout,
                                              scaling=scaling)
    q_G = _take(query, plan.grouped).reshape(-1, kv_heads, heads // kv_heads, dim)  # [G, Hkv, g, d]: GQA folded
    o_G = torch.empty(q_G.shape, dtype=torch.float32, device=query.device)
    fast = _CPU_FLASH is not None and query.device.type == "cpu"
    o_G = (_cpu_flash if fast else _portable)(o_G, q_G, key, value, plan, scale)
    out[plan.grouped] = o_G.reshape(-1, 1, heads, dim).to(query.dtype)
    return out, None


AttentionInterface.register(CASCADE_ATTENTION, cascade_attention)
# The masks transformers builds for it are SDPA's: a model switched to cascade and called by anyone else (a trainer
# sharing it: a 2-D padding mask, packed sequences told apart by their positions) gets what SDPA would.
AttentionMaskInterface.register(CASCADE_ATTENTION, sdpa_mask)


def use_cascade_attention(model: torch.nn.Module) -> bool:
    """Switch a text model whose attention is SDPA to `cascade_attention` (which is SDPA for every call without a
    plan); False, and nothing changed, for any other attention implementation."""
    config: Any = model.config  # a transformers PretrainedConfig (nn.Module types it as Tensor | Module)
    if config._attn_implementation == CASCADE_ATTENTION:
        return True
    if config._attn_implementation != "sdpa":
        return False
    config._attn_implementation_internal = CASCADE_ATTENTION
    return True
