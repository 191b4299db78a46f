"""Dataset rows: loading JSONL/parquet files and turning a row's `prompt` into chat messages.

A row is a JSON object with a `prompt` (a string, or a list of chat messages) and any other columns; the
other columns travel with the trajectory (`Trajectory.sample`) to environments, tools and reward functions.
Optional columns with a meaning: `id`, `system` (a system prompt prepended to a string prompt),
`agent_name`, `tools_kwargs`, `tool_selection`, `images`, `env_config`, `seed`.

Rows for an environment that opens the episode itself (its `reset()` gives the first message: reasoning-gym,
OpenEnv, TextArena; docs/ecosystems.md) need no prompt: such a row may hold only a `seed`, an `id` and
`env_config` overrides (`load_rows(path, prompt_required=False)`), and `seed_rows(n)` makes N of them.

Rows written for the reference frameworks load as they are:
- verl's preprocessing scripts (`prompt`, `data_source`, `ability`, `reward_model`, `extra_info`, `agent_name`):
  `tools_kwargs` and `tool_selection` are read from `extra_info` when the row has none of its own
  (`row_tools_kwargs`, `row_tool_selection`), as verl's dataset lifts them.
- ms-swift's `messages` rows (no `prompt`): the messages are the prompt, except a trailing assistant message,
  which is the row's reference reply and is dropped (ms-swift's `remove_response`; the row keeps it under
  `messages`). A `system` column is prepended when the messages have no system message, and images without
  an `<image>` tag get one at the start of the first non-system message, as ms-swift's templates add them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from turnrl.types import Message

_ROLES = {"system", "user", "assistant", "tool"}


class DataError(ValueError):
    """A malformed data file or row; the message names the file, the row and the field."""


def load_rows(path: str | Path, prompt_required: bool = True) -> list[dict[str, Any]]:
    """Read rows from `.jsonl` (one JSON object per line) or `.parquet`, validating each row's prompt (a row
    without one is accepted when not `prompt_required`: the env opens the episode)."""
    path = Path(path)
    rows = read_rows(path)
    for i, row in enumerate(rows):
        resolve_image_paths(row, path.parent)
        prompt_messages(row, where=f"{path} row {i + 1}", required=prompt_required)
    return rows


def seed_rows(n: int) -> list[dict[str, Any]]:
    """N rows with only a seed (0..N-1) and an id: the episodes of an env that makes its own tasks (`turnrl rollout
    --limit N` without --data)."""
    if n < 1:
        raise DataError(f"expected a number of episodes >= 1, got {n}")
    return [{"id": f"seed-{i}", "seed": i} for i in range(n)]


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a `.jsonl` or `.parquet` file as they are (no prompt validation: SFT reads trajectory JSONL)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    if path.suffix == ".parquet":
        rows = _read_parquet(path)
    elif path.suffix in (".jsonl", ".json"):
        rows = _read_jsonl(path)
    else:
        raise DataError(f"data file {path}: expected a .jsonl or .parquet file")
    if not rows:
        raise DataError(f"data file {path} has no rows")
    return rows


def resolve_image_paths(row: dict[str, Any], base: Path) -> None:
    """Relative image paths in `images` are relative to the data file."""
    images = row.get("images")
    if isinstance(images, list):
        row["images"] = [str(base / im) if isinstance(im, str) and not Path(im).is_absolute()
                         and (base / im).exists() else im for im in images]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is in the test extra
        raise DataError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    return pq.read_table(path).to_pylist()


def prompt_messages(row: dict[str, Any], where: str = "row", required: bool = True) -> list[Message]:
    """The chat messages of a row's `prompt` (a string becomes one user message), or of its `messages`; [] for a
    row with neither when not `required` (the env's `reset()` opens the episode)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "prompt" not in row:
        if "messages" in row:
            return _messages_row(row, where)
        if not required:
            _check_seed(row, where)
            return []
        raise DataError(f"{where}: missing field 'prompt' (a string or a list of chat messages) or 'messages'")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return _with_images(_with_system([{"role": "user", "content": prompt}], row, where), row, where)
    return _with_images(_chat(prompt, "prompt", where), row, where)


def _check_seed(row: dict[str, Any], where: str) -> None:
    seed = row.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise DataError(f"{where}: field 'seed' must be an integer >= 0, got {seed!r:.40}")
    if row.get("env_config") is not None and not isinstance(row["env_config"], dict):
        raise DataError(f"{where}: field 'env_config' must be a mapping of env settings, got {row['env_config']!r:.60}")


def _chat(value: Any, field: str, where: str) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {field!r} must be a non-empty string or list of messages, got {value!r:.80}")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or "content" not in m:
            raise DataError(
                f"{where}: {field}[{j}] must be a message with 'role' in {sorted(_ROLES)} and 'content', got {m!r:.80}"
            )
    return [dict(m) for m in value]


def _with_system(messages: list[Message], row: dict[str, Any], where: str) -> list[Message]:
    system = row.get("system")
    if system is None or messages[0]["role"] == "system":
        return messages
    if not isinstance(system, str):
        raise DataError(f"{where}: field 'system' must be a string, got {type(system).__name__}")
    return [{"role": "system", "content": system}, *messages]


def _messages_row(row: dict[str, Any], where: str) -> list[Message]:
    """ms-swift's row format (module docstring): the reference reply dropped, missing image tags added."""
    messages = _chat(row["messages"], "messages", where)
    if len(messages) > 1 and messages[-1]["role"] == "assistant":
        messages.pop()
    messages = _with_system(messages, row, where)
    images = row.get("images")
    if isinstance(images, list) and images:
        from turnrl.multimodal import IMAGE_PLACEHOLDER

        texts = [m["content"] for m in messages if isinstance(m["content"], str)]
        missing = len(images) - sum(t.count(IMAGE_PLACEHOLDER) for t in texts)
        first = next((m for m in messages if m["role"] != "system"), None)
        if missing > 0 and first is not None and isinstance(first["content"], str):
            first["content"] = IMAGE_PLACEHOLDER * missing + first["content"]
    return _with_images(messages, row, where)


def conversation_messages(row: dict[str, Any], where: str = "row") -> list[Message]:
    """A `messages` row's whole conversation, assistant replies included (what SFT trains on), with a `system`
    column prepended and `<image>` placeholders turned into image parts as for prompts."""
    if not isinstance(row, dict) or "messages" not in row:
        raise DataError(f"{where}: expected a row with 'messages' (a list of chat messages)")
    messages = _chat(row["messages"], "messages", where)
    return _with_images(_with_system(messages, row, where), row, where)


def row_tools_kwargs(row: dict[str, Any]) -> dict[str, Any]:
    """The row's per-tool `tools_kwargs` (`{tool: {"create_kwargs": {...}}}`): its own column, else verl's
    `extra_info.tools_kwargs`; {} when it has neither."""
    return _row_or_extra_info(row, "tools_kwargs") or {}


def row_tool_selection(row: dict[str, Any]) -> list[str] | None:
    """The tools a row offers (`tool_selection`, else verl's `extra_info.tool_selection`); None = all."""
    return _row_or_extra_info(row, "tool_selection") or None


def _row_or_extra_info(row: dict[str, Any], key: str) -> Any:
    if row.get(key) is not None:
        return row[key]
    extra_info = row.get("extra_info")
    return extra_info.get(key) if isinstance(extra_info, dict) else None


def _with_images(messages: list[Message], row: dict[str, Any], where: str) -> list[Message]:
    """Rows with `images` (geo3k schema): each `<image>` placeholder in the text becomes an image part,
    consuming the images in order; the counts must match."""
    images = row.get("images")
    if images is None:  # an empty list still has to match the placeholders (zero of them)
        return messages
    if not isinstance(images, list):
        raise DataError(f"{where}: field 'images' must be a list of image paths or base64 strings")
    from turnrl.multimodal import IMAGE_PLACEHOLDER, split_placeholders

    placeholders = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m["content"], str))
    if placeholders != len(images):
        raise DataError(f"{where}: the prompt has {placeholders} '{IMAGE_PLACEHOLDER}' placeholders but 'images' "
                        f"has {len(images)} entries")
    if not images:
        return messages
    remaining = list(images)
    for m in messages:
        if isinstance(m["content"], str) and IMAGE_PLACEHOLDER in m["content"]:
            n = m["content"].count(IMAGE_PLACEHOLDER)
            m["content"] = split_placeholders(m["content"], remaining[:n], where)
            remaining = remaining[n:]
    return messages


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
