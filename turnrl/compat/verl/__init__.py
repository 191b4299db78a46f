"""verl's tool API on turnrl's stateful tools: a verl `BaseTool` subclass ports by changing its imports.

    from verl.tools.base_tool import BaseTool               →  from turnrl.compat.verl import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
                                             →  from turnrl.compat.verl import OpenAIFunctionToolSchema, ToolResponse
    from verl.utils.rollout_trace import rollout_trace_op   →  from turnrl.compat.verl import rollout_trace_op
    from verl.utils.reward_score import gsm8k               →  from turnrl.compat.verl import gsm8k   (also geo3k)
    from verl.interactions.base import BaseInteraction      →  from turnrl.compat.verl import BaseInteraction
                                                               (run with --env turnrl.compat.verl.interaction:
                                                               turnrl.compat.verl.interaction)

A verl tool-config YAML (`tools: [{class_name, config, tool_schema}]`) whose `class_name` names such a class loads
with `--tools tools.yaml`. The class keeps verl's lifecycle and signatures, sync or async:

    __init__(config, tool_schema: OpenAIFunctionToolSchema)
    create(instance_id=None, **kwargs) -> (instance_id, ToolResponse)     (a bare instance id is accepted too)
    execute(instance_id, parameters, **kwargs) -> (ToolResponse, reward, metrics)
    calc_reward(instance_id, **kwargs) -> float (or anything: verl's SearchTool returns its list of results)
    release(instance_id, **kwargs)

How turnrl runs it (`__turnrl_tool_spec__`, the hook turnrl.tools.ToolSpec.from_class looks for): the class is
constructed once per process, as verl constructs it once per worker, and every trajectory gets its own instance
id: `create` before the trajectory's first call of the tool, `execute` per call, `calc_reward` when the episode
ends (a number reaches reward functions as `tool_rewards[name]`; any other value is no reward and is kept in the
trajectory's `info["tool_reward_values"]` with a warning; verl-signature reward functions get every value in
`extra_info["rollout_reward_scores"]`, as verl's reward managers pass them), `release` always, also after a failure. This is
the lifecycle of verl's SGLang multi-turn path; verl's agent loop instead creates and releases around every
call and never calls `calc_reward`. `create` receives the row's `tools_kwargs[name]["create_kwargs"]` (the
row's column or verl's `extra_info.tools_kwargs`) both ways verl has passed it: as keyword arguments (the
SGLang path: `create(instance_id, ground_truth=...)`) and as `create_kwargs={...}` (the agent loop), each only
when the signature can take it. The execute reward is the step reward (`turn_rewards`), its metrics go to the
tool call's record, and what `execute` returns reaches the model as the tool message (images too; video fails the
trajectory with an error saying so). An exception the tool raises is told to the model, as verl does; a
malformed result (a reward that is not a number) fails the trajectory.
"""

from __future__ import annotations

import inspect
import json
from functools import partial
from typing import Any, Literal
from uuid import uuid4

from pydantic import BaseModel, ConfigDict, Field, model_validator

from turnrl.calling import reward_arguments, verl_num_turns
from turnrl.envs.base import call
from turnrl.observe.tracing import traced
from turnrl.tools.function_tool import ToolLifecycleError, normalize_tool_schema
from turnrl.tools.function_tool import ToolResponse as _TurnrlToolResponse
from turnrl.tools.stateful import ToolSpec

rollout_trace_op = traced
"""verl's decorator: the decorated function's calls (inputs, outputs, errors, times) are recorded under the tool
call's span of turnrl's traces (`tool_calls[i].spans` in the trajectory JSONL; MLflow with --trace-uri)."""


# ---- schemas (verl.tools.schemas) ------------------------------------------------------------------
class _Schema(BaseModel):
    # extra JSON-schema keys (items, anyOf, minimum, ...) are kept, where verl's models drop them
    model_config = ConfigDict(extra="allow")


class OpenAIFunctionPropertySchema(_Schema):
    """One parameter of a function schema."""

    type: str | list[str] | None = None
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(_Schema):
    """The parameters of a function schema (a JSON schema of type object)."""

    type: str = "object"
    properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(_Schema):
    name: str
    description: str = ""
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=OpenAIFunctionParametersSchema)
    strict: bool = False


class OpenAIFunctionToolSchema(_Schema):
    """A tool in OpenAI format: `schema.function.name`, `schema.function.parameters.properties`."""

    type: str = "function"
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    name: str
    arguments: str
    """The arguments as the model wrote them: a JSON string."""


