"""A tiny stdio MCP server for tests/test_adapters_mcp.py, on the real MCP SDK (1.x or 2.x).

    python3 tests/mcp_notes_server.py

Tools: ``add_note(text)`` (a side effect: the notes are the server's state), ``count_notes()``
and ``read_note(index)`` (read-only: ``readOnlyHint``), ``roll()`` (a side effect whose answer
is random: a server no replay reproduces), ``fail(reason)`` (always an error), and for the
tests' checks ``calls_made()`` (the calls this process answered before) and ``environ(name)``.
"""

from __future__ import annotations

import os
import random

from mcp.types import ToolAnnotations

try:
    from mcp.server.mcpserver import MCPServer  # mcp 2.x

    server = MCPServer("notes")
except ImportError:
    from mcp.server.fastmcp import FastMCP  # mcp 1.x (it logs every request at INFO)

    server = FastMCP("notes", log_level="WARNING")
READ_ONLY = ToolAnnotations.model_validate({"readOnlyHint": True})  # the wire name, in 1.x and 2.x
NOTES: list[str] = []
CALLS = [0]  # calls of the note tools this process answered


@server.tool()
def add_note(text: str) -> str:
    """Add a note; answers how many there are."""
    CALLS[0] += 1
    NOTES.append(text)
    return f"{len(NOTES)} notes"


@server.tool(annotations=READ_ONLY)
def count_notes() -> str:
    """How many notes there are."""
    CALLS[0] += 1
    return f"{len(NOTES)} notes"


@server.tool(annotations=READ_ONLY)
def read_note(index: int) -> str:
    """The note at ``index`` (from 0)."""
    CALLS[0] += 1
    return NOTES[index]


@server.tool()
def roll() -> str:
    """A random number: a side effect no replay reproduces."""
    CALLS[0] += 1
    return str(random.SystemRandom().randint(0, 10**9))


@server.tool()
def fail(reason: str) -> str:
    """Always fails."""
    CALLS[0] += 1
    raise ValueError(reason)


@server.tool(annotations=READ_ONLY)
def calls_made() -> str:
    """How many calls of the note tools this server process answered."""
    return str(CALLS[0])


@server.tool(annotations=READ_ONLY)
def environ(name: str) -> str:
    """An environment variable of the server process ('' when unset)."""
    return os.environ.get(name, "")


if __name__ == "__main__":
    server.run("stdio")
