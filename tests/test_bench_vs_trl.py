"""scripts/bench_vs_trl.py: the TRL side on a miniature setting, and the shared greedy eval.

The arbor side is `arbor train` itself (tests/test_trainer.py runs the quickstart command);
a whole comparison takes minutes, so only TRL's run is exercised here end to end.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

from ci_rule import unavailable

REPO = Path(__file__).resolve().parents[1]


def test_trl_side_runs_and_reports_its_result_line(tmp_path):
    try:
        import trl  # noqa: F401  (the `bench` extra; the script runs it in a subprocess)
    except ImportError as e:
        unavailable(f"trl is not installed ({e}): pip install -e '.[bench]'")
    plot = tmp_path / "vs-trl.png"
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench_vs_trl.py"), "--systems", "trl", "--eval-problems", "4",
         "--plot", str(plot), "--clear-thread-vars", "run.steps=1", "data.prompts_per_step=2", "rollout.width=4"],
        capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    cleared = next(line for line in run.stdout.splitlines() if line.startswith("bench_vs_trl: cleared "))
    assert "OMP_NUM_THREADS=1" in cleared and cleared.endswith("for both systems (--clear-thread-vars)")
    seed = re.search(r"^seed 0 trl +wall_s=([\d.]+) cpu_s=([\d.]+) eval ([\d.]+) -> ([\d.]+) reward first/last "
                     r"([\d.]+)/([\d.]+)$", run.stdout, re.M)
    assert seed, run.stdout
    assert float(seed[1]) > 0 and float(seed[2]) > 0  # the child process was timed and its CPU counted
    # The starting model's greedy accuracy on 4 problems is a multiple of 1/4; one step logs one reward.
    assert float(seed[3]) * 4 == int(float(seed[3]) * 4)
    result = re.search(r"^RESULT trl_wall_s=[\d.]+ trl_cpu_s=[\d.]+ eval_before=([\d.]+) trl_eval=([\d.]+)$",
                       run.stdout, re.M)
    assert result, run.stdout
    assert plot.stat().st_size > 0


def test_the_greedy_eval_scores_the_starting_model_in_its_known_range():
    """The shared eval (transformers' generate) on the first 20 test problems: the starting
    model's 0.3-in-10 accuracy, not 0 (a prompt or stop-token mismatch) and not 1."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_vs_trl import greedy_accuracy

    from arbor.config_load import load_config
    from arbor.data import load_problems

    cfg = load_config(REPO / "configs" / "quickstart.yaml", [])
    problems = load_problems(REPO / cfg.data.eval_path, cfg.data)[:20]
    accuracy = greedy_accuracy(REPO / cfg.model.path, cfg, problems)
    assert 0.1 <= accuracy <= 0.7


def test_a_thread_variable_is_refused_before_anything_runs():
    """Each system at its own defaults: a set OMP_NUM_THREADS would reach both (TRL on one core)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    run = subprocess.run([sys.executable, str(REPO / "scripts/bench_vs_trl.py"), "--systems", "arbor"],
                         capture_output=True, text=True, timeout=120, cwd=REPO, env={**env, "MKL_NUM_THREADS": "2"})
    assert run.returncode != 0
    assert "MKL_NUM_THREADS=2 is set" in run.stderr and "--clear-thread-vars" in run.stderr
    assert "greedy eval" not in run.stdout  # refused before the first eval
