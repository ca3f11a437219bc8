"""Math rewards: the final ``\\boxed{}`` answer of a completion checked with math-verify.

Name them in a config as ``rewards/math.py:boxed_accuracy`` (or ``rewards.math:...`` when
running from the repository root):

    reward:
      functions:
        - {fn: rewards/math.py:boxed_accuracy, weight: 1.0}
        - {fn: rewards/math.py:boxed_format, weight: 0.1}

Gold answers are LaTeX as in MATH (``\\frac{\\sqrt{3}}{2}``, ``(0,1]``, ``x^2+2x+1``,
``\\text{(B)}``, ``10\\%``): they are parsed as if boxed, so bare LaTeX verifies against
equivalent forms (``0.5`` = ``\\frac12``, ``(x+1)^2`` = ``x^2+2x+1``). Repeating decimals
(``0.\\overline{3}``), which math-verify reads as text, are turned into fractions first.

What is read, and why (each case scored a right answer 0 before, a wrong signal):
- **The final run of boxes** (``arbor.final_boxes``): boxes that only separators
  divide — ``,`` ``;`` ``and`` ``or`` ``\\quad`` ``\\text{and}`` ``$`` … — are one answer,
  joined with ", ": ``\\boxed{(2,2)} \\quad\\text{and}\\quad \\boxed{(6,2)}`` reads
  ``(2,2), (6,2)``, a set. A label before a box (``y_1 = \\boxed{2}``: a letter or Greek
  letter, a subscript, primes, then ``=``) is kept, ``y_1 = 2``, so that swapped values do
  not match a labelled gold. A hedge gains nothing: math-verify compares a set with a
  single gold by size, so ``\\boxed{3} or \\boxed{5}`` (like ``\\boxed{3 \\text{ or } 5}``)
  against 5 scores 0. A part label between boxes (``\\boxed{(3,3)} \\text{ for part (a) and }
  \\boxed{(1,1)}``, ``(a) \\boxed{3}, (b) \\boxed{5}``) and one word naming what a box counts
  before ``and``/``,`` (``\\boxed{1} papers and \\boxed{2} bins``) are separators too.
  Any other text between boxes ends the run: only the last one counts.
- **One trailing** ``.`` ``,`` or ``;`` inside a box is dropped (``\\boxed{42.}``, which
  math-verify cannot parse); ``...`` and the LaTeX spaces ``\\,`` ``\\;`` are kept.
- **Digit groups**: a group of 1–3 digits followed by groups of exactly three, each after a
  space, ``\\,``, ``\\ `` or ``~``, is one number (``1 000``, ``12\\,345\\,678``) in gold and
  answer alike; math-verify would read ``1 000`` as ``1·000 = 0``. Comma forms are left to
  math-verify (``1,000`` is 1000, ``1,22`` a pair), and so are decimals (``3.141\\,592``).
- **Decimal commas**, where unambiguous: an answer that is one number with one comma and no
  thousands grouping (``1,22``, ``0,111``, ``1000,99``; not ``1,000``) is read as a decimal,
  but only when that is what the other side is: a single number. ``1,22`` still matches a
  gold ``1,22`` read as a pair and never matches ``122``.
- **Relations in words**: ``x \\text{ is at least } 5``, ``greater than``, ``no more than``,
  ``not equal to``, ``\\not=``, ``\\textless`` are read as ``\\geq``, ``>``, ``\\leq``,
  ``\\neq``, ``<`` in gold and answer alike (math-verify already reads ``\\geq``, ``\\lt``,
  ``\\neq``, ``\\le``, ``>=`` and ``≥``).

These run inside arbor's reward workers (a main thread, so math-verify's SIGALRM
timeouts work); the pool's hard timeout is the backstop for what signals cannot stop.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from functools import lru_cache

import sympy
from math_verify import LatexExtractionConfig, parse, verify

from arbor import final_boxes, in_reward_worker, last_boxed

# math-verify's own limits, in whole seconds (it silently ignores floats). A legitimate
# answer parses in well under 0.3 s; adversarial ones run into these.
PARSE_TIMEOUT_S = 2
VERIFY_TIMEOUT_S = 2
# No MATH answer is this long; longer "answers" are adversarial and only cost time.
MAX_ANSWER_CHARS = 1000

_LATEX = [LatexExtractionConfig()]
# 0.\overline{3}, -1.2\overline{45}, .\overline{6}
_REPEATING = re.compile(r"(-?)(\d*)\.(\d*)\\overline\{(\d{1,50})\}")
# 42. / (1,2). / 5 \text{ cm}; — but not ... nor the LaTeX spaces \, and \;
_TRAILING_PUNCTUATION = re.compile(r"(?:(?<![.\\])\.|(?<!\\)[,;])\s*\Z")
# 1 000, 1\,000, 1~000, 12\ 345\ 678, 3 \, 000 (math mode ignores the spaces): the first
# group is not part of a longer number or a decimal's fraction, each later one is exactly
# three digits. "(1, 000)" has a comma, "2 \times 100" an operator: neither matches.
_DIGIT_GROUPS = re.compile(r"(?<![\d.])\d{1,3}(?:(?:[ \t]*(?:\\[ ,]|~)[ \t]*|[ \t]+)\d{3}(?!\d))+")

# One number with one comma that is no thousands grouping: 1,22  0,111  -1000,99 (not 1,000).
_DECIMAL_COMMA = re.compile(r"-?\d+,\d+")
_THOUSANDS = re.compile(r"-?[1-9]\d{0,2}(?:,\d{3})+")
# Relations spelled in words (longest phrases first), optionally in \text{} and after is/are.
_RELATION_WORDS = [
    (r"greater\s+than\s+or\s+equal\s+to|at\s+least|no\s+less\s+than|not\s+less\s+than", r"\geq"),
    (r"less\s+than\s+or\s+equal\s+to|at\s+most|no\s+more\s+than|not\s+more\s+than|not\s+greater\s+than", r"\leq"),
    (r"greater\s+than|more\s+than|larger\s+than", ">"),
    (r"less\s+than|smaller\s+than|fewer\s+than", "<"),
    (r"not\s+equal\s+to|unequal\s+to", r"\neq"),
    (r"equal\s+to|equals", "="),
]
_RELATIONS = [
    (re.compile(rf"\\(?:text|textrm|textnormal|mbox|mathrm)\s*\{{\s*(?:(?:is|are)\s+)?(?:{words})\s*\}}"
                rf"|(?<![A-Za-z\\])(?:(?:is|are)\s+)?(?:{words})(?![A-Za-z])"), symbol)
    for words, symbol in _RELATION_WORDS
] + [(re.compile(r"\\not\s*="), r"\neq"), (re.compile(r"\\textless(?![A-Za-z])"), "<"),
     (re.compile(r"\\textgreater(?![A-Za-z])"), ">")]


class _Truncate(logging.Filter):
    """math-verify logs its whole input on a timeout. Keep 200 characters."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > 200:
            record.msg, record.args = f"{message[:200]}… [{len(message)} chars]", ()
        return True


