"""The chain-of-thought task of ``build_tiny_model.py --task cot``: column addition, worked.

    >>> solve([528173, 309468])
    '3+8+0=11, 7+6+1=14, 1+4+1=6, 8+9+0=17, 2+0+1=3, 5+3+0=8, \\\\boxed{837641}'

The model writes one column per clause, least significant digit first: the column's
digits, the carry coming in, and the column sum (whose last digit is the answer's digit
and whose tens are the next carry), then the answer in ``\\boxed{}``. Two six-digit
operands make ~65 answer tokens with the digit-per-token tokenizer: long enough that the
trees of a TreePO rollout share real prefixes, short enough for a CPU.

``corrupt``: the warm-up's data teaches a policy that slips. A corrupted solution gets one
column sum off by one and carries the slip on consistently (later carries, the boxed
answer), so its chain reads as a plausible worked answer that is wrong, never as noise.
"""

from __future__ import annotations

import random
from collections.abc import Callable

OPERANDS, DIGITS = 2, 6


def solve(operands: list[int], slip_column: int | None = None, slip: int = 0) -> str:
    """The worked answer; ``slip`` (±1) is added to column ``slip_column``'s sum (0 = units)."""
    width = max(len(str(x)) for x in operands)
    digits = [str(x).zfill(width)[::-1] for x in operands]  # [operand][column], units first
    carry, clauses, answer_digits = 0, [], []
    for column in range(width):
        terms = [d[column] for d in digits] + [str(carry)]
        total = sum(map(int, terms))
        if column == slip_column:
            total += slip if total + slip >= 0 else -slip  # a column of zeros slips up, not to -1
        clauses.append(f"{'+'.join(terms)}={total}")
        answer_digits.append(total % 10)
        carry = total // 10
    answer = str(carry) * (carry > 0) + "".join(map(str, reversed(answer_digits)))
    return ", ".join(clauses) + f", \\boxed{{{int(answer)}}}"


def make_problem(rng: random.Random, index: int, corrupt: float) -> dict[str, str]:
    """Two random six-digit operands; the solution slips with probability ``corrupt``."""
    operands = [rng.randint(10 ** (DIGITS - 1), 10**DIGITS - 1) for _ in range(OPERANDS)]
    slip_column, slip = None, 0
    if rng.random() < corrupt:
        slip_column, slip = rng.randrange(DIGITS), rng.choice([-1, 1])
    return {"id": f"cot-{index}", "prompt": f"What is {'+'.join(map(str, operands))}?",
            "answer": str(sum(operands)), "solution": solve(operands, slip_column, slip)}


def make_problems(seed: int, count: int, corrupt: float) -> list[dict[str, str]]:
    """``count`` distinct problems (no prompt twice, so seeded splits are disjoint)."""
    return distinct_problems(lambda rng, index: make_problem(rng, index, corrupt), seed, count)


def distinct_problems(make: Callable[[random.Random, int], dict[str, str]], seed: int,
                      count: int) -> list[dict[str, str]]:
    """``count`` problems from ``make(rng, index)``, each prompt once, in a seeded order
    (also the quickstart's a±b problems, ``build_tiny_model.make_problems``)."""
    rng, seen, problems = random.Random(seed), set(), []
    while len(problems) < count:
        problem = make(rng, len(problems))
        if problem["prompt"] not in seen:
            seen.add(problem["prompt"])
            problems.append(problem)
    return problems
