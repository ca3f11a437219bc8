"""Engine keys: SGLang's auth rules in `arbor serve`, refused requests change nothing, keys never
leak into command lines, logs or saved configs."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sglang_env import sglang_python
from test_server import call
from tiny_model import build_tiny_model_dir

from arbor.config import dump_config
from arbor.config_load import load_config
from arbor.engines.auth import API_KEY_ENV, Level, decide, run_api_key, unprotected_warning
from arbor.engines.client import SGLangClient
from arbor.engines.connect import run_sync
from arbor.engines.embedded.engine import LocalEngine
from arbor.engines.embedded.server import ServerThread
from arbor.engines.errors import EngineError
from arbor.engines.launch import _start, launch_engines
from arbor.engines.types import GenerateRequest, SamplingParams

KEY = "k3y-for-tests-only_0123456789abcdef"
PROMPT = [17, 42, 99, 5, 63, 120, 7, 88]
GREEDY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}


@pytest.fixture
def no_env_key(monkeypatch):
    """This test's process has no ``$ARBOR_ENGINE_API_KEY`` (restored afterwards)."""
    monkeypatch.setenv(API_KEY_ENV, "placeholder")  # records the original value for undo
    monkeypatch.delenv(API_KEY_ENV)


# -- the rules ------------------------------------------------------------------------------


def test_decisions_by_hand():
    admin, normal, force = Level.ADMIN_OPTIONAL, Level.NORMAL, Level.ADMIN_FORCE
    # No keys: everything open except an ADMIN_FORCE endpoint, which no key could open.
    assert decide("POST", "/flush_cache", None, api_key=None, admin_api_key=None, level=admin) is None
    assert decide("POST", "/x", None, api_key=None, admin_api_key=None, level=force) == 403
    # api_key only: it guards everything but the probes; scheme is case-insensitive.
    assert decide("POST", "/generate", None, api_key="a", admin_api_key=None, level=normal) == 401
    assert decide("POST", "/generate", "Bearer b", api_key="a", admin_api_key=None, level=normal) == 401
    assert decide("POST", "/generate", "bearer a", api_key="a", admin_api_key=None, level=normal) is None
    assert decide("POST", "/generate", "Basic a", api_key="a", admin_api_key=None, level=normal) == 401
    assert decide("POST", "/flush_cache", "Bearer a", api_key="a", admin_api_key=None, level=admin) is None
    assert decide("POST", "/x", "Bearer a", api_key="a", admin_api_key=None, level=force) == 403
    for probe in ("/health", "/health_generate", "/ready", "/metrics"):
        assert decide("GET", probe, None, api_key="a", admin_api_key="b", level=normal) is None
    assert decide("OPTIONS", "/generate", None, api_key="a", admin_api_key="b", level=normal) is None
    # Both keys: admin endpoints take only the admin key, normal ones only the api key.
    assert decide("POST", "/flush_cache", "Bearer a", api_key="a", admin_api_key="b", level=admin) == 401
    assert decide("POST", "/flush_cache", "Bearer b", api_key="a", admin_api_key="b", level=admin) is None
    assert decide("POST", "/generate", "Bearer b", api_key="a", admin_api_key="b", level=normal) == 401
    # A non-ASCII token is a wrong key (401), not a server error.
    assert decide("POST", "/generate", "Bearer ké", api_key="a", admin_api_key=None, level=normal) == 401


SGLANG_DECISIONS = """
import json, sys
from sglang.srt.utils.auth import AuthLevel, decide_request_auth
out = []
for method, path, header, api_key, admin_api_key, level in json.load(sys.stdin):
    d = decide_request_auth(method=method, path=path, authorization_header=header, api_key=api_key,
                            admin_api_key=admin_api_key, auth_level=AuthLevel(level))
    out.append(None if d.allowed else d.error_status_code)
print(json.dumps(out))
"""


