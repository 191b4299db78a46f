"""Where a training run's metrics go: `metrics.jsonl` always, and the backends `trainer.loggers` names.

    jsonl         RUN/metrics.jsonl, one JSON object per step or evaluation (every key, as the console line)
    mlflow        the MLflow run at rollout.trace_uri, the one the trajectory traces link to (on whenever
                  trace_uri is set): params, metrics, and the run's files as artifacts
    wandb         a Weights & Biases run (WANDB_MODE=offline writes it under RUN/wandb/ for `wandb sync`):
                  the resolved config as its config, metrics, and the run's files as an artifact
    tensorboard   event files under RUN/tensorboard/: metrics as scalars, the config and trajectory samples
                  as text, the curves as an image

Every backend gets the same metric names and steps as metrics.jsonl (the finite numbers of each record; the
step is the training step, 0 for the evaluation before training), and the run directory's name as the run's
name. A backend that fails to start, or later, warns once and is off for the rest of the run: it never stops
training. `Loggers.log(metrics, step)` is all the training loop calls.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

BACKENDS = ("jsonl", "mlflow", "wandb", "tensorboard")


class Backend(Protocol):
    """One place metrics go besides metrics.jsonl."""

    name: str

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def artifacts(self, files: list[Path]) -> None:
        """The run's files at its end (curves.png, trajectory JSONL samples), where the backend keeps files."""

    def close(self, failed: bool) -> None: ...


class Loggers:
    """metrics.jsonl and the started backends, behind one `log(metrics, step)`."""

    def __init__(self, jsonl: Path, backends: Sequence[Backend] = ()):
        self.jsonl = jsonl
        self.backends = list(backends)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        with open(self.jsonl, "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")
        numbers = {k: float(v) for k, v in metrics.items() if k != "step" and isinstance(v, int | float)
                   and not isinstance(v, bool) and math.isfinite(v)}
        for backend in list(self.backends):
            self._guarded(backend, "log", numbers, step)

    def close(self, artifacts: Sequence[Path] = (), *, failed: bool = False) -> None:
        """Hand the run's files that exist to each backend, then end its run."""
        files = [Path(f) for f in artifacts if Path(f).is_file()]
        for backend in list(self.backends):
            if files and not failed:
                self._guarded(backend, "artifacts", files)
        for backend in list(self.backends):
            self._guarded(backend, "close", failed)
        self.backends = []

    def _guarded(self, backend: Backend, what: str, *args: Any) -> None:
        """`backend.<what>(*args)`; one that raises is warned about once and dropped."""
        try:
            getattr(backend, what)(*args)
        except Exception as e:  # a dashboard never stops training
            log.warning("trainer.loggers: %s failed in %s (%s: %s); it is off for the rest of the run", backend.name,
                        what, type(e).__name__, e)
            if backend in self.backends:
                self.backends.remove(backend)


def build_loggers(names: Sequence[str], run_dir: Path, config: dict[str, Any], tracer: Any = None,
                  project: str | None = None) -> Loggers:
    """metrics.jsonl in `run_dir` and every backend of `names` that starts (one that cannot warns once); MLflow
    whenever `tracer` (turnrl.observe.tracing) is connected. `config` is the resolved config, `project` the
    W&B project unless WANDB_PROJECT names one (default "turnrl")."""
    backends: list[Backend] = []
    starters: dict[str, Callable[[], Backend]] = {
        "mlflow": lambda: MlflowBackend(tracer, run_dir.name),
        "wandb": lambda: WandbBackend(run_dir, config, project),
        "tensorboard": lambda: TensorboardBackend(run_dir, config),
    }
    wanted = [n for n in dict.fromkeys(names) if n != "jsonl"]
    if tracer is not None and tracer.enabled and "mlflow" not in wanted:
        wanted.insert(0, "mlflow")
    for name in wanted:
        try:
            backends.append(starters[name]())
        except Exception as e:
            log.warning("trainer.loggers: %s could not start (%s: %s); the run goes on without it (metrics.jsonl "
                        "has every metric)", name, type(e).__name__, e)
    return Loggers(run_dir / "metrics.jsonl", backends)


# ---- the backends ----------------------------------------------------------------------------------
class MlflowBackend:
    """Metrics and files to the MLflow run the trajectory tracer (rollout.trace_uri) logs to."""

    name = "mlflow"

    def __init__(self, tracer: Any, run_name: str):
        if tracer is None or not tracer.enabled:
            raise RuntimeError("no MLflow tracking server: set rollout.trace_uri")
        self.tracer = tracer
        tracer.run_name = run_name

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.tracer.log_metrics(metrics, step)

    def artifacts(self, files: list[Path]) -> None:
        self.tracer.log_artifacts(files)

    def close(self, failed: bool) -> None:
        pass  # the tracer ends the run when the stack closes it (after the last traces are sent)


class WandbBackend:
    """A W&B run named after the run directory, its files under RUN/wandb/ (offline runs stay there)."""

    name = "wandb"

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str | None = None):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or project or "turnrl", name=run_dir.name,
                              config=config, dir=str(run_dir), reinit="create_new",
                              settings=wandb.Settings(console="off", quiet=True))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def artifacts(self, files: list[Path]) -> None:
        import wandb

        artifact = wandb.Artifact(f"{_safe(self.run.name or 'run')}-files", type="run-files",
                                  description="curves and trajectory samples of a turnrl run")
        for f in files:
            artifact.add_file(str(f))
        self.run.log_artifact(artifact)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class TensorboardBackend:
    """Event files under RUN/tensorboard/ (torch's SummaryWriter; `tensorboard --logdir RUN/tensorboard`)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        import yaml
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)
        self.last_step = 0

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.last_step = max(self.last_step, step)

    def artifacts(self, files: list[Path]) -> None:
        import numpy as np
        from PIL import Image

        for f in files:
            if f.suffix == ".png":
                self.writer.add_image(f.stem, np.asarray(Image.open(f).convert("RGB")), self.last_step,
                                      dataformats="HWC")
            elif f.suffix == ".jsonl":
                self.writer.add_text(f"samples/{f.stem}", trajectory_samples(f), self.last_step)

    def close(self, failed: bool) -> None:
        self.writer.close()


def trajectory_samples(path: Path, count: int = 4, chars: int = 400) -> str:
    """The first `count` trajectories of a JSONL file as markdown: id, status, reward, and each message."""
    parts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(parts) == count:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            lines = [f"**{row.get('id')}** status {row.get('status')}, reward {row.get('reward')}"]
            for m in row.get("messages") or []:
                content = m.get("content") if isinstance(m.get("content"), str) else json.dumps(m.get("content"))
                lines.append(f"    [{m.get('role')}] {content[:chars]}".replace("\n", "\n    "))
            parts.append("\n\n".join(lines))
    return "\n\n---\n\n".join(parts) or "(no trajectories)"


def _safe(name: str) -> str:
    """A W&B artifact name: letters, digits, '-', '_' and '.'."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
