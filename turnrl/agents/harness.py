"""`agent: harness`: a coding-agent CLI (Claude Code, Codex, opencode, or any CLI) runs each episode, against the
policy behind turnrl's proxy, on a task whose tests give the reward.

    rollout:
      agent: harness
      harness: opencode            # claude-code | codex | opencode, or {command: [...], env: {...}, api: chat}
    train_data: tasks/             # a folder of Harbor tasks (turnrl.agents.harbor), or rows with a prompt

For each trajectory (`run_harness`):
1. a run folder of its own (mode 0700): `work/`, the task's working directory, empty at the start, which the CLI
   sees at the task's path (`/app` unless the task says otherwise), and `home/`, the CLI's HOME, where its
   configuration is written pointing at this episode's URL;
2. a session on the in-process proxy (turnrl.agents.openai_agent.gateway: the rollout's engine and chat template,
   on 127.0.0.1 behind a random token), whose per-session URL is the CLI's endpoint: every call it makes is
   recorded token-exactly (turnrl.serve.sessions) and its calls run on the rollout's event loop, as `drive`'s do;
3. the CLI in the command sandbox (turnrl.agents.sandbox): its own unprivileged user, HOME and /tmp, reads by
   allow-list, writes only its task and HOME, no network but the proxy's port, killed with every process it
   started at its wall-clock limit (`harness.timeout_s`, else the task's `[agent] timeout_sec`, else 900 s);
4. its end. A CLI that crashed (exit status not 0), ran past its limit or never called the model ends the episode
   FAILED (env_error / timeout) with the reason, its exit status and the last lines of its output; it is not
   scored, not trained and not in its group's baseline (a failure is not a zero reward). Otherwise the task's
   tests run (turnrl.agents.harbor.verify) and their reward is the episode's; tests that hang or write no reward
   fail the episode the same way. A row without a Harbor task has no tests: the configured reward function
   scores it;
5. the session's calls become the episode's trajectories (one per history the CLI kept: a title call or a
   sub-agent is a trajectory of its own, all with the episode's `episode_id` and reward), with the run's
   account in `info["harness"]` and the tests' in `info["tests"]`;
6. whatever happened (an exception, a cancelled or timed-out trajectory), the session is closed, the engine's
   cache released, every process of the CLI killed and the run folder removed.

A built-in harness is data (`BUILTIN`): its command, the API it speaks, its environment and the configuration
files it reads from HOME, filled in per run with {instruction}, {base_url}, {api_key}, {model}, {workdir} and
{home}. Any other CLI is `harness: {command: [...], env: {...}, api: anthropic | responses | chat}`: it gets
{base_url} (with /v1 for the OpenAI APIs, without for Anthropic's, as each client appends its own path) and the
usual variables of its API (OPENAI_BASE_URL and OPENAI_API_KEY, or ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY).
The CLIs are found in `harness.search_path`, then ./.harnesses and the source checkout's .harnesses (`make
harnesses`), then PATH; nothing is downloaded at run time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from turnrl.agents.harbor import DEFAULT_WORKDIR, HarborTask, Verdict, load_task, verify
from turnrl.agents.openai_agent import Gateway, close_session, gateway
from turnrl.agents.sandbox import CommandLimits, CommandResult, run_sandboxed
from turnrl.data import prompt_messages
from turnrl.rollout.episode import RolloutContext
from turnrl.serve.sessions import Session, assemble_trajectories
from turnrl.types import TerminationReason, Trajectory

log = logging.getLogger(__name__)

Api = Literal["anthropic", "responses", "chat"]
DEFAULT_TIMEOUT_S = 900.0
"""The CLI's wall-clock limit when neither the harness config nor the task sets one (Harbor's template task)."""
MODEL_NAME = "turnrl-policy"
"""The model name the gateway answers to and the CLIs are configured with."""


@dataclass(frozen=True)
class HarnessSpec:
    """A CLI as data: how it is started and configured for one episode."""

    command: tuple[str, ...]
    """argv; command[0] is looked up in the search path (unless it is a path)."""
    api: Api
    """The API the CLI speaks: it decides {base_url} and the variables set for it."""
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)
    """Files written into its HOME before it starts (its configuration), by path relative to HOME."""
    package: str | None = None
    """The npm package it comes from (for the error when it is not installed)."""


_CLAUDE_MODELS = ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
                  "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")

BUILTIN: dict[str, HarnessSpec] = {
    # Claude Code 2.1: print mode, every tool allowed (it refuses that as root; the sandbox's user is not root);
    # every model alias it may pick (the small one for titles, sub-agents) is the policy; no telemetry or updates.
    "claude-code": HarnessSpec(
        command=("claude", "-p", "{instruction}", "--permission-mode", "bypassPermissions", "--model", "{model}",
                 "--output-format", "stream-json", "--verbose"),
        api="anthropic",
        env={"ANTHROPIC_BASE_URL": "{base_url}", "ANTHROPIC_API_KEY": "{api_key}",
             **dict.fromkeys(_CLAUDE_MODELS, "{model}"), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
             "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1"},
        package="@anthropic-ai/claude-code",
    ),
    # Codex CLI 0.171: `codex exec` with its own sandbox and approvals off (turnrl's sandbox is the boundary); a
    # model provider of its own pointing at the session (Responses API), its key in an environment variable.
    "codex": HarnessSpec(
        command=("codex", "exec", "--dangerously-bypass-approvals-and-sandbox", "--skip-git-repo-check", "--json",
                 "--model", "{model}", "--", "{instruction}"),
        api="responses",
        env={"CODEX_HOME": "{home}/.codex", "TURNRL_API_KEY": "{api_key}"},
        files={".codex/config.toml": (
            'model = "{model}"\nmodel_provider = "turnrl"\ncheck_for_update_on_startup = false\n\n'
            '[model_providers.turnrl]\nname = "turnrl"\nbase_url = "{base_url}"\nenv_key = "TURNRL_API_KEY"\n'
            'wire_api = "responses"\n')},
        package="@openai/codex",
    ),
    # opencode 1.18: `opencode run` with permissions auto-approved, an OpenAI-compatible provider (chat
    # completions; the provider package is bundled in its binary) pointing at the session; nothing fetched or
    # installed at run time (models list, updates, language servers, default plugins, sharing).
    "opencode": HarnessSpec(
        command=("opencode", "run", "--model", "turnrl/{model}", "--format", "json", "--auto", "{instruction}"),
        api="chat",
        env=dict.fromkeys(("OPENCODE_DISABLE_MODELS_FETCH", "OPENCODE_DISABLE_AUTOUPDATE", "OPENCODE_DISABLE_LSP_DOWNLOAD",
                           "OPENCODE_DISABLE_DEFAULT_PLUGINS", "OPENCODE_DISABLE_SHARE"), "1"),
        files={".config/opencode/opencode.json": (
            '{"$schema": "https://opencode.ai/config.json", "autoupdate": false, "share": "disabled", '
            '"model": "turnrl/{model}", "provider": {"turnrl": {"npm": "@ai-sdk/openai-compatible", '
            '"name": "turnrl", "options": {"baseURL": "{base_url}", "apiKey": "{api_key}"}, '
            '"models": {"{model}": {"name": "{model}"}}}}}\n')},
        package="opencode-ai",
    ),
}
"""The built-in harnesses, by name."""

_API_ENV: dict[str, dict[str, str]] = {
    "anthropic": {"ANTHROPIC_BASE_URL": "{base_url}", "ANTHROPIC_API_KEY": "{api_key}", "ANTHROPIC_MODEL": "{model}"},
    "responses": {"OPENAI_BASE_URL": "{base_url}", "OPENAI_API_KEY": "{api_key}", "OPENAI_MODEL": "{model}"},
    "chat": {"OPENAI_BASE_URL": "{base_url}", "OPENAI_API_KEY": "{api_key}", "OPENAI_MODEL": "{model}"},
}
"""What a CLI of each API gets besides its own `env` (a custom harness's; the built-ins set their own)."""


@dataclass(frozen=True)
class HarnessSettings:
    """One harness agent's settings (from `rollout.harness`: turnrl.build.harness_settings)."""

    name: str
    """The built-in's name, or `custom`."""
    spec: HarnessSpec
    executable: str
    """command[0], found."""
    read_paths: tuple[str, ...] = ()
    """What the CLI may read besides the sandbox's defaults: its installation."""
    timeout_s: float | None = None
    test_timeout_s: float | None = None
    weak: bool = False
    tool_parser: str = "hermes"
    model: str = MODEL_NAME
    base_dir: str | None = None
    memory_mb: int | None = None


def harness_spec(name: str | None, command: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 api: Api | None = None) -> HarnessSpec:
    """A built-in by `name` (its env extended by `env`), or a CLI of your own by `command` and `api`."""
    if name and command:
        raise ValueError(f"harness: give either a built-in name ({name!r}) or your own command, not both")
    if name:
        if name not in BUILTIN:
            raise ValueError(f"harness: unknown harness {name!r}; built-in: {', '.join(sorted(BUILTIN))} (or give "
                             "`command` and `api` for your own CLI)")
        spec = BUILTIN[name]
        return HarnessSpec(spec.command, api or spec.api, {**spec.env, **(env or {})}, spec.files, spec.package)
    if not command or api is None:
        raise ValueError("harness: a CLI of your own needs `command` (its argv, e.g. [my-agent, --task, "
                         "'{instruction}']) and `api` (anthropic, responses or chat)")
    return HarnessSpec(tuple(command), api, {**_API_ENV[api], **(env or {})})


def harness_search_path(extra: Sequence[str] = ()) -> list[str]:
    """Where CLIs are looked for before PATH: `extra`, $TURNRL_HARNESSES, ./.harnesses and the source
    checkout's .harnesses (`make harnesses` installs there)."""
    checkout = Path(__file__).resolve().parents[2]
    roots = [os.environ.get("TURNRL_HARNESSES"), ".harnesses", str(checkout / ".harnesses")]
    return [*extra, *(str(Path(r) / "node_modules" / ".bin") for r in roots if r)]


def find_cli(spec: HarnessSpec, search: Sequence[str], name: str) -> tuple[str, tuple[str, ...]]:
    """(the executable, the folders it needs to read: its npm installation); ValueError saying how to install
    it when it is nowhere."""
    program = spec.command[0]
    found = os.path.abspath(program) if "/" in program else next(
        (str(Path(d, program).absolute()) for d in search if Path(d, program).exists()), shutil.which(program))
    if not found or not os.access(found, os.X_OK):
        how = (f"run `make harnesses` (or `npm install -g {spec.package}` at the version harnesses/package.json pins)"
               if spec.package else "install it, or give its path")
        raise ValueError(f"harness {name}: the CLI {program!r} is not installed (looked in {', '.join(search)} and "
                         f"PATH); {how}")
    real = Path(os.path.realpath(found))
    modules = next((p for p in real.parents if p.name == "node_modules"), None)
    return found, (str(modules),) if modules is not None else ()


# ---------------------------------------------------------------------------------------------------
# One episode
# ---------------------------------------------------------------------------------------------------
@dataclass
class _Run:
    """The folders of one episode's run."""

    root: Path
    work: Path
    home: Path


def make_harness_agent(settings: HarnessSettings) -> Callable[[RolloutContext, dict[str, Any]], Any]:
    """The `harness` agent of these settings (registered by turnrl.build)."""

    async def harness(ctx: RolloutContext, sample: dict[str, Any]) -> list[Trajectory]:
        return await run_harness(ctx, sample, settings)

    return harness


async def run_harness(ctx: RolloutContext, sample: dict[str, Any], settings: HarnessSettings) -> list[Trajectory]:
    """One episode of the CLI on this row (module docstring)."""
    task = _task_of(sample)
    gw = gateway(ctx.engine, ctx.renderer, settings.tool_parser)
    session = gw.proxy.open_session(ctx.trajectory_id, loop=asyncio.get_running_loop(), sampling=ctx.sampling,
                                    max_new_tokens=ctx.limits.max_new_tokens, max_calls=ctx.limits.max_turns)
    t0, limit = time.perf_counter(), _agent_limit(settings, task)
    try:
        with _run_folder(settings.base_dir) as run:
            agent = await _blocking(lambda cancel: _run_cli(settings, task, sample, gw, session, run, limit, cancel))
            gw.proxy.close_session(session.id)  # the CLI and all it started are gone: a late call gets a 404
            failure = _agent_failure(agent, session, settings.name, limit)
            verdict = None
            if failure is None and task is not None:
                verdict = await _blocking(lambda cancel: verify(
                    task, run.work, timeout_s=settings.test_timeout_s, weak=settings.weak,
                    base_dir=settings.base_dir, cancel=cancel))
    except asyncio.CancelledError:  # trajectory_timeout_s: keep what was generated for the FAILED record
        if session.calls:
            ctx.partial = _assemble(ctx, session, None)[0]
        raise
    finally:
        await close_session(ctx, gw, session)
    return _episode(ctx, session, settings, agent, verdict, failure, time.perf_counter() - t0)


def _task_of(sample: dict[str, Any]) -> HarborTask | None:
    path = sample.get("harbor_task")
    return load_task(path) if path else None


def _instruction(sample: dict[str, Any], task: HarborTask | None) -> str:
    """The task's instruction, else the text of the row's prompt (its messages, by role when several)."""
    if task is not None:
        return task.instruction
    messages = prompt_messages(sample)
    texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    if len(messages) != len(texts):
        raise ValueError("the harness agent gives the CLI text only; this row's prompt holds images")
    return texts[0] if len(texts) == 1 else "\n\n".join(f"{m['role']}: {m['content']}" for m in messages)


@contextlib.contextmanager
def _run_folder(base_dir: str | None) -> Iterator[_Run]:
    root = Path(tempfile.mkdtemp(prefix="turnrl-harness-", dir=base_dir))
    try:
        (root / "work").mkdir()
        (root / "home").mkdir()
        yield _Run(root, root / "work", root / "home")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_cli(settings: HarnessSettings, task: HarborTask | None, sample: dict[str, Any], gw: Gateway,
             session: Session, run: _Run, limit: float, cancel: threading.Event) -> CommandResult:
    """Write the CLI's configuration into its HOME and run it in the sandbox (blocking, in a worker thread)."""
    spec = settings.spec
    workdir = task.workdir if task is not None else (None if settings.weak else DEFAULT_WORKDIR)
    url = gw.session_url(session.id)  # .../sessions/<id>/v1
    values = {"instruction": _instruction(sample, task), "api_key": gw.token, "model": settings.model,
              "base_url": url.removesuffix("/v1") if spec.api == "anthropic" else url,
              "workdir": workdir or str(run.work), "home": str(run.home)}
    for relative, text in spec.files.items():
        path = run.home / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fill(text, values))
    argv = [settings.executable, *(fill(a, values) for a in spec.command[1:])]
    env = {**(task.agent_env if task else {}), **{k: fill(v, values) for k, v in spec.env.items()}}
    return run_sandboxed(
        argv, cwd=run.work, home=run.home, env=env, ports=[gw.http.port], timeout_s=limit,
        read_paths=settings.read_paths, weak=settings.weak, base_dir=settings.base_dir, cancel=cancel,
        mounts={workdir: run.work} if workdir else None, workdir=workdir,
        limits=CommandLimits(memory_mb=settings.memory_mb))