def test_decisions_equal_sglangs_own_on_every_combination():
    """Every (method, path, header, keys, level) against SGLang 0.5.23's decide_request_auth."""
    python = sglang_python()
    keys = [None, "", "a", "b"]
    cases = list(itertools.product(
        ["GET", "POST", "OPTIONS"], ["/generate", "/flush_cache", "/health_generate", "/metrics", "/readyz"],
        [None, "", "Bearer a", "Bearer b", "bearer a", "Bearer", "Token a", "Bearer  a"],
        keys, keys, [level.value for level in Level],
    ))
    done = subprocess.run([python, "-c", SGLANG_DECISIONS], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [decide(m, p, h, api_key=a, admin_api_key=b, level=Level(lv)) for m, p, h, a, b, lv in cases]
    assert ours == theirs and set(theirs) == {None, 401, 403}  # all three outcomes covered


def test_run_key_and_the_bind_warning(no_env_key, monkeypatch):
    assert run_api_key("mine", launch=True) == "mine"
    assert run_api_key(None, launch=False) is None  # external servers started without a key
    fresh = {run_api_key(None, launch=True) for _ in range(3)}
    assert len(fresh) == 3 and all(len(k) >= 40 for k in fresh)  # 32 random bytes each
    # SGLang parses its --config file as arguments: a key starting with "-" reads as a flag
    # ("--admin-api-key: expected one argument"; 1 in 64 URL-safe keys did).
    assert not any(run_api_key(None, launch=True).startswith("-") for _ in range(2000))
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert run_api_key(None, launch=True) == "from-env" and run_api_key("mine", launch=True) == "mine"
    for host in ("127.0.0.1", "::1", "localhost"):
        assert unprotected_warning(host, None, None) is None
    assert API_KEY_ENV in unprotected_warning("0.0.0.0", None, None)
    assert unprotected_warning("10.1.2.3", None, "admin") is None


# -- a real `arbor serve` with a key --------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A keyed `arbor serve` subprocess, a second model to try loading, the log file."""
    root = tmp_path_factory.mktemp("auth")
    model, other = build_tiny_model_dir(root / "a", seed=0), build_tiny_model_dir(root / "b", seed=1)
    with launch_engines("embedded", model_path=str(model), log_dir=root / "logs", api_key=KEY,
                        startup_timeout_s=120) as handle:
        yield handle, other


def state(url: str) -> tuple:
    """(weight version, cached tokens, greedy output) as the key holder sees them."""
    output = call(url, "POST", "/generate", GREEDY, key=KEY)[1]["output_ids"]  # cached from then on
    info = call(url, "GET", "/server_info", key=KEY)[1]
    return info["weight_version"], info["cached_tokens_in_cache"], output


def test_requests_without_the_key_are_refused_and_change_nothing(keyed):
    handle, other = keyed
    url = handle.urls[0]
    before = state(url)  # also puts the prompt in the radix cache
    assert before[1] > 0
    group = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
             "group_name": "g", "backend": "gloo"}
    refused = [
        ("POST", "/update_weights_from_disk", {"model_path": str(other), "weight_version": "evil"}),
        ("POST", "/flush_cache", {}), ("GET", "/flush_cache", None),
        ("POST", "/init_weights_update_group", group),  # would block waiting for a rank 0
        ("POST", "/begin_weight_update", {}), ("POST", "/end_weight_update", {}),
        ("POST", "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
        ("POST", "/destroy_weights_update_group", {"group_name": "g"}),
        ("POST", "/release_memory_occupation", {}), ("POST", "/resume_memory_occupation", {}),
        ("POST", "/generate", GREEDY), ("GET", "/model_info", None), ("GET", "/get_weight_version", None),
        ("GET", "/server_info", None), ("GET", "/no_such_endpoint", None),
    ]
    for method, path, body in refused:
        for key in (None, "wrong-key", KEY + "x", ""):
            assert call(url, method, path, body, key=key) == (401, {"error": "Unauthorized"}), (path, key)
    assert state(url) == before  # same weights, version and cache
    # Nothing was opened or released: a session opens now, and the engine still generates.
    assert call(url, "POST", "/begin_weight_update", {}, key=KEY)[0] == 200
    assert call(url, "POST", "/end_weight_update", {}, key=KEY)[0] == 200
    # Probes stay open.
    assert call(url, "GET", "/health")[0] == 200 and call(url, "GET", "/health_generate")[0] == 200


def test_the_key_holder_gets_through_and_the_client_sends_it(keyed, no_env_key, monkeypatch):
    handle, other = keyed
    url = handle.urls[0]
    request = GenerateRequest(PROMPT, SamplingParams(max_new_tokens=3, temperature=0))
    assert len(run_sync(lambda c: c.generate(request), url, api_key=KEY)[0].output_ids) == 3
    with pytest.raises(EngineError) as refused:
        run_sync(lambda c: c.flush_cache(), url)
    assert refused.value.status == 401 and API_KEY_ENV in str(refused.value)
    monkeypatch.setenv(API_KEY_ENV, KEY)  # the default key: the environment's
    run_sync(lambda c: c.flush_cache(), url)
    assert call(url, "GET", "/server_info", key=KEY)[1]["cached_tokens_in_cache"] == 0

    async def swap_weights(client: SGLangClient) -> list[str]:
        await client.update_weights_from_disk(str(other), weight_version="7")
        return await client.get_weight_version()

    assert run_sync(swap_weights, url) == ["7"]


def test_the_key_is_in_no_command_line_and_no_log(keyed):
    handle, _ = keyed
    pid = handle.processes[0].pid
    assert KEY not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    # It is in the server's environment, which only this user (and root) may read.
    assert f"{API_KEY_ENV}={KEY}".encode() in Path(f"/proc/{pid}/environ").read_bytes()
    assert "bearer key required" in handle.log_files[0].read_text()
    assert KEY not in handle.log_files[0].read_text()


def test_separate_admin_key_follows_sglang(tmp_path):
    """api key A guards /generate, admin key B the admin endpoints (A no longer opens them)."""
    engine = LocalEngine(build_tiny_model_dir(tmp_path / "m"))
    try:
        with ServerThread(engine, api_key="A", admin_api_key="B") as url:
            assert call(url, "POST", "/generate", GREEDY, key="A")[0] == 200
            assert call(url, "POST", "/generate", GREEDY, key="B")[0] == 401
            assert call(url, "POST", "/flush_cache", {}, key="A")[0] == 401
            assert call(url, "POST", "/flush_cache", {}, key="B")[0] == 200
        with ServerThread(engine, admin_api_key="B") as url:  # admin key only: /generate open
            assert call(url, "POST", "/generate", GREEDY)[0] == 200
            assert call(url, "POST", "/flush_cache", {})[0] == 401
        with ServerThread(engine) as url:  # no key: today's open server, any header accepted
            assert call(url, "POST", "/flush_cache", {}, key="anything")[0] == 200
            assert call(url, "POST", "/release_memory_occupation", {})[0] == 200
    finally:
        engine.shutdown()


def test_unkeyed_server_on_a_network_address_warns(tmp_path, no_env_key):
    model = build_tiny_model_dir(tmp_path / "m")
    with launch_engines("embedded", model_path=str(model), host="0.0.0.0", log_dir=tmp_path / "logs",
                        startup_timeout_s=120) as handle:
        assert call(handle.urls[0], "POST", "/generate", GREEDY)[0] == 200  # still open, as before
    log = handle.log_files[0].read_text()
    assert "WARNING: listening on 0.0.0.0 without a key" in log and "bearer key required" not in log


def test_sglang_output_reaches_its_log_with_the_key_blanked(tmp_path):
    """SGLang prints its server_args (keys included) at start-up: the copy into the log redacts."""
    log = tmp_path / "engine-0.log"
    script = f"print('server_args=' + repr({{'api_key': {KEY!r}, 'admin_api_key': {KEY!r}}}), flush=True)"
    process = _start([sys.executable, "-c", script], dict(os.environ), log, secret=KEY)
    assert process.wait(timeout=60) == 0
    for _ in range(100):  # the copying thread finishes at EOF
        if "api_key" in log.read_text():
            break
        time.sleep(0.05)
    text = log.read_text()
    assert KEY not in text and text.count("<redacted>") == 2


# -- the run's config -----------------------------------------------------------------------


def test_engine_api_key_is_never_dumped_or_shown(tmp_path):
    cfg = load_config(None, ["engine.kind=external", "engine.urls=[http://10.0.0.1:30000]", f"engine.api_key={KEY}"])
    assert cfg.engine.api_key == KEY
    assert KEY not in dump_config(cfg) and "api_key" not in dump_config(cfg)
    assert KEY not in repr(cfg) and KEY not in repr(cfg.engine)
    (tmp_path / "c.yaml").write_text(dump_config(cfg))
    assert load_config(tmp_path / "c.yaml").engine.api_key is None  # the saved config: no secret


def test_a_run_keys_its_engines_and_writes_the_key_nowhere(tmp_path, no_env_key):
    """One training step: the trainer's and the learner's requests (generate, weight push,
    flush, version) pass with the generated key; no file of the run holds it."""
    from arbor.run.trainer import train

    model = build_tiny_model_dir(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"q{i} " * 3, "answer": "1"}) + "\n" for i in range(4)))
    (tmp_path / "reward.py").write_text("def length(problem, completion):\n    return len(completion) % 2\n")
    out = tmp_path / "out"
    cfg = load_config(None, [
        f"model.path={model}", f"data.train_path={data}", "data.prompts_per_step=2", "rollout.width=2",
        "rollout.branch=2", "rollout.segment_tokens=4", "rollout.max_depth=2", "engine.kind=embedded",
        f"reward.functions=[{{fn: {tmp_path}/reward.py:length}}]", "reward.workers=1", "learner.device=cpu",
        "learner.dtype=float32", "learner.backend=torch", "learner.zero_stage=0", "learner.weight_sync=distributed",
        "algorithm.dynamic_sampling=false", "data.max_prompt_tokens=64", "run.steps=1", f"run.output_dir={out}",
        "run.save_every=1",
    ])
    versions, keys = [], []

    def after_step(ctx, step, metrics):
        versions.append(ctx.run_async(ctx.client.get_weight_version()))
        keys.append(ctx.cfg.engine.api_key)  # the settled config's (cfg itself is left as loaded)

    train(cfg, after_step=after_step)
    [key] = keys
    assert cfg.engine.api_key is None
    assert versions == [["1"]] and key and len(key) >= 40  # the pushed weights arrived, under a fresh key
    assert API_KEY_ENV not in os.environ  # the driver's copy went with the engines
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in files)
    assert any("bearer key required" in p.read_text() for p in files if p.suffix == ".log")  # a keyed server
    assert [p for p in files if key.encode() in p.read_bytes()] == []
