"""`arbor train` with an environment on the quickstart model and the embedded engine: the
environment's reward alone (``reward.functions: []``), forks by replay, the periodic eval's
episodes; synchronous and asynchronous (``algorithm.max_staleness=1``). The real-SGLang run is
in tests/test_sglang_runs.py."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from async_checks import check_async_trained

from arbor.config_load import load_config
from arbor.errors import ConfigError
from arbor.run import evaluate
from arbor.run.trainer import train

REPO = Path(__file__).resolve().parents[1]
RECHECK = f"rollout.env={REPO}/tests/env_fixtures.py:Recheck"


def env_run(out: Path, *overrides: str):
    return load_config(REPO / "configs" / "quickstart.yaml", [
        f"run.output_dir={out}", "data.prompts_per_step=4", "learner.backend=torch", "learner.zero_stage=0",
        # One segment per answer: the tree forks after the environment's turn (replaying its step).
        RECHECK, "reward.functions=[]", "rollout.width=4", "rollout.segment_tokens=16", "rollout.max_depth=4",
        "algorithm.dynamic_sampling=false",
        "run.cpu_threads=1", "algorithm.max_staleness=0", *overrides,
    ])


def check_env_step(metrics: dict) -> None:
    # Two answers per episode (the environment asks for a check once); a replayed first step per fork.
    assert 1.0 < metrics["env/steps_per_episode"] <= 2.0
    assert metrics["env/forks/replay"] > 0 and metrics["env/replayed_steps"] > 0 and metrics["env/forks/copy"] == 0
    assert metrics["env/errors"] == 0 and metrics["env/timeouts"] == 0 and metrics["env/live"] == 0
    # The environment's reward is the whole reward (reward.functions is empty, env_weight 1).
    assert metrics["reward/mean"] == pytest.approx(metrics["env/reward_mean"])
    assert metrics["agent/tool_calls_per_episode"] > 0 and metrics["train/linearised_tokens"] > 0


def test_an_environment_trains_and_evaluates_on_the_embedded_engine(tmp_path):
    out = tmp_path / "sync"
    cfg = env_run(out, "run.steps=1", "run.eval_every=1", "eval.max_problems=8")
    history = train(cfg)
    check_env_step(history[-1])
    assert history[-1]["eval/env_errors"] == 0 and history[-1]["sync/logprob_gap"] <= 1e-4
    # The step's eval is `arbor eval`'s on the weights the run exported (greedy: the same
    # episodes), and its accuracy is the share of episodes that boxed the gold answer
    # (Recheck's reward), read back from that report's responses.
    report = tmp_path / "eval.json"
    assert evaluate.main(replace(cfg, model=replace(cfg.model, path=str(out / "hf")),
                                 eval=replace(cfg.eval, output=str(report)))) == 0
    result = json.loads(report.read_text())
    samples = [(p["gold"], s) for p in result["problems"] for s in p["samples"]]
    assert len(samples) == 8
    for key in ("eval/accuracy", "eval/reward_mean", "eval/length_mean"):
        assert history[-1][key] == pytest.approx(result["metrics"][key], abs=1e-9), key
    assert history[-1]["eval/accuracy"] == sum(f"\\boxed{{{gold}}}" in s["response"] for gold, s in samples) / 8


def test_an_environment_in_an_asynchronous_run(tmp_path):
    history = train(env_run(tmp_path / "async", "run.steps=3", "run.eval_every=0", "algorithm.max_staleness=1",
                            "run.sync_probe_every=1"))
    for metrics in history:
        check_env_step(metrics)
    check_async_trained(history, max_staleness=1)  # environment turns carry no weight version: not stale


def ledger_run(out: Path, *overrides: str):
    """envs/ledger.py (copy-forked, its own prompt and reward) on the quickstart's config as shipped
    (asynchronous, max_staleness 1, 32 problems a step, dynamic sampling): the ids-only problems of
    data/env/ledger.jsonl. (With 8 problems a step, one whose groups all scored alike, which
    dynamic sampling rightly leaves untrained, came often enough to fail the check by chance.)"""
    return load_config(REPO / "configs" / "quickstart.yaml", [
        f"run.output_dir={out}", f"rollout.env={REPO}/envs/ledger.py:Ledger", "reward.functions=[]",
        f"data.train_path={REPO}/data/env/ledger.jsonl", "data.eval_path=null",
        "rollout.segment_tokens=16", "rollout.max_depth=4", "run.steps=6", "run.eval_every=0", "run.save_every=0",
        "learner.backend=torch", "learner.zero_stage=0", "run.cpu_threads=1", *overrides,
    ])


def test_a_copy_forked_environment_trains_asynchronously_as_it_does_synchronously(tmp_path):
    """The bug that shipped: on the quickstart's asynchronous config a multi-turn tree was dropped as
    too stale from step 3 on (its environment's nodes read as weight version 0), training nothing."""
    asynchronous = train(ledger_run(tmp_path / "async"))
    check_async_trained(asynchronous, max_staleness=1)
    assert all(m["async/dropped"] == 0 and m["run/empty_steps"] == 0 for m in asynchronous)
    assert all(m["env/forks/copy"] > 0 and m["env/steps_per_episode"] > 1 for m in asynchronous)
    rewards = {round(m["reward/mean"], 6) for m in asynchronous}
    assert len(rewards) > 1 and all(m["reward/std"] > 0 for m in asynchronous)  # the reward varies
    synchronous = train(ledger_run(tmp_path / "sync", "algorithm.max_staleness=0"))
    trained = [sum(m["rollout/trees_trained"] for m in run) for run in (asynchronous, synchronous)]
    assert trained[0] >= trained[1] / 2, trained


def test_an_environment_without_a_reward_and_no_reward_function_is_refused_at_start_up(tmp_path):
    cfg = env_run(tmp_path / "none", f"rollout.env={REPO}/tests/env_fixtures.py:Silent")
    with pytest.raises(ConfigError, match=r"reward.functions is empty but rollout.env '.*Silent' defines no reward"):
        train(cfg)


def test_an_environment_that_raises_on_every_step_stops_the_run_in_a_few_lines(tmp_path):
    """One failure policy: each branch whose env.step raises is dropped and counted; every episode
    of the step failing (more than reward.max_failure_fraction) stops `arbor train` with a few lines
    naming the problem id, the turn and the environment's own message, the traceback in arbor.log."""
    import subprocess
    import sys

    out = tmp_path / "exploding"
    done = subprocess.run([
        sys.executable, "-m", "arbor", "train", "configs/quickstart.yaml", f"run.output_dir={out}",
        f"rollout.env={REPO}/tests/env_fixtures.py:Exploding", "reward.functions=[]", "data.prompts_per_step=4",
        "rollout.width=4", "rollout.segment_tokens=16", "rollout.max_depth=4", "run.steps=2", "run.eval_every=0",
        "learner.backend=torch", "learner.zero_stage=0", "run.cpu_threads=1",
    ], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    err = done.stderr.strip()
    assert "Traceback" not in err and "Traceback" not in done.stdout
    stopped = [line for line in err.splitlines() if line.startswith("arbor train: stopped:")]
    assert len(stopped) == 1 and len(err.splitlines()) <= 6, err
    assert re.search(r"step 1: (\d+) of \1 episodes failed \(100% > reward.max_failure_fraction=0.1\)\. First: "
                     r"problem 'arith-\d+', turn 1: env_error: step raised KeyError: 'no account for 2 messages'",
                     stopped[0]), stopped[0]
    log = (out / "arbor.log").read_text()
    assert "Traceback (most recent call last)" in log and "RewardFailureError" in log
    assert "env_error: step raised KeyError" in log  # every dropped branch, one line each
