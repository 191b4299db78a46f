"""Run directories: every `turnrl train` and `turnrl sft` gets its own, so a run never overwrites another.

    runs/arithmetic/                    output_dir: the runs of one config
        latest-run -> 20261201-103200   the newest run started here (a symbolic link)
        20261201-103200/                a run directory (`--run-dir` names one yourself)
            config.yaml                 the config the run started with (resolved: every key)
            metrics.jsonl  groups.jsonl  curves.png  trajectories/  (tensorboard/  wandb/: trainer.loggers)
            checkpoints/step_000030/ ... checkpoints/latest    (turnrl.train.checkpoint; the newest
                                        trainer.keep_checkpoints of them are kept)
            model -> checkpoints/step_000030/model      `turnrl sft`: its model (and output_dir/model -> it)

`prepare_run` decides the directory before anything loads:
- a new run: `run_dir` if given (it must be empty or absent; `overwrite` deletes the previous run's files
  from it first), else a new `<output_dir>/<YYYYmmdd-HHMMSS>`;
- `resume=True`: the run in `run_dir`, else the newest run under output_dir (a config whose output_dir is
  itself a run directory, as before run directories existed, resumes that one);
- `resume=PATH`: the run directory, checkpoint folder or directory of runs at PATH;
- a resume that finds no run, or a run without a checkpoint, is refused (the user asked to continue a run that
  is not there; starting afresh in its place would mix two runs).
Under torchrun without `run_dir`, rank 0 alone decides (a timestamped name is only unique where it is made);
`share_run` gives the other ranks its choice once the process group is up.

`find_checkpoint(PATH)` is the same rule for `turnrl eval`: a checkpoint folder, a run (its newest valid
checkpoint) or a directory of runs (the newest run's). `find_run(FILE)` is the run a file it wrote lies in
(`turnrl replay`: the model in its config.yaml, the policy versions in its checkpoints).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from turnrl.config import ConfigError, TrainConfig
from turnrl.train.checkpoint import checkpoint_problem, checkpoint_step, select_checkpoint

if TYPE_CHECKING:
    from turnrl.train.parallel import Parallel

RUN_FILES = ("config.yaml", "metrics.jsonl", "groups.jsonl", "curves.png", "checkpoints", "trajectories", "tensorboard",
             "wandb", "model")
"""What a run writes into its directory (what `overwrite` deletes; anything else there is left alone)."""


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in ("config.yaml", "checkpoints", "metrics.jsonl"))


def runs_under(output_dir: Path) -> list[Path]:
    """The run directories directly under `output_dir`, oldest first (timestamped names sort by time)."""
    if not output_dir.is_dir():
        return []
    return sorted((p for p in output_dir.iterdir() if not p.name.startswith(".") and not p.is_symlink()
                   and is_run_dir(p)), key=lambda p: p.name)


def new_run_dir(output_dir: Path) -> Path:
    """`<output_dir>/<YYYYmmdd-HHMMSS>`, created here so that two runs started in the same second never
    share it (the second gets a `-2` suffix)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for k in range(1, 1000):
        path = output_dir / (stamp if k == 1 else f"{stamp}-{k}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        _link_latest(output_dir, path)
        return path
    raise ConfigError(f"output_dir {output_dir}: could not create a new run directory for {stamp}")


LATEST_RUN = "latest-run"


def _link_latest(output_dir: Path, run: Path) -> None:
    """`<output_dir>/latest-run` -> the run just created."""
    replace_link(output_dir / LATEST_RUN, run.name)


def replace_link(link: Path, target: str | Path) -> bool:
    """Point the symbolic link `link` at `target` (a path relative to the link's folder), replacing an older
    link atomically. False, and nothing changed, where `link` is a real file or folder or links cannot be made."""
    if link.exists() and not link.is_symlink():
        return False
    tmp = link.with_name(f".{link.name}-{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target, target_is_directory=True)
        os.replace(tmp, link)
    except OSError:
        return False
    return True


def discard_if_empty(run: Path) -> None:
    """A run that never started: its directory goes if it is empty, and `latest-run`, were it left pointing at
    nothing, points back at the newest run that remains (or goes)."""
    with contextlib.suppress(OSError):  # not empty (or already gone): keep it
        run.rmdir()
    link = run.parent / LATEST_RUN
    if link.is_symlink() and not link.exists():
        remaining = runs_under(run.parent)
        if remaining:
            _link_latest(run.parent, remaining[-1])
        else:
            with contextlib.suppress(OSError):
                link.unlink()


def prepare_run(cfg: TrainConfig, *, overwrite: bool = False) -> Path | None:
    """Decide this run's directory (module docstring) and set `cfg.run_dir` to it; an explicit checkpoint
    to resume from stays in `cfg.resume`. Raises ConfigError, naming the directory and the way out, for a
    non-empty run directory without resume or overwrite, and for a resume with nothing to resume. Returns None
    on a torchrun rank other than 0 without `run_dir`: rank 0's choice comes with `share_run`."""
    if overwrite and cfg.run_dir is None and not cfg.resume:
        raise ConfigError("--overwrite replaces the run in --run-dir (run_dir); without it every run gets a "
                          f"new directory under output_dir ({cfg.output_dir})")
    if cfg.run_dir is None and _rank() != 0:
        return None
    if isinstance(cfg.resume, str):
        run_dir = _run_of_resume_path(cfg, Path(cfg.resume))
    elif cfg.resume:
        run_dir = Path(cfg.run_dir) if cfg.run_dir else _newest_run(Path(cfg.output_dir))
        _check_resumable(run_dir)
    else:
        run_dir = _fresh_run(cfg, overwrite)
    cfg.run_dir = str(run_dir)
    return run_dir


def share_run(cfg: TrainConfig, parallel: Parallel) -> Path:
    """Every rank takes rank 0's run directory and resume choice (a collective; the identity in one process):
    under torchrun without `run_dir` only rank 0 chose (`prepare_run`)."""
    cfg.run_dir, cfg.resume = parallel.broadcast_object((cfg.run_dir, cfg.resume))
    if cfg.run_dir is None:
        raise ConfigError("rank 0 chose no run directory (prepare_run was not called on it)")
    return Path(cfg.run_dir)


def _fresh_run(cfg: TrainConfig, overwrite: bool) -> Path:
    if cfg.run_dir is None:
        return new_run_dir(Path(cfg.output_dir))
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir {run_dir} is a file, not a directory")
    if _rank() != 0 or not run_dir.is_dir() or not any(run_dir.iterdir()):
        return run_dir
    if not overwrite:
        raise ConfigError(f"run directory {run_dir} is not empty ({_describe(run_dir)}): pass --resume to continue "
                          "that run, --overwrite to replace it, or another --run-dir")
    for name in RUN_FILES:
        target = run_dir / name
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)
    return run_dir


def _run_of_resume_path(cfg: TrainConfig, path: Path) -> Path:
    """The run a `resume` path continues; a checkpoint folder stays in cfg.resume (resume exactly there)."""
    if checkpoint_step(path) is not None and path.parent.name == "checkpoints":
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ConfigError(f"--resume {path}: this checkpoint {problem}; pass its run directory "
                              f"({path.parent.parent}) to resume from the newest valid one")
        run_dir = path.parent.parent
    elif is_run_dir(path):
        run_dir, cfg.resume = path, True
        _check_resumable(run_dir)
    elif runs_under(path):
        run_dir, cfg.resume = runs_under(path)[-1], True
        _check_resumable(run_dir)
    else:
        raise ConfigError(f"--resume {path}: not a checkpoint folder (checkpoints/step_N), a run directory or a "
                          "directory of runs")
    if cfg.run_dir is not None and Path(cfg.run_dir).resolve() != run_dir.resolve():
        raise ConfigError(f"--run-dir {cfg.run_dir} and --resume {path} name different runs ({run_dir}); "
                          "give one of them")
    return run_dir


def _newest_run(output_dir: Path) -> Path:
    runs = runs_under(output_dir)
    if runs:
        return runs[-1]
    if is_run_dir(output_dir):  # a run written before run directories: output_dir was the run directory
        return output_dir
    raise ConfigError(f"--resume: there is no earlier run to resume: output_dir {output_dir} "
                      f"{'holds no run directory' if output_dir.is_dir() else 'does not exist'}; start the run "
                      "without --resume, or pass --resume PATH (a run directory or checkpoint)")


def _check_resumable(run_dir: Path) -> None:
    """A ConfigError unless the run in `run_dir` has a checkpoint to resume from (a cheap check: sizes, not
    checksums; `select_checkpoint` verifies the one it picks)."""
    if not run_dir.is_dir():
        raise ConfigError(f"--resume: run directory {run_dir} does not exist, so there is nothing to resume; "
                          "start the run without --resume")
    root = run_dir / "checkpoints"
    saved = sorted(root.glob("step_*")) if root.is_dir() else []
    if not any(checkpoint_problem(p, verify=False) is None for p in saved):
        what = f"no complete checkpoint ({', '.join(p.name for p in saved)} broken)" if saved else "no checkpoint"
        raise ConfigError(f"--resume: run {run_dir} has {what}, so there is nothing to resume; start a new run "
                          f"without --resume, or replace this one with --run-dir {run_dir} --overwrite")


def find_checkpoint(path: Path) -> tuple[Path, list[str]]:
    """The checkpoint folder `path` means: itself, the newest valid checkpoint of a run directory, or that of
    the newest run in a directory of runs; with notes on the newer checkpoints skipped. Raises ValueError
    saying what `path` holds when there is none."""
    path = Path(path)
    if checkpoint_step(path) is not None and (path / "trainer_state.pt").exists():
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(f"checkpoint {path} {problem}")
        return path, []
    runs = runs_under(path)
    run = path if is_run_dir(path) else (runs[-1] if runs else None)
    if run is None:
        what = "does not exist" if not path.exists() else "is neither a checkpoint, a run directory nor a directory of runs"
        raise ValueError(f"{path} {what} (expected e.g. runs/NAME/<timestamp> or "
                         "runs/NAME/<timestamp>/checkpoints/step_000030)")
    ckpt, notes = select_checkpoint(run)
    if ckpt is None:
        raise ValueError(f"run {run} has no valid checkpoint" + (f" ({'; '.join(notes)})" if notes else ""))
    return ckpt, notes


def find_run(path: Path) -> Path | None:
    """The run directory a file the run wrote lies in (RUN/trajectories/last_step.jsonl, RUN/eval/step_N.jsonl,
    RUN/config.yaml itself): the nearest of the file's two enclosing folders with a config.yaml; None if neither."""
    for folder in list(Path(path).resolve().parents)[:2]:
        if (folder / "config.yaml").is_file() and is_run_dir(folder):
            return folder
    return None


def run_model(run_dir: Path) -> str:
    """The model a run trained (the `model` of its config.yaml)."""
    import yaml

    config = Path(run_dir) / "config.yaml"
    try:
        model = (yaml.safe_load(config.read_text()) or {}).get("model")
    except (OSError, yaml.YAMLError, AttributeError) as e:
        raise ConfigError(f"{config}: cannot read the run's config ({type(e).__name__}: {e})") from None
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{config} names no model (a `model:` key); pass --model")
    return model


def version_checkpoint(run_dir: Path, version: int) -> Path:
    """The checkpoint of policy `version` in a run (the weights after `version` steps: checkpoints/step_N, N =
    version). Raises FileNotFoundError naming the checkpoints the run did save."""
    path = Path(run_dir) / "checkpoints" / f"step_{version:06d}"
    problem = checkpoint_problem(path, verify=False)
    if problem is not None:
        saved = sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("step_*"))
        raise FileNotFoundError(f"{run_dir}: no checkpoint of policy version {version} ({path.name} {problem}); "
                                f"saved: {', '.join(saved) or 'none'} (save_every=1 with trainer.keep_checkpoints: "
                                "null keeps every version)")
    return path


def _describe(run_dir: Path) -> str:
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").is_dir() else []
    if ckpts:
        return f"checkpoints up to {ckpts[-1]}"
    return ", ".join(sorted(p.name for p in run_dir.iterdir())[:4])


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))

