"""Typed configuration: one pydantic model per entry point, defaults in the schema, YAML + dotted overrides.

    cfg = load_config(TrainConfig, "examples/arithmetic/config.yaml", ["algo.clip_high=0.28", "steps=10"])

Unknown keys and wrong types fail at once with the dotted path of the field, what was given, what was
expected, and a suggestion for misspelt keys. Components never see these objects: `turnrl.build` turns
them into plain arguments.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class SamplingConfig(Strict):
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of rollouts (0 = greedy). The trainer scales its logits by the same value."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus mass; 1.0 disables. Below 1 the engine records each token's kept set (rollout.sampling_mask), which
    the trainer renormalises over (algo.sampling_mask; docs/off-policy.md)."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 disables."""
    seed: int | None = None
    """Base seed of per-request samplers (request k of trajectory t gets a derived seed); None = unseeded."""


class EngineConfig(Strict):
    kind: Literal["embedded", "vllm", "sglang", "http"] = "embedded"
    """embedded: in-process continuous batching (CPU, small models); vllm / sglang / http: see docs/serving.md."""
    max_batch_size: int = Field(16, ge=1)
    """Rows decoded together by the embedded engine."""
    prefix_cache_tokens: int = Field(32_768, ge=0)
    """KV tokens the embedded engine keeps of finished requests (least recently used out first), for a trajectory's
    next turn and any request whose prompt shares a prefix with them (0 = off; docs/engines.md)."""
    share_prefixes: bool = True
    """Embedded engine: a request copies the KV of the longest prefix it shares with any parked, running or
    same-step request (a group's prompt is prefilled once); false: only its own trajectory's (docs/engines.md)."""
    cascade: bool = True
    """Embedded engine, with share_prefixes: rows whose first tokens' KV was copied from one another decode against
    one copy of it (cascade attention: the shared prompt's keys read once per step for the whole group, merged by
    log-sum-exp with each row's own tokens); false: each row reads its own copy (docs/engines.md)."""
    replicas: int = Field(1, ge=1)
    """Engine replicas behind the router (each a separate engine)."""
    urls: list[str] = []
    """Server URLs for kind sglang/http/vllm-server (one replica each)."""
    probe_after_s: float | None = Field(20.0, gt=0)
    """Server engines: a call without an answer this long asks the server's health (a cheap endpoint on its own
    connection); a server that answers keeps the call waiting (it is slow), one that does not fails the call at
    once, naming its URL (it is dead). None: never probe (a call then waits up to its 600 s limit)."""
    probe_timeout_s: float = Field(10.0, gt=0)
    """How long that health probe may take before the server counts as not responding."""
    kv_metrics: bool = False
    """Server engines vllm and sglang: read each server's Prometheus /metrics (KV occupancy, preemptions) for
    rollout.concurrency auto (SGLang needs --enable-metrics; docs/rollout.md). Off: they report no KV."""
    weights_dir: str | None = None
    """A folder the trainer and the servers share: server engines (sglang, vllm server) load pushed weights
    from there (`update_weights_from_disk`); one sub-folder per replica."""
    share_weights: bool = True
    """Training: the embedded engine samples from the policy's own tensors instead of a copy (one copy of the
    weights in memory), where that is safe: one embedded engine in this process, trainer.mode sync (no rollout
    runs during an update), one process without FSDP or LoRA, the policy on the CPU. Elsewhere it has a copy."""
    distributed: Literal["none", "ray"] = "none"
    """ray: each replica is a Ray actor and rollouts run in `ray_workers` Ray workers (turnrl.rollout.ray)."""
    ray_workers: int = Field(1, ge=1)
    """Rollout worker actors with distributed=ray; each runs its shard of the rows with the same RolloutManager."""
    ray_address: str | None = None
    """Address of an existing Ray cluster ("auto", "ray://host:10001"); None starts a local one."""


