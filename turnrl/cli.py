"""`turnrl rollout | train | sft | eval | export | serve | view | replay | doctor`."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from turnrl.config import RolloutConfig, SFTConfig, TrainConfig
    from turnrl.train.parallel import Parallel

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Multi-turn agentic RL for LLMs and VLMs.")
console = Console(soft_wrap=not sys.stdout.isatty())  # into a file or a pipe: one line per line, never wrapped


def _setup_logging(verbose: bool) -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if console.is_terminal:
        handler: logging.Handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
        fmt = "%(message)s"
    else:  # a file or a pipe: plain records (Rich's columns would wrap each at 80 characters)
        handler, fmt = logging.StreamHandler(console.file), "%(asctime)s %(levelname)s %(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler], force=True)


def _fail(message: str, code: int = 2) -> NoReturn:
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def _bad_input(*errors: type[BaseException]) -> Iterator[None]:
    """Inside: one of `errors` ends the command as bad input, exit 2 and its message (a pydantic error of the
    flags' config names each bad flag), never a traceback."""
    from pydantic import ValidationError

    try:
        yield
    except errors as e:
        _fail(_flag_errors(e) if isinstance(e, ValidationError) else str(e))


T = TypeVar("T")


def _guarded(verbose: bool, body: Callable[[], T]) -> T:
    """A command's body with one error boundary: any error is one paragraph naming what was wrong (the
    exception's own message, which names the field or file), the traceback only with -v. Bad input exits 2;
    a run that failed (a stall, an engine that died, a bug) exits 1."""
    try:
        return body()
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except Exception as e:
        if verbose:
            console.print_exception()
        _fail(_one_paragraph(e), 2 if _is_bad_input(e) else 1)
        raise  # unreachable: _fail raises


def _one_paragraph(e: BaseException) -> str:
    from turnrl.observe.watchdog import Stalled

    if isinstance(e, SyntaxError):
        message = f"{e.filename} line {e.lineno}: {type(e).__name__}: {e.msg}"
    elif isinstance(e, Stalled | KeyError) or not str(e):
        message = f"{type(e).__name__}: {e}"
    else:
        message = str(e)
    notes = [n for n in getattr(e, "__notes__", ()) if n not in message]
    hint = "" if _is_bad_input(e) else " (run with -v for the traceback)"
    return " ".join([message, *notes]).rstrip() + hint


def _is_bad_input(e: BaseException) -> bool:
    from turnrl.engines.base import EngineError

    return isinstance(e, ValueError | OSError | ImportError | AttributeError | SyntaxError | EngineError)


Opt = typer.Option
_DATA_HELP = ("JSONL/parquet rows with a `prompt` (string or chat messages), or a folder of Harbor tasks. An env that opens "
              "its episodes itself (reasoning_gym:, openenv:, textarena:) takes rows without prompt, or none: --limit N "
              "runs seeds 0..N-1.")
_ENV_HELP = ("Environment: built-in name, dotted module, .py file with build_env, or reasoning_gym:NAME, "
             "openenv:MODULE:CLASS, openenv+http://HOST:PORT, textarena:GAME-v0 (docs/ecosystems.md).")
_SERVER_HELP = ("Rollout server URL (turnrl serve --scheduler/--env/...): it runs the turns with its own rollout "
                "settings; n, sampling and rewards stay here.")
_TOOLS_HELP = ("Function-tool .py file, tool-config .yaml, or MCP server: 'mcp:COMMAND [ARGS...]' (stdio) or "
               "mcp+http://HOST:PORT/PATH (repeatable).")


_WHERE_TURNS_RUN = ("--env, --scheduler, --plugin, --tools, --agent-path, --harness and --ray-workers configure where "
                    "the turns run; with --server the rollout server runs them: pass these to `turnrl serve` instead")


@app.command()
def rollout(
    model: Annotated[str, Opt(help="Local HF directory, hub id, or built-in name (smollm2-135m-instruct, tiny-qwen3).")],
    out: Annotated[Path, Opt(help="Output trajectory JSONL (docs/trajectory-format.md).")],
    data: Annotated[Path | None, Opt(help=_DATA_HELP)] = None,
    env: Annotated[str | None, Opt(help=_ENV_HELP)] = None,
    env_config: Annotated[str | None, Opt(help='JSON env config over --custom-config, e.g. \'{"size": 200}\'.')] = None,
    n: Annotated[int, Opt(help="Samples per prompt.")] = 1,
    max_turns: Annotated[int | None, Opt(help="Model turns per trajectory (default 4, or --custom-config's).")] = None,
    max_new_tokens: Annotated[int, Opt(help="Tokens per model turn.")] = 256,
    token_budget: Annotated[int | None, Opt(help="Tokens after the prompt for the whole trajectory.")] = None,
    custom_config: Annotated[Path | None, Opt(help="YAML passed to build_env as `config`.")] = None,
    temperature: Annotated[float, Opt(help="Sampling temperature (0 = greedy).")] = 1.0,
    top_p: Annotated[float, Opt(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int | None, Opt(help="Seed of the samplers (reproducible trajectories).")] = None,
    agent: Annotated[str | None, Opt(help="Agent of rows without agent_name (default env_agent; tool_agent: --tools).")] = None,
    agents: Annotated[list[str], Opt("--agent-path", help="Extra agent loop: [name=]file.py:function.")] = [],
    tools: Annotated[list[str], Opt(help=_TOOLS_HELP)] = [],
    tool_timeout: Annotated[float | None, Opt(help="Seconds a tool call may take (tool agent; default 30).")] = None,
    tool_parser: Annotated[str, Opt(help="Tool-call format (hermes, qwen3_coder).")] = "hermes",
    harness: Annotated[str | None, Opt(help="Coding-agent CLI per episode: claude-code|codex|opencode.")] = None,
    scheduler: Annotated[str | None, Opt(help="ms-swift-style scheduler by name.")] = None,
    gym_env: Annotated[str | None, Opt(help="Gym env of the gym scheduler (ms-swift's --gym_env; env_config.gym_env).")] = None,
    plugin: Annotated[list[str], Opt(help="Python file imported at start-up (repeatable).")] = [],
    chat_template_kwargs: Annotated[str | None, Opt(help='JSON, e.g. \'{"enable_thinking": false}\'.')] = None,
    sanity_check: Annotated[str, Opt(help="strict | ignore_strippable | disable.")] = "strict",
    sanity_check_every: Annotated[int, Opt(help="Check 1 trajectory in N (the first 64, then by id hash; 1 = all).")] = 1,
    concurrency: Annotated[str, Opt(help="Trajectories in flight: a number, or auto (follows the engines' KV cache).")] = "64",
    env_timeout: Annotated[float | None, Opt(help="Seconds an env step may take (then FAILED; 0 = no limit).")] = 60.0,
    env_retries: Annotated[int, Opt(help="Extra attempts of a failing env step.")] = 0,
    watchdog: Annotated[float, Opt(help="Seconds of no progress before the run fails naming what hung (0 = off).")] = 600.0,
    max_batch_size: Annotated[int, Opt(help="Rows decoded together by the embedded engine.")] = 16,
    ray_workers: Annotated[int, Opt(help="Rollout workers on Ray, the engine a Ray actor (0 = all in this process).")] = 0,
    limit: Annotated[int | None, Opt(help="Use only the first N rows (without --data: N episodes, seeds 0..N-1).")] = None,
    reward: Annotated[str | None, Opt(help="Reward function (env, env_last, math, file.py:fn).")] = None,
    answer_key: Annotated[str, Opt(help="Ground-truth column of --reward (slime's --label-key).")] = "answer",
    trace_uri: Annotated[str | None, Opt(help="MLflow tracking URI: one trace per trajectory (turnrl.observe.tracing).")] = None,
    max_traces: Annotated[int, Opt(help="Trajectories traced to MLflow (the first to finish).")] = 16,
    server: Annotated[str | None, Opt(help=_SERVER_HELP)] = None,
    verbose: Annotated[bool, Opt("--verbose", "-v")] = False,
) -> None:
    """Roll out trajectories of a model in an environment and write them as JSONL."""
    _setup_logging(verbose)
    if server and (env or scheduler or plugin or tools or agents or ray_workers or harness):
        _fail(_WHERE_TURNS_RUN)
    from turnrl.config import EngineConfig, RolloutConfig, SamplingConfig, effective_rollout_config
    with _bad_input(ValueError, FileNotFoundError, ImportError):  # ConfigError, DataError, pydantic's errors...
        given = {k: v for k, v in {"max_turns": max_turns, "agent": agent, "harness": harness}.items() if v is not None}
        cfg = effective_rollout_config(RolloutConfig(
            env=env, custom_config=str(custom_config) if custom_config else None, agents=agents,
            tools=tools, tool_parser=tool_parser, scheduler=scheduler, plugins=plugin, n=n, **given,
            tool_agent={"tool_timeout_s": tool_timeout} if tool_timeout else {},
            env_config={**_json_flag("--env-config", env_config), **({"gym_env": gym_env} if gym_env else {})},
            max_new_tokens=max_new_tokens, token_budget=token_budget, concurrency=_concurrency_flag(concurrency),
            env_timeout_s=env_timeout or None, env_retries=env_retries, watchdog_s=watchdog or None,
            sanity_check=sanity_check, sanity_check_every=sanity_check_every, chat_template_kwargs=_json_flag("--chat-template-kwargs", chat_template_kwargs),
            trace_uri=trace_uri, max_traces_per_step=max_traces,
            sampling=SamplingConfig(temperature=temperature, top_p=top_p, seed=seed)))
        rows = _rollout_rows(data, limit, cfg)
        engine_cfg = EngineConfig(max_batch_size=max_batch_size, distributed="ray" if ray_workers else "none",
                                  ray_workers=max(ray_workers, 1))
    _guarded(verbose, lambda: asyncio.run(_rollout(model, cfg, engine_cfg, rows, out, reward, answer_key, server)))


def _concurrency_flag(value: str) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--concurrency must be a number >= 1 or auto, got {value!r}")
    return int(value)


def _rollout_rows(data: Path | None, limit: int | None, cfg: RolloutConfig) -> list[dict[str, Any]]:
    """The rows of `turnrl rollout`: --data's first --limit rows, or, without --data, --limit seed-only rows for an
    env that opens its episodes itself."""
    from turnrl.build import env_opens_episode
    from turnrl.data import load_rows, seed_rows

    try:
        opens = env_opens_episode(cfg)
    except Exception:
        if data is None:
            raise
        opens = False  # the env's own error comes at start-up (_guarded: with its traceback under -v)
    if data is not None:
        return load_rows(data, prompt_required=not opens)[:limit]
    if not opens:
        raise ValueError("--data is required: this env does not open its episodes itself (only reasoning_gym:, "
                         "openenv:, textarena: envs, and envs whose build_env says opens_episode, run without rows)")
    if limit is None:
        raise ValueError("without --data, --limit N says how many episodes to run (seeds 0..N-1)")
    return seed_rows(limit)


async def _rollout(model_name, cfg, engine_cfg, rows, out: Path, reward: str | None, answer_key: str = "answer",
                   server: str | None = None) -> None:
    from turnrl.build import build_stack
    from turnrl.config import RewardConfig
    from turnrl.observe.stats import RolloutStats, TrajectoryWriter

    reward_cfg = RewardConfig(function=reward, answer_key=answer_key) if reward else None
    with console.status(f"loading {model_name}"):  # errors: one paragraph from _guarded
        stack = build_stack(model_name, cfg, engine_cfg, reward=reward_cfg, server=server)
    stats, tracer = RolloutStats(), stack.tracer
    try:
        with TrajectoryWriter(out) as writer, _progress() as progress:
            task = progress.add_task("rollout", total=len(rows) * cfg.n, info="")
            assert stack.rollout is not None  # build_stack with a rollout config
            async for traj in stack.rollout.stream(rows, cfg.n):
                tracer.export(traj)
                writer.write(traj)
                stats.add(traj)
                s = stats.summary()
                progress.update(task, advance=1, info=f"turns {s['rollout/turns_mean']:.1f}  "
                                                      f"{s['rollout/tokens_per_s']:.0f} tok/s")
    finally:
        stack.close()
    console.print(stats.table(f"rollout of {model_name} → {out}"))
    if tracer.enabled:
        console.print(f"traced {tracer.exported} trajectories to {cfg.trace_uri} (experiment {cfg.trace_experiment!r}, "
                      f"{tracer.failures} failures)")


_FLAGS = {"env_timeout_s": "--env-timeout", "watchdog_s": "--watchdog", "plugins": "--plugin", "agents": "--agent-path",
          "max_traces_per_step": "--max-traces"}
"""Config fields whose `turnrl rollout` flag is not simply --field-name."""


def _flag_errors(error: Any) -> str:
    """A pydantic ValidationError of the flags' config, one clause per bad flag."""
    clauses = []
    for err in error.errors():
        loc = [str(part) for part in err["loc"]]
        field = "harness" if loc[:1] == ["harness"] else loc[-1] if loc else ""  # --harness is a whole section
        flag = _FLAGS.get(field, "--" + field.replace("_", "-"))
        clauses.append(f"{flag}: {err['msg']} (got {err.get('input')!r:.60})")
    return "; ".join(clauses)


def _json_flag(flag: str, value: str | None) -> dict[str, Any]:
    try:
        parsed = json.loads(value or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: invalid JSON ({e.msg} at column {e.colno}): {value!r:.80}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{flag}: expected a JSON object, got {type(parsed).__name__}")
    return parsed


def _progress() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[info]}"), console=console)


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="Training config YAML (turnrl.config.TrainConfig).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted key=value overrides.")] = None,
    run_dir: Annotated[Path | None, Opt(help="This run's directory (default: a new OUTPUT_DIR/<timestamp>); it must "
                                             "be empty unless --resume or --overwrite.")] = None,
    resume: Annotated[bool, Opt("--resume", help="Continue a run from its newest valid checkpoint: `--resume` alone "
                                                 "continues the newest run under output_dir (or --run-dir); "
                                                 "`--resume PATH` the run directory or checkpoint at PATH.")] = False,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace the run in --run-dir (its checkpoints, metrics and "
                                                       "trajectories are deleted first).")] = False,
    scheduler: Annotated[str | None, Opt(help="ms-swift-style scheduler by name (overrides rollout.scheduler).")] = None,
    plugin: Annotated[list[str], Opt(help="Python file imported at start-up (repeatable; extends rollout.plugins).")] = [],
    verbose: Annotated[bool, Opt("--verbose", "-v")] = False,
) -> None:
    """Train a policy with GRPO on multi-turn rollouts. Each run writes its own directory (printed at start):
    OUTPUT_DIR/<timestamp>, or --run-dir; `turnrl train CONFIG --resume [PATH]` continues one. Under torchrun
    each process is one trainer rank (trainer.parallel: fsdp; rank 0 names the run directory for all); with
    trainer.launcher: ray it starts the ranks itself (docs/distributed.md)."""
    _setup_logging(verbose)
    from turnrl.config import ConfigError, TrainConfig
    from turnrl.train.parallel import check_launch
    from turnrl.train.runs import prepare_run

    with _bad_input(ConfigError):
        cfg = _run_config(TrainConfig, config, overrides, run_dir, resume)
        if scheduler is not None:
            cfg.rollout.scheduler = scheduler
        if plugin:
            cfg.rollout.plugins = [*cfg.rollout.plugins, *plugin]
        check_launch(cfg.trainer)  # torchrun's ranks against trainer.world_size / parallel / launcher
        prepare_run(cfg, overwrite=overwrite)  # refuses a non-empty run directory before anything loads
    _guarded(verbose, lambda: run_training(cfg, console=console, overwrite=overwrite))


