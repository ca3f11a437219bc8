"""Find the final answer of a completion: the content of its last ``\\boxed{...}``.

    last_boxed(r"so x = \\boxed{\\frac{1}{2}}.")   # '\\frac{1}{2}'
    last_boxed(r"\\boxed{1} then \\boxed{2")         # '1': the last one is unbalanced

Used by the reward functions and by the sampler's "final answer" early stop. A scanner
of our own rather than a regex: braces nest (``\\boxed{\\frac{a}{b}}``), and a
regex over a megabyte completion with many unbalanced braces can go quadratic.
"""

from __future__ import annotations

_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str, max_chars: int = 10_000, max_tries: int = 16) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` (or ``\\fbox{...}``), or None.

    Searches backwards from the end, so the cost is linear in the text. Content longer
    than ``max_chars`` counts as no answer (no real answer is that long; huge answers are
    adversarial and only make checkers hang). At most ``max_tries`` candidates are scanned,
    so text made of many unbalanced ``\\boxed{`` costs O(max_tries · max_chars), not O(n²).
    """
    end = len(text)
    for _ in range(max_tries):
        start = max(text.rfind(cmd, 0, end) for cmd in _COMMANDS)
        if start < 0:
            return None
        content = _braced_after(text, start, max_chars)
        if content is not None:
            return content
        end = start  # unbalanced or oversized: try the previous one
    return None


def _braced_after(text: str, start: int, max_chars: int) -> str | None:
    cmd = next(c for c in _COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, min(len(text), i + max_chars + 2)):
        ch = text[j]
        if ch == "\\" and j + 1 < len(text) and text[j + 1] in "{}":
            continue  # an escaped brace \{ or \} does not nest
        if ch == "{" and (j == 0 or text[j - 1] != "\\"):
            depth += 1
        elif ch == "}" and (j == 0 or text[j - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def has_final_answer(text: str) -> bool:
    """True when the text holds a well-formed boxed answer (the TreePO "finished" test)."""
    answer = last_boxed(text)
    return answer is not None and answer.strip() != ""