class HarnessConfig(Strict):
    """A coding-agent CLI that runs each episode (`rollout.agent: harness`; docs/harnesses.md). A string is
    short for `{name: ...}`."""

    name: Literal["claude-code", "codex", "opencode"] | None = None
    """A built-in harness (installed by `make harnesses`); leave empty for your own `command`."""
    command: list[str] = []
    """Your own CLI: its argv, where {instruction}, {base_url}, {api_key}, {model}, {workdir} and {home} are
    filled in for each episode (e.g. [my-agent, --prompt, "{instruction}"])."""
    env: dict[str, str] = {}
    """Environment of the CLI, filled in as `command` (over a built-in's; your own CLI also gets its API's
    OPENAI_BASE_URL/OPENAI_API_KEY or ANTHROPIC_BASE_URL/ANTHROPIC_API_KEY)."""
    api: Literal["anthropic", "responses", "chat"] | None = None
    """The API your own CLI speaks: Anthropic Messages, OpenAI Responses or chat completions ({base_url} ends
    in /v1 for the OpenAI APIs, not for Anthropic's)."""
    timeout_s: float | None = Field(None, gt=0)
    """The CLI's wall-clock limit per episode; None: the task's `[agent] timeout_sec`, else 900 s."""
    test_timeout_s: float | None = Field(None, gt=0)
    """The limit of the task's tests; None: the task's `[verifier] timeout_sec` (Harbor's default 600 s)."""
    sandbox: Literal["strict", "weak"] = "strict"
    """strict: refuse to run where the command sandbox cannot be enforced (not root, no Landlock, no
    namespaces); weak: run with the layers available (docs/sandbox.md)."""
    search_path: list[str] = []
    """Folders searched for the CLI before ./.harnesses, the source checkout's .harnesses and PATH."""
    read_paths: list[str] = []
    """More paths the CLI may read (its installation, when it is not an npm package found as above)."""
    model: str = "turnrl-policy"
    """The model name the CLI is configured with (the proxy serves the policy under any name)."""
    base_dir: str | None = None
    """Where each episode's run folder (its working directory and HOME) is made; None: the system's temp dir."""
    memory_mb: int | None = Field(None, ge=64)
    """Address-space limit of each CLI process (None: none; V8 reserves far more than it uses)."""

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_cli(self) -> HarnessConfig:
        if bool(self.name) == bool(self.command):
            raise ValueError("harness: give a built-in `name` (claude-code, codex, opencode) or your own `command` "
                             "(with `api`), not both or neither")
        if self.command and self.api is None:
            raise ValueError("harness.api: your own CLI's API is required (anthropic, responses or chat)")
        return self


class ContextConfig(Strict):
    """The context window of one branch of an episode and what the turn loop does when it is full (docs/trees.md)."""

    max_tokens: int | None = Field(None, ge=1)
    """Tokens one branch's stream (prompt + response) may hold: when the next observation and a whole turn
    (max_new_tokens) would not fit, the episode is compacted into a new branch; None = no limit."""
    strategy: Literal["summarize", "drop_observations", "none"] = "summarize"
    """summarize: the policy writes a summary (a trained model turn) and the episode goes on from the system prompt,
    the task and the summary; drop_observations: older tool/env outputs are replaced by a stub; none: never compacted
    (the episode ends truncated/token_budget when full)."""
    keep_last_turns: int = Field(1, ge=0)
    """drop_observations: the outputs of this many last turns are kept whole."""
    instruction: str | None = None
    """summarize: the user message asking for the summary (None: turnrl's, turnrl.rollout.context.DEFAULT_INSTRUCTION)."""


