"""rewards/math.py and arbor/rollout/answers.py: last-\\boxed{} extraction and the final run of
boxes, math-verify scoring of MATH-style gold answers (with the readings of issue 24: runs
of boxes, trailing punctuation, digit groups, each re-run against wrong golds), and
adversarial completions that must finish in bounded time."""

import time
from pathlib import Path

import pytest

from arbor.plugins import load_object
from arbor.rollout.answers import final_boxes, has_final_answer, last_boxed
from arbor.rollout.rewards import RewardTerm, score_batch

REPO = Path(__file__).resolve().parents[1]
boxed_accuracy = load_object("rewards/math.py:boxed_accuracy", "test", [str(REPO)])
boxed_format = load_object("rewards/math.py:boxed_format", "test", [str(REPO)])
read_answer = load_object("rewards/math.py:read_answer", "test", [str(REPO)])


@pytest.mark.parametrize(
    "text, answer",
    [
        (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{1} and finally \boxed{2}", "2"),
        (r"\boxed{1} then \boxed{2", None),  # the last box is unbalanced: no answer
        (r"\boxed{1} then \boxed 2", None),  # the last box has no brace
        (r"\boxed {x+1}", "x+1"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not nest
        (r"\boxed{\left\{ x \right\}} tail", r"\left\{ x \right\}"),
        (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
        (r"\boxed{a\\}b}", r"a\\"),  # `\\` is a line break, so the next } closes the box
        (r"\fbox{7}", "7"),
        (r"\boxed{1} \fbox{7}", "7"),
        (r"\fbox{\boxed{3}}", "3"),
        ("no answer", None),
        (r"\boxed{}", ""),
        (r"\boxed" + "{" * 5000, None),
        (r"\boxed{5} " + r"\boxed{" + "1" * 20_000 + "}", None),  # last box too long
    ],
)
def test_last_boxed(text, answer):
    assert last_boxed(text) == answer


def test_last_boxed_is_linear_on_megabytes_of_braces():
    text = (r"\boxed{" * 200_000) + "{" * 1_000_000
    t0 = time.monotonic()
    assert last_boxed(text) is None
    assert time.monotonic() - t0 < 1.0


def test_has_final_answer_on_text_being_generated():
    # The sampler asks after every chunk: a box still being written is not an answer yet.
    assert not has_final_answer(r"first \boxed{1}, but let me redo it: \boxed{1")
    assert has_final_answer(r"first \boxed{1}, but let me redo it: \boxed{12}")
    assert not has_final_answer(r"\boxed{ }")


@pytest.mark.parametrize(
    "text, boxes",
    [
        (r"\boxed{(2, 2)} \quad \text{and} \quad \boxed{(6, 2)}", ["(2, 2)", "(6, 2)"]),
        (r"\boxed{1},\boxed{2},\boxed{3}", ["1", "2", "3"]),
        (r"so $y_1 = \boxed{2}$ and $y_2 = \boxed{3}$.", ["y_1 = 2", "y_2 = 3"]),
        (r"\(x=\boxed{1}\), \(y=\boxed{2}\)", ["x = 1", "y = 2"]),
        (r"\alpha = \boxed{1},\; \beta_{2}' = \boxed{2}", [r"\alpha = 1", r"\beta_{2}' = 2"]),
        (r"2x = \boxed{4}, y = \boxed{3}", ["4", "y = 3"]),  # 2x is no label
        (r"x = \boxed{x=5}, \boxed{6}", ["x=5", "6"]),
        (r"\boxed{1} \text{ or } \boxed{2}", ["1", "2"]),
        (r"\boxed{1} \\ \boxed{2}", ["1", "2"]),
        (r"x = \boxed{5}", ["5"]),  # a single box is read as is, without its label
        (r"\boxed{4}, no wait: \boxed{5}", ["5"]),  # words end the run
        (r"\boxed{1} andy \boxed{2}", ["2"]),
        (r"\boxed{(3, 3)} \text{ for part (a) and } \boxed{(1, 1)}", ["(3, 3)", "(1, 1)"]),
        (r"(a) \boxed{3}; (b) \boxed{5}", ["3", "5"]),
        (r"\boxed{1} papers and \boxed{2} bins", ["1", "2"]),  # a unit word before "and"
        (r"\boxed{1} no and \boxed{2}", ["2"]),  # ... but not a word that takes it back
        (r"\boxed{1} b \boxed{2}", ["2"]),  # a bare letter is no part label
        (r"\boxed{1} for \boxed{2}", ["2"]),
        (r"\boxed{}, \boxed{2}", ["2"]),  # an empty box ends the run
        (r"\fbox{\boxed{3}}", ["3"]),  # a box around the last one is not before it
        (r"\boxed{1}, \boxed{2", None),  # the last box is malformed: no answer
        (r"\boxed{1}" + " " * 200 + r"\boxed{2}", ["2"]),  # too far apart
        ("no answer", None),
    ],
)
def test_final_boxes(text, boxes):
    assert final_boxes(text) == boxes


def test_final_boxes_is_bounded_by_max_chars():
    t0 = time.monotonic()
    boxes = final_boxes(r"\boxed{1}, " * 200_000 + r"\boxed{2}", max_chars=1000)
    assert time.monotonic() - t0 < 1.0
    assert boxes[-1] == "2" and len(", ".join(boxes)) <= 1000


# (gold, completion): right answers in the forms models write.
CORRECT = [
    (r"\frac{\sqrt{3}}{2}", r"Hence \boxed{\frac{\sqrt3}{2}}."),
    (r"(0,1]", r"The set is \boxed{(0,1]}"),
    (r"(0,1]", r"\boxed{(0, 1]}"),
    (r"x^2+2x+1", r"\boxed{(x+1)^2}"),
    (r"\dfrac{1}{2}", r"\boxed{0.5}"),
    (r"0.5", r"\boxed{\frac12}"),
    (r"\text{(B)}", r"\boxed{B}"),
    (r"\text{(B)}", r"\boxed{\textbf{(B)}}"),
    (r"-3", r"\boxed{-3}"),
    (r"-\frac{1}{2}", r"\boxed{-0.5}"),
    (r"2\sqrt{2}", r"\boxed{\sqrt{8}}"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"\boxed{(3, \pi/2)}"),
    (r"[-2,7)", r"\boxed{[-2,7)}"),
    (r"(-\infty, 3)", r"\boxed{(-\infty,3)}"),
    (r"10\%", r"\boxed{10}"),
    (r"90^\circ", r"\boxed{90}"),
    (r"\$18.90", r"\boxed{18.9}"),
    (r"1,000", r"\boxed{1000}"),
    (r"5, 7", r"\boxed{7, 5}"),
    (r"\{1,2\}", r"\boxed{\{2, 1\}}"),
    (r"\text{Devon}", r"\boxed{Devon}"),
    (r"0.\overline{3}", r"\boxed{\frac13}"),
    (r"\frac{1}{6}", r"\boxed{0.1\overline{6}}"),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}"),
    (r"y=2x+3", r"\boxed{y = 3 + 2x}"),
    ("5", r"so $x = \boxed{x=5}$"),
    ("5", r"first \boxed{4}, no wait: \boxed{5}"),
    (5, r"\boxed{5}"),  # a numeric answer column
]


@pytest.mark.parametrize("gold, completion", CORRECT)
def test_correct_answers_score_one(gold, completion):
    assert boxed_accuracy({"id": "p", "answer": gold}, completion) == 1.0


@pytest.mark.parametrize(
    "gold, completion",
    [
        (r"\frac{\sqrt{3}}{2}", r"\boxed{\frac{\sqrt2}{2}}"),
        (r"(0,1]", r"\boxed{[0,1]}"),
        (r"x^2+2x+1", r"\boxed{x^2+1}"),
        (r"\text{(B)}", r"\boxed{C}"),
        (r"(3,-1)", r"\boxed{(-1,3)}"),  # a point is ordered
        (r"-3", r"\boxed{3}"),
        (r"\frac{1}{3}", r"\boxed{0.333}"),  # too coarse an approximation
        (r"0.\overline{3}", r"\boxed{\frac14}"),
        ("5", r"\boxed{5} is wrong, it is \boxed{4}"),  # the LAST box counts
        ("5", r"\boxed{5} then \boxed{"),  # ... even when it is unfinished
        ("5", "5"),  # no box
        ("5", r"\boxed{}"),
    ],
)
def test_wrong_answers_score_zero(gold, completion):
    assert boxed_accuracy({"id": "p", "answer": gold}, completion) == 0.0


# Issue 24: right answers that the last box alone, or math-verify on the raw box, scored 0.
# (gold, completion, near misses: golds this completion must NOT match).
RUNS_OF_BOXES = [
    (r"(2, 2), (6, 2)", r"\boxed{(2, 2)} \quad \text{and} \quad \boxed{(6, 2)}",
     [r"(2, 2)", r"(6, 2)", r"(2, 2), (2, 6)"]),
    (r"(2, 2), (6, 2)", r"\boxed{(2, 2)}\text{, }\boxed{(6, 2)}", [r"(2, 2), (6, 3)"]),
    (r"\{1,2,3\}", r"\boxed{1},\boxed{2},\boxed{3}", [r"\{1,2\}", "3", r"\{1,2,4\}"]),
    (r"y_1 = 2, y_2 = -3", r"so $y_1 = \boxed{2}$ and $y_2 = \boxed{-3}$",
     [r"y_1 = -3, y_2 = 2", "2", r"y_1 = 2, y_2 = 3"]),
    (r"(2, -3)", r"$y_1 = \boxed{2}$ and $y_2 = \boxed{-3}$", [r"(-3, 2)", r"(2, 3)"]),
    (r"2, -3", r"y_1 = \boxed{2} \text{ and } y_2 = \boxed{-3}", ["2", "2, 3"]),
    (r"x = 1, y = 2", r"\(x = \boxed{1}\), \(y = \boxed{2}\)", [r"x = 2, y = 1"]),
    (r"3, 5", r"x = \boxed{3} or x = \boxed{5}", ["5", "3", "3, 4"]),
    (r"-1, 4", r"\boxed{-1}; \boxed{4}", ["-1", "1, 4"]),
    (r"\frac{1}{2}, 2", r"$\boxed{\frac{1}{2}}$, $\boxed{2}$.", ["2", r"\frac{1}{2}, 3"]),
    (r"-2, 2", r"\boxed{-2} , \text{or} \, \boxed{2}", ["2", "-2, 3"]),
    (r"1, 2", r"\boxed{1}\qquad\boxed{2}", ["1", "2, 3"]),
]
TRAILING_PUNCTUATION = [
    ("42", r"\boxed{42.}", ["4", "42.1"]),
    (r"\sqrt{2}", r"\boxed{\sqrt{2}.}", [r"\sqrt{3}", "2"]),
    (r"(1,2)", r"\boxed{(1,2).}", [r"(2,1)", r"[1,2]"]),
    ("5", r"\boxed{5 \text{ cm}.}", ["6", "50"]),
    ("7", r"\boxed{7,}", ["17"]),
    ("7", r"\boxed{7; }", ["-7"]),
]
DIGIT_GROUPS = [
    ("1000", r"\boxed{1 000}", ["0", "1", "100", "10000"]),
    ("1000", r"\boxed{1\,000}", ["0", "1"]),
    ("1000", r"\boxed{1~000}", ["0", "1"]),
    ("12345678", r"\boxed{12\ 345\ 678}", ["0", "1035", "12345"]),
    ("3000", r"\boxed{3 \, 000}", ["0", "3"]),  # math mode ignores the spaces
    ("1000000", r"\boxed{1 000 000}", ["0", "1000"]),
    ("1000.5", r"\boxed{1 000.5}", ["0", "1000"]),
    (r"10\,000", r"\boxed{10000}", ["0", "10"]),  # the rule reads gold answers too
    (r"-1\,500", r"\boxed{-1500}", ["0", "1500"]),
    (r"\$12 500", r"\boxed{12500}", ["0", "6000"]),
    # What the rule must leave alone: a pair, an operator, a point, a matrix's rows.
    ("1,22", r"\boxed{1,22}", ["122", "12.2"]),
    ("200", r"\boxed{2 \times 100}", ["2100", "0"]),
    ("(1, 0)", r"\boxed{(1, 000)}", ["1000", "(1, 1)"]),
    (r"\begin{pmatrix} 100 \\ 200 \end{pmatrix}", r"\boxed{\begin{pmatrix}100\\200\end{pmatrix}}",
     [r"\begin{pmatrix} 100200 \end{pmatrix}"]),
]
# Decimal commas where the other side is one number; thousands groupings stay thousands.
DECIMAL_COMMAS = [
    ("1.22", r"\boxed{1,22}", ["122", "1.2", "12.2"]),  # (1, 22) matches too: the pair reading
    ("1,22", r"\boxed{1.22}", ["122", "1.2"]),  # a gold written with the comma
    ("0.111", r"\boxed{0,111}", ["111", "0.11"]),
    ("1000.99", r"\boxed{1000,99}", ["100099", "1000"]),
    ("-2.5", r"\boxed{-2,5}", ["2.5", "-25"]),
    ("1000", r"\boxed{1,000}", ["1", "1.0", "0"]),  # 3 digits after the comma: thousands
]
# Relations in words, inside \text{} or bare; symbols math-verify already reads stay read.
RELATIONS_IN_WORDS = [
    (r"x \geq 5", r"\boxed{x \text{ is at least } 5}", [r"x \leq 5", "x > 5", "5"]),
    ("x > 5", r"\boxed{x \text{ greater than } 5}", ["x < 5", r"x \geq 5"]),
    (r"x \leq 4", r"\boxed{x \text{ is less than or equal to } 4}", ["x < 4", r"x \geq 4"]),
    (r"x \leq 4", r"\boxed{x \text{ no more than } 4}", [r"x \geq 4"]),
    ("x < 3", r"\boxed{x \textless 3}", ["x > 3", r"x \leq 3"]),
    (r"x \neq 3", r"\boxed{x \not= 3}", ["x = 3", r"x \neq 2"]),
    (r"x \neq 3", r"\boxed{x \text{ not equal to } 3}", ["x = 3"]),
    ("x >= 5", r"\boxed{x \geq 5}", [r"x \leq 5"]),
    ("x < 3", r"\boxed{x \lt 3}", ["x > 3"]),
    ("x != 3", r"\boxed{x \neq 3}", ["x = 3"]),
    (r"x \le 2", r"\boxed{x \leq 2}", [r"x \geq 2"]),
]
# Answers split over boxes, one per part, or each followed by what it counts.
PARTS = [
    ("(3, 3), (1, 1)", r"$$\boxed{(3, 3)} \text{ for part (a) and } \boxed{(1, 1)}$$", ["(3, 3)", "(1, 1)", "(3, 3), (1, 2)"]),
    ("3, 5", r"(a) \boxed{3}, (b) \boxed{5}", ["5", "3, 6"]),
    (r"\{1, 2\}", r"\boxed{1} papers and \boxed{2} bins", ["2", r"\{1, 3\}"]),
    ("2, 4", r"\boxed{2} \text{(i)}, \boxed{4} \text{(ii)}", ["4"]),
]
ISSUE_24 = RUNS_OF_BOXES + TRAILING_PUNCTUATION + DIGIT_GROUPS + DECIMAL_COMMAS + RELATIONS_IN_WORDS + PARTS
# Golds that no right answer above equals: every right answer is re-run against them.
WRONG_GOLDS = ["0", "7", "-1", r"\{0\}", "(0, 0)", r"\text{(E)}"]


@pytest.mark.parametrize("gold, completion, near_misses", ISSUE_24)
def test_issue_24_readings_score_one(gold, completion, near_misses):
    assert boxed_accuracy({"id": "p", "answer": gold}, completion) == 1.0


def _false_positive_cases() -> list[tuple[str, str]]:
    cases = [(wrong, completion) for _, completion, near_misses in ISSUE_24 for wrong in near_misses]
    everything = [(str(gold), completion) for gold, completion in CORRECT]
    everything += [(gold, completion) for gold, completion, _ in ISSUE_24]
    cases += [(wrong, completion) for gold, completion in everything for wrong in WRONG_GOLDS if wrong != gold]
    return cases


@pytest.mark.parametrize("wrong_gold, completion", _false_positive_cases())
def test_right_answers_do_not_match_wrong_golds(wrong_gold, completion):
    # The guard on the readings: each makes more answers parse, none may make one match more.
    assert boxed_accuracy({"id": "p", "answer": wrong_gold}, completion) == 0.0


@pytest.mark.parametrize(
    "gold, completion",
    [
        ("5", r"\boxed{3 \text{ or } 5}"),  # a hedge inside one box
        ("5", r"\boxed{3} or \boxed{5}"),  # ... or across boxes: a set of two is not 5
        ("5", r"\boxed{3}, \boxed{4}, \boxed{5}"),
        ("1", r"\boxed{1}, \boxed{2}"),  # a joined set against a single-number gold
        (r"\{1,2\}", r"\boxed{1}, \boxed{2}, \boxed{3}"),
        (r"x = 2, y = 3", r"$x = \boxed{3}$ and $y = \boxed{2}$"),  # labels are kept
        ("2", r"\boxed{2}, or maybe \boxed{3}"),  # words end the run: the last box counts
        ("0", r"\boxed{1 000}"),  # was a false positive: math-verify read 1·000
        ("0", r"\boxed{1\,000}"),
        ("1.22", r"\boxed{1}, \boxed{22}"),  # two boxes are two numbers, never a decimal
        (r"\{1, 2\}", r"\boxed{1} no no no no no \boxed{2}"),  # words, not a part or a unit: the last box only
        ("4, 5", r"\boxed{4} maybe or \boxed{5}"),
    ],
)
def test_hedges_and_misreadings_score_zero(gold, completion):
    assert boxed_accuracy({"id": "p", "answer": gold}, completion) == 0.0


@pytest.mark.parametrize(
    "completion, answer",
    [
        (r"\boxed{42.}", "42"),
        (r"\boxed{42.,}", "42."),  # one mark only
        (r"\boxed{1, 2, ...}", "1, 2, ..."),  # an ellipsis is kept
        (r"\boxed{1, 2, \ldots}", r"1, 2, \ldots"),
        (r"\boxed{5\;}", r"5\;"),  # a LaTeX space, not a semicolon
        (r"\boxed{5\,}", r"5\,"),
        (r"\boxed{1},\boxed{2}.", "1, 2"),
        (r"\boxed{1.}, \boxed{2;}", "1, 2"),
        (r"\boxed{", None),
    ],
)
def test_read_answer(completion, answer):
    assert read_answer(completion) == answer


def test_format_reward():
    assert boxed_format({}, r"\boxed{x}") == 1.0
    assert boxed_format({}, "x") == 0.0 and boxed_format({}, r"\boxed{") == 0.0


def test_bad_rows_raise_naming_the_problem():
    with pytest.raises(KeyError, match="'p9' has no 'answer'"):
        boxed_accuracy({"id": "p9"}, r"\boxed{1}")
    with pytest.raises(ValueError, match="gold answer '' does not parse"):
        boxed_accuracy({"id": "p9", "answer": ""}, r"\boxed{1}")


ADVERSARIAL = [
    r"\boxed{9^{9^{9^9}}}",
    r"\boxed{99999999!}",
    r"\boxed{" + r"\frac{1}{" * 100_000 + "2" + "}" * 100_001,  # ~1 MB of nested \frac
    r"\boxed{" + "{" * 10_000,  # unbalanced
    r"\boxed{" + "9" * 900 + "}",
    r"\boxed{5} " + r"\boxed{" + "5+" * 100_000 + "0}",  # a good box, then a huge one
]


def test_adversarial_inputs_finish_in_bounded_time():
    items = [({"id": f"adv{i}", "answer": "5"}, text) for i, text in enumerate(ADVERSARIAL)]
    items.append(({"id": "ok", "answer": "5"}, r"\boxed{5}"))
    t0 = time.monotonic()
    result = score_batch("rewards/math.py:boxed_accuracy", items, timeout_s=2, workers=2,
                         search_dirs=[str(REPO)])
    # 7 checks on 2 workers, each ≤ 2 s (math-verify's own limit or the pool's kill),
    # plus start-up: far below 30 s even on a loaded machine.
    assert time.monotonic() - t0 < 30
    assert result.scores == [0.0] * len(ADVERSARIAL) + [1.0]
    assert all(s < 5 for s in result.check_seconds)  # killed at 2 s, give or take a loaded machine


def test_weighted_accuracy_and_format_through_the_pool():
    terms = [RewardTerm("rewards.math:boxed_accuracy", 1.0), RewardTerm("rewards.math:boxed_format", 0.1)]
    items = [({"id": 1, "answer": "2"}, r"\boxed{2}"), ({"id": 2, "answer": "2"}, r"\boxed{3}"),
             ({"id": 3, "answer": "2"}, "2")]
    result = score_batch(terms, items, timeout_s=60, workers=1, search_dirs=[str(REPO)])
    assert result.scores == pytest.approx([1.1, 0.1, 0.0])
    assert result.term_scores["rewards.math:boxed_accuracy"] == [1.0, 0.0, 0.0]
