"""Find the final answer of a completion: the content of its last ``\\boxed{...}``.

    last_boxed(r"so x = \\boxed{\\frac{1}{2}}.")   # '\\frac{1}{2}'
    last_boxed(r"\\boxed{1}, no: \\boxed{2}")       # '2': only the last box counts
    last_boxed(r"\\boxed{1} then \\boxed{2")         # None: the last box is unbalanced

Used by the reward functions (``rewards/math.py``) and by the sampler's "final answer"
test, so it lives in arbor (which must not import the top-level ``rewards/`` examples).

Only the *last* ``\\boxed``/``\\fbox`` counts. If it is malformed (no brace, unbalanced,
or longer than ``max_chars``) the completion has no answer; we do not fall back to an
earlier box. Two reasons: the sampler calls this on text still being generated, where a
half-written ``\\boxed{12`` must not count as finished because of an earlier box; and a
model should not be able to hedge with a good early box followed by junk.

A scanner of our own rather than a regex: braces nest (``\\boxed{\\frac{a}{b}}``), and a
regex over a megabyte completion full of unbalanced braces can go quadratic. The cost is
one backwards ``rfind`` per command plus at most ``max_chars`` characters scanned.
"""

from __future__ import annotations

_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str, max_chars: int = 10_000) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), or None if it is malformed.

    Content longer than ``max_chars`` counts as no answer: no real answer is that long,
    and huge "answers" are adversarial inputs that only make checkers hang.
    """
    start, command = max((text.rfind(c), c) for c in _COMMANDS)
    if start < 0:
        return None
    i = start + len(command)
    while i < len(text) and text[i] in " \t":  # `\boxed {x}` is valid LaTeX
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    return _balanced_group(text, i, max_chars)


def _balanced_group(text: str, open_at: int, max_chars: int) -> str | None:
    """The text between ``text[open_at] == "{"`` and its matching ``}``, or None."""
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
                return text[open_at + 1 : j]
        j += 1
    return None


def has_final_answer(text: str) -> bool:
    """True when the text ends its reasoning with a non-empty, well-formed boxed answer."""
    answer = last_boxed(text)
    return answer is not None and answer.strip() != ""
