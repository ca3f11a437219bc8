"""Start (or connect to) rollout engines and hand back their URLs.

    with launch_engines("embedded", model_path="path/to/model", num_engines=1) as handle:
        handle.wait_healthy(timeout_s=120)
        client = SGLangClient(handle.urls)

Kinds:
- ``sglang``: ``PYTHON -m sglang.launch_server --model-path M --port P`` per engine, PYTHON
  being ``python`` (``engine.python``: SGLang pins its own torch, so it often lives in a venv
  of its own) or this interpreter. With CUDA, one GPU group each (``CUDA_VISIBLE_DEVICES``);
  with ``device="cpu"``, SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1`` and
  :func:`sglang_cpu_flags`; scripts/sglang_cpu_env.sh builds such a venv);
- ``embedded``: ``python -m arbor.engines.embedded.server --model M --port P`` (``arbor serve``);
- ``auto``: ``sglang`` where it can run, else ``embedded``;
- ``external``: the given ``urls``, only health-checked; nothing is started or stopped.

Each process writes ``<log_dir>/engine-<i>.log``; a server that dies or is not healthy
within ``startup_timeout_s`` raises with the tail of its log. ``restart(i)`` starts a dead
server again with the same command and port (its URL stays valid; the log is appended to).
``shutdown()`` terminates, then kills, every process it started (also at interpreter exit,
so no orphans).

Keys: with ``api_key`` (default ``$ARBOR_ENGINE_API_KEY``) every server requires it as a
bearer token for all but ``/health*``, never seen on a command line: `arbor serve` reads it
from its environment; SGLang, which takes keys only as flags or in a ``--config`` YAML file,
gets a 0600 file in ``$TMPDIR`` (``api-key`` and ``admin-api-key``; deleted at ``shutdown()``,
so a restart with the same command finds it), and its output goes to the log with the key
replaced (SGLang 0.5.23 logs its ``server_args``, keys included, at start-up).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from arbor.engines.auth import ADMIN_API_KEY_ENV, API_KEY_ENV
from arbor.engines.ports import free_port
from arbor.errors import ConfigError, RunStopped

KINDS = ("auto", "sglang", "embedded", "external")


class EngineLaunchError(RunStopped):
    """An engine could not be started or never became healthy."""


def sglang_available(python: str | None = None) -> bool:
    """SGLang's GPU engine can run here (what ``engine.kind: auto`` picks it by): ``python``
    (default: this interpreter) has the sglang package and a CUDA GPU is visible."""
    if python is None and importlib.util.find_spec("sglang") is None:
        return False
    import torch

    return torch.cuda.is_available() and (python is None or sglang_import_error(python) is None)


def sglang_import_error(python: str | None) -> str | None:
    """Why ``python`` (None: this interpreter) cannot ``import sglang``, or None when it can.
    Run in a subprocess: importing sglang patches transformers, and its torch may differ."""
    command = [python or sys.executable, "-c", "import sglang"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {done.returncode}"


def check_sglang_python(python: str | None) -> None:
    """:class:`ConfigError` naming ``engine.python`` unless that interpreter imports sglang."""
    reason = sglang_import_error(python)
    if reason is not None:
        shown = python or f"{sys.executable} (this interpreter; engine.python unset)"
        raise ConfigError(
            f"engine.python: {shown} cannot import sglang ({reason}); point engine.python at the "
            "interpreter of an environment with SGLang (on a CPU machine: scripts/sglang_cpu_env.sh DIR "
            "builds one and prints its python)"
        )


def resolve_kind(kind: str, device: str | None = None, python: str | None = None) -> str:
    """``engine.kind`` as it runs here: ``auto`` is SGLang where its GPU engine can run
    (:func:`sglang_available` with ``python``), else the embedded engine; ``sglang`` whose
    interpreter (``engine.python``) cannot import it is a :class:`ConfigError`."""
    if kind not in KINDS:
        raise ValueError(f"engine kind must be one of {KINDS}, got {kind!r}")
    if kind == "auto":
        return "sglang" if device != "cpu" and sglang_available(python) else "embedded"
    if kind == "sglang":
        check_sglang_python(python)
    return kind


@dataclass
class EngineHandle:
    """Running (or external) engines; a context manager that shuts them down."""

    kind: str  # "sglang" | "embedded" | "external" (auto resolved)
    urls: list[str]
    processes: list[subprocess.Popen] = field(default_factory=list)
    log_files: list[Path] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)  # per process, for restart()
    envs: list[dict[str, str]] = field(default_factory=list)
    key_files: list[Path] = field(default_factory=list)  # SGLang's --config files, until shutdown
    redact: str | None = field(default=None, repr=False)  # blanked out of the servers' output

    def wait_healthy(self, timeout_s: float = 300.0, poll_s: float = 0.1) -> None:
        """Block until every URL answers ``GET /health`` with 200 (asked every ``poll_s``: a
        refused connection costs nothing, and each poll skipped is start-up time saved)."""
        deadline = time.monotonic() + timeout_s
        pending = list(range(len(self.urls)))
        while pending:
            for index in list(pending):
                self._check_alive(index)
                if _healthy(self.urls[index]):
                    pending.remove(index)
            if not pending:
                return
            if time.monotonic() > deadline:
                bad = ", ".join(self.urls[i] for i in pending)
                raise EngineLaunchError(
                    f"{self.kind} engine(s) {bad} not healthy after {timeout_s:.0f} s"
                    + self._log_tails(pending)
                )
            time.sleep(poll_s)

    def restart(self, index: int, timeout_s: float = 300.0) -> None:
        """Kill what is left of server ``index`` and start it again on its port; wait until
        healthy (an :class:`EngineLaunchError` with its log's tail if it dies or hangs)."""
        old = self.processes[index]
        _signal_group(old, signal.SIGKILL)
        old.wait()
        with open(self.log_files[index], "ab") as log:
            log.write(f"\n--- arbor: {self.kind} engine restarted (it exited with {old.returncode}) ---\n".encode())
        # Through _start, as at launch: a keyed server's output is redacted again.
        self.processes[index] = _start(self.commands[index], self.envs[index], self.log_files[index], self.redact,
                                       append=True)
        self.wait_healthy(timeout_s)

    def log_tail(self, index: int, lines: int = 30) -> str:
        """The last ``lines`` of server ``index``'s log, headed by its path ("" without one)."""
        return self._log_tails([index], lines)

    def shutdown(self, grace_s: float = 10.0) -> None:
        """SIGTERM each server's process group (SGLang forks workers), SIGKILL after grace."""
        for process in self.processes:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
            # Workers may outlive a leader that exited on SIGTERM.
            _signal_group(process, signal.SIGKILL)
        self.processes = []
        for path in self.key_files:
            path.unlink(missing_ok=True)
        self.key_files = []

    def __enter__(self) -> EngineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _check_alive(self, index: int) -> None:
        if index < len(self.processes) and self.processes[index].poll() is not None:
            code = self.processes[index].returncode
            raise EngineLaunchError(
                f"{self.kind} engine {self.urls[index]} exited with code {code}"
                + self._log_tails([index])
            )

    def _log_tails(self, indices: list[int], lines: int = 30) -> str:
        out = []
        for i in indices:
            if i < len(self.log_files) and self.log_files[i].exists():
                tail = self.log_files[i].read_text(errors="replace").splitlines()[-lines:]
                out.append(f"\n--- last lines of {self.log_files[i]} ---\n" + "\n".join(tail))
        return "".join(out)


def launch_engines(
    kind: str = "auto",
    *,
    model_path: str | None = None,
    num_engines: int = 1,
    urls: list[str] | None = None,
    host: str = "127.0.0.1",
    dtype: str | None = None,
    device: str | None = None,
    extra_args: list[str] | None = None,
    log_dir: str | Path | None = None,
    startup_timeout_s: float = 600.0,
    wait: bool = True,
    gpus_per_engine: int = 1,
    api_key: str | None = None,
    python: str | None = None,
) -> EngineHandle:
    """Start ``num_engines`` servers of ``kind`` (or adopt ``urls``) and wait until healthy.

    ``dtype`` is passed as ``--dtype`` to either server; ``device`` (``cpu``/``cuda``) picks
    the embedded server's device, and with ``cpu`` runs SGLang's CPU engine
    (:func:`sglang_cpu_flags` are the caller's to give, with its KV pool size); ``extra_args``
    are appended to each server's command line as given (e.g. ``["--mem-fraction-static", "0.4"]``).
    ``python``: the interpreter that runs SGLang (``engine.python``; default this one).
    ``api_key`` (default ``$ARBOR_ENGINE_API_KEY``, none when unset): the key the servers
    require, for normal and admin endpoints alike.
    """
    if kind not in KINDS:
        raise ValueError(f"engine kind must be one of {KINDS}, got {kind!r}")
    if kind == "external":
        if not urls:
            raise ValueError("engine kind 'external' needs urls")
        handle = EngineHandle("external", [u.rstrip("/") for u in urls])
    else:
        if model_path is None:
            raise ValueError(f"engine kind {kind!r} needs model_path")
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        kind = resolve_kind(kind, device=device, python=python)
        log_root = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="arbor-engines-"))
        log_root.mkdir(parents=True, exist_ok=True)
        api_key = api_key or os.environ.get(API_KEY_ENV) or None
        handle = EngineHandle(kind, [], redact=api_key if kind == "sglang" else None)
        atexit.register(handle.shutdown)
        for index in range(num_engines):
            port = free_port(host)
            extra = list(extra_args or [])
            if device and kind == "embedded":
                extra = ["--device", device, *extra]
            env = dict(os.environ)
            if kind == "sglang" and device == "cpu":
                env["SGLANG_USE_CPU_ENGINE"] = "1"
            elif kind == "sglang":
                env["CUDA_VISIBLE_DEVICES"] = _gpu_for(index, env, gpus_per_engine)
            if kind == "sglang":
                if api_key and "--config" in extra:
                    raise EngineLaunchError(
                        "engine.extra_args gives SGLang a --config file, but arbor passes the engine key "
                        "in one (SGLang takes one): move those options into engine.extra_args"
                    )
                if api_key:
                    handle.key_files.append(sglang_key_file(api_key))
                    extra = ["--config", str(handle.key_files[-1]), *extra]
            elif api_key:
                env[API_KEY_ENV] = env[ADMIN_API_KEY_ENV] = api_key
            command = _command(kind, model_path, host, port, dtype, extra, python)
            log_file = log_root / f"engine-{index}.log"
            handle.processes.append(_start(command, env, log_file, handle.redact))
            handle.log_files.append(log_file)
            handle.commands.append(command)
            handle.envs.append(env)
            handle.urls.append(f"http://{host}:{port}")
    if wait:
        try:
            handle.wait_healthy(startup_timeout_s)
        except BaseException:
            handle.shutdown()
            raise
    return handle


