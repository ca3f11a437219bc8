"""The problems of ``envs/paged_lookup.py``: two entries of one page of a book, added.

    >>> page = "3141592653" * 5 + "58"                  # a3 b1 c4 d1 e5 f9 ... Z8
    >>> solve(page, ["c", "k"])
    'read c4, k3, 4+3=7 \\\\boxed{7}'
    >>> solve(page, ["c", "k"], misread=[1])            # k's neighbour l holds 1
    'read c4, k1, 4+1=5 \\\\boxed{5}'

A problem is a book of ``PAGES`` pages, each a table of the 52 keys a-z, A-Z with one-digit
values, a page to open ("Open page 3, then answer the question about it.") and two keys the
question names once the page is open ("What is K + d?"). The model opens the page with the
environment's tool (``open page 3``), reads the two entries from the page it gets back (~210
tokens) and adds them in ~20 tokens: the decisions come after the long observation, which is
where a rollout tree forks. The answer's format is
``scripts/lookup_task.py``'s, the format a 0.9M-parameter model learned to read a table in:
each key one token wherever it appears, its value the next token (one induction step).

``corrupt``: the warm-up's data teaches a policy that slips. Each read of a corrupted
solution takes the next key's value on the page (Z's neighbour is a) and carries it through
the sum, so the answer reads as a plausible worked one that is wrong. Reads slip
independently; above 0.5 a fully trained warm-up prefers the wrong line at both reads.

``questions``: several problems share one book and page (their keys differ). The warm-up
trains them as one tree, the page computed once (``scripts/build_paged_model.py``).

Rows (``data/paged-lookup/*.jsonl``): ``id``, ``prompt`` (what to open), ``answer`` (the sum,
for reward functions that want one), ``page``, ``keys`` and ``pages`` (one string of 52
digits per page), what the environment reads.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Collection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envs.paged_lookup import KEYS  # noqa: E402

PAGES = 4  # pages per book


def neighbour(key: str) -> str:
    """The key on the next line of the page (the slip of a corrupted read)."""
    return KEYS[(KEYS.index(key) + 1) % len(KEYS)]


def solve(page: str, asked: list[str], misread: Collection[int] = ()) -> str:
    """The worked answer from the page's digits; the asked keys at the indices in ``misread``
    are read from their neighbour's line."""
    values = [int(page[KEYS.index(neighbour(key) if i in misread else key)]) for i, key in enumerate(asked)]
    reads = ", ".join(f"{k}{v}" for k, v in zip(asked, values))
    total = sum(values)
    return f"read {reads}, {'+'.join(map(str, values))}={total} \\boxed{{{total}}}"


def open_call(page: int) -> str:
    """The model turn that opens ``page`` (what ``envs/paged_lookup.py`` answers with it)."""
    return f"open page {page}"


def make_problems(seed: int, count: int, corrupt: float, questions: int = 1) -> list[dict]:
    """``count`` problems in a seeded order, each ``questions`` in a row on one book and page
    (distinct keys each); each solution misreads each entry with probability ``corrupt``.
    Every book is drawn afresh (10^208 of them), so no two splits share a problem."""
    rng = random.Random(seed)
    problems: list[dict] = []
    while len(problems) < count:
        pages = ["".join(rng.choice("0123456789") for _ in KEYS) for _ in range(PAGES)]
        page = rng.randint(1, PAGES)
        for _ in range(min(questions, count - len(problems))):
            asked = rng.sample(KEYS, 2)
            misread = [i for i in range(2) if rng.random() < corrupt]
            values = pages[page - 1]
            problems.append({
                "id": f"paged-{len(problems)}", "prompt": f"Open page {page}, then answer the question about it.",
                "answer": str(sum(int(values[KEYS.index(k)]) for k in asked)), "page": page, "keys": asked,
                "pages": pages, "solution": solve(values, asked, misread),
            })
    return problems
