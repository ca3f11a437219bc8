"""scripts/bench_async.py: its figures by hand, and a smoke run of both arms through the real trainer."""

import csv
import re
import subprocess
import sys

from script_loader import REPO, load_script


def _script():
    return load_script("bench_async")


def test_figures_per_seed_and_the_final_eval():
    script = _script()
    runs = [
        script.Run("sync", 0, 100.0, [(1, 5.0, 0.3, None), (2, 10.0, 0.4, 0.45)]),
        script.Run("async", 0, 80.0, [(1, 4.0, 0.3, None), (2, 8.0, 0.4, 0.40)]),
        script.Run("sync", 1, 90.0, [(2, 9.0, 0.5, 0.50)]),
        script.Run("async", 1, 60.0, [(2, 6.0, 0.5, 0.55)]),
    ]
    figures = script.figures(runs)
    # speedup per seed: 100/80 = 1.25 and 90/60 = 1.5
    assert figures["speedup"] == [1.25, 1.5]
    assert figures["eval_sync"] == [0.45, 0.50] and figures["eval_async"] == [0.40, 0.55]
    assert script.Run("sync", 0, 1.0, [(1, 1.0, 0.2, None)]).final_eval != script.Run("sync", 0).final_eval  # nan


def test_smoke_run_trains_both_arms_and_writes_csv_plot_and_result(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "scripts/bench_async.py"), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = re.search(r"^RESULT wall_sync_s=[\d.]+ wall_async_s=[\d.]+ speedup=[\d.]+ eval_sync=[\d.]+ eval_async=[\d.]+ "
                       r"reward_sync=[\d.]+ reward_async=[\d.]+ trained_sync=([\d.]+) trained_async=([\d.]+)$", run.stdout, re.M)
    assert result, run.stdout
    assert float(result.group(1)) > 0 and float(result.group(2)) > 0  # both arms trained trees
    assert re.search(r"^SPREAD wall_sync_s=[\d.]+ wall_async_s=[\d.]+ speedup=", run.stdout, re.M)
    rows = list(csv.DictReader((tmp_path / "curves.csv").open()))
    for arm in ("sync", "async"):
        steps = [r for r in rows if r["arm"] == arm]
        assert [r["step"] for r in steps] == ["1", "2"] and steps[-1]["eval_accuracy"] != ""
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The async arm ran with a producer thread: its metrics carry the async/* keys.
    assert "max_staleness: 1" in (tmp_path / "async-seed0" / "config.yaml").read_text()
    assert '"async/staleness_mean"' in (tmp_path / "async-seed0" / "metrics.jsonl").read_text()
