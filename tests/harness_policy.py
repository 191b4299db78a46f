"""A scripted policy that drives real coding-agent CLIs: it reads the tools the CLI offered from the prompt it was
given (the Qwen3 template lists them one JSON per line inside <tools>), writes the task's file with the CLI's own
write tool (Claude Code's Write, opencode's write, Codex's exec_command, the test CLI's write_file), and says it is
done once a tool result came back. A call without tools (a title) gets a short title. tiny-qwen3 cannot drive a
CLI; this script can, and every token it "samples" goes through the engine contract like a model's."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable

WRITERS: dict[str, Callable[[str, str], dict]] = {
    "Write": lambda path, text: {"file_path": path, "content": text + "\n"},          # Claude Code
    "write": lambda path, text: {"filePath": path, "content": text + "\n"},           # opencode
    "exec_command": lambda path, text: {"cmd": f"printf '%s\\n' {shlex.quote(text)} > {shlex.quote(path)}"},  # Codex
    "write_file": lambda path, text: {"path": path, "content": text},                 # tests/harness_cli.py
}


def offered_tools(prompt: str) -> list[str]:
    """The names of the tools in the prompt's <tools> block (function tools, flattened namespaces included)."""
    block = re.search(r"<tools>\n(.*?)\n</tools>", prompt, re.S)
    names = []
    for line in block.group(1).splitlines() if block else ():
        try:
            tool = json.loads(line)
        except json.JSONDecodeError:
            continue
        names.append((tool.get("function") or tool).get("name"))
    return names


def answered(prompt: str) -> bool:
    """Whether the last turn before the assistant's brought a tool result."""
    head = prompt.rsplit("<|im_start|>assistant", 1)[0]
    last = head.rsplit("<|im_start|>", 1)[-1]
    return "<tool_response>" in last


def tool_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


_TASK = re.compile(r"named `([^`]+)` in the working directory \((/[^)]*)\) whose whole content is the line:\s*\n"
                   r"\s*\n([^\n<]+)")  # the line ends at a newline or at the end of its turn (<|im_end|>)


def the_task(prompt: str) -> tuple[str, str]:
    """(path, text) the task's instruction asks for (tests/data/harbor/write-*), read from the prompt."""
    found = _TASK.search(prompt)
    assert found, "the prompt holds no write-a-file instruction"
    return f"{found.group(2).rstrip('/')}/{found.group(1)}", found.group(3).strip()


def harness_policy(text_of: Callable[[str, str], str | None] | None = None) -> Callable[[str, int, str], str | None]:
    """The ScriptedEngine script: the text the task asks for, or `text_of(request_id, text)` (None: the engine
    fails the call)."""
    def script(request_id: str, turn: int, prompt: str) -> str | None:
        if answered(prompt):
            return "Done: the file is written."
        tools = offered_tools(prompt)
        writer = next((name for name in WRITERS if name in tools), None)
        if writer is None:
            return "Greeting file"
        path, text = the_task(prompt)
        content = text if text_of is None else text_of(request_id, text)
        return None if content is None else tool_call(writer, WRITERS[writer](path, content))
    return script


SUBAGENT = "SUBAGENT: "


def is_subagent(prompt: str) -> bool:
    """A sub-agent's conversation: a user turn (not a tool result) holds the task its parent gave it."""
    return any(turn.startswith("user") and SUBAGENT in turn and "<tool_response>" not in turn
               for turn in prompt.split("<|im_start|>"))


def _sub_task(prompt: str) -> str:
    path, text = the_task(prompt)
    return (f"{SUBAGENT}Create a file named `{path.rsplit('/', 1)[1]}` in the working directory (/app) whose whole "
            f"content is the line:\n\n{text}")


def _sub_agent_turn(prompt: str) -> str:
    """The sub-agent writes the file with its CLI's write tool, then reports."""
    if answered(prompt):
        return "Sub-agent done."
    writer = next(name for name in WRITERS if name in offered_tools(prompt))
    path, text = the_task(prompt)
    return tool_call(writer, WRITERS[writer](path, text))


def codex_subagent_policy() -> Callable[[str, int, str], str | None]:
    """Codex with a sub-agent: the main agent spawns one through the namespaced tool `multi_agent_v1__spawn_agent`
    (flattened as the Responses API does), waits for it (`multi_agent_v1__wait_agent` with the id spawn_agent
    returned) and is done when it reports back; the sub-agent (its task starts with SUBAGENT) writes the file."""
    def script(request_id: str, turn: int, prompt: str) -> str | None:
        if is_subagent(prompt):
            return _sub_agent_turn(prompt)
        head = prompt.rsplit("<|im_start|>assistant", 1)[0]
        last = head.rsplit("<|im_start|>", 1)[-1]
        if "<subagent_notification>" in last or '<tool_call>\n{"name": "multi_agent_v1__wait_agent"' in head:
            return "Done: the sub-agent wrote the file."
        spawned = re.search(r'"agent_id"\s*:\s*"([^"]+)"', last)
        if spawned:
            return tool_call("multi_agent_v1__wait_agent", {"targets": [spawned.group(1)], "timeout_ms": 60000})
        return tool_call("multi_agent_v1__spawn_agent", {"message": _sub_task(prompt)})
    return script


def claude_subagent_policy() -> Callable[[str, int, str], str | None]:
    """Claude Code with a sub-agent: the main agent gives the task to its Agent tool (in the foreground) and is
    done when the result comes back; the sub-agent writes the file with Write."""
    def script(request_id: str, turn: int, prompt: str) -> str | None:
        if is_subagent(prompt):
            return _sub_agent_turn(prompt)
        if answered(prompt):
            return "Done: the sub-agent wrote the file."
        return tool_call("Agent", {"description": "Write the greeting file", "prompt": _sub_task(prompt),
                                   "run_in_background": False})
    return script
