"""Tree-packed training rows: the samples of a micro-batch as a prefix trie over token ids, every shared token
(a group's prompt, the turns before a fork, a common system prompt) forwarded and back-propagated once.

Only tokens at identical prefixes merge (the same ids from the root), so a node's hidden states are the ones each
sample passing through it would compute alone: causal attention makes a token's states a function of its prefix.
Each node is laid out once, in depth-first order; its position id is its depth (RoPE sees the sample's own
positions) and it attends exactly to its root-to-node path. The logit that predicts a sample's token comes from
the token's parent node, so a shared node can predict different children for different samples (the prompt's
last token predicts each sample's first response token); the LM head runs once per distinct predicting node.

A row's nodes form segments: maximal chains without a fork. Segments are contiguous in the row, and a segment's
tokens see all of its ancestor segments plus themselves causally, which is what the attention here computes
(SDPA per segment over its gathered ancestors' K/V on any device, or FlexAttention with the ancestor relation as
its block mask: `trainer.attention`). The trainer consumes a `TreeRow` as it does a flat `PackedRow`: the same
targets in the same order (`target_seq`, `target_pos`, `sequence_index`), so `unpack_to_padded` and
`row_kept_counts` serve both.

VLM samples merge only with samples whose image inputs are identical and whose shared prefix holds all their
image tokens (the images are then encoded once); otherwise they get a trie of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from turnrl.moe import UNROUTED
from turnrl.train.algos import kept_token_logprobs
from turnrl.train.packing import _SDPA_GQA, PackedRow, _text_configs, varlen_sdpa_attention

TREE_ATTENTION = "turnrl_tree"

Triple = tuple[list[int], list[int], list[int]]  # prompt_ids, response_ids, loss_mask


@dataclass
class TreeAttention:
    """How the tokens of a tree row attend: segments in row order, each seeing its ancestors' tokens and itself."""

    seg_lengths: list[int]  # tokens per segment, in row order (they tile the row)
    key_index: torch.Tensor  # [K] row positions of the keys of every segment that has ancestors, concatenated
    key_lengths: list[int]  # ancestors + own tokens of each such segment (splits key_index)
    masks: list[torch.Tensor | None]  # per segment: None (a root: causal) or [L, A + L] bool (ancestors, then causal)
    subtree_end: torch.Tensor  # [T] one past the last row position in each token's subtree (the ancestor relation)
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # per segment (start, end, its subtree's end)
    kernel: str = "sdpa"  # "sdpa" or "flex"
    block_mask: Any = None  # FlexAttention's BlockMask, made on the device per forward
    _additive: dict[torch.dtype, list[torch.Tensor | None]] = field(default_factory=dict, repr=False)

    def additive_masks(self, dtype: torch.dtype) -> list[torch.Tensor | None]:
        """`masks` as SDPA's additive float masks (0 / -inf) in `dtype`: made once per row, not per layer and call."""
        if dtype not in self._additive:
            self._additive[dtype] = [None if m is None else torch.zeros(m.shape, dtype=dtype, device=m.device)
                                     .masked_fill_(~m, float("-inf")) for m in self.masks]
        return self._additive[dtype]

    def to(self, device: torch.device | str) -> TreeAttention:
        return dataclasses.replace(self, key_index=self.key_index.to(device), subtree_end=self.subtree_end.to(device),
                                   masks=[None if m is None else m.to(device) for m in self.masks], block_mask=None,
                                   _additive={})


@dataclass
class TreeRow(PackedRow):
    """A micro-batch packed as a prefix trie. `input_ids`/`position_ids` hold the unique tokens (position = depth);
    `predict_at`, `targets`, `target_seq`, `target_pos` and `sequence_index` mean what they mean in a PackedRow
    (targets per sample in row order, each sample's in response order; a predicting position may repeat)."""

    parent: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [T] (-1: a root)
    witness: list[tuple[int, int]] = field(default_factory=list)  # per token: (packed sample, its index there)
    paths: list[torch.Tensor] = field(default_factory=list)  # per packed sample: the row position of each token
    tree: TreeAttention | None = None
    tokens_raw: int = 0  # the members' prompt + response tokens: what a flat row would forward
    mm_tries: list[int] = field(default_factory=list)  # packed samples whose images the row encodes, in row order

    def to(self, device: torch.device | str) -> TreeRow:
        moved = PackedRow.to(self, device)
        assert isinstance(moved, TreeRow) and self.tree is not None
        moved.tree = self.tree.to(device)
        return moved


