"""Sandboxed tool calls for agents: model-written Python run in a limited subprocess.

    pool = ToolPool(workers=4)
    result = await pool.run_python("print(2 + 2)", timeout_s=5.0)
    result.observation          # "4\\n": what goes back to the model as the tool message

Every call is a fresh ``python -I`` process in its own temporary directory (its working
directory and ``HOME``, deleted afterwards) with a minimal environment, limits on
address space (``memory_mb``), CPU time, file size and process count (``max_processes``),
inside a bubblewrap sandbox (:mod:`arbor.rollout.sandbox`): its own unprivileged user, a
read-only view of only what Python needs, no network, its own PID namespace (every process
it starts dies with the call). Where bwrap cannot run, a pool refuses to start
(:class:`~arbor.errors.ConfigError` saying why) unless it was built with
``allow_unsandboxed=True``; calls then run as arbor's own user, counted in
:func:`unsandboxed_calls`, and only cut off the network (``unshare -n``, or ``unshare -rn``
for non-root users; :func:`network_isolation` says which) -- where that cannot be made
either, the pool also needs ``allow_network=True``. Neither is ever the default.
Nothing a tool does can crash a rollout: a timeout, an exception, a memory blow-up or a
flood of output each becomes an error observation for the model. Calls of different
branches run concurrently, at most ``workers`` at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
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
from arbor.rollout.sandbox import Sandbox, call_uid, read_only_paths

log = logging.getLogger(__name__)

# Runs inside the sandbox before the tool's code: the switch to the call's own user (where
# arbor is root; "-" otherwise), the limits, then the code itself with tracebacks showing
# only the tool's own frames.
_BOOTSTRAP = r"""
import os, resource, sys, traceback
script, memory, cpu, fsize, nproc, uid = sys.argv[1:7]
if uid != "-":
    os.setgroups([])
    os.setgid(int(uid))
    os.setuid(int(uid))
os.chdir(os.path.dirname(script))
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu),
                     (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NPROC, nproc)):
    if value != "-":
        resource.setrlimit(limit, (int(value), int(value)))
source = open(script).read()
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


@functools.cache
def _probe_sandbox(path: str, max_processes: int) -> tuple[Sandbox | None, str]:
    """``(sandbox, "")`` where a call through bwrap (found on ``PATH=path``) runs and prints
    here, else ``(None, why)``. Cached: probing starts a sandbox."""
    bwrap = shutil.which("bwrap", path=path)
    if bwrap is None:
        return None, f"no `bwrap` program on PATH ({path or 'empty'}); install bubblewrap"
    sandbox = Sandbox(bwrap, read_only_paths(), as_root=os.geteuid() == 0)
    with tempfile.TemporaryDirectory(prefix="arbor-tool-") as workdir:
        command, env = _call("print(6 * 7)", workdir, sandbox, timeout_s=10.0, memory_mb=512,
                             max_file_mb=1, max_processes=max_processes)
        try:
            done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"`{bwrap}` could not run a call: {e}"
    if done.returncode != 0 or done.stdout != "42\n":
        return None, f"`{bwrap}` exited {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}"
    return sandbox, ""


def _call(code: str, workdir: str, sandbox: Sandbox | None, *, timeout_s: float, memory_mb: int,
          max_file_mb: int, max_processes: int, isolation: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one call whose code is written into ``workdir``."""
    script = Path(workdir) / "tool.py"
    script.write_text(code)
    uid = call_uid() if sandbox is not None else None
    if uid is not None:  # the call's own user must own its directory
        for owned in (workdir, script):
            os.chown(owned, uid, uid)
    # Unsandboxed, RLIMIT_NPROC would count all of arbor's user's processes (and root is
    # exempt): the process limit is the sandbox's alone ("-": leave the limit as it is).
    limits = [str(memory_mb * 2**20), str(max(1, int(timeout_s) + 1)), str(max_file_mb * 2**20),
              str(max_processes) if sandbox is not None else "-", "-" if uid is None else str(uid)]
    prefix = sandbox.command(workdir) if sandbox is not None else (isolation or [])
    command = [*prefix, sys.executable, "-I", "-c", _BOOTSTRAP, str(script), *limits]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir,
           "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return command, env


_unsandboxed_lock = threading.Lock()
_unsandboxed_count = 0


def unsandboxed_calls() -> int:
    """Tool calls this process ran without the bubblewrap sandbox (pools built with
    ``allow_unsandboxed=True`` where bwrap cannot run): the ``agent/unsandboxed_tool_calls`` metric."""
    return _unsandboxed_count


def _count_unsandboxed() -> None:
    global _unsandboxed_count
    with _unsandboxed_lock:
        _unsandboxed_count += 1


class ToolPool:
    """Runs tool calls concurrently, at most ``workers`` at a time, each sandboxed."""

    def __init__(self, workers: int = 4, *, allow_network: bool = False, allow_unsandboxed: bool = False,
                 max_processes: int = 64) -> None:
        """Where bwrap cannot run here, ``allow_unsandboxed=True`` runs calls as arbor's own
        user (counted, :func:`unsandboxed_calls`), and ``allow_network=True`` further lets
        them reach the network where no network namespace can be made either; otherwise
        such a machine is a :class:`ConfigError` here, at start-up. ``max_processes``: the
        processes and threads one call may have at once (RLIMIT_NPROC in the sandbox)."""
        if workers < 1:
            raise ValueError(f"workers must be ≥ 1, got {workers}")
        if max_processes < 1:
            raise ValueError(f"max_processes must be ≥ 1, got {max_processes}")
        self.workers, self.max_processes = workers, max_processes
        path = os.environ.get("PATH", "")
        self.sandbox, why = _probe_sandbox(path, max_processes)
        self.isolation: list[str] | None = None
        if self.sandbox is None:
            if not allow_unsandboxed:
                raise ConfigError(
                    f"tool sandbox: cannot run tools in bubblewrap here ({why}). Install bubblewrap "
                    "(apt-get install bubblewrap) where it can make namespaces, or run tools as arbor's own "
                    "user explicitly: rollout.agent_args: {allow_unsandboxed: true}"
                )
            self.isolation, why_network = _probe_isolation(path)
            if self.isolation is None and not allow_network:
                raise ConfigError(
                    f"tool sandbox: cannot cut tools off the network here ({why_network}). Run where `unshare -n` "
                    "(root) or `unshare -rn` (unprivileged user namespaces) works, or let tools reach the "
                    "network explicitly: rollout.agent_args: {allow_network: true}"
                )
            log.warning("tool calls run WITHOUT the bubblewrap sandbox (rollout.agent_args.allow_unsandboxed): "
                        "%s; they are counted in agent/unsandboxed_tool_calls", why)
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
                command, env = _call(code, workdir, self.sandbox, timeout_s=timeout_s, memory_mb=memory_mb,
                                     max_file_mb=max_file_mb, max_processes=self.max_processes,
                                     isolation=self.isolation)
                if self.sandbox is None:
                    _count_unsandboxed()
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
