"""Does overlapping sampling and training pay off? The quickstart synchronous vs ``algorithm.max_staleness: 1``.

    python scripts/bench_async.py [--config configs/quickstart.yaml] [--seeds 3] [--steps 60]
        [--out runs/bench_async] [section.key=value ...]
    python scripts/bench_async.py --smoke            # 2 steps, 1 seed, small batches: checks it runs

Trains the config twice per seed with the real trainer (:func:`arbor.run.trainer.train`: Ray,
engines, reward pool, DeepSpeed learner, weight sync):

- **sync**: ``algorithm.max_staleness: 0``: sample, score, train,
  push, one after another — the engine idles while the learner trains and the reverse;
- **async**: ``algorithm.max_staleness: 1``: a producer thread samples and scores step
  t + 1's trees while the learner trains on step t's (:mod:`arbor.run.async_rollouts`), and the
  loss is AReaL's decoupled objective (``loss.behaviour_cap``). On CPU the engine and the
  learner then split the cores (``arbor.run.orchestration.cpu_threads``).

Everything else is the config's and the same for both arms (model, data order ``run.seed``,
reward, batch, learning rate, evals every ``run.eval_every`` steps). ``wall`` is the whole
``train`` call as a user waits for it: start-up, steps, evals and the final export.

Writes ``curves.csv`` (arm, seed, step, wall_s, reward_accuracy, eval_accuracy) and
``curves.png`` (greedy eval accuracy against wall seconds; sampled-answer accuracy against
step) into ``--out``, then ``SPREAD`` (every seed's values) and
``RESULT wall_sync_s=... wall_async_s=... speedup=<sync / async wall> eval_sync=... eval_async=...
reward_sync=... reward_async=... trained_sync=... trained_async=...`` (means over seeds; eval = the
greedy held-out accuracy after the last step, nan for a config without an eval set; reward = the
mean ``reward/mean`` over the second half of the steps; trained = the trees trained over the run,
which an asynchronous run that drops its trees as too stale would show). Timings only
mean something on a quiet machine. Wall time on a quiet 2-core machine: 13 min (3 seeds;
RESULT speedup=1.424, per seed 1.27–1.59).
"""

from __future__ import annotations

import argparse
import csv
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from arbor.config_load import load_config  # noqa: E402

ARMS = {"sync": ["algorithm.max_staleness=0"], "async": ["algorithm.max_staleness=1"]}
# --smoke: a couple of small steps with an eval at the end (seconds, not minutes).
SMOKE = ["data.prompts_per_step=4", "eval.max_problems=4", "rollout.max_depth=2", "reward.workers=1",
         "algorithm.max_refill_rounds=0"]