# ---- placement -------------------------------------------------------------------------------------------------

class _Trie:
    """Prefix trie over token ids (children per node; node 0 is the root, no token)."""

    def __init__(self):
        self.children: list[dict[int, int]] = [{}]

    def common(self, ids: Sequence[int]) -> int:
        """Length of the longest prefix of `ids` already in the trie."""
        node, n = 0, 0
        for t in ids:
            node = self.children[node].get(t, -1)
            if node < 0:
                break
            n += 1
        return n

    def insert(self, ids: Sequence[int]) -> int:
        """Insert `ids`; the number of new nodes."""
        node, new = 0, 0
        for t in ids:
            nxt = self.children[node].get(t)
            if nxt is None:
                nxt = len(self.children)
                self.children.append({})
                self.children[node][t] = nxt
                new += 1
            node = nxt
        return new


def _mm_keys(sequences: Sequence[Triple], mm_inputs: Sequence[dict[str, torch.Tensor] | None] | None,
             image_token_id: int | None) -> list[Any]:
    """The trie each sample may share: text samples one (None); a VLM sample the one of the earlier samples with
    identical image inputs whose common prefix with it holds all its image tokens, else its own."""
    if mm_inputs is None:
        return [None] * len(sequences)
    keys: list[Any] = []
    reps: list[tuple[int, dict[str, torch.Tensor]]] = []  # (sample, inputs) of each VLM trie
    for i, (prompt, response, _) in enumerate(sequences):
        mm = mm_inputs[i]
        if not mm:
            keys.append(None)
            continue
        ids = prompt + response
        last_image = max((k for k, t in enumerate(ids) if t == image_token_id), default=len(ids)) \
            if image_token_id is not None else len(ids)
        for j, other in reps:
            if other.keys() == mm.keys() and all(other[k].shape == mm[k].shape and torch.equal(other[k], mm[k])
                                                 for k in mm):
                shared = 0
                other_ids = sequences[j][0] + sequences[j][1]
                while shared < min(len(ids), len(other_ids)) and ids[shared] == other_ids[shared]:
                    shared += 1
                if shared > last_image:
                    keys.append(("mm", j))
                    break
        else:
            reps.append((i, mm))
            keys.append(("mm", i))
    return keys


def families(sequences: Sequence[Triple], keys: Sequence[Any] | None = None) -> list[list[int]]:
    """Samples that belong together, in order of first appearance: a sample joins the family of the earlier
    sample it shares the longest prefix with when that prefix holds its whole prompt or at least half its tokens
    (a group's samples, the branches of an episode)."""
    keys = keys if keys is not None else [None] * len(sequences)
    family_of: list[int] = []
    out: list[list[int]] = []
    tries: dict[Any, tuple[_Trie, list[int]]] = {}  # per key: a trie whose nodes remember their first sample
    for i, (prompt, response, _) in enumerate(sequences):
        ids = prompt + response
        trie, owner = tries.setdefault(keys[i], (_Trie(), [-1]))
        node, n = 0, 0
        for t in ids:
            nxt = trie.children[node].get(t)
            if nxt is None:
                break
            node, n = nxt, n + 1
        if n and (n >= len(prompt) or 2 * n >= len(ids)):
            family_of.append(family_of[owner[node]])
            out[family_of[-1]].append(i)
        else:
            family_of.append(len(out))
            out.append([i])
        node = 0
        for t in ids:
            nxt = trie.children[node].get(t)
            if nxt is None:
                nxt = len(trie.children)
                trie.children.append({})
                owner.append(i)
                trie.children[node][t] = nxt
            node = nxt
    return out


def unique_tokens(sequences: Sequence[Triple], members: Sequence[int], keys: Sequence[Any] | None = None) -> int:
    """Tokens the trie of `members` holds: what their tree row forwards."""
    tries: dict[Any, _Trie] = {}
    return sum(tries.setdefault(None if keys is None else keys[i], _Trie()).insert(sequences[i][0] + sequences[i][1])
               for i in members)