def _start(
    command: list[str], env: dict[str, str], log_file: Path, secret: str | None, append: bool = False
) -> subprocess.Popen:
    """Start a server in its own process group, its output into ``log_file`` (through a
    thread that blanks ``secret`` out of it, when given)."""
    with open(log_file, "ab" if append else "wb") as log:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE if secret else log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )
    if secret:
        threading.Thread(target=_copy_redacted, args=(process.stdout, log_file, secret.encode()), daemon=True).start()
    return process


def _copy_redacted(stream: Any, log_file: Path, secret: bytes) -> None:
    """Copy ``stream`` line by line into ``log_file`` with ``secret`` replaced, until EOF."""
    with stream, open(log_file, "ab") as log:
        for line in stream:
            log.write(line.replace(secret, b"<redacted>"))
            log.flush()  # the tail is read when a server fails


def sglang_key_file(api_key: str) -> Path:
    """A YAML file only this user can read, for ``sglang.launch_server --config FILE``:
    ``--api-key`` and ``--admin-api-key`` both ``api_key``, off the command line."""
    descriptor, path = tempfile.mkstemp(prefix="arbor-sglang-keys-", suffix=".yaml")  # mode 0600
    with os.fdopen(descriptor, "w") as file:
        yaml.safe_dump({"api-key": api_key, "admin-api-key": api_key}, file)
    return Path(path)


