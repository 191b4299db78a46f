"""Checkpoints: sharded training state that resumes exactly, at the same or another world size, and Hugging
Face directories for everything else (evaluation, vLLM, transformers).

    checkpoints/step_000012/
        state/              torch.distributed.checkpoint: trainable weights (fp32 shards) + optimizer state;
                            any world size loads it (DCP reshards on load)
        rng/rank_00000.pt   python / numpy / torch (and CUDA) RNG state of each rank
        trainer_state.pt    step, scheduler, sampler (data position), history, world size, the config (rank 0)
        model/              Hugging Face directory: config, tokenizer/processor, chat template and, per
                            trainer.save_hf (default: the run's final checkpoint only), the weights (LoRA merged)
        manifest.json       every file above with its size and sha256 (written last, by rank 0)
    checkpoints/latest      the newest complete checkpoint's name

Writes are atomic: every rank writes into `checkpoints/.tmp-step_000012/`, rank 0 adds the manifest and
renames the folder into place, then points `latest` at it. A crash at any moment leaves the previous
checkpoints as they were. `select_checkpoint(RUN_DIR)` picks the newest checkpoint whose files match its
manifest and says which newer ones it skipped and why (truncated, missing or corrupted files, a `latest`
naming a folder that is gone): what `--resume` and `turnrl eval` use.

`export_checkpoint(CKPT, OUT_DIR)` writes a Hugging Face directory from `state/` in one process, whatever
world size wrote it; `load_checkpoint_model(CKPT)` gives the policy of a checkpoint, from `model/` when its
weights are there, else from `state/`.

The training loops (turnrl.train.loop, turnrl.train.sft) save and resume through `save_checkpoint` and
`resume_checkpoint`: the learner's state (weights, optimizer, scheduler) and each rank's RNG here, the loop's
own state (step, data position, history, the RL buffer) as the dict they hand in and get back.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from turnrl.train import lora
from turnrl.train.parallel import Parallel
from turnrl.train.weights import weight_buckets, weight_sources

if TYPE_CHECKING:
    from rich.console import Console

    from turnrl.train.learner import Learner

HF_SHARD_BYTES = 4 * 2**30  # safetensors files of a Hugging Face directory (transformers' own default is 5 GB)
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")
MANIFEST = "manifest.json"
REQUIRED = ("trainer_state.pt", "state/.metadata", "rng/rank_00000.pt")
"""Files every checkpoint has (what a checkpoint from before manifests is checked for)."""
_STEP = re.compile(r"step_(\d+)$")
log = logging.getLogger(__name__)


def _state_options(loading: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen weights (a LoRA run's base model) are not training state: they come from the base model. On load
    # `strict=False` only lets those be absent: DCP itself fails on any requested (trainable) key it lacks.
    return StateDictOptions(ignore_frozen_params=True, strict=not loading)


class _TrainingState:
    """DCP's Stateful view of the model and optimizer: sharded state dicts keyed by parameter name, which is
    what lets a checkpoint written by N ranks load into M."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": self._trainable(get_model_state_dict(self.model, options=_state_options()))}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_state_options())
        return {"model": self._trainable(model_sd), "optim": optim_sd}

    def _trainable(self, model_sd: dict[str, Any]) -> dict[str, Any]:
        # ignore_frozen_params misses the second name of a tied frozen weight (a LoRA run's lm_head); a tied
        # weight is kept once, under its first name (loading it fills both: they are one tensor)
        every = self.model.named_parameters(remove_duplicate=False)
        first = {n for n, _ in self.model.named_parameters()}
        skip = {n for n, p in every if not p.requires_grad or n not in first}
        return {k: v for k, v in model_sd.items() if k not in skip}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is None:
            set_model_state_dict(self.model, state["model"], options=_state_options(loading=True))
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=_state_options(loading=True))


def save_training_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of the weights and optimizer state into `path/state` (collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"training": _TrainingState(model, optimizer)}, checkpoint_id=str(path / "state"))