for _name in ("math_verify.parser", "math_verify.grader", "math_verify.metric"):
    logging.getLogger(_name).addFilter(_Truncate())


def _repeating_to_fraction(match: re.Match[str]) -> str:
    sign, whole, fixed, repeat = match.groups()
    # x = whole.fixed(repeat)…  =  whole + (fixed·(10^r − 1) + repeat) / (10^f · (10^r − 1))
    nines = 10 ** len(repeat) - 1
    value = int(whole or "0") + Fraction(int(fixed or "0") * nines + int(repeat), 10 ** len(fixed) * nines)
    if sign:
        value = -value
    return f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


def _join_digit_groups(match: re.Match[str]) -> str:
    return "".join(ch for ch in match.group() if ch.isdigit())


def _parse_answer(latex: str) -> list:
    """math-verify's parse of a bare LaTeX answer: [sympy object, normalized string] or []."""
    latex = _DIGIT_GROUPS.sub(_join_digit_groups, latex)
    latex = _REPEATING.sub(_repeating_to_fraction, latex)
    for relation, symbol in _RELATIONS:
        latex = relation.sub(lambda _, symbol=symbol: f" {symbol} ", latex)
    return parse(f"\\boxed{{{latex}}}", extraction_config=_LATEX, parsing_timeout=PARSE_TIMEOUT_S)


@lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple:
    # Every leaf of a tree shares its gold answer: parse each once per worker.
    return tuple(_parse_answer(answer))


def read_answer(completion: str) -> str | None:
    """The completion's final answer as LaTeX for math-verify, or None without a good box.

    ``read_answer(r"\\boxed{1},\\boxed{2}.") == "1, 2"``, ``read_answer(r"\\boxed{42.}") == "42"``.
    """
    parts = final_boxes(completion, max_chars=MAX_ANSWER_CHARS)
    if parts is None:
        return None
    return ", ".join(_TRAILING_PUNCTUATION.sub("", part) for part in parts)


def boxed_accuracy(problem: dict, completion: str) -> float:
    """1.0 when the completion's final boxed answer equals ``problem["answer"]``, else 0.0.

    The answer is :func:`read_answer`'s: the final run of boxes, trailing punctuation dropped.

    A gold answer that does not parse is a data error and raises (naming the problem).
    """
    if "answer" not in problem:
        raise KeyError(f"problem {problem.get('id')!r} has no 'answer' column")
    predicted = read_answer(completion)
    if predicted is None or not predicted.strip():
        return 0.0
    gold = _parse_gold(str(problem["answer"]).strip())
    if not gold:
        raise ValueError(f"gold answer {str(problem['answer'])[:100]!r} does not parse")
    pred = _parse_answer(predicted)
    if pred and verify(list(gold), pred, timeout_seconds=VERIFY_TIMEOUT_S):
        return 1.0
    # A decimal comma, read as one only where the other side is a single number.
    gold_text = str(problem["answer"]).strip()
    if _is_decimal_comma(predicted) and _is_number(gold):
        pred = _parse_answer(predicted.strip().replace(",", "."))
    elif _is_decimal_comma(gold_text) and _is_number(pred):
        gold = _parse_gold(gold_text.replace(",", "."))
    else:
        return 0.0
    return 1.0 if pred and gold and verify(list(gold), pred, timeout_seconds=VERIFY_TIMEOUT_S) else 0.0


def _is_decimal_comma(text: str) -> bool:
    text = text.strip()
    return _DECIMAL_COMMA.fullmatch(text) is not None and _THOUSANDS.fullmatch(text) is None


def _is_number(parsed: list | tuple) -> bool:
    """Whether math-verify's parse is one plain number (not a pair, set or expression)."""
    return bool(parsed) and isinstance(parsed[0], sympy.Number)


def boxed_format(problem: dict, completion: str) -> float:
    """1.0 when the completion ends with a well-formed, non-empty ``\\boxed{}`` answer."""
    predicted = last_boxed(completion, max_chars=MAX_ANSWER_CHARS)
    return 1.0 if predicted is not None and predicted.strip() else 0.0


def _warm_up() -> None:
    """Check a few answer forms once. A fresh worker's first fraction, interval or
    polynomial costs 0.1–0.35 s (parser and sympy caches); pay that before the worker
    says ready, not inside a check's timeout (workers restart after every kill)."""
    for gold, predicted in [(r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt2}{2}"), ("(0,1]", "[0,1)"),
                            ("x^2+2x+1", "(x+1)^2"), (r"\text{(B)}", "B"), (r"\{1,2\}", "1, 2")]:
        boxed_accuracy({"id": "warm-up", "answer": gold}, f"\\boxed{{{predicted}}}")


if in_reward_worker():
    _warm_up()