class RolloutConfig(Strict):
    env: str | None = None
    """Environment: a built-in name (arithmetic, geo3k, single_turn), a dotted module or a .py file with build_env."""
    env_config: dict[str, Any] = {}
    """Passed to build_env(sample, config) as `config` (merged over --custom-config YAML)."""
    custom_config: str | None = None
    """A YAML file whose mapping becomes the env config (slime's --custom-config-path). Its `max_turns` is also the
    turn limit and its `rollout_interaction_env_path` the env, unless those are set (effective_rollout_config)."""
    agent: str = "env_agent"
    """Default agent for rows without `agent_name` (single_turn, env_agent, tool_agent, openai_agent, harness,
    verifiers: a verifiers v1 env server at `env_config.env_server`, docs/ecosystems.md; or one from `agents`)."""
    harness: HarnessConfig | None = None
    """The coding-agent CLI of the `harness` agent (a built-in name or {command, env, api}); setting it makes
    `harness` the default agent unless `agent` is set."""
    agents: list[str] = []
    """Extra agent loops by path: `[name=]file.py:function` or `[name=]pkg.module:function`."""
    tools: list[str] = []
    """Function-tool files (.py) and tool configs (.yaml) for the tool agent."""
    tool_parser: str = "hermes"
    """Tool-call format the tool agent parses (hermes, qwen3_coder)."""
    tool_agent: dict[str, Any] = {}
    """Tool agent limits: max_parallel_calls, max_tool_response_length, truncate_side, ... (see docs/tools.md)."""
    scheduler: str | None = None
    """An ms-swift-style scheduler by name (see docs/from-ms-swift.md); rows then run through it."""
    plugins: list[str] = []
    """Python files imported at start-up (they may register schedulers, agents, rewards)."""
    n: int = Field(4, ge=1)
    """Samples per prompt (the GRPO group size)."""
    max_turns: int = Field(4, ge=1)
    """Model turns per trajectory."""
    max_new_tokens: int = Field(256, ge=1)
    """Tokens per model turn."""
    token_budget: int | None = Field(None, ge=1)
    """Tokens after the prompt for the whole trajectory (model + observations); None = unlimited."""
    context: ContextConfig = ContextConfig()
    """Context compaction: `{max_tokens, strategy: summarize | drop_observations | none, keep_last_turns, instruction}`
    (docs/trees.md)."""
    env_timeout_s: float | None = Field(60.0, gt=0)
    """Time limit of one env step."""
    env_retries: int = Field(0, ge=0)
    """Extra attempts of a failing env step."""
    trajectory_timeout_s: float | None = Field(None, gt=0)
    """Wall-clock limit per trajectory."""
    watchdog_s: float | None = Field(600.0, gt=0)
    """The run fails (naming what was stuck, stacks in the log) when no trajectory, engine call or env call makes
    progress for this long; a training run also watches its update and weight sync. None = off."""
    concurrency: int | Literal["auto"] = 64
    """Trajectories in flight at once (per rollout worker): a number, or `auto`: admission grows while the engines
    have KV headroom and cuts multiplicatively on a preemption or past `kv_soft_cap` (docs/rollout.md)."""
    kv_soft_cap: float = Field(0.85, gt=0, le=1)
    """concurrency auto: the engines' KV occupancy admission aims under (past it the limit is cut by a tenth)."""
    kv_hard_cap: float = Field(0.95, gt=0, le=1)
    """concurrency auto: past this KV occupancy nothing new is admitted and the limit is halved."""
    workers: int = Field(1, ge=1)
    """Rollout processes: N > 1 runs N Ray rollout workers (turnrl.rollout.ray), each with its share of the groups,
    the engine replicas Ray actors (engine.distributed ray; engine.ray_workers is the older spelling)."""
    sanity_check: Literal["strict", "ignore_strippable", "disable"] = "strict"
    """Compare each token stream with a full chat-template re-render (render.py)."""
    sanity_check_every: int = Field(1, ge=1)
    """1 = check every trajectory. N > 1 (for scale): the first 64 trajectories of the process, then those whose id
    hashes (zlib.crc32) to 0 mod N; an unchecked trajectory has no render metrics, `rollout/render_checked` is the
    fraction checked."""
    chat_template_kwargs: dict[str, Any] = {}
    """Passed to the chat template (e.g. enable_thinking: false)."""
    trace_uri: str | None = None
    """MLflow tracking URI that receives one trace per trajectory (turnrl.observe.tracing); None = no tracing."""
    trace_experiment: str = "turnrl"
    """MLflow experiment of the traces (and of the training run's params and metrics)."""
    max_traces_per_step: int = Field(16, ge=0)
    """Trajectories traced per training step, eval pass or `turnrl rollout`; all are still written to JSONL."""
    sampling: SamplingConfig = SamplingConfig()
    """How rollouts sample (the training distribution; evaluation's greedy pass uses temperature 0)."""
    sampling_mask: Literal["none", "record"] | None = None
    """record: the engine reports, for each sampled token, the kept set top-k / top-p left (as its size k: the k most
    likely tokens) and the trajectory stores it (segments[].kept_counts), so the trainer can score the token under
    the same truncated distribution (algo.sampling_mask). None = record whenever sampling.top_p < 1 or
    sampling.top_k > 0. An engine that cannot report it says so once (docs/off-policy.md)."""
    router_replay: Literal["none", "record"] = "none"
    """record (MoE policies): the engine records the experts each MoE layer's router chose for every token, and the
    trajectory stores them (routed_experts), for the trainer to force the same routing (algo.router_replay)."""

    @model_validator(mode="after")
    def _admission(self) -> RolloutConfig:
        if self.concurrency != "auto" and self.concurrency < 1:
            raise ValueError(f"rollout.concurrency must be auto or an integer >= 1, got {self.concurrency}")
        if self.kv_soft_cap > self.kv_hard_cap:
            raise ValueError(f"rollout.kv_soft_cap ({self.kv_soft_cap}) must not exceed rollout.kv_hard_cap "
                             f"({self.kv_hard_cap})")
        return self

    @property
    def records_sampling_mask(self) -> bool:
        """`sampling_mask` with its default resolved: record when top-p or top-k cut the distribution."""
        if self.sampling_mask is not None:
            return self.sampling_mask == "record"
        return self.sampling.top_p < 1.0 or self.sampling.top_k > 0


