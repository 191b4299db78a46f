"""verl's interactions (`verl.interactions.base.BaseInteraction`) as a turnrl environment: a verl interaction
ports by changing its imports, and its interaction-config YAML is the `--custom-config`.

    from verl.interactions.base import BaseInteraction   →  from turnrl.compat.verl import BaseInteraction
    from verl.utils.reward_score import gsm8k            →  from turnrl.compat.verl import gsm8k

    turnrl rollout --model M --data train.parquet --env turnrl.compat.verl.interaction \\
        --custom-config gsm8k_interaction_config.yaml --max-turns 4 --reward env_last

The YAML is verl's (`interaction: [{name, class_name, config}]`, `class_name` a `package.module.Class` or
`file.py:Class`); a custom config may instead give its path as `interaction_config_path` (verl's key). Each
class is constructed once per process with its `config` (plus `name`, as verl's registry injects it; without a
`name`, the class name less "Interaction", lower-cased). A row picks its interaction by
`extra_info.interaction_kwargs.name` (or an `interaction_kwargs` column), as verl's rows from
gsm8k_multiturn_w_interaction.py carry it. Per trajectory, as verl's agent loop runs it:

    start_interaction(instance_id, **interaction_kwargs)            before the first turn
    generate_response(instance_id, messages, **interaction_kwargs)  after each model reply: (should_terminate,
        response, score, metrics): `response` is the next user message, `score` the step reward (`turn_rewards`),
        `metrics` the step's info, and `should_terminate` ends the episode
    finalize_interaction(instance_id)                               always at the end (verl's SGLang path)

`messages` is the conversation so far: the row's prompt, then each reply (its text) and each response. Tools
and an interaction in the same episode (verl allows both) are not supported here.
"""

from __future__ import annotations

import inspect
import json
import threading
from typing import Any
from uuid import uuid4

from turnrl.config import load_custom_config
from turnrl.data import prompt_messages
from turnrl.envs.base import call
from turnrl.loading import load_object
from turnrl.types import StepResult


class BaseInteraction:
    """verl's interaction base class (module docstring); subclasses override the four async methods."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return instance_id or str(uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
                                ) -> tuple[bool, str, float, dict[str, Any]]:
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self) -> float:
        return 0.0

    async def finalize_interaction(self) -> None:
        return None


_INTERACTIONS: dict[str, dict[str, BaseInteraction]] = {}
"""The interactions of each interaction config (by its JSON), built once per process as verl builds them."""
_BUILDING = threading.Lock()  # env factories run on threads: two first trajectories must not build two sets


def interaction_map(entries: Any) -> dict[str, BaseInteraction]:
    """verl's `initialize_interactions_from_config` on the YAML's `interaction:` list: {name: instance}."""
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("class_name"), str)
                                                for e in entries):
        raise ValueError("interaction config: `interaction:` must be a list of {name, class_name, config} "
                         f"mappings (verl's interaction_config YAML), got {entries!r:.120}")
    key = json.dumps(entries, sort_keys=True, default=str)
    with _BUILDING:
        if key not in _INTERACTIONS:
            built: dict[str, BaseInteraction] = {}
            for entry in entries:
                cls = _load_class(entry["class_name"])
                name = entry.get("name") or _default_name(entry["class_name"])
                if name in built:
                    raise ValueError(f"interaction config: duplicate interaction name {name!r}")
                built[name] = cls(config={**(entry.get("config") or {}), "name": name})
            _INTERACTIONS[key] = built
    return _INTERACTIONS[key]


def _load_class(class_name: str) -> Any:
    if ".py:" in class_name or ":" in class_name:
        return load_object(class_name, what="interaction")
    module, _, attr = class_name.rpartition(".")
    if not module:
        raise ValueError(f"interaction class_name {class_name!r}: expected package.module.Class or file.py:Class")
    return load_object(f"{module}:{attr}", what="interaction")


def _default_name(class_name: str) -> str:
    simple = class_name.replace(":", ".").rsplit(".", 1)[-1]
    return (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def row_interaction_kwargs(sample: dict[str, Any]) -> dict[str, Any]:
    """The row's `interaction_kwargs` column, else its `extra_info.interaction_kwargs` (verl's rows)."""
    kwargs = sample.get("interaction_kwargs")
    if kwargs is None and isinstance(sample.get("extra_info"), dict):
        kwargs = sample["extra_info"].get("interaction_kwargs")
    if not isinstance(kwargs, dict) or "name" not in kwargs:
        raise ValueError("a verl interaction row needs extra_info.interaction_kwargs (or an interaction_kwargs "
                         f"column) with a `name`; this row has {sorted(sample)}")
    return kwargs


class InteractionEnv:
    """One trajectory of a verl interaction (module docstring)."""

    def __init__(self, interaction: BaseInteraction, kwargs: dict[str, Any], messages: list[dict[str, Any]],
                 instance_id: str):
        self.interaction, self.kwargs, self.messages = interaction, kwargs, messages
        self.instance_id = instance_id

    async def reset(self) -> None:
        self.instance_id = await self.interaction.start_interaction(self.instance_id, **self.kwargs)

    async def step(self, response_text: str) -> StepResult:
        self.messages.append({"role": "assistant", "content": response_text})
        done, response, score, metrics = await self.interaction.generate_response(
            self.instance_id, self.messages, **self.kwargs)
        self.messages.append({"role": "user", "content": response})
        return StepResult(observation=None if done else response, reward=score, done=bool(done),
                          info=dict(metrics or {}))

    async def close(self) -> None:
        finalize = self.interaction.finalize_interaction
        takes_id = any(p.kind != p.VAR_KEYWORD for p in inspect.signature(finalize).parameters.values())
        await (call(finalize, self.instance_id) if takes_id else call(finalize))


def build_env(sample: dict[str, Any], config: dict[str, Any]) -> InteractionEnv:
    """The env of a row: its interaction (by `interaction_kwargs.name`) from the config's `interaction:` list
    (or the YAML at `interaction_config_path`)."""
    entries = config.get("interaction")
    if entries is None and config.get("interaction_config_path"):
        entries = load_custom_config(config["interaction_config_path"]).get("interaction")
    if entries is None:
        raise ValueError("verl interactions need verl's interaction config: pass it as --custom-config "
                         "(`interaction: [{name, class_name, config}]`) or set interaction_config_path in it")
    interactions = interaction_map(entries)
    kwargs = row_interaction_kwargs(sample)
    if kwargs["name"] not in interactions:
        raise ValueError(f"interaction {kwargs['name']!r} not in the interaction config (it has "
                         f"{', '.join(interactions)})")
    instance_id = str(sample.get("session_id") or uuid4())
    return InteractionEnv(interactions[kwargs["name"]], dict(kwargs), prompt_messages(dict(sample)), instance_id)
