"""Multi-turn SFT on exactly the tokens and masks RL trains on (`turnrl sft CONFIG [key=value ...]`).

Two kinds of rows, one file may mix them:
- chat-message rows (`messages`: system, user, assistant, tool... with `tool_calls`, tool results and images):
  each conversation is *replayed through the RL turn loop*. A `ReplayEngine` answers each model turn with the
  row's next assistant message, a `ReplayEnv` answers each reply with the row's next user or tool messages, and
  `rollout.drive` builds the trajectory as it builds every RL trajectory: the prompt rendered by the policy's
  renderer (tool schemas included), the model's tokens with mask 1 ending with the token the model stops on,
  the template's closing and each observation delta with mask 0, images in both stores with their parity
  checks, and the same sanity check against a full re-render. An SFT sample is therefore token for token the
  trajectory RL would record had the model said those words: there is no second tokenisation scheme.
- trajectory JSONL (`turnrl rollout --out`, `turnrl train`'s trajectories): trained on as recorded, the tokens
  the policy sampled with their loss masks (trajectories with images are replayed from their messages, since
  the JSONL keeps image references, not pixel tensors). FAILED and ABORTED trajectories are never trained on.
  `--filter 'reward>=1'` keeps the successful ones: rejection-sampling fine-tuning.

The update is RL's: `SFTTrainer` runs the same `Learner` (turnrl.train.learner) with `masked_nll` as its loss in
place of the policy loss: packed rows, loss only where the mask is 1, the same process group and FSDP2 path at
any world size, the same checkpoints, and evaluation through the rollout on held-out RL rows
(turnrl.train.evaluation). Each run writes its own directory, as `turnrl train` does (turnrl.train.runs); its last
checkpoint's `model/` directory, linked as RUN/model and as `output_dir/model`, is what `turnrl train` takes as
its `model`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import operator
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console

from turnrl.config import SFTConfig
from turnrl.data import DataError, conversation_messages, read_rows, resolve_image_paths
from turnrl.observe.tracing import TrajectoryTracer
from turnrl.render import ChatRenderer, RenderError, SanityMode
from turnrl.rollout.episode import RolloutContext, RolloutLimits, drive
from turnrl.train.checkpoint import resume_checkpoint, save_checkpoint
from turnrl.train.evaluation import Evaluator, format_step_line, packing_text, write_metrics
from turnrl.train.learner import Learner, MicroBatch
from turnrl.train.runs import replace_link
from turnrl.train.samples import PromptSampler, TrainSample, to_sample
from turnrl.types import (
    FinishReason,
    GenerateOutput,
    Message,
    RolloutStatus,
    SamplingParams,
    StepResult,
    Trajectory,
)

log = logging.getLogger(__name__)

TRAINABLE = (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED)


# ---- --filter ------------------------------------------------------------------------------------
_OPS: dict[str, Callable[[Any, Any], bool]] = {">=": operator.ge, "<=": operator.le, "==": operator.eq,
                                               "!=": operator.ne, ">": operator.gt, "<": operator.lt}
_CLAUSE = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(>=|<=|==|!=|>|<)\s*(\S.*?)\s*$")


def parse_filter(expr: str) -> Callable[[dict[str, Any]], bool]:
    """`reward>=1`, `status==completed and num_turns<=2`, `sample.level>1`: a predicate over a row (a
    trajectory's JSON or a data row). A number compares numerically; a word (quotes optional) only with == or !=.
    A row without the field, or with a null or non-number where a number is compared, fails the clause."""
    clauses = []
    for part in re.split(r"\s+and\s+", expr.strip()):
        match = _CLAUSE.match(part)
        if match is None:
            raise ValueError(f"--filter {expr!r}: cannot read {part!r}; expected FIELD OP VALUE with OP one of "
                             f"{' '.join(_OPS)} (e.g. reward>=1), clauses joined by 'and'")
        field, op, raw = match.groups()
        value: Any = _number(raw)
        if value is None:
            value = raw.strip("'\"")
            if op not in ("==", "!="):
                raise ValueError(f"--filter {expr!r}: {field}{op}{raw} compares a word; only == and != do")
        clauses.append((field, op, value))

    def keep(row: dict[str, Any]) -> bool:
        for field, op, value in clauses:
            have = field_value(row, field)
            if isinstance(value, float):
                if isinstance(have, bool) or not isinstance(have, int | float) or not _OPS[op](float(have), value):
                    return False
            elif have is None or not _OPS[op](str(have), value):
                return False
        return True

    keep.fields = [c[0] for c in clauses]  # type: ignore[attr-defined]
    return keep


def _number(raw: str) -> float | None:
    try:
        return float(raw)
    except ValueError:
        return None


def field_value(row: dict[str, Any], dotted: str) -> Any:
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def filter_rows(rows: list[dict[str, Any]], expr: str | None, where: str) -> list[dict[str, Any]]:
    """The rows that pass `expr`; a field no row has is a typo, not an empty result."""
    if not expr:
        return rows
    keep = parse_filter(expr)
    for f in keep.fields:  # type: ignore[attr-defined]
        if all(field_value(r, f) is None for r in rows):
            raise DataError(f"{where}: --filter field {f!r} is in no row (fields of the first row: {sorted(rows[0])})")
    kept = [r for r in rows if keep(r)]
    if not kept:
        raise DataError(f"{where}: no row passes --filter {expr!r} (of {len(rows)})")
    return kept


# ---- replaying a conversation through the turn loop ------------------------------------------------
class ReplayEngine:
    """An engine that 'samples' the row's assistant messages, in order, one per model turn of a trajectory."""

    def __init__(self, renderer: ChatRenderer):
        self.renderer = renderer
        self.turns: dict[str, list[tuple[list[Message], Message, list[dict] | None]]] = {}
        """Per trajectory id: (history before the reply, the assistant message, tools) of each model turn."""
        self.end_id = _end_token(renderer)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str,
                       images: list | None = None) -> GenerateOutput:
        history, message, tools = self.turns[request_id].pop(0)
        text = reply_text(self.renderer, history, message, tools)
        prefill = self.renderer.prefill_of(prompt_ids)  # the template opened the turn: the model goes on after it
        if prefill and text.startswith(prefill):
            text = text[len(prefill):]
        ids = self.renderer.encode(text) + [self.end_id]
        return GenerateOutput(ids, [0.0] * len(ids), FinishReason.STOP)

    async def release(self, request_id: str) -> None:
        self.turns.pop(request_id, None)

    async def update_weights(self, named_tensors: Any, version: int | None = None, *, final: bool = True) -> int:
        raise NotImplementedError("the replay engine has no weights")

    async def sleep(self) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    def close(self) -> None:
        return None


