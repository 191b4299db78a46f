"""Tools as coding-agent harnesses declare them, in the proxy's terms (the function tools the model sees), and the
model's calls routed back as each API defines them.

- `function`: as it is.
- `custom` (free-form: the Responses API's `{type: custom, name, description, format}`, chat's `{type: custom,
  custom: {...}}`): a function with one string parameter, `input`; the model's call of it goes back as the API's
  custom tool call carrying that string (Responses `custom_tool_call` {name, input}, chat `{type: custom, custom:
  {name, input}}`). A grammar in `format` is not enforced (decoding is not constrained here).
- `namespace` (the Responses API's `{type: namespace, name, description, tools: [...]}`, e.g. Codex's
  `multi_agent_v1`): each of its function and custom tools becomes a function named `<namespace>__<name>`, the
  flattened name the Responses API uses (Codex's `ToolName::canonical_flat_name`); a call of it goes back with
  `namespace` and the tool's own `name`, and a call echoed back that way is that function again.
- hosted tools, run by the model provider (`web_search`, `file_search`, `code_interpreter`, `image_generation`,
  `mcp`, ...; Anthropic's server tools such as `web_search_20250305`), and tools declared for later loading
  (Anthropic's `defer_loading`): this server runs none of them, so they are accepted and not offered to the model
  (`ChatCall.not_offered`; the session logs it once and each call records it in its notes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from turnrl.serve.sessions import ChatRequestError

NAMESPACE_SEPARATOR = "__"

_INPUT_SCHEMA = {"type": "object", "properties": {"input": {"type": "string", "description": "The tool's input, as "
                                                               "free-form text."}}, "required": ["input"]}


@dataclass(frozen=True)
class Origin:
    """Where a function the model sees came from: its kind (function or custom), namespace and own name."""

    kind: str
    name: str
    namespace: str | None = None


@dataclass
class Offered:
    """A request's tools in the proxy's terms."""

    functions: list[dict] = field(default_factory=list)
    """Chat-completions function tools: what the chat template shows the model."""
    origins: dict[str, Origin] = field(default_factory=dict)
    """Function name -> where it came from (only for the names that are not plain functions)."""
    not_offered: list[str] = field(default_factory=list)
    """Hosted and deferred tools, by type or name."""


def flat_name(namespace: str | None, name: str) -> str:
    """The name a namespaced tool has as a function: `<namespace>__<name>` (stray underscores around the
    separator trimmed, as the Responses API does)."""
    return name if not namespace else f"{namespace.rstrip('_')}{NAMESPACE_SEPARATOR}{name.lstrip('_')}"


def function_tool(name: str, description: str | None, parameters: Any) -> dict:
    fn: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


def custom_tool(name: str, description: str | None) -> dict:
    """A free-form tool as a function of one string, `input`."""
    return function_tool(name, description, _INPUT_SCHEMA)


def responses_tools(tools: Any) -> Offered:
    """The Responses API's `tools`: function, custom, namespace (flattened), hosted (not offered)."""
    offered = Offered()
    if not tools:
        return offered
    if not isinstance(tools, list):
        raise ChatRequestError("tools must be a list", param="tools")
    for i, tool in enumerate(tools):
        _add_responses_tool(offered, tool, f"tools[{i}]", None)
    return offered


def _add_responses_tool(offered: Offered, tool: Any, where: str, namespace: str | None) -> None:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind is None:
        raise ChatRequestError(f"{where} must be a tool object with a `type`", param=where)
    if kind == "namespace" and namespace is None:
        inner = tool.get("tools")
        if not isinstance(tool.get("name"), str) or not isinstance(inner, list):
            raise ChatRequestError(f"{where}: a namespace tool needs `name` and `tools` (a list)", param=where)
        for j, member in enumerate(inner):
            _add_responses_tool(offered, member, f"{where}.tools[{j}]", tool["name"])
        return
    if kind not in ("function", "custom"):  # a hosted tool (web_search, file_search, ...), run by the provider
        offered.not_offered.append(str(tool.get("name") or kind))
        return
    if not isinstance(tool.get("name"), str):
        raise ChatRequestError(f"{where}: a {kind} tool needs a `name`", param=where)
    name = flat_name(namespace, tool["name"])
    if kind == "custom":
        offered.functions.append(custom_tool(name, tool.get("description")))
    else:
        offered.functions.append(function_tool(name, tool.get("description"), tool.get("parameters")))
    if kind == "custom" or namespace:
        offered.origins[name] = Origin(kind, tool["name"], namespace)


def custom_input(arguments: str) -> str:
    """The free-form input of a custom tool's call: the `input` the model gave, else its arguments as written."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return parsed["input"] if isinstance(parsed, dict) and isinstance(parsed.get("input"), str) else arguments


def custom_arguments(text: Any) -> str:
    """The arguments of a custom tool's call echoed back (its input string), as the function the model saw."""
    return json.dumps({"input": text if isinstance(text, str) else json.dumps(text)}, ensure_ascii=False)
