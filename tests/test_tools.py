"""The tool sandbox: every way a tool can misbehave becomes an error observation, quickly."""

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest
from ci_rule import unavailable

from arbor.errors import ConfigError
from arbor.rollout.tools import ToolPool, _probe_sandbox, network_isolation, unsandboxed_calls


def _sandbox_missing() -> str:
    return _probe_sandbox(os.environ.get("PATH", ""), 64)[1]


# The escape tests must run in CI: there a machine without a working bwrap is a failure
# (.ci/run installs bubblewrap), elsewhere they skip saying why (tests/ci_rule.py).
@pytest.fixture
def pool():
    if why := _sandbox_missing():
        unavailable(f"the tool sandbox cannot run here: {why}")
    return ToolPool(workers=2)


def run(code: str, **limits):
    return asyncio.run(ToolPool(workers=2, allow_unsandboxed=True).run_python(code, **limits))


def test_output_comes_back():
    result = run("import math\nprint(math.factorial(5))")
    assert result.ok and result.observation == "120\n"


def test_an_exception_is_an_observation_with_the_tools_own_traceback():
    result = run("def f(x):\n    return 1 / x\nprint('before')\nf(0)")
    assert not result.ok and result.exit_code == 1
    assert result.observation.startswith("before\n")
    assert "ZeroDivisionError: division by zero" in result.observation
    assert 'File "<tool>", line 2, in f' in result.observation
    assert "_BOOTSTRAP" not in result.observation and "exec(compile" not in result.observation


def test_sleeping_past_the_timeout_is_stopped():
    result = run("import time\nprint('started', flush=True)\ntime.sleep(30)", timeout_s=1.0)
    assert result.timed_out and not result.ok
    assert result.seconds < 10  # killed, not waited for
    assert "started" in result.observation and "time limit" in result.observation


def test_megabytes_of_output_are_cut_and_stopped():
    result = run("while True:\n    print('x' * 1000)", max_output_chars=5000, timeout_s=20.0)
    assert result.flooded and not result.ok and not result.timed_out
    assert len(result.output) == 5000 and "too much output" in result.observation
    small = run("print('y' * 7000)", max_output_chars=5000)
    assert small.ok and small.truncated and "[output truncated]" in small.observation


