"""What user code is called with: the arguments turnrl passes to environment factories and reward functions.

Core concepts, at the bottom of the house (turnrl.compat.slime and turnrl.compat.verl re-export them):

- `build_env(sample, config)` gets the row as a `Sample` and the env config as an `Args` (`env_arguments`): both
  are dicts that also read by attribute, so an env written for turnrl (`sample["answer"]`, `config.get(...)`) and
  one written for slime (`sample.label`, `args.max_turns`) run on the same call, with no mode to pick.
- A reward function with slime's signature (`reward_func(args, sample, **kwargs)` or batched `(args, samples)`)
  is called as slime calls it (`reward_caller`), the finished trajectory as a `Sample` (`reward_sample`).
- verl's reward arguments (`solution_str`, `ground_truth`, `extra_info` with `num_turns`) are offered by name
  to every reward function (`reward_arguments`).
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from turnrl.types import SegmentSource, Trajectory


class SampleStatus(enum.Enum):
    """slime's `Sample.Status`."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


# slime's Sample fields a row does not carry, and what they read as until set. Mutable defaults are stored on
# first read so that `sample.metadata["k"] = v` sticks.
_DEFAULTS: dict[str, Any] = {
    "group_index": None, "index": None, "rollout_id": None, "prompt": "", "tokens": list,
    "multimodal_inputs": None, "multimodal_train_inputs": None, "apply_chat_template_kwargs": dict,
    "response": "", "response_length": 0, "label": None, "reward": None, "loss_mask": None,
    "weight_versions": list, "rollout_log_probs": None, "remove_sample": False, "status": SampleStatus.PENDING,
    "metadata": dict, "generate_function_path": None, "custom_rm_path": None, "train_metadata": None,
    "session_id": None,
}


class Sample(dict):
    """A dataset row that also reads like slime's `Sample`: every column by key (`sample["answer"]`), and
    slime's fields by attribute (`sample.label`, `sample.prompt`, `sample.metadata`, `sample.status`, ...).

    An attribute is the column of that name when the row has one, else:
    - `label`: the `answer` column (a `label_key` in the env config names another column: slime's --label-key);
    - `prompt`: the `messages` column (ms-swift-style rows);
    - `multimodal_inputs`: `{"images": [...]}` when the row has `images`;
    - any other slime field: slime's default (`response` "", `reward` None, `status` Sample.Status.PENDING,
      `metadata` {}, `index` None, ...).
    Setting an attribute sets the key. `Sample(prompt=..., label=..., metadata=...)` builds one by keyword, as
    in slime. A field that is neither a column nor a slime field raises AttributeError naming both lists.
    """

    Status = SampleStatus

    @classmethod
    def from_row(cls, row: Mapping[str, Any], label_key: str | None = None, **fields: Any) -> Sample:
        """The row's columns, `label` from `label_key` when given, and `fields` (e.g. `session_id`)."""
        sample = cls(row)
        if label_key:
            if label_key not in row:
                raise KeyError(f"label_key {label_key!r}: the row has no such column (columns: {sorted(row)})")
            sample["label"] = row[label_key]
        sample.update(fields)
        return sample

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends probe dunders: they are not fields
            raise AttributeError(name)
        if name in self:
            return self[name]
        if name == "label" and "answer" in self:
            return self["answer"]
        if name == "prompt" and "messages" in self:
            return self["messages"]
        if name == "multimodal_inputs" and self.get("images"):
            return {"images": self["images"]}
        if name in _DEFAULTS:
            default = _DEFAULTS[name]
            return self.setdefault(name, default()) if callable(default) else default
        raise AttributeError(f"Sample has no field {name!r}: not a column of the row ({', '.join(sorted(self))}) "
                             f"nor one of slime's Sample fields ({', '.join(_DEFAULTS)})")

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        self.pop(name, None)