_FIELD = re.compile(r"\{(instruction|base_url|api_key|model|workdir|home)\}")


def fill(text: str, values: Mapping[str, str]) -> str:
    """`text` with each {name} of the harness variables replaced (other braces, as in JSON, are left alone)."""
    return _FIELD.sub(lambda m: values[m.group(1)], text)


def _agent_limit(settings: HarnessSettings, task: HarborTask | None) -> float:
    return settings.timeout_s or (task.agent_timeout_s if task is not None else None) or DEFAULT_TIMEOUT_S


T = TypeVar("T")
_THREADS = ThreadPoolExecutor(max_workers=256, thread_name_prefix="turnrl-harness")
"""Where the blocking sandbox runs wait (the default executor has a few threads: it would cap the episodes in
flight far below `rollout.concurrency`)."""


async def _blocking(fn: Callable[[threading.Event], T]) -> T:
    """`fn(cancel)` in a worker thread; when this coroutine is cancelled, `cancel` is set (the sandbox kills its
    run) and the thread is awaited a little while, so the run folder is only removed after it."""
    cancel = threading.Event()
    future = asyncio.get_running_loop().run_in_executor(_THREADS, fn, cancel)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        cancel.set()
        await asyncio.wait({future}, timeout=30)
        raise


# ---------------------------------------------------------------------------------------------------
# How the episode ended
# ---------------------------------------------------------------------------------------------------
def _agent_failure(agent: CommandResult, session: Session, name: str, limit: float
                   ) -> tuple[TerminationReason, str] | None:
    """Why the CLI's run cannot be scored, or None: it crashed, ran past its limit, or never called the model.
    A CLI that stopped because the episode's call limit refused it (rollout.max_turns) ran its course."""
    tail = last_lines(agent.output)
    if agent.timed_out:
        return TerminationReason.TIMEOUT, (f"harness {name} ran past its limit of {limit:g} s and was killed with "
                                           f"every process it started; its last output:\n{tail}")
    if not session.calls:
        how = f"exited with status {agent.exit_code}" if agent.exit_code else "exited"
        return TerminationReason.ENV_ERROR, (f"harness {name} {how} and no model call was answered (it made none, or "
                                             f"each was refused); its last output:\n{tail}")
    if agent.exit_code != 0 and not session.limit_reached:
        return TerminationReason.ENV_ERROR, (f"harness {name} crashed (exit status {agent.exit_code}) after "
                                             f"{len(session.calls)} model calls; its last output:\n{tail}")
    return None