class AlgoConfig(Strict):
    advantage: Literal["grpo", "rloo"] = "grpo"
    """Group-relative advantage estimator."""
    normalize_std: bool = True
    """Divide by the group std (GRPO); false gives Dr. GRPO (mean only)."""
    clip_low: float = Field(0.2, ge=0)
    """Ratio clipped below at 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """Ratio clipped above at 1 + clip_high (clip-higher: e.g. 0.28)."""
    dual_clip: float | None = None
    """Dual-clip constant (> 1) for negative advantages; None disables."""
    ratio_level: Literal["token", "sequence"] = "token"
    """sequence = GSPO (use tiny clip ranges, ~3e-4)."""
    kl_coef: float = Field(0.0, ge=0)
    """KL-to-reference loss coefficient; 0 loads no reference model."""
    kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """Estimator of the KL term (Schulman's k1, k2, k3; low_var_kl = k3 with verl's clamps: algos.kl_penalty)."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """How per-token losses become one number (see algos.aggregate_loss)."""
    norm_constant: float | None = None
    """Denominator of seq_mean_token_sum_norm (e.g. the max response length)."""
    decoupled: bool = True
    """Decoupled PPO (AReaL's, for off-policy data): the clipped ratio is against the proximal policy (the one
    being updated, recomputed), and importance weights `is_mode` correct proximal vs behaviour per token, with the
    behaviour logprobs of each segment's own version. false: PPO anchored at the behaviour policy (the rollout
    logprobs are the "old" ones; no separate importance weights)."""
    is_mode: Literal["none", "truncate", "mask"] = "truncate"
    """Importance-sampling correction against the engine's logprobs: TIS, MIS, or none."""
    is_level: Literal["token", "sequence"] = "token"
    """Importance weights per token, or one per trajectory (the geometric mean of its token ratios)."""
    is_threshold: float = Field(2.0, gt=1)
    """TIS truncates importance weights at this value; MIS masks those outside [1/threshold, threshold]."""
    train_on: list[Literal["completed", "truncated", "aborted", "failed"]] = ["completed", "truncated"]
    """Trajectory statuses that enter the loss (failed ones never should)."""
    sampling_mask: Literal["renormalize", "ignore"] = "renormalize"
    """renormalize: score each sampled token under the trainer's distribution renormalised over the kept set the
    engine sampled it from (rollout.sampling_mask), in the ratio, the importance weights and the loss; trajectories
    without kept sets fall back to the full softmax, with a warning. ignore: the full softmax everywhere. Both
    report train/mismatch_kl_k3 (renormalised) and train/mismatch_kl_k3_unmasked (full softmax)."""
    router_replay: bool = False
    """MoE policies: the trainer's forward routes every token to the experts the engine chose (recorded with
    rollout.router_replay: record); the router's gate values still train (turnrl.moe)."""