class OpenAIFunctionCallSchema(BaseModel):
    name: str
    arguments: dict[str, Any]

    @staticmethod
    def from_openai_function_parsed_schema(parsed: OpenAIFunctionParsedSchema
                                           ) -> tuple[OpenAIFunctionCallSchema, bool]:
        """The call with its arguments decoded, and whether decoding failed (then the arguments are {})."""
        try:
            arguments = json.loads(parsed.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            return OpenAIFunctionCallSchema(name=parsed.name, arguments={}), True
        return OpenAIFunctionCallSchema(name=parsed.name, arguments=arguments), False


class OpenAIFunctionToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a verl tool returns to the model: text, images (a list) and videos (a list; turnrl refuses them)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, values: Any) -> Any:
        for key in ("image", "video"):
            if isinstance(values, dict) and values.get(key) is not None and not isinstance(values[key], list):
                raise ValueError(f"ToolResponse.{key} must be a list (wrap one item as [{key}]), "
                                 f"got {type(values[key]).__name__}")
        return values

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video


# ---- the base class ---------------------------------------------------------------------------------
class BaseTool:
    """verl's tool base class (module docstring). Subclasses override `create`, `execute`, `calc_reward`,
    `release`, and `get_openai_tool_schema` when the tool config gives no `tool_schema`."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | dict | None):
        self.config = config
        if isinstance(tool_schema, dict):
            tool_schema = OpenAIFunctionToolSchema.model_validate(tool_schema)
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"tool class {type(self).__qualname__}: no tool schema; give `tool_schema:` in the tool "
                             "config or override get_openai_tool_schema()")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return self.__dict__.get("tool_schema")

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid4()), ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None

    @classmethod
    def __turnrl_tool_spec__(cls, config: dict[str, Any], tool_schema: dict[str, Any] | None, source: str
                             ) -> ToolSpec:
        """The ToolSpec that runs this class (module docstring): one shared instance, one id per trajectory."""
        tool = cls(config, OpenAIFunctionToolSchema.model_validate(tool_schema) if tool_schema is not None else None)
        given: Any = tool.tool_schema
        if isinstance(given, BaseModel):
            given = given.model_dump(exclude_unset=True, exclude_none=True)
        schema = normalize_tool_schema(given, source)
        return ToolSpec(name=schema["function"]["name"], cls=partial(_TrajectoryTool, tool), config=config,
                        schema=schema, source=source)


class _TrajectoryTool:
    """One trajectory's use of a shared verl tool: turnrl's StatefulTool contract, verl's calls underneath."""

    def __init__(self, tool: BaseTool, config: dict[str, Any], schema: dict[str, Any]):
        self.tool, self.schema = tool, schema
        self.name: str = schema["function"]["name"]
        self.instance_id: str | None = None

    async def create(self, **create_kwargs: Any) -> None:
        created = await call(partial(self.tool.create, **_create_arguments(self.tool.create, create_kwargs)))
        self.instance_id = created[0] if isinstance(created, tuple) else created
        if self.instance_id is None:
            raise TypeError(f"{type(self.tool).__qualname__}.create() returned no instance id ({created!r:.80})")

    async def execute(self, arguments: dict[str, Any]) -> Any:
        return _turnrl_result(await call(self.tool.execute, self.instance_id, arguments))

    async def calc_reward(self) -> Any:
        return await call(self.tool.calc_reward, self.instance_id)

    async def release(self) -> None:
        if self.instance_id is not None:  # create failed: there is no instance to release (as in verl)
            await call(self.tool.release, self.instance_id)


def _create_arguments(create: Any, create_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The row's create_kwargs as keywords, plus `create_kwargs={...}` when `create` can take it."""
    params = inspect.signature(create).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    kwargs = dict(create_kwargs)
    if (takes_any or "create_kwargs" in params) and "create_kwargs" not in kwargs:
        kwargs["create_kwargs"] = dict(create_kwargs)
    return kwargs


def _turnrl_result(value: Any) -> Any:
    """`(ToolResponse, reward, metrics)` (or a bare ToolResponse) with turnrl's ToolResponse inside. The tool session
    checks the rest (turnrl.tools.normalize_result): a malformed result is a bug of the tool and fails the
    trajectory, where an exception raised by the tool is told to the model."""
    if isinstance(value, tuple) and value and isinstance(value[0], ToolResponse):
        return (_turnrl_response(value[0]), *value[1:])
    return _turnrl_response(value) if isinstance(value, ToolResponse) else value


def _turnrl_response(response: ToolResponse) -> _TurnrlToolResponse:
    if response.video:
        raise ToolLifecycleError("a tool returned ToolResponse(video=...): video tool responses are not supported")
    return _TurnrlToolResponse(text=response.text or "", images=list(response.image or []))


from turnrl.compat.verl.interaction import BaseInteraction  # noqa: E402 (it imports nothing of this module)

__all__ = [
    "BaseInteraction",
    "BaseTool",
    "OpenAIFunctionCallSchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionParsedSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolCall",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
    "reward_arguments",
    "rollout_trace_op",
    "verl_num_turns",
]
