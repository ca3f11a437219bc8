"""scripts/bench_packing.py: its three modes compute one loss, and its smoke run reports every RESULT key."""

import importlib.util
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SCRIPT = SCRIPTS / "bench_packing.py"


def load_script(name: str):
    """Import ``scripts/<name>.py`` as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_bench():
    return load_script("bench_packing")


def loss_and_grads(bench, model, batch):
    model.zero_grad()
    loss = bench.batch_loss(model, batch, "auto")
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("case", ["d", "b"])
def test_packed_linear_baseline_is_the_padded_computation_float64(case):
    # The fair baseline (every leaf its own unpadded sequence, packed) must be the padded
    # baseline's computation exactly, only without padding; tree packing equals both.
    bench = load_bench()
    trees = bench.CASES[case](random.Random(1), bench.Shape(8))
    lengths = {leaf.end for t in trees for leaf in t.leaves()}
    assert case != "d" or len(lengths) > 3  # the uneven case is uneven
    rng = random.Random(2)
    advantages = [[rng.gauss(0, 1) for _ in t.leaves()] for t in trees]
    model = bench.build_model(smoke=True).double()
    results = {mode: loss_and_grads(bench, model, bench.batch_for(mode, trees, advantages)) for mode in bench.MODES}
    ref_loss, ref_grads = results["padded"]
    assert ref_loss != 0.0
    # The packed baseline is the padded computation minus the padding: equal to rounding.
    # Tree packing sums shared-prefix gradients in another order; k_proj's bias gradient is
    # zero in exact arithmetic (softmax ignores a shift common to all keys), so its
    # relative noise sets the tree's tolerance (1e-6, as in test_tree_vs_linear).
    for mode, rtol in (("packed", 1e-10), ("tree", 1e-6)):
        loss, grads = results[mode]
        assert loss == pytest.approx(ref_loss, rel=1e-9), mode
        for ref, grad in zip(ref_grads, grads):
            assert (ref - grad).abs().max().item() <= rtol * max(ref.abs().max().item(), 1e-12), mode

def test_packed_batch_holds_one_unpadded_sequence_per_leaf():
    bench = load_bench()
    trees = bench.CASES["d"](random.Random(0), bench.Shape(8))
    batch = bench.batch_for("packed", trees, [[0.5] * len(t.leaves()) for t in trees])
    paths = [len(t.prompt_ids) + leaf.end for t in trees for leaf in t.leaves()]
    assert batch.policy_mode == "tree"
    assert [len(c.leaves()) for c in batch.trees] == [1] * len(paths)
    assert sum(c.stats().unique_tokens for c in batch.trees) == sum(paths) < bench.padded_tokens(trees)
    with pytest.raises(ValueError, match="mode must be one of"):
        bench.batch_for("flat", trees, [])


def test_smoke_run_reports_every_case_and_the_result_keys():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("case ")] == [f"case {c}" for c in "abcd"]
    keys = ("speedup ideal fraction nosharing_ratio uneven_speedup uneven_ideal uneven_fraction "
            "uneven_speedup_padded uneven_ideal_padded uneven_fraction_padded nosharing_ratio_packed").split()
    result = re.fullmatch("RESULT " + " ".join(rf"{k}=([\d.]+)" for k in keys), lines[-1])
    assert result, lines[-1]
    values = dict(zip(keys, map(float, result.groups())))
    assert values["ideal"] == pytest.approx(6.0)  # 16 branches under one prefix 6x their length
    # Padding only adds tokens: the uneven case's padded ideal exceeds its packed one.
    assert values["uneven_ideal_padded"] > values["uneven_ideal"] > 1.0

