"""`arbor train` with an environment on the quickstart model and the embedded engine: the
environment's reward alone (``reward.functions: []``), forks by replay, the periodic eval's
episodes; synchronous and asynchronous (``algorithm.max_staleness=1``). The real-SGLang run is
in tests/test_sglang_runs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from arbor.config_load import load_config
from arbor.errors import ConfigError
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
    cfg = env_run(tmp_path / "sync", "run.steps=1", "run.eval_every=1", "eval.max_problems=4")
    history = train(cfg)
    check_env_step(history[-1])
    assert 0 <= history[-1]["eval/accuracy"] <= 1 and history[-1]["eval/env_errors"] == 0
    assert history[-1]["sync/logprob_gap"] <= 1e-4


def test_an_environment_in_an_asynchronous_run(tmp_path):
    history = train(env_run(tmp_path / "async", "run.steps=2", "run.eval_every=0", "algorithm.max_staleness=1", "run.sync_probe_every=1"))
    assert len(history) == 2
    for metrics in history:
        check_env_step(metrics)
        assert metrics["async/staleness_mean"] <= 1


def test_an_environment_without_a_reward_and_no_reward_function_is_refused_at_start_up(tmp_path):
    cfg = env_run(tmp_path / "none", f"rollout.env={REPO}/tests/env_fixtures.py:Silent")
    with pytest.raises(ConfigError, match=r"reward.functions is empty but rollout.env '.*Silent' defines no reward"):
        train(cfg)
