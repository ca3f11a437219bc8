"""rewards/math.py: last-\\boxed{} extraction and math-verify scoring, adversarial inputs."""

import time
from pathlib import Path

import pytest

from arbor.answers import has_final_answer, last_boxed
from arbor.plugins import load_object
from arbor.rewards import score_batch

REPO = Path(__file__).resolve().parents[1]
boxed_accuracy = load_object("rewards/math.py:boxed_accuracy", "test", [str(REPO)])
boxed_format = load_object("rewards/math.py:boxed_format", "test", [str(REPO)])


@pytest.mark.parametrize(
    "text, answer",
    [
        (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{1} and finally \boxed{2}", "2"),
        (r"\boxed{1} then \boxed{2", "1"),  # the last one is unbalanced
        (r"\boxed {x+1}", "x+1"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"\fbox{7}", "7"),
        ("no answer", None),
        (r"\boxed" + "{" * 5000, None),
    ],
)
def test_last_boxed(text, answer):
    assert last_boxed(text) == answer


def test_has_final_answer():
    assert has_final_answer(r"\boxed{3}") and not has_final_answer(r"\boxed{ }")


@pytest.mark.parametrize(
    "gold, completion",
    [
        (r"\frac{\sqrt{3}}{2}", r"Hence \boxed{\frac{\sqrt3}{2}}."),
        (r"(0,1]", r"The set is \boxed{(0,1]}"),
        (r"x^2+2x+1", r"\boxed{(x+1)^2}"),
        (r"\dfrac{1}{2}", r"\boxed{0.5}"),
        (r"\text{(B)}", r"\boxed{B}"),
        (r"-3", r"\boxed{-3}"),
        (r"2\sqrt{2}", r"\boxed{\sqrt{8}}"),
        (r"\left( 3, \frac{\pi}{2} \right)", r"\boxed{(3, \pi/2)}"),
        (r"[-2,7)", r"\boxed{[-2,7)}"),
        ("5", r"first \boxed{4}, no wait: \boxed{5}"),
    ],
)
def test_correct_answers_score_one(gold, completion):
    assert boxed_accuracy({"id": "p", "answer": gold}, completion) == 1.0


@pytest.mark.parametrize(
    "gold, completion",
    [
        (r"\frac{\sqrt{3}}{2}", r"\boxed{\frac{\sqrt2}{2}}"),
        (r"(0,1]", r"\boxed{[0,1]}"),
        (r"x^2+2x+1", r"\boxed{x^2+1}"),
        ("5", r"\boxed{5} is wrong, it is \boxed{4}"),  # the LAST box counts
        ("5", "5"),  # no box
        ("5", r"\boxed{}"),
    ],
)
def test_wrong_answers_score_zero(gold, completion):
    assert boxed_accuracy({"id": "p", "answer": gold}, completion) == 0.0


def test_format_reward():
    assert boxed_format({}, r"\boxed{x}") == 1.0 and boxed_format({}, "x") == 0.0


def test_missing_gold_answer_raises():
    with pytest.raises(KeyError, match="'p9' has no 'answer'"):
        boxed_accuracy({"id": "p9"}, r"\boxed{1}")


ADVERSARIAL = [
    r"\boxed{9^{9^{9^9}}}",
    r"\boxed{99999999!}",
    r"\boxed{" + r"\frac{1}{" * 100_000 + "2" + "}" * 100_001,  # ~1 MB of nested \frac
    r"\boxed{" + "{" * 10_000,  # unbalanced
    r"\boxed{" + "9" * 900 + "}",
]


def test_adversarial_inputs_finish_in_bounded_time():
    items = [({"id": f"adv{i}", "answer": "5"}, text) for i, text in enumerate(ADVERSARIAL)]
    items.append(({"id": "ok", "answer": "5"}, r"\boxed{5}"))
    t0 = time.monotonic()
    result = score_batch("rewards/math.py:boxed_accuracy", items, timeout_s=3, workers=2,
                         search_dirs=[str(REPO)])
    assert time.monotonic() - t0 < 30  # 5 hard cases, 2 workers, ≤ 3 s each + worker start
    assert result.scores == [0.0] * len(ADVERSARIAL) + [1.0]


def test_dotted_spec_from_repo_root():
    fn = load_object("rewards.math:boxed_accuracy", "reward.functions[0].fn", [str(REPO)])
    assert fn({"id": 1, "answer": "2"}, r"\boxed{2}") == 1.0
