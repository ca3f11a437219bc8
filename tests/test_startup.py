"""Start-up: the phase clock, engines and learner ranks started at once, and a failed start stopping all."""

import ast
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch
from tiny_model import build_tiny_model_dir

from arbor.config_load import load_config
from arbor.engines.auth import API_KEY_ENV
from arbor.engines.launch import EngineLaunchError, resolve_kind, sglang_available
from arbor.errors import ConfigError
from arbor.run.context import start_run
from arbor.run.engine_group import engine_args
from arbor.run.startup import StartupClock, check_problem_files, problem_files, settled

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def test_settled_decides_the_engine_kind_and_key_once_and_leaves_the_loaded_config_alone(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.chdir(REPO)
    loaded = load_config(QUICKSTART, ["engine.kind=auto"])
    cfg = settled(loaded)
    assert cfg.engine.kind == ("sglang" if sglang_available() else "embedded") == resolve_kind("auto")
    assert cfg.engine.api_key and len(cfg.engine.api_key) >= 40  # a fresh key for engines arbor starts
    assert (loaded.engine.kind, loaded.engine.api_key) == ("auto", None)
    assert settled(cfg).engine == cfg.engine  # settling twice changes nothing
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert settled(loaded).engine.api_key == "from-env"
    external = load_config(QUICKSTART, ["engine.kind=external", "engine.urls=[http://10.0.0.1:1]"])
    monkeypatch.delenv(API_KEY_ENV)
    assert (settled(external).engine.kind, settled(external).engine.api_key) == ("external", None)
    # arbor sft starts no engines: its engine section is left as written.
    assert settled(loaded, "sft").engine == loaded.engine


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rule needs a machine without CUDA")
def test_settling_checks_the_rules_again_knowing_the_machine(monkeypatch):
    """learner.device: auto passes as loaded; settled on a CPU machine, flex attention (no
    backward on CPU) is refused, naming the key, by every command."""
    monkeypatch.chdir(REPO)
    cfg = load_config(QUICKSTART, ["learner.device=auto", "learner.attention=flex"])
    for command in ("train", "eval", "sft"):
        with pytest.raises(ConfigError, match=r"quickstart.yaml \(settled for this machine\): learner.attention flex needs CUDA"):
            settled(cfg, command)


def test_engine_flags_need_a_settled_kind():
    with pytest.raises(ValueError, match="engine.kind is still auto"):
        engine_args(load_config(None, ["engine.kind=auto"]))
    assert engine_args(load_config(None, ["engine.kind=embedded", "engine.max_cached_tokens=64"])) == [
        "--max-cached-tokens", "64"]


def test_train_eval_and_sft_share_one_start_up():
    """Each command's entry calls start_command, and none settles, loads a tokenizer or
    claims its output directory on its own (read from the source: nothing is run)."""
    own_startup = {"settled", "load_tokenizer", "save_config", "latest_checkpoint", "from_pretrained"}
    for module in ("context", "evaluate", "sft"):
        tree = ast.parse((REPO / "arbor" / "run" / f"{module}.py").read_text())
        called = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                  for node in ast.walk(tree) if isinstance(node, ast.Call)}
        assert "start_command" in called, module
        assert not called & own_startup, (module, called & own_startup)


def test_the_clock_times_phases_and_joins_overlapping_ones():
    clock = StartupClock(origin=100.0)
    times = iter([100.0, 101.0, 101.5, 102.0, 104.0, 105.0, 105.0])
    clock.now = lambda: next(times) - clock.origin  # a hand-driven clock: offsets 0, 1, 1.5, 2, 4, 5
    with clock.phase("ray"):  # 0 -> 1
        pass
    clock.begin("engines")  # 1.5
    clock.begin("learners")  # 2
    clock.end("engines")  # 4
    clock.end("learners")  # 5
    assert clock.seconds() == {"ray": 1.0, "engines": 2.5, "learners": 3.0}
    assert clock.summary() == "started in 5.0 s: ray 1.0, engines 2.5 | learners 3.0"


def test_a_phase_that_raises_is_still_timed_and_an_unfinished_one_is_left_out():
    clock = StartupClock()
    with pytest.raises(ValueError), clock.phase("tokenizer"):
        raise ValueError("no tokenizer")
    clock.begin("engines")
    assert list(clock.seconds()) == ["tokenizer"]
    assert "engines" not in clock.summary()


def test_importing_orchestration_imports_no_torch_transformers_or_deepspeed():
    """An engine actor imports arbor.run.engine_group (and orchestration) before it launches its
    server, a learner actor arbor.run.learner_group before it sets up: neither may wait for the
    learner's libraries first."""
    code = ("import sys, arbor.run.orchestration, arbor.run.engine_group, arbor.run.learner_group, "
            "arbor.engines.launch; "
            "print([m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=TESTS.parent).stdout
    assert out.strip() == "[]"


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    model = build_tiny_model_dir(root / "model")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"q{i} " * 3, "answer": "1"}) + "\n" for i in range(4)))
    return model, data


