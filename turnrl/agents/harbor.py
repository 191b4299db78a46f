"""Harbor tasks as data, graded without Docker.

A Harbor task (PyPI `harbor`, 0.26; the common format of coding and terminal tasks) is a folder:

    instruction.md        the prompt the agent gets
    task.toml             limits: [agent] timeout_sec, [verifier] timeout_sec and env, [environment] workdir and env
    environment/          how Harbor builds the task's container (Dockerfile: its last WORKDIR is where the agent works)
    tests/test.sh         the grader, run after the agent: it writes the reward to /logs/verifier/reward.txt
                          (a number) or /logs/verifier/reward.json ({"reward": number, ...} or a number)
    solution/solve.sh     a reference solution (not used here)

`task_rows(folder)` turns a folder of task folders (or one task folder) into dataset rows (`prompt` =
instruction, `harbor_task` = the folder), so `--data tasks/` trains on them. `verify(task, workdir)` grades a
finished episode the way Harbor's verifier does, in the command sandbox (turnrl.agents.sandbox) instead of a
container: the task's working directory at its own path (`/app`), a copy of `tests/` at `/tests` (read-only),
a fresh `/logs` (the only other place it writes), a HOME of its own, no network; reward.json before
reward.txt, a finite number or a clear error, never a silent 0.

What this reads from the `harbor` wheel (0.26.0, read with `pip download --no-deps --python-version 3.12
harbor`, since the package needs Python 3.12): the folder layout (`harbor.models.task.paths.TaskPaths`), the
`task.toml` fields used here and their defaults (`harbor.models.task.config`: verifier timeout 600 s, no agent
timeout, `environment.workdir` over the Dockerfile's last WORKDIR), the in-container paths (`/logs/verifier`,
`/tests`: `harbor.models.trial.paths.EnvironmentPaths`), and the reward rules (`harbor.verifier.verifier`).

What differs from Harbor with Docker (docs/harnesses.md): the container image is not built, so the steps of
`environment/Dockerfile` (RUN, COPY) do not happen: the agent starts in an empty working directory, with the
programs of this machine; a test that installs packages from the network fails. Multi-step tasks
(`[[steps]]`) and Windows tasks are refused.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import threading
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

LOGS_DIR = "/logs"
TESTS_DIR = "/tests"
DEFAULT_WORKDIR = "/app"
"""Where the agent works when neither task.toml nor the Dockerfile says (Harbor's template task uses /app)."""
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
"""Harbor's default `[verifier] timeout_sec`."""


class HarborTaskError(ValueError):
    """A folder that is not a usable Harbor task; the message names the file and the field."""


@dataclass(frozen=True)
class HarborTask:
    path: Path
    instruction: str
    workdir: str
    """Where the agent works (and the tests run), as they see it: `[environment] workdir`, else the last WORKDIR
    of environment/Dockerfile, else /app."""
    agent_timeout_s: float | None
    """`[agent] timeout_sec`: the agent's wall-clock limit (None: the harness's default)."""
    verifier_timeout_s: float
    verifier_env: dict[str, str] = field(default_factory=dict)
    """`[environment] env` with `[verifier] env` over it: the test script's environment."""
    agent_env: dict[str, str] = field(default_factory=dict)
    """`[environment] env`: given to the agent's CLI too."""

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"


def is_task_dir(path: str | Path) -> bool:
    """A folder with instruction.md and tests/test.sh (task.toml is optional here: its defaults apply)."""
    path = Path(path)
    return (path / "instruction.md").is_file() and (path / "tests" / "test.sh").is_file()


def load_task(path: str | Path) -> HarborTask:
    """Read a task folder; HarborTaskError names the file and field at fault."""
    path = Path(path).resolve()
    if not path.is_dir():
        raise HarborTaskError(f"Harbor task {path}: not a folder")
    for needed in ("instruction.md", "tests/test.sh"):
        if not (path / needed).is_file():
            raise HarborTaskError(f"Harbor task {path}: {needed} is missing (a task folder holds instruction.md, "
                                  "task.toml and tests/test.sh)")
    config = _read_toml(path / "task.toml")
    where = path / "task.toml"
    if config.get("steps"):
        raise HarborTaskError(f"{where}: [[steps]] (a multi-step task) is not supported by turnrl's harness agent")
    environment, agent, verifier = (_table(config, name, where) for name in ("environment", "agent", "verifier"))
    if str(environment.get("os", "linux")).lower() != "linux":
        raise HarborTaskError(f"{where}: [environment] os = {environment['os']!r}; only linux tasks run here")
    agent_env = _env(environment, "environment", where)
    return HarborTask(
        path=path,
        instruction=(path / "instruction.md").read_text(encoding="utf-8"),
        workdir=_workdir(environment, path, where),
        agent_timeout_s=_seconds(agent, "agent", where, None),
        verifier_timeout_s=_seconds(verifier, "verifier", where, DEFAULT_VERIFIER_TIMEOUT_S) or DEFAULT_VERIFIER_TIMEOUT_S,
        verifier_env={**agent_env, **_env(verifier, "verifier", where)},
        agent_env=agent_env,
    )


def task_rows(path: str | Path) -> list[dict[str, Any]]:
    """Dataset rows of a Harbor task folder, or of every task folder in `path` (sorted by name): `id` (the folder
    name), `prompt` (its instruction) and `harbor_task` (its path)."""
    path = Path(path)
    folders = [path] if is_task_dir(path) else sorted(p for p in path.iterdir() if p.is_dir() and is_task_dir(p))
    if not folders:
        raise HarborTaskError(f"{path}: neither a Harbor task folder nor a folder of them (a task folder holds "
                              "instruction.md, task.toml and tests/test.sh)")
    return [task_row(folder) for folder in folders]


def task_row(path: str | Path) -> dict[str, Any]:
    task = load_task(path)
    return {"id": task.name, "prompt": task.instruction, "harbor_task": str(task.path)}


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise HarborTaskError(f"{path}: invalid TOML ({e})") from None


def _table(config: dict[str, Any], name: str, where: Path) -> dict[str, Any]:
    table = config.get(name, {})
    if not isinstance(table, dict):
        raise HarborTaskError(f"{where}: [{name}] must be a table")
    return table


def _seconds(table: dict[str, Any], name: str, where: Path, default: float | None) -> float | None:
    value = table.get("timeout_sec", default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise HarborTaskError(f"{where}: [{name}] timeout_sec must be a positive number of seconds, got {value!r}")
    return float(value)


def _env(table: dict[str, Any], name: str, where: Path) -> dict[str, str]:
    env = table.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise HarborTaskError(f"{where}: [{name}] env must be a table of strings")
    return dict(env)


def _workdir(environment: dict[str, Any], path: Path, where: Path) -> str:
    workdir = environment.get("workdir") or dockerfile_workdir(path / "environment" / "Dockerfile") or DEFAULT_WORKDIR
    if not isinstance(workdir, str) or not workdir.startswith("/"):
        raise HarborTaskError(f"{where}: [environment] workdir must be an absolute path, got {workdir!r}")
    return str(PurePosixPath(workdir))


def dockerfile_workdir(dockerfile: Path) -> str | None:
    """The last WORKDIR of the Dockerfile's final stage (a FROM resets it; a relative one joins the one before),
    as Harbor reads it (`harbor.environments.definition.parse_dockerfile_workdir`); None without one."""
    if not dockerfile.is_file():
        return None
    workdir: str | None = None
    text = dockerfile.read_text(encoding="utf-8", errors="replace").replace("\\\n", " ")
    for line in text.splitlines():
        words = line.strip().split(None, 1)
        if not words or words[0].startswith("#"):
            continue
        keyword = words[0].upper()
        if keyword == "FROM":
            workdir = None
        elif keyword == "WORKDIR" and len(words) == 2:
            value = words[1].strip().strip('"')
            workdir = value if value.startswith("/") else str(PurePosixPath(workdir or "/") / value)
    return workdir


# ---------------------------------------------------------------------------------------------------
# Grading: the task's tests after the episode
# ---------------------------------------------------------------------------------------------------
@dataclass
class Verdict:
    """What the task's tests said about an episode."""

    reward: float | None
    """The reward, or None with `error` saying why (the trajectory then fails: never a silent 0)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Every reward reward.json named (reward.txt: {"reward": x})."""
    error: str | None = None
    exit_code: int | None = None
    timed_out: bool = False
    output: str = ""
    """The tail of the test script's output (also in /logs/verifier/test-stdout.txt)."""
    wall_s: float = 0.0


def verify(task: HarborTask, workdir: Path, *, timeout_s: float | None = None, weak: bool = False,
           base_dir: str | None = None, cancel: threading.Event | None = None) -> Verdict:
    """Run the task's tests/test.sh on the episode's working directory `workdir` (blocking) and read the reward
    it wrote. The script runs in the command sandbox as its own user with no network: `workdir` at the task's
    workdir, a copy of tests/ at /tests, a fresh /logs; its limit is `timeout_s` or the task's."""
    from turnrl.agents.sandbox import run_sandboxed

    limit = timeout_s or task.verifier_timeout_s
    with tempfile.TemporaryDirectory(prefix="turnrl-verifier-", dir=base_dir, ignore_cleanup_errors=True) as scratch:
        tests, logs = Path(scratch, "tests"), Path(scratch, "logs")
        shutil.copytree(task.tests_dir, tests, symlinks=True)
        (tests / "test.sh").chmod(0o755)
        (logs / "verifier").mkdir(parents=True)
        result = run_sandboxed(
            ["/bin/sh", "-c", f"{TESTS_DIR}/test.sh"], cwd=workdir, write_paths=[logs], timeout_s=limit,
            network="none", weak=weak, base_dir=base_dir, env=task.verifier_env, cancel=cancel,
            mounts={task.workdir: workdir, TESTS_DIR: tests, LOGS_DIR: logs}, workdir=task.workdir,
        )
        (logs / "verifier" / "test-stdout.txt").write_text(result.output)
        verdict = Verdict(None, exit_code=result.exit_code, timed_out=result.timed_out, output=result.output,
                          wall_s=result.wall_s)
        if result.cancelled:
            verdict.error = "the episode was cancelled while its tests ran"
        elif result.timed_out:
            verdict.error = f"the task's tests ran past their limit of {limit:g} s and were killed"
        else:
            try:
                verdict.reward, verdict.rewards = read_reward(logs / "verifier")
            except HarborTaskError as e:
                verdict.error = f"{e} (tests/test.sh exit status {result.exit_code})"
    return verdict


def read_reward(verifier_dir: Path) -> tuple[float, dict[str, float]]:
    """(reward, all rewards) from reward.json (a number, or an object of numbers: its `reward`, or its only one)
    or else reward.txt (a number), as Harbor reads them; HarborTaskError says what is wrong."""
    as_json, as_text = verifier_dir / "reward.json", verifier_dir / "reward.txt"
    if as_json.exists():
        try:
            value = json.loads(as_json.read_text(encoding="utf-8", errors="replace") or "null")
        except json.JSONDecodeError as e:
            raise HarborTaskError(f"the task's tests wrote an invalid /logs/verifier/reward.json ({e.msg})") from None
        rewards = value if isinstance(value, dict) else {"reward": value}
        if not rewards or not all(_is_finite(v) for v in rewards.values()):
            raise HarborTaskError(f"/logs/verifier/reward.json must hold finite numbers, got {value!r:.200}")
        if "reward" not in rewards and len(rewards) != 1:
            raise HarborTaskError(f"/logs/verifier/reward.json holds several rewards {sorted(rewards)} and none is "
                                  "named `reward`: which one trains?")
        return float(rewards.get("reward", next(iter(rewards.values())))), {k: float(v) for k, v in rewards.items()}
    if as_text.exists():
        text = as_text.read_text(encoding="utf-8", errors="replace").strip()
        try:
            reward = float(text)
        except ValueError:
            raise HarborTaskError(f"/logs/verifier/reward.txt must hold a number, got {text[:100]!r}") from None
        if not math.isfinite(reward):
            raise HarborTaskError(f"/logs/verifier/reward.txt holds {text!r}, not a finite number")
        return reward, {"reward": reward}
    raise HarborTaskError("the task's tests wrote no reward (neither /logs/verifier/reward.txt nor reward.json)")


def _is_finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
