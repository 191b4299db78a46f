"""From typed config to components: the one place that reads config objects (components take plain args).

Every entry point builds here: `turnrl rollout`, `eval`, `train` and `serve` call `build_stack` (engine,
renderer, rollout, tracer), and `turnrl train` / `eval` call `build_trainer`, which hands the Trainer the built
components. Cheap checks come before weights load: data rows, the reward function, plugins, agents, the
scheduler, tools and the env.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from turnrl.config import (
    ConfigError,
    EngineConfig,
    HarnessConfig,
    JudgeConfig,
    RewardConfig,
    RolloutConfig,
    SFTConfig,
    TrainConfig,
)
from turnrl.engines.base import Engine, Recording
from turnrl.observe.tracing import TrajectoryTracer
from turnrl.render import ChatRenderer
from turnrl.rollout.admission import AdmissionSettings
from turnrl.rollout.context import DEFAULT_INSTRUCTION, ContextPolicy, Strategy
from turnrl.rollout.episode import RolloutLimits
from turnrl.rollout.manager import RewardFn, Rollout, RolloutManager
from turnrl.types import SamplingParams

if TYPE_CHECKING:
    from rich.console import Console

    from turnrl.agents.harness import HarnessSettings
    from turnrl.rewards.judge import Judge
    from turnrl.train.learner import Learner, LearnerOptions
    from turnrl.train.loop import Trainer
    from turnrl.train.parallel import Parallel
    from turnrl.train.sft import SFTTrainer

log = logging.getLogger(__name__)



def sampling_params(cfg: RolloutConfig) -> SamplingParams:
    s = cfg.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
                          max_new_tokens=cfg.max_new_tokens)


def rollout_limits(cfg: RolloutConfig) -> RolloutLimits:
    c = cfg.context
    context = ContextPolicy(c.max_tokens, Strategy(c.strategy), c.keep_last_turns,
                            c.instruction if c.instruction is not None else DEFAULT_INSTRUCTION)
    return RolloutLimits(
        max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens, token_budget=cfg.token_budget,
        env_timeout_s=cfg.env_timeout_s, env_retries=cfg.env_retries, trajectory_timeout_s=cfg.trajectory_timeout_s,
        context=context,
    )


def env_config(cfg: RolloutConfig) -> dict[str, Any]:
    """--custom-config YAML, then `env_config` on top; `max_turns` defaults to the driver's."""
    from turnrl.config import load_custom_config

    merged = load_custom_config(cfg.custom_config)  # the one reader of that file (errors name it)
    merged.update(cfg.env_config)
    merged.setdefault("max_turns", cfg.max_turns)
    return merged


def engine_recording(cfg: RolloutConfig) -> Recording:
    """What the engines record for the trainer: kept sets (rollout.sampling_mask), MoE routing (router_replay)."""
    return Recording(sampling_mask=cfg.records_sampling_mask, routing=cfg.router_replay == "record")


def load_engine(source: str, cfg: EngineConfig, *, eos_token_ids: Sequence[int] = (), image_processor: Any = None,
                dtype: str = "float32", record: Recording = Recording()) -> Engine:
    """`build_engine` with its weights: an embedded engine loads `source` (a model name or directory) in `dtype`
    here; vLLM in process loads it itself; server engines load nothing here."""
    from turnrl.models import DTYPES, load_model

    model = load_model(source, dtype=DTYPES[dtype]) if cfg.kind == "embedded" else None
    return build_engine(model, cfg, eos_token_ids, image_processor, model_path=source, record=record)