def load_training_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Fill the (sharded) model and optimizer from `path/state`, resharding to this world size."""
    import torch.distributed.checkpoint as dcp

    if not (path / "state").is_dir():
        raise FileNotFoundError(f"checkpoint {path} has no sharded training state ({path / 'state'}); a checkpoint "
                                "from an older turnrl cannot be resumed: start from its model/ directory instead")
    dcp.load({"training": _TrainingState(model, optimizer)}, checkpoint_id=str(path / "state"))


def save_rng(path: Path, rank: int) -> None:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    (path / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(state, path / "rng" / f"rank_{rank:05d}.pt")


def load_rng(path: Path, rank: int) -> None:
    """This rank's RNG; at another world size a new rank takes rank 0's (streams then differ, the update not)."""
    own = path / "rng" / f"rank_{rank:05d}.pt"
    state = torch.load(own if own.exists() else path / "rng" / "rank_00000.pt", weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_hf(model: nn.Module, where: Path, parallel: Parallel, dtype: torch.dtype, *, weights: bool = True) -> None:
    """A Hugging Face directory of `model` (LoRA merged) in `dtype`: rank 0 writes config, generation config
    and safetensors files of at most HF_SHARD_BYTES, gathered tensor by tensor (every rank takes part)."""
    hf = lora.base_model(model)
    if parallel.is_main:
        where.mkdir(parents=True, exist_ok=True)
        for old in (f for pattern in WEIGHT_FILES for f in where.glob(pattern)):
            old.unlink()
        config = copy.deepcopy(hf.config)  # the live model's config keeps its dtype
        config.dtype = dtype
        config.save_pretrained(where)
        if getattr(hf, "generation_config", None) is not None:
            hf.generation_config.save_pretrained(where)
    if not weights:
        return
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    for bucket in weight_buckets(weight_sources(model), HF_SHARD_BYTES, dtype, keep=parallel.is_main):
        file = "model.safetensors" if bucket.count == 1 else f"model-{bucket.index + 1:05d}-of-{bucket.count:05d}.safetensors"
        if parallel.is_main:
            save_file({n: t.contiguous() for n, t in bucket.tensors}, where / file, metadata={"format": "pt"})
            weight_map.update({n: file for n, _ in bucket.tensors})
        total += bucket.nbytes
        if parallel.is_main and bucket.final and bucket.count > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (where / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write a Hugging Face directory (safetensors, config, tokenizer/processor, chat template) from a
    checkpoint's sharded state, in this one process; LoRA adapters are merged into the base weights."""
    from turnrl.config import SFTConfig, TrainConfig

    ckpt, out = Path(checkpoint), Path(out_dir)
    if not (ckpt / "trainer_state.pt").exists():
        raise FileNotFoundError(f"{ckpt} is not a turnrl checkpoint (no trainer_state.pt); expected a folder like "
                                "runs/NAME/checkpoints/step_000010")
    saved = torch.load(ckpt / "trainer_state.pt", weights_only=False)["config"]
    cfg = (SFTConfig if "sft" in saved else TrainConfig).model_validate(saved)  # `turnrl sft` or `turnrl train`'s
    model = _model_to_fill(ckpt, cfg)
    load_training_state(ckpt, model, optimizer=None)
    out.mkdir(parents=True, exist_ok=True)
    for f in (ckpt / "model").iterdir():  # tokenizer, processor, chat template (the weights come from state/)
        if f.is_file() and not any(f.match(p) for p in WEIGHT_FILES):
            shutil.copy(f, out / f.name)
    write_hf(model, out, Parallel(), getattr(torch, cfg.dtype))
    return out


