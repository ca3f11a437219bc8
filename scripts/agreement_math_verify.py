"""How often ``rewards/math.py:boxed_accuracy`` agrees with Math-Verify's own test cases.

    git clone https://github.com/huggingface/Math-Verify /tmp/Math-Verify
    python3 scripts/agreement_math_verify.py /tmp/Math-Verify/tests
    python3 scripts/agreement_math_verify.py /tmp/Math-Verify/tests --repo /path/to/other/arbor   # another version's reward

Math-Verify's tests state, case by case, whether a prediction matches a gold answer
(``@pytest.mark.parametrize("gold,pred,expected", [...])``). This script reads those cases
from the test files' source (``ast``; nothing of Math-Verify's test code runs) and keeps the
ones whose prediction holds a ``\\boxed{}``: arbor's reward reads only boxes, so a prediction
without one says nothing about it. A gold with boxes is read as the reward reads an answer
(its final run of boxes); otherwise its ``$…$`` is dropped. Each case is scored
``boxed_accuracy({"answer": gold}, pred)`` and compared with ``expected``. A false positive
is a reward of 1 where Math-Verify expects 0 (a wrong answer rewarded).

Prints each disagreement, then

    RESULT agreement=<agreeing / cases> cases=<n> false_positives=<n> false_negatives=<n>
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parametrized_cases(tests: Path) -> list[tuple[str, str, str, int]]:
    """``(where, gold, pred, expected)`` of every ``gold, pred, expected, ...`` parametrize
    list with literal rows in ``tests/test_*.py``."""
    cases = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                if not (isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize"):
                    continue
                names = ast.literal_eval(decorator.args[0])
                names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)]
                if names[:2] != ["gold", "pred"]:
                    continue
                try:
                    rows = ast.literal_eval(decorator.args[1])
                except ValueError:  # rows built by code, not literals
                    continue
                cases += [(f"{path.name}::{node.name}", row[0], row[1], int(row[2])) for row in rows]
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", type=Path, help="Math-Verify's tests/ directory")
    parser.add_argument("--repo", type=Path, default=REPO, help="the arbor checkout whose rewards/math.py to score")
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo))
    from arbor.plugins import load_object

    boxed_accuracy = load_object("rewards/math.py:boxed_accuracy", "agreement", [str(args.repo)])
    read_answer = load_object("rewards/math.py:read_answer", "agreement", [str(args.repo)])
    cases = [c for c in parametrized_cases(args.tests) if "\\boxed" in c[2]]
    if not cases:
        raise SystemExit(f"no parametrized gold/pred cases with a \\boxed prediction under {args.tests}")
    agree = false_positives = false_negatives = 0
    for where, gold, pred, expected in cases:
        if "\\boxed" in gold or "\\fbox" in gold:
            gold = read_answer(gold) or gold
        gold = gold.strip().strip("$").strip()
        got = boxed_accuracy({"id": where, "answer": gold}, pred)
        if got == expected:
            agree += 1
            continue
        false_positives += got == 1
        false_negatives += got == 0
        print(f"{'FALSE POSITIVE' if got == 1 else 'false negative'} {where}: gold {gold[:60]!r}, "
              f"pred ...{pred[-90:]!r}, Math-Verify expects {expected}")
    print(f"RESULT agreement={agree / len(cases):.4f} cases={len(cases)} false_positives={false_positives} "
          f"false_negatives={false_negatives}")


if __name__ == "__main__":
    main()
