"""scripts/bench_tree_execution.py: its three modes compute one loss and gradients, its cases
have the shapes it names, and its smoke run and CPU memory probe report what they promise."""

import re
import subprocess
import sys

import pytest
import torch
from test_bench_packing import load_script

SCRIPT = "scripts/bench_tree_execution.py"


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_tree_execution")


def test_the_three_modes_train_the_same_gradients_float64(bench):
    # pack_tokens 300: the agentic tree (2,930 tokens, paths of 264) is split into packs
    settings = bench.Settings(model="smoke", shrink=16, pack_tokens=300, group_tokens=40, chunk_tokens=7)
    model = bench.build_model(settings).double()
    for case in ("agentic", "quickstart"):
        trees, advantages = bench.batch(case, settings, model.config.vocab_size)
        results = {}
        for mode in bench.MODES:
            model.zero_grad()
            loss = bench.step(model, mode, trees, advantages, settings)
            results[mode] = loss, [p.grad.clone() for p in model.parameters()]
        ref_loss, ref_grads = results["linear"]
        for mode in ("packed", "dfs"):
            loss, grads = results[mode]
            assert loss == pytest.approx(ref_loss, rel=1e-9), (case, mode)
            for a, b in zip(ref_grads, grads):
                assert (a - b).abs().max() <= 1e-6 * a.abs().max() + 1e-12, (case, mode)


def test_cases_have_the_named_shapes(bench):
    settings = bench.Settings()
    (agentic,) = bench.batch("agentic", settings, 100)[0]
    assert len(agentic.leaves()) == 16
    path = agentic.path(agentic.leaves()[0])
    assert len(path) == 16 and [len(n.token_ids) for n in path[:2]] == [96, 400]  # 8 × (response, observation)
    assert path[1].loss_mask == [0] * 400 and path[0].loss_mask is None
    (prefix,) = bench.batch("prefix", settings, 100)[0]
    assert len(prefix.leaves()) == 64 and len(prefix.prompt_ids) + prefix.leaves()[0].start == 2048
    quick = bench.batch("quickstart", settings, 100)[0]
    assert len(quick) == 32 and {len(t.leaves()) for t in quick} == {8}


def test_smoke_run_reports_every_case_and_the_result_keys():
    done = subprocess.run([sys.executable, SCRIPT, "--smoke", "--threads", "1"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("case ")] == [
        "case agentic", "case prefix", "case quickstart"]
    keys = [f"{case}_{key}" for case in ("agentic", "prefix", "quickstart") for key in (
        "unique", "ideal", "dfs_time", "dfs_memory", "linear_time", "linear_memory")]
    found = re.fullmatch("RESULT " + " ".join(rf"{k}=([\d.]+|nan)" for k in keys), lines[-1])
    assert found, lines[-1]
    values = dict(zip(keys, found.groups()))
    assert float(values["prefix_ideal"]) == 8.0  # 64 leaves of 16 under a 128-token prefix
    assert float(values["agentic_ideal"]) > 1.0 and float(values["agentic_dfs_time"]) > 0
    assert values["agentic_dfs_memory"] == "nan"  # smoke runs measure no memory


def test_the_cpu_memory_probe_prints_a_step_peak_in_mib():
    done = subprocess.run([sys.executable, SCRIPT, "--smoke", "--memory", "quickstart", "dfs", "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.strip().splitlines()[-1]) >= 0.0


def test_cuda_without_a_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    done = subprocess.run([sys.executable, SCRIPT, "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device is visible" in done.stderr
