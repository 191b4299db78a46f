"""Training throughput of one GRPO update: turnrl's `Trainer.update` vs TRL's `GRPOTrainer`, same model and batch.

The batch is one RL step's worth of completions, fixed once so that both sides do the same work:
- SmolLM2-135M-Instruct in fp32 (`turnrl.models`), `--threads` torch threads (2) on both sides.
- `--batch` completions (16): `--batch / --group` chat prompts (system prompt + a question through the chat
  template, 42-46 tokens) × `--group` (4) completions each.
- Completion token ids are random non-special tokens (seeded): the cost does not depend on which tokens they are,
  and sampling them from the model would add minutes to every run. Lengths are shaped like RL: three of every
  four completions end with EOS (<|im_end|>) at a length uniform in [--min-completion, --max-completion], the
  fourth is truncated at --max-completion without EOS.
- Fixed rewards (a 1/0 pattern that leaves no group constant) and turnrl's GRPO advantages (group mean/std),
  computed once and handed to both sides unchanged.
- The same loss: PPO-clip with eps 0.2, averaged over all completion tokens of the batch (turnrl
  `loss_agg=token_mean`, TRL's default `loss_type="dapo"`), one epoch and one mini-batch (ratio = 1: the "old"
  logprobs are the current ones, detached), no KL term, no importance-sampling correction (TRL has none
  without vLLM, so turnrl's `is_mode` is "none"), temperature 1.
- One AdamW step: lr 1e-6, betas (0.9, 0.999), eps 1e-8, no weight decay, grad-norm clip 1.0, each side's own
  default AdamW implementation (both fused).
Both sides' first update starts from the same pretrained weights; the script checks that it gives both the same
loss and gradient norm (it does, to 5 digits), i.e. that they compute the same update.

What is timed (wall clock):
- turnrl: the whole call `Trainer.update(samples)`: packing, forward, loss, backward, grad clip, AdamW step,
  LR scheduler step, metrics.
- TRL: one optimizer step of TRL's own training loop (`GRPOTrainer.train()`), from its `on_step_begin` callback
  to `on_step_end`: `_prepare_inputs`, where generation is replaced by returning the fixed batch as the dict
  `_generate_and_score_completions` returns (prompt and completion ids and masks, advantages,
  num_items_in_batch; no old logprobs, which TRL leaves out itself when num_iterations = 1); `compute_loss`
  (the padded batch through the model and TRL's chunked LM head, entropy included, and the "dapo" loss);
  backward; grad-norm clip; AdamW step; scheduler step; zero_grad. All TRL defaults except what this CPU needs
  (`use_cpu=True, bf16=False`: bf16 is ~11x slower here). TRL's default turns gradient checkpointing on; it
  is also timed with it off.

The machine is shared, so the implementations are interleaved: a GEMM probe and one update of each turnrl
variant run inside TRL's `on_step_begin` callback, just before TRL's timer starts, so that each round times
every implementation once under similar conditions. The first round of each TRL run is a warm-up for all and
is dropped. Each timing also records the share of the machine's CPUs that other processes used meanwhile
(from /proc/stat; Linux only). Contention from outside the VM does not show there, only in the GEMM probes
(which range from ~150 to ~370 GFLOP/s on the 2-core development VM). Rows show the median and the best of the
timed rounds.

FLOPs, for forward + backward, are 6 per parameter per token (attention scores, ~1.5% at these lengths, and
the recomputation of gradient checkpointing are not counted):
- run: 6 · N_params · the tokens each side runs through the model: TRL's padded B × (longest prompt + longest
  completion); turnrl's real tokens, packed without padding. For turnrl this overcounts: it runs the LM head
  only at positions that predict a completion token.
- useful, the same for both: 6 · N_body · real tokens + 6 · N_head · completion tokens, with N_head = vocab ×
  hidden (the LM head, tied to the embedding) and N_body = N_params - N_head: the work the update needs.
MFU = FLOPs / wall time / GEMM peak, the peak probed before every round as the best of 3 fp32 2048×2048
matmuls at the same thread count: median wall against the median probe, best wall against the best probe.

    python bench/train.py --repeats 3 --batch 16 --max-completion 128
    python bench/train.py --before       # also turnrl with the speedups of the "GRPO trainer" issue reverted
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from turnrl.build import build_learner
from turnrl.config import TrainConfig
from turnrl.models import load_model, load_tokenizer
from turnrl.train import algos
from turnrl.train.loop import Trainer
from turnrl.train.samples import TrainSample

MODEL = "smollm2-135m-instruct"
LR = 1e-6
QUESTIONS = [
    "What is 17 times 23? Show your work.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me a short recipe for pancakes.",
    "Name a famous painting by Vincent van Gogh.",
    "Suggest a name for a pet turtle.",
]


def question(k: int) -> str:
    return QUESTIONS[k % len(QUESTIONS)]


@dataclass
class Batch:
    """The fixed completions, in groups of `--group` consecutive ones sharing a prompt."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    advantages: list[float]

    @property
    def real_tokens(self) -> int:
        return sum(len(p) + len(c) for p, c in zip(self.prompt_ids, self.completion_ids, strict=True))

    @property
    def completion_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)

    @property
    def padded_tokens(self) -> int:
        """What a padded batch holds: B × (longest prompt + longest completion)."""
        longest = max(map(len, self.prompt_ids)) + max(map(len, self.completion_ids))
        return len(self.prompt_ids) * longest


