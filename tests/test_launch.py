"""Engine launcher: embedded subprocesses, external URLs, failures with log tails, no orphans."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from sglang_env import sglang_python
from tiny_model import build_tiny_model_dir

from arbor.config_load import load_config
from arbor.engines.launch import (
    EngineLaunchError,
    _command,
    _gpu_for,
    launch_engines,
    sglang_available,
    sglang_key_file,
)
from arbor.engines.ports import free_port
from arbor.errors import ConfigError
from arbor.run.engine_group import engine_args


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
    # The interpreter meant to run SGLang cannot import it: a config error naming engine.python.
    with pytest.raises(ConfigError, match=r"engine.python: /no/such/python cannot import sglang \(FileNotFoundError"):
        launch_engines("sglang", model_path="m", python="/no/such/python")
    if subprocess.run([sys.executable, "-c", "import sglang"], capture_output=True).returncode != 0:
        with pytest.raises(ConfigError, match=r"engine.python: .* \(ModuleNotFoundError: No module named 'sglang'\)"):
            launch_engines("sglang", model_path="m")


def test_server_command_lines():
    sglang = _command("sglang", "/m", "0.0.0.0", 31000, "bfloat16", ["--tp", "1"])
    assert sglang[1:] == [
        "-m", "sglang.launch_server", "--model-path", "/m", "--host", "0.0.0.0",
        "--port", "31000", "--dtype", "bfloat16", "--tp", "1",
    ]  # fmt: skip
    embedded = _command("embedded", "/m", "127.0.0.1", 5, None, [])
    assert embedded[1:] == ["-m", "arbor.engines.embedded.server", "--model", "/m", "--host", "127.0.0.1", "--port", "5"]  # fmt: skip
    assert _gpu_for(1, {"CUDA_VISIBLE_DEVICES": "4,6"}) == "6"
    assert _gpu_for(1, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, per_engine=2) == "2,3"  # tensor parallel
    with pytest.raises(EngineLaunchError, match="needs 1 GPU"):
        _gpu_for(2, {"CUDA_VISIBLE_DEVICES": "4,6"})


def sglang_command(**overrides) -> list[str]:
    """The full command arbor starts SGLang with, for the config ``overrides`` (dotted keys;
    learner.device: cuda unless given: a GPU machine's flags)."""
    overrides = {"learner.device": "cuda", **overrides}
    cfg = load_config(None, ["engine.kind=sglang", *(f"{k}={v}" for k, v in overrides.items())])
    dtype = None if cfg.model.dtype == "auto" else cfg.model.dtype
    return _command("sglang", "/models/m", "0.0.0.0", 31000, dtype, engine_args(cfg), cfg.engine.python)


def test_sglang_on_a_cpu_machine_gets_the_cpu_engine_flags():
    command = sglang_command(**{"learner.device": "cpu", "engine.max_cached_tokens": "4096",
                                "engine.python": "/venvs/sglang/bin/python"})
    assert command[:3] == ["/venvs/sglang/bin/python", "-m", "sglang.launch_server"]
    flags = " ".join(command)
    assert "--dtype float32" in flags  # the learner's auto dtype on CPU
    assert "--device cpu --attention-backend torch_native --disable-overlap-schedule --max-total-tokens 4096" in flags
    assert "--enable-deterministic-inference" not in flags
    with pytest.raises(ConfigError, match="engine.deterministic"):
        load_config(None, ["engine.kind=sglang", "learner.device=cpu", "engine.deterministic=true"])


def test_sglang_flags_follow_the_config():
    plain = sglang_command()
    assert plain[plain.index("--dtype") + 1] == "bfloat16"  # the learner's, never SGLang's auto
    assert plain[plain.index("--random-seed") + 1] == "0"
    assert not {"--trust-remote-code", "--enable-memory-saver", "--enable-deterministic-inference"} & set(plain)
    full = sglang_command(**{"model.trust_remote_code": "true", "ray.colocate": "true",
                             "learner.weight_sync": "disk", "engine.deterministic": "true",
                             "model.dtype": "float16", "run.seed": "7"})
    assert {"--trust-remote-code", "--enable-memory-saver", "--enable-deterministic-inference"} <= set(full)
    assert full.count("--dtype") == 1 and full[full.index("--dtype") + 1] == "float16"
    fp32 = sglang_command(**{"learner.dtype": "float32"})
    assert fp32[fp32.index("--dtype") + 1] == "float32"


# Parses a command line with SGLang's own ServerArgs parser (no GPU needed), in a subprocess:
# importing sglang patches transformers, which the other tests must not see.
PARSE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = parser.parse_args(json.loads(sys.argv[1]))
print(json.dumps({k: getattr(args, k) for k in json.loads(sys.argv[2])}))
"""


def test_every_flag_arbor_passes_is_one_sglang_parses():
    python = sglang_python()
    command = sglang_command(**{"model.trust_remote_code": "true", "ray.colocate": "true",
                                "learner.weight_sync": "disk", "engine.deterministic": "true",
                                "engine.tp_size": "1", "run.seed": "7", "engine.extra_args": "[--log-level, warning]"})
    assert command[1:3] == ["-m", "sglang.launch_server"]
    keys = ["model_path", "host", "port", "dtype", "tp_size", "mem_fraction_static", "random_seed",
            "trust_remote_code", "enable_memory_saver", "enable_deterministic_inference", "log_level"]
    done = subprocess.run([python, "-c", PARSE, json.dumps(command[3:]), json.dumps(keys)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed == {
        "model_path": "/models/m", "host": "0.0.0.0", "port": 31000, "dtype": "bfloat16", "tp_size": 1,
        "mem_fraction_static": 0.8, "random_seed": 7, "trust_remote_code": True, "enable_memory_saver": True,
        "enable_deterministic_inference": True, "log_level": "warning",
    }


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["ray.colocate=true", "engine.kind=sglang"], "learner.weight_sync"),
        (["ray.colocate=true", "learner.device=cuda"], "learner.weight_sync"),
        (["ray.colocate=true", "learner.weight_sync=disk", "engine.tp_size=2"], "engine.tp_size"),
        (["engine.tp_size=0"], "engine.tp_size"),
    ],
)
def test_impossible_engine_combinations_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert key in str(err.value)
    load_config(None, ["ray.colocate=true", "learner.device=cpu"])  # gloo on CPU pairs fine


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


# What `python -m sglang.launch_server ARGS` does first: SGLang's own prepare_server_args,
# which merges a --config YAML file into the arguments.
PREPARE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(json.loads(sys.argv[1]))
print(json.dumps({"api_key": args.api_key, "admin_api_key": args.admin_api_key, "port": args.port}))
"""


def test_sglang_reads_the_engine_key_from_a_private_file_not_the_command_line():
    python = sglang_python()
    key = "k3y-" + "x" * 40
    path = sglang_key_file(key)
    try:
        assert path.stat().st_mode & 0o777 == 0o600  # only this user reads it
        flags = engine_args(load_config(None, ["engine.kind=sglang"]))
        command = _command("sglang", "/models/m", "127.0.0.1", 31000, None, ["--config", str(path), *flags])
        assert key not in " ".join(command)
        done = subprocess.run([python, "-c", PREPARE, json.dumps(command[3:])],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        parsed = json.loads(done.stdout.strip().splitlines()[-1])
        assert parsed == {"api_key": key, "admin_api_key": key, "port": 31000}
    finally:
        path.unlink()

