"""Math rewards: the last ``\\boxed{}`` answer of a completion checked with math-verify.

Name them in a config as ``rewards/math.py:boxed_accuracy`` (or ``rewards.math:...`` when
running from the repository root). Gold answers are LaTeX as in MATH
(``\\frac{\\sqrt{3}}{2}``, ``(0,1]``, ``x^2+2x+1``, ``\\text{(B)}``): they are parsed as
if boxed, so bare LaTeX verifies against equivalent forms (``0.5`` = ``\\frac12``).

These run inside arbor's reward workers (a main thread, so math-verify's SIGALRM
timeouts work); the pool's hard timeout is the backstop for what signals cannot stop.
"""

from __future__ import annotations

import logging
from functools import lru_cache

from math_verify import LatexExtractionConfig, parse, verify

from arbor.answers import last_boxed

# math-verify's own limits, in whole seconds (floats are silently ignored by it).
PARSE_TIMEOUT_S = 2
VERIFY_TIMEOUT_S = 2
# No MATH answer is this long; longer "answers" are adversarial and only cost time.
MAX_ANSWER_CHARS = 1000

_LATEX = [LatexExtractionConfig()]


class _Truncate(logging.Filter):
    """math-verify logs the whole input on a timeout: megabyte lines. Keep 200 chars."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > 200:
            record.msg, record.args = f"{message[:200]}… [{len(message)} chars]", ()
        return True


for _name in ("math_verify.parser", "math_verify.grader", "math_verify.metric"):
    logging.getLogger(_name).addFilter(_Truncate())


@lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple:
    # Gold answers repeat across a tree's leaves: parse each once per worker.
    return tuple(parse(f"\\boxed{{{answer}}}", extraction_config=_LATEX, parsing_timeout=PARSE_TIMEOUT_S))


def boxed_accuracy(problem: dict, completion: str) -> float:
    """1.0 when the completion's last ``\\boxed{}`` equals ``problem["answer"]``, else 0.0."""
    if "answer" not in problem:
        raise KeyError(f"problem {problem.get('id')!r} has no 'answer' column")
    predicted = last_boxed(completion, max_chars=MAX_ANSWER_CHARS)
    if predicted is None or not predicted.strip():
        return 0.0
    gold = _parse_gold(str(problem["answer"]).strip())
    if not gold:
        raise ValueError(f"gold answer {str(problem['answer'])[:100]!r} does not parse")
    pred = parse(f"\\boxed{{{predicted}}}", extraction_config=_LATEX, parsing_timeout=PARSE_TIMEOUT_S)
    if not pred:
        return 0.0
    return 1.0 if verify(list(gold), pred, timeout_seconds=VERIFY_TIMEOUT_S) else 0.0


def boxed_format(problem: dict, completion: str) -> float:
    """1.0 when the completion ends its reasoning with a non-empty ``\\boxed{}`` answer."""
    predicted = last_boxed(completion, max_chars=MAX_ANSWER_CHARS)
    return 1.0 if predicted is not None and predicted.strip() else 0.0