def test_memory_limit():
    result = run("x = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert not result.ok and "MemoryError" in result.observation and "allocated" not in result.output


def test_files_stay_in_a_private_temporary_directory():
    first = run("import os\nopen('note.txt', 'w').write('hi')\nprint(os.getcwd())")
    second = run("import os\nprint(os.path.exists('note.txt'), os.getcwd())")
    assert first.ok and second.ok
    assert second.output.split()[0] == "False" and second.output.split()[1] != first.output.strip()


def test_no_network():
    if network_isolation() is None:  # util-linux's unshare; CI runs as root, where `unshare -n` works
        unavailable("no private network namespace here (`unshare -n` and `unshare -rn` both fail)")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.socket()\ns.settimeout(2)\nprint(s.connect_ex(('127.0.0.1', {port})))"
        result = run(code)
    assert result.ok and result.output.strip() != "0"  # the host's loopback is not reachable


def test_calls_run_concurrently_in_one_pool():
    pool = ToolPool(workers=3)

    async def main():
        return await asyncio.gather(*(pool.run_python(f"print({i} * {i})") for i in range(6)))

    results = asyncio.run(main())
    assert [r.output for r in results] == [f"{i * i}\n" for i in range(6)]


def test_without_bwrap_a_pool_refuses_to_start_unless_unsandboxed_is_allowed(tmp_path, monkeypatch):
    """A machine where bubblewrap cannot run (here: a PATH without `bwrap`): tools must not
    quietly run as arbor's user; `allow_unsandboxed=True` is the explicit, counted opt-out."""
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no bwrap to find
    with pytest.raises(ConfigError, match=r"no `bwrap` program on PATH .*\{allow_unsandboxed: true\}"):
        ToolPool()
    before = unsandboxed_calls()
    pool = ToolPool(allow_unsandboxed=True, allow_network=True)
    assert pool.sandbox is None
    assert asyncio.run(pool.run_python("print(6 * 7)")).output == "42\n"
    assert pool.run_python_sync("print(1)").ok
    assert unsandboxed_calls() == before + 2


def test_without_unshare_a_pool_refuses_to_start_unless_network_is_allowed(tmp_path, monkeypatch):
    """Unsandboxed, with no way to isolate the network either (a PATH without `unshare`):
    tools must not quietly get the network; `allow_network=True` is the explicit opt-out."""
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no bwrap, no unshare
    with pytest.raises(ConfigError, match=r"no `unshare` program on PATH .*\{allow_network: true\}"):
        ToolPool(allow_unsandboxed=True)
    pool = ToolPool(allow_unsandboxed=True, allow_network=True)
    assert pool.isolation is None and network_isolation() is None
    result = asyncio.run(pool.run_python("print(6 * 7)"))
    assert result.ok and result.output == "42\n"


def test_a_bwrap_or_unshare_the_kernel_refuses_is_reported(tmp_path, monkeypatch):
    """`bwrap` and `unshare` present but refused (no CAP_SYS_ADMIN, user namespaces off):
    their own messages are in the errors. The stand-ins print what bubblewrap and util-linux
    print in that case."""
    for name, message in (("bwrap", "bwrap: No permissions to create new namespace"),
                          ("unshare", "unshare: unshare failed: Operation not permitted")):
        fake = tmp_path / name
        fake.write_text(f"#!/bin/sh\necho '{message}' >&2\nexit 1\n")
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(ConfigError, match=r"bwrap` exited 1: bwrap: No permissions to create new namespace"):
        ToolPool()
    with pytest.raises(ConfigError, match=r"-rn true` exited 1: unshare: unshare failed: Operation not permitted"):
        ToolPool(allow_unsandboxed=True)


# Escapes: what model code tried through the pool before it ran in bubblewrap.


def test_a_host_file_is_out_of_sight(pool, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    secret.chmod(0o600)
    code = f"for p in ({str(secret)!r}, '/etc/shadow', '/root/.bashrc'):\n"
    code += "    try:\n        print(open(p).read())\n    except OSError as e:\n        print(type(e).__name__)"
    result = pool.run_python_sync(code)
    assert result.ok, result.observation
    assert "hunter2" not in result.output and "root:" not in result.output
    assert result.output.split() == ["FileNotFoundError"] * 3


def test_nothing_outside_the_temporary_directory_is_writable(pool, tmp_path):
    """A host directory is not there to write to; what Python needs is there, read-only."""
    host_dir = tmp_path / "checkpoints"
    host_dir.mkdir()
    code = "import os, sys\n"
    code += f"targets = [{str(host_dir / 'model.pt')!r}, os.path.join(sys.prefix, 'evil.py'), '/usr/evil', '/evil']\n"
    code += "for t in targets:\n    try:\n        open(t, 'w').write('x')\n        print('wrote', t)\n"
    code += "    except OSError as e:\n        print(type(e).__name__)\n"
    code += "open('mine.txt', 'w').write('fine'); print(open('mine.txt').read())"
    result = pool.run_python_sync(code)
    assert result.ok, result.observation
    assert "wrote" not in result.output and result.output.endswith("fine\n")
    assert list(host_dir.iterdir()) == [] and not os.path.exists(os.path.join(sys.prefix, "evil.py"))


def test_a_host_process_cannot_be_signalled(pool):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        result = pool.run_python_sync(
            f"import os, signal\ntry:\n    os.kill({victim.pid}, signal.SIGKILL)\n    print('killed')\n"
            "except OSError as e:\n    print(type(e).__name__)\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
        )
        assert result.ok, result.observation
        assert result.output.splitlines()[0] == "ProcessLookupError"
        assert victim.poll() is None  # still running
        assert max(eval(result.output.splitlines()[1])) < 10  # only the sandbox's own few processes
    finally:
        victim.kill()
        victim.wait()


def test_a_host_port_is_unreachable(pool):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.socket()\ns.settimeout(2)\nprint(s.connect_ex(('127.0.0.1', {port})))"
        result = pool.run_python_sync(code)
    assert result.ok and result.output.strip() != "0", result.observation


def test_a_fork_flood_stops_at_the_process_limit(pool):
    code = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
            "            time.sleep(60)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
            "    print(n, type(e).__name__)")
    start = time.monotonic()
    result = pool.run_python_sync(code, timeout_s=20.0)
    assert result.ok, result.observation
    forked, error = result.output.split()
    assert error == "BlockingIOError" and 0 < int(forked) < pool.max_processes
    assert time.monotonic() - start < 15  # the sleeping children did not hold the call open


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:  # exited meanwhile
            pass
    return found


def test_no_process_outlives_the_call(pool):
    """A child detached into its own session (double fork, setsid) that sleeps on after
    the call returned: gone with it. Its command line carries a marker to look it up."""
    marker = f"arbor-escape-{uuid.uuid4().hex}"
    code = ("import os, subprocess, sys\nif os.fork() == 0:\n    os.setsid()\n"
            f"    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}],"
            " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)\n"
            "    os._exit(0)\nos.wait()\nimport time\ntime.sleep(0.5)\nprint('left it running')")
    result = pool.run_python_sync(code)
    assert result.ok and result.output == "left it running\n", result.observation
    deadline = time.monotonic() + 5
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)  # the kernel tears the PID namespace down right after the call
    assert _processes_with(marker) == []


def test_the_call_runs_as_its_own_unprivileged_user(pool):
    code = ("import os\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
            "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])")
    first, second = pool.run_python_sync(code), pool.run_python_sync(code)
    assert first.ok and second.ok, first.observation
    uid = int(first.output.split()[0])
    assert uid != 0 and uid != os.getuid() or os.getuid() != 0
    assert first.output.splitlines()[1] == "0000000000000000"  # no capabilities
    if os.geteuid() == 0:  # root: each call its own fresh uid
        assert first.output.split()[0] != second.output.split()[0]