class OptimConfig(Strict):
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate (after warm-up)."""
    lr_scale: dict[str, float] = {}
    """Learning-rate multipliers by parameter name: a parameter whose name contains a key trains at lr × its value
    (the first key that matches), e.g. {vision_tower: 50, multi_modal_projector: 50} for a VLM whose vision
    side starts random (ms-swift's vit_lr / aligner_lr)."""
    freeze: list[str] = []
    """Parameters that do not train: every one whose name contains one of these (ms-swift's freeze_llm /
    freeze_vit / freeze_aligner), e.g. [language_model] to align a VLM's vision tower and projector to a
    language model kept as it is (LLaVA's first stage). They get no gradients or optimizer state and are not in
    the checkpoint's sharded state (they come from `model`, as a LoRA run's base does)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment coefficients."""
    grad_clip: float | None = 1.0
    """Max gradient norm; None disables."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up (optimizer steps)."""
    epochs: int = Field(1, ge=1)
    """Passes over each step's rollouts (PPO epochs)."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per epoch (the step's trajectories are split into this many mini-batches)."""
    micro_batch_tokens: int = Field(4096, ge=64)
    """Tokens per packed forward/backward (sequences are packed without padding up to this budget): with
    trainer.packing tree, unique tokens (a shared prefix counts once)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (activation checkpointing)."""


class LoraConfig(Strict):
    r: int = Field(16, ge=1)
    """Rank of the adapters (peft LoRA)."""
    alpha: float = Field(32.0, gt=0)
    """Scale of the adapters: the update is (alpha / r) · B·A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training."""
    target_modules: list[str] | str = "all-linear"
    """Module names (suffixes) that get adapters, e.g. [q_proj, v_proj]; "all-linear" = every linear layer but
    the LM head (peft's shorthand)."""


class TrainerConfig(Strict):
    parallel: Literal["none", "fsdp"] = "none"
    """none: one process on `device`. fsdp: FSDP2 (`fully_shard` per decoder layer and at the root) over
    `world_size` ranks (started by torchrun or Ray: `launcher`); the update is the same at any world size
    (docs/distributed.md). With fsdp the sharded parameters, the gradient reduction and the optimizer state
    are fp32 and `dtype` is the compute dtype (bfloat16: mixed precision)."""
    world_size: int = Field(1, ge=1)
    """Trainer ranks; under torchrun it must equal WORLD_SIZE."""
    loggers: list[Literal["jsonl", "mlflow", "wandb", "tensorboard"]] = ["jsonl"]
    """Where metrics go besides the console (turnrl.observe.loggers), each with metrics.jsonl's names and steps and
    the run directory's name: jsonl (RUN/metrics.jsonl, always on), mlflow (the MLflow run at rollout.trace_uri,
    on whenever that is set), wandb (a W&B run; WANDB_MODE=offline keeps it under RUN/wandb, WANDB_PROJECT names
    the project), tensorboard (event files under RUN/tensorboard). A backend that cannot start or log warns once
    and training goes on. `turnrl train` only."""
    launcher: Literal["torchrun", "ray"] = "torchrun"
    """Who starts the trainer ranks. torchrun: each process `turnrl train` runs in is one rank, as torchrun's
    environment says (WORLD_SIZE, RANK, LOCAL_RANK); without torchrun, one process. ray: `turnrl train`, run
    once, starts `world_size` Ray trainer actors on the cluster at engine.ray_address (one GPU each with a
    cuda device) sharing one process group; rank 0 holds the engines and the rollout (docs/distributed.md)."""
    cpu_offload: bool = False
    """fsdp: keep the sharded parameters, gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy);
    the optimizer step runs on the CPU. Trades step time for device memory."""
    save_hf: bool | Literal["final"] = "final"
    """Write the policy's weights into the checkpoint's Hugging Face directory (checkpoint/model) beside the
    sharded state: "final" = only in the run's last checkpoint (the others keep only what resuming needs: the
    weights are in the sharded state once), true = in every checkpoint, false = never. Config and tokenizer
    always go there; `turnrl eval` and `turnrl.train.checkpoint.export_checkpoint` make the weights from the state."""
    keep_checkpoints: int | None = Field(2, ge=1)
    """Checkpoints a run keeps (`turnrl train` and `turnrl sft`): after each save, all but the newest N are
    deleted, except that the newest valid one always stays (a newer broken one does not count), so a run can
    always resume. null = keep every one (`turnrl replay` of every policy version needs save_every=1 and null)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (peft) instead of every weight; None = full fine-tuning."""
    packing: Literal["tree", "flat"] = "tree"
    """How a micro-batch's samples share a forward (turnrl.train.tree; docs/trees.md). tree: as a prefix trie over
    token ids, every token shared by several samples (a group's prompt, the turns before a fork, a common system
    prompt) forwarded and back-propagated once, each token attending exactly to its own root-to-token path: the
    same loss and gradients as flat, with fewer tokens. flat: each sample's prompt + response packed separately."""
    attention: Literal["sdpa", "flex"] = "sdpa"
    """Tree packing's attention kernel. sdpa: scaled-dot-product attention per trie segment over its ancestors'
    gathered keys and values (any device). flex: FlexAttention with the ancestor relation as its block mask
    (compiled on an accelerator; on the CPU its unfused reference implementation, which is slow)."""
    mode: Literal["sync", "async"] = "sync"
    """sync: a step trains groups sampled by the current policy, and rollouts wait while it updates. async:
    rollouts go on during updates (the update runs beside the event loop), and groups are trained within
    `max_staleness` policy versions of the one that sampled them (turnrl.train.buffer; docs/async-training.md)."""
    max_staleness: int = Field(0, ge=0)
    """async: the most policy versions between sampling a group and training on it, time in the buffer
    included (0 = on-policy). Nothing is dropped for staleness: admission and earliest-deadline-first batches
    keep every group within the bound."""

    @model_validator(mode="after")
    def _check_staleness(self) -> TrainerConfig:
        if self.mode == "sync" and self.max_staleness:
            raise ValueError(f"trainer.max_staleness={self.max_staleness} needs trainer.mode=async (sync mode is "
                             "on-policy: max_staleness 0)")
        return self


class WeightSyncConfig(Strict):
    bucket_mb: float = Field(512.0, gt=0)
    """Weights go to the engines in buckets of about this many MB (a tensor larger than a bucket goes alone): the
    trainer never holds more than one bucket of gathered weights beyond its shard."""
    pause: Literal["abort", "wait", "keep"] = "keep"
    """What requests in flight do at a weight update. keep: pause in place, keep their KV, continue under the new
    weights (their later tokens carry the new version). wait: finish them on the old weights first (no new
    request starts meanwhile). abort: stop them; the driver resubmits prompt + tokens so far (a re-prefill
    under the new weights). No tokens are lost in any mode (docs/async-training.md)."""


class JudgeConfig(Strict):
    """An LLM judge (turnrl.rewards.judge): `reward.function: judge`, or built by an env for per-turn scores."""

    model: str
    """The judge model: its tokenizer and chat template always, its weights with an embedded or in-process vLLM
    engine (a local directory, hub id or built-in name)."""
    engine: EngineConfig = EngineConfig()
    """Where the judge runs: embedded (in this process), or http / vllm / sglang servers with engine.urls."""
    template: str
    """Jinja template of the judge's user message, or the path of a file holding one. Variables: messages,
    conversation, response, responses, sample, every column of the row by name."""
    system: str | None = None
    """A system message for the judge."""
    score_pattern: str = r"(?i)score\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)"
    """Regex whose first group is the score; the reply's last match counts."""
    labels: dict[str, float] = {}
    """Instead of a number: label words and their scores, e.g. {yes: 1, no: 0} (the last label in the reply)."""
    score_range: tuple[float, float] = (0.0, 10.0)
    """Scores outside are errors; the reward is (score - low) / (high - low)."""
    normalize: bool = True
    """false: the reward is the raw score."""
    max_new_tokens: int = Field(256, ge=1)
    """Tokens of one verdict (its reasoning and the score)."""
    temperature: float = Field(0.0, ge=0)
    """The judge's sampling temperature (0 = greedy: the same verdict for the same prompt)."""
    max_concurrency: int = Field(16, ge=1)
    """Judge calls in flight at once (the engine batches them)."""
    timeout_s: float | None = Field(60.0, gt=0)
    """Limit of one judge call; past it the reward is an error."""
    cache: bool = True
    """Judge each distinct prompt once (content hash)."""
    cache_path: str | None = None
    """A JSONL file that keeps verdicts across runs."""
    chat_template_kwargs: dict[str, Any] = {}
    """Passed to the judge's chat template, e.g. {enable_thinking: false}."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The embedded judge's weights."""


class RewardConfig(Strict):
    function: str = "env"
    """env (sum of env step rewards), env_last, math (\\boxed answer vs the row's ground truth), judge (an LLM judge: set
    `judge`), or path.py:fn / pkg.mod:fn."""
    judge: JudgeConfig | None = None
    """The judge of `function: judge`."""

    answer_key: str = "answer"
    """Dataset column with the reference answer for `math` (and slime reward functions' `sample.label`); at the
    default, the `answer` column, else `label`, else verl's `reward_model.ground_truth` (or the column the
    custom config's `label_key` names). `turnrl rollout --answer-key`."""
    format_weight: float = 0.0
    """Weight of a format reward (reply ends with a \\boxed{} answer) added to the main reward."""

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        if (self.function == "judge") != (self.judge is not None):
            raise ValueError("reward.function: judge and the reward.judge section go together (set both or neither)")
        return self


class TrainConfig(Strict):
    model: str
    """Local HF directory, hub id, or built-in name (smollm2-135m-instruct, tiny-qwen3, tiny-qwen3-vl)."""
    train_data: str
    """JSONL or parquet rows with a `prompt` (and any columns the env / reward use), or a folder of Harbor tasks
    (one row each: docs/harnesses.md)."""
    eval_data: str | None = None
    """Held-out rows evaluated with greedy decoding before training, every eval_every steps and at the end."""
    output_dir: str = "runs/train"
    """Where the runs of this config go: each `turnrl train` writes a new run directory
    `<output_dir>/<YYYYmmdd-HHMMSS>` (unless `run_dir` is set), so a run never overwrites another."""
    run_dir: str | None = None
    """This run's own directory (checkpoints/, metrics.jsonl, trajectories/, curves.png, config.yaml;
    `turnrl train --run-dir`). It must be empty unless the run resumes (`resume`) or overwrites
    (`turnrl train --overwrite`). None = a new timestamped directory under output_dir."""
    steps: int = Field(20, ge=1)
    """Training steps (one rollout batch and its updates each)."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompts per step; each gets rollout.n samples."""
    seed: int = 0
    """Seed of data order, initial RNG and (unless rollout.sampling.seed is set) the samplers: a run and its
    resume are reproducible."""
    shuffle: bool = True
    """Reshuffle the training rows each epoch over the data (deterministic by seed)."""
    eval_every: int = Field(0, ge=0)
    """Evaluate every K steps (0 = only before and after training)."""
    eval_n: int = Field(1, ge=1)
    """Greedy samples per eval prompt (1 unless the env is stochastic)."""
    eval_sampled_n: int = Field(0, ge=0)
    """Also evaluate the sampling policy: this many samples per eval prompt at the rollout's temperature."""
    save_every: int = Field(0, ge=0)
    """Checkpoint every K steps (0 = only at the end)."""
    resume: bool | str = False
    """Continue a run (same data order, RNG, optimizer; `turnrl train --resume [PATH]`): true = the newest run
    under output_dir (or run_dir when set); a path = that run directory or checkpoint folder. The newest
    checkpoint whose files match its manifest is used; newer broken ones are skipped and named. With no run or
    no valid checkpoint to resume, the run is refused (it never starts from scratch instead)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training and engine dtype (fp32 on CPU: bf16 is ~25x slower without hardware support)."""
    device: str = "cpu"
    """Where the policy trains: cpu, cuda, cuda:1... (the embedded engine keeps a CPU copy; GPU runs use
    engine.kind vllm or sglang for rollouts)."""
    rollout_server: str | None = None
    """URL of a rollout server (`turnrl serve ... --scheduler NAME`, docs/serving.md): it runs the turns with its
    own rollout settings and engine; rollout.n, rollout.sampling and the reward stay here, and the weights are
    pushed to its engine after each step. Token: TURNRL_SERVE_TOKEN. None = roll out in this process."""
    rollout: RolloutConfig = RolloutConfig()
    """How trajectories are run: env, agent, tools, turn and token limits, sampling."""
    engine: EngineConfig = EngineConfig()
    """What generates: the embedded engine, vLLM, SGLang or HTTP servers; replicas, Ray."""
    algo: AlgoConfig = AlgoConfig()
    """The RL objective: advantages, clipping, KL, importance sampling, loss aggregation."""
    optim: OptimConfig = OptimConfig()
    """The optimizer and how an update is batched (epochs, mini- and micro-batches)."""
    reward: RewardConfig = RewardConfig()
    """The reward function applied to each finished trajectory (docs/rewards.md)."""
    trainer: TrainerConfig = TrainerConfig()
    """Sync or async training, FSDP, LoRA, what checkpoints hold."""
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    """How new weights reach the engines after each step."""

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.algo.loss_agg == "seq_mean_token_sum_norm" and self.algo.norm_constant is None:
            raise ValueError("algo.norm_constant is required with algo.loss_agg=seq_mean_token_sum_norm")
        if self.trainer.parallel == "none" and self.trainer.world_size > 1:
            raise ValueError(f"trainer.world_size={self.trainer.world_size} needs trainer.parallel: fsdp")
        if "mlflow" in self.trainer.loggers and not self.rollout.trace_uri:
            raise ValueError("trainer.loggers: mlflow logs to the MLflow server at rollout.trace_uri (where the "
                             "trajectory traces go): set rollout.trace_uri")
        if self.algo.router_replay and self.rollout.router_replay != "record":
            raise ValueError("algo.router_replay: true replays the routing the engine recorded: set "
                             "rollout.router_replay: record")
        return self


def training_warnings(cfg: TrainConfig) -> list[str]:
    """Settings that are valid but make RL training do nothing useful, said at start-up (`turnrl train`)."""
    warnings = []
    if cfg.rollout.n == 1:
        kl = (f"; only the KL term (algo.kl_coef={cfg.algo.kl_coef:g}) moves the policy" if cfg.algo.kl_coef
              else "")
        warnings.append(f"rollout.n=1: each group has one sample, so every group-relative advantage "
                        f"(algo.advantage={cfg.algo.advantage}) is 0 and no trajectory gives a policy gradient{kl}. "
                        "Set rollout.n to the group size, e.g. 4 to 16.")
    return warnings


class SFTSection(Strict):
    epochs: float = Field(1.0, gt=0)
    """Passes over the SFT samples (fractions allowed); `steps`, when set, wins."""
    batch_size: int = Field(16, ge=1)
    """Sequences per optimizer step (packed into micro-batches of optim.micro_batch_tokens)."""
    filter: str | None = None
    """Keep only rows that pass, e.g. `reward>=1` (rejection sampling from rollouts) or `reward>=1 and
    num_turns<=2`: comparisons (== != >= <= > <) of a row's field (dotted for nested: `sample.level`) with a
    number or a word, joined by `and` (turnrl.train.sft.parse_filter). A row without the field fails it."""
    max_tokens: int | None = Field(None, ge=1)
    """Drop samples longer than this (prompt + response tokens); None keeps every sample."""


class SFTConfig(TrainConfig):
    """`turnrl sft`: multi-turn SFT through the RL renderer (turnrl.train.sft). `train_data` holds chat-message rows
    (`messages`) or trajectory JSONL (`turnrl rollout` / `turnrl train` output); `eval_data` holds RL prompt rows,
    evaluated through `rollout` and `reward` as `turnrl train` does. Each run writes its own run directory, as
    `turnrl train` does (`output_dir`, `run_dir`, `resume`); the last checkpoint's `model/` directory (linked as
    RUN/model and `output_dir/model`) is what `turnrl train` takes as its `model`. `prompts_per_step` and `algo`
    (except `loss_agg`) are not used."""

    steps: int | None = Field(None, ge=1)  # type: ignore[assignment]
    """Optimizer steps; None = sft.epochs passes over the samples."""
    sft: SFTSection = SFTSection()

    @model_validator(mode="after")
    def _check_sft(self) -> SFTConfig:
        if self.optim.epochs != 1 or self.optim.mini_batches != 1:
            raise ValueError("optim.epochs and optim.mini_batches are PPO settings; for SFT set sft.epochs and "
                             "sft.batch_size")
        return self


# ---------------------------------------------------------------------------------------------------
C = TypeVar("C", bound=BaseModel)


class ConfigError(ValueError):
    """A config file or override is wrong; the message names each bad field."""


def load_custom_config(path: str | Path | None) -> dict[str, Any]:
    """The mapping of a `--custom-config` YAML ({} without one)."""
    if path is None:
        return {}
    return read_yaml_mapping(Path(path), "custom config")


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """A YAML file that must hold a mapping; errors name `what` and the file."""
    if not path.exists():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path}: invalid YAML: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{what} {path}: expected a mapping at the top level, got {type(loaded).__name__}")
    return loaded


