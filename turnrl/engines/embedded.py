"""The embedded engine: continuous batching over a transformers model, for CPUs and small models.

Why not `model.generate`: it serves one static batch at a time (rows that finish keep decoding until the
longest one ends, and a trajectory that comes back from its tool waits for the whole batch), and its
dynamic KV cache grows by `torch.cat` every step, which on a 2-core CPU costs as much as the matmuls.
transformers' own continuous-batching manager (`generate_batch`) uses paged attention kernels that fall
back to slow paths on CPU and has no VLM support; `bench/engine.py` measures both against this engine.

How it works:
- One background thread owns the model. `generate()` (async) enqueues a request and awaits a future;
  the event loop stays free for environments and tools while the thread computes.
- KV lives in a preallocated slab per layer, `[max_batch, kv_heads, capacity, head_dim]`, left-aligned
  (row i holds its tokens in columns [0, len_i)). Capacity doubles when needed (rare copy).
  Active rows are always slots [0, n): a finished row is replaced by the last active row (one row copy).
- Every step: admit waiting requests (prefill each into a free slot; its first token comes from the
  prefill logits), then one decode step for all active rows with a 4-D boolean mask `col <= len_i`.
- Prefix reuse (turnrl.engines.prefix): when a request finishes, its KV is parked under its request id. A new
  request copies the KV of the longest prefix its prompt shares with a parked entry, a running request or a
  request admitted before it in the same step, and prefills only the rest: the next turn of a trajectory
  prefills its observation, the samples of a group prefill their common prompt once, a fork or a compacted
  branch copies what it shares with its parent. Parked KV is bounded by `prefix_cache_tokens` (LRU) and
  dropped on `release(request_id)`, `sleep` or a weight update. With `share_prefixes=False` (and always for
  VLMs and with `record_routing`) only a trajectory's own parked KV is reused, when its prompt extends it.
- Cascade (turnrl.engines.cascade; `cascade=True`, with share_prefixes): rows whose first columns hold copies of
  one block's KV (a group's prompt) decode against one copy of it: the decode step reads those columns once for
  the group, merged by log-sum-exp with each row's own columns. Every row still holds its full copy.
- Logprobs are those of the distribution actually sampled from (temperature, top-k, top-p applied).
- With `record_sampling_mask`, each token also reports the size of the kept set it was drawn from (the k most
  likely tokens that top-k and top-p left), so the trainer can renormalise over the same set; with
  `record_routing` (an MoE policy), the experts its routers chose for every token fed (turnrl.moe).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from turnrl.engines.base import EngineError, InvalidRequest, KVStats, NamedTensors, check_pause
from turnrl.engines.cascade import (
    PLAN_KWARG,
    Shared,
    decode_groups,
    plan_cascade,
    share,
    use_cascade_attention,
)
from turnrl.engines.prefix import Parked, ParkedKV, Source, choose_sources
from turnrl.moe import RoutingRecorder, router_top_k
from turnrl.types import (
    SAMPLING_RULES,
    FinishReason,
    GenerateOutput,
    SamplingParams,
    broken_sampling_field,
    is_int,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# KV slab: what the model's attention layers call `cache.update(...)` on.
# ---------------------------------------------------------------------------------------------------
class SlotKVCache:
    """A preallocated, left-aligned KV cache with one row (slot) per active request.

    Duck-types the transformers `Cache` API the attention layers use (`update`, `get_seq_length`). Before
    each forward the engine sets a *plan*: either a prefill of `q` tokens into one slot starting at a
    column, or a decode step of one token for slots [0, n) at columns `lens`.
    """

    def __init__(self, n_layers: int, max_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.n_layers, self.max_slots, self.kv_heads, self.head_dim, self.dtype = (
            n_layers, max_slots, kv_heads, head_dim, dtype,
        )
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._plan: tuple = ()
        self.ensure_capacity(256)

    # -- memory -----------------------------------------------------------------------------------
    def ensure_capacity(self, tokens: int) -> None:
        if tokens <= self.capacity:
            return
        new_cap = max(256, self.capacity)
        while new_cap < tokens:
            new_cap *= 2
        shape = (self.max_slots, self.kv_heads, new_cap, self.head_dim)
        k = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.n_layers)]
        v = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.n_layers)]
        for old, new in zip(self.k + self.v, k + v, strict=False):  # empty on first allocation
            new[:, :, : self.capacity].copy_(old)
        self.k, self.v, self.capacity = k, v, new_cap

    def free(self) -> None:
        self.k, self.v, self.capacity = [], [], 0

    def move_row(self, src: int, dst: int, length: int) -> None:
        for t in itertools.chain(self.k, self.v):
            t[dst, :, :length].copy_(t[src, :, :length])

    def export_row(self, slot: int, length: int) -> list[torch.Tensor]:
        return [t[slot, :, :length].clone() for t in itertools.chain(self.k, self.v)]

    def import_row(self, slot: int, parked: list[torch.Tensor], length: int) -> None:
        for t, p in zip(itertools.chain(self.k, self.v), parked, strict=True):
            t[slot, :, :length].copy_(p[:, :length])

    # -- plans ------------------------------------------------------------------------------------
    def plan_prefill(self, first_slot: int, starts: list[int], qs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill of slots first_slot.. first_slot+m-1: row i adds qs[i] tokens at columns starts[i]...

        Queries are left-padded to Q = max(qs), so every row's last query is its last token (`logits_to_keep=1`
        gives each row's next-token logits). Returns the 4-D mask [m, 1, Q, W] and the positions [m, Q]."""
        m, q_max = len(qs), max(qs)
        width = max(s + q for s, q in zip(starts, qs, strict=True))
        rel_M_Q = torch.arange(q_max)[None, :] - torch.tensor([q_max - q for q in qs])[:, None]  # < 0: padding
        valid_M_Q = rel_M_Q >= 0
        col_M_Q = torch.tensor(starts)[:, None] + rel_M_Q  # the column each query token is written to
        cols_W = torch.arange(width)
        mask = (cols_W <= col_M_Q[:, :, None]) & valid_M_Q[:, :, None]
        mask |= ~valid_M_Q[:, :, None] & (cols_W == 0)  # padding queries look at one real key (no NaN rows)
        ii, jj = valid_M_Q.nonzero(as_tuple=True)
        self._plan = ("prefill", first_slot, m, width, ii, jj, first_slot + ii, col_M_Q[ii, jj])
        return mask[:, None], col_M_Q.clamp(min=0)

    def plan_decode(self, lens: torch.Tensor) -> torch.Tensor:
        """Returns the 4-D mask [n, 1, 1, max(lens) + 1]: row i sees columns 0..lens[i]."""
        n = lens.shape[0]
        width = int(lens.max()) + 1
        self._plan = ("decode", torch.arange(n), lens, width)
        return (torch.arange(width)[None, :] <= lens[:, None])[:, None, None, :]

    # -- the Cache API used by attention layers ---------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        k, v = self.k[layer_idx], self.v[layer_idx]
        if self._plan[0] == "prefill":
            _, first, m, width, ii, jj, rows, cols = self._plan
            k[rows, :, cols] = key_states[ii, :, jj]
            v[rows, :, cols] = value_states[ii, :, jj]
            return k[first : first + m, :, :width], v[first : first + m, :, :width]
        _, rows, cols, width = self._plan
        k[rows, :, cols] = key_states[:, :, 0]
        v[rows, :, cols] = value_states[:, :, 0]
        n = rows.shape[0]
        return k[:n, :, :width], v[:n, :, :width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    @property
    def is_compileable(self) -> bool:
        return False


# ---------------------------------------------------------------------------------------------------
# Requests and sampling
# ---------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    stop_ids: frozenset[int]
    max_new: int
    generator: torch.Generator | None = None
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    length: int = 0  # tokens whose KV is in the slot
    cached_prompt_tokens: int = 0
    aborted: bool = False
    images: list = field(default_factory=list)  # VLM: every image of the prompt, in order
    next_pos: int = 0  # rotary position of the next token fed (differs from `length` after images)
    on_token: Callable[[int], bool | None] | None = None  # streaming: called on `loop` with each sampled token
    stop_asked: bool = False  # on_token returned True: the call ends at the next step, as a stop
    error: BaseException | None = None  # set when this request alone failed in a step: retired with it
    versions: list[int] = field(default_factory=list)  # the policy version that sampled each out token
    kv_epoch: int = -1  # the engine's weights epoch at prefill: KV from an earlier epoch is never copied
    kept: list[int] = field(default_factory=list)  # the kept-set size of each out token (record_sampling_mask)
    routing: list[torch.Tensor] = field(default_factory=list)  # [tokens, layers, k] per forward (record_routing)
    shared: Shared | None = None  # its first columns hold a shared block's KV (copied): cascade groups by it


def sample_tokens(
    logits_N_V: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row with per-row temperature/top-k/top-p; return (tokens_N, logprobs_N, kept_N).

    The logprob is taken from the distribution the token was drawn from (after the filters, renormalised),
    which is what importance-sampling correction needs. Greedy rows return the unscaled logprob.
    kept_N is the size of each row's kept set: top-k keeps every token at least as likely as the k-th, top-p a
    prefix of the tokens sorted by probability, so the kept set is always the kept_N most likely tokens (the
    vocabulary size for greedy rows and rows without filters).
    """
    logits_N_V = logits_N_V.float()
    n = logits_N_V.shape[0]
    temps_N = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    scaled_N_V = logits_N_V / temps_N[:, None]
    if any(p.top_k > 0 for p in params):
        for i, p in enumerate(params):
            if 0 < p.top_k < scaled_N_V.shape[1]:
                kth = torch.topk(scaled_N_V[i], p.top_k).values[-1]
                scaled_N_V[i].masked_fill_(scaled_N_V[i] < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p_N = torch.tensor([p.top_p for p in params])
        sorted_N_V, order_N_V = scaled_N_V.sort(dim=-1, descending=True)
        cum_N_V = sorted_N_V.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_N_V = (cum_N_V - sorted_N_V.softmax(-1)) >= top_p_N[:, None]
        sorted_N_V = sorted_N_V.masked_fill(drop_N_V, float("-inf"))
        scaled_N_V = torch.empty_like(scaled_N_V).scatter_(1, order_N_V, sorted_N_V)
    logp_N_V = scaled_N_V.log_softmax(-1)
    kept_N = torch.full((n,), logits_N_V.shape[1], dtype=torch.long)
    filtered = [i for i, p in enumerate(params) if not p.greedy and (p.top_p < 1.0 or 0 < p.top_k < logits_N_V.shape[1])]
    if filtered:
        kept_N[filtered] = torch.isfinite(scaled_N_V[filtered]).sum(-1)
    tokens_N = torch.empty(n, dtype=torch.long)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        tokens_N[greedy] = logp_N_V[greedy].argmax(-1)
    shared = [i for i, p in enumerate(params) if not p.greedy and generators[i] is None]
    if shared:
        tokens_N[shared] = draw(logp_N_V[shared], default_generator)
    for i, p in enumerate(params):
        generator = generators[i]
        if not p.greedy and generator is not None:
            tokens_N[i] = draw(logp_N_V[i : i + 1], generator)[0]
    logprobs_N = logp_N_V.gather(1, tokens_N[:, None])[:, 0]
    if greedy:  # a greedy choice has no sampling distribution: report the model's own (unfiltered) logprob
        logprobs_N[greedy] = logits_N_V[greedy].log_softmax(-1).gather(1, tokens_N[greedy, None])[:, 0]
    return tokens_N, logprobs_N, kept_N


def draw(logp_N_V: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row by inverse-CDF sampling: one uniform per row, searched in the float64 CDF.

    Not `torch.multinomial`: on CPU it draws an exponential per vocabulary entry, ~15 ms per step at batch
    16 over a 49k vocabulary (10% of a SmolLM2-135M decode step), against ~1.5 ms here.
    """
    cdf_N_V = logp_N_V.exp().cumsum(-1, dtype=torch.float64)
    total_N_1 = cdf_N_V[:, -1:]
    if not torch.isfinite(total_N_1).all():
        raise ValueError("sampling distribution is not finite (nan/inf logits)")
    # u in (0, total]: the first column whose CDF reaches u has a positive probability
    u_N_1 = (1 - torch.rand(total_N_1.shape, dtype=torch.float64, generator=generator)) * total_N_1
    return torch.searchsorted(cdf_N_V, u_N_1)[:, 0]


def check_sampling(params: Any, where: str, vocab_size: int) -> None:
    """Raise InvalidRequest naming the first SamplingParams field an engine step could not use: the rules of
    `SAMPLING_RULES` (params can reach here with their checks bypassed) and stop ids inside the vocabulary."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequest(f"{where}: sampling params must be SamplingParams, got {type(params).__name__}", "sampling")
    broken = broken_sampling_field({name: getattr(params, name) for name in SAMPLING_RULES})
    if broken is None and not all(t < vocab_size for t in params.stop_token_ids):
        broken = "stop_token_ids", f"a list of token ids (integers in [0, {vocab_size}))"
    if broken is not None:
        name, expected = broken
        raise InvalidRequest(f"{where}: sampling.{name} must be {expected}, got {getattr(params, name)!r}",
                             f"sampling.{name}")


def _prefill_groups(admitted: list[tuple[_Request, int]], max_group: int) -> list[list[tuple[_Request, int]]]:
    """Split consecutive admitted requests into prefill groups whose left padding wastes little: a group grows
    while padded tokens (max length × rows) stay within 1.5× the real ones plus a small slack."""
    groups: list[list[tuple[_Request, int]]] = []
    for item in admitted:
        q = len(item[0].prompt_ids) - item[1]
        if groups and len(groups[-1]) < max_group:
            lengths = [len(r.prompt_ids) - s for r, s in groups[-1]] + [q]
            if max(lengths) * len(lengths) <= 1.5 * sum(lengths) + 32:
                groups[-1].append(item)
                continue
        groups.append([item])
    return groups


# ---------------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------------
def _model_end_tokens(model: PreTrainedModel, text_config: Any) -> frozenset[int]:
    """The model config's and the generation config's end tokens: both stop (Qwen3: <|im_end|>, <|endoftext|>)."""
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return frozenset(t for ids in (getattr(text_config, "eos_token_id", None), gen_eos) if ids is not None
                     for t in ([ids] if isinstance(ids, int) else ids))


class EmbeddedEngine:
    """Token-level continuous-batching engine over a transformers causal LM (see module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Iterable[int] = (),
        max_batch_size: int = 16,
        prefix_cache_tokens: int = 32_768,
        max_context: int | None = None,
        seed: int = 0,
        image_processor: Any = None,
        record_sampling_mask: bool = False,
        record_routing: bool = False,
        share_prefixes: bool = True,
        cascade: bool = True,
    ):
        self.model = model.eval()
        self.record_sampling_mask = record_sampling_mask
        """Report each token's kept-set size (`GenerateOutput.kept_counts`)."""
        self._routing = RoutingRecorder(model) if record_routing else None
        """Records the MoE routing of every forward (`GenerateOutput.routed_experts`); None: off."""
        self.is_vlm = hasattr(model.config, "vision_config")
        from turnrl.multimodal import uses_mrope

        self.mrope = self.is_vlm and uses_mrope(model.config)
        """Qwen VL: multimodal rotary positions; text models and LLaVA-style VLMs: the token's index."""
        self.image_processor = image_processor
        if self.is_vlm and image_processor is None:
            raise EngineError("EmbeddedEngine over a VLM needs its image_processor (turnrl.multimodal.build_processor)")
        cfg: Any = getattr(model.config, "text_config", model.config)
        self.config: Any = model.config  # a transformers PretrainedConfig (nn.Module types it as Tensor | Module)
        self.max_batch_size = max_batch_size
        self.max_context: int = max_context or int(getattr(cfg, "max_position_embeddings", 32_768))
        self.vocab_size: int = cast(torch.nn.Embedding, model.get_input_embeddings()).num_embeddings
        """Token ids must lie in [0, vocab_size): the rows of the embedding (may exceed the tokenizer's)."""
        self.eos_token_ids = frozenset(eos_token_ids) | _model_end_tokens(model, cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(model.parameters()).dtype
        self.cache = SlotKVCache(cfg.num_hidden_layers, max_batch_size, cfg.num_key_value_heads, head_dim, dtype)
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.policy_version = 0
        self.prefix_cache_tokens = prefix_cache_tokens
        self.share_prefixes = share_prefixes and not self.is_vlm and not record_routing
        """Reuse any request's KV for a shared prefix; off: only a trajectory's own. Never for VLMs (the image
        tokens of different images have the same ids) or with record_routing (the routing of a copied prefix
        belongs to the request it was copied from)."""
        self.cascade = self.share_prefixes and cascade and use_cascade_attention(model)
        """Decode rows that copied one prefix's KV against one copy of it (turnrl.engines.cascade): with
        share_prefixes, on an SDPA model."""
        self._parked = ParkedKV(prefix_cache_tokens)
        self._kv_epoch = 0  # bumped when the weights change or the cache sleeps: older KV is never copied
        self._generator = torch.Generator().manual_seed(seed)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting, self._active = list[_Request](), list[_Request]()
        self._wake, self._stopped = threading.Event(), False
        self._updating = False  # between the first and the final bucket of a streamed weight update
        self._deferred: list[tuple] = []  # commands held until the running requests finish (pause=wait)
        self.stats = {"decode_steps": 0, "cascade_steps": 0, "prefill_forwards": 0, "prefill_tokens": 0,
                      "cached_prompt_tokens": 0, "shared_prompt_tokens": 0, "generated_tokens": 0, "requests": 0,
                      "busy_s": 0.0, "prefill_s": 0.0}
        """shared_prompt_tokens: the part of cached_prompt_tokens copied from another request's KV; prefill_s: the
        part of busy_s spent in prefill forwards; cascade_steps: decode steps that ran cascade attention."""
        self._thread = threading.Thread(target=self._run, name="turnrl-engine", daemon=True)
        self._thread.start()

    # ---- public API (async, called from any event loop) -----------------------------------------
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str, images: list | None = None,
        on_token: Callable[[int], bool | None] | None = None,
    ) -> GenerateOutput:
        """Sample a continuation. `on_token(token_id)` (optional) is called on the caller's event loop with each
        token as it is sampled, in order, before the call returns them all (streaming servers use it). When it
        returns True (the caller saw a stop string in the text) the call ends at the next step with finish_reason
        stop; tokens sampled before that step are still returned, for the caller to cut."""
        self._check_request(prompt_ids, params, request_id, images)
        loop = asyncio.get_running_loop()
        req = _Request(
            prompt_ids=list(prompt_ids), params=params, request_id=request_id, loop=loop,
            future=loop.create_future(), stop_ids=self.eos_token_ids | frozenset(params.stop_token_ids),
            max_new=min(params.max_new_tokens, self.max_context - len(prompt_ids)),
            generator=None if params.seed is None else torch.Generator().manual_seed(params.seed),
            images=list(images or []), on_token=on_token,
        )
        self._submit(("generate", req))
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            req.aborted = True  # the engine thread drops it at the next step
            self._wake.set()
            raise

    def _check_request(self, prompt_ids: Any, params: Any, request_id: str, images: list | None) -> None:
        """Refuse, here on the caller's side, whatever would fail inside a step: there it would fail every
        request batched with it (an out-of-vocabulary id breaks the embedding lookup of the whole prefill)."""
        where = f"request {request_id!r}"
        if images and not self.is_vlm:
            raise InvalidRequest(f"{where}: EmbeddedEngine over a text-only model got images; load a VLM policy "
                                 "for images", "images")
        if not isinstance(prompt_ids, list | tuple) or not prompt_ids:
            raise InvalidRequest(f"{where}: empty prompt (prompt_ids must be a non-empty list of token ids)",
                                 "prompt_ids")
        for i, t in enumerate(prompt_ids):
            if not is_int(t) or not 0 <= t < self.vocab_size:
                raise InvalidRequest(f"{where}: prompt_ids[{i}] = {t!r} is not a token id (an int in "
                                     f"[0, {self.vocab_size}))", "prompt_ids")
        check_sampling(params, where, self.vocab_size)
        if self.is_vlm:
            from turnrl.multimodal import count_images

            n_prompt = count_images(self.config, list(prompt_ids))
            if n_prompt != len(images or []):
                raise InvalidRequest(f"{where}: the prompt has {n_prompt} images but {len(images or [])} were sent",
                                     "images")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequest(f"{where}: prompt_ids holds {len(prompt_ids)} tokens, which do not fit the "
                                 f"context of {self.max_context} tokens (the prompt must be shorter)", "prompt_ids")

    async def update_weights(self, named_tensors: NamedTensors, version: int | None = None, *,
                             final: bool = True, pause: str = "keep") -> int:
        """Load weights between decode steps. `pause` (with the first bucket of an update) says what requests in
        flight do: `keep` them in place, KV and all, and continue under the new weights (their later tokens
        carry the new version, `GenerateOutput.token_versions`); `wait` until they finish on the old weights
        (no request starts meanwhile); `abort` them: each returns its tokens so far as `preempted`, for the
        caller to resubmit (turnrl.rollout does, re-prefilling under the new weights)."""
        check_pause(pause)
        items = dict(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        return await self._call(("update_weights", items, version, final, pause))

    async def release(self, request_id: str) -> None:
        await self._call(("release", request_id))

    def kv_stats(self) -> KVStats | None:
        """Its cache of trajectories' KV between turns (`prefix_cache_tokens`): the share in use, and the parked
        prefixes of live trajectories evicted to make room (each recomputed at that trajectory's next turn, as a
        server recomputes a preempted request). None without a prefix cache."""
        if not self.prefix_cache_tokens:
            return None
        return KVStats(min(self._parked.tokens / self.prefix_cache_tokens, 1.0), self._parked.evicted)

    async def sleep(self) -> None:
        await self._call(("sleep",))

    async def wake_up(self) -> None:
        await self._call(("wake_up",))

    def close(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        if self._routing is not None:
            self._routing.close()

    # ---- thread plumbing -------------------------------------------------------------------------
    def _submit(self, item: tuple) -> None:
        if self._stopped:
            raise EngineError("engine is closed")
        self._inbox.put(item)
        self._wake.set()

    async def _call(self, command: tuple):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._submit(("command", command, loop, fut))
        return await fut

    @staticmethod
    def _resolve(loop, fut, result=None, error: BaseException | None = None) -> None:
        def _set():
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        with contextlib.suppress(RuntimeError):  # the caller's loop is closed
            loop.call_soon_threadsafe(_set)

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stopped:
                self._drain_inbox()
                self._run_deferred()
                if self._updating or (not self._active and not self._waiting):
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                t0 = time.perf_counter()
                try:
                    self._admit()
                    if self._active:
                        self._decode_step()
                except Exception as e:  # a broken step fails the requests in it (never those still waiting)
                    log.exception("engine step failed")
                    for r in self._active:
                        self._resolve(r.loop, r.future, error=EngineError(f"engine step failed: {e!r}"))
                    self._active = []
                self.stats["busy_s"] += time.perf_counter() - t0
        for r in self._active + self._waiting:
            self._resolve(r.loop, r.future, error=EngineError("engine closed"))
        while True:  # submitted but never drained: fail them too, or their callers wait forever
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            loop, fut = (item[1].loop, item[1].future) if item[0] == "generate" else (item[2], item[3])
            self._resolve(loop, fut, error=EngineError("engine closed"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "generate":
                self._waiting.append(item[1])
                continue
            if self._deferred or self._waits_for_running(item[1]):  # in order, behind a waiting update
                self._deferred.append(item)
                continue
            self._run_command(item)

    def _waits_for_running(self, command: tuple) -> bool:
        """A weight update in pause mode `wait` that starts while requests are running."""
        return (command[0] == "update_weights" and not self._updating and command[4] == "wait"
                and bool(self._active))

    def _run_deferred(self) -> None:
        """The running requests finished: the update that waited for them (and what queued behind it) runs."""
        while self._deferred and not self._active:
            self._run_command(self._deferred.pop(0))

    def _run_command(self, item: tuple) -> None:
        _, command, loop, fut = item
        try:
            self._resolve(loop, fut, result=self._command(command))
        except Exception as e:
            self._resolve(loop, fut, error=e)

    def _command(self, command: tuple):
        name = command[0]
        if name == "update_weights":
            return self._load_weights(*command[1:])
        if name == "release":
            self._parked.pop(command[1])
        elif name == "sleep":
            self._drop_parked()
            if not self._active:
                self.cache.free()
        elif name == "wake_up":
            self.cache.ensure_capacity(256)
        return None

    # ---- weights ---------------------------------------------------------------------------------
    def _load_weights(self, tensors: dict[str, torch.Tensor], version: int | None, final: bool = True,
                      pause: str = "keep") -> int:
        # remove_duplicate=False: a state dict names tied weights twice (lm_head.weight and embed_tokens.weight)
        params: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers(remove_duplicate=False)))
        unknown = [n for n in tensors if n not in params]
        if unknown:
            raise EngineError(f"update_weights: {len(unknown)} unknown parameter names, e.g. {unknown[:3]}")
        for name, t in tensors.items():  # check everything before copying anything: no half-updated policy
            if params[name].shape != t.shape:
                raise EngineError(f"update_weights: {name} has shape {tuple(t.shape)}, expected {tuple(params[name].shape)}")
        if pause == "abort" and not self._updating:  # the first bucket: stop what runs, keep its tokens
            self._preempt_running()
        for name, t in tensors.items():
            params[name].copy_(t)
        self._drop_parked()  # parked KV was computed with the old weights
        self._updating = not final  # no token is sampled from half-updated weights (see _run)
        if final:
            self.policy_version = self.policy_version + 1 if version is None else version
        return self.policy_version

    def _preempt_running(self) -> None:
        """pause=abort: every running request returns its tokens so far, marked preempted (the caller resubmits
        prompt + tokens); their slots are free at once. Requests still waiting are served by the new weights."""
        for req in self._active:
            if not req.aborted and req.error is None:
                self._resolve(req.loop, req.future, result=self._output(req, FinishReason.ABORT, preempted=True))
        self._active = []

    def _output(self, req: _Request, reason: FinishReason, *, preempted: bool = False) -> GenerateOutput:
        versions = req.versions if len(set(req.versions)) > 1 else None  # a request that went on across an update
        routed = torch.cat(req.routing) if req.routing else None
        return GenerateOutput(token_ids=req.out_ids, logprobs=req.out_logprobs, finish_reason=reason,
                              policy_version=self.policy_version, cached_prompt_tokens=req.cached_prompt_tokens,
                              token_versions=versions, preempted=preempted,
                              kept_counts=req.kept if self.record_sampling_mask else None,
                              routed_experts=routed, routed_start=req.cached_prompt_tokens)

    # ---- prefix reuse ----------------------------------------------------------------------------
    def _park(self, req: _Request, slot: int) -> None:
        tokens = req.prompt_ids + req.out_ids[:-1]  # KV exists for everything but the last sampled token
        if req.kv_epoch != self._kv_epoch or not self._parked.fits(len(tokens)):
            return  # KV partly computed by weights since replaced, or too long to keep
        # the next turn's delta starts with the last sampled token, at rotary position next_pos
        self._parked.park(req.request_id, Parked(req.request_id, tokens, self.cache.export_row(slot, len(tokens)),
                                                 req.next_pos, req.shared))

    def _drop_parked(self) -> None:
        self._parked.clear()
        self._kv_epoch += 1

    def _choose_sources(self, taken: list[_Request]) -> list[Source | None]:
        """For each request admitted in this step, in order, the KV its prompt's prefix is copied from (None:
        prefilled whole). A request consumes its own trajectory's parked entry either way."""
        for req in taken:
            self.cache.ensure_capacity(len(req.prompt_ids) + req.max_new)
        owns = [self._parked.pop(req.request_id) for req in taken]
        if self.share_prefixes:
            running = [(r, r.prompt_ids + r.out_ids[: r.length - len(r.prompt_ids)]) for r in self._active
                       if r.error is None and r.kv_epoch == self._kv_epoch]
            return choose_sources([r.prompt_ids for r in taken], owns, self._parked, running, taken)
        return [Source("parked", own, len(own.tokens))  # its own trajectory's KV, when the prompt extends it
                if own is not None and 0 < len(own.tokens) < len(req.prompt_ids)
                and req.prompt_ids[: len(own.tokens)] == own.tokens else None for req, own in zip(taken, owns, strict=True)]

    def _copy_prefix(self, req: _Request, slot: int, source: Source | None) -> int:
        """Copy the source's KV for the shared prefix into the request's slot; returns the tokens copied."""
        if source is None:
            return 0
        if source.kind == "parked":
            entry = cast(Parked, source.key)
            self.cache.import_row(slot, entry.kv, source.tokens)
            if self.mrope:  # (the whole entry: VLMs reuse only their own trajectory's)
                req.next_pos = entry.next_pos
            entry.shared, req.shared = share(entry.shared, source.tokens)
        else:
            src = cast(_Request, source.key)
            if src.error is not None or src.length < source.tokens:  # a round source whose prefill failed
                return 0
            self.cache.move_row(self._active.index(src), slot, source.tokens)
            src.shared, req.shared = share(src.shared, source.tokens)
        if source.kind != "parked" or cast(Parked, source.key).request_id != req.request_id:
            self.stats["shared_prompt_tokens"] += source.tokens
        return source.tokens

    # ---- scheduling ------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Move waiting requests into free slots and prefill them, several per forward where lengths allow. A
        request that copies its prefix from another admitted in this step is prefilled after it (levels)."""
        self._waiting = [r for r in self._waiting if not r.aborted]
        taken: list[_Request] = []
        while self._waiting and len(self._active) + len(taken) < self.max_batch_size and not self._deferred:
            taken.append(self._waiting.pop(0))  # (not while a pause=wait update waits)
        if not taken:
            return
        sources = self._choose_sources(taken)
        levels = [s.level if s is not None else 0 for s in sources]
        for level in sorted(set(levels)):  # each level's requests in consecutive slots, as _prefill needs
            admitted: list[tuple[_Request, int]] = []
            for req, source, req_level in zip(taken, sources, levels, strict=True):
                if req_level == level:
                    self._active.append(req)
                    admitted.append((req, self._copy_prefix(req, len(self._active) - 1, source)))
            for group in _prefill_groups(admitted, 1 if self.is_vlm else self.max_batch_size):
                self._prefill_isolated(group)
        self._retire([req for req in taken if req.error is not None or self._finished(req)])

    def _prefill_isolated(self, group: list[tuple[_Request, int]]) -> None:
        """Prefill a group; when it fails, prefill its requests one by one, so a request that cannot be
        prefilled (an image that does not load) fails alone and its neighbours go on."""
        try:
            self._prefill(group)
            return
        except Exception as e:
            if len(group) == 1:
                log.warning("engine: request %r failed in its prefill: %r", group[0][0].request_id, e)
                group[0][0].error = EngineError(f"request {group[0][0].request_id!r} failed in prefill: {e!r}")
                return
        for item in group:
            self._prefill_isolated([item])

    def _prefill(self, group: list[tuple[_Request, int]]) -> None:
        """One forward over the new tokens of a group of requests in consecutive slots."""
        t0 = time.perf_counter()
        first_slot = self._active.index(group[0][0])
        starts = [start for _, start in group]
        new_ids = [req.prompt_ids[start:] for req, start in group]
        mask, positions = self.cache.plan_prefill(first_slot, starts, [len(ids) for ids in new_ids])
        q_max = positions.shape[1]
        input_ids = torch.tensor([[0] * (q_max - len(ids)) + ids for ids in new_ids])  # left-padded
        if self.is_vlm:  # one request per group: its images (and M-RoPE positions for Qwen VL)
            req, start = group[0]
            pixels = self._new_image_inputs(req, start)
            if self.mrope:
                from turnrl.multimodal import vl_positions

                positions, req.next_pos = vl_positions(self.model, new_ids[0], pixels.get("image_grid_thw"),
                                                       req.next_pos)
            logits = self._forward(input_ids, positions, mask, **pixels)
        else:
            logits = self._forward(input_ids, positions, mask)
        self.stats["prefill_forwards"] += 1
        self.stats["prefill_s"] += time.perf_counter() - t0
        reqs = [req for req, _ in group]
        if self._routing is not None:  # rows [m * Q]: each request's new tokens are the last of its (left-padded) row
            routed = self._routing.take().view(len(reqs), q_max, *self._routing_shape())
            for i, (req, ids) in enumerate(zip(reqs, new_ids, strict=True)):
                req.routing.append(routed[i, q_max - len(ids):])
        tokens, logps, kept = sample_tokens(logits[:, -1], [r.params for r in reqs], [r.generator for r in reqs],
                                            self._generator)
        for (req, start), ids, token, logp, k in zip(group, new_ids, tokens.tolist(), logps.tolist(), kept.tolist(),
                                                     strict=True):
            req.length = len(req.prompt_ids)
            if not self.mrope:
                req.next_pos = len(req.prompt_ids)
            req.cached_prompt_tokens = start
            req.kv_epoch = self._kv_epoch
            self.stats["prefill_tokens"] += len(ids)
            self.stats["cached_prompt_tokens"] += start
            self.stats["requests"] += 1
            self._append(req, token, logp, k)

    def _new_image_inputs(self, req: _Request, start: int) -> dict[str, torch.Tensor]:
        """Pixels of the images in the part of the prompt not served from the cache (stream order)."""
        from turnrl.multimodal import count_images, load_image

        cached = count_images(self.config, req.prompt_ids[:start])
        new = req.images[cached:]
        expected = count_images(self.config, req.prompt_ids[start:])
        if len(new) != expected:
            raise EngineError(f"request {req.request_id!r}: the prompt has {cached + expected} images but "
                              f"{len(req.images)} were sent")
        if not new:
            return {}
        out = self.image_processor(images=[load_image(im) for im in new], return_tensors="pt")
        return {k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out}  # LLaVA: no grid

    def _decode_step(self) -> None:
        self._retire([r for r in self._active if r.stop_asked])  # the caller saw a stop string: not one token more
        if not self._active:
            return
        rows = self._active
        lens = torch.tensor([r.length for r in rows])
        self.cache.ensure_capacity(int(lens.max()) + 1)
        mask = self.cache.plan_decode(lens)
        ids = torch.tensor([[r.out_ids[-1]] for r in rows])
        if self.mrope:  # text tokens after images: the same rotary position on all three M-RoPE axes
            positions = torch.tensor([r.next_pos for r in rows]).view(1, -1, 1).expand(3, -1, 1)
        else:
            positions = lens[:, None]
        plan = plan_cascade(lens, decode_groups([r.shared for r in rows], lens)) if self.cascade else None
        self.stats["cascade_steps"] += plan is not None
        logits = self._forward(ids, positions, mask, **({PLAN_KWARG: plan} if plan is not None else {}))
        for r in rows:
            r.next_pos += 1
        tokens, logps, kept = sample_tokens(
            logits[:, -1], [r.params for r in rows], [r.generator for r in rows], self._generator
        )
        self.stats["decode_steps"] += 1
        routed = self._routing.take() if self._routing is not None else None  # one row per request
        for i, (r, t, lp, k) in enumerate(zip(rows, tokens.tolist(), logps.tolist(), kept.tolist(), strict=True)):
            r.length += 1
            if routed is not None:
                r.routing.append(routed[i : i + 1])
            self._append(r, t, lp, k)
        self._retire([r for r in rows if self._finished(r) or r.aborted])

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                 **pixels: Any) -> torch.Tensor:
        with self._routing.capture() if self._routing is not None else contextlib.nullcontext():
            out = self.model(
                input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                logits_to_keep=1, **{self._cache_kwarg: self.cache}, **pixels,
            )
        return out.logits

    def _routing_shape(self) -> tuple[int, int]:
        """(MoE layers, experts per token) of the recorded routing."""
        assert self._routing is not None
        return len(self._routing.routers), router_top_k(self._routing.routers[0])

    def _append(self, req: _Request, token: int, logprob: float, kept: int) -> None:
        req.out_ids.append(token)
        req.out_logprobs.append(logprob)
        req.kept.append(kept)
        req.versions.append(self.policy_version)
        self.stats["generated_tokens"] += 1
        if req.on_token is not None:
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                req.loop.call_soon_threadsafe(self._deliver, req, token)

    def _deliver(self, req: _Request, token: int) -> None:
        """On the caller's loop: `on_token`, and its request to stop (read by the engine thread at its next step)."""
        assert req.on_token is not None
        if req.on_token(token) is True and not req.stop_asked:
            req.stop_asked = True
            self._wake.set()

    @staticmethod
    def _finished(req: _Request) -> bool:
        return req.stop_asked or req.out_ids[-1] in req.stop_ids or len(req.out_ids) >= req.max_new

    def _retire(self, done: list[_Request]) -> None:
        """Resolve finished requests and keep the active rows packed in slots [0, n)."""
        for req in done:
            slot = self._active.index(req)
            if req.error is not None:
                self._resolve(req.loop, req.future, error=req.error)
            elif not req.aborted:
                self._park(req, slot)
                stopped = req.stop_asked or req.out_ids[-1] in req.stop_ids
                reason = FinishReason.STOP if stopped else FinishReason.LENGTH
                self._resolve(req.loop, req.future, result=self._output(req, reason))
            last = len(self._active) - 1
            if slot != last:
                moved = self._active[last]
                self.cache.move_row(last, slot, moved.length)
                self._active[slot] = moved
            self._active.pop()