def _end_token(renderer: ChatRenderer) -> int:
    """The token a model stops its turn on: the first of the template's closing when it is a stop token
    (`<|im_end|>`), else the tokenizer's eos."""
    closing = renderer.closing_ids
    if closing and closing[0] in renderer.end_of_turn_ids:
        return closing[0]
    eos = renderer.tokenizer.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


def reply_text(renderer: ChatRenderer, history: list[Message], message: Message, tools: list[dict] | None) -> str:
    """What the model writes for `message`: its content; for structured `tool_calls` (or content parts) the text
    the chat template renders for the turn, between the generation prompt and the turn's closing."""
    content = message.get("content")
    if isinstance(content, str) and not message.get("tool_calls"):
        return content
    before = renderer.render_text(history, tools, add_generation_prompt=True)
    after = renderer.render_text([*history, message], tools, add_generation_prompt=False)
    if not after.startswith(before):
        raise RenderError(f"{renderer.template_name} renders the conversation before this assistant turn "
                          "differently once the turn follows; cannot cut the reply out of the render")
    reply = after[len(before):]
    profile = renderer.profiles[bool(tools)]
    for tail in (profile.trailer, profile.tool_closing, profile.closing):
        if tail and reply.endswith(tail):
            reply = reply[: len(reply) - len(tail)]
    return reply


class ReplayEnv:
    """Answers model turn k with the messages that follow assistant message k in the row; done after the last."""

    def __init__(self, observations: list[list[Message]], tools: list[dict] | None):
        self.observations, self.tools, self.turn = observations, tools, 0

    async def step(self, text: str) -> StepResult:
        self.turn += 1
        if self.turn > len(self.observations):
            return StepResult(done=True)
        return StepResult(observation=self.observations[self.turn - 1])