def build_engine(model: torch.nn.Module | None, cfg: EngineConfig, eos_token_ids: Sequence[int] = (),
                 image_processor: Any = None, model_path: str | None = None, *,
                 record: Recording = Recording()) -> Engine:
    """`model_path` (a model name or directory, as `turnrl.models.resolve_model` takes) is what an in-process
    vLLM engine (`engine.kind: vllm` without `engine.urls`) loads; the embedded engine uses `model` itself.
    `record` says what the engines report beside tokens and logprobs (kept sets, MoE routing)."""
    if cfg.kind == "vllm" and not cfg.urls:
        return build_vllm_engine(cfg, model_path, eos_token_ids, record)
    if cfg.kind != "embedded":
        return _server_engine(cfg, record, model_path)
    from turnrl.engines.embedded import EmbeddedEngine

    if model is None:
        raise ValueError("build_engine: the embedded engine needs the model (load_engine loads it)")

    def one(weights: Any) -> EmbeddedEngine:  # a transformers PreTrainedModel
        return EmbeddedEngine(weights, eos_token_ids=eos_token_ids, max_batch_size=cfg.max_batch_size,
                              prefix_cache_tokens=cfg.prefix_cache_tokens, image_processor=image_processor,
                              record_sampling_mask=record.sampling_mask, record_routing=record.routing,
                              share_prefixes=cfg.share_prefixes, cascade=cfg.cascade)

    if cfg.replicas == 1:
        return one(model)
    import copy

    from turnrl.engines.router import Router

    # each replica owns a copy of the weights, as a separate server would
    return Router({f"embedded{i}": one(model if i == 0 else copy.deepcopy(model)) for i in range(cfg.replicas)})


def build_vllm_engine(cfg: EngineConfig, model_path: str | None, eos_token_ids: Sequence[int] = (),
                      record: Recording = Recording()) -> Engine:
    from turnrl.engines.vllm import VLLMEngine
    from turnrl.models import resolve_model

    if model_path is None:
        raise ConfigError("engine.kind=vllm without engine.urls runs vLLM in process: build_engine needs model_path")
    if cfg.replicas != 1:
        raise ConfigError("engine.kind=vllm runs one in-process vLLM engine; for replicas, start `vllm serve` "
                          "servers and list them in engine.urls")
    return VLLMEngine(resolve_model(model_path), eos_token_ids=eos_token_ids, max_num_seqs=cfg.max_batch_size,
                      record=record)


def _server_engine(cfg: EngineConfig, record: Recording = Recording(), model_path: str | None = None) -> Engine:
    """An Engine for `engine.kind` http, sglang or vllm (with urls): one client per URL in `engine.urls`, behind a
    Router when there are several. `weights_dir` is where SGLang and vLLM
    server clients write pushed weights for their servers to load (a sub-folder per replica)."""
    from turnrl.engines.router import Router

    if not cfg.urls:
        raise ValueError(f"engine.urls is required for engine.kind={cfg.kind!r} (one server URL per replica)")
    replicas: list[Any]
    after, probe = cfg.probe_after_s, cfg.probe_timeout_s  # a call that waits this long asks if the server is alive
    if cfg.kind == "http":
        from turnrl.engines.http import HttpEngine

        replicas = [HttpEngine(url, probe_after_s=after, probe_timeout_s=probe) for url in cfg.urls]
    elif cfg.kind == "sglang":
        from turnrl.engines.sglang import SGLangEngine

        shape = None
        if record.routing:
            from transformers import AutoConfig

            from turnrl.models import resolve_model
            from turnrl.moe import routing_shape

            if model_path is None:
                raise ConfigError("rollout.router_replay: record with SGLang needs the policy (model) to size its routing")
            shape = routing_shape(AutoConfig.from_pretrained(resolve_model(model_path)))
        replicas = [SGLangEngine(url, weights_dir=_replica_dir(cfg, i), record=record, routing_shape=shape,
                                    probe_after_s=after, probe_timeout_s=probe, kv_metrics=cfg.kv_metrics)
                    for i, url in enumerate(cfg.urls)]
    elif cfg.kind == "vllm":
        from turnrl.engines.vllm import VLLMServerEngine

        replicas = [VLLMServerEngine(url, weights_dir=_replica_dir(cfg, i), record=record, probe_after_s=after,
                                     probe_timeout_s=probe, kv_metrics=cfg.kv_metrics)
                    for i, url in enumerate(cfg.urls)]
    else:
        raise ValueError(f"engine.kind={cfg.kind!r} has no server client here; use http, sglang or vllm")
    return replicas[0] if len(replicas) == 1 else Router(replicas)


def _replica_dir(cfg: EngineConfig, index: int) -> str | None:
    """A folder per replica: they write concurrently when the router broadcasts an update."""
    if cfg.weights_dir is None:
        return None
    return cfg.weights_dir if len(cfg.urls) == 1 else f"{cfg.weights_dir}/replica{index}"