C = TypeVar("C", bound="TrainConfig")


def _run_config(schema: type[C], config: Path, overrides: list[str] | None, run_dir: Path | None,
                resume: bool) -> C:
    """The config of `turnrl train` or `turnrl sft` with its run flags: --run-dir, --resume [PATH]."""
    from turnrl.config import load_config

    overrides, resume_path = _resume_path(overrides or [], resume)
    cfg = load_config(schema, config, overrides)
    if run_dir is not None:
        cfg.run_dir = str(run_dir)
    if resume:
        cfg.resume = resume_path or True
    return cfg


def _resume_path(items: list[str], resume: bool) -> tuple[list[str], str | None]:
    """`--resume PATH`: the one positional argument that is not a key=value override is the PATH."""
    from turnrl.config import ConfigError

    paths = [item for item in items if "=" not in item]
    if paths and (not resume or len(paths) > 1):
        raise ConfigError(f"override {paths[-1]!r}: expected dotted.key=value" + (
            "" if resume else " (to continue a run, put --resume before its path: --resume PATH)"))
    return [item for item in items if "=" in item], (paths[0] if paths else None)


def run_training(cfg: TrainConfig, console: Console | None = None, parallel: Parallel | None = None, *,
                 overwrite: bool = False) -> list[dict[str, float]]:
    """`turnrl train`: choose the run directory (turnrl.train.runs.prepare_run: a ConfigError for a non-empty one
    without resume or `overwrite`), build the trainer (turnrl.build), train, close; returns the metrics history
    (rank 0's is the one logged). This process is one trainer rank: `parallel`, else as torchrun's environment
    says (one process without it; under torchrun the ranks take rank 0's run directory once the process group
    is up). With `trainer.launcher: ray` and no `parallel` it starts the ranks as Ray actors (each runs this
    function with its own `parallel`, in the run directory chosen here) and returns rank 0's history."""
    from turnrl.build import build_trainer
    from turnrl.observe.plots import plot_curves
    from turnrl.observe.stats import peak_rss_gb

    console = console or Console()
    if parallel is None:  # a Ray trainer rank (parallel given) runs in the directory its driver chose
        _prepare_training(cfg, console, overwrite)
    if cfg.trainer.launcher == "ray" and parallel is None:
        from turnrl.train.ray import train_on_ray

        console.print(_run_line(cfg), soft_wrap=True)
        return train_on_ray(functools.partial(_train_rank, cfg), cfg.trainer.world_size,
                            address=cfg.engine.ray_address, gpus_per_rank=1.0 if cfg.device.startswith("cuda") else 0.0)
    with _starting_run(cfg, parallel) as parallel:
        trainer, stack = build_trainer(cfg, console=console, parallel=parallel, loggers=True)
    if trainer.parallel.is_main:
        console.print(_run_line(cfg), soft_wrap=True)
    failed = True
    try:
        history = asyncio.run(trainer.train())
        if trainer.parallel.is_main:
            plot_curves(history, trainer.out / "curves.png")
        failed = False
    finally:  # the backends get the curves and trajectory samples, then the stack ends the MLflow run
        trajectories = trainer.out / "trajectories"
        trainer.loggers.close([trainer.out / "curves.png", trajectories / "last_step.jsonl",
                               *sorted(trajectories.glob("eval_*.jsonl"))], failed=failed)
        stack.close()
    trainer.parallel.close()  # after a failure a rank just exits: torchrun / the Ray driver stops the others
    if trainer.parallel.is_main:
        trainer.console.print(f"wrote {trainer.out / 'curves.png'}, {trainer.out / 'metrics.jsonl'}, "
                              f"{trainer.out / 'trajectories'}, {trainer.out / 'checkpoints'}", soft_wrap=True)
        peak = peak_rss_gb()
        if peak is not None:
            trainer.console.print(f"peak memory: {peak:.2f} GB resident (this process's maximum RSS)")
    return history


