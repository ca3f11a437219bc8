"""Where a learner step's time goes, tree packing vs packed linear training: shares of op time.

    python scripts/profile_learner_step.py [--width 16] [--repeats 3] [--threads 1] [--smoke]

On a loaded machine absolute times mean little, but the shares of one step's op time
(torch.profiler, self CPU time) stay comparable: a tree step should spend its time as
the linear step does, in matrix multiplies and attention, not in moving data around.
One step = ``pack_trees`` + one ``Learner.step`` (forward + backward over every pack,
one AdamW update), on ``bench_packing``'s case (d) trees (4 TreePO trees with early
stops, chain-of-thought shapes) and on the same trees linearised (every leaf its own
sequence, packed: the fair linear baseline). Each mode runs its own copy of the model
(hidden 256, 4 layers). Per mode the median-time step of ``--repeats`` is reported:

    tree: 1.64 s of ops | matmul 61.8% | attention kernel 14.0% | data movement 8.4% | other 15.8%

``data movement``: gathers and their gradients (index_select / index_add), copies, fills,
gradient accumulation (add_), concatenation, allocation. ``--smoke``: a tiny model and
the cases shrunk 8×, one repeat (checks the script, measures nothing).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_packing import Shape, build_model, case_uneven  # noqa: E402

from arbor.config import LearnerConfig, LossConfig, ModelConfig, OptimConfig  # noqa: E402
from arbor.train.learner import Learner  # noqa: E402
from arbor.train.packing import linearise_trees, loss_denominator, pack_trees  # noqa: E402

PACK_TOKENS = 4096  # bench_train_step's learner budget
CATEGORIES = {
    "matmul": ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm"),
    "attention kernel": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                         "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    "data movement": ("aten::index_select", "aten::index_add_", "aten::copy_", "aten::fill_", "aten::add_",
                      "aten::zero_", "aten::cat", "aten::clone", "aten::scatter_add_", "aten::index",
                      "aten::_to_copy", "aten::empty", "aten::empty_strided", "aten::zeros"),
}


def shares(prof: profile) -> tuple[float, dict[str, float]]:
    """(total self CPU seconds, category -> share of it); the rest is ``other``."""
    self_us = {event.key: event.self_cpu_time_total for event in prof.key_averages()}
    total = sum(self_us.values())
    out = {name: sum(self_us.get(op, 0.0) for op in ops) / total for name, ops in CATEGORIES.items()}
    out["other"] = 1.0 - sum(out.values())
    return total / 1e6, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=16, help="leaves per tree at most")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    trees = case_uneven(rng, Shape(8 if args.smoke else 1), width=args.width)
    advantages = [[rng.gauss(0, 1) for _ in t.leaves()] for t in trees]
    batches = {"tree": (trees, advantages), "linear": linearise_trees(trees, advantages)}
    model = build_model(args.smoke)
    learners = {
        mode: Learner(ModelConfig(path="unused: the model is given"),
                      LearnerConfig(backend="torch", device="cpu", dtype="float32", pack_tokens=PACK_TOKENS),
                      OptimConfig(lr=1e-6), LossConfig(), total_steps=1000, model=copy.deepcopy(model))
        for mode in batches
    }

    def step(mode: str) -> None:
        batch, adv = batches[mode]
        packs = pack_trees(batch, adv, pack_tokens=PACK_TOKENS, normalize="token")
        learners[mode].step(packs, loss_denominator(batch, "token"))

    unique = sum(t.stats().unique_tokens for t in trees)
    linearised = sum(t.stats().linearised_tokens for t in trees)
    print(f"{len(trees)} trees, leaves {[len(t.leaves()) for t in trees]}: unique {unique} tokens, "
          f"linearised {linearised} (ideal {linearised / unique:.2f}x)")
    results: dict[str, list[tuple[float, dict[str, float]]]] = {mode: [] for mode in batches}
    for mode in batches:  # warm-up: allocator, kernel choice, AdamW state
        step(mode)
    for _ in range(1 if args.smoke else args.repeats):
        for mode in batches:  # interleaved, so drifts in machine load hit both
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(mode)
            results[mode].append(shares(prof))
    for mode, runs in results.items():
        total, share = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        parts = " | ".join(f"{name} {value * 100:.1f}%" for name, value in share.items())
        print(f"{mode}: {total:.2f} s of ops | {parts}")
    ratio = statistics.median(r[0] for r in results["linear"]) / statistics.median(r[0] for r in results["tree"])
    print(f"RESULT op_time_ratio={ratio:.3f} ideal={linearised / unique:.3f}")


if __name__ == "__main__":
    main()
