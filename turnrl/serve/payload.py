"""What a chat call carries, as the proxy handles it: how much text (a short call is prepared on the event loop, a
long one in a worker thread) and deep copies of its messages for the record."""

from __future__ import annotations

import copy
from typing import Any

INLINE_PREPARE_CHARS = 32_768
"""A call whose messages hold less text than this (and no images) is rendered and tokenised on the event loop
(well under a millisecond); a longer one in a worker thread, so the loop goes on serving the other sessions."""


def text_size(value: Any, limit: int) -> int:
    """The characters of text in messages (contents, parts, tool calls), counted up to `limit`; anything that is not
    JSON-like text (an image) counts as `limit`: it goes to the worker thread."""
    if isinstance(value, str):
        return len(value)
    if value is None or isinstance(value, bool | int | float):
        return 0
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, list | tuple):
        items = value
    else:
        return limit
    total = 0
    for item in items:
        total += text_size(item, limit)
        if total >= limit:
            return limit
    return total


def copied(value: Any) -> Any:
    """A deep copy of messages or tools: JSON-like containers rebuilt, strings and numbers shared (immutable),
    anything else `copy.deepcopy`'d (what the whole copy was before, at a tenth of the cost for JSON)."""
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if type(value) is dict:
        return {k: copied(v) for k, v in value.items()}
    if type(value) is list:
        return [copied(v) for v in value]
    return copy.deepcopy(value)
