"""OpenEnv environments, run unchanged (docs/ecosystems.md):

    --env openenv:MODULE:CLASS        an `openenv.core.env_server.Environment` subclass in this process
                                      (pip install 'turnrl[openenv]')
    --env openenv+http://HOST:PORT    a running OpenEnv server (`create_app(...)` served by uvicorn, in its own venv:
                                      openenv pins fastmcp<4, so mcp<2); one WebSocket session (`/ws`) per
                                      trajectory, HTTP `/reset` + `/step` where the server has no WebSocket

What maps to what:
- reset: `reset(seed=, episode_id=, **reset_kwargs)`; the seed is the row's `seed` (else one derived from the row:
  a group plays one episode), the episode id the trajectory id; both are in rollout_infos (`openenv_seed`,
  `openenv_episode_id`). Its observation is the episode's first message (after the row's prompt, if any).
- the reply becomes the action: an action model with one text field (besides OpenEnv's `metadata`) gets the reply
  (reasoning removed, stripped); any other is parsed from the JSON object in the reply. An action that does not
  validate is told to the model, naming the field, and the env is not stepped (`max_invalid_actions` in a row
  end the episode: no_action).
- an MCP environment (its actions are `CallToolAction`s): its tools (ListToolsAction) are rendered into the prompt
  as the tool agent's are, the reply's tool calls (`tool_parser`) become CallToolActions, and their results come
  back as tool messages (mask 0); a reply without a tool call ends the episode (no_tool_call).
- the observation becomes the next user message: its text fields (`observation_fields` picks them; one text field
  alone is the message, several become `name: value` lines), its images (PIL images, `data:image/...` strings) as
  image parts; `reward` is the step's reward, `done` ends the episode, `metadata` goes to the turn's info.
- rubric scores (in process: `env.rubric.named_rubrics()`) reach rollout_infos as `rubric`.

env_config keys: env_kwargs (constructor, in process), reset_kwargs, system_prompt, observation_fields,
max_invalid_actions (3), tool_parser (hermes), max_concurrent_envs, session_wait_s (300). A class that does not
declare `SUPPORTS_CONCURRENT_SESSIONS` runs one episode at a time in this process unless `max_concurrent_envs`
says otherwise; a server's own limit is learned from its CAPACITY_REACHED answer.
"""

from __future__ import annotations

import asyncio
import json
import re
import typing
import weakref
from typing import Any

from turnrl.envs.base import DEFAULT_THREADS, EnvFactory, call, episode_seed, episode_settings
from turnrl.envs.openenv_client import openai_tool, validation_problem
from turnrl.loading import load_object, split_object_spec
from turnrl.reasoning import split_reasoning
from turnrl.types import Message, StepResult, TerminationReason

SETTINGS = frozenset({"env_kwargs", "reset_kwargs", "system_prompt", "observation_fields", "max_invalid_actions",
                      "tool_parser", "max_concurrent_envs", "session_wait_s", "max_turns", "label_key"})


class InvalidAction(ValueError):
    """The reply is not a valid action; the message names the field and is shown to the model."""


def env_factory(spec: str) -> EnvFactory:
    scheme, _, target = spec.partition(":")
    if scheme == "openenv":
        backend = _local_backend_factory(spec, target)
    else:
        url = spec.removeprefix("openenv+")
        if not re.match(r"https?://[^/]+", url):
            raise ValueError(f"--env {spec}: expected openenv+http://HOST:PORT")
        backend = _remote_backend_factory(url.rstrip("/"))

    def build_env(sample: dict[str, Any], config: dict[str, Any]) -> OpenEnvEpisode:
        settings = episode_settings(sample, config)
        return OpenEnvEpisode(backend(settings), settings, episode_seed(sample), str(sample.get("session_id") or ""))

    build_env.opens_episode = True  # type: ignore[attr-defined]
    build_env.check = _check_settings  # type: ignore[attr-defined]
    return build_env


def _check_settings(config: dict[str, Any]) -> None:
    unknown = sorted(set(config) - SETTINGS)
    if unknown:
        raise ValueError(f"openenv env_config: unknown key(s) {unknown}; allowed: {sorted(SETTINGS)} (constructor "
                         "arguments go under env_kwargs, reset arguments under reset_kwargs)")