def place(sequences: Sequence[Triple], max_tokens: int, keys: Sequence[Any] | None = None) -> list[list[int]]:
    """Rows of at most `max_tokens` unique tokens: each family (`families`), in order, whole into the row where it
    fits adding the fewest tokens (sharing the most; ties: the first row, so samples that share nothing pack first
    fit, as flat packing does); a family that fits no row sample by sample the same way, a new row when it fits
    none. A sample longer than `max_tokens` gets a row of its own (never truncated)."""
    keys = keys if keys is not None else [None] * len(sequences)
    rows: list[list[int]] = []
    tries: list[dict[Any, _Trie]] = []
    sizes: list[int] = []

    def cost(r: int, i: int) -> int:
        trie = tries[r].get(keys[i])
        ids = sequences[i][0] + sequences[i][1]
        return len(ids) - (trie.common(ids) if trie is not None else 0)

    def add(r: int, i: int) -> None:
        if r == len(rows):
            rows.append([])
            tries.append({})
            sizes.append(0)
        rows[r].append(i)
        sizes[r] += tries[r].setdefault(keys[i], _Trie()).insert(sequences[i][0] + sequences[i][1])

    for fam in families(sequences, keys):
        fits = [(added, r) for r in range(len(rows))
                if sizes[r] + (added := _added(tries[r], sequences, fam, keys)) <= max_tokens]
        whole = min(fits)[1] if fits else None  # the row it adds the fewest tokens to (ties: the first)
        if whole is None and unique_tokens(sequences, fam, keys) <= max_tokens:
            whole = len(rows)
        if whole is not None:
            for i in fam:
                add(whole, i)
            continue
        for i in fam:
            fits = [(c, r) for r in range(len(rows)) if sizes[r] + (c := cost(r, i)) <= max_tokens]
            add(min(fits)[1] if fits else len(rows), i)
    return rows


def _added(tries: dict[Any, _Trie], sequences: Sequence[Triple], members: Sequence[int], keys: Sequence[Any]) -> int:
    """Tokens `members` would add to a row holding `tries`, without changing them: each member's suffix after
    the node where it leaves the row's trie, suffixes leaving at the same node sharing their prefixes."""
    extra: dict[Any, _Trie] = {}
    added = 0
    for i in members:
        ids = sequences[i][0] + sequences[i][1]
        node, n = 0, 0
        base = tries.get(keys[i])
        if base is not None:
            for t in ids:
                nxt = base.children[node].get(t)
                if nxt is None:
                    break
                node, n = nxt, n + 1
        added += extra.setdefault((keys[i], node), _Trie()).insert(ids[n:])
    return added


# ---- building a row --------------------------------------------------------------------------------------------

@dataclass
class _RowTrie:
    """The tries of a row's samples, nodes in creation order: `token`, `parent` (-1 at a root), `children`
    (token -> node), `witness` (a (sample, depth) through the node), each sample's node `paths`, the roots in order
    of first member."""

    token: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    children: list[dict[int, int]] = field(default_factory=list)
    witness: list[tuple[int, int]] = field(default_factory=list)
    paths: list[list[int]] = field(default_factory=list)
    roots: list[dict[int, int]] = field(default_factory=list)


def _insert(sequences: Sequence[Triple], members: list[int], keys: Sequence[Any]) -> _RowTrie:
    """One trie per key (samples with different keys never share a node), in order of first member."""
    trie, roots = _RowTrie(), dict[Any, dict[int, int]]()
    for s, i in enumerate(members):
        prompt, response, mask = sequences[i]
        if mask and mask[0] and not prompt:
            raise ValueError(f"sample {i}: its first response token is trained but it has no prompt token to "
                             "predict it from")
        if keys[i] not in roots:
            roots[keys[i]] = {}
            trie.roots.append(roots[keys[i]])
        level, up, path = roots[keys[i]], -1, []
        for d, t in enumerate(prompt + response):
            node = level.get(t)
            if node is None:
                node = len(trie.token)
                trie.token.append(t)
                trie.parent.append(up)
                trie.children.append({})
                trie.witness.append((s, d))
                level[t] = node
            path.append(node)
            level, up = trie.children[node], node
        trie.paths.append(path)
    return trie


def _preorder(trie: _RowTrie) -> list[int]:
    """The nodes in depth-first preorder, root by root: a node's subtree is the positions right after it."""
    order: list[int] = []
    for level in trie.roots:
        stack = list(reversed(level.values()))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(trie.children[node].values()))
    return order


