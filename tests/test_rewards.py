"""The reward pool: order, weights, hard timeouts, errors naming the problem."""

from pathlib import Path

import pytest

from arbor.errors import ConfigError
from arbor.rewards import RewardError, RewardPool, RewardTerm, clip_text, score_batch

HERE = str(Path(__file__).parent)
FIX = "reward_fixtures.py"


def problem(i, **extra):
    return {"id": f"p{i}", "prompt": "q", "answer": "1", **extra}


def test_scores_in_order_with_weights():
    items = [(problem(i), "x" * i) for i in range(7)]
    terms = [RewardTerm(f"{FIX}:length", 2.0), RewardTerm(f"{FIX}:one", 0.5)]
    result = score_batch(terms, items, timeout_s=10, workers=2, search_dirs=[HERE])
    assert result.scores == [2.0 * i + 0.5 for i in range(7)]
    assert result.term_scores[f"{FIX}:length"] == [float(i) for i in range(7)]
    assert result.timeouts == 0 and result.timed_out == []


def test_timeout_kills_replaces_and_counts():
    # Items 1 and 3 sleep far past the timeout; the others are instant and still score.
    items = [(problem(i, sleep=60 if i in (1, 3) else 0), "c") for i in range(6)]
    with RewardPool(f"{FIX}:sleepy", workers=2, timeout_s=1.0, search_dirs=[HERE]) as pool:
        result = pool.score(items)
        assert result.scores == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
        assert result.timeouts == 2 and result.timed_out == [1, 3]
        assert result.seconds < 30  # bounded: nobody waited for the 60 s sleeps
        # The replaced workers serve the next batch.
        again = pool.score([(problem(9), "c")] * 3)
        assert again.scores == [1.0, 1.0, 1.0] and again.timeouts == 0


def test_raise_names_problem_id_and_keeps_partial_scores():
    items = [(problem(0), "ok"), (problem(1), "ok"), (problem(2), "bad"), (problem(3), "ok")]
    with RewardPool(f"{FIX}:raises_on_bad", workers=1, timeout_s=10, search_dirs=[HERE]) as pool:
        with pytest.raises(RewardError) as err:
            pool.score(items)
        assert "'p2'" in str(err.value) and "ValueError: cannot score this" in str(err.value)
        assert err.value.problem_id == "p2"
        assert err.value.partial_scores == {0: 1.0, 1: 1.0}
        # The pool stays usable after a failed batch.
        assert pool.score([(problem(5), "ok")]).scores == [1.0]


def test_non_finite_score_is_an_error():
    with pytest.raises(RewardError, match="problem id 'p0'.*not a finite number"):
        score_batch(f"{FIX}:nan", [(problem(0), "c")], timeout_s=10, workers=1, search_dirs=[HERE])


def test_dead_worker_counts_and_is_replaced():
    items = [(problem(0), "ok"), (problem(1), "die"), (problem(2), "ok")]
    result = score_batch(f"{FIX}:dies", items, timeout_s=10, workers=1, search_dirs=[HERE])
    assert result.scores == [1.0, 0.0, 1.0] and result.timed_out == [1]


@pytest.mark.parametrize(
    "spec, message",
    [
        (f"{FIX}:missing", "reward.functions[0].fn: module"),
        (f"{FIX}:not_callable", "reward.functions[0].fn: 'reward_fixtures.py:not_callable' is not callable"),
        ("no_module_here:fn", "reward.functions[0].fn: cannot import module"),
    ],
)
def test_bad_spec_is_config_error_naming_key(spec, message):
    with pytest.raises(ConfigError) as err:
        RewardPool(spec, workers=1, timeout_s=1, search_dirs=[HERE])
    assert message in str(err.value)


def test_clip_text_bounds_megabyte_strings():
    shown = clip_text("a" * 1_000_000)
    assert len(shown) < 300 and "999800 chars" in shown