# ---- the episode -----------------------------------------------------------------------------------
class OpenEnvEpisode:
    """One trajectory's OpenEnv episode on a backend (in process or a server session); see the module docstring."""

    opens_episode = True

    def __init__(self, backend: Any, settings: dict[str, Any], seed: int, episode_id: str):
        self.backend, self.settings, self.seed, self.episode_id = backend, settings, seed, episode_id
        self.tools: list[dict] | None = None
        self.parser: Any = None
        self.invalid_streak = 0

    async def reset(self) -> list[Message]:
        kwargs = {"seed": self.seed, "episode_id": self.episode_id, **(self.settings.get("reset_kwargs") or {})}
        self.seed = kwargs["seed"]  # reset_kwargs may name its own (an env whose seed means something else)
        result = await self.backend.reset(**kwargs)
        if self.backend.is_mcp:
            from turnrl.tools import get_parser

            self.tools = await self.backend.list_tools()
            self.parser = get_parser(self.settings.get("tool_parser", "hermes"), self.tools)
        system = self.settings.get("system_prompt")
        messages: list[Message] = [{"role": "system", "content": system}] if system else []
        first = observation_message(result["observation"], self.settings.get("observation_fields"))
        return messages + ([first] if first is not None else [])

    async def step(self, text: str) -> StepResult:
        if self.backend.is_mcp:
            return await self._tool_step(text)
        try:
            action = parse_action(text, self.backend.action_schema)
        except InvalidAction as e:
            return self._invalid(str(e))
        result = await self.backend.step(action)
        if "invalid_action" in result:
            return self._invalid(result["invalid_action"])
        self.invalid_streak = 0
        done = bool(result.get("done"))
        message = None if done else observation_message(result["observation"], self.settings.get("observation_fields"))
        if not done and message is None:
            message = {"role": "user", "content": "(the environment returned an empty observation)"}
        return StepResult(message, reward=_reward(result), done=done, info={"action": action,
                          "metadata": result.get("metadata") or {}}, rollout_infos=self._infos())

    async def _tool_step(self, text: str) -> StepResult:
        parsed = self.parser.parse(text)
        if not parsed.calls and not parsed.errors:
            return StepResult(done=True, termination_reason=TerminationReason.NO_TOOL_CALL,
                              rollout_infos=self._infos())
        messages: list[Message] = [{"role": "tool", "content": f"Error: {error}"} for error in parsed.errors]
        rewards, done = [], False
        for tool_call in parsed.calls:
            result = await self.backend.step({"type": "call_tool", "tool_name": tool_call.name,
                                              "arguments": tool_call.arguments})
            messages.append(_tool_message(tool_call, result))
            rewards.append(_reward(result) or 0.0)
            done = done or bool(result.get("done"))
        return StepResult(messages, reward=sum(rewards), done=done, info={"tool_calls": len(parsed.calls)},
                          rollout_infos=self._infos())

    def _invalid(self, problem: str) -> StepResult:
        self.invalid_streak += 1
        limit = int(self.settings.get("max_invalid_actions", 3))
        if self.invalid_streak >= limit:
            return StepResult(done=True, termination_reason=TerminationReason.NO_ACTION,
                              info={"invalid_action": problem}, rollout_infos=self._infos())
        return StepResult(f"Invalid action: {problem}", reward=None, done=False, info={"invalid_action": problem},
                          rollout_infos=self._infos())

    def _infos(self) -> dict[str, Any]:
        infos: dict[str, Any] = {"openenv_seed": self.seed, "openenv_episode_id": self.episode_id}
        rubric = self.backend.rubric_scores()
        if rubric:
            infos["rubric"] = rubric
        return infos

    async def close(self) -> None:
        await self.backend.close()


def _reward(result: dict[str, Any]) -> float | None:
    reward = result.get("reward")
    return None if reward is None else float(reward)


def _tool_message(tool_call: Any, result: dict[str, Any]) -> Message:
    from turnrl.tools.mcp import tool_result

    observation = result.get("observation") or {}
    error = observation.get("error")
    if error:
        text = f"Error: {error.get('message', error) if isinstance(error, dict) else error}"
        return {"role": "tool", "tool_call_id": tool_call.id, "name": tool_call.name, "content": text}
    outcome = tool_result(observation.get("result"))
    message: Message = {"role": "tool", "tool_call_id": tool_call.id, "name": tool_call.name, "content": outcome.text}
    if outcome.images:
        message["content"] = [*({"type": "image", "image": im} for im in outcome.images),
                              {"type": "text", "text": outcome.text}]
    return message