def _subtree_ends(parent_T: list[int]) -> list[int]:
    """The end (exclusive) of each preorder position's subtree."""
    end = list(range(1, len(parent_T) + 1))
    for k in range(len(parent_T) - 1, -1, -1):
        p = parent_T[k]
        if p >= 0 and end[k] > end[p]:
            end[p] = end[k]
    return end


def _attention(parent_T: list[int], n_children: list[int], end: list[int]) -> TreeAttention:
    """Segments (a new one at every root and every child of a fork, contiguous in preorder), and for each, the keys
    its queries attend to: its ancestor segments up to its parent, then itself causally."""
    T = len(parent_T)
    seg_starts = [k for k in range(T) if parent_T[k] < 0 or n_children[parent_T[k]] != 1]
    bounds = [*seg_starts, T]
    seg_of = [s_idx for s_idx in range(len(seg_starts)) for _ in range(bounds[s_idx], bounds[s_idx + 1])]
    seg_lengths = [bounds[s_idx + 1] - a for s_idx, a in enumerate(seg_starts)]
    key_index: list[int] = []
    key_lengths: list[int] = []
    masks: list[torch.Tensor | None] = []
    for a, length in zip(seg_starts, seg_lengths, strict=True):
        p = parent_T[a]
        if p < 0:
            masks.append(None)
            continue
        chain = []
        while p >= 0:
            anc = seg_of[p]
            chain.append((seg_starts[anc], p + 1))  # the ancestor segment up to the parent (all of it)
            p = parent_T[seg_starts[anc]]
        ancestors = [k for a0, b0 in reversed(chain) for k in range(a0, b0)]
        key_index.extend(ancestors)
        key_index.extend(range(a, a + length))
        key_lengths.append(len(ancestors) + length)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        masks.append(torch.cat([torch.ones(length, len(ancestors), dtype=torch.bool), causal], dim=1))
    spans = [(a, a + length, end[a + length - 1]) for a, length in zip(seg_starts, seg_lengths, strict=True)]
    return TreeAttention(seg_lengths, torch.tensor(key_index, dtype=torch.long), key_lengths, masks,
                         torch.tensor(end, dtype=torch.long), spans)


