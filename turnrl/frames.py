"""Template frames: what a chat template renders for one shape of conversation with the message contents cut out,
so the renderer's hot path (a prompt, an observation delta) is a string join instead of a Jinja render.

A frame is proven per template and shape, never assumed: the shape is rendered twice, with two different
sentinel contents (`SENTINELS`: the second has quotes, a backslash, markup characters, tabs, inner newlines,
non-ASCII, another length), and it is a frame only when each sentinel appears exactly once in each render and
swapping one set for the other turns the first render into the second (the template passes the content
through untouched: no escaping, case change, splitting or length test that the sentinels would show). A content
is then filled in only when it is *plain* for that template (`plain`): a non-empty string without leading or
trailing whitespace (templates that `trim` it then render it unchanged) that contains none of the string
literals the template's logic compares, searches, splits or calls with (`logic_literals`: Qwen3's
`'<tool_response>'`, `'</think>'`, a role name...). Anything else renders through the template. Templates
that read the clock (`strftime_now`: Llama 3.x's "Today Date") get no frames. tests/test_frames.py checks
frame renders against full renders, and `ChatRenderer.encode`'s tokenizer shortcut against the tokenizer's
own call, on the real Qwen3, SmolLM2 and Llama-3 tokenizers and templates.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turnrl.types import Message

SENTINELS: tuple[Callable[[int], str], Callable[[int], str]] = (
    lambda k: f"TURNRLFRAME{k}Q",
    lambda k: f"turnrl 'frame' \"{k}\"\n\n\tx\\y <b>&amp; é中 -- {k}",
)
"""The two contents each frame is rendered with (message k of the shape)."""
MAX_FRAMES = 512
"""Frames kept per renderer (shapes x tool lists); past it the cache starts again."""


@dataclass(frozen=True)
class Frame:
    """The literal text around each message's content: pieces[0] + content[0] + pieces[1] + ... + pieces[n]."""

    pieces: tuple[str, ...]

    def fill(self, contents: list[str]) -> str:
        parts = [self.pieces[0]]
        for content, piece in zip(contents, self.pieces[1:], strict=True):
            parts += (content, piece)
        return "".join(parts)


def prove(render: Callable[[list[Message]], str], messages: list[Message]) -> Frame | None:
    """The frame of `messages`' shape (their contents replaced), or None when the two sentinel renders do not
    prove one (or the template raises for the shape: the caller's full render then says why)."""
    try:
        first, second = (render([{**m, "content": s(k)} for k, m in enumerate(messages)]) for s in SENTINELS)
    except Exception:
        return None
    pieces, rest = [], first
    for k in range(len(messages)):
        mark = SENTINELS[0](k)
        if first.count(mark) != 1 or mark not in rest:
            return None
        piece, rest = rest.split(mark)
        pieces.append(piece)
    frame = Frame((*pieces, rest))
    if frame.fill([SENTINELS[1](k) for k in range(len(messages))]) != second:
        return None
    return frame


def shape_key(kind: str, messages: list[Message], tools: Any, plain: Callable[[Any], bool]) -> tuple | None:
    """The cache key of a frame for `messages`: their roles and every field but the content, and the tool list's
    JSON (its content, not its identity: an env may build a new list per episode, or change one in place); None
    when a content is not plain, a field is not a string or the tools are not JSON (then no frame is used)."""
    shape: list[tuple] = []
    for m in messages:
        if not plain(m.get("content")):
            return None
        fields = tuple(sorted((k, v) for k, v in m.items() if k != "content"))
        if not all(isinstance(v, str) for _, v in fields):
            return None
        shape.append(fields)
    try:
        tool_key = json.dumps(tools, sort_keys=True, ensure_ascii=False) if tools else ""
    except (TypeError, ValueError):
        return None
    return kind, tool_key, tuple(shape)


def logic_literals(template: Any) -> tuple[str, ...] | None:
    """The string literals a chat template's logic uses (compared, tested, passed to a method or filter), except
    pure whitespace; None when the template gets no frames (several templates, unparseable, reads the clock)."""
    if not isinstance(template, str) or "strftime" in template:
        return None
    import jinja2
    from jinja2 import nodes

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"]).parse(
            re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", template))  # transformers' assistant-mask tags
    except Exception:
        return None
    if _measures_content(ast):
        return None
    keys = {id(g.arg) for g in ast.find_all(nodes.Getitem)}  # message['content']: a key, not logic on content
    found: set[str] = set()
    for node in ast.find_all((nodes.Compare, nodes.Call, nodes.Filter, nodes.Test)):
        if isinstance(node, nodes.Compare):
            parts = [node.expr, *(op.expr for op in node.ops)]
            if any(_is_role(p) for p in parts):  # message.role == 'tool': a role name, no test of a content
                continue
        else:
            call: Any = node  # Call, Filter, Test: arguments
            parts = [*call.args, *(kw.value for kw in call.kwargs)]
        for part in parts:
            for const in ([part] if isinstance(part, nodes.Const) else list(part.find_all(nodes.Const))):
                if isinstance(const.value, str) and const.value.strip() and id(const) not in keys:
                    found.add(const.value)
    return tuple(sorted(found, key=len, reverse=True))


SIZE_FILTERS = frozenset({"length", "count", "wordcount", "truncate", "center", "wordwrap", "batch", "slice"})
"""Filters whose result depends on a string's length (what two sentinels cannot prove a frame for)."""
LISTS = frozenset({"messages", "loop_messages", "tools", "tool_calls", "documents", "parameters", "properties",
                   "required", "enum"})
"""Names and fields of lists a template may measure, index or slice without looking into a content."""


def _measures_content(ast: Any) -> bool:
    """Does the template measure, slice or index something that may be a content? `messages|length`,
    `messages[1:]`, `message.tool_calls[0]` and `content.split('</think>')[-1]` (a literal no plain content holds:
    one piece) are fine; `content|length > 12` or `content[:20]` are not."""
    from jinja2 import nodes

    def whole(node: Any) -> bool:
        if isinstance(node, nodes.Name):
            return node.name in LISTS
        if isinstance(node, nodes.Getattr):
            return node.attr in LISTS
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value in LISTS
        return (isinstance(node, nodes.Call) and isinstance(node.node, nodes.Getattr) and node.node.attr == "split"
                and len(node.args) == 1 and isinstance(node.args[0], nodes.Const)
                and isinstance(node.args[0].value, str) and bool(node.args[0].value.strip()))

    for f in ast.find_all(nodes.Filter):
        if f.name in SIZE_FILTERS and not whole(f.node):
            return True
    for g in ast.find_all(nodes.Getitem):
        index = isinstance(g.arg, nodes.Slice) or (isinstance(g.arg, nodes.Const) and isinstance(g.arg.value, int))
        if index and not whole(g.node):
            return True
    return False


def _is_role(node: Any) -> bool:
    from jinja2 import nodes

    return ((isinstance(node, nodes.Getattr) and node.attr == "role")
            or (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "role"))


def plain_test(literals: tuple[str, ...] | None) -> Callable[[Any], bool]:
    """`plain(content)` for a template whose logic uses `literals` (always False when it gets no frames)."""
    if literals is None:
        return lambda content: False
    search = re.compile("|".join(map(re.escape, literals))).search if literals else None

    def plain(content: Any) -> bool:
        return (isinstance(content, str) and bool(content) and content == content.strip()
                and (search is None or search(content) is None))

    return plain