# ---- actions and observations ----------------------------------------------------------------------
def action_fields(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The action's fields (JSON schema properties) other than OpenEnv's own `metadata`, $refs resolved."""
    defs = schema.get("$defs", {})
    fields = {}
    for name, prop in (schema.get("properties") or {}).items():
        if name == "metadata":
            continue
        ref = prop.get("$ref") or next((p.get("$ref") for p in prop.get("allOf", []) if "$ref" in p), None)
        fields[name] = defs.get(ref.rpartition("/")[2], prop) if ref else prop
    return fields


def _is_text(prop: dict[str, Any]) -> bool:
    options = prop.get("anyOf") or [prop]
    return any(o.get("type") == "string" or (o.get("enum") and all(isinstance(v, str) for v in o["enum"]))
               for o in options)


def parse_action(text: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The reply as an action dict (the module docstring's rule); InvalidAction names what is wrong."""
    body = split_reasoning(text)[1].strip()
    fields = action_fields(schema)
    if len(fields) == 1 and _is_text(next(iter(fields.values()))):
        name = next(iter(fields))
        parsed = _json_object(body)
        value = parsed[name] if isinstance(parsed, dict) and isinstance(parsed.get(name), str) else body
        _check_enum(name, fields[name], value)
        return {name: value}
    parsed = _json_object(body)
    if not isinstance(parsed, dict):
        raise InvalidAction(f"reply with a JSON object with the fields {_describe(fields)}")
    missing = [n for n in schema.get("required", []) if n not in parsed]
    if missing:
        raise InvalidAction(f"field {missing[0]!r} is missing; the action has the fields {_describe(fields)}")
    unknown = [n for n in parsed if n not in fields and n != "metadata"]
    if unknown:
        raise InvalidAction(f"field {unknown[0]!r} is not an action field; the fields are {_describe(fields)}")
    for name, value in parsed.items():
        if name in fields:
            _check_enum(name, fields[name], value)
    return parsed


def _check_enum(name: str, prop: dict[str, Any], value: Any) -> None:
    allowed = prop.get("enum")
    if allowed is not None and value not in allowed:
        raise InvalidAction(f"field {name!r} must be one of {', '.join(map(str, allowed))}; got {str(value)!r:.60}")


def _describe(fields: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{n} ({p.get('type') or 'one of ' + '/'.join(map(str, p.get('enum', [])))})"
                     for n, p in fields.items())


def _json_object(body: str) -> Any:
    """The JSON object in a reply: the whole reply, a ```json fence, or the last {...} span that parses."""
    fenced = re.search(r"```(?:json)?\s*(\{.*?\})\s*```", body, re.DOTALL)
    candidates = [body, *([fenced.group(1)] if fenced else []),
                  *(body[i:] for i in reversed([m.start() for m in re.finditer(r"\{", body)]))]
    decoder = json.JSONDecoder()
    for candidate in candidates:
        try:
            value, _ = decoder.raw_decode(candidate.strip())
        except (json.JSONDecodeError, ValueError):
            continue
        if isinstance(value, dict):
            return value
    return None


def observation_message(observation: dict[str, Any], fields: list[str] | None = None) -> Message | None:
    """An observation's fields as a user message (its text and images), None when it shows nothing."""
    shown = {k: v for k, v in observation.items() if k != "metadata" and v not in (None, "", [], {})}
    if fields is not None:
        shown = {k: observation.get(k) for k in fields if observation.get(k) not in (None, "", [], {})}
    images = [v for v in shown.values() if _is_image(v)]
    texts = {k: v for k, v in shown.items() if not _is_image(v)}
    if len(texts) == 1 and isinstance(next(iter(texts.values())), str):
        text = next(iter(texts.values()))
    else:
        text = "\n".join(f"{k}: {v if isinstance(v, str) else json.dumps(v, default=str)}" for k, v in texts.items())
    if not text and not images:
        return None
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                        *([{"type": "text", "text": text}] if text else [])]}


def _is_image(value: Any) -> bool:
    return (isinstance(value, str) and value.startswith("data:image/")) or type(value).__module__.startswith("PIL.")


# ---- in process ------------------------------------------------------------------------------------
def _local_backend_factory(spec: str, target: str) -> Any:
    try:
        from openenv.core.env_server.interfaces import Environment
    except ImportError as e:
        raise ImportError(f"--env {spec} runs an OpenEnv environment in this process and needs openenv ({e}): "
                          "pip install 'turnrl[openenv]' (or serve it in its own venv and use "
                          "--env openenv+http://HOST:PORT)") from None
    split_object_spec(target, "OpenEnv environment")
    env_cls = load_object(target, what="OpenEnv environment")
    if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
        raise ValueError(f"--env {spec}: {target} is not a subclass of openenv's Environment")
    action_cls = _action_class(env_cls)
    return lambda settings: LocalBackend(env_cls, action_cls, settings)


