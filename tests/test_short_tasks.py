"""scripts/short_tasks.py (the short-answer tasks of configs/smollm2_rl.yaml) and
rewards/short_answer.py (their reward)."""

import json
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import short_tasks  # noqa: E402

from rewards.short_answer import last_number, number_answer  # noqa: E402


@pytest.mark.parametrize("completion,expected", [
    ("12", 1.0), ("12.", 1.0), ("The answer is 12.", 1.0), ("7 + 5 = 12", 1.0), (" 12\n", 1.0), ("12.0", 1.0),
    ("12 apples, or 13", 0.0),  # the last number is the answer given
    ("x12", 0.0), ("12b", 0.0),  # digits inside a word are not a number
    ("twelve", 0.0), ("", 0.0), ("1,2", 0.0), ("121", 0.0), ("-12", 0.0),
])
def test_the_last_number_written_is_the_answer(completion, expected):
    assert number_answer({"id": "p", "answer": "12"}, completion) == expected


def test_last_number_and_a_gold_answer_that_is_not_a_number():
    assert last_number("3 + 4.5 = 7.5, so 7.5.") == "7.5" and last_number("none") is None
    with pytest.raises(ValueError, match=r"problem 'p7': answer 'twelve' is not a number"):
        number_answer({"id": "p7", "answer": "twelve"}, "12")


@pytest.mark.parametrize("task", sorted(short_tasks.TASKS))
def test_every_task_s_answer_is_its_question_s(task):
    """Each generator's gold answer, recomputed from the numbers in its question."""
    rng = random.Random(task)
    for _ in range(50):
        question, answer = short_tasks.TASKS[task](rng)
        assert isinstance(answer, int) and 0 <= answer < 1000, (question, answer)
        numbers = [int(n) for n in __import__("re").findall(r"\d+", question)]
        if task in ("add1", "add2"):
            assert answer == numbers[0] + numbers[1]
        elif task == "sub2":
            assert answer == numbers[0] - numbers[1] > 0
        elif task in ("mul1", "mul12"):
            assert answer == numbers[0] * numbers[1]
        elif task == "larger":
            assert answer == max(numbers)
        elif task == "smallest3":
            assert answer == min(numbers)
        elif task == "compare":
            assert answer == (max(numbers) if "larg" in question else min(numbers))
        elif task == "next_number":
            assert answer == numbers[0] + 1
        elif task == "sequence_step":
            assert answer - numbers[-1] == numbers[1] - numbers[0]
        elif task == "count_letter":
            letter, word = __import__("re").findall(r"'(\w+)'", question)
            assert answer == word.count(letter) >= 1


def test_write_gives_disjoint_splits_and_the_same_bytes_again(tmp_path):
    for out in (tmp_path / "a", tmp_path / "b"):
        short_tasks.write("add2", out, train=300, test=100, seed=0)
    train = [json.loads(line) for line in (tmp_path / "a" / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (tmp_path / "a" / "test.jsonl").read_text().splitlines()]
    assert len(train) == 300 and len(test) == 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert len({r["id"] for r in train + test}) == 400
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_a_task_with_too_few_prompts_says_so():
    with pytest.raises(SystemExit, match="add1 has fewer than 100 distinct new prompts"):
        short_tasks.draw("add1", 100, seed=0)
    assert len(short_tasks.draw("add1", 100, seed=0, strict=False)) == 81


def test_the_committed_data_is_what_the_script_writes(tmp_path):
    """data/short/compare/ (configs/smollm2_rl.yaml's data) is `short_tasks.py write compare`'s output."""
    short_tasks.write("compare", tmp_path, train=2000, test=400, seed=0)
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (REPO / "data" / "short" / "compare" / name).read_bytes()
