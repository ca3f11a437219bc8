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


def test_bench_weight_sync_lora_compares_full_and_adapter_bytes():
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench_weight_sync.py"), "--lora", "--tiny", "--lora-rank", "4"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = re.search(r"^RESULT_LORA shape=tiny full_bytes=(\d+) adapter_bytes=(\d+) full_s=([\d.]+) adapter_s=([\d.]+)$",
                       run.stdout, re.M)
    assert result, run.stdout
    full, adapter = int(result[1]), int(result[2])
    # The toy model in bfloat16: tied embedding 512 × 64, 2 layers of attention (q, o 64 × 64, k, v 32 × 64,
    # biases q 64, k, v 32), MLP (3 × 128 × 64), two norms, the final norm.
    layer = 2 * 64 * 64 + 2 * 32 * 64 + 64 + 2 * 32 + 3 * 128 * 64 + 2 * 64
    assert full == 2 * (512 * 64 + 2 * layer + 64)
    # Rank 4 on q, k, v, o, gate, up, down: A [4, in] + B [out, 4], in float32 (peft keeps an
    # adapter on a bfloat16 model in float32: autocast_adapter_dtype).
    shapes = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]
    assert adapter == 4 * 2 * sum(4 * (i + o) for i, o in shapes)
