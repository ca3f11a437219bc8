"""On-policy distillation vs RL vs both: the quickstart's student, the same wall-clock budget.

    python scripts/bench_distill.py [--budget-s 120] [--seeds 3] [--evals 6] [--out runs/bench_distill]
        [section.key=value ...]
    python scripts/bench_distill.py --budget-s 10 --seeds 1 --evals 1 data.prompts_per_step=4   # smoke

Trains ``configs/distill.yaml``'s student (models/tiny-arith) once per arm and seed with the real
trainer (:func:`bench_learning.run_arm`: engines, reward pool, DeepSpeed learner, greedy evals of
the held-out set every ``budget / evals`` training seconds, eval and start-up excluded):

- **distill**: pure on-policy distillation from models/teacher-arith (``reward_weight: 0``);
- **rl**: RL alone on the task reward (no teacher; dynamic sampling on, as the quickstart);
- **both**: the whitened task advantage plus the distillation term (``reward_weight: 1``).

The teacher's own greedy accuracy on the same problems is measured first (a plain greedy
decode of the teacher, :func:`build_tiny_model.evaluate`). The progress lines name each run
``tree`` (the sampling every arm shares); ``--out/<arm>/`` holds each arm's runs. Writes ``curves.csv`` into
``--out`` and prints, per arm, the median over seeds of the training seconds to first reach
90% of the teacher's accuracy (``inf`` when an arm never does within the budget) and the mean
final accuracy, then the distill arm's teacher tokens over the linearised count
(``distill/teacher_token_ratio``, the tree's saving), in one line:
``RESULT teacher_acc=... t90_distill=... t90_rl=... t90_both=... final_acc_<arm>=... teacher_token_ratio=...``.
Timings only mean something on a quiet machine.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_learning  # noqa: E402

from arbor.run.metrics import read_metrics  # noqa: E402

CONFIG = str(REPO / "configs" / "distill.yaml")
# What differs between the arms; everything else is configs/distill.yaml's.
ARMS = {
    "distill": [],
    "rl": ["algorithm.distill.teacher.model=null", "algorithm.dynamic_sampling=true"],
    "both": ["algorithm.distill.reward_weight=1.0", "algorithm.dynamic_sampling=true"],
}


def teacher_accuracy(overrides: list[str]) -> float:
    """The teacher's greedy accuracy on the problems the arms' evals score (``eval.path`` or
    ``data.eval_path``, the first ``eval.max_problems``)."""
    import json

    import build_tiny_model as tiny
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arbor.config_load import load_config

    cfg = load_config(CONFIG, overrides)
    teacher, test_path = cfg.algorithm.distill.teacher.model, Path(cfg.eval.path or cfg.data.eval_path or "")
    assert teacher is not None, "configs/distill.yaml names its teacher"
    if not test_path.is_absolute():
        test_path = REPO / test_path
    rows = [json.loads(line) for line in test_path.read_text().splitlines() if line.strip()]
    rows = rows[: cfg.eval.max_problems or None]
    if not Path(teacher).is_absolute():
        teacher = str(REPO / teacher)
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    return float(tiny.evaluate(model, AutoTokenizer.from_pretrained(teacher), rows, samples=0, seed=0)["acc"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=120.0, help="training seconds per arm and seed")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--evals", type=int, default=6, help="greedy evals over the budget (and one at the start)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", default=str(REPO / "runs" / "bench_distill"))
    parser.add_argument("overrides", nargs="*", help="section.key=value for every arm")
    args = parser.parse_args()
    arms = args.arms.split(",")
    out = Path(args.out)
    teacher_acc = teacher_accuracy(args.overrides)
    target = 0.9 * teacher_acc
    print(f"teacher greedy accuracy {teacher_acc:.3f}: target {target:.3f}", flush=True)
    curves, figures = [], {}
    for arm in arms:
        t90, finals, ratios = [], [], []
        for seed in range(args.seeds):
            # run_arm's own arm is "tree" (TreePO sampling and packing, as configs/distill.yaml);
            # each of ours in a directory of its own.
            curve = bench_learning.run_arm(CONFIG, "tree", seed, args.budget_s, args.evals, out / arm,
                                           args.overrides, tuple(ARMS[arm]))
            curve.arm = arm
            curves.append(curve)
            t90.append(bench_learning.time_to_accuracy(curve.points, target))
            finals.append(curve.final_accuracy)
            steps = read_metrics(out / arm / f"tree-seed{seed}")
            ratios += [m["distill/teacher_token_ratio"] for m in steps if "distill/teacher_token_ratio" in m]
        figures[f"t90_{arm}"] = bench_learning.median(t90)
        figures[f"final_acc_{arm}"] = sum(finals) / len(finals)
        if ratios:
            figures[f"teacher_token_ratio_{arm}"] = sum(ratios) / len(ratios)
    bench_learning.write_csv(curves, out / "curves.csv")
    shown = " ".join(f"{k}={v:.3f}" if math.isfinite(v) else f"{k}={v}" for k, v in figures.items())
    print(f"RESULT teacher_acc={teacher_acc:.3f} {shown}", flush=True)


if __name__ == "__main__":
    main()
