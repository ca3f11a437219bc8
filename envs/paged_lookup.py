"""A paged lookup: the answer sits on one page of a book that a tool opens, one page a call.

    rollout:
      env: envs/paged_lookup.py:PagedLookup
      env_args: {max_opens: 2}

An episode (``configs/paged_lookup.yaml``, data from ``scripts/paged_lookup_task.py``)::

    user       The book has 4 pages; to read one, write "open page" and its number. Open page 3, ...
    assistant  open page 3
    tool       Page 3 of 4 / - a4 / - b7 / ... / - Z2       (52 lines, ~210 tokens)
    user       What is K + d? Put the answer in \\boxed{}.
    assistant  read K7, d2, 7+2=9 \\boxed{9}

The environment holds the book (a problem's ``pages``: one string of 52 digits per page, the
values of :data:`KEYS` in order), the question (``page`` and two ``keys``) and what the episode
opened. Each model turn that asks ``open page N`` gets that page as a tool message, the first
one also the question (the user asks once the model has the page); a turn without a call
ends the episode, and its last ``\\boxed{}`` is the answer. It judges the episode itself
(:meth:`reward`): 1.0 when the answer is the sum of the two asked entries *and* the asked
page was opened — a lucky guess that never read the book scores 0, which a reward function
reading the final answer alone could not tell.

The page is the long observation every continuation after it shares: a rollout tree that
forks right after it (``rollout.root_fork: 1``, ``branch: 8``) samples, scores and trains
the page once per problem, where independent episodes carry it once each.

Forking copies the state (``fork = "copy"``): three small fields, and the book is shared
read-only between the copies. The environment is deterministic (no randomness, no clock), so
``replay`` forks reproduce it exactly too.
"""

from __future__ import annotations

import re
import string

from arbor import Message, Step, last_boxed

KEYS = string.ascii_lowercase + string.ascii_uppercase  # a page's entries, in this order
# Each key is written after a space (in the question, on the page, in the answer), so the
# tokenizer gives it one token everywhere and its value (one digit) is the next token.
INSTRUCTION = 'The book has {pages} pages; to read one, write "open page" and its number. '
OPEN = re.compile(r"open page (\d+)")


def question(keys: tuple[str, str] | list[str]) -> str:
    """What the user asks once a page is open.

    >>> question(["K", "d"])
    'What is K + d? Put the answer in \\\\boxed{}.'
    """
    return f"What is {keys[0]} + {keys[1]}? Put the answer in \\boxed{{}}."


def page_text(number: int, pages: list[str]) -> str:
    """Page ``number`` (1-based) as the tool shows it: a header, then one ``- <key><value>``
    line per key.

    >>> page_text(1, ["12" + "0" * 50])[:22]
    'Page 1 of 1\\n- a1\\n- b2\\n'
    """
    values = pages[number - 1]
    return f"Page {number} of {len(pages)}\n" + "\n".join(f"- {key}{value}" for key, value in zip(KEYS, values))


class PagedLookup:
    """One episode of a paged lookup (the :class:`arbor.Env` protocol)."""

    fork = "copy"

    def __init__(self, max_opens: int = 2) -> None:
        # A call past this many ends the episode unanswered: an episode that only
        # browses has a bounded length.
        self.max_opens = max_opens
        self.pages: list[str] = []
        self.page, self.keys = 0, ("", "")  # the question: two keys on one page
        self.opened: list[int] = []  # pages opened, in order
        self.calls = 0  # calls made, a page that does not exist included
        self.answer: str | None = None  # the final turn's last \boxed{} content

    def reset(self, problem: dict, seed: int) -> list[Message]:
        pages, page, keys = problem["pages"], problem["page"], problem["keys"]
        if not all(len(p) == len(KEYS) and p.isdigit() for p in pages):
            raise ValueError(f"problem {problem['id']}: 'pages' must be strings of {len(KEYS)} digits")
        if not 1 <= page <= len(pages) or len(keys) != 2 or not set(keys) <= set(KEYS):
            raise ValueError(f"problem {problem['id']}: 'page' {page!r} or 'keys' {keys!r} is not in the book")
        self.pages, self.page, self.keys = list(pages), int(page), (keys[0], keys[1])
        self.opened, self.calls, self.answer = [], 0, None
        return [{"role": "user", "content": INSTRUCTION.format(pages=len(pages)) + problem["prompt"]}]

    def step(self, history: list[Message]) -> Step:
        text = history[-1]["content"]
        call = OPEN.search(text)
        if call is None or self.calls >= self.max_opens:
            self.answer = last_boxed(text) if call is None else None
            return Step([], done=True)
        self.calls += 1
        number = int(call.group(1))
        if not 1 <= number <= len(self.pages):
            missing: Message = {"role": "tool", "content": f"There is no page {number}: the book has pages "
                                f"1 to {len(self.pages)}.", "error": True}
            return Step([missing])
        messages: list[Message] = [{"role": "tool", "content": page_text(number, self.pages)}]
        if not self.opened:  # the first page the model has: now the question
            messages.append({"role": "user", "content": question(self.keys)})
        self.opened.append(number)
        return Step(messages)

    def reward(self) -> float:
        values = self.pages[self.page - 1]
        gold = sum(int(values[KEYS.index(key)]) for key in self.keys)
        right = self.answer is not None and self.answer.strip() == str(gold)
        return float(right and self.page in self.opened)

    def copy(self) -> PagedLookup:
        twin = PagedLookup(self.max_opens)
        twin.pages, twin.page, twin.keys = self.pages, self.page, self.keys  # read-only: shared
        twin.opened, twin.calls, twin.answer = list(self.opened), self.calls, self.answer
        return twin

    def close(self) -> None:
        """Nothing to release: the book lives in memory."""