def _prepare_training(cfg: TrainConfig, console: Console, overwrite: bool) -> None:
    """The run directory (rank 0's choice under torchrun) and, said once before anything loads, the settings
    that make training do nothing useful."""
    from rich.markup import escape

    from turnrl.config import training_warnings
    from turnrl.train.runs import prepare_run

    prepare_run(cfg, overwrite=overwrite)
    if os.environ.get("RANK", "0") == "0":
        for warning in training_warnings(cfg):
            console.print(f"[bold yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)


@contextmanager
def _starting_run(cfg: TrainConfig, parallel: Parallel | None) -> Iterator[Parallel]:
    """This process's place among the trainer ranks (`parallel`, else started from torchrun's environment), with
    every rank in rank 0's run directory (turnrl.train.runs.share_run). Inside: building the run; should that
    fail, a run directory left empty is removed (a run that never started leaves nothing behind)."""
    from turnrl.train.parallel import Parallel
    from turnrl.train.runs import discard_if_empty, share_run

    run_dir = Path(cfg.run_dir) if cfg.run_dir else None
    try:
        parallel = parallel or Parallel.start(cfg.trainer, cfg.device)
        run_dir = share_run(cfg, parallel)
        yield parallel
    except BaseException:
        if run_dir is not None:
            discard_if_empty(run_dir)
        raise


def _run_line(cfg: TrainConfig) -> str:
    return f"run directory: {cfg.run_dir}" + (" (resuming)" if cfg.resume else "")


@app.command()
def sft(
    config: Annotated[Path, typer.Argument(help="SFT config YAML (turnrl.config.SFTConfig).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted key=value overrides.")] = None,
    filter_: Annotated[str | None, Opt("--filter", help="Keep rows that pass, e.g. 'reward>=1' (rejection "
                                                        "sampling from rollouts); overrides sft.filter.")] = None,
    run_dir: Annotated[Path | None, Opt(help="This run's directory (default: a new OUTPUT_DIR/<timestamp>); it must "
                                             "be empty unless --resume or --overwrite.")] = None,
    resume: Annotated[bool, Opt("--resume", help="Continue a run from its newest valid checkpoint: `--resume` alone "
                                                 "continues the newest run under output_dir (or --run-dir); "
                                                 "`--resume PATH` the run directory or checkpoint at PATH.")] = False,
    overwrite: Annotated[bool, Opt("--overwrite", help="Replace the run in --run-dir (its checkpoints, metrics and "
                                                       "model link are deleted first).")] = False,
    verbose: Annotated[bool, Opt("--verbose", "-v")] = False,
) -> None:
    """Multi-turn SFT on chat-message rows or trajectory JSONL, with the masks RL trains on (turnrl.train.sft). Each
    run writes its own directory, as `turnrl train` does (OUTPUT_DIR/<timestamp>, or --run-dir; --resume,
    --overwrite); OUTPUT_DIR/model links the newest run's model, a `model` for `turnrl train`."""
    _setup_logging(verbose)
    from turnrl.config import ConfigError, SFTConfig
    from turnrl.train.parallel import check_launch
    from turnrl.train.runs import prepare_run

    with _bad_input(ConfigError):
        cfg = _run_config(SFTConfig, config, overrides, run_dir, resume)
        if filter_ is not None:
            cfg.sft.filter = filter_
        check_launch(cfg.trainer)
        prepare_run(cfg, overwrite=overwrite)  # refuses a non-empty run directory before anything loads
    run_sft(cfg, console=console, overwrite=overwrite)


def run_sft(cfg: SFTConfig, console: Console | None = None, *, overwrite: bool = False) -> list[dict[str, float]]:
    """`turnrl sft`: choose the run directory as `turnrl train` does (turnrl.train.runs), build the SFT trainer
    (turnrl.build), train, close; returns the metrics history."""
    from turnrl.build import build_sft
    from turnrl.observe.plots import plot_sft_curves
    from turnrl.train.runs import prepare_run

    with _bad_input(ValueError, FileNotFoundError):  # ConfigError and DataError among them
        prepare_run(cfg, overwrite=overwrite)
        with _starting_run(cfg, None) as parallel:
            trainer, stack = build_sft(cfg, console=console, parallel=parallel)
    on_main = trainer.parallel.is_main
    r = trainer.report
    if on_main:
        trainer.console.print(_run_line(cfg), soft_wrap=True)
        trainer.console.print(f"sft: {r['samples']} samples from {r['rows']} rows of {cfg.train_data} "
                              f"({r['filtered_out']} filtered out, skipped: {r['skipped'] or 'none'}), "
                              f"{r['trained_tokens']} trained of {r['tokens']} tokens, {cfg.steps} steps")
    try:
        history = asyncio.run(trainer.train())
    finally:
        stack.close()
    trainer.parallel.close()
    if on_main:
        plot_sft_curves(history, trainer.out / "curves.png")
        trainer.console.print(f"wrote {trainer.out / 'model'} (a model for `turnrl train`), "
                              f"{trainer.out / 'curves.png'}, {trainer.out / 'metrics.jsonl'}", soft_wrap=True)
    return history


def _train_rank(cfg: TrainConfig, rank: int, world_size: int, init_method: str) -> list[dict[str, float]]:
    """What each Ray trainer actor runs (turnrl.train.ray.TrainerActor): join the process group, train."""
    from turnrl.train.parallel import Parallel

    parallel = Parallel.start(cfg.trainer, cfg.device, rank=rank, world_size=world_size, init_method=init_method)
    return run_training(cfg, parallel=parallel)


@app.command(name="export")
def export_command(
    checkpoint: Annotated[Path, typer.Argument(help="A training checkpoint: RUN/checkpoints/step_NNNNNN.")],
    out_dir: Annotated[Path, typer.Argument(help="Where to write the Hugging Face directory.")],
    verbose: Annotated[bool, Opt("--verbose", "-v")] = False,
) -> None:
    """Write a checkpoint as a Hugging Face directory (safetensors, config, tokenizer or processor, chat template)
    that transformers and vLLM load: from its sharded state, whatever world size wrote it; LoRA merged in."""
    _setup_logging(verbose)
    from turnrl.train.checkpoint import export_checkpoint

    out = _guarded(verbose, lambda: export_checkpoint(checkpoint, out_dir))
    files = sorted(f.name for f in out.iterdir())
    console.print(f"wrote {out}: {', '.join(files)}")


@app.command(name="eval")
def evaluate(
    config: Annotated[Path, typer.Argument(help="Training config YAML; evaluates its model on eval_data.")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted key=value overrides.")] = None,
    checkpoint: Annotated[Path | None, Opt(help="Evaluate this instead of the base model: a checkpoint folder "
                                                "(RUN/checkpoints/step_N), a run directory (its newest valid "
                                                "checkpoint) or a directory of runs (the newest run's).")] = None,
    out: Annotated[Path | None, Opt(help="Trajectory JSONL of the greedy pass (the sampled pass goes beside it as "
                                         "NAME-sampled.jsonl); default: RUN/eval/step_N.jsonl for a checkpoint, "
                                         "OUTPUT_DIR/eval/base.jsonl for the base model.")] = None,
    greedy: Annotated[bool, Opt("--greedy/--no-greedy", help="Greedy decoding (temperature 0), eval_n samples "
                                                             "per problem.")] = True,
    sampled_n: Annotated[int | None, Opt(help="Also sample this many answers per problem at the rollout's "
                                              "temperature (rollout.sampling); default: the config's "
                                              "eval_sampled_n; 0 = off.")] = None,
    verbose: Annotated[bool, Opt("--verbose", "-v")] = False,
) -> None:
    """Evaluate a policy on the held-out set of a training config (eval_data), as training does before and after:
    greedy decoding and, with --sampled-n N (or eval_sampled_n in the config), N sampled answers per problem.
    Prints the scores and where the trajectories went."""
    _setup_logging(verbose)
    from turnrl.config import ConfigError, TrainConfig, load_config

    with _bad_input(ConfigError):
        cfg = load_config(TrainConfig, config, overrides or [])
        if not cfg.eval_data:
            raise ConfigError(f"{config}: eval_data is not set (the held-out rows to evaluate on)")
        if not greedy and not (cfg.eval_sampled_n if sampled_n is None else sampled_n):
            raise ConfigError("--no-greedy leaves nothing to evaluate: add --sampled-n N")
    _guarded(verbose, lambda: run_evaluation(cfg, checkpoint=checkpoint, out=out, console=console, greedy=greedy,
                                             sampled_n=sampled_n))


def run_evaluation(cfg: TrainConfig, checkpoint: Path | None = None, out: Path | None = None,
                   console: Console | None = None, *, greedy: bool = True,
                   sampled_n: int | None = None) -> dict[str, float]:
    """`turnrl eval`: the trainer's evaluation of `checkpoint` (a checkpoint folder, run directory or directory
    of runs: turnrl.train.runs.find_checkpoint; None = the base model) on `eval_data`, written to `out`."""
    import tempfile

    import torch

    from turnrl.build import build_trainer
    from turnrl.train.checkpoint import export_checkpoint, has_hf_weights
    from turnrl.train.evaluation import format_step_line, sampled_path
    from turnrl.train.parallel import Parallel
    from turnrl.train.runs import find_checkpoint

    console = console or Console()
    ckpt = None
    if checkpoint is not None:
        ckpt, notes = find_checkpoint(checkpoint)
        console.print(f"evaluating {ckpt}" + (f" ({'; '.join(notes)})" if notes else ""), soft_wrap=True)
    if out is None:
        out = ckpt.parent.parent / "eval" / f"{ckpt.name}.jsonl" if ckpt else Path(cfg.output_dir) / "eval" / "base.jsonl"
    # evaluation is rollouts only: one process, whatever trainer.parallel / world_size / launcher the config has
    one = Parallel(device=torch.device(cfg.device))
    with tempfile.TemporaryDirectory(prefix="turnrl-eval-") as tmp:
        model_dir = None
        if ckpt is not None:  # a checkpoint without Hugging Face weights (all but a run's last): from its state
            model_dir = ckpt / "model" if has_hf_weights(ckpt / "model") else export_checkpoint(ckpt, tmp)
            cfg = _checkpoint_model(cfg, ckpt, model_dir, console)
        trainer, stack = build_trainer(cfg, checkpoint=model_dir, console=console, parallel=one)
    try:
        metrics = asyncio.run(trainer.evaluate("cli", greedy=greedy, sampled_n=sampled_n, out=out))
    finally:
        stack.close()
    console.print(format_step_line(metrics, 0), soft_wrap=True)
    passes = [(out, "eval/trajectories"), (sampled_path(out), "eval/sampled_trajectories")]
    console.print("wrote " + ", ".join(f"{p} ({metrics[k]:.0f} trajectories)" for p, k in passes if k in metrics),
                  soft_wrap=True)
    return metrics


def _checkpoint_model(cfg: TrainConfig, ckpt: Path, model_dir: Path, console: Console) -> TrainConfig:
    """The config to evaluate a checkpoint with: its own model directory (weights, config, tokenizer and chat
    template, as it saved them) in place of the config's `model`, which may name another model; said when it does."""
    import torch

    trained = torch.load(ckpt / "trainer_state.pt", weights_only=False)["config"].get("model")
    if trained is not None and trained != cfg.model:
        console.print(f"note: {ckpt} was trained from {trained}, not {cfg.model} (the config's model): evaluating it "
                      "with its own tokenizer, chat template and config", soft_wrap=True)
    return cfg.model_copy(update={"model": str(model_dir)})


@app.command()
def view(
    path: Annotated[Path, typer.Argument(help="Trajectory JSONL written by rollout/train.")],
    index: Annotated[int | None, Opt(help="Show only the trajectory at this line (0-based).")] = None,
    model: Annotated[str | None, Opt(help="Tokenizer to decode token-level segments (else messages are shown).")] = None,
    html: Annotated[Path | None, Opt(help="Write an HTML page (with images) instead of printing.")] = None,
) -> None:
    """Show trajectories: model tokens (trained) vs injected tokens, statuses, rewards, images."""
    from turnrl.observe.viewer import print_trajectories, write_html

    if not path.is_file():
        _fail(f"{path} does not exist" if not path.exists() else f"{path} is a directory, not a trajectory JSONL file")
    with _bad_input(ValueError, OSError):  # not a trajectory file, an --index out of range, an unknown --model
        if html is not None:
            write_html(path, html, model=model, index=index)
            console.print(f"wrote {html}")
        else:
            print_trajectories(path, console, index=index, model=model)


@app.command(name="replay")
def replay_command(
    path: Annotated[Path, typer.Argument(help="Trajectory JSONL written by rollout/train (format version 2).")],
    trajectory_id: Annotated[str, Opt("--id", help="The id of the trajectory to replay.")],
    model: Annotated[str | None, Opt(help="The policy that sampled it (version 0): model dir, hub id, built-in name. "
                                          "Default: the model of the training run the file lies in.")] = None,
    run_dir: Annotated[Path | None, Opt(help="The training run whose checkpoints hold the policy versions that "
                                             "answered the calls. Default: the run the file lies in.")] = None,
) -> None:
    """Re-issue every model call of a recorded trajectory and check that the same tokens and logprobs come out
    (exit 1 when a call's tokens differ, with the reason). A file inside a training run (RUN/trajectories/,
    RUN/eval/) needs nothing else: the run's config names the model and its checkpoints hold each policy
    version. See turnrl/rollout/replay.py for what is reproducible."""
    _setup_logging(False)
    from turnrl.rollout.replay import report_table, run_replay, verdict

    traj = _recorded_trajectory(path, trajectory_id)
    with _bad_input(ValueError, FileNotFoundError, ImportError):
        model, weights_of = _replay_weights(path, traj, model, run_dir)
        report = asyncio.run(run_replay(traj, model, weights_of))
    console.print(report_table(report))
    console.print(verdict(report), soft_wrap=True)
    if not report.tokens_equal:
        raise typer.Exit(1)


def _recorded_trajectory(path: Path, trajectory_id: str) -> Any:
    from turnrl.types import Trajectory

    if not path.exists():
        _fail(f"{path} does not exist")
    rows = []
    for k, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                _fail(f"{path} line {k}: not JSON ({e.msg}); expected trajectory JSONL (docs/trajectory-format.md)")
    row = next((r for r in rows if isinstance(r, dict) and r.get("id") == trajectory_id), None)
    if row is None:
        _fail(f"{path}: no trajectory with id {trajectory_id!r} ({len(rows)} trajectories in the file)")
    return Trajectory.from_json(row)


def _replay_weights(path: Path, traj: Any, model: str | None, run_dir: Path | None) -> tuple[str, Any]:
    """The model of `turnrl replay` and the policy of each later version: given, or the run's the file lies in."""
    from turnrl.rollout.replay import policy_versions
    from turnrl.train.checkpoint import load_checkpoint_model
    from turnrl.train.runs import find_run, run_model, version_checkpoint

    run = run_dir or find_run(path)
    if model is None and run is None:
        raise ValueError(f"--model: {path} does not lie in a training run (no run's config.yaml in its folders), so "
                         "the policy that sampled it is unknown: pass --model M (and --run-dir RUN for trained "
                         "policy versions)")
    later = [v for v in policy_versions(traj) if v]
    if run is None:
        assert model is not None
        if later:
            console.print(f"note: calls sampled by policy version(s) {', '.join(map(str, later))}; without a run "
                          f"(--run-dir) they replay with {model}'s weights", soft_wrap=True)
        return model, None
    model = model or run_model(run)
    checkpoints = {v: version_checkpoint(run, v) for v in later}  # every one, before anything loads
    console.print(f"replaying with {model} (policy version 0) and the checkpoints of {run} (version(s) "
                  f"{', '.join(map(str, later)) or 'none'})", soft_wrap=True)
    return model, lambda version: load_checkpoint_model(checkpoints[version])


@app.command()
def doctor(
    sandbox: Annotated[bool, Opt("--sandbox", help="Check the sandboxes (the Python tool's and harness agents').")]
    = False,
) -> None:
    """Check what this machine enforces. `--sandbox` (the only check so far): each sandbox layer's state, the read
    allow-list in force, and what stays readable where Landlock is missing (docs/sandbox.md)."""
    from turnrl.agents.sandbox import doctor_rows

    for layer, state in doctor_rows():
        console.print(f"[bold]{layer}[/bold]: " + state.replace("\n", "\n    "), soft_wrap=True, highlight=False)


@app.command()
def serve(
    model: Annotated[str, Opt(help="Model (embedded engine) or tokenizer (remote engines): HF dir, hub id, built-in name.")],
    host: Annotated[str, Opt(help="Bind address; anything but loopback requires --token.")] = "127.0.0.1",
    port: Annotated[int, Opt(help="Port.")] = 8000,
    token: Annotated[str | None, Opt(envvar="TURNRL_SERVE_TOKEN", help="Bearer token every request must carry.")] = None,
    engine: Annotated[str, Opt(help="embedded | sglang | http (the last two need --url).")] = "embedded",
    url: Annotated[list[str], Opt(help="Server URL of a remote engine (repeatable: one replica each).")] = [],
    tool_parser: Annotated[str, Opt(help="Tool-call format of the model's text (hermes, qwen3_coder).")] = "hermes",
    max_new_tokens: Annotated[int | None, Opt(help="Cap on one completion (a request's max_tokens may lower it; "
                                                    "default 1024); rollout server: tokens per model turn.")] = None,
    max_batch_size: Annotated[int, Opt(help="Rows decoded together by the embedded engine.")] = 16,
    chat_template_kwargs: Annotated[str | None, Opt(help='JSON, e.g. \'{"enable_thinking": false}\'.')] = None,
    rollout_config: Annotated[Path | None, Opt(help="Rollout server: a YAML RolloutConfig (the flags below override it).")] = None,
    env: Annotated[str | None, Opt(help="Rollout server: environment (built-in name, module, or .py file).")] = None,
    agent: Annotated[str | None, Opt(help="Rollout server: default agent for rows without agent_name.")] = None,
    scheduler: Annotated[str | None, Opt(help="Rollout server: ms-swift-style scheduler by name.")] = None,
    plugin: Annotated[list[str], Opt(help="Rollout server: Python file imported by the server (repeatable).")] = [],
    tools: Annotated[list[str], Opt(help="Rollout server: function-tool .py or tool-config .yaml (repeatable).")] = [],
    max_turns: Annotated[int | None, Opt(help="Rollout server: model turns per trajectory.")] = None,
    token_budget: Annotated[int | None, Opt(help="Rollout server: tokens after the prompt per trajectory.")] = None,
    custom_config: Annotated[Path | None, Opt(help="Rollout server: YAML passed to build_env as `config`.")] = None,
    concurrency: Annotated[int | None, Opt(help="Rollout server: trajectories in flight per request.")] = None,
    max_body_mb: Annotated[float, Opt(help="Largest request body (MB); a larger one gets a 413 before it is read.")] = 8.0,
    session_ttl_s: Annotated[float, Opt(help="Close a chat session idle this long as ABORTED (seconds; 0: never).")] = 3600.0,
    cors_origin: Annotated[list[str], Opt(help="Browser origin CORS allows (repeatable); default: any ('*').")] = [],
    verbose: Annotated[bool, Opt("--verbose", "-v")] = False,
) -> None:
    """Serve a token-level engine (for HttpEngine) and per-session OpenAI endpoints that record exact tokens; with
    a rollout configuration (--scheduler, --env, --agent, --plugin, --tools or --rollout-config) also `/rollout`,
    which runs whole trajectories here and streams them to `turnrl.rollout.remote.RemoteRollout`."""
    _setup_logging(verbose)
    from turnrl.build import build_stack
    from turnrl.config import EngineConfig
    from turnrl.engines.base import EngineError
    from turnrl.serve.app import BindError, check_bind, run_server
    from turnrl.types import SamplingParams

    with _bad_input(BindError, ValueError):  # ConfigError among them
        check_bind(host, token)
        if max_body_mb <= 0 or session_ttl_s < 0:
            raise ValueError(f"--max-body-mb must be > 0 (got {max_body_mb}) and --session-ttl-s >= 0 (got {session_ttl_s})")
        kwargs = json.loads(chat_template_kwargs or "{}")
        flags = {"env": env, "agent": agent, "scheduler": scheduler, "max_turns": max_turns,
                 "max_new_tokens": max_new_tokens, "token_budget": token_budget, "concurrency": concurrency,
                 "custom_config": str(custom_config) if custom_config else None}
        rollout = _server_rollout_config(rollout_config, flags, plugin, tools,
                                         kwargs if chat_template_kwargs is not None else None)
        engine_cfg = EngineConfig(kind=engine, urls=url, max_batch_size=max_batch_size)
    with _bad_input(ValueError, FileNotFoundError, ImportError, AttributeError, EngineError):
        stack = build_stack(model, rollout, engine_cfg)  # the rollout's plugins, scheduler, env... before the model
    console.print(_serving_banner(model, engine, url, host, port, token, stack.rollout), soft_wrap=True)
    assert stack.engine is not None and stack.renderer is not None  # built in this process
    try:
        run_server(stack.engine, stack.renderer.tokenizer, stack.rollout, model_name=model, host=host, port=port,
                   token=token, tool_parser=tool_parser, sampling=SamplingParams(max_new_tokens=max_new_tokens or 1024),
                   chat_template_kwargs=kwargs, log_level="info" if verbose else "warning",
                   max_body_mb=max_body_mb, session_ttl_s=session_ttl_s or None, cors_origins=cors_origin or ["*"])
    finally:
        stack.close()


def _serving_banner(model: str, engine: str, urls: list[str], host: str, port: int, token: str | None,
                    rollout: Any) -> str:
    """What `turnrl serve` prints at start-up: where, what, and who may call it."""
    base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    where = "embedded engine" if engine == "embedded" else f"{engine} engine at {', '.join(urls)}"
    lines = [f"serving {model} ({where}) at {base}",
             f"  OpenAI chat completions and Responses, Anthropic Messages: {base}/v1 (one recorded session per "
             f"conversation: {base}/sessions/<id>/v1)",
             f"  token level: POST {base}/generate, /update_weights; health: GET {base}/health"]
    if rollout is not None:
        lines.append(f"  rollouts: POST {base}/rollout (default agent {getattr(rollout, 'default_agent', '?')})")
    lines.append("  auth: a bearer token is required (Authorization: Bearer <token>, or X-Api-Key)" if token else
                 "  auth: none (loopback only; --token or TURNRL_SERVE_TOKEN to require one)")
    return "\n".join(lines)


def _server_rollout_config(path: Path | None, flags: dict[str, Any], plugins: list[str], tools: list[str],
                           chat_template_kwargs: dict[str, Any] | None) -> RolloutConfig | None:
    """The rollout server's configuration: the YAML at `path` with the flags over it; None without either."""
    from turnrl.config import ConfigError, RolloutConfig, load_config

    if path or flags["env"] or flags["agent"] or flags["scheduler"] or plugins or tools:
        rollout = load_config(RolloutConfig, path) if path else RolloutConfig()
        for key, value in flags.items():
            if value is not None:
                setattr(rollout, key, value)
        rollout.plugins, rollout.tools = [*rollout.plugins, *plugins], [*rollout.tools, *tools]
        if chat_template_kwargs is not None:
            rollout.chat_template_kwargs = chat_template_kwargs
        return rollout
    if flags["max_turns"] or flags["token_budget"] or flags["custom_config"] or flags["concurrency"]:
        raise ConfigError("--max-turns, --token-budget, --custom-config and --concurrency configure a rollout "
                          "server: add --scheduler, --env, --agent or --rollout-config")
    return None


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # `python -m turnrl.cli ...`, e.g. under torchrun: torchrun ... -m turnrl.cli train CONFIG
    main()