class Args(dict):
    """The env config read as slime's `args`: `args.max_turns`, `args["max_turns"]` and `args.get(...)`.

    slime sets every key of its `--custom-config-path` YAML on `args`; turnrl's `--custom-config` YAML is
    `env_config`, so the same keys arrive, with `max_turns` always set (the rollout's turn limit)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self:
            return self[name]
        raise AttributeError(f"args has no {name!r}: set it in the --custom-config YAML (or rollout.env_config); "
                             f"it has {', '.join(sorted(self)) or 'nothing'}")

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


def env_arguments(row: Mapping[str, Any], config: Mapping[str, Any], **fields: Any) -> tuple[Sample, Args]:
    """The `(sample, config)` that `build_env` receives for a row (see the module docstring)."""
    return Sample.from_row(row, config.get("label_key"), **fields), Args(config)


# ---- slime's reward functions (--custom-rm-path) ----------------------------------------------------
def reward_caller(fn: Callable[..., Any], name: str, tokenizer: Any = None, label_key: str | None = None
                  ) -> Callable[[Trajectory], Any] | None:
    """`fn` called as slime calls a `--custom-rm-path` function, when its signature is slime's: first parameter
    `args`, second `sample` (`reward_func(args, sample, **kwargs)`) or `samples` (batched: `(args, samples)`); else
    None. The trajectory arrives as a `Sample` (`reward_sample`) and `args` as `reward_args`. turnrl scores each
    trajectory as it finishes, so a batched function gets a list of one sample and returns a list of one reward."""
    params = list(inspect.signature(fn).parameters)
    if len(params) < 2 or params[0] != "args" or params[1] not in ("sample", "samples"):
        return None
    if tokenizer is None:
        raise ValueError(f"reward function {name!r} has slime's signature (args, {params[1]}); its sample.response is "
                         "the decoded response: bind it with the policy's tokenizer (bind_reward(fn, tokenizer=...))")
    batched = params[1] == "samples"
    args = reward_args(name, label_key)

    async def call(traj: Trajectory) -> Any:
        sample = reward_sample(traj, tokenizer, label_key)
        value = fn(args, [sample] if batched else sample)
        if inspect.isawaitable(value):
            value = await value
        if batched:
            if not isinstance(value, list | tuple) or len(value) != 1:
                raise TypeError(f"batched reward function {name!r} got 1 sample and returned {value!r:.80}; "
                                "expected a list of 1 reward")
            [value] = value
        return value

    call.__name__ = name
    return call


def reward_args(custom_rm_path: str, label_key: str | None = None) -> Args:
    """The `args` a slime reward function receives: slime's argument names that such functions read and turnrl can
    answer. `custom_rm_path` (the function), `rm_type` None, `label_key` (reward.answer_key, None for the default),
    `reward_key` None (a dict reward is scored by its "score"), `partial_rollout` False; any other name raises an
    AttributeError naming these."""
    return Args(custom_rm_path=custom_rm_path, rm_type=None, label_key=_given_label_key(label_key), reward_key=None,
                partial_rollout=False)


def reward_sample(traj: Trajectory, tokenizer: Any, label_key: str | None = None) -> Sample:
    """The finished trajectory as slime's `Sample` after its generate function: the row's columns, and

    - `prompt`: the prompt as text, the chat template applied and its special tokens kept (slime's
      --apply-chat-template: search-r1's reward looks for `<|im_start|>assistant` in `prompt + response`);
    - `response`: every token after the prompt decoded with `skip_special_tokens=True`, the text slime's
      generate functions accumulate from SGLang (model turns, tool and env outputs, and for turns rendered by
      the chat template its role text; the end-of-turn tokens dropped, as SGLang's text drops them);
    - `tokens` (prompt + response ids), `response_length`, `loss_mask`, `rollout_log_probs`;
    - `label`: the `label_key` column when given (reward.answer_key), else `label`, else `answer`;
    - `status` (Sample.Status of the trajectory's status), `reward` (None: not scored yet), `metadata` (the row's
      or {}), `session_id` (the trajectory id)."""
    sample = Sample.from_row(traj.sample, _given_label_key(label_key), session_id=traj.id)
    sample.update(
        prompt=tokenizer.decode(traj.prompt_ids, skip_special_tokens=False),
        response=tokenizer.decode(traj.response_ids, skip_special_tokens=True),
        tokens=[*traj.prompt_ids, *traj.response_ids], response_length=traj.num_response_tokens,
        loss_mask=traj.loss_mask, rollout_log_probs=traj.rollout_logprobs, reward=traj.reward,
        status=SampleStatus(str(traj.status)),
    )
    return sample


def _given_label_key(label_key: str | None) -> str | None:
    return None if label_key in (None, "", "answer") else label_key  # "answer": reward.answer_key's default


# ---- verl's reward arguments -----------------------------------------------------------------------
def reward_arguments(traj: Trajectory, tokenizer: Any = None) -> dict[str, Any]:
    """The arguments verl's reward managers pass that turnrl names otherwise (turnrl.rewards offers them by name):

    - `solution_str`: the whole response, every token after the prompt decoded with `skip_special_tokens=True`
      as verl's reward managers decode it (all assistant turns, tool and env outputs and the template's role
      text between them, not only the final reply: `response` is that); only with a `tokenizer`;
    - `ground_truth`: the row's `reward_model.ground_truth`, when it has one;
    - `extra_info`: the row's `extra_info` (a copy; {} without one) plus what verl's reward managers add:
      `num_turns` as verl's agent loop counts it (the prompt, each model turn and each tool or env response: 2
      for a single reply) and `rollout_reward_scores`, `{tool name: calc_reward()}` as the tools returned it.
    """
    row = traj.sample
    names: dict[str, Any] = {}
    if tokenizer is not None:
        names["solution_str"] = tokenizer.decode(traj.response_ids, skip_special_tokens=True)
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        names["ground_truth"] = reward_model["ground_truth"]
    extra_info = row.get("extra_info")
    names["extra_info"] = {**(extra_info if isinstance(extra_info, dict) else {}), "num_turns": verl_num_turns(traj),
                           "rollout_reward_scores": {**traj.tool_rewards, **traj.info.get("tool_reward_values", {})}}
    return names


def verl_num_turns(traj: Trajectory) -> int:
    """verl's `__num_turns__`: 1 (the prompt) + the model turns + the observations (tool or env responses) that
    followed them (verl's ToolAgentLoop: `user_turns + assistant_turns + 1`)."""
    observed = {s.turn for s in traj.segments if s.source in (SegmentSource.ENV, SegmentSource.TOOL)}
    return 1 + traj.num_turns + len(observed)
