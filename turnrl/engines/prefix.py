"""Prefix reuse for the embedded engine: which KV a new request can copy instead of prefilling it.

A request's prompt often begins with tokens whose KV the engine already holds:
- its own trajectory's previous turn (parked when that turn finished, under the request id);
- another request's: the other samples of a GRPO group (the same prompt), the turns before a fork (a
  branch's prompt extends its parent's tokens up to the fork), a branch after context compaction (the same
  system prompt and task), another episode with the same system prompt.
Where that KV lies: a *parked* entry (a finished request's tokens and KV, kept under its request id), a
*running* request's slot (columns [0, length) hold its prompt and the tokens sampled so far), or a request
admitted in the same step and prefilled before this one (a *round* source: a group's first sample is
prefilled, the other seven copy its prompt's KV and prefill only their last prompt token).

The copy is of rows of K/V computed from the same token ids at the same positions by the same weights, so the
outputs are those of prefilling the whole prompt, up to float rounding (the no-sharing path itself is only
reproducible that far: the same prompt batched with other rows gives logprobs that differ in the last bits).

Bounds: parked KV holds at most `max_tokens` tokens (`engine.prefix_cache_tokens`); entries are evicted least
recently used (parked, or copied from) first, dropped on `release(request_id)`, on a weight update and on
`sleep`. A request consumes its own trajectory's entry (its slot holds that KV from then on, and parks it
again, extended, when it finishes); other requests' entries stay. Running and round sources cost no memory
beyond the slots. Requests only copy KV computed under the current weights.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from turnrl.engines.cascade import Shared


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (binary search over C-speed slice compares)."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Parked:
    """A finished request's KV: `tokens` (prompt and output but the last sampled token), one [kv_heads,
    len(tokens), head_dim] tensor per layer's K then V, the rotary position of the next token fed, and the shared
    block its first columns hold (turnrl.engines.cascade.Shared; None: none known)."""

    request_id: str
    tokens: list[int]
    kv: list[torch.Tensor]
    next_pos: int
    shared: Shared | None = None


class ParkedKV:
    """Finished requests' KV by request id: least recently used first out, at most `max_tokens` tokens."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.tokens = 0
        self.evicted = 0
        """Entries pushed out to make room (a live trajectory's KV: its next turn recomputes it)."""
        self._entries: OrderedDict[str, Parked] = OrderedDict()

    def park(self, request_id: str, entry: Parked) -> None:
        self.pop(request_id)
        if not self.max_tokens or len(entry.tokens) > self.max_tokens:
            return
        self._entries[request_id] = entry
        self.tokens += len(entry.tokens)
        while self.tokens > self.max_tokens:
            self.pop(next(iter(self._entries)))
            self.evicted += 1

    def fits(self, n_tokens: int) -> bool:
        """Whether an entry of n tokens would be kept (checked before exporting its KV)."""
        return 0 < n_tokens <= self.max_tokens

    def pop(self, request_id: str) -> Parked | None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self.tokens -= len(entry.tokens)
        return entry

    def touch(self, request_id: str) -> None:
        """Copied from: most recently used."""
        if request_id in self._entries:
            self._entries.move_to_end(request_id)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def items(self) -> list[tuple[str, Parked]]:
        return list(self._entries.items())

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class Source:
    """Where a request's reused prefix comes from and how many tokens it copies: `kind` parked (key: the Parked
    entry), running (key: the running request whose slot holds it) or round (key: a request admitted before it in
    the same step, prefilled first); `level`: the prefill phase of the step the request joins (0, or one more than
    its round source's)."""

    kind: Literal["parked", "running", "round"]
    key: object
    tokens: int
    level: int = 0


@dataclass
class Candidate:
    """KV that could serve a prompt's prefix: its tokens, how many of them have KV, and the level a request
    served by it would join."""

    kind: Literal["parked", "running", "round"]
    key: object
    tokens: Sequence[int]
    available: int
    level: int = 0


def best_source(prompt: list[int], candidates: list[Candidate]) -> Source | None:
    """The candidate sharing the longest prefix with `prompt` (at least one prompt token is left to prefill, for
    the next-token logits); among equals, the lowest level (prefilled earliest), then the first. None: none."""
    best: Source | None = None
    cap = len(prompt) - 1
    for c in candidates:
        n = min(common_prefix(prompt, c.tokens), c.available, cap)
        if n > 0 and (best is None or n > best.tokens or (n == best.tokens and c.level < best.level)):
            best = Source(c.kind, c.key, n, c.level)
    return best


def choose_sources(prompts: Sequence[list[int]], owns: Sequence[Parked | None], parked: ParkedKV,
                   running: Sequence[tuple[object, list[int]]], admitted: Sequence[object]) -> list[Source | None]:
    """The source of each prompt admitted in one step, in order: `owns` are their own trajectories' parked
    entries (already taken out of `parked`), `running` the running requests with the tokens their slots hold,
    `admitted` the admitted requests themselves (a later one may copy an earlier one's prompt). Parked entries
    chosen become the most recently used."""
    sources: list[Source | None] = []
    for i, prompt in enumerate(prompts):
        entries = [e for e in (owns[i],) if e is not None] + [entry for _, entry in parked.items()]
        candidates = [Candidate("parked", e, e.tokens, len(e.tokens)) for e in entries]
        candidates += [Candidate("running", r, tokens, len(tokens)) for r, tokens in running]
        candidates += [Candidate("round", admitted[j], prompts[j], len(prompts[j]), (s.level if s else 0) + 1)
                       for j, s in enumerate(sources)]
        source = best_source(prompt, candidates)
        if source is not None and isinstance(source.key, Parked):
            parked.touch(source.key.request_id)
        sources.append(source)
    return sources