def split_turns(messages: list[Message], where: str) -> tuple[list[Message], list[Message], list[list[Message]]]:
    """(prompt, assistant messages, the messages between consecutive assistant messages). Messages after the
    last assistant message are dropped: nothing follows them to train on."""
    at = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not at or at[0] == 0:
        raise DataError(f"{where}: a conversation needs prompt messages, then at least one assistant message")
    between = [messages[a + 1 : b] for a, b in zip(at, at[1:], strict=False)]
    if any(not b for b in between):
        raise DataError(f"{where}: two assistant messages in a row; each model turn but the last must be "
                        "followed by a user or tool message (merge them into one reply)")
    return messages[: at[0]], [messages[k] for k in at], between


async def record_conversation(messages: list[Message], row: dict[str, Any], index: int, engine: ReplayEngine,
                 tools: list[dict] | None, sanity: SanityMode | str, where: str) -> Trajectory:
    """The trajectory RL would record for this conversation (module docstring)."""
    prompt, replies, between = split_turns(messages, where)
    trajectory_id = f"sft-{row.get('id', index)}"
    history: list[Message] = list(prompt)
    engine.turns[trajectory_id] = []
    for k, reply in enumerate(replies):
        engine.turns[trajectory_id].append((list(history), reply, tools))
        history += [reply, *(between[k] if k < len(between) else [])]
    ctx = RolloutContext(engine=engine, renderer=engine.renderer,
                         sampling=SamplingParams(temperature=0.0),
                         limits=RolloutLimits(max_turns=len(replies), max_new_tokens=1 << 30, env_timeout_s=None),
                         trajectory_id=trajectory_id, group_id=trajectory_id, sample_index=0, sample=row,
                         agent_name="sft", sanity_mode=SanityMode(sanity))
    return await drive(ctx, ReplayEnv(between, tools), prompt)


def row_tools(row: dict[str, Any], toolset: Any) -> list[dict] | None:
    """The tool schemas rendered into a row's prompt: its own `tools` column, else the tool agent's (the subset
    its `tool_selection` names), as an RL rollout renders them."""
    if row.get("tools"):
        return row["tools"]
    if toolset is None:
        return None
    from turnrl.data import row_tool_selection

    selection = row_tool_selection(row.get("sample", row))
    return (toolset.subset(selection) if selection else toolset).schemas


async def sft_trajectories(rows: list[dict[str, Any]], renderer: ChatRenderer, *, toolset: Any = None,
                           sanity: SanityMode | str = SanityMode.STRICT, where: str = "sft data"
                           ) -> tuple[list[Trajectory], Counter]:
    """The trajectories to train on, and a count of what was left out and why (a bad row fails alone)."""
    engine = ReplayEngine(renderer)
    kept: list[Trajectory] = []
    skipped: Counter = Counter()
    for i, row in enumerate(rows):
        here = f"{where} row {i + 1}"
        try:
            traj = await _row_trajectory(row, i, engine, toolset, sanity, here)
        except (DataError, RenderError, ValueError, KeyError) as e:
            log.warning("%s: skipped: %s", here, e)
            skipped[f"bad row: {type(e).__name__}"] += 1
            continue
        if traj.status not in TRAINABLE or not any(traj.loss_mask):
            skipped[f"status {traj.status}" if traj.status not in TRAINABLE else "no trained tokens"] += 1
            if traj.error:
                log.warning("%s: skipped (%s): %s", here, traj.status, traj.error)
            continue
        kept.append(traj)
    return kept, skipped


async def _row_trajectory(row: dict[str, Any], i: int, engine: ReplayEngine, toolset: Any,
                          sanity: SanityMode | str, where: str) -> Trajectory:
    if "response_ids" in row:  # a recorded trajectory
        traj = Trajectory.from_json(row)
        if not traj.images or traj.status not in TRAINABLE:
            return traj
        messages = [dict(m) for m in traj.messages]  # images: pixels from the refs its messages hold
        replayed = await record_conversation(messages, traj.sample, i, engine, row_tools(traj.sample, toolset), sanity, where)
        replayed.reward = traj.reward
        return replayed
    return await record_conversation(conversation_messages(row, where), row, i, engine, row_tools(row, toolset), sanity, where)