@dataclass
class Run:
    """One arm's run: per step the cumulative wall seconds, sampled and greedy accuracy."""

    arm: str
    seed: int
    wall_s: float = 0.0  # the whole train() call
    points: list[tuple[int, float, float, float | None]] = field(default_factory=list)  # (step, wall_s, reward_acc, eval_acc)
    rewards: list[float] = field(default_factory=list)  # reward/mean per step
    trees_trained: float = 0.0  # Σ rollout/trees_trained: what the arm learned from

    @property
    def late_reward(self) -> float:
        """Mean reward/mean over the second half of the steps: learning where the config has no eval."""
        half = self.rewards[len(self.rewards) // 2:]
        return statistics.fmean(half) if half else float("nan")

    @property
    def final_eval(self) -> float:
        evals = [p[3] for p in self.points if p[3] is not None]
        return evals[-1] if evals else float("nan")


def run_arm(config: str, arm: str, seed: int, steps: int, out: Path, overrides: list[str]) -> Run:
    """Train one arm for ``steps`` steps; the eval runs every ``run.eval_every`` steps and after the last."""
    from arbor.run.trainer import train

    output_dir = out / f"{arm}-seed{seed}"
    shutil.rmtree(output_dir, ignore_errors=True)  # the last run of this arm and seed: run again, not resumed
    cfg = load_config(config, [
        *overrides, *ARMS[arm], f"run.seed={seed}", f"run.output_dir={output_dir}",
        f"run.name=bench-{arm}", f"run.steps={steps}", "run.save_every=0", "run.save_trees_every=0",
        "run.loggers=[]", "run.log_every=10",
    ])
    if cfg.run.eval_every and steps % cfg.run.eval_every:
        cfg.run.eval_every = steps  # the final accuracy is measured after the last step
    run = Run(arm, seed)
    t0 = time.perf_counter()
    history = train(cfg)
    import ray

    ray.shutdown()  # each arm starts its own Ray, as a user's run does (else the first arm alone pays ray.init)
    run.wall_s = time.perf_counter() - t0
    elapsed = 0.0
    for step, metrics in enumerate(history, start=1):  # a fresh run: steps 1..steps
        elapsed += metrics["time/step_s"]
        run.points.append((step, elapsed, metrics["reward/accuracy"], metrics.get("eval/accuracy")))
        run.rewards.append(metrics["reward/mean"])
        run.trees_trained += metrics.get("rollout/trees_trained", 0.0)
    print(f"{arm} seed {seed}: {steps} steps in {run.wall_s:.1f} s (loop {elapsed:.1f} s); "
          f"final greedy accuracy {run.final_eval:.3f}", flush=True)
    return run


def write_csv(runs: list[Run], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arm", "seed", "step", "wall_s", "reward_accuracy", "eval_accuracy"])
        for r in runs:
            for step, wall, reward, accuracy in r.points:
                writer.writerow([r.arm, r.seed, step, f"{wall:.2f}", f"{reward:.4f}",
                                 "" if accuracy is None else f"{accuracy:.4f}"])


def plot(runs: list[Run], path: Path) -> None:
    """Greedy eval accuracy vs loop seconds, sampled-answer accuracy vs step: a line per arm and seed."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    colors = {"sync": "tab:blue", "async": "tab:orange"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        evals = [(wall, acc) for _, wall, _, acc in r.points if acc is not None]
        left.plot([w for w, _ in evals], [a for _, a in evals], marker="o", color=colors[r.arm], alpha=0.8,
                  label=f"{r.arm} seed {r.seed}")
        right.plot([p[0] for p in r.points], [p[2] for p in r.points], color=colors[r.arm], alpha=0.6,
                   label=f"{r.arm} seed {r.seed}")
    left.set(xlabel="training-loop seconds", ylabel="greedy held-out accuracy")
    right.set(xlabel="step", ylabel="sampled-answer accuracy (train)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figures(runs: list[Run]) -> dict[str, list[float]]:
    """Per seed: wall seconds and final eval of each arm, and the speedup sync / async."""
    by = {(r.arm, r.seed): r for r in runs}
    seeds = sorted({r.seed for r in runs})
    out = {
        "wall_sync_s": [by["sync", s].wall_s for s in seeds],
        "wall_async_s": [by["async", s].wall_s for s in seeds],
        "eval_sync": [by["sync", s].final_eval for s in seeds],
        "eval_async": [by["async", s].final_eval for s in seeds],
        "reward_sync": [by["sync", s].late_reward for s in seeds],
        "reward_async": [by["async", s].late_reward for s in seeds],
        "trained_sync": [by["sync", s].trees_trained for s in seeds],
        "trained_async": [by["async", s].trees_trained for s in seeds],
    }
    out["speedup"] = [a / b for a, b in zip(out["wall_sync_s"], out["wall_async_s"])]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"))
    parser.add_argument("--seeds", type=int, default=3, help="run.seed 0..N-1, each trained by both arms")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default=str(REPO / "runs" / "bench_async"))
    parser.add_argument("--smoke", action="store_true", help="2 steps, 1 seed, small batches (checks the script runs)")
    parser.add_argument("overrides", nargs="*", help="section.key=value for both arms")
    args = parser.parse_args()
    seeds, steps, overrides = args.seeds, args.steps, list(args.overrides)
    if args.smoke:
        seeds, steps, overrides = 1, 2, [*SMOKE, *overrides]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in range(seeds):
        # Arms alternate so a machine that slows down over the session hurts both alike.
        runs += [run_arm(args.config, arm, seed, steps, out, overrides) for arm in ARMS]
    write_csv(runs, out / "curves.csv")
    plot(runs, out / "curves.png")
    print(f"wrote {out / 'curves.csv'} and {out / 'curves.png'}")
    per_seed = figures(runs)
    keys = ("wall_sync_s", "wall_async_s", "speedup", "eval_sync", "eval_async", "reward_sync", "reward_async",
            "trained_sync", "trained_async")
    print("SPREAD " + " ".join(f"{k}=" + ",".join(f"{v:.3f}" for v in per_seed[k]) for k in keys))
    print("RESULT " + " ".join(f"{k}={statistics.fmean(per_seed[k]):.3f}" for k in keys), flush=True)


if __name__ == "__main__":
    main()