def _targets(sequences: Sequence[Triple], members: list[int], paths: list[list[int]],
             new: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sample's trained tokens, predicted at their parent node (preorder positions): (predict_at, targets,
    target_seq, target_pos)."""
    predict_at, targets, target_seq, target_pos = [], [], [], []
    for s, i in enumerate(members):
        prompt, response, mask = sequences[i]
        for k, m in enumerate(mask):
            if m:
                predict_at.append(new[paths[s][len(prompt) + k - 1]])
                targets.append(response[k])
                target_seq.append(s)
                target_pos.append(k)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return as_tensor(predict_at), as_tensor(targets), as_tensor(target_seq), as_tensor(target_pos)


def build_tree_row(sequences: Sequence[Triple], members: list[int], keys: Sequence[Any] | None = None,
                   mm_inputs: Sequence[dict[str, torch.Tensor] | None] | None = None) -> TreeRow:
    """The tree row of `sequences[members]` (packed samples numbered in `members` order)."""
    keys = keys if keys is not None else [None] * len(sequences)
    trie = _insert(sequences, members, keys)
    order = _preorder(trie)
    new = [0] * len(order)
    for k, node in enumerate(order):
        new[node] = k
    parent_T = [-1 if trie.parent[n] < 0 else new[trie.parent[n]] for n in order]
    n_children = [len(trie.children[n]) for n in order]
    owners: dict[Any, int] = {}  # the first member of each image trie encodes its images
    for s, i in enumerate(members):
        if mm_inputs is not None and mm_inputs[i] and keys[i] is not None:
            owners.setdefault(keys[i], s)
    predict_at, targets, target_seq, target_pos = _targets(sequences, members, trie.paths, new)
    row = TreeRow(
        input_ids=torch.tensor([[trie.token[n] for n in order]]),
        position_ids=torch.tensor([[trie.witness[n][1] for n in order]]),
        cu_seqlens=[0, len(order)], sequence_index=list(members),
        predict_at=predict_at, targets=targets, target_seq=target_seq, target_pos=target_pos,
        parent=torch.tensor(parent_T, dtype=torch.long), witness=[trie.witness[n] for n in order],
        tree=_attention(parent_T, n_children, _subtree_ends(parent_T)),
        tokens_raw=sum(len(sequences[i][0]) + len(sequences[i][1]) for i in members),
        mm_tries=sorted(owners.values(), key=lambda s: new[trie.paths[s][0]]),
        paths=[torch.tensor([new[n] for n in path], dtype=torch.long) for path in trie.paths])
    if mm_inputs is not None:
        row.mm_inputs = [mm_inputs[i] for i in members]
    return row


def pack_tree(sequences: Sequence[Triple], max_tokens: int,
              mm_inputs: Sequence[dict[str, torch.Tensor] | None] | None = None,
              image_token_id: int | None = None) -> list[TreeRow]:
    """(prompt_ids, response_ids, loss_mask) triples as tree rows of at most `max_tokens` unique tokens each
    (`place`); `mm_inputs` (VLM processor tensors per sample) travel with their samples, and `image_token_id`
    (the model's) tells which prefix a VLM sample must share to share its images."""
    keys = _mm_keys(sequences, mm_inputs, image_token_id)
    return [build_tree_row(sequences, members, keys, mm_inputs) for members in place(sequences, max_tokens, keys)]


# ---- attention -------------------------------------------------------------------------------------------------

def tree_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Each token attends to its root-to-token path. query [1, H, T, D], key/value [1, H_kv, T, D] → [1, T, H, D].
    A flat row's call (`turnrl_cu_seqlens`) goes to packing.varlen_sdpa_attention."""
    tree: TreeAttention | None = kwargs.get("turnrl_tree")
    if tree is None:
        return varlen_sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    groups = query.shape[1] // key.shape[1]
    if tree.kernel == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        out = _flex(flex_attention, query.device)(query, key, value, block_mask=tree.block_mask, scale=scaling,
                                                   enable_gqa=groups > 1)
        return out.transpose(1, 2).contiguous(), None
    if query.device.type == "cpu" and tree.spans and _CPU_FLASH is not None:
        return _SpanAttention.apply(query, key, value, tree.spans, scaling), None
    gqa = {"enable_gqa": True} if groups > 1 and _SDPA_GQA else {}
    if groups > 1 and not gqa:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    queries = query.split(tree.seg_lengths, 2)
    own_k, own_v = key.split(tree.seg_lengths, 2), value.split(tree.seg_lengths, 2)
    if tree.key_lengths:  # one gather for every forked segment: one scatter in the backward
        gathered_k = key.index_select(2, tree.key_index).split(tree.key_lengths, 2)
        gathered_v = value.index_select(2, tree.key_index).split(tree.key_lengths, 2)
    outputs, g = [], 0
    masks = tree.additive_masks(query.dtype)
    for s, q in enumerate(queries):
        mask = masks[s]
        if mask is None:
            o = F.scaled_dot_product_attention(q, own_k[s], own_v[s], is_causal=True, scale=scaling, **gqa)
        else:
            o = F.scaled_dot_product_attention(q, gathered_k[g], gathered_v[g], attn_mask=mask, scale=scaling, **gqa)
            g += 1
        outputs.append(o.transpose(1, 2))
    return torch.cat(outputs, dim=1), None


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _SpanAttention(torch.autograd.Function):
    """Tree attention on the CPU without gathers or masks: every segment attends to itself causally (one flash
    call on its own slice), and the queries of a segment's whole subtree, which depth-first order makes one
    contiguous slice right after it, attend to the segment's keys densely (one flash call, no mask). A token thus
    sees its own segment and each of its ancestor segments once; the pieces merge by their log-sum-exp, and the
    backward runs the same pieces against the merged output and log-sum-exp (FlashAttention's backward, which is
    exact per piece given the final softmax normaliser). query [1, H, T, D], key/value [1, H_kv, T, D]."""

    @staticmethod
    def forward(ctx, query, key, value, spans, scale):
        assert _CPU_FLASH is not None
        B, H, T, D = query.shape
        acc = torch.promote_types(query.dtype, torch.float32)  # merged in fp32 (fp64 for fp64 inputs)
        out_T = query.new_empty(B, T, H, D, dtype=acc)  # [B, T, H, D]: the kernel's own layout
        lse_T = query.new_empty(B, T, H, dtype=acc)
        out, lse = out_T.transpose(1, 2), lse_T.transpose(1, 2)  # [B, H, T, D], [B, H, T] views
        for a, b, _ in spans:
            o, m = _CPU_FLASH(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], 0.0, True, scale=scale)
            out[:, :, a:b] = o
            lse[:, :, a:b] = m
        for a, b, e in spans:
            if e > b:  # the subtree's queries see this segment's keys, all of them
                o, m = _CPU_FLASH(query[:, :, b:e], key[:, :, a:b], value[:, :, a:b], 0.0, False, scale=scale)
                old_lse = lse[:, :, b:e]
                new_lse = torch.logaddexp(old_lse, m)
                out[:, :, b:e] = (out[:, :, b:e] * (old_lse - new_lse).exp_()[..., None]
                                  + o.to(acc) * (m - new_lse).exp_()[..., None])
                lse[:, :, b:e] = new_lse
        result = out_T.to(query.dtype)
        ctx.save_for_backward(query, key, value, result, lse_T)
        ctx.spans, ctx.scale = spans, scale
        return result

    @staticmethod
    def backward(ctx, grad_T):
        assert _CPU_FLASH_BACKWARD is not None
        query, key, value, result, lse_T = ctx.saved_tensors
        out, lse, grad = result.transpose(1, 2), lse_T.transpose(1, 2), grad_T.transpose(1, 2)
        dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        for a, b, e in ctx.spans:
            pieces = [(a, b, True)] + ([(b, e, False)] if e > b else [])
            for q0, q1, causal in pieces:
                gq, gk, gv = _CPU_FLASH_BACKWARD(grad[:, :, q0:q1], query[:, :, q0:q1], key[:, :, a:b],
                                                 value[:, :, a:b], out[:, :, q0:q1], lse[:, :, q0:q1], 0.0, causal,
                                                 scale=ctx.scale)
                dq[:, :, q0:q1] += gq
                dk[:, :, a:b] += gk
                dv[:, :, a:b] += gv
        return dq, dk, dv, None, None


