"""`arbor train` of agent programs on the quickstart model and the embedded engine: the
example written with the ``openai`` client (configs/program_openai.yaml), synchronous and
asynchronous, token-exact (the learner scores the trained ids as the engine sampled them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from async_checks import check_async_trained

from arbor.config_load import load_config
from arbor.errors import ConfigError
from arbor.run.trainer import train

REPO = Path(__file__).resolve().parents[1]


def program_run(out: Path, *overrides: str):
    return load_config(REPO / "configs" / "program_openai.yaml", [
        f"run.output_dir={out}", "data.prompts_per_step=4", "run.cpu_threads=1", *overrides])


def test_the_openai_program_trains_three_steps_token_exact(tmp_path):
    history = train(program_run(tmp_path / "sync", "run.steps=3", "run.sync_probe_every=1"))
    assert len(history) == 3
    for metrics in history:
        assert metrics["program/calls"] >= 3 * 4 * 4  # three calls per run, four runs per problem
        assert metrics["program/replayed_calls"] > 0  # forks replayed the calls before them
        assert metrics["program/retokenized"] == 0 and metrics["program/offpath_calls"] == 0
        assert metrics["program/errors"] == 0 and metrics["program/diverged"] == 0
        assert metrics["program/timeouts"] == 0
        # The learner's log-probs of the trained ids are the engine's: nothing was re-tokenised.
        assert metrics["train/logprob_gap"] <= 1e-4 and metrics["mismatch/kl"] <= 1e-4
        assert metrics["sync/logprob_gap"] <= 1e-4
        assert metrics["tree/sharing_ratio"] > 1.0


def test_the_openai_program_in_an_asynchronous_run(tmp_path):
    history = train(program_run(tmp_path / "async", "run.steps=3", "algorithm.max_staleness=1"))
    assert all(m["program/replayed_calls"] > 0 and m["failures/total"] == 0 for m in history)
    # Context between calls (tool results, the program's own messages) carries no weight version.
    check_async_trained(history, max_staleness=1)


def test_a_program_and_an_environment_are_refused_together(tmp_path):
    with pytest.raises(ConfigError, match="rollout.program and rollout.env are all set"):
        program_run(tmp_path / "both", f"rollout.env={REPO}/tests/env_fixtures.py:Recheck")
