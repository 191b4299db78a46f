"""From typed config to components: the one place that reads config objects (components take plain args)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import yaml

from turnrl.config import ConfigError, EngineConfig, RewardConfig, RolloutConfig
from turnrl.engines.base import Engine
from turnrl.render import ChatRenderer
from turnrl.rollout import RewardFn, RolloutLimits, RolloutManager
from turnrl.types import SamplingParams

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def sampling_params(cfg: RolloutConfig) -> SamplingParams:
    s = cfg.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
                          max_new_tokens=cfg.max_new_tokens)


def rollout_limits(cfg: RolloutConfig) -> RolloutLimits:
    return RolloutLimits(
        max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens, token_budget=cfg.token_budget,
        env_timeout_s=cfg.env_timeout_s, env_retries=cfg.env_retries, trajectory_timeout_s=cfg.trajectory_timeout_s,
    )


def env_config(cfg: RolloutConfig) -> dict[str, Any]:
    """--custom-config YAML, then `env_config` on top; `max_turns` defaults to the driver's."""
    merged: dict[str, Any] = {}
    if cfg.custom_config:
        path = Path(cfg.custom_config)
        if not path.exists():
            raise ConfigError(f"custom config {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"custom config {path}: expected a mapping, got {type(loaded).__name__}")
        merged.update(loaded)
    merged.update(cfg.env_config)
    merged.setdefault("max_turns", cfg.max_turns)
    return merged


def build_engine(model: torch.nn.Module, cfg: EngineConfig, eos_token_ids: list[int] = (),
                 image_processor: Any = None, model_path: str | None = None) -> Engine:
    """`model_path` (a model name or directory, as `turnrl.models.resolve_model` takes) is what an in-process
    vLLM engine (`engine.kind: vllm` without `engine.urls`) loads; the embedded engine uses `model` itself."""
    if cfg.kind == "vllm" and not cfg.urls:
        return build_vllm_engine(cfg, model_path, eos_token_ids)
    if cfg.kind != "embedded":
        from turnrl.engines import build_server_engine

        return build_server_engine(cfg)
    from turnrl.engines.embedded import EmbeddedEngine

    def one(weights: torch.nn.Module) -> EmbeddedEngine:
        return EmbeddedEngine(weights, eos_token_ids=eos_token_ids, max_batch_size=cfg.max_batch_size,
                              prefix_cache_tokens=cfg.prefix_cache_tokens, image_processor=image_processor)

    if cfg.replicas == 1:
        return one(model)
    import copy

    from turnrl.engines.router import Router

    # each replica owns a copy of the weights, as a separate server would
    return Router({f"embedded{i}": one(model if i == 0 else copy.deepcopy(model)) for i in range(cfg.replicas)})


def build_vllm_engine(cfg: EngineConfig, model_path: str | None, eos_token_ids: list[int] = ()) -> Engine:
    from turnrl.engines.vllm import VLLMEngine
    from turnrl.models import resolve_model

    if model_path is None:
        raise ConfigError("engine.kind=vllm without engine.urls runs vLLM in process: build_engine needs model_path")
    if cfg.replicas != 1:
        raise ConfigError("engine.kind=vllm runs one in-process vLLM engine; for replicas, start `vllm serve` "
                          "servers and list them in engine.urls")
    return VLLMEngine(resolve_model(model_path), eos_token_ids=eos_token_ids, max_num_seqs=cfg.max_batch_size)


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
    cfg: RolloutConfig, engine: Engine, renderer: ChatRenderer, reward_fn: RewardFn | None = None
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
    default_agent = cfg.agent
    if cfg.scheduler is not None:
        from turnrl.agents.scheduler import scheduler_agent

        agents["scheduler"] = scheduler_agent(cfg.scheduler)
        default_agent = "scheduler"
    tools = None
    if cfg.tools or default_agent == "tool_agent":
        from turnrl.agents.tool_agent import ToolAgentSettings
        from turnrl.tools import ToolSet

        py_files = [t for t in cfg.tools if t.endswith(".py")]
        configs = [t for t in cfg.tools if t.endswith((".yaml", ".yml"))]
        if len(py_files) + len(configs) != len(cfg.tools):
            raise ConfigError(f"rollout.tools: expected .py function-tool files or .yaml tool configs, got {cfg.tools}")
        tools = ToolAgentSettings.build(ToolSet.from_sources(py_files, configs), cfg.tool_parser, cfg.tool_agent)
    if default_agent == "env_agent" and env_factory is None:
        raise ConfigError("rollout.env is required for the env_agent (or choose rollout.agent=single_turn|tool_agent)")
    return RolloutManager(
        engine, renderer, agents=agents, default_agent=default_agent, sampling=sampling_params(cfg),
        limits=rollout_limits(cfg), env_factory=env_factory, env_config=env_config(cfg), tools=tools,
        concurrency=cfg.concurrency, sanity_mode=cfg.sanity_check, reward_fn=reward_fn,
    )


def build_reward_fn(cfg: RewardConfig) -> RewardFn:
    from turnrl.rewards import bind_reward, boxed_answer_reward, load_reward_fn

    if cfg.function == "math" and cfg.answer_key != "answer":
        key = cfg.answer_key

        def math_reward(responses: list[str], sample: dict) -> float:
            return boxed_answer_reward(responses, str(sample[key]))

        return bind_reward(math_reward, "math")
    return load_reward_fn(cfg.function, cfg.format_weight)