_FLEX: dict[str, Any] = {}


def _flex(fn, device: torch.device):
    """flex_attention compiled on an accelerator (its fused kernel), as it is on the CPU (the reference path)."""
    if device.type == "cpu":
        return fn
    if "compiled" not in _FLEX:
        _FLEX["compiled"] = torch.compile(fn, dynamic=True)
    return _FLEX["compiled"]


def tree_block_mask(tree: TreeAttention, T: int, device: torch.device | str):
    """FlexAttention's block mask of the ancestor relation: key k is on query q's path iff k <= q < subtree_end[k]
    (depth-first layout: a node's subtree is the positions right after it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    end = tree.subtree_end

    def on_path(b, h, q, k):
        return (k <= q) & (q < end[k])

    return create_block_mask(on_path, B=None, H=None, Q_LEN=T, KV_LEN=T, device=str(device))


def ancestor_mask(row: TreeRow) -> torch.Tensor:
    """[T, T] bool: row[q, k] = k is on q's root-to-token path (itself included). For tests and small rows."""
    assert row.tree is not None
    pos = torch.arange(row.input_ids.shape[1])
    return (pos[None, :] <= pos[:, None]) & (pos[:, None] < row.tree.subtree_end[None, :])


AttentionInterface.register(TREE_ATTENTION, tree_attention)


def use_tree_attention(model: torch.nn.Module) -> None:
    """Switch a (text) model's attention to the tree kernel (training side only); flat rows still work."""
    for config in {id(c): c for c in _text_configs(model.config)}.values():
        config._attn_implementation_internal = TREE_ATTENTION


# ---- logprobs --------------------------------------------------------------------------------------------------

