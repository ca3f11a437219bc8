"""The long-context task of ``build_tiny_model.py --task lookup``: two values looked up in a table.

    >>> table = dict(zip(KEYS, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]))
    >>> solve(table, ["c", "k"])
    'read c4, k5, 4+5=9 \\\\boxed{9}'

The shape agentic RL has (Tree Training's setting): a long context every answer shares — the
prompt holds a table of 26 one-digit entries (86 prompt tokens with the chat template) — and a
short decision after it (~20 answer tokens): which two entries to read, then their sum. A
rollout tree of this task is mostly shared prefix: tree packing computes the table once per
prompt where linear training computes it once per answer.

The format is chosen so that a 0.9M-parameter model can learn the lookup at all. Every key is
written with a space before it (" c" in the table, the question and the answer alike), so the
byte-level tokenizer gives a key one token wherever it appears; values are one digit (one token)
and follow their key directly, so reading an entry is copying the token that followed the key in
the table (one induction step). Measured with the default recipe (4 layers of 128, 16 keys then):
a first format ("a=12 ... What is c+k?", two-digit values, keys glued to "+") stayed at ~2% greedy
accuracy after 2,500 warm-up steps; "a=6 ... What is c + k?" (one-digit values behind "=") at
~7%, chance, after 2,000; "a6 ... What is c + k?" learned to read after ~400 steps. With 26 keys
and both reads slipping (below) the reading forms after ~850 steps; the builder runs 3,000.

``corrupt``: the warm-up's data teaches a policy that slips. Each read of a corrupted solution
takes the neighbouring entry's value (the next key's) and carries it through the sum, so the
answer reads as a plausible worked one that is wrong. Reads slip independently; above 0.5 (the
builder's default for this task is 0.55) a fully trained warm-up prefers the wrong read at both
decisions: the built model is right on 19.5% of the test problems greedily and on 27.1% sampled.
The slip is a preference RL can reverse, and the two read tokens are where a tree should fork.
"""

from __future__ import annotations

import random
from collections.abc import Collection

from cot_task import distinct_problems

KEYS = "abcdefghijklmnopqrstuvwxyz"  # the table's keys, in order; values are one digit


def solve(table: dict[str, int], asked: list[str], misread: Collection[int] = ()) -> str:
    """The worked answer; the asked entries at the indices in ``misread`` are read from the next key's value."""
    values = []
    for i, key in enumerate(asked):
        source = KEYS[(KEYS.index(key) + 1) % len(KEYS)] if i in misread else key
        values.append(table[source])
    reads = ", ".join(f"{k}{v}" for k, v in zip(asked, values))
    total = sum(values)
    return f"read {reads}, {'+'.join(map(str, values))}={total} \\boxed{{{total}}}"


def make_problem(rng: random.Random, index: int, corrupt: float) -> dict[str, str]:
    """A fresh table and two distinct keys; the solution misreads each entry with probability ``corrupt``."""
    table = {k: rng.randint(0, 9) for k in KEYS}
    asked = rng.sample(KEYS, 2)
    misread = [i for i in range(2) if rng.random() < corrupt]
    listing = " ".join(f"{k}{v}" for k, v in table.items())
    return {"id": f"lookup-{index}", "prompt": f"Table: {listing}. What is {asked[0]} + {asked[1]}?",
            "answer": str(table[asked[0]] + table[asked[1]]), "solution": solve(table, asked, misread)}


def make_problems(seed: int, count: int, corrupt: float) -> list[dict[str, str]]:
    """``count`` distinct problems in a seeded order."""
    return distinct_problems(lambda rng, index: make_problem(rng, index, corrupt), seed, count)
