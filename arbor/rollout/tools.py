"""Sandboxed tool calls for agents: model-written Python run in a limited subprocess.

    pool = ToolPool(workers=4)
    result = await pool.run_python("print(2 + 2)", timeout_s=5.0)
    result.observation          # "4\\n": what goes back to the model as the tool message

Every call is a fresh ``python -I`` process in its own temporary directory (its working
directory and ``HOME``, deleted afterwards) with a minimal environment, limits on
address space (``memory_mb``), CPU time and file size, no network (a private network
namespace: ``unshare -n``, or ``unshare -rn`` for non-root users; :func:`network_isolation`
says which), and a process group killed on timeout. Where no namespace can be made, a
pool refuses to start (:class:`~arbor.errors.ConfigError` saying why) unless it was
built with ``allow_network=True``: tools quietly reaching the network is never the default.
Nothing a tool does can crash a rollout: a timeout, an exception, a memory blow-up or a
flood of output each becomes an error observation for the model. Calls of different
branches run concurrently, at most ``workers`` at once.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arbor.errors import ConfigError

# Runs inside the sandbox before the tool's code: the limits, then the code itself with
# tracebacks showing only the tool's own frames.
_BOOTSTRAP = r"""
import resource, sys, traceback
memory, cpu, fsize = (int(x) for x in sys.argv[2:5])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
source = open(sys.argv[1]).read()
try:
    exec(compile(source, "<tool>", "exec"), {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as e:
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<tool>":
        tb = tb.tb_next
    sys.stdout.flush()
    traceback.print_exception(type(e), e, tb, limit=-8)
    sys.exit(1)
"""


@dataclass
class ToolResult:
    ok: bool  # exited 0 within the limits
    output: str  # stdout then stderr, cut at max_output_chars
    seconds: float
    timed_out: bool = False
    truncated: bool = False  # output cut at max_output_chars
    flooded: bool = False  # stopped for printing far more than max_output_chars
    exit_code: int | None = None

    @property
    def observation(self) -> str:
        """The text the model sees."""
        text = self.output
        if self.truncated:
            text += "\n[output truncated]"
        if self.timed_out:
            return f"{text}\nError: the code ran longer than the time limit and was stopped.".lstrip()
        if self.flooded:
            return f"{text}\nError: the code printed too much output and was stopped.".lstrip()
        if not self.ok:
            reason = "it was killed (memory or CPU limit?)" if (self.exit_code or 0) < 0 else f"exit code {self.exit_code}"
            return f"{text}\nError: the code failed ({reason}).".lstrip()
        return text


def network_isolation() -> list[str] | None:
    """The ``unshare`` prefix that gives a process no network here, or None if none works."""
    return _probe_isolation(os.environ.get("PATH", ""))[0]


@functools.cache
def _probe_isolation(path: str) -> tuple[list[str] | None, str]:
    """``(prefix, "")`` for the first ``unshare`` form that works with ``PATH=path``, else
    ``(None, why)``. Cached per PATH: probing starts two processes."""
    unshare = shutil.which("unshare", path=path)
    if unshare is None:
        return None, f"no `unshare` program on PATH ({path or 'empty'})"
    failures = []
    for prefix in ([unshare, "-n"], [unshare, "-rn"]):
        try:
            done = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            failures.append(f"`{' '.join(prefix)} true`: {e}")
            continue
        if done.returncode == 0:
            return prefix, ""
        failures.append(f"`{' '.join(prefix)} true` exited {done.returncode}: {done.stderr.strip()[:200]}")
    return None, "; ".join(failures)


class ToolPool:
    """Runs tool calls concurrently, at most ``workers`` at a time, each sandboxed."""

    def __init__(self, workers: int = 4, *, allow_network: bool = False) -> None:
        """``allow_network=True`` runs tools without network isolation where none can be
        made; otherwise such a machine is a :class:`ConfigError` here, at start-up."""
        if workers < 1:
            raise ValueError(f"workers must be ≥ 1, got {workers}")
        self.workers = workers
        self.isolation, why = _probe_isolation(os.environ.get("PATH", ""))
        if self.isolation is None and not allow_network:
            raise ConfigError(
                f"tool sandbox: cannot cut tools off the network here ({why}). Run where `unshare -n` "
                "(root) or `unshare -rn` (unprivileged user namespaces) works, or let tools reach the "
                "network explicitly: rollout.agent_args: {allow_network: true}"
            )
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread_slots = threading.BoundedSemaphore(workers)

    def run_python_sync(self, code: str, **limits: Any) -> ToolResult:
        """:meth:`run_python` from a worker thread (agents' ``step`` runs in threads): at
        most ``workers`` calls at once over all threads."""
        with self._thread_slots:
            return asyncio.run(self.run_python(code, **limits))

    def _slots(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._loop is not loop:  # one per event loop
            self._semaphore, self._loop = asyncio.Semaphore(self.workers), loop
        return self._semaphore

    async def run_python(
        self,
        code: str,
        *,
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        max_output_chars: int = 8192,
        max_file_mb: int = 16,
    ) -> ToolResult:
        """Run ``code`` with ``python -I`` in the sandbox; never raises for what the code does."""
        async with self._slots():
            with tempfile.TemporaryDirectory(prefix="arbor-tool-") as workdir:
                script = Path(workdir) / "tool.py"
                script.write_text(code)
                limits = [str(memory_mb * 2**20), str(max(1, int(timeout_s) + 1)), str(max_file_mb * 2**20)]
                command = [*(self.isolation or []), sys.executable, "-I", "-c", _BOOTSTRAP, str(script), *limits]
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "LANG": "C.UTF-8",
                       "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
                return await _run(command, workdir, env, timeout_s, max_output_chars)


async def _run(command: list[str], workdir: str, env: dict[str, str], timeout_s: float, max_chars: int) -> ToolResult:
    start = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        *command, cwd=workdir, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
    )
    chunks: list[bytes] = []
    size = 0
    flooded = timed_out = False

    async def read() -> None:
        nonlocal size, flooded
        assert process.stdout is not None
        while chunk := await process.stdout.read(65536):
            if size < max_chars * 4:  # UTF-8: at most 4 bytes a character
                chunks.append(chunk)
                size += len(chunk)
            else:  # a flood: stop it now rather than drain megabytes
                flooded = True
                _kill(process)

    try:
        await asyncio.wait_for(read(), timeout_s)
        await asyncio.wait_for(process.wait(), max(0.1, timeout_s - (time.monotonic() - start)))
    except asyncio.TimeoutError:
        timed_out = True
        _kill(process)
        await process.wait()
    text = b"".join(chunks).decode("utf-8", errors="replace")
    truncated = len(text) > max_chars
    code = process.returncode
    ok = code == 0 and not timed_out and not flooded
    return ToolResult(ok, text[:max_chars], time.monotonic() - start, timed_out, truncated, flooded, code)


def _kill(process: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
