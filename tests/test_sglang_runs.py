"""Whole runs on a real SGLang 0.5.23 CPU server that arbor starts itself (``engine.kind: sglang``,
``engine.python: $ARBOR_SGLANG_PYTHON``; tests/sglang_env.py): the quickstart, asynchronous
with partial rollouts and weights by broadcast, then ``arbor eval`` on its export; a
synchronous run with weights by disk whose SGLang scheduler is killed mid-rollout; an
asynchronous one whose scheduler is killed while the producer samples (at a barrier:
tests/engine_kills.py); an asynchronous
LoRA run (its requests name the adapter, which SGLang would otherwise silently ignore); and an
asynchronous run with an environment (``rollout.env``).

Small on purpose (a few prompts, two or three steps): each run starts a server (~20 s quiet).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from async_checks import check_async_trained
from engine_kills import kill_while_the_producer_samples
from sglang_env import sglang_python

from arbor.config_load import load_config
from arbor.run.metrics import read_metrics
from arbor.run.trainer import train

REPO = Path(__file__).resolve().parents[1]
# float32 on both sides, SGLang's torch_native kernels against the learner's forward.
GAP_BOUND = 1e-4
# One refill round: with 4 problems a step, a step whose problems all score alike (nothing to
# train, push or probe) would be common without it.
SMALL = ["data.prompts_per_step=4", "engine.max_cached_tokens=16384", "run.cpu_threads=1", "algorithm.max_refill_rounds=1"]


def test_quickstart_async_on_sglang_then_arbor_eval(tmp_path):
    python = sglang_python()
    out = tmp_path / "qs"
    sglang = ["engine.kind=sglang", f"engine.python={python}", *SMALL]
    command = [sys.executable, "-m", "arbor", "train", "configs/quickstart.yaml", *sglang, "run.steps=3",
               "run.eval_every=3", "algorithm.max_staleness=1", "run.sync_probe_every=1", "engine.partial_rollouts=true",
               f"run.output_dir={out}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [m for m in read_metrics(out) if m["step"] >= 1]
    assert [m["step"] for m in steps] == [1, 2, 3]
    # Right after each push the engine's log-probs are the learner's (float32 both sides).
    assert all(m["sync/logprob_gap"] < GAP_BOUND for m in steps)
    # Step 1 trains on trees of the weights it starts from; later steps on trees one update old
    # (max_staleness 1), so their gap is the policy's own move in one step, not an engine error.
    assert steps[0]["train/logprob_gap"] < GAP_BOUND
    assert all(m["async/staleness_mean"] <= 1 for m in steps)
    assert all(m["rollout/trees_trained"] > 0 and m["run/empty_steps"] == 0 for m in steps[1:])
    # Prefix reuse read from the server's own cached_tokens: forks share their parents' KV.
    assert all(m["rollout/cached_ratio"] > 0.5 for m in steps)
    assert "eval/accuracy" in read_metrics(out)[-1]

    report = tmp_path / "eval.json"
    evaluate = [sys.executable, "-m", "arbor", "eval", "configs/quickstart.yaml", *sglang, f"model.path={out / 'hf'}",
                "eval.max_problems=20", f"eval.output={report}"]
    done = subprocess.run(evaluate, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report.exists() and "accuracy" in report.read_text()


def scheduler_of(launcher_pid: int) -> int:
    """The pid of SGLang's scheduler process, a child of the launcher (``sglang::scheduler``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            name = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == launcher_pid and "scheduler" in name:
            return int(entry.name)
    raise AssertionError(f"no SGLang scheduler under launcher {launcher_pid}")


def test_weights_by_disk_and_a_killed_scheduler_restarts_the_server(tmp_path):
    import ray

    python = sglang_python()
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        "engine.kind=sglang", f"engine.python={python}", *SMALL, "run.steps=3", "run.eval_every=0",
        "run.save_every=0", "learner.weight_sync=disk", "algorithm.max_staleness=0", f"run.output_dir={tmp_path / 'run'}",
        f"model.path={REPO / 'models' / 'tiny-arith'}", f"data.train_path={REPO / 'data' / 'arith' / 'train.jsonl'}",
        f"data.eval_path={REPO / 'data' / 'arith' / 'test.jsonl'}",
    ])
    kills: list[int] = []

    def arm(ctx, step, metrics):
        if step != 1:
            return
        show, worker = ctx.log.status, ctx.engines.workers[0]

        def status(text):  # at step 2's first finished tree: the rest are in flight
            if text.startswith("rollout: 1/") and not kills:
                kills.append(scheduler_of(ray.get(worker.pid.remote())))
                os.kill(kills[0], signal.SIGKILL)
            show(text)

        ctx.log.status = status

    history = train(cfg, after_step=arm)
    assert len(kills) == 1
    assert [m["engine/restarts"] for m in history] == [0, 1, 0]
    # The restarted server got the run's weights back: the next pushes and probes agree.
    assert all(m["sync/logprob_gap"] < GAP_BOUND and m["train/logprob_gap"] < GAP_BOUND for m in history)


def quickstart(tmp_path, *overrides):
    return load_config(REPO / "configs" / "quickstart.yaml", [
        "engine.kind=sglang", f"engine.python={sglang_python()}", *SMALL, "run.eval_every=0", "run.save_every=0",
        "algorithm.max_staleness=0", f"run.output_dir={tmp_path / 'run'}", f"model.path={REPO / 'models' / 'tiny-arith'}",
        f"data.train_path={REPO / 'data' / 'arith' / 'train.jsonl'}",
        f"data.eval_path={REPO / 'data' / 'arith' / 'test.jsonl'}", *overrides,
    ])