def build_renderer(tokenizer: Any, cfg: RolloutConfig) -> ChatRenderer:
    return ChatRenderer(tokenizer, cfg.chat_template_kwargs)


def build_policy_renderer(model_name: str, cfg: RolloutConfig) -> tuple[ChatRenderer, Any]:
    """The renderer for a policy, and the image processor the engine needs (None for text models).
    VLMs render through their processor (images expand into placeholder tokens)."""
    from transformers import AutoConfig

    from turnrl.models import load_tokenizer, resolve_model

    where = resolve_model(model_name)
    if hasattr(AutoConfig.from_pretrained(where), "vision_config"):
        from turnrl.multimodal import VisionRenderer, build_processor

        processor = build_processor(where)
        return VisionRenderer(processor, cfg.chat_template_kwargs), processor.image_processor
    return build_renderer(load_tokenizer(model_name), cfg), None


def build_rollout_manager(
    cfg: RolloutConfig, engine: Engine | None, renderer: ChatRenderer, reward_fn: RewardFn | None = None
) -> RolloutManager:
    from turnrl.agents import agent_registry
    from turnrl.config import effective_rollout_config
    from turnrl.envs.base import load_env_factory
    from turnrl.loading import load_module

    cfg = effective_rollout_config(cfg)  # the custom config's max_turns / env; tools without an env: tool_agent
    for plugin in cfg.plugins:
        load_module(plugin, what="plugin")
    agents = agent_registry(cfg.agents)
    env_factory = load_env_factory(cfg.env) if cfg.env else None
    check = getattr(env_factory, "check", None)
    if callable(check):  # an ecosystem env checks its config once here (a bad generator config fails at start-up)
        check(env_config(cfg))
    default_agent = cfg.agent
    if cfg.scheduler is not None:
        from turnrl.agents.scheduler import scheduler_agent

        agents["scheduler"] = scheduler_agent(cfg.scheduler)
        default_agent = "scheduler"
    tools = None
    if cfg.tools or default_agent == "tool_agent":
        from turnrl.agents.tool_agent import ToolAgentSettings

        tools = ToolAgentSettings.build(toolset_of(cfg.tools), cfg.tool_parser, cfg.tool_agent)
        renderer.require("tool")  # at start-up: a template with no tool role, or one that drops tool schemas
        renderer.require_tools(cfg.tool_parser)  # (they are injected then, or refused), says so now
    if cfg.harness is not None:
        from turnrl.agents.harness import make_harness_agent

        agents["harness"] = make_harness_agent(harness_settings(cfg.harness, cfg.tool_parser))
    elif default_agent == "harness":
        raise ConfigError("rollout.agent: harness needs rollout.harness (claude-code, codex, opencode, or your own "
                          "CLI as {command: [...], api: anthropic | responses | chat})")
    if default_agent == "env_agent" and env_factory is None:
        raise ConfigError("rollout.env is required for the env_agent (or choose rollout.agent=single_turn|tool_agent)")
    # engine None: build_stack builds the manager first (plugins, env, tools fail before weights load), then sets it
    return RolloutManager(
        cast(Engine, engine), renderer, agents=agents, default_agent=default_agent, sampling=sampling_params(cfg),
        limits=rollout_limits(cfg), env_factory=env_factory, env_config=env_config(cfg), tools=tools,
        sanity_mode=cfg.sanity_check, sanity_check_every=cfg.sanity_check_every, reward_fn=reward_fn,
        watchdog_s=cfg.watchdog_s,
        admission=AdmissionSettings(cfg.concurrency, kv_soft_cap=cfg.kv_soft_cap, kv_hard_cap=cfg.kv_hard_cap),
    )


