"""Engine launcher: embedded subprocesses, external URLs, failures with log tails, no orphans."""

from __future__ import annotations

import urllib.request

import pytest
from tiny_model import build_tiny_model_dir

from arbor.engines.launch import (
    EngineLaunchError,
    _command,
    _gpu_for,
    launch_engines,
    sglang_available,
)
from arbor.engines.server import free_port


def test_auto_starts_embedded_servers_and_shuts_them_down(tmp_path):
    if sglang_available():
        pytest.skip("auto would start SGLang here")
    model = build_tiny_model_dir(tmp_path / "model")
    with launch_engines(
        "auto", model_path=str(model), log_dir=tmp_path / "logs", startup_timeout_s=120
    ) as handle:
        assert handle.kind == "embedded" and len(handle.urls) == 1
        with urllib.request.urlopen(handle.urls[0] + "/get_model_info", timeout=10) as resp:
            assert str(model) in resp.read().decode()
        # An external handle on a running server only health-checks it.
        external = launch_engines("external", urls=[handle.urls[0] + "/"], startup_timeout_s=10)
        assert external.urls == handle.urls and external.processes == []
        external.shutdown()  # starts nothing, stops nothing
        assert handle.processes[0].poll() is None
        process = handle.processes[0]
    assert process.poll() is not None  # terminated on exit
    assert (tmp_path / "logs" / "engine-0.log").read_text().count("arbor serve:") == 1


def test_a_server_that_dies_raises_with_its_log_tail(tmp_path):
    with pytest.raises(EngineLaunchError) as info:
        launch_engines(
            "embedded",
            model_path=str(tmp_path / "no-model"),
            log_dir=tmp_path,
            startup_timeout_s=60,
        )
    message = str(info.value)
    assert "exited with code" in message and "engine-0.log" in message
    assert "no-model" in message  # the server's own error, from the log tail


def test_unreachable_external_url_times_out():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineLaunchError, match="not healthy after"):
        launch_engines("external", urls=[url], startup_timeout_s=1)


def test_argument_errors():
    with pytest.raises(ValueError, match="kind"):
        launch_engines("vllm", model_path="m")
    with pytest.raises(ValueError, match="urls"):
        launch_engines("external")
    with pytest.raises(ValueError, match="model_path"):
        launch_engines("embedded")
    if not sglang_available():
        with pytest.raises(EngineLaunchError, match="sglang"):
            launch_engines("sglang", model_path="m")


def test_server_command_lines():
    sglang = _command("sglang", "/m", "0.0.0.0", 31000, "bfloat16", ["--tp", "1"])
    assert sglang[1:] == [
        "-m", "sglang.launch_server", "--model-path", "/m", "--host", "0.0.0.0",
        "--port", "31000", "--dtype", "bfloat16", "--tp", "1",
    ]  # fmt: skip
    embedded = _command("embedded", "/m", "127.0.0.1", 5, None, [])
    assert embedded[1:] == ["-m", "arbor.engines.server", "--model", "/m", "--host", "127.0.0.1", "--port", "5"]  # fmt: skip
    assert _gpu_for(1, {"CUDA_VISIBLE_DEVICES": "4,6"}) == "6"
    assert _gpu_for(1, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, per_engine=2) == "2,3"  # tensor parallel
    with pytest.raises(EngineLaunchError, match="needs 1 GPU"):
        _gpu_for(2, {"CUDA_VISIBLE_DEVICES": "4,6"})


def test_a_killed_server_restarts_on_its_url_with_its_log_appended(tmp_path):
    import os
    import signal

    if sglang_available():
        pytest.skip("auto would start SGLang here")
    model = build_tiny_model_dir(tmp_path / "model")
    with launch_engines("embedded", model_path=str(model), log_dir=tmp_path / "logs", startup_timeout_s=120) as handle:
        url, first = handle.urls[0], handle.processes[0]
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        handle.restart(0, timeout_s=120)
        assert handle.urls == [url] and handle.processes[0].pid != first.pid
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            assert resp.status == 200
        log = (tmp_path / "logs" / "engine-0.log").read_text()
        assert log.count("arbor serve:") == 2 and "engine restarted (it exited with -9)" in log
        assert "engine restarted" in handle.log_tail(0)
