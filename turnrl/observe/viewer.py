"""A readable view of trajectory JSONL: trained tokens vs injected tokens, statuses, rewards and images; an episode
with several branches (forks, compactions, sub-agents, splits: docs/trees.md) is drawn as its tree, each branch
shown from where it leaves its parent."""

from __future__ import annotations

import base64
import html
import json
import mimetypes
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.text import Text

from turnrl.rollout.tree import episodes, walk
from turnrl.types import Parent, Trajectory

STYLES = {"shared": "dim italic", "prompt": "dim", "model": "green", "injected": "magenta", "env": "yellow", "tool": "cyan", "template": "bright_black"}
CSS_COLOURS = {"shared": "#bbb", "prompt": "#777", "model": "#0a7d00", "injected": "#a0a", "env": "#9a6700", "tool": "#0277bd",
               "template": "#999"}


TRAJECTORY_KEYS = ("id", "status", "prompt_ids", "response_ids", "loss_mask")
"""What every trajectory line has (docs/trajectory-format.md) and the viewer reads."""


def _rows(path: Path, index: int | None = None) -> list[dict[str, Any]]:
    """The trajectories of a JSONL file (only the one at line `index`, 0-based, when given). Raises ValueError
    naming the file and line for a line that is not a trajectory, or an index out of range."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for k, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {k} is not JSON ({e.msg}); expected trajectory JSONL written by "
                                 "turnrl rollout / train (docs/trajectory-format.md)") from None
            missing = [key for key in TRAJECTORY_KEYS if not isinstance(row, dict) or key not in row]
            if missing:
                raise ValueError(f"{path} line {k} is not a trajectory (no {', '.join(missing)}); expected trajectory "
                                 "JSONL written by turnrl rollout / train (docs/trajectory-format.md)")
            rows.append(row)
    if index is not None and not 0 <= index < len(rows):
        raise ValueError(f"--index {index}: {path} has {len(rows)} trajectories, so --index must be in "
                         f"0..{len(rows) - 1}" if rows else f"--index {index}: {path} has no trajectories")
    return rows


def _pieces(row: dict[str, Any], tokenizer: Any) -> list[tuple[str, str]]:
    """(kind, text) runs: prompt, then each segment split where the mask changes inside it. A branch's first
    `parent.at` tokens (its parent's too) are one `shared` run saying so."""
    parent = row.get("parent") or {}
    shared = parent.get("at") or 0
    prompt = row["prompt_ids"]
    pieces = [("shared", f"⟨{shared} tokens shared with {parent.get('id')}⟩")] if shared else []
    if shared < len(prompt):
        pieces.append(("prompt", tokenizer.decode(prompt[shared:])))
    ids, mask = row["response_ids"], row["loss_mask"]
    for seg in row.get("segments") or [{"source": "model", "start": 0, "length": len(ids)}]:
        a, b = max(seg["start"], shared - len(prompt)), seg["start"] + seg["length"]
        if a >= b:
            continue
        run = a
        for k in range(a + 1, b + 1):
            if k == b or mask[k] != mask[run]:
                kind = seg["source"] if seg["source"] != "model" else ("model" if mask[run] else "injected")
                pieces.append((kind, tokenizer.decode(ids[run:k])))
                run = k
    return pieces


def _in_tree_order(rows: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(depth, row) of every row, each episode's branches in tree order under its root (rollout.tree.walk)."""
    skeletons = [_skeleton(row) for row in rows]
    row_of = {id(t): row for t, row in zip(skeletons, rows, strict=True)}
    return [(depth, row_of[id(t)]) for episode in episodes(skeletons).values() for depth, t in walk(episode)]


def _skeleton(row: dict[str, Any]) -> Trajectory:
    """The tree fields of a row (id, episode, parent) as a Trajectory, without its tokens."""
    return Trajectory(id=row["id"], group_id=row.get("group_id", ""), sample_index=0, prompt_ids=[],
                      episode_id=row.get("episode_id"), parent=Parent.from_json(row.get("parent"), f"{row['id']} parent"))


def _header(row: dict[str, Any], depth: int = 0) -> str:
    reward = row.get("reward")
    parent = row.get("parent")
    where = "" if not parent else (f"{parent['kind']} of {parent['id']} at {parent['at']}  " if parent.get("at")
                                   else f"{parent['kind']} of {parent['id']} (new context)  ")
    return ("  " * max(depth - 1, 0) + ("└─ " if depth else "") + f"{row['id']}  {where}"
            f"status={row['status']}  reason={row.get('termination_reason')}  turns={row.get('num_turns')}  "
            f"reward={'—' if reward is None else f'{reward:.3f}'}" + (f"  error={row['error']}" if row.get("error") else ""))


def _selected(rows: list[dict[str, Any]], index: int | None) -> list[tuple[int, dict[str, Any]]]:
    return [(0, rows[index])] if index is not None else _in_tree_order(rows)


def print_trajectories(path: Path, console: Console, index: int | None = None, model: str | None = None) -> None:
    rows = _rows(path, index)
    selected = _selected(rows, index)
    tokenizer = None
    if model is not None:
        from turnrl.models import load_tokenizer

        tokenizer = load_tokenizer(model)
    legend = "  ".join(f"[{style}]{kind}[/]" for kind, style in STYLES.items())
    console.print(f"{len(rows)} trajectories in {path}   legend: {legend}")
    for depth, row in selected:
        body = Text()
        if tokenizer is not None:
            for kind, text in _pieces(row, tokenizer):
                body.append(text, style=STYLES.get(kind, ""))
        else:
            for m in row.get("messages", []):
                style = {"assistant": "green", "tool": "cyan", "system": "dim"}.get(m.get("role"), "yellow")
                body.append(f"[{m.get('role')}] ", style="bold " + style)
                body.append(_content_text(m.get("content")) + "\n", style=style)
        if row.get("images"):
            body.append("\nimages: " + ", ".join(row["images"]), style="italic")
        console.print(Panel(body, title=_header(row, depth), title_align="left"))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if p.get("type") == "text" else f"<{p.get('type')}>" for p in content)
    return str(content)


def _image_src(ref: str, base: Path) -> str:
    if ref.startswith(("data:", "http://", "https://")):
        return ref
    path = Path(ref) if Path(ref).is_absolute() or Path(ref).exists() else base / ref  # as recorded, else beside the file
    if not path.exists():
        return ""
    mime = mimetypes.guess_type(path.name)[0] or "image/png"
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def write_html(path: Path, out: Path, model: str | None = None, index: int | None = None) -> None:
    """One self-contained HTML page: each trajectory (or only the one at line `index`) with coloured token runs
    and its images inline."""
    rows = _rows(path, index)
    selected = _selected(rows, index)
    tokenizer = None
    if model is not None:
        from turnrl.models import load_tokenizer

        tokenizer = load_tokenizer(model)
    parts = ["<html><head><meta charset='utf-8'><style>body{font-family:sans-serif} pre{white-space:pre-wrap;"
             "border:1px solid #ddd;padding:8px} img{max-width:256px;margin:4px;border:1px solid #ccc}</style></head><body>",
             "<p>" + " ".join(f"<span style='color:{c}'>{k}</span>" for k, c in CSS_COLOURS.items()) + "</p>"]
    for depth, row in selected:
        parts.append(f"<div style='margin-left:{2 * depth}em'><h3>{html.escape(_header(row, depth))}</h3>")
        for ref in row.get("images", []):
            src = _image_src(ref, path.parent)
            parts.append(f"<img src='{src}' title='{html.escape(ref)}'>" if src else f"<p>missing image {html.escape(ref)}</p>")
        if tokenizer is not None:
            spans = "".join(f"<span style='color:{CSS_COLOURS.get(k, '#000')}'>{html.escape(t)}</span>"
                            for k, t in _pieces(row, tokenizer))
        else:
            spans = "".join(f"<b>[{html.escape(str(m.get('role')))}]</b> {html.escape(_content_text(m.get('content')))}\n"
                            for m in row.get("messages", []))
        parts.append(f"<pre>{spans}</pre></div>")
    parts.append("</body></html>")
    out.write_text("\n".join(parts), encoding="utf-8")