def fixed_batch(tokenizer, n: int, group: int, min_len: int, max_len: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    special = set(tokenizer.all_special_ids)
    vocab = torch.tensor([t for t in range(len(tokenizer)) if t not in special])
    prompts, completions, rewards = [], [], []
    for i in range(n):
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": question(i // group)}],
                                                     add_generation_prompt=True, return_dict=False))
        truncated = i % 4 == 3
        length = max_len if truncated else int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = vocab[torch.randint(len(vocab), (length,), generator=g)].tolist()
        if not truncated:
            ids[-1] = eos
        completions.append(ids)
        rewards.append(float((i + i // group) % 2))  # alternating within each group: never constant
    groups = torch.arange(n) // group
    advantages = algos.grpo_advantages(torch.tensor(rewards), groups).tolist()
    return Batch(prompts, completions, advantages)


def gemm_peak_gflops(n: int = 2048, reps: int = 3) -> float:
    """Best of `reps` fp32 n×n matmuls, in GFLOP/s (2n³ FLOPs each)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


@dataclass
class Timing:
    wall_s: float
    others: float  # share of the machine's CPUs other processes used meanwhile (nan where /proc/stat is missing)


class Stopwatch:
    """Wall time of a span, and how much of the machine other processes took during it."""

    def start(self) -> None:
        self.t0, self.cpu0 = time.perf_counter(), _cpu_seconds()

    def stop(self) -> Timing:
        wall = time.perf_counter() - self.t0
        (busy0, own0), (busy, own) = self.cpu0, _cpu_seconds()
        if math.isnan(busy):
            return Timing(wall, math.nan)
        return Timing(wall, max(0.0, (busy - busy0) - (own - own0)) / (wall * (os.cpu_count() or 1)))


def _cpu_seconds() -> tuple[float, float]:
    """(CPU seconds all processes have used, this process's), busy = user + nice + system + irq + softirq + steal."""
    own = sum(os.times()[:2])
    try:
        with open("/proc/stat") as f:
            jiffies = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return math.nan, own
    user, nice, system, _idle, _iowait, irq, softirq, steal = jiffies
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), own


# ---- turnrl --------------------------------------------------------------------------------------------
class TurnrlUpdate:
    """A turnrl Trainer with no engine or rollouts; each call times one `Trainer.update` on the fixed batch."""

    def __init__(self, batch: Batch, out_dir: Path, legacy: bool = False):
        cfg = TrainConfig(model=MODEL, train_data="unused", output_dir=str(out_dir),
                          algo={"is_mode": "none", "loss_agg": "token_mean", "clip_low": 0.2, "clip_high": 0.2},
                          optim={"lr": LR, "grad_clip": 1.0, "weight_decay": 0.0})
        self.trainer = Trainer(cfg, build_learner(cfg, load_model(MODEL)), engine=None, rollout=None, train_rows=[{}],
                               eval_rows=[])
        if legacy:
            use_legacy_update(self.trainer)
        self.samples = [TrainSample(p, c, [1] * len(c), None, a)
                        for p, c, a in zip(batch.prompt_ids, batch.completion_ids, batch.advantages, strict=True)]
        self.first_metrics: dict[str, float] | None = None  # of the first update, from the pretrained weights

    def __call__(self) -> Timing:
        watch = Stopwatch()
        watch.start()
        metrics = self.trainer.update(self.samples)
        timing = watch.stop()
        self.first_metrics = self.first_metrics or metrics
        return timing


def _legacy_varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """turnrl.train.packing's attention before the "GRPO trainer" issue: a slice per sequence, KV heads repeated per
    slice. Kept only so that `--before` can time the old code in the same process."""
    cu_seqlens: list[int] = kwargs["turnrl_cu_seqlens"]
    groups = query.shape[1] // key.shape[1]
    outputs = []
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        k, v = key[:, :, a:b], value[:, :, a:b]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        outputs.append(F.scaled_dot_product_attention(query[:, :, a:b], k, v, is_causal=True, scale=scaling))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def use_legacy_update(trainer: Trainer) -> None:
    """Revert the issue's speedups on one trainer: the sliced attention loop and the unfused (for-loop) AdamW."""
    from transformers import AttentionInterface

    AttentionInterface.register("turnrl_varlen_legacy", _legacy_varlen_attention)
    learner = trainer.learner
    learner.policy.config._attn_implementation_internal = "turnrl_varlen_legacy"
    o = trainer.cfg.optim
    learner.optimizer = torch.optim.AdamW(learner.policy.parameters(), lr=o.lr, betas=o.betas,
                                          weight_decay=o.weight_decay)
    learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda k: 1.0)


# ---- TRL -----------------------------------------------------------------------------------------------
def trl_inputs(batch: Batch, pad_id: int) -> dict[str, torch.Tensor]:
    """The dict `GRPOTrainer._generate_and_score_completions` returns for this batch (no vLLM, no KL, one
    iteration: TRL then leaves out old/ref/sampling logprobs)."""
    from trl.trainer.utils import pad

    prompts = [torch.tensor(p) for p in batch.prompt_ids]
    completions = [torch.tensor(c) for c in batch.completion_ids]
    completion_mask = pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right")
    return {
        "prompt_ids": pad(prompts, padding_value=pad_id, padding_side="left"),
        "prompt_mask": pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"),
        "completion_ids": pad(completions, padding_value=pad_id, padding_side="right"),
        "completion_mask": completion_mask,
        "advantages": torch.tensor(batch.advantages, dtype=torch.float32),
        "num_items_in_batch": completion_mask.sum(),
    }


def run_trl(batch: Batch, tokenizer, args, gradient_checkpointing: bool, out_dir: Path,
            between: Callable[[], None]) -> tuple[list[Timing], dict[str, float]]:
    """Train `repeats + 1` TRL steps on the fixed batch; returns each step's wall time and the first step's logs
    (loss, grad_norm). `between()` runs before every step, outside the timed window."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    # transformers 5.24 renamed gradient_checkpointing (still accepted, with a FutureWarning)
    ckpt = "activation_checkpointing" if hasattr(GRPOConfig, "activation_checkpointing") else "gradient_checkpointing"

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.watch, self.times = Stopwatch(), []
            self.logs: list[dict[str, float]] = []  # one per step (logging_steps=1), logged after on_step_end

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            on = getattr(model, f"is_{ckpt}")
            if on != gradient_checkpointing:
                raise RuntimeError(f"TRL's model has {ckpt} {on}, expected {gradient_checkpointing}")
            between()
            self.watch.start()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(self.watch.stop())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                self.logs.append(logs)

    config = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=False, fp16=False, **{ckpt: gradient_checkpointing},
        per_device_train_batch_size=len(batch.completion_ids), num_generations=args.group,
        max_completion_length=args.max_completion, learning_rate=LR, max_steps=args.repeats + 1,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
    )
    same_loss = (config.loss_type == "dapo" and config.beta == 0.0 and config.epsilon == 0.2
                 and config.epsilon_high in (None, 0.2) and config.num_iterations == 1 and config.temperature == 1.0
                 and config.max_grad_norm == 1.0 and config.weight_decay == 0.0 and "adamw" in str(config.optim).lower())
    if not same_loss:
        raise SystemExit("TRL's GRPOConfig defaults changed; this benchmark compares against the dapo loss, beta 0, "
                         "epsilon 0.2, one iteration, temperature 1, grad clip 1.0 and AdamW without weight decay")
    prompts = Dataset.from_dict({"prompt": [question(k) for k in range(len(batch.completion_ids) // args.group)]})
    timer = StepTimer()
    trainer = GRPOTrainer(model=load_model(MODEL), reward_funcs=_never_called_reward, args=config,
                          train_dataset=prompts, processing_class=tokenizer, callbacks=[timer])
    inputs = trl_inputs(batch, tokenizer.pad_token_id)
    trainer._generate_and_score_completions = lambda rows: dict(inputs)  # generation → the fixed batch
    trainer.remove_callback(PrinterCallback)  # the per-step log lines
    trainer.train()
    if len(timer.times) != args.repeats + 1:
        raise RuntimeError(f"expected {args.repeats + 1} TRL steps, timed {len(timer.times)}")
    return timer.times, timer.logs[0]


def _never_called_reward(prompts, completions, **kwargs) -> list[float]:
    raise AssertionError("generation is replaced by the fixed batch; rewards are never scored")


# ---- report --------------------------------------------------------------------------------------------
@dataclass
class Model:
    params: int
    head: int  # vocab × hidden: the LM head's matmul (tied to the embedding)

    @property
    def body(self) -> int:
        return self.params - self.head


def model_sizes() -> Model:
    model = load_model(MODEL)
    params = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    return Model(params, model.config.vocab_size * model.config.hidden_size)


class Rounds:
    """Called before each TRL step (outside its timed window): a GEMM probe, then one update of every turnrl
    variant, in alternating order. The first step of each TRL run is a warm-up round for all, not recorded."""

    def __init__(self, updates: dict[str, Callable[[], Timing]], threads: int, console: Console):
        self.updates, self.threads, self.console = updates, threads, console
        self.timings: dict[str, dict[int, Timing]] = {name: {} for name in updates}  # name → round → timing
        self.peaks: list[float] = []
        self.round, self.step_in_run = 0, 0

    def new_run(self) -> None:
        self.step_in_run = 0

    def __call__(self) -> None:
        self.round += 1
        self.step_in_run += 1
        if torch.get_num_threads() != self.threads:
            raise RuntimeError(f"the thread count changed to {torch.get_num_threads()} (expected {self.threads})")
        self.peaks.append(gemm_peak_gflops())
        names = list(self.updates)[:: 1 if self.round % 2 else -1]
        for name in names:
            self.record(name, self.round, self.updates[name](), warm_up=self.step_in_run == 1)

    def record(self, name: str, round_no: int, timing: Timing, warm_up: bool) -> None:
        self.console.print(f"  round {round_no}: {name} {timing.wall_s:.2f} s, other processes "
                           f"{timing.others:.0%} of the CPUs" + (" (warm-up)" if warm_up else ""))
        if not warm_up:
            self.timings.setdefault(name, {})[round_no] = timing

    def add_trl(self, name: str, step_timings: list[Timing]) -> None:
        first = self.round - len(step_timings) + 1
        for k, timing in enumerate(step_timings):
            self.record(name, first + k, timing, warm_up=k == 0)


def report(console: Console, batch: Batch, sizes: Model, rounds: Rounds) -> None:
    useful = 6 * sizes.body * batch.real_tokens + 6 * sizes.head * batch.completion_tokens
    peak_median, peak_best = statistics.median(rounds.peaks), max(rounds.peaks)
    table = Table(title=f"One GRPO update, {MODEL} fp32, {torch.get_num_threads()} threads: "
                        f"{len(batch.completion_ids)} completions, {batch.real_tokens:,} tokens "
                        f"({batch.completion_tokens:,} completion)")
    for col in ("implementation", "tokens run", "wall s: median", "best-worst (n)", "tokens/s: median", "best",
                "MFU useful: median", "best", "MFU run: median", "others' CPU", "turnrl speedup: median",
                "best", "per round"):
        table.add_column(col, justify="left" if col == "implementation" else "right")
    turnrl = rounds.timings["turnrl"]
    for name, by_round in rounds.timings.items():
        walls = [t.wall_s for t in by_round.values()]
        wall, best = statistics.median(walls), min(walls)
        tokens_run = batch.padded_tokens if name.startswith("TRL") else batch.real_tokens
        speedup = ["", "", ""]
        if name != "turnrl":
            turnrl_walls = [t.wall_s for t in turnrl.values()]
            per_round = [t.wall_s / turnrl[r].wall_s for r, t in by_round.items() if r in turnrl]
            speedup = [f"{wall / statistics.median(turnrl_walls):.2f}x", f"{best / min(turnrl_walls):.2f}x",
                       f"{min(per_round):.2f}-{max(per_round):.2f}x"]
        table.add_row(name, f"{tokens_run:,}", f"{wall:.2f}", f"{best:.2f}-{max(walls):.2f} ({len(walls)})",
                      f"{batch.real_tokens / wall:,.0f}", f"{batch.real_tokens / best:,.0f}",
                      f"{useful / wall / 1e9 / peak_median:.0%}", f"{useful / best / 1e9 / peak_best:.0%}",
                      f"{6 * sizes.params * tokens_run / wall / 1e9 / peak_median:.0%}",
                      f"{statistics.median(t.others for t in by_round.values()):.0%}", *speedup)
    console.print(table)
    console.print(
        f"GEMM peak (best of 3 fp32 2048x2048 matmuls, probed before each round): median {peak_median:.0f}, best "
        f"{peak_best:.0f}, worst {min(rounds.peaks):.0f} GFLOP/s (n={len(rounds.peaks)}).\n"
        f"tokens run: TRL pads to {len(batch.completion_ids)} x (longest prompt + longest completion) = "
        f"{batch.padded_tokens:,} ({1 - batch.real_tokens / batch.padded_tokens:.0%} padding); turnrl packs the "
        f"{batch.real_tokens:,} real tokens.\n"
        f"MFU useful = (6 N_body {batch.real_tokens:,} + 6 N_head {batch.completion_tokens:,}) = "
        f"{useful / 1e12:.2f} TFLOP / wall / peak, N_head = vocab x hidden = {sizes.head / 1e6:.1f}M of N_params "
        f"{sizes.params / 1e6:.1f}M; MFU run = 6 N_params tokens_run / wall / peak. Medians use the median peak, "
        "bests the best peak.\n"
        "speedup = TRL wall / turnrl wall: of the medians, of the bests, and per round (each step against the turnrl "
        "update of the same round). others' CPU: the median share of the machine that other processes used "
        "during this row's timings; high values mean the timings are inflated by the shared machine.")


def check_same_update(console: Console, turnrl: dict[str, float], trl: dict[str, float]) -> None:
    """Both sides' first update starts from the same pretrained weights, so the same batch and loss must give the
    same loss value and gradient norm (up to fp32 summation order)."""
    pairs = {"loss": (turnrl["train/loss"], trl["loss"]), "grad norm": (turnrl["train/grad_norm"], trl["grad_norm"])}
    text = ", ".join(f"{k} turnrl {a:.5g} vs TRL {b:.5g}" for k, (a, b) in pairs.items())
    same = all(abs(a - b) <= 1e-3 * max(abs(a), abs(b), 1e-6) + 1e-6 for a, b in pairs.values())
    console.print(f"  first update from the pretrained weights: {text}: "
                  + ("[green]same[/]" if same else "[bold red]DIFFERENT: not the same update[/]"))


def time_all(args, batch: Batch, tokenizer, out: Path, console: Console) -> Rounds:
    """Every implementation on the batch, interleaved: one TRL run per gradient-checkpointing setting."""
    turnrl = TurnrlUpdate(batch, out / "turnrl")
    updates: dict[str, Callable[[], Timing]] = {"turnrl": turnrl}
    if args.before:
        updates["turnrl (before)"] = TurnrlUpdate(batch, out / "turnrl-before", legacy=True)
    rounds = Rounds(updates, args.threads, console)
    for gc in {"both": (True, False), "on": (True,), "off": (False,)}[args.trl_gc]:
        name = f"TRL (grad. ckpt {'on, default' if gc else 'off'})"
        console.print(f"[bold]{name}[/], turnrl interleaved (the first round of each TRL run is a warm-up)")
        rounds.new_run()
        step_times, first_logs = run_trl(batch, tokenizer, args, gc, out / f"trl-{gc}", rounds)
        rounds.add_trl(name, step_times)
        check_same_update(console, turnrl.first_metrics, first_logs)
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per implementation after a warm-up")
    parser.add_argument("--batch", type=int, default=16, help="completions in the batch")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--min-completion", type=int, default=32)
    parser.add_argument("--max-completion", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--before", action="store_true",
                        help="also time turnrl with the speedups of the GRPO-trainer issue reverted")
    parser.add_argument("--trl-gc", choices=["both", "on", "off"], default="both",
                        help="TRL's gradient checkpointing: its default (on), off, or both")
    args = parser.parse_args()
    if args.group < 2 or args.batch % args.group:
        parser.error(f"--batch ({args.batch}) must be a multiple of --group ({args.group}), and --group >= 2")
    torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 190)

    tokenizer = load_tokenizer(MODEL)
    batch = fixed_batch(tokenizer, args.batch, args.group, args.min_completion, args.max_completion, args.seed)
    with tempfile.TemporaryDirectory(prefix="turnrl-bench-train-") as tmp:  # trainer outputs, unused
        rounds = time_all(args, batch, tokenizer, Path(tmp), console)
    report(console, batch, model_sizes(), rounds)


if __name__ == "__main__":
    main()