def load_sft_samples(path: str | Path, renderer: ChatRenderer, *, filter_expr: str | None = None,
                     toolset: Any = None, sanity: SanityMode | str = SanityMode.STRICT,
                     max_tokens: int | None = None) -> tuple[list[TrainSample], dict[str, Any]]:
    """Training samples of an SFT data file, and a report (rows, filtered, skipped with reasons, tokens)."""
    path = Path(path)
    rows = read_rows(path)
    for row in rows:
        if "messages" in row and "response_ids" not in row:
            resolve_image_paths(row, path.parent)
    kept = filter_rows(rows, filter_expr, str(path))
    trajs, skipped = asyncio.run(sft_trajectories(kept, renderer, toolset=toolset, sanity=sanity, where=str(path)))
    # SFT's NLL is under the full softmax, through the policy's own routing: what a sampler recorded does not enter
    samples = [dataclasses.replace(to_sample(t, 1.0), kept_counts=None, routed_experts=None) for t in trajs]
    if max_tokens is not None:
        long = sum(len(s.prompt_ids) + len(s.response_ids) > max_tokens for s in samples)
        samples = [s for s in samples if len(s.prompt_ids) + len(s.response_ids) <= max_tokens]
        if long:
            skipped[f"longer than sft.max_tokens={max_tokens}"] += long
    if not samples:
        raise DataError(f"{path}: no trainable sample ({len(rows)} rows, {len(rows) - len(kept)} filtered out, "
                        f"skipped: {dict(skipped) or 'none'})")
    report = {"rows": len(rows), "filtered_out": len(rows) - len(kept), "skipped": dict(skipped),
              "samples": len(samples), "trained_tokens": sum(sum(s.loss_mask) for s in samples),
              "tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in samples),
              "render_mismatch": sum(t.metrics.get("render_mismatch", 0.0) for t in trajs)}
    return samples, report


