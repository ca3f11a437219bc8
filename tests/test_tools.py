"""The tool sandbox: every way a tool can misbehave becomes an error observation, quickly."""

import asyncio
import socket

import pytest

from arbor.errors import ConfigError
from arbor.rollout.tools import ToolPool, network_isolation


def run(code: str, **limits):
    return asyncio.run(ToolPool(workers=2).run_python(code, **limits))


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


@pytest.mark.skipif(network_isolation() is None, reason="no private network namespace (unshare) here")
def test_no_network():
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


def test_without_unshare_a_pool_refuses_to_start_unless_network_is_allowed(tmp_path, monkeypatch):
    """A machine with no way to isolate the network (here: a PATH without `unshare`): tools
    must not quietly get the network; `allow_network=True` is the explicit opt-out."""
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no unshare to find
    with pytest.raises(ConfigError, match=r"no `unshare` program on PATH .*\{allow_network: true\}"):
        ToolPool()
    pool = ToolPool(allow_network=True)
    assert pool.isolation is None and network_isolation() is None
    result = asyncio.run(pool.run_python("print(6 * 7)"))
    assert result.ok and result.output == "42\n"


def test_an_unshare_the_kernel_refuses_is_reported(tmp_path, monkeypatch):
    """`unshare` present but refused (no CAP_SYS_ADMIN, user namespaces off): its own
    message is in the error. The stand-in prints what util-linux prints in that case."""
    fake = tmp_path / "unshare"
    fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(ConfigError, match=r"-rn true` exited 1: unshare: unshare failed: Operation not permitted"):
        ToolPool()