def toolset_of(sources: Sequence[str]) -> Any:
    """The ToolSet of `rollout.tools`: .py function-tool files, .yaml tool configs, MCP servers (`mcp:COMMAND
    ...`, `mcp+http://...`)."""
    from turnrl.tools import ToolSet
    from turnrl.tools.mcp import is_mcp_source

    mcp = [t for t in sources if is_mcp_source(t)]
    py_files = [t for t in sources if t.endswith(".py") and t not in mcp]
    configs = [t for t in sources if t.endswith((".yaml", ".yml")) and t not in mcp]
    if len(py_files) + len(configs) + len(mcp) != len(sources):
        raise ConfigError(f"rollout.tools: expected .py function-tool files, .yaml tool configs or MCP servers "
                          f"(mcp:COMMAND ..., mcp+http://...), got {list(sources)}")
    return ToolSet.from_sources(py_files, configs, mcp_servers=mcp)


def env_opens_episode(cfg: RolloutConfig) -> bool:
    """Whether the rollout's env gives each episode's first message itself (reasoning-gym, OpenEnv, TextArena:
    its rows need no prompt, and `turnrl rollout` needs no --data)."""
    from turnrl.config import effective_rollout_config
    from turnrl.envs.base import load_env_factory

    env = effective_rollout_config(cfg).env
    return env is not None and bool(getattr(load_env_factory(env), "opens_episode", False))


def harness_settings(cfg: HarnessConfig, tool_parser: str = "hermes") -> HarnessSettings:
    """The harness agent's settings; the CLI is looked up now, so a missing one fails before weights load."""
    from turnrl.agents.harness import HarnessSettings, find_cli, harness_search_path, harness_spec

    name = cfg.name or "custom"
    try:
        spec = harness_spec(cfg.name, cfg.command, cfg.env, cfg.api)
        executable, installation = find_cli(spec, harness_search_path(cfg.search_path), name)
    except ValueError as e:
        raise ConfigError(f"rollout.{e}") from None
    return HarnessSettings(
        name=name, spec=spec, executable=executable, read_paths=(*installation, *cfg.read_paths),
        timeout_s=cfg.timeout_s, test_timeout_s=cfg.test_timeout_s, weak=cfg.sandbox == "weak",
        tool_parser=tool_parser, model=cfg.model, base_dir=cfg.base_dir, memory_mb=cfg.memory_mb)


def build_reward_fn(cfg: RewardConfig, tokenizer: Any = None, label_key: str | None = None) -> RewardFn:
    """The reward function of `cfg`; an LLM judge (function: judge) has a `close()` for its engine. `tokenizer`
    (the policy's) decodes responses for verl's and slime's reward functions (turnrl.rewards.bind_reward);
    `label_key` (the --custom-config's, slime's --label-key) names the ground-truth column when
    `reward.answer_key` is left at its default."""
    from turnrl.rewards import load_reward_fn

    if cfg.judge is not None:
        if cfg.format_weight:
            raise ConfigError("reward.format_weight does not combine with reward.function: judge; put the format "
                              "in the judge's template or write a reward function that calls the judge")
        return build_judge(cfg.judge)
    answer_key = cfg.answer_key if cfg.answer_key != "answer" else label_key
    return load_reward_fn(cfg.function, cfg.format_weight, tokenizer=tokenizer, answer_key=answer_key)


def _reward_fn(reward: RewardConfig | None, cfg: RolloutConfig, renderer: ChatRenderer) -> RewardFn | None:
    if reward is None:
        return None
    return build_reward_fn(reward, renderer.tokenizer, env_config(cfg).get("label_key"))


def build_judge(cfg: JudgeConfig, name: str = "judge") -> Judge:
    """An LLM judge (turnrl.rewards.judge) on its own engine: embedded (the judge's weights load here), vLLM in
    process, or servers (engine.urls). Its template may be given inline or as a file path."""
    from turnrl.models import load_tokenizer
    from turnrl.rewards.judge import Judge

    template = cfg.template
    if "\n" not in template and len(template) < 4096 and Path(template).is_file():
        template = Path(template).read_text(encoding="utf-8")
    renderer = ChatRenderer(load_tokenizer(cfg.model), cfg.chat_template_kwargs)
    sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    judge_args: dict[str, Any] = dict(system=cfg.system, score_pattern=cfg.score_pattern, labels=cfg.labels or None,
                      score_range=cfg.score_range, normalize=cfg.normalize, sampling=sampling,
                      max_concurrency=cfg.max_concurrency, timeout_s=cfg.timeout_s, cache=cfg.cache,
                      cache_path=cfg.cache_path, name=name)
    Judge(None, renderer, template, **judge_args)  # a bad template or pattern fails before any weights load
    engine = load_engine(cfg.model, cfg.engine, eos_token_ids=sorted(renderer.end_of_turn_ids), dtype=cfg.dtype)
    return Judge(engine, renderer, template, **judge_args)