def _command(
    kind: str, model_path: str, host: str, port: int, dtype: str | None, extra: list[str],
    python: str | None = None,
) -> list[str]:
    if kind == "sglang":
        command = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", model_path]
    else:
        command = [sys.executable, "-m", "arbor.engines.embedded.server", "--model", model_path]
    command += ["--host", host, "--port", str(port)]
    if dtype:
        command += ["--dtype", dtype]
    return command + list(extra)


def sglang_flags(
    *,
    mem_fraction: float,
    tp_size: int,
    dtype: str | None,
    seed: int,
    trust_remote_code: bool = False,
    memory_saver: bool = False,
    deterministic: bool = False,
) -> list[str]:
    """``sglang.launch_server`` flags for an RL engine (checked against SGLang's own parser
    in tests/test_launch.py).

    ``dtype`` is the learner's (None: given elsewhere): SGLang's ``auto`` serves an fp32 checkpoint in fp16, and the
    engine's log-probs must come from the weights the learner trains. ``memory_saver``:
    without ``--enable-memory-saver`` (and ``torch_memory_saver``) SGLang's
    ``/release_memory_occupation`` frees nothing, which colocated engines rely on.
    ``deterministic``: SGLang uses ``sampling_seed`` only with
    ``--enable-deterministic-inference`` (slower kernels); otherwise seeds are ignored.
    """
    flags = ["--mem-fraction-static", str(mem_fraction), "--tp-size", str(tp_size)]
    flags += ["--random-seed", str(seed)] + (["--dtype", dtype] if dtype else [])
    if trust_remote_code:
        flags.append("--trust-remote-code")
    if memory_saver:
        flags.append("--enable-memory-saver")
    if deterministic:
        flags.append("--enable-deterministic-inference")
    return flags


def sglang_cpu_flags(max_total_tokens: int) -> list[str]:
    """``sglang.launch_server`` flags for its CPU engine (with ``SGLANG_USE_CPU_ENGINE=1``).

    ``torch_native`` is the attention backend that runs without GPU kernels; the overlap
    scheduler needs CUDA streams; ``--max-total-tokens`` bounds the KV pool, which SGLang
    otherwise sizes from the free host memory (most of the machine).
    """
    return [
        "--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
        "--max-total-tokens", str(max_total_tokens),
    ]  # fmt: skip


def _gpu_for(index: int, env: dict[str, str], per_engine: int = 1) -> str:
    """Engine i gets the i-th group of ``per_engine`` visible GPUs (its tensor-parallel ranks)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(_cuda_count())]
    if (index + 1) * per_engine > len(devices):
        raise EngineLaunchError(
            f"engine {index} needs {per_engine} GPU(s), only {len(devices)} visible for all engines"
        )
    return ",".join(devices[index * per_engine : (index + 1) * per_engine])


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    """Signal the process group the server leads (it was started in a new session)."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False
