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
    history = train(program_run(tmp_path / "sync", "run.steps=3", "run.sync_probe_every=1", "run.eval_every=2",
                                "data.eval_path=data/arith/test.jsonl", "eval.max_problems=6"))
    assert len(history) == 3
    # The periodic eval runs the program: one greedy run per problem, none failed.
    assert [("eval/accuracy" in m) for m in history] == [False, True, False]
    assert history[1]["eval/problems"] == 6 and history[1]["eval/length_mean"] > 0
    assert history[1]["eval/program_errors"] == 0 and history[1]["eval/failures"] == 0
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


def test_arbor_eval_of_the_paged_lookup_program_is_the_environment_s(tmp_path):
    """agents/paged_lookup_program.py plays envs/paged_lookup.py's episodes through the endpoint:
    greedy, every answer is the environment run's, token for token, and so is every reward."""
    import json

    from arbor.run.evaluate import main

    reports = {}
    for name in ("program_paged_lookup", "paged_lookup"):
        out = tmp_path / name
        assert main(load_config(REPO / "configs" / f"{name}.yaml", [
            f"run.output_dir={out}", "eval.max_problems=12", "run.cpu_threads=1"])) == 0
        reports[name] = json.loads((out / "eval.json").read_text())
    program, env = reports["program_paged_lookup"], reports["paged_lookup"]
    assert program["program"] == "agents/paged_lookup_program.py:program"
    assert program["metrics"]["eval/problems"] == 12 and program["metrics"]["eval/program_errors"] == 0
    assert [p["samples"][0]["response"] for p in program["problems"]] == \
        [p["samples"][0]["response"] for p in env["problems"]]
    assert [p["correct"] for p in program["problems"]] == [p["correct"] for p in env["problems"]]
    assert 0 < sum(p["correct"] for p in program["problems"]) < 12  # the model is half right: rewards vary


def test_a_program_tree_trains_the_shared_page_once(tmp_path):
    """The tree forks after the page: one request samples the eight answers, and tree packing
    trains the call, the page and the question once per problem, where independent runs (the GRPO
    arm of bench_learning) carry them once per run."""
    seen = {}
    for mode, extra in (("tree", ()), ("independent", ("algorithm.advantage=grpo", "loss.mode=linear"))):
        cfg = load_config(REPO / "configs" / "program_paged_lookup.yaml", [
            f"run.output_dir={tmp_path / mode}", "run.steps=1", "run.eval_every=0", "data.prompts_per_step=4",
            "algorithm.dynamic_sampling=false", "run.cpu_threads=1", "run.save_every=0", "run.save_trees_every=0",
            f"rollout.mode={mode}", *extra])
        [metrics] = train(cfg)
        assert metrics["program/runs"] == 32 and metrics["program/errors"] == 0
        seen[mode] = metrics
    tree, independent = seen["tree"], seen["independent"]
    assert tree["program/replayed_calls"] == 28 and independent["program/replayed_calls"] == 0
    # Per problem: call 1, then one request of n=8 at the fork; independent: call 1 for the eight
    # runs in one request from the root, then each run's call 2 of its own.
    assert (tree["rollout/requests"], independent["rollout/requests"]) == (4 * 2, 4 * (1 + 8))
    assert tree["tree/sharing_ratio"] > 4 and independent["tree/sharing_ratio"] < 1.5
