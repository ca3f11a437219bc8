"""scripts/gpu_report.py: the figures it takes from a run's metrics, worked out by hand (the
script itself runs only on a CUDA machine)."""

import json

import pytest
from script_loader import load_script

gpu_report = load_script("gpu_report")


def test_a_runs_figures_skip_the_compiling_steps_and_take_the_memory_over_idle(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/accuracy": 0.3},  # the eval before training is not a step
            {"step": 1, "time/step_s": 9.0, "mismatch/kl": 1e-4, "mismatch/is_weight_max": 1.2},
            {"step": 2, "time/step_s": 5.0, "mismatch/kl": 3e-4, "mismatch/is_weight_max": 1.5},
            {"step": 3, "time/step_s": 1.5, "mismatch/kl": 2e-4, "mismatch/is_weight_max": 1.1},
            {"step": 4, "time/step_s": 1.7, "mismatch/kl": 2e-4, "mismatch/is_weight_max": 1.0},
            {"step": 5, "time/step_s": 1.6, "mismatch/kl": 2e-4, "mismatch/is_weight_max": 1.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = gpu_report.summarise_run("mis", metrics, memory_mib=[900.0, 4100.0, 3000.0], idle_mib=100.0)
    assert figures["steps_mis"] == 5
    assert figures["s_per_step_mis"] == 1.6  # median of steps 3-5
    assert figures["peak_gpu_mib_mis"] == 4000.0
    assert figures["mismatch_kl_mis"] == pytest.approx(2e-4)  # mean over the steps
    assert figures["mismatch_is_weight_max_mis"] == 1.5  # a max stays a max
    assert "sync_logprob_gap_mis" not in figures  # absent metrics are left out, not zero
    assert gpu_report.result_line({"a": 1.23456, "b": 2.0}) == "RESULT a=1.235 b=2"
