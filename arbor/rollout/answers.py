"""Find the final answer of a completion: the content of its last ``\\boxed{...}``.

    last_boxed(r"so x = \\boxed{\\frac{1}{2}}.")   # '\\frac{1}{2}'
    last_boxed(r"\\boxed{1}, no: \\boxed{2}")       # '2': only the last box counts
    last_boxed(r"\\boxed{1} then \\boxed{2")         # None: the last box is unbalanced
    final_boxes(r"$x = \\boxed{1}$ and $y = \\boxed{2}$")   # ['x = 1', 'y = 2']

Used by the reward functions (``rewards/math.py``) and by the sampler's "final answer"
test, so it lives in arbor (which must not import the top-level ``rewards/`` examples).

Only the *last* ``\\boxed``/``\\fbox`` counts. If it is malformed (no brace, unbalanced,
or longer than ``max_chars``) the completion has no answer; we do not fall back to an
earlier box. Two reasons: the sampler calls this on text still being generated, where a
half-written ``\\boxed{12`` must not count as finished because of an earlier box; and a
model should not be able to hedge with a good early box followed by junk.

:func:`final_boxes` extends that last box backwards over a *run*: boxes that only
separators divide (``\\boxed{(2,2)} \\quad\\text{and}\\quad \\boxed{(6,2)}``,
``\\boxed{1},\\boxed{2}``) together state one answer — a list of solutions, a pair of
coordinates. So do part labels (``(a) \\boxed{3}, (b) \\boxed{5}``) and one word naming
what a box counts (``\\boxed{1} papers and \\boxed{2} bins``). Any other text between two boxes (``\\boxed{4}, no wait: \\boxed{5}``) ends
the run, so an earlier box still never counts on its own.

A scanner of our own rather than a regex: braces nest (``\\boxed{\\frac{a}{b}}``), and a
regex over a megabyte completion full of unbalanced braces can go quadratic. The cost is
one backwards ``rfind`` per command plus at most ``max_chars`` characters scanned; a run
adds the same per extra box, in a window of ``max_chars`` + ``_MAX_GAP`` characters.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_COMMANDS = ("\\boxed", "\\fbox")

# What may stand between two boxes of one run, or between a label and its box.
_DELIMITER = r"\$|\\[()\[\]]"  # $ … $, \( … \), \[ … \]
# The part a box answers: (a), (ii), part (b), for part (a) — parenthesised, so that a
# lone letter between boxes (a hedge, a variable) still ends the run.
_PART = r"(?:for\s+)?(?:part\s+)?\((?:[a-z]|[ivx]{1,4}|\d)\)"
_CONJUNCTION = r"(?<![A-Za-z])(?:and|or)(?![A-Za-z])"
_SEPARATOR = "|".join([
    r"\s", r"[,;~]", _DELIMITER,
    r"\\[,;:! ]",  # \, \; \: \! and "\ " (LaTeX spaces)
    r"\\(?:q?quad|enspace|thinspace)(?![A-Za-z])",
    r"\\\\",  # a line break between the lines of a display
    _CONJUNCTION, _PART,
    rf"\\(?:text|textrm|textnormal|mbox|mathrm)\s*\{{(?:[\s,;:~.]|{_CONJUNCTION}|{_PART})*\}}",
])
# One word right after a box and before a conjunction names what it counts
# (``\boxed{1} papers and \boxed{2} bins``); words that take an answer back do not.
_UNIT = r"(?:\s*(?!(?:no|not|wait|maybe|but|actually|and|or)(?![A-Za-z]))[A-Za-z]{1,15}(?![A-Za-z])" \
        rf"(?=\s*(?:[,;]|{_CONJUNCTION})))?"
# A label names the value of the box after it: x, y_1, x_{12}, \alpha, a' — then "=".
# It is kept (``y_1 = 2``): dropping it would let x = 3, y = 2 match a gold x = 2, y = 3.
_LABEL = r"(?P<label>(?:[A-Za-z]|\\[A-Za-z]+)(?:_(?:[A-Za-z0-9]|\{[A-Za-z0-9]+\}))?'*)\s*="
_GAP = re.compile(rf"{_UNIT}(?:{_SEPARATOR})*(?:{_LABEL}(?:\s|{_DELIMITER})*)?")
# Before the first box of a run, a label must not end a longer name or product (2x = …).
_LEADING_LABEL = re.compile(rf"(?<![A-Za-z0-9\\_^}}]){_LABEL}(?:\s|{_DELIMITER})*\Z")
# Longest gap read between two boxes: separators and a label take a few dozen characters.
_MAX_GAP = 100


class _Box(NamedTuple):
    start: int  # index of the command's backslash
    end: int  # index just past the closing brace
    content: str


def last_boxed(text: str, max_chars: int = 10_000) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), or None if it is malformed.

    Content longer than ``max_chars`` counts as no answer: no real answer is that long,
    and huge "answers" are adversarial inputs that only make checkers hang.
    """
    box = _last_box(text, 0, len(text), max_chars)
    return None if box is None else box.content


