"""scripts/build_teacher.py: a few SFT steps on the student make a loadable teacher that keeps
the student's tokenizer byte for byte (what distillation requires), and the RESULT line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_short_build_keeps_the_tokenizer_and_reports(tmp_path):
    from arbor.run.teacher_settle import check_same_tokenizer

    out = tmp_path / "teacher"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "build_teacher.py"), "--steps", "3", "--out", str(out),
                           "--eval-problems", "4", "--eval-samples", "1"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith("RESULT sampled_acc=")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (REPO / "models" / "tiny-arith" / name).read_bytes()
    check_same_tokenizer(str(REPO / "models" / "tiny-arith"), str(out))
    assert (out / "model.safetensors").stat().st_size > 1_000_000
