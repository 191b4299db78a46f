"""A FastMCP server for tests/test_mcp.py (FastMCP 3 or 4): stdio by default, streamable HTTP with `--http PORT`."""

import asyncio
import os
import sys
from collections import defaultdict

from fastmcp import Context, FastMCP
from fastmcp.utilities.types import Image

mcp = FastMCP("turnrl-test")
NOTES: dict[str, list[str]] = defaultdict(list)


@mcp.tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@mcp.tool
def add_note(note: str, ctx: Context) -> str:
    """Keep a note in this session."""
    NOTES[ctx.session_id].append(note)
    return f"noted ({len(NOTES[ctx.session_id])} notes)"


@mcp.tool
def list_notes(ctx: Context) -> list[str]:
    """The notes of this session."""
    return NOTES[ctx.session_id]


@mcp.tool
def red_square() -> Image:
    """A 4x4 red PNG."""
    import io

    from PIL import Image as PILImage

    buffer = io.BytesIO()
    PILImage.new("RGB", (4, 4), (255, 0, 0)).save(buffer, format="PNG")
    return Image(data=buffer.getvalue(), format="png")


@mcp.tool
def fail(reason: str) -> str:
    """Always raises."""
    raise ValueError(f"failed on purpose: {reason}")


@mcp.tool
async def hang() -> str:
    """Never answers (the server itself goes on answering other calls)."""
    await asyncio.sleep(3600)
    return "late"


@mcp.tool
def die() -> str:
    """The server process exits."""
    print("dying now", file=sys.stderr, flush=True)
    os._exit(3)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        mcp.run(transport="http", host="127.0.0.1", port=int(sys.argv[2]), show_banner=False)
    else:
        mcp.run(show_banner=False)