ENV_PATH_KEY = "rollout_interaction_env_path"
"""The custom-config key naming the environment (slime's; slime has no CLI flag for it)."""


def effective_rollout_config(cfg: RolloutConfig, custom: dict[str, Any] | None = None) -> RolloutConfig:
    """The settings a rollout runs with, once its custom config (`custom`, else the `custom_config` YAML) is read:

    - the YAML's `max_turns` is the turn limit, unless `max_turns` was set (a flag or a config key);
    - the YAML's `rollout_interaction_env_path` is the environment, unless `env` was set;
    - with tools and neither an env nor a scheduler, rows without `agent_name` run the tool agent, unless `agent`
      was set (so verl rows need no --agent);
    - with a harness, they run the harness agent, unless `agent` was set.
    The result carries the YAML merged under `env_config` (without `rollout_interaction_env_path`) and no
    `custom_config`, so applying it again changes nothing and other processes need not read the file."""
    custom = load_custom_config(cfg.custom_config) if custom is None else dict(custom)
    given = cfg.model_fields_set
    out = cfg.model_copy(deep=True)
    try:
        if custom.get("max_turns") is not None and "max_turns" not in given:
            out.max_turns = custom["max_turns"]
        if custom.get(ENV_PATH_KEY) and cfg.env is None:
            out.env = str(custom[ENV_PATH_KEY])
        if cfg.tools and out.env is None and cfg.scheduler is None and "agent" not in given:
            out.agent = "tool_agent"
        if cfg.harness is not None and "agent" not in given:
            out.agent = "harness"
    except ValidationError as e:
        raise ConfigError(f"custom config {cfg.custom_config or ''}: {e.errors()[0]['msg']} "
                          f"(max_turns: {custom.get('max_turns')!r})") from None
    env_config = {k: v for k, v in custom.items() if k != ENV_PATH_KEY}
    out.env_config = {**env_config, **cfg.env_config}
    out.custom_config = None
    return out