def final_boxes(text: str, max_chars: int = 10_000) -> list[str] | None:
    """Contents of the final run of boxes, in order, each with its label; None as last_boxed.

    ``final_boxes(r"\\boxed{1},\\boxed{2}") == ["1", "2"]``,
    ``final_boxes(r"y_1 = \\boxed{2} and y_2 = \\boxed{3}") == ["y_1 = 2", "y_2 = 3"]``,
    ``final_boxes(r"\\boxed{4}, no: \\boxed{5}") == ["5"]``. A single box is returned as is
    (no label added). The run stops at an empty box and where the contents together
    would pass ``max_chars``.
    """
    last = _last_box(text, 0, len(text), max_chars)
    if last is None:
        return None
    run = [last]  # walked backwards: the last box first
    labels: list[str | None] = []  # labels[i] labels run[i]; it stands in the gap before it
    total = len(last.content)
    while True:
        after = run[-1]
        # The window holds any box that could end close enough: `\boxed` + braces = 8 characters.
        box = _last_box(text, max(0, after.start - _MAX_GAP - max_chars - 8), after.start, max_chars)
        if box is None or box.end > after.start or after.start - box.end > _MAX_GAP:
            break  # no earlier box, one around this one (\fbox{\boxed{3}}), or too far
        gap = _GAP.fullmatch(text, box.end, after.start)
        total += len(box.content) + 2  # + a separator once the reward joins them
        if gap is None or not box.content.strip() or total > max_chars:
            break
        labels.append(gap["label"])
        run.append(box)
    if len(run) == 1:
        return [last.content]
    lead = _LEADING_LABEL.search(text, max(0, run[-1].start - _MAX_GAP), run[-1].start)
    labels.append(lead["label"] if lead else None)
    # A box that states its own equation (x = \boxed{x = 5}) needs no label.
    return [box.content if label is None or "=" in box.content else f"{label} = {box.content}"
            for box, label in zip(reversed(run), reversed(labels))]


def _last_box(text: str, lo: int, hi: int, max_chars: int) -> _Box | None:
    """The last box whose command starts in ``text[lo:hi]``, or None if it is malformed."""
    start, command = max((text.rfind(c, lo, hi), c) for c in _COMMANDS)
    if start < 0:
        return None
    i = start + len(command)
    while i < len(text) and text[i] in " \t":  # `\boxed {x}` is valid LaTeX
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    close = _closing_brace(text, i, max_chars)
    return None if close is None else _Box(start, close + 1, text[i + 1 : close])


def _closing_brace(text: str, open_at: int, max_chars: int) -> int | None:
    """Index of the ``}`` that matches ``text[open_at] == "{"``, or None."""
    depth = 0
    j = open_at
    stop = min(len(text), open_at + max_chars + 2)  # +2: the two braces themselves
    while j < stop:
        ch = text[j]
        if ch == "\\":
            j += 2  # `\{`, `\}` and `\\` are escapes, not group delimiters
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return j
        j += 1
    return None


def has_final_answer(text: str) -> bool:
    """True when the text ends its reasoning with a non-empty, well-formed boxed answer."""
    answer = last_boxed(text)
    return answer is not None and answer.strip() != ""