def test_async_run_whose_scheduler_is_killed_while_the_producer_samples(tmp_path):
    # After step 1 the trainer waits until the producer samples step 3's batch, then the kill
    # (tests/engine_kills.py): steps 2 and 3 run on the restarted server.
    cfg = quickstart(tmp_path, "run.steps=3", "algorithm.max_staleness=1", "run.sync_probe_every=1")  # weights by broadcast
    arm, kills = kill_while_the_producer_samples(1, victim=scheduler_of)
    history = train(cfg, after_step=arm)
    assert len(kills) == 1 and len(history) == 3  # the run finished
    assert sum(m["engine/restarts"] for m in history) >= 1
    # The restarted server got the pushed weights back and joined the next broadcast's group.
    assert all(m["sync/logprob_gap"] < GAP_BOUND for m in history)


def test_lora_async_run_names_the_adapter_and_restores_it_after_a_scheduler_kill(tmp_path):
    """SGLang serves a request that names no adapter from the base model, silently. Every
    request of the run names it (the producer's through the same engine wrapper as the probe's;
    `arbor serve`, which refuses an unnamed request, shows that in tests/test_trainer.py): here
    the probe after each push matches the learner's adapted policy, the producer's LoRA
    rollouts run on a real SGLang, and its scheduler killed while the producer samples comes
    back with the adapters."""
    # SGLang's LoRA path pins host memory, which needs CUDA: tests/sglang_cpu_pinless makes it
    # a no-op in SGLang's processes alone (an interpreter that puts it on their path).
    python = tmp_path / "sglang-pinless"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{REPO / "tests" / "sglang_cpu_pinless"}${{PYTHONPATH:+:$PYTHONPATH}}" '
                      f'exec "{sglang_python()}" "$@"\n')
    python.chmod(0o755)
    # The kill between step 1's push and step 2's update, while the producer samples step 3's
    # batch (tests/engine_kills.py).
    cfg = quickstart(tmp_path, "run.steps=3", "algorithm.max_staleness=1", "run.sync_probe_every=1", "model.lora_rank=8", "model.lora_alpha=16",
                     "optim.lr=2e-3", f"engine.python={python}", "engine.extra_args=[--lora-backend, torch_native]")
    arm, kills = kill_while_the_producer_samples(1, victim=scheduler_of)
    history = train(cfg, after_step=arm)
    assert len(kills) == 1 and len(history) == 3
    assert sum(m["engine/restarts"] for m in history) >= 1
    assert all(m["sync/logprob_gap"] < GAP_BOUND for m in history)
    assert all(m["async/staleness_mean"] <= 1 for m in history)
    assert (tmp_path / "run" / "hf" / "adapter_config.json").exists()


def test_an_environment_forked_by_replay_on_sglang_asynchronously(tmp_path):
    """rollout.env on a real SGLang server, asynchronous (the producer thread runs the episodes):
    two-turn episodes whose reward is the environment's alone, forks rebuilt by replay, every
    instance closed at the end of each step, the engine's log-probs still the learner's."""
    python = sglang_python()
    out = tmp_path / "env"
    command = [sys.executable, "-m", "arbor", "train", "configs/quickstart.yaml", "engine.kind=sglang",
               f"engine.python={python}", *SMALL, "run.steps=3", "run.eval_every=0", "algorithm.max_staleness=1", "run.sync_probe_every=1",
               f"rollout.env={REPO}/tests/env_fixtures.py:Recheck", "reward.functions=[]", "rollout.width=4",
               "rollout.segment_tokens=16", "rollout.max_depth=4", "algorithm.dynamic_sampling=false",
               f"run.output_dir={out}"]
    history = trained_steps(command, out, 3)
    check_async_trained(history, max_staleness=1)  # the environment's turns do not make a tree stale
    for m in history:
        assert 1.0 < m["env/steps_per_episode"] <= 2.0 and m["env/replayed_steps"] > 0
        assert m["env/live"] == 0 and m["env/errors"] == 0
        assert m["reward/mean"] == m["env/reward_mean"]
        assert m["sync/logprob_gap"] < GAP_BOUND and m["rollout/cached_ratio"] > 0.5


@pytest.mark.parametrize("program", ["agents/openai_agents_sdk.py:program", "agents/langgraph_tool.py:program"])
def test_a_framework_agent_program_trains_on_sglang(tmp_path, program):
    """An agent program on a framework drives a real SGLang server through arbor's endpoint: 2
    steps, forks replayed, nothing re-tokenised, the trained ids scored as SGLang sampled them."""
    python = sglang_python()
    out = tmp_path / "program"
    command = [sys.executable, "-m", "arbor", "train", "configs/program_openai.yaml", "engine.kind=sglang",
               f"engine.python={python}", *SMALL, "run.steps=2", f"rollout.program={program}",
               f"run.output_dir={out}"]
    for m in trained_steps(command, out, 2):
        assert m["program/replayed_calls"] > 0 and m["program/retokenized"] == 0 and m["program/errors"] == 0
        assert m["train/logprob_gap"] < GAP_BOUND


def trained_steps(command: list[str], out: Path, steps: int) -> list[dict]:
    """The metrics of each step of the ``arbor train`` ``command`` writes to ``out`` (it must succeed)."""
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = [m for m in read_metrics(out) if m["step"] >= 1]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    return metrics