def _model_to_fill(ckpt: Path, cfg) -> nn.Module:
    """The architecture the state loads into: the base model with fresh adapters (LoRA: only the adapters are
    in the state), the base model with the same parameters frozen (optim.freeze: those are not in the state),
    else the checkpoint's config with fresh weights (all of them are in the state)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from turnrl.models import freeze, load_model

    if cfg.trainer.lora is not None or cfg.optim.freeze:
        model = load_model(cfg.model)
        model = lora.apply_lora(model, cfg.trainer.lora) if cfg.trainer.lora is not None else model
        freeze(model, cfg.optim.freeze)
        return model
    config = AutoConfig.from_pretrained(ckpt / "model")
    cls = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    return cls.from_config(config, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------
# Atomic writes, manifests, and choosing the checkpoint to resume
# ---------------------------------------------------------------------------------------------------
def save_checkpoint(learner: Learner, path: Path, loop_state: dict[str, Any], *, renderer: Any,
                    hf_weights: bool, keep: int | None = None) -> Path:
    """Sharded state that resumes exactly (every rank writes its part), the loop's `loop_state` and a Hugging
    Face model dir (with `hf_weights`, its weights; always the config and the `renderer`'s tokenizer), written
    into a staging folder and renamed into place once complete (with its manifest), then named by `latest`;
    then all but the `keep` newest checkpoints of the run are deleted (`prune_checkpoints`; None: none)."""
    parallel = learner.parallel
    staged = staging_dir(path)
    if parallel.is_main:
        shutil.rmtree(staged, ignore_errors=True)  # left by a run that died while saving
        staged.mkdir(parents=True)
    parallel.barrier()
    save_rng(staged, parallel.rank)
    save_training_state(staged, learner.policy, learner.optimizer)
    write_hf(learner.policy, staged / "model", parallel, learner.options.dtype, weights=hf_weights)
    if parallel.is_main:
        save_tokenizer(renderer, staged / "model")
        torch.save({**loop_state, "scheduler": learner.scheduler.state_dict(), "world_size": parallel.world_size},
                   staged / "trainer_state.pt")
    parallel.barrier()  # every rank's files are written before the checkpoint is published
    if parallel.is_main:
        publish_checkpoint(staged, path)
        if keep is not None:
            prune_checkpoints(path.parent, keep, published=path)
    parallel.barrier()
    return path


def save_tokenizer(renderer: Any, where: Path) -> None:
    """Tokenizer (and a VLM's image processor and chat template) beside the weights: a self-contained dir.
    The processor is saved piecewise: without a video processor its own save_pretrained fails."""
    if getattr(renderer, "tokenizer", None) is not None:
        renderer.tokenizer.save_pretrained(where)
    processor = getattr(renderer, "processor", None)
    if processor is not None:
        processor.image_processor.save_pretrained(where)
        (where / "chat_template.jinja").write_text(processor.chat_template)


def resume_checkpoint(learner: Learner, run_dir: Path, resume: bool | str, *, lora: dict[str, Any] | None,
                      console: Console) -> dict[str, Any]:
    """Restore the learner (weights, optimizer, scheduler) and this rank's RNG from the checkpoint to resume
    (`resume_point`: rank 0 chooses, the other ranks take its choice; a ValueError when there is none), whatever
    world size wrote it. Returns the loop's saved state; what was logged after the checkpoint is dropped from
    the run's metrics.jsonl and groups.jsonl, to be done again. `lora`: the run's trainer.lora, which must be
    the checkpoint's."""
    parallel = learner.parallel
    choice: Path | ValueError | None = None
    if parallel.is_main:
        try:
            choice = resume_point(resume, run_dir, console)
        except ValueError as e:
            choice = e
    path = parallel.broadcast_object(choice)
    if isinstance(path, ValueError):
        raise path
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    saved_lora = state["config"]["trainer"]["lora"]
    if saved_lora != lora:
        raise ValueError(f"checkpoint {path}: trainer.lora was {saved_lora}, the config now has {lora}; "
                         "resume with the same adapters")
    load_training_state(path, learner.policy, learner.optimizer)
    learner.scheduler.load_state_dict(state["scheduler"])
    load_rng(path, parallel.rank)
    if parallel.is_main:  # never log a step twice
        for name in ("metrics.jsonl", "groups.jsonl"):
            _truncate_after(run_dir / name, state["step"])
        moved = supersede_newer(path) if path.parent.resolve() == (run_dir / "checkpoints").resolve() else []
        console.print(f"resumed from {path} (step {state['step']}, written by {state['world_size']} ranks, "
                      f"now {parallel.world_size})"
                      + (f"; moved the newer {', '.join(moved)} to checkpoints/superseded/" if moved else ""),
                      soft_wrap=True)
    return state


def resume_point(resume: bool | str, run_dir: Path, console: Console) -> Path:
    """The checkpoint `resume` names (a checkpoint folder), else the newest valid one of the run in `run_dir`;
    the newer ones skipped (broken, incomplete) are named in one line. A ValueError when there is none: a
    resume never starts from scratch."""
    if isinstance(resume, str) and checkpoint_step(Path(resume)) is not None:
        path = Path(resume)
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(f"resume: checkpoint {path} {problem}")
        return path
    found, notes = select_checkpoint(run_dir)
    if found is None:  # turnrl.train.runs refused a run without a complete checkpoint; these failed their checksums
        raise ValueError(f"resume: run {run_dir} has no valid checkpoint to resume from"
                         + (f" ({'; '.join(notes)})" if notes else "") + "; start a new run without --resume")
    if notes:
        console.print(f"[yellow]resume:[/] {'; '.join(notes)}; resuming from {found.name}", soft_wrap=True)
    return found


def _truncate_after(path: Path, step: int) -> None:
    """Keep the JSONL lines of `path` whose `step` is at most `step` (a resumed run writes the later ones again)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def staging_dir(path: Path) -> Path:
    """Where every rank writes the checkpoint `path` before it is published (`publish_checkpoint`)."""
    return path.parent / f".tmp-{path.name}"


def publish_checkpoint(staged: Path, path: Path) -> None:
    """Rank 0, once every rank wrote into `staged`: the manifest, then one rename into place, then `latest`.
    A checkpoint of the same step from an earlier continuation of the run is replaced."""
    write_manifest(staged)
    if path.exists():
        old = path.parent / f".old-{path.name}"
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        staged.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staged.rename(path)
    _write_atomically(path.parent / "latest", path.name)


def write_manifest(path: Path) -> None:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(path)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    _write_atomically(path / MANIFEST, json.dumps({"files": entries}, indent=1))


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checkpoint_problem(path: Path, *, verify: bool = True) -> str | None:
    """Why the checkpoint folder `path` cannot be resumed from, or None: a missing or empty folder, files of
    its manifest missing, truncated or (with `verify`) not matching their checksum. A checkpoint from before
    manifests is checked for its required files only."""
    if not path.is_dir():
        return "does not exist"
    if not any(path.iterdir()):
        return "is empty"
    if not (path / MANIFEST).exists():
        missing = [f for f in REQUIRED if not (path / f).is_file() or (path / f).stat().st_size == 0]
        return f"{missing[0]} is missing or empty (and there is no {MANIFEST})" if missing else None
    try:
        entries = json.loads((path / MANIFEST).read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for name, entry in entries.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry["bytes"]:
            return f"{name} has {f.stat().st_size} of its {entry['bytes']} bytes (truncated or overwritten)"
    for name, entry in entries.items() if verify else ():
        if _sha256(path / name) != entry["sha256"]:
            return f"{name} does not match its checksum (corrupted)"
    return None


def checkpoint_step(path: Path) -> int | None:
    match = _STEP.match(path.name)
    return int(match.group(1)) if match else None


def select_checkpoint(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of the run in `run_dir` that can be resumed from (None: there is none), and a
    note for each newer one it skipped and why (also a `latest` naming a folder that does not exist)."""
    root = Path(run_dir) / "checkpoints"
    steps = {p: step for p in root.glob("step_*") if (step := checkpoint_step(p)) is not None} if root.is_dir() else {}
    found = sorted(steps, key=steps.__getitem__, reverse=True)
    notes = []
    latest = root / "latest"
    if latest.is_file() and not (root / latest.read_text().strip()).is_dir():
        notes.append(f"latest names {latest.read_text().strip()!r}, which does not exist")
    for path in found:
        problem = checkpoint_problem(path)
        if problem is None:
            return path, notes
        notes.append(f"skipped {path.name}: {problem}")
    return None, notes


def supersede_newer(path: Path) -> list[str]:
    """A run resumes from the checkpoint `path`: the newer checkpoints of its run (skipped as broken, or from
    a continuation given up by resuming an earlier one) move into `checkpoints/superseded/`, so that the
    newest checkpoint is always this continuation's, and `latest` names `path`. Returns what moved."""
    root, step = path.parent, checkpoint_step(path) or 0
    newer = sorted(p for p in root.glob("step_*") if (checkpoint_step(p) or -1) > step)
    if newer:
        aside = root / "superseded" / time.strftime("%Y%m%d-%H%M%S")
        aside.mkdir(parents=True, exist_ok=True)
        for p in newer:
            p.rename(aside / p.name)
    _write_atomically(root / "latest", path.name)
    return [p.name for p in newer]


def prune_checkpoints(root: Path, keep: int, *, published: Path | None = None) -> list[str]:
    """Delete the checkpoints in `root` (a run's checkpoints/) but the `keep` newest and the newest valid one,
    whatever `keep` says: a newer broken one (truncated, failing its checksum) does not count as valid, so the
    only checkpoint a run can resume from is never deleted. `published`: the checkpoint just written (whole by
    construction: its manifest was made from its files), not hashed again. Returns the names deleted."""
    steps = sorted((p for p in root.glob("step_*") if checkpoint_step(p) is not None and p.is_dir()),
                   key=lambda p: checkpoint_step(p) or 0, reverse=True)
    newest_valid = next((p for p in steps if p == published or checkpoint_problem(p) is None), None)
    doomed = [p for p in steps[keep:] if p != newest_valid]
    for p in doomed:
        shutil.rmtree(p)
    if doomed:
        log.info("deleted checkpoints %s (trainer.keep_checkpoints=%d)", ", ".join(p.name for p in doomed), keep)
    return [p.name for p in doomed]


def has_hf_weights(model_dir: Path) -> bool:
    return any(any(model_dir.glob(p)) for p in WEIGHT_FILES)


def load_checkpoint_model(checkpoint: str | Path) -> nn.Module:
    """The policy of a checkpoint (LoRA merged): its Hugging Face weights when it has them, else made from its
    sharded state in this process (intermediate checkpoints keep only what resuming needs)."""
    from turnrl.models import load_model

    ckpt = Path(checkpoint)
    if has_hf_weights(ckpt / "model"):
        return load_model(str(ckpt / "model"))
    import tempfile

    with tempfile.TemporaryDirectory(prefix="turnrl-export-") as tmp:
        return load_model(str(export_checkpoint(ckpt, tmp)))