# ---------------------------------------------------------------------------------------------------
# The composition root
# ---------------------------------------------------------------------------------------------------
@dataclass
class Stack:
    """What a run samples with: `rollout` runs trajectories on `engine` (None: `turnrl serve` without a
    rollout configuration), `renderer` is the policy's chat template, `tracer` exports trajectories (one that
    does nothing unless `rollout.trace_uri`). `close()` stops what the stack started; a second call does
    nothing."""

    engine: Engine | None
    """None on trainer ranks other than 0 (rank 0 alone samples)."""
    renderer: ChatRenderer | None
    rollout: Rollout | None
    tracer: TrajectoryTracer
    stops: tuple[Callable[[], None], ...] = ()
    """What `close` calls: the engine's close, or the Ray / remote rollout's (which closes its engine)."""
    closed: bool = field(default=False, init=False)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for stop in self.stops:
                stop()
            self.tracer.close()


def build_stack(model: str, cfg: RolloutConfig | None, engine_cfg: EngineConfig, *, reward: RewardConfig | None = None,
                server: str | None = None, weights: str | None = None, dtype: str = "float32",
                engine_model: Callable[[], torch.nn.Module] | None = None) -> Stack:
    """The engine, renderer, rollout and tracer of a run of the policy `model` (a name or directory).

    The turns run on `server` (a `turnrl serve` rollout server: turnrl.rollout.remote), else on Ray workers
    (`engine_cfg.distributed == "ray"`: turnrl.rollout.ray), else in this process (a RolloutManager). Engines load
    their weights from `weights` (a checkpoint's model directory) when given, else from `model`, in `dtype`;
    an embedded engine runs the module `engine_model()` gives, when given (the policy's tensors: `build_trainer`).
    `reward` scores each trajectory as it finishes (None: rewards stay as the agent set them)."""
    rollout_cfg = cfg or RolloutConfig()
    renderer, image_processor = build_policy_renderer(model, rollout_cfg)
    reward_fn = _reward_fn(reward, rollout_cfg, renderer)  # a bad reward fails before any weights load
    tracer = TrajectoryTracer.from_config(rollout_cfg, renderer.tokenizer)
    if server:
        return _remote_stack(server, model, rollout_cfg, renderer, reward_fn, tracer)
    if rollout_cfg.workers > 1 and engine_cfg.distributed != "ray":  # N rollout processes: the Ray path
        if engine_cfg.ray_workers > 1 and engine_cfg.ray_workers != rollout_cfg.workers:
            raise ConfigError(f"rollout.workers={rollout_cfg.workers} and engine.ray_workers={engine_cfg.ray_workers} "
                              "disagree; set rollout.workers only")
        engine_cfg = engine_cfg.model_copy(update={"distributed": "ray"})
    if engine_cfg.distributed == "ray":
        return _ray_stack(model, rollout_cfg, engine_cfg, renderer, image_processor, reward, weights or model, dtype,
                          tracer)
    # plugins, agents, scheduler, tools and env resolve here, before the weights load; the engine comes after
    manager = build_rollout_manager(cfg, None, renderer, reward_fn) if cfg is not None else None
    record = engine_recording(rollout_cfg)
    if engine_model is not None:
        engine = build_engine(engine_model(), engine_cfg, sorted(renderer.end_of_turn_ids), image_processor,
                              record=record)
    else:
        engine = load_engine(weights or model, engine_cfg, eos_token_ids=sorted(renderer.end_of_turn_ids),
                             image_processor=image_processor, dtype=dtype, record=record)
    if manager is not None:
        manager.engine = engine
    return Stack(engine, renderer, manager, tracer, (engine.close, *_closers(reward_fn)))


def _closers(reward_fn: Any) -> tuple[Callable[[], None], ...]:
    """What a reward function runs that the stack must stop (an LLM judge's engine)."""
    close = getattr(reward_fn, "close", None)
    return (close,) if callable(close) else ()