def last_lines(output: str, lines: int = 12, chars: int = 2000) -> str:
    """The end of a CLI's output: its last `lines` lines, at most `chars` characters."""
    return "\n".join(output.rstrip().splitlines()[-lines:])[-chars:] or "(no output)"


def _episode(ctx: RolloutContext, session: Session, settings: HarnessSettings, agent: CommandResult,
             verdict: Verdict | None, failure: tuple[TerminationReason, str] | None, seconds: float
             ) -> list[Trajectory]:
    if failure is None and verdict is not None and verdict.error is not None:
        reason = TerminationReason.TIMEOUT if verdict.timed_out else TerminationReason.ENV_ERROR
        failure = (reason, f"{verdict.error}; its last output:\n{last_lines(verdict.output)}")
    end = failure or ((TerminationReason.MAX_TURNS, None) if session.limit_reached else None)
    if not session.calls:
        traj = ctx.failed(failure[0] if failure else TerminationReason.ENV_ERROR,
                          failure[1] if failure else "the harness made no model call")
        trajectories = [traj]
    else:
        trajectories = _assemble(ctx, session, end)
    reward = verdict.reward if verdict is not None and failure is None else None
    for traj in trajectories:
        traj.episode_id = session.id
        traj.reward = reward
        traj.metrics["total_time_s"] = seconds
        traj.info["harness"] = _harness_info(settings, agent)
        if verdict is not None:
            traj.info["tests"] = _tests_info(verdict)
    return trajectories


def _assemble(ctx: RolloutContext, session: Session, end: tuple[TerminationReason, str | None] | None
              ) -> list[Trajectory]:
    return assemble_trajectories(session, group_id=ctx.group_id, sample_index=ctx.sample_index, sample=ctx.sample,
                                 agent=ctx.agent_name, end=end)


def _harness_info(settings: HarnessSettings, agent: CommandResult) -> dict[str, Any]:
    return {"name": settings.name, "exit_code": agent.exit_code, "timed_out": agent.timed_out,
            "wall_s": round(agent.wall_s, 3), "output_tail": last_lines(agent.output, 40, 8000),
            "sandbox": {k: agent.layers.get(k) for k in ("uid", "pidns", "mountns", "netns", "landlock", "mounts")}}


def _tests_info(verdict: Verdict) -> dict[str, Any]:
    return {"reward": verdict.reward, "rewards": verdict.rewards, "error": verdict.error,
            "exit_code": verdict.exit_code, "timed_out": verdict.timed_out, "wall_s": round(verdict.wall_s, 3),
            "output_tail": last_lines(verdict.output, 40, 8000)}
