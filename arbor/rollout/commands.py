"""Commands a run launches for user code (an MCP server, an agent program), resolved the way the
user means them.

    command_argv(["python3", "envs/lookup_tools.py"])   # [sys.executable, "envs/lookup_tools.py"]

A bare ``python``, ``python3`` or ``python3.N`` (no slash) as the program is arbor's own
interpreter, ``sys.executable``: the helper then imports what arbor's environment has. Run from
an un-activated virtual environment (``.venv/bin/arbor``, as a scheduler or a service runs it),
``PATH``'s ``python3`` is the system's, and a helper that needs a package of the venv (``mcp``)
dies at import. An explicit path (``/usr/bin/python3``, ``./python``) is left as it is.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

_BARE_PYTHON = re.compile(r"python(3(\.\d+)?)?")


def command_argv(command: Sequence[str]) -> list[str]:
    """``command`` with a bare Python interpreter name as its program replaced by ``sys.executable``.

    >>> command_argv(["python3.11", "-m", "srv"])[1:], command_argv(["/usr/bin/python3", "x"])
    (['-m', 'srv'], ['/usr/bin/python3', 'x'])
    """
    argv = [str(part) for part in command]
    if argv and _BARE_PYTHON.fullmatch(argv[0]) and sys.executable:
        argv[0] = sys.executable
    return argv


def stderr_tail(text: str, lines: int = 15) -> str:
    """The last ``lines`` lines of a helper's stderr, for an error message ("" when it wrote none)."""
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n    ".join(kept)