def _remote_stack(server: str, model: str, cfg: RolloutConfig, renderer: ChatRenderer, reward_fn: RewardFn | None,
                  tracer: TrajectoryTracer) -> Stack:
    from turnrl.rollout.remote import RemoteRollout

    if cfg.scheduler or cfg.plugins or cfg.env or cfg.tools or cfg.agents:
        log.warning("a rollout server is set: rollout.scheduler/plugins/env/tools/agents are not used here; "
                    "the server runs the turns with its own (turnrl serve --scheduler/--plugin/...)")
    remote = RemoteRollout(server, model=model, renderer=renderer, sampling=sampling_params(cfg), reward_fn=reward_fn)
    return Stack(remote.engine, renderer, remote, tracer, (remote.close, *_closers(reward_fn)))


def _ray_stack(model: str, cfg: RolloutConfig, engine_cfg: EngineConfig, renderer: ChatRenderer, image_processor: Any,
               reward: RewardConfig | None, weights: str, dtype: str, tracer: TrajectoryTracer) -> Stack:
    """Engine replicas and rollout workers as Ray actors (turnrl.rollout.ray), each built in its own process by
    the builders a single process uses, so plugins are imported where the turns run, never here."""
    from turnrl.rollout.ray import RayRollout

    if engine_cfg.kind != "embedded":
        raise ConfigError(f"engine.distributed=ray runs embedded engines as Ray actors; engine.kind={engine_cfg.kind!r} "
                          "servers are already separate processes (use distributed=none)")
    if cfg.env:  # what the driver can check before starting actors
        from turnrl.envs.base import load_env_factory

        load_env_factory(cfg.env)
    one = engine_cfg.model_copy(update={"replicas": 1, "distributed": "none"})
    engine = functools.partial(load_engine, weights, one, eos_token_ids=sorted(renderer.end_of_turn_ids),
                               image_processor=image_processor, dtype=dtype, record=engine_recording(cfg))
    rollout = RayRollout.start(engine, functools.partial(build_worker_manager, model, cfg, reward),
                               replicas=engine_cfg.replicas, workers=max(cfg.workers, engine_cfg.ray_workers),
                               renderer=renderer,
                               sampling=sampling_params(cfg), address=engine_cfg.ray_address)
    return Stack(rollout.engine, renderer, rollout, tracer, (rollout.close,))


def build_worker_manager(model: str, cfg: RolloutConfig, reward: RewardConfig | None, engine: Engine) -> RolloutManager:
    """The RolloutManager of a Ray rollout worker, built in the worker's process (turnrl.rollout.ray)."""
    renderer, _ = build_policy_renderer(model, cfg)
    return build_rollout_manager(cfg, engine, renderer, _reward_fn(reward, cfg, renderer))