def _unique_logits(model: torch.nn.Module, row: TreeRow, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """([U, V] fp32 logits / temperature at the U distinct predicting nodes, [N] which of them predicts each
    target): the LM head once per node, however many samples' tokens it predicts."""
    assert row.tree is not None
    tree = row.tree
    if tree.kernel == "flex" and tree.block_mask is None:
        tree = dataclasses.replace(tree, block_mask=tree_block_mask(tree, row.input_ids.shape[1], row.input_ids.device))
    keep, inverse = torch.unique(row.predict_at, return_inverse=True)
    inputs = _vl_inputs(model, row) if hasattr(model.config, "vision_config") else {"position_ids": row.position_ids}
    logits_U_V = model(input_ids=row.input_ids, turnrl_tree=tree, logits_to_keep=keep, use_cache=False,
                       **inputs).logits[0].float()
    if temperature > 0 and temperature != 1.0:
        logits_U_V = logits_U_V / temperature
    return logits_U_V, inverse


def tree_token_logprobs(model: torch.nn.Module, row: TreeRow, temperature: float = 1.0) -> torch.Tensor:
    """Logprob of each target token of `row` under `model` at `temperature`. [N], as packed_token_logprobs."""
    logits_U_V, inverse = _unique_logits(model, row, temperature)
    return logits_U_V.log_softmax(-1)[inverse, row.targets]  # [N]: no [N, V] copy of the logits


def tree_kept_logprobs(model: torch.nn.Module, row: TreeRow, kept_N: torch.Tensor,
                       temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(renormalised over the kept set, full) logprob of each target, as packing.packed_kept_logprobs."""
    logits_U_V, inverse = _unique_logits(model, row, temperature)
    full_N = logits_U_V.log_softmax(-1)[inverse, row.targets]
    return kept_token_logprobs(logits_U_V[inverse], row.targets, kept_N), full_N


def _vl_inputs(model: torch.nn.Module, row: TreeRow) -> dict[str, torch.Tensor]:
    """VLM inputs of a tree row: each token's position from a sample it belongs to (M-RoPE for Qwen VL, its depth
    for LLaVA), the pixels of each image trie once, in row order."""
    from turnrl.multimodal import uses_mrope, vl_positions

    mms = row.mm_inputs or [None] * len(row.sequence_index)
    with_images = [mm for mm in (mms[s] for s in row.mm_tries) if mm]
    pixels = {key: torch.cat([mm[key] for mm in with_images]) for key in with_images[0]} if with_images else {}
    if not uses_mrope(model.config):
        return {"position_ids": row.position_ids, **pixels}
    ids = row.input_ids[0].tolist()
    paths: dict[int, list[int]] = {}
    for k, (s, _) in enumerate(row.witness):  # a sample's ids from its nodes: the witness path of each token
        paths.setdefault(s, []).append(k)
    per_sample = {}
    for s, nodes in paths.items():
        full = _sample_ids(row, s, nodes, ids)
        per_sample[s] = vl_positions(model, full, (mms[s] or {}).get("image_grid_thw"))[0]  # [3, 1, L]
    positions = torch.stack([per_sample[s][:, 0, d] for s, d in row.witness], dim=1)[:, None, :]
    return {"position_ids": positions.to(row.input_ids.device), **pixels}


def _sample_ids(row: TreeRow, s: int, nodes: list[int], ids: list[int]) -> list[int]:
    """The token ids of packed sample `s` up to its deepest node that it witnesses: its root-to-node path."""
    deepest = max(nodes, key=lambda k: row.witness[k][1])
    path = []
    parent = row.parent.tolist()
    k = deepest
    while k >= 0:
        path.append(ids[k])
        k = parent[k]
    return path[::-1]


def tree_row_routing(row: TreeRow, routing: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """[T, layers, top_k] routing of the row's tokens for `turnrl.moe.replay_routing`, each node's from the first
    sample through it that has one for it (a shared prefix routes the same in every sample passing through; the
    engine never fed a sample's last token); UNROUTED where none has. As packing.row_routing, `routing[i]` is
    indexed like `row.sequence_index`."""
    known = [r for r in (routing[i] for i in row.sequence_index) if r is not None]
    if not known:
        return None
    out = known[0].new_full((row.input_ids.shape[1], *known[0].shape[1:]), UNROUTED)
    for s in reversed(range(len(row.sequence_index))):  # earlier samples overwrite later ones
        experts = routing[row.sequence_index[s]]
        if experts is not None:
            n = min(experts.shape[0], len(row.paths[s]))
            out[row.paths[s][:n]] = experts[:n]
    return out


def tree_stats(rows: Sequence[PackedRow]) -> tuple[int, int]:
    """(tokens forwarded, tokens raw) of packed rows, tree or flat."""
    forwarded = sum(int(r.input_ids.shape[1]) for r in rows)
    raw = sum(r.tokens_raw if isinstance(r, TreeRow) else int(r.input_ids.shape[1]) for r in rows)
    return forwarded, raw
