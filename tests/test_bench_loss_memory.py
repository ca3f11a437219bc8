"""scripts/bench_loss_memory.py runs both variants end to end and ends with its RESULT line."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "bench_loss_memory.py"


def test_bench_runs_both_variants_on_a_miniature_setting():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tokens", "700", "--prompt", "100", "--vocab", "4000", "--hidden", "64",
         "--chunk", "64", "--repeats", "1", "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert any(line.strip().startswith("chunked:") for line in lines)
    assert any(line.strip().startswith("unchunked:") for line in lines)
    result = re.fullmatch(
        r"RESULT peak_mib_unchunked=(\d+) peak_mib_chunked=(\d+) time_ratio=([\d.]+) body_peak_mib=(\d+)", lines[-1]
    )
    assert result, lines[-1]
    # 600 trained rows × 4,000 × 4 bytes ≈ 9 MiB per logits copy, autograd keeps several;
    # 64-row chunks keep ~1 MiB each.
    assert int(result[2]) < int(result[1])