def build_trainer(cfg: TrainConfig, *, checkpoint: Path | None = None, console: Console | None = None,
                  parallel: Parallel | None = None, loggers: bool = False) -> tuple[Trainer, Stack]:
    """The Trainer of `cfg` over its built components, and the stack to close when done. `checkpoint` (a
    model directory) replaces the base model's weights, in the policy and in the engines. `parallel` is this
    process's place among the trainer ranks (None: `Parallel.start` from torchrun's environment, or one
    process). Rank 0 reads the rows and builds the engines and the rollout; the other ranks only train, on the
    samples rank 0 sends them each step (their stack holds nothing). `loggers`: rank 0 starts the backends of
    trainer.loggers (a training run; an evaluation writes none)."""
    from turnrl.data import load_rows
    from turnrl.models import DTYPES, load_model
    from turnrl.train.loop import Trainer
    from turnrl.train.parallel import Parallel

    parallel = parallel or Parallel.start(cfg.trainer, cfg.device)  # first: a launch error before anything loads
    _seed_everything(cfg)
    if cfg.rollout.sampling.seed is None:  # seeded samplers make runs (and resumes) reproducible
        cfg.rollout.sampling.seed = cfg.seed
    weights = str(checkpoint) if checkpoint else None
    # the policy trains (the Trainer moves or shards it onto the devices cfg.device and cfg.trainer say); the
    # engines sample from a copy of it, or from its very tensors where that is safe (shares_weights)
    loaded: list[torch.nn.Module] = []

    def policy_view() -> torch.nn.Module:  # called by build_stack once the cheap checks passed
        loaded.append(load_model(weights or cfg.model, dtype=DTYPES[cfg.dtype]).eval())
        return sharing_view(loaded[0])

    if parallel.is_main:
        prompt_required = not env_opens_episode(cfg.rollout)
        train_rows = load_rows(cfg.train_data, prompt_required)
        eval_rows = load_rows(cfg.eval_data, prompt_required) if cfg.eval_data else []
        stack = build_stack(cfg.model, cfg.rollout, cfg.engine, reward=cfg.reward, server=cfg.rollout_server,
                            weights=weights, dtype=cfg.dtype,
                            engine_model=policy_view if shares_weights(cfg) else None)
        if cfg.engine.kind != "embedded" and not cfg.rollout_server:  # a dead server fails here, not per trajectory
            from turnrl.engines import check_servers

            try:
                check_servers(stack.engine)
            except Exception:
                stack.close()
                raise
    else:
        train_rows, eval_rows, stack = [], [], Stack(None, None, None, TrajectoryTracer(None))
    policy = loaded[0] if loaded else load_model(weights or cfg.model, dtype=DTYPES[cfg.dtype]).eval()
    if checkpoint and cfg.rollout_server and stack.engine is not None:  # the server loaded its own weights
        asyncio.run(stack.engine.update_weights(policy.state_dict()))
    metric_loggers = None
    if loggers and parallel.is_main:
        from turnrl.observe.loggers import build_loggers

        run_dir = Path(cfg.run_dir or cfg.output_dir)
        metric_loggers = build_loggers(cfg.trainer.loggers, run_dir, cfg.model_dump(mode="json"), stack.tracer,
                                       project=Path(cfg.output_dir).name if cfg.run_dir else None)
    trainer = Trainer(cfg, build_learner(cfg, policy, parallel), stack.engine, stack.rollout, train_rows, eval_rows,
                      console, stack.tracer, loggers=metric_loggers)
    return trainer, stack


def build_learner(cfg: TrainConfig, policy: torch.nn.Module, parallel: Parallel | None = None) -> Learner:
    """The policy as `cfg` trains it (turnrl.train.learner) over `parallel` (None: `Parallel.start` from
    torchrun's environment, or one process)."""
    from turnrl.train.learner import Learner
    from turnrl.train.parallel import Parallel

    return Learner(policy, parallel or Parallel.start(cfg.trainer, cfg.device), learner_options(cfg))


def learner_options(cfg: TrainConfig) -> LearnerOptions:
    """The Learner's options from `cfg`'s optim, algo, trainer and weight_sync. RL's logprobs are at the sampling
    temperature (the engine's distribution) with a KL reference when algo.kl_coef > 0; SFT's (an SFTConfig)
    at temperature 1, without a reference."""
    from turnrl.models import DTYPES
    from turnrl.train.learner import LearnerOptions
    from turnrl.train.lora import apply_lora

    o, a, t, sft = cfg.optim, cfg.algo, cfg.trainer, isinstance(cfg, SFTConfig)
    return LearnerOptions(
        lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, warmup_steps=o.warmup_steps, lr_scale=o.lr_scale,
        freeze=tuple(o.freeze), epochs=o.epochs, mini_batches=o.mini_batches, micro_batch_tokens=o.micro_batch_tokens,
        grad_clip=o.grad_clip, gradient_checkpointing=o.gradient_checkpointing, loss_agg=a.loss_agg,
        norm_constant=a.norm_constant, temperature=1.0 if sft else (cfg.rollout.sampling.temperature or 1.0),
        kl_reference=a.kl_coef > 0 and not sft, dtype=DTYPES[cfg.dtype], cpu_offload=t.cpu_offload, seed=cfg.seed,
        sync_bucket_bytes=int(cfg.weight_sync.bucket_mb * 2**20), sync_pause=cfg.weight_sync.pause,
        lora=None if t.lora is None else functools.partial(apply_lora, cfg=t.lora),
        sampling_mask="ignore" if sft else a.sampling_mask, router_replay=a.router_replay and not sft,
        packing=t.packing, attention=t.attention)


