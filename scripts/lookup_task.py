"""The long-context task of ``build_tiny_model.py --task lookup``: two values looked up in a table.

    >>> table = dict(zip(KEYS, range(10, 26)))
    >>> solve(table, ["c", "k"])
    'c=12, k=20, 12+20=32 \\\\boxed{32}'

The shape agentic RL has (Tree Training's setting): a long context every answer shares — the
prompt holds a table of 16 two-digit entries (~110 prompt tokens with the chat template, one
digit per token) — and a short decision after it (~20 answer tokens): which two entries to
read, then their sum. A rollout tree of this task is mostly shared prefix: tree packing computes
the table once per prompt where linear training computes it once per answer.

``corrupt``: the warm-up's data teaches a policy that slips. A corrupted solution reads one of
the two entries from its neighbour in the table and carries that value through the sum, so it
reads as a plausible worked answer that is wrong.
"""

from __future__ import annotations

import random

from cot_task import distinct_problems

KEYS = "abcdefghijklmnop"  # the table's keys, in order; values are two-digit


def solve(table: dict[str, int], asked: list[str], misread: int | None = None) -> str:
    """The worked answer; ``misread`` (0 or 1) reads that asked entry from the next key's value."""
    values = []
    for i, key in enumerate(asked):
        source = KEYS[(KEYS.index(key) + 1) % len(KEYS)] if i == misread else key
        values.append(table[source])
    reads = ", ".join(f"{k}={v}" for k, v in zip(asked, values))
    total = sum(values)
    return f"{reads}, {'+'.join(map(str, values))}={total} \\boxed{{{total}}}"


def make_problem(rng: random.Random, index: int, corrupt: float) -> dict[str, str]:
    """A fresh table and two distinct keys; the solution misreads one entry with probability ``corrupt``."""
    table = {k: rng.randint(10, 99) for k in KEYS}
    asked = rng.sample(KEYS, 2)
    misread = rng.randrange(2) if rng.random() < corrupt else None
    listing = " ".join(f"{k}={v}" for k, v in table.items())
    return {"id": f"lookup-{index}", "prompt": f"Table: {listing}. What is {asked[0]}+{asked[1]}?",
            "answer": str(table[asked[0]] + table[asked[1]]), "solution": solve(table, asked, misread)}


def make_problems(seed: int, count: int, corrupt: float) -> list[dict[str, str]]:
    """``count`` distinct problems in a seeded order."""
    return distinct_problems(lambda rng, index: make_problem(rng, index, corrupt), seed, count)