def _action_class(env_cls: Any) -> Any:
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction

    if issubclass(env_cls, MCPEnvironment):
        return CallToolAction
    try:
        hints = typing.get_type_hints(env_cls.step)
    except Exception:  # annotations naming what the module does not import: fall back to the generic parameter
        hints = {}
    action = hints.get("action")
    if isinstance(action, type):
        return action
    for base in getattr(env_cls, "__orig_bases__", ()):
        args = typing.get_args(base)
        if args and isinstance(args[0], type):
            return args[0]
    raise ValueError(f"{env_cls.__qualname__}: cannot tell its Action class (annotate step(self, action: MyAction))")


_SLOTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[type, asyncio.Semaphore]] = \
    weakref.WeakKeyDictionary()


class LocalBackend:
    """An `Environment` instance of this trajectory; sync methods run on turnrl's env threads."""

    def __init__(self, env_cls: Any, action_cls: Any, settings: dict[str, Any]):
        from openenv.core.env_server.mcp_environment import MCPEnvironment

        self.env_cls, self.action_cls, self.settings = env_cls, action_cls, settings
        self.is_mcp = issubclass(env_cls, MCPEnvironment)
        self.action_schema = action_cls.model_json_schema()
        self.env: Any = None
        self._slot: asyncio.Semaphore | None = None

    def _slots(self) -> asyncio.Semaphore:
        """Per class and event loop: a class without SUPPORTS_CONCURRENT_SESSIONS runs one episode at a time."""
        per_loop = _SLOTS.setdefault(asyncio.get_running_loop(), {})
        if self.env_cls not in per_loop:
            default = 1 << 30 if getattr(self.env_cls, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1
            per_loop[self.env_cls] = asyncio.Semaphore(int(self.settings.get("max_concurrent_envs", default)))
        return per_loop[self.env_cls]

    async def reset(self, **kwargs: Any) -> dict[str, Any]:
        slots = self._slots()
        await asyncio.wait_for(slots.acquire(), float(self.settings.get("session_wait_s", 300)))
        self._slot = slots
        self.env = await call(lambda: self.env_cls(**(self.settings.get("env_kwargs") or {})), threads=DEFAULT_THREADS)
        return await self._run("reset", _accepted(self.env.reset, kwargs))

    async def step(self, action: dict[str, Any]) -> dict[str, Any]:
        from pydantic import ValidationError

        try:
            typed = self.action_cls.model_validate(action)
        except ValidationError as e:
            return {"invalid_action": validation_problem(e.errors())}
        return await self._run("step", {"action": typed})

    async def _run(self, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        from openenv.core.env_server.interfaces import Environment
        from openenv.core.env_server.serialization import serialize_observation

        own_async = getattr(type(self.env), f"{method}_async") is not getattr(Environment, f"{method}_async")
        if own_async:  # the env's own async method (MCP envs route tools there)
            observation = await getattr(self.env, f"{method}_async")(**kwargs)
        else:
            observation = await call(lambda: getattr(self.env, method)(**kwargs), threads=DEFAULT_THREADS)
        return serialize_observation(observation)

    async def list_tools(self) -> list[dict]:
        from openenv.core.env_server.mcp_types import ListToolsAction

        observation = await self.env.step_async(ListToolsAction())
        return [openai_tool(t.model_dump()) for t in observation.tools]

    def rubric_scores(self) -> dict[str, float]:
        rubric = getattr(self.env, "rubric", None)
        if rubric is None:
            return {}
        return {name or "rubric": r.last_score for name, r in [("", rubric), *rubric.named_rubrics()]
                if r.last_score is not None}

    async def close(self) -> None:
        try:
            if self.env is not None:
                await call(self.env.close, threads=DEFAULT_THREADS)
        finally:
            if self._slot is not None:
                self._slot.release()
                self._slot = None


def _accepted(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `fn` takes (OpenEnv's servers do the same: GridWorld's reset takes no seed)."""
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


# ---- a server --------------------------------------------------------------------------------------
def _remote_backend_factory(url: str) -> Any:
    from turnrl.envs.openenv_client import RemoteBackend, ServerInfo

    info = ServerInfo(url)
    return lambda settings: RemoteBackend(info, settings)