def build_sft(cfg: SFTConfig, *, console: Console | None = None,
              parallel: Parallel | None = None) -> tuple[SFTTrainer, Stack]:
    """The SFTTrainer of `cfg` (turnrl.train.sft) and the stack to close: the policy's renderer turns the SFT rows into
    samples before any weights load; the engine and rollout are the ones `turnrl train` builds, for evaluation
    on `eval_data` (without it no engine is loaded). With N trainer ranks (`parallel`, as in build_trainer)
    every rank renders the samples and trains; only rank 0 has the engine and evaluates."""
    from turnrl.data import load_rows
    from turnrl.models import DTYPES, load_model
    from turnrl.train.parallel import Parallel
    from turnrl.train.sft import SFTTrainer, load_sft_samples, sft_steps

    parallel = parallel or Parallel.start(cfg.trainer, cfg.device)  # first: a launch error before anything loads
    _seed_everything(cfg)
    eval_rows = load_rows(cfg.eval_data) if cfg.eval_data else []
    if eval_rows and parallel.is_main:
        stack = build_stack(cfg.model, cfg.rollout, cfg.engine, reward=cfg.reward, dtype=cfg.dtype)
    else:
        renderer, _ = build_policy_renderer(cfg.model, cfg.rollout)
        tracer = (TrajectoryTracer.from_config(cfg.rollout, renderer.tokenizer) if parallel.is_main
                  else TrajectoryTracer(None))
        stack = Stack(None, renderer, None, tracer)
    try:
        toolset = _sft_toolset(cfg.rollout, stack.rollout)
        sft_renderer = stack.renderer
        assert sft_renderer is not None  # both stacks above have the policy's renderer
        samples, report = load_sft_samples(cfg.train_data, sft_renderer, filter_expr=cfg.sft.filter, toolset=toolset,
                                           sanity=cfg.rollout.sanity_check, max_tokens=cfg.sft.max_tokens)
        cfg.steps = sft_steps(cfg, len(samples))
        policy = load_model(cfg.model, dtype=DTYPES[cfg.dtype]).eval()
        trainer = SFTTrainer(cfg, build_learner(cfg, policy, parallel), stack.engine, stack.rollout, samples,
                             eval_rows, sft_renderer, console, stack.tracer, report=report)
    except BaseException:
        stack.close()
        raise
    return trainer, stack


def _sft_toolset(cfg: RolloutConfig, rollout: Rollout | None) -> Any:
    """The tool agent's tools (their schemas go into SFT prompts as into RL ones): the built rollout's, else
    built from rollout.tools."""
    settings = getattr(rollout, "tools", None)
    if settings is not None:
        return settings.toolset
    if not cfg.tools:
        return None
    return toolset_of(cfg.tools)


def _seed_everything(cfg: TrainConfig) -> None:
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)


def shares_weights(cfg: TrainConfig) -> bool:
    """Whether the engine may sample from the policy's own tensors (`engine.share_weights`). Safe only when
    nothing samples while the optimizer writes them and the engine would hold the same tensors anyway: sync
    mode (every step's groups have finished before its update starts, and the next are admitted after the
    weight push: turnrl.train.buffer with K = 0), one embedded engine in this process, whole fp weights on the CPU
    (no FSDP shards, no LoRA whose engine weights are merged, no device the engine is not on)."""
    e, t = cfg.engine, cfg.trainer
    return (e.share_weights and e.kind == "embedded" and e.distributed == "none" and e.replicas == 1
            and cfg.rollout_server is None and t.mode == "sync" and t.parallel == "none" and t.lora is None
            and cfg.device == "cpu")


def sharing_view(model: torch.nn.Module) -> torch.nn.Module:
    """A second module over the same parameter tensors: its own config and module objects (the
    trainer switches the policy's attention to packed sequences and its mode to train; the engine's stay),
    not a second copy of the weights."""
    import copy

    memo: dict[int, Any] = {id(p): p for p in model.parameters()}  # buffers (rotary tables) are small: copies
    return copy.deepcopy(model, memo)
