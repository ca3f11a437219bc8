"""scripts/bench_rollout.py runs end to end on a miniature setting and reports what it promises."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_rollout_runs_both_modes_and_ends_with_its_result_line():
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench_rollout.py"), "--width", "4", "--max-depth", "3",
         "--segment-tokens", "8", "--prompts", "2", "--prompt-tokens", "8", "--repeats", "2",
         "--hidden", "64", "--layers", "1", "--heads", "2", "--intermediate", "128"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert len(re.findall(r"^repeat \d: tree [\d.]+s, independent [\d.]+s, trajectories/s ratio [\d.]+$", out, re.M)) == 2
    tree = re.search(r"^tree .*trajectories=(\d+) .*requests=(\d+) decode_steps=(\d+)", out, re.M)
    indep = re.search(r"^independent .*trajectories=(\d+) .*requests=(\d+) decode_steps=(\d+)", out, re.M)
    assert tree and indep, out
    # Both modes made width leaves for every prompt in every repeat; the tree took one
    # request per path and round, the baseline one request per prompt.
    assert int(tree[1]) == int(indep[1]) == 2 * 2 * 4
    assert int(indep[2]) == 2 * 2 and int(tree[2]) > int(indep[2])
    assert int(tree[3]) > 0 and int(indep[3]) > 0
    result = re.search(r"^RESULT trajps_ratio=([\d.]+) compute_ratio=([\d.]+) cpu_trajps_ratio=([\d.]+)$", out, re.M)
    assert result, out
    assert float(result[2]) > 1.0  # the tree computes fewer tokens than the baseline
