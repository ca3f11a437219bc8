"""Reward for short numeric answers (configs/smollm2_rl.yaml, scripts/short_tasks.py).

``number_answer`` pays 1.0 when the last whole number written in the completion equals
``problem["answer"]``: "12", "12.", "The answer is 12." and "7 + 5 = 12" all read as 12;
"12 apples, or 13" reads as 13. Numbers spelled as words ("twelve") are not read, and
digits inside a word ("x2") are not a number. No chain of thought is asked for, so the
last number written is the answer the model gave.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w])")


def last_number(completion: str) -> str | None:
    """The last whole or decimal number in ``completion`` as written, or None."""
    found = _NUMBER.findall(completion)
    return found[-1] if found else None


def number_answer(problem: dict, completion: str) -> float:
    """1.0 when the completion's last number equals ``problem["answer"]`` (a number), else 0.0."""
    found = last_number(completion)
    if found is None:
        return 0.0
    try:
        return float(float(found) == float(str(problem["answer"]).strip()))
    except ValueError as e:
        raise ValueError(f"problem {problem.get('id')!r}: answer {problem['answer']!r} is not a number") from e
