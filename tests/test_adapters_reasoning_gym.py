"""reasoning-gym as problems and rewards: ``reasoning_gym:NAME`` sets (arbor.dataset_sources)
and the dataset's own scorer (arbor.rollout.adapters.reasoning_gym), against the real package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from adapter_packages import require

from arbor.config import DataConfig
from arbor.data import load_problems
from arbor.dataset_files import DataError
from arbor.dataset_sources import parse_spec

REPO = Path(__file__).resolve().parents[1]
rg = require("reasoning_gym", "reasoning-gym")
from arbor.rollout.adapters.reasoning_gym import reasoning_gym_score as score  # noqa: E402 (needs reasoning_gym)
from arbor.rollout.adapters.reasoning_gym import reasoning_gym_score_boxed as score_boxed  # noqa: E402


def test_a_spec_names_the_dataset_and_its_options_as_yaml():
    assert parse_spec("reasoning_gym:chain_sum") == ("chain_sum", {"seed": 0})
    assert parse_spec("reasoning_gym:basic_arithmetic?size=8&seed=3&operators=[+, -]") == (
        "basic_arithmetic", {"size": 8, "seed": 3, "operators": ["+", "-"]})


def test_problems_are_the_items_reasoning_gym_generates():
    problems = load_problems("reasoning_gym:chain_sum?size=5&seed=3&max_digits=2", DataConfig())
    items = list(rg.create_dataset("chain_sum", size=5, seed=3, max_digits=2))
    assert [p["id"] for p in problems] == [f"chain_sum-3-{i}" for i in range(5)]
    assert [(p["prompt"], p["answer"]) for p in problems] == [(i["question"], i["answer"]) for i in items]
    assert problems[2]["reasoning_gym"] == {"dataset": "chain_sum", "config": {"size": 5, "seed": 3, "max_digits": 2},
                                            "index": 2}
    json.dumps(problems)  # rows travel to reward workers and into saved trees


def test_the_score_is_the_datasets_own_with_the_items_metadata():
    (problem,) = load_problems("reasoning_gym:countdown?size=1&seed=3", DataConfig())
    gold = problem["answer"]  # "82 + 20 + 67 - 50" makes 119 from 67, 50, 20, 82
    assert score(problem, f"think... <answer>{gold}</answer>") == 1.0
    # Another expression that uses each number once and hits the target: countdown's scorer
    # checks it against the item's metadata (the numbers and the target), not the gold string.
    assert score(problem, "<answer>20 + 82 - 50 + 67</answer>") == 1.0
    assert score(problem, "<answer>82 + 20</answer>") == 0.05  # its partial credit: wrong numbers
    assert score(problem, f"{gold}") == 0.01  # no <answer> tags: scored as no answer
    assert score_boxed(problem, rf"so \boxed{{{gold}}}") == 1.0


def test_a_row_whose_question_reasoning_gym_no_longer_generates_is_an_error():
    (problem,) = load_problems("reasoning_gym:chain_sum?size=1", DataConfig())
    with pytest.raises(DataError, match="chain_sum-0-0.*another question"):
        score({**problem, "prompt": "What is 1+1?"}, "<answer>2</answer>")
    with pytest.raises(DataError, match="no 'reasoning_gym' column"):
        score({"id": "p", "prompt": "q", "answer": "1"}, "<answer>1</answer>")


@pytest.mark.parametrize(("spec", "message"), [
    ("reasoning_gym:no_such_set", "no dataset 'no_such_set'; it has .*chain_sum"),
    ("reasoning_gym:chain_sum?max_digit=2", "no option 'max_digit'; its options: .*max_digits"),
    ("reasoning_gym:chain_sum?min_terms=9&max_terms=2", "refuses this chain_sum config"),
    ("reasoning_gym:", "no dataset name"),
])
def test_bad_specs_are_data_errors_naming_the_problem(spec, message):
    with pytest.raises(DataError, match=message):
        load_problems(spec, DataConfig())


def test_two_rl_steps_of_arbor_train_on_a_generated_set_scored_by_its_dataset(tmp_path):
    """configs/env_reasoning_gym.yaml's set and scorer: every tree's prompt is a chain_sum
    question, every leaf's reward is chain_sum's score of its <answer>."""
    from adapter_runs import train_steps
    from transformers import AutoTokenizer

    history, trees = train_steps(tmp_path, "configs/env_reasoning_gym.yaml", "rollout.width=4")
    assert len(history) == 2 and all("reward/mean" in m for m in history)
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-env")
    scored = 0
    for tree in (t for step in trees.values() for t in step):
        item = rg.create_dataset("chain_sum", **tree.problem["reasoning_gym"]["config"])[tree.problem["reasoning_gym"]["index"]]
        assert item["question"] in tokenizer.decode(tree.prompt_ids)
        for leaf in tree.leaves():
            completion = tokenizer.decode(tree.response_ids(leaf), skip_special_tokens=True)
            assert leaf.reward == pytest.approx(score(tree.problem, completion))
            scored += 1
    assert scored >= 2 * 4 * 4
