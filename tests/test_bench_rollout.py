"""scripts/bench_rollout.py runs end to end on a miniature setting and reports what it promises."""

import re
import subprocess
import sys
from pathlib import Path

from sglang_env import sglang_python

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
    assert len(re.findall(r"^embedded repeat \d: tree [\d.]+s, independent [\d.]+s, trajectories/s ratio [\d.]+$", out, re.M)) == 2
    pattern = r".*trajectories=(\d+) .*paths=(\d+) calls=(\d+) calls/batch=([\d.]+) paths/call=[\d.]+ decode_steps=(\d+)"
    tree = re.search("^tree " + pattern, out, re.M)
    indep = re.search("^independent " + pattern, out, re.M)
    assert tree and indep, out
    # Both modes made width leaves for every prompt in every repeat; the tree took one
    # request per path and round, the baseline one request per prompt.
    assert int(tree[1]) == int(indep[1]) == 2 * 2 * 4
    assert int(indep[2]) == 2 * 2 and int(tree[2]) > int(indep[2])
    # Batched across trees: the baseline's one round is one call per batch, plus the
    # prompts committed before their forks; the tree's 3 rounds at most 3 calls more.
    assert int(indep[3]) == 2 * 2 and float(indep[4]) == 2.0
    assert 2 * 2 < int(tree[3]) <= 2 * (3 + 2) and int(tree[3]) < int(tree[2])
    assert int(tree[5]) > 0 and int(indep[5]) > 0
    result = re.search(r"^RESULT trajps_ratio=([\d.]+) compute_ratio=([\d.]+) cpu_trajps_ratio=([\d.]+)$", out, re.M)
    assert result, out
    assert float(result[2]) > 1.0  # the tree computes fewer tokens than the baseline


def test_bench_rollout_serves_a_given_model_directory(tmp_path):
    # --model: prompts from the model's own tokenizer vocabulary, stops on its EOS ids.
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_model import build_tiny_model_dir

    model = build_tiny_model_dir(tmp_path / "model", vocab_size=300, hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench_rollout.py"), "--model", str(model), "--width", "4",
         "--max-depth", "2", "--segment-tokens", "8", "--prompts", "2", "--prompt-tokens", "8", "--repeats", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "embedded http" in run.stdout and f"{model}, vocab " in run.stdout
    assert re.search(r"^RESULT trajps_ratio=[\d.]+ compute_ratio=[\d.]+ cpu_trajps_ratio=[\d.]+$", run.stdout, re.M)


def test_bench_rollout_on_sglang_without_it_says_so():
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench_rollout.py"), "--engine", "sglang", "--prompts", "1",
         "--sglang-python", "/no/such/python", "--hidden", "32", "--layers", "1", "--heads", "2", "--intermediate", "64"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 1
    assert "bench_rollout: engine.python: /no/such/python cannot import sglang" in run.stderr


def test_bench_rollout_on_a_real_sglang_server_against_the_embedded_engine():
    python = sglang_python()
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench_rollout.py"), "--engine", "sglang", "--sglang-python", python,
         "--width", "4", "--max-depth", "2", "--segment-tokens", "8", "--prompts", "2", "--prompt-tokens", "8",
         "--repeats", "1", "--hidden", "32", "--layers", "1", "--heads", "2", "--intermediate", "64"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "sglang http" in run.stdout and "embedded http" in run.stdout
    result = re.search(r"^RESULT trajps_ratio=[\d.]+ compute_ratio=([\d.]+) cached_ratio_tree=([\d.]+) "
                       r"cached_ratio_independent=([\d.]+) sglang_vs_embedded_tokps_tree=[\d.]+ "
                       r"sglang_vs_embedded_tokps_independent=[\d.]+$", run.stdout, re.M)
    assert result, run.stdout
    # Forks reuse their parents' KV on the real server: the tree computes less and hits its cache.
    assert float(result[1]) > 1 and float(result[2]) > float(result[3])