def config(model, data, out, *overrides):
    return load_config(None, [
        f"model.path={model}", "model.chat_template=true", f"data.train_path={data}", "data.max_prompt_tokens=64",
        "engine.kind=embedded", f"reward.functions=[{{fn: {TESTS}/reward_fixtures.py:one}}]", "reward.workers=1",
        "learner.backend=deepspeed", "learner.zero_stage=3", "learner.device=cpu", "learner.dtype=float32",
        "rollout.segment_tokens=16", "rollout.max_depth=2", f"run.output_dir={out}", "run.loggers=[]", *overrides,
    ])


def actor_processes() -> list[psutil.Process]:
    """This test's engine and learner actors still alive (Ray's workers are our descendants)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.cmdline()[:1] in (["ray::EngineWorker"], ["ray::LearnerWorker"]) and process.is_running() \
                    and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            continue  # exited while we looked
    return found


def test_engines_and_learners_start_at_once_and_both_serve(run_inputs, tmp_path):
    model, data = run_inputs
    with start_run(config(model, data, tmp_path / "out", "engine.kind=auto")) as ctx:
        engines_start, engines_end = ctx.startup.spans["engines"]
        learners_start, learners_end = ctx.startup.spans["learners"]
        assert learners_start < engines_end and engines_start < learners_end  # the two overlapped
        assert ctx.run_async(ctx.client.get_weight_version())  # the engine answers
        assert ctx.learners.state_checksum()[0] > 0  # the rank holds its model
    # The config as run: the engine kind this machine decided, never the key.
    saved = load_config(tmp_path / "out" / "config.yaml")
    assert saved.engine.kind == ctx.cfg.engine.kind == resolve_kind("auto") and saved.engine.api_key is None


def test_an_engine_that_fails_while_learners_start_stops_everything_naming_it(run_inputs, tmp_path):
    import ray

    model, data = run_inputs
    cfg = config(model, data, tmp_path / "out", "engine.extra_args=[--no-such-flag]")
    with pytest.raises(EngineLaunchError) as info, start_run(cfg):
        pass
    message = str(info.value)
    assert message.startswith("engine 0 did not start: embedded engine http://")
    assert "exited with code 2" in message and "--no-such-flag" in message  # the server's log tail
    assert "Traceback" not in message  # Ray's traceback of the actor is not the reason
    deadline = time.monotonic() + 60
    while actor_processes() and time.monotonic() < deadline:  # killed actors take a moment to exit
        time.sleep(0.5)
    assert actor_processes() == []
    # The placement group is gone: every CPU is free again for the next run.
    assert ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU")


def test_ray_started_early_is_awaited_and_outlives_the_thread_that_started_it(tmp_path):
    """`arbor train` starts Ray in a thread while it reads the model and data; start_ray then
    waits for it. Ray's processes die with the thread that spawned them (PR_SET_PDEATHSIG), so
    that thread must live on: the GCS and raylet are still running after it started them."""
    import ray

    from arbor.run import orchestration

    cfg = load_config(TESTS.parent / "configs" / "quickstart.yaml",
                      [f"run.output_dir={tmp_path}"])
    ray.shutdown()
    try:
        orchestration.start_ray_early(cfg)
        orchestration.start_ray(cfg.ray, needs_cpus=orchestration.ray_cpus(cfg))
        assert ray.is_initialized() and orchestration._early_start is None
        time.sleep(1.0)  # a killed GCS / raylet would have exited by now
        node = ray._private.worker._global_node
        for kind in ("gcs_server", "raylet"):
            assert all(p.process.poll() is None for p in node.all_processes[kind]), kind
        assert ray.get(ray.remote(lambda: 6 * 7).remote()) == 42

        def progress_bars() -> dict[str, bool]:  # defined here: Ray ships it by value
            """Whether tqdm, and transformers (save_pretrained's "Writing model shards"), draw bars."""
            from tqdm import tqdm
            from transformers.utils import logging

            with tqdm(range(1), desc="Writing model shards") as bar:
                return {"tqdm": not bar.disable, "transformers": logging.is_progress_bar_enabled()}

        # Actors draw no progress bars: Ray would forward them to the run's console.
        assert ray.get(ray.remote(progress_bars).remote()) == {"tqdm": False, "transformers": False}
    finally:
        ray.shutdown()


def test_problem_files_are_named_by_their_keys(tmp_path):
    """What each command reads, by the key that names it; a missing one is refused naming that key."""
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("")
    cfg = load_config(None, [f"data.train_path={train}", f"data.eval_path={test}", "run.eval_every=5"])
    assert problem_files(cfg, "train") == {"data.train_path": str(train), "data.eval_path": str(test)}
    assert problem_files(cfg, "eval") == {"data.eval_path": str(test)}
    assert problem_files(replace(cfg, run=replace(cfg.run, eval_every=0)), "train") == {"data.train_path": str(train)}
    other = replace(cfg, eval=replace(cfg.eval, path="other.jsonl"))
    assert problem_files(other, "eval") == {"eval.path": "other.jsonl"}  # eval.path wins
    assert problem_files(cfg, "sft") == {"sft.train_path": cfg.sft.train_path}
    with pytest.raises(ConfigError, match=rf"^data.eval_path: {test}: no such file or directory$"):
        check_problem_files(cfg, "train")
    with pytest.raises(ConfigError, match="^eval.path: arbor eval has no set to evaluate"):
        problem_files(replace(cfg, data=replace(cfg.data, eval_path=None)), "eval")
