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
    seed = re.search(r"^seed 0 trl +wall_s=([\d.]+) train_s=([\d.]+) cpu_s=([\d.]+) eval ([\d.]+) -> ([\d.]+) "
                     r"reward first/last ([\d.]+)/([\d.]+) periodic evals (.*)$", run.stdout, re.M)
    assert seed, run.stdout
    wall, train, cpu, before, after = (float(seed[i]) for i in range(1, 6))
    assert wall > 0 and cpu > 0  # the child process was timed and its CPU counted
    assert 0 < train < wall  # training seconds: start-up and evals left out
    # The starting model's greedy accuracy on 4 problems is a multiple of 1/4; one step logs one reward.
    assert before * 4 == int(before * 4)
    # The periodic evals: before the first step (the starting model: the same figure as the
    # separate eval before) and after the last; on the same 4 problems.
    points = [p.split(":") for p in seed[8].split()]
    assert len(points) == 2 and float(points[0][0].rstrip("s")) == 0.0
    assert float(points[0][1]) == before and float(points[1][1]) == after
    result = re.search(r"^RESULT trl_wall_s=[\d.]+ trl_train_s=[\d.]+ trl_cpu_s=[\d.]+ eval_before=([\d.]+) "
                       r"trl_eval=([\d.]+) trl_final_periodic=([\d.]+)$", run.stdout, re.M)
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


def test_the_time_ratio_is_arbor_s_seconds_to_trl_s_final_accuracy_over_trl_s_seconds():
    """time_to_trl_final_ratio: per seed, the first arbor eval at or above TRL's last one."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_vs_trl import Run, result_line, time_to

    arbor = Run("arbor", 0, 100.0, 150.0, 0.5, [0.1], [(0, 0.0, 0.2), (5, 30.0, 0.4), (10, 60.0, 0.5)], 60.0)
    trl = Run("trl", 0, 200.0, 300.0, 0.4, [0.1], [(0, 0.0, 0.2), (10, 120.0, 0.4)], 120.0)
    assert time_to(arbor.curve, 0.4) == 30.0 and time_to(arbor.curve, 0.6) == float("inf")
    line = result_line([arbor, trl], ["arbor", "trl"], 0.2)
    assert " wall_ratio=0.500 time_to_trl_final_ratio=0.250 " in line, line
    assert "arbor_final_periodic=0.500" in line and "trl_final_periodic=0.400" in line
