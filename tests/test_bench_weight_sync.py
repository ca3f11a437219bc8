"""scripts/bench_weight_sync.py runs end to end on a toy model and ends with its RESULT line."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_weight_sync_times_every_transport_and_ends_with_its_result_line():
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench_weight_sync.py"), "--tiny", "--bucket-mb", "0.05"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for line in ("raw gloo:", "per_tensor:", "bucketed:", "disk:"):
        assert re.search(rf"^{line} [\d.]+ s$", run.stdout, re.M), (line, run.stdout)
    number = r"([\d.e+-]+)"
    result = re.search(
        rf"^RESULT gb={number} sync_s_per_tensor={number} sync_s_bucketed={number} sync_s_disk={number} "
        rf"raw_gbps={number} bucketed_gbps={number}$", run.stdout, re.M,
    )
    assert result, run.stdout
    gb, *times_and_rates = map(float, result.groups())
    assert 1e-4 < gb < 1e-3  # the toy model's bf16 bytes
    assert all(value > 0 for value in times_and_rates)
