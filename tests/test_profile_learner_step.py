"""scripts/profile_learner_step.py runs both modes and prints shares that add up to 100%."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_learner_step.py"


def test_smoke_run_prints_shares_of_both_modes():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for mode in ("tree", "linear"):
        line = re.search(rf"^{mode}: [\d.]+ s of ops \| (.*)$", out, re.M)
        assert line, out
        shares = dict(re.findall(r"(\w[a-z ]*?) (-?[\d.]+)%", line[1]))
        assert list(shares) == ["matmul", "attention kernel", "data movement", "other"]
        assert sum(map(float, shares.values())) == pytest.approx(100.0, abs=0.3)
        assert float(shares["matmul"]) > 0
    assert re.search(r"^RESULT op_time_ratio=[\d.]+ ideal=3\.000$", out, re.M), out