def load_config(cls: type[C], path: str | Path | None = None, overrides: Sequence[str] = ()) -> C:
    path = Path(path) if path is not None else None
    data = read_yaml_mapping(path, "config file") if path is not None else {}
    for item in overrides:
        apply_override(data, item)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(cls, e, path)) from None


def apply_override(data: dict[str, Any], item: str) -> None:
    """`a.b.c=value` (value parsed as YAML: numbers, booleans, lists, null) into nested dicts."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r}: expected dotted.key=value")
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw != "" else ""


def _explain(cls: type[BaseModel], error: ValidationError, path: Path | None) -> str:
    where = f"config {path}" if path else "config"
    lines = [f"{where} is invalid:"]
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            known = _fields_at(cls, err["loc"][:-1])
            hint = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else f" (known keys: {', '.join(known)})"
            lines.append(f"  {loc}: unknown key{suggestion}")
        else:
            got = f" (got {err.get('input')!r:.80})" if loc else ""  # the top level's input is the whole config
            lines.append(f"  {loc or '(top level)'}: {err['msg']}{got}")
    return "\n".join(lines)


def _fields_at(cls: type[BaseModel], loc: tuple) -> list[str]:
    model: Any = cls
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
        # an optional section (`LoraConfig | None`): the model inside the union
        model = next((a for a in getattr(model, "__args__", ()) if hasattr(a, "model_fields")), model)
    return sorted(getattr(model, "model_fields", {}))
