"""scripts/agreement_math_verify.py on a hand-written test file in Math-Verify's format:
only cases with a boxed prediction count, a boxed gold is read as an answer, and a wrong
answer rewarded is a false positive."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CASES = r'''
import pytest


@pytest.mark.parametrize(
    "gold,pred,expected",
    [
        ("$1.22$", r"so $\boxed{1,22}$", 1),
        (r"\boxed{1} and \boxed{2}", r"$\boxed{1, 2}$", 1),
        ("$5$", r"\boxed{6}", 1),
        ("$7$", r"\boxed{7}", 0),
        ("$9$", "no box: 9", 1),
    ],
)
def test_cases(gold, pred, expected):
    pass


@pytest.mark.parametrize("x", [1, 2])
def test_other(x):
    pass
'''


def test_agreement_counts_boxed_cases_and_false_positives(tmp_path):
    (tmp_path / "test_sample.py").write_text(CASES)
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "agreement_math_verify.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "RESULT agreement=0.5000 cases=4 false_positives=1 false_negatives=1"
    assert any(line.startswith("false negative test_sample.py::test_cases: gold '5'") for line in lines)
    assert any(line.startswith("FALSE POSITIVE test_sample.py::test_cases: gold '7'") for line in lines)