# ---- the loop ----------------------------------------------------------------------------------------
def masked_nll(batch: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """SFT's loss: the negative log-likelihood of each trained (mask 1) token, at temperature 1; the learner
    aggregates it as `algo.loss_agg` says (token_mean: over every trained token of the batch, on all ranks)."""
    trained_logp = batch.logp_B_T.detach()[batch.mask_B_T.bool()]
    return -batch.logp_B_T, {"train/nll": float(-trained_logp.mean())}


class SFTTrainer:
    """Supervised fine-tuning over fixed samples: the `Learner` RL trains (packing, token-balanced ranks, FSDP2,
    the checkpoints, resume, weight sync) with `masked_nll` as its loss, and evaluation through the rollout on
    held-out RL rows before, every `eval_every` steps and after (the engine gets the weights first)."""

    def __init__(self, cfg: SFTConfig, learner: Learner, engine: Any, rollout: Any, samples: list[TrainSample],
                 eval_rows: list[dict], renderer: ChatRenderer, console: Console | None = None,
                 tracer: TrajectoryTracer | None = None, report: dict[str, Any] | None = None):
        self.cfg, self.learner, self.engine, self.parallel = cfg, learner, engine, learner.parallel
        self.samples, self.eval_rows, self.renderer = samples, eval_rows, renderer
        self.report = report or {}
        """What load_sft_samples found: rows, filtered out, skipped with reasons, tokens."""
        self.console = console or Console()
        self.out = Path(cfg.run_dir or cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.tracer = tracer if tracer is not None else TrajectoryTracer(None)
        self.sampler = PromptSampler(len(samples), min(cfg.sft.batch_size, len(samples)), cfg.seed, cfg.shuffle)
        self.steps = sft_steps(cfg, len(samples))
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.evaluator = Evaluator(rollout, eval_rows, out=self.out, tracer=self.tracer, console=self.console,
                                   greedy_n=cfg.eval_n, sampled_n=cfg.eval_sampled_n,
                                   max_new_tokens=cfg.rollout.max_new_tokens)

    async def train(self) -> list[dict[str, Any]]:
        self.tracer.log_params(self.cfg.model_dump())
        if self.parallel.is_main:  # the resolved config, every key: what this run is (and marks its directory)
            (self.out / "config.yaml").write_text(yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False))
        if self.cfg.resume:
            self.load_checkpoint()
            if self.eval_rows:
                await self.sync_weights()
        if self.step == 0:
            await self._evaluate("before")
        while self.step < self.steps:
            self.step += 1
            self._log(self.sft_step())
            if self.eval_rows and self.cfg.eval_every and self.step % self.cfg.eval_every == 0 and (
                    self.step < self.steps):
                await self.sync_weights()
                await self._evaluate(f"step{self.step}")
            if self.cfg.save_every and self.step % self.cfg.save_every == 0:
                self.save_checkpoint()
        if self.eval_rows:  # every rank has the rows: every rank takes part in the weight gathers
            await self.sync_weights()
            await self._evaluate("after")
        self.save_checkpoint()
        return self.history

    def sft_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = [self.samples[i] for i in self.sampler.next_batch()]
        metrics = self.update(batch)
        return {"step": float(self.step), **metrics, "sft/sequences": float(len(batch)),
                "sft/epoch": self.sampler.epoch + self.sampler.position / max(len(self.samples), 1),
                "train/lr": float(self.learner.scheduler.get_last_lr()[0]), "time/step_s": time.perf_counter() - t0}

    def update(self, samples: list[TrainSample]) -> dict[str, float]:
        """One SFT update on `samples` (every rank passes the same list): the learner's, with `masked_nll`."""
        return self.learner.update(samples, masked_nll, step=self.step)

    async def sync_weights(self) -> dict[str, float]:
        """The evaluation engine gets the policy's weights (every rank takes part in the gathers)."""
        return await self.learner.sync_weights(self.engine, version=self.step)

    async def _evaluate(self, tag: str) -> None:
        """Evaluation runs where the rollout is, on rank 0; the other ranks wait for it in their next collective."""
        if self.eval_rows and self.parallel.is_main:
            self._log(await self.evaluator.evaluate(tag, self.step))

    def _log(self, m: dict[str, Any]) -> None:
        self.history.append(m)
        if not self.parallel.is_main:
            return
        write_metrics(self.out, m, self.step, self.tracer)
        self.console.print(format_step_line(m, self.steps) if "eval/reward_mean" in m else
                           f"sft step {m['step']:.0f}/{self.steps}  epoch {m['sft/epoch']:.2f}  "
                           f"loss {m['train/loss']:.4f}  {m['sft/sequences']:.0f} sequences  "
                           f"{m['train/tokens']:.0f} tokens{packing_text(m)}  train {m['train/tokens_per_s']:.0f} tok/s  "
                           f"step {m['time/step_s']:.1f}s")

    def save_checkpoint(self) -> Path:
        """The learner's checkpoint with this loop's state, the Hugging Face weights unless trainer.save_hf is
        false (turnrl.train.checkpoint; the run keeps the newest trainer.keep_checkpoints), and the links to
        its model directory: RUN/model, and output_dir/model when the run lies in output_dir (so a config's
        `model: runs/NAME/sft/model` is the newest run's model)."""
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "history": self.history,
                 "config": self.cfg.model_dump()} if self.parallel.is_main else {}
        save_hf = self.cfg.trainer.save_hf
        path = save_checkpoint(self.learner, self.out / "checkpoints" / f"step_{self.step:06d}", state,
                               renderer=self.renderer, hf_weights=save_hf is True or save_hf == "final",
                               keep=self.cfg.trainer.keep_checkpoints)
        if self.parallel.is_main:
            links = [(self.out / "model", Path("checkpoints") / path.name / "model")]
            output_dir = Path(self.cfg.output_dir)
            if self.out.parent.resolve() == output_dir.resolve() and self.out.resolve() != output_dir.resolve():
                links.append((output_dir / "model", Path(self.out.name) / "model"))
            for link, target in links:
                if not replace_link(link, target):
                    log.warning("%s exists and is not a link; the model is in %s", link, path / "model")
        return path

    def load_checkpoint(self) -> None:
        """Restore the learner, data position, RNG and history from the checkpoint to resume (cfg.resume; a
        ValueError when there is none)."""
        lora = self.cfg.trainer.lora
        state = resume_checkpoint(self.learner, self.out, self.cfg.resume, console=self.console,
                                  lora=lora.model_dump() if lora else None)
        self.sampler.load_state_dict(state["sampler"])
        self.step, self.history = state["step"], state["history"]


def sft_steps(cfg: SFTConfig, n_samples: int) -> int:
    """Optimizer steps: `steps` when set, else sft.epochs passes of sft.batch_size sequences."""
    return cfg.steps or max(1, math.ceil(cfg.sft.epochs * n_samples / min(cfg.sft.batch_size, n_samples)))
