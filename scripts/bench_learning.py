"""Does the tree pay off? Tree arms vs GRPO trained side by side for the same wall-clock budget.

    python scripts/bench_learning.py [--config configs/cot.yaml] [--budget-s 200] [--seeds 2]
        [--evals 6] [--arms tree,grpo,entropy,entropy_treerl] [--out runs/bench_learning]
        [section.key=value ...]
    python scripts/bench_learning.py --budget-s 20 --seeds 1 data.prompts_per_step=4   # smoke

Trains the config's model on its data once per arm and seed with the real trainer
(:func:`arbor.run.trainer.train`: engines, reward pool, DeepSpeed learner, weight sync):

- **tree**: TreePO sampling (``rollout.mode: tree``), TreePO subgroup advantages
  (``algorithm.advantage: treepo``) and tree packing (``loss.mode: tree``): each shared
  prefix sampled, scored and trained once;
- **grpo**: independent sampling (``rollout.mode: independent``: one request ``n = width``
  per prompt), GRPO advantages and linear training (``loss.mode: linear``: every
  trajectory its own row, packed unpadded under ``learner.pack_tokens``), what verl,
  slime and OpenRLHF do;
- **entropy**: TreeRL's EPTree sampling (``rollout.fork_at: entropy``: whole answers forked at
  their highest-entropy tokens, docs/fork-policies.md) with TreePO's advantages and tree packing;
- **entropy_treerl**: the same trees with TreeRL's per-step global + local advantage
  (``algorithm.advantage: treerl``);
- **entropy_dist** (only when named in ``--arms``): entropy forking scored by the entropy of the
  next-token distribution (``rollout.fork_entropy: distribution``) rather than ``−log p``.

Everything else is the config's and the same for every arm: model, data and its order
(``run.seed``), reward, learning rate, dynamic sampling, and the group size — the tree's
``rollout.width`` leaves are the GRPO arm's ``width`` independent answers, under the same
response budget (``segment_tokens · max_depth``). Each arm trains until its training
seconds (the step phases, eval excluded, start-up excluded) pass ``--budget-s``; greedy
accuracy on the held-out set is measured at the start, every ``budget / evals`` training
seconds and at the end, through the same engines (``eval.*``). Tokens computed are the
engines' (prefill + decode: ``rollout/tokens_computed``) plus the learner's
(``train/tokens``: a tree's shared prefix counts once, a linear row's every time).

Writes ``curves.csv`` (arm, seed, step, train_s, tokens, accuracy), ``accuracy_vs_seconds.png``
and ``accuracy_vs_tokens.png`` into ``--out``, then
``RESULT time_to_acc_ratio=<GRPO seconds / TreePO seconds to reach the lower of the two
final accuracies> final_acc_tree=... final_acc_grpo=... step_speedup=<GRPO / TreePO seconds
per RL step>``, each the mean over seeds, then ``time_to_80pct_ratio``: GRPO's seconds over
the tree arm's to first reach ``start + 0.8 · (GRPO's final − start)`` (on the rise, not on the
plateau the lower final accuracy may sit on), the median over seeds (0 for a seed where the
arm never gets there); ``time_to_80pct_ratio_<arm>`` and ``final_acc_<arm>`` for the other tree
arms; ``auc_<arm>`` for every arm: the area under accuracy-vs-seconds over the budget, divided by
it (the mean accuracy over the budget). Before it a ``SPREAD`` line with every seed's values, a
``SIGNAL`` line (per arm, means over seeds: ``signal_<arm>``, the share of sampled leaves in
trees whose rewards differ, the only leaves with a learning signal, and ``tokens_per_step_<arm>``),
written per step to ``steps.csv`` and ``signal_vs_step.png``, a ``SHARING`` line (per arm, means
over seeds: ``cached_ratio_<arm>``, the share of request input tokens the engines' radix cache
served, ``tokens_per_step_<arm>`` and ``seconds_per_step_<arm>``: what prefix sharing saves), and
``TRAIN_REWARD reward_time_ratio=...``: the same ratio asked of the training
reward (the sampled leaves' accuracy at temperature 1, averaged over a sixth of the budget),
which every step measures, where the greedy evals are few and noisy (±0.03 on 200 problems).
``--tree-override KEY=VALUE`` changes the tree arms only: ``--tree-override rollout.width=16``
gives the trees the compute of the GRPO arm's 8 answers rather than their number.
Wall time: per arm and seed, start-up (~20 s quiet) + the budget + 7 greedy evals of the 200
held-out problems; 2 seeds x 2 arms x 200 s took 17 min on a quiet 2-core
machine (``--budget-s 60 --evals 12 --seeds 3``: 11 min). Timings only mean something on a quiet machine:
on a loaded one the reward pool's math-verify calls time out (scored 0) and start-up alone
takes minutes.
"""

from __future__ import annotations

import argparse
import csv
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from arbor.config_load import load_config  # noqa: E402
from arbor.run import phases  # noqa: E402
from arbor.run.metrics import read_metrics  # noqa: E402

# What differs between the arms; everything else comes from the config.
ARMS = {
    "tree": ["rollout.mode=tree", "algorithm.advantage=treepo", "loss.mode=tree"],
    "grpo": ["rollout.mode=independent", "algorithm.advantage=grpo", "loss.mode=linear"],
    # TreeRL's EPTree: whole answers forked at their highest-entropy tokens (docs/fork-policies.md),
    # with TreePO's subgroup advantages, then with TreeRL's per-step global + local advantage.
    # entropy_init=2: the paper's share of initial paths (M = 6 of its 30 leaves) at cot.yaml's width 8;
    # branch=2: the paper's T copies per fork point, whatever the config's TreePO branching
    # (configs/paged_lookup.yaml forks 8 ways after its page).
    "entropy": ["rollout.mode=tree", "rollout.fork_at=entropy", "rollout.entropy_init=2", "rollout.branch=2",
                "algorithm.advantage=treepo", "loss.mode=tree"],
    "entropy_treerl": ["rollout.mode=tree", "rollout.fork_at=entropy", "rollout.entropy_init=2", "rollout.branch=2",
                       "algorithm.advantage=treerl", "loss.mode=tree"],
    # Not run by default: forks scored by the distribution's entropy (the engine's) instead of -log p.
    "entropy_dist": ["rollout.mode=tree", "rollout.fork_at=entropy", "rollout.entropy_init=2", "rollout.branch=2",
                     "rollout.fork_entropy=distribution", "algorithm.advantage=treepo", "loss.mode=tree"],
}
DEFAULT_ARMS = ("tree", "grpo", "entropy", "entropy_treerl")
LABELS = {"tree": "TreePO", "grpo": "GRPO", "entropy": "EPTree + TreePO adv.", "entropy_treerl": "EPTree + TreeRL adv.",
          "entropy_dist": "EPTree (distribution entropy)"}
COLORS = {"tree": "tab:green", "grpo": "tab:blue", "entropy": "tab:orange", "entropy_treerl": "tab:red",
          "entropy_dist": "tab:purple"}
# Past any budget: the run ends when the budget does, not at run.steps.
NO_STEP_LIMIT = 1_000_000


@dataclass
class Curve:
    """One arm's run: greedy accuracy at cumulative training seconds and tokens."""

    arm: str
    seed: int
    points: list[tuple[int, float, float, float]] = field(default_factory=list)  # (step, train_s, tokens, accuracy)
    rewards: list[tuple[float, float]] = field(default_factory=list)  # (train_s, reward/mean) after each step
    # Per step: the share of sampled leaves in trees whose rewards differ (reward/signal_leaves),
    # the leaves with a learning signal at all; and the tokens computed (engines + learner).
    signals: list[float] = field(default_factory=list)
    step_tokens: list[float] = field(default_factory=list)
    cached: list[float] = field(default_factory=list)  # per step: rollout/cached_ratio (prefix sharing)
    steps: int = 0
    train_s: float = 0.0  # training seconds over all steps (eval excluded)

    @property
    def final_accuracy(self) -> float:
        return self.points[-1][3]

    @property
    def seconds_per_step(self) -> float:
        return self.train_s / max(self.steps, 1)

    @property
    def tokens_per_step(self) -> float:
        return sum(self.step_tokens) / max(len(self.step_tokens), 1)

    @property
    def cached_ratio(self) -> float:
        """Mean over steps of the share of request input tokens the engines' radix cache served."""
        return sum(self.cached) / max(len(self.cached), 1)

    @property
    def signal(self) -> float:
        """Mean over steps of the share of leaves with a learning signal."""
        return sum(self.signals) / max(len(self.signals), 1)


class BudgetSpent(Exception):
    """Raised from the trainer's ``after_step`` hook to end a run at its budget."""


def run_arm(config: str, arm: str, seed: int, budget_s: float, evals: int, out: Path, overrides: list[str],
            arm_overrides: tuple[str, ...] = ()) -> Curve:
    """Train one arm with :func:`arbor.run.trainer.train` until ``budget_s`` training seconds;
    ``overrides`` (both arms) come before the arm's own settings, ``arm_overrides``
    (``--tree-override``) after them."""
    from arbor.run.trainer import train

    output_dir = out / f"{arm}-seed{seed}"
    shutil.rmtree(output_dir, ignore_errors=True)  # the last run of this arm and seed: run again, not resumed
    cfg = load_config(config, [
        *overrides, *ARMS[arm], *arm_overrides, f"run.seed={seed}", f"run.output_dir={output_dir}", f"run.name=bench-{arm}",
        f"run.steps={NO_STEP_LIMIT}", f"run.eval_every={NO_STEP_LIMIT}",  # the trainer evaluates the start only
        "run.save_every=0", "run.save_trees_every=0", "run.loggers=[]", "run.log_every=10",
    ])
    curve = Curve(arm, seed)
    tokens = [0.0]
    next_eval = [budget_s / evals]

    def after_step(ctx, step: int, metrics: dict[str, float]) -> None:
        curve.steps = step
        curve.train_s += metrics["time/step_s"] - metrics.get("time/eval_s", 0.0)
        step_tokens = metrics["rollout/tokens_computed"] + metrics.get("train/tokens", 0.0)
        tokens[0] += step_tokens
        curve.rewards.append((curve.train_s, metrics["reward/mean"]))
        curve.signals.append(metrics["reward/signal_leaves"])
        curve.step_tokens.append(step_tokens)
        curve.cached.append(metrics["rollout/cached_ratio"])
        done = curve.train_s >= budget_s
        if done or curve.train_s >= next_eval[0]:
            accuracy = phases.evaluate(ctx.sampling, ctx.rewards, ctx.eval_problems, cfg.eval, cfg.rollout,
                                       cfg.run.seed, ctx.log.status)["eval/accuracy"]
            curve.points.append((step, curve.train_s, tokens[0], accuracy))
            print(f"{arm} seed {seed}: step {step}, {curve.train_s:.0f} s, {tokens[0]:.3g} tokens: "
                  f"greedy accuracy {accuracy:.3f}", flush=True)
            while next_eval[0] <= curve.train_s:
                next_eval[0] += budget_s / evals
        if done:
            raise BudgetSpent

    try:
        train(cfg, after_step)
    except BudgetSpent:
        pass
    start = read_metrics(output_dir)[0]  # step 0: the trainer's eval before any training
    curve.points.insert(0, (0, 0.0, 0.0, start["eval/accuracy"]))
    return curve


def time_to_accuracy(points: list[tuple[int, float, float, float]], target: float) -> float:
    """Training seconds at which the curve first reaches ``target``, linear between evals;
    ``inf`` when it never does.

    >>> time_to_accuracy([(0, 0.0, 0, 0.2), (5, 10.0, 0, 0.3), (9, 20.0, 0, 0.5)], 0.4)
    15.0
    """
    for i, (_, seconds, _, accuracy) in enumerate(points):
        if accuracy >= target:
            if i == 0:
                return seconds
            _, s0, _, a0 = points[i - 1]
            return s0 + (target - a0) / (accuracy - a0) * (seconds - s0)
    return math.inf


def trailing_means(rewards: list[tuple[float, float]], window_s: float) -> list[tuple[int, float, float, float]]:
    """The training reward (the mean over a step's sampled leaves: the policy's accuracy at
    temperature 1) averaged over the steps that ended in the last ``window_s`` seconds, from
    the first step past one window on; as ``(0, train_s, 0, mean)`` points for
    :func:`time_to_accuracy`.

    >>> trailing_means([(1.0, 0.1), (2.0, 0.3), (3.0, 0.5), (4.0, 0.9)], 2.0)
    [(0, 2.0, 0, 0.2), (0, 3.0, 0, 0.4), (0, 4.0, 0, 0.7)]
    """
    means = []
    for seconds, _ in rewards:
        if seconds >= window_s:
            inside = [r for s, r in rewards if seconds - window_s < s <= seconds]
            means.append((0, seconds, 0, round(sum(inside) / len(inside), 12)))
    return means


def seed_figures(tree: Curve, grpo: Curve, window_s: float = 10.0) -> dict[str, float]:
    """One seed's figures. The target is the lower final accuracy; it must lie above the
    start (both arms start from the same model), else neither learned and the ratio is nan."""
    target = min(tree.final_accuracy, grpo.final_accuracy)
    start = max(tree.points[0][3], grpo.points[0][3])
    ratio = math.nan
    if target > start:
        ratio = time_to_accuracy(grpo.points, target) / time_to_accuracy(tree.points, target)
    # The same question of the training reward (sampled, not greedy), smoothed over window_s.
    tree_r, grpo_r = trailing_means(tree.rewards, window_s), trailing_means(grpo.rewards, window_s)
    reward_ratio = math.nan
    if tree_r and grpo_r and min(tree_r[-1][3], grpo_r[-1][3]) > max(tree_r[0][3], grpo_r[0][3]):
        reward_target = min(tree_r[-1][3], grpo_r[-1][3])
        reward_ratio = time_to_accuracy(grpo_r, reward_target) / time_to_accuracy(tree_r, reward_target)
    return {"time_to_acc_ratio": ratio, "reward_time_ratio": reward_ratio, "final_acc_tree": tree.final_accuracy, "final_acc_grpo": grpo.final_accuracy,
            "step_speedup": grpo.seconds_per_step / tree.seconds_per_step, "target": target, "start": start}


def time_to_80pct_ratio(arm: Curve, grpo: Curve) -> float:
    """GRPO's seconds over ``arm``'s to first reach ``start + 0.8 · (GRPO's final − start)``
    (``start``: GRPO's first eval, the model both begin from), interpolated between evals.

    Off the plateau, unlike :func:`seed_figures`' lower-final target: 80 % of GRPO's gain is
    reached on the rise. 0 when ``arm`` never gets there; nan when GRPO did not improve.
    GRPO 0.2 → 0.6 at 20 s gives a target of 0.52, reached at 16 s; an arm at 0.2, 0.6 at
    0, 10 s gets there at 8 s: ratio 2.0.
    """
    start = grpo.points[0][3]
    target = start + 0.8 * (grpo.final_accuracy - start)
    if grpo.final_accuracy <= start:
        return math.nan
    arm_s = time_to_accuracy(arm.points, target)
    if math.isinf(arm_s):
        return 0.0
    return time_to_accuracy(grpo.points, target) / arm_s if arm_s > 0 else math.inf


def area_under_accuracy(points: list[tuple[int, float, float, float]], budget_s: float) -> float:
    """The area under accuracy against training seconds over ``[0, budget_s]``, over
    ``budget_s``: the mean accuracy over the budget (linear between evals, the last eval's
    value held past it). ``[(0, 0, 0, 0.2), (4, 10, 0, 0.4)]`` over 20 s: (3 + 4) / 20 = 0.35.
    """
    area = 0.0
    for (_, s0, _, a0), (_, s1, _, a1) in zip(points, points[1:]):
        if s0 >= budget_s:
            break
        end = min(s1, budget_s)
        a_end = a0 + (a1 - a0) * (end - s0) / (s1 - s0) if s1 > s0 else a1
        area += (end - s0) * (a0 + a_end) / 2
    last_s, last_a = points[-1][1], points[-1][3]
    area += max(0.0, budget_s - last_s) * last_a
    return area / budget_s


def median(values: list[float]) -> float:
    """The median of the values that are numbers (nan when none is)."""
    numbers = sorted(v for v in values if not math.isnan(v))
    if not numbers:
        return math.nan
    mid = len(numbers) // 2
    return numbers[mid] if len(numbers) % 2 else (numbers[mid - 1] + numbers[mid]) / 2


def arm_figures(arm: Curve, grpo: Curve, budget_s: float) -> dict[str, float]:
    """One arm's figures in one seed, against that seed's GRPO run (GRPO's own ratio is 1)."""
    return {"time_to_80pct_ratio": time_to_80pct_ratio(arm, grpo), "final_acc": arm.final_accuracy,
            "auc": area_under_accuracy(arm.points, budget_s), "tokens_per_step": arm.tokens_per_step,
            "signal": arm.signal, "seconds_per_step": arm.seconds_per_step, "cached_ratio": arm.cached_ratio}


def write_csv(curves: list[Curve], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arm", "seed", "step", "train_s", "tokens_computed", "greedy_accuracy"])
        for c in curves:
            for step, seconds, tokens, accuracy in c.points:
                writer.writerow([c.arm, c.seed, step, f"{seconds:.2f}", int(tokens), f"{accuracy:.4f}"])


def write_steps_csv(curves: list[Curve], path: Path) -> None:
    """Per step: training seconds, tokens computed that step, the sampled leaves' mean reward and
    the share of leaves with a learning signal (in trees whose rewards differ)."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arm", "seed", "step", "train_s", "step_tokens", "reward_mean", "signal_leaves"])
        for c in curves:
            for i, ((seconds, reward), tokens, signal) in enumerate(zip(c.rewards, c.step_tokens, c.signals)):
                writer.writerow([c.arm, c.seed, i + 1, f"{seconds:.2f}", int(tokens), f"{reward:.4f}", f"{signal:.4f}"])


def plot(curves: list[Curve], out: Path) -> list[Path]:
    """Accuracy against training seconds and against tokens computed, and the share of leaves
    with a learning signal per step: one line per arm and seed."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    series = [
        ("accuracy_vs_seconds", "training seconds", "greedy held-out accuracy", lambda c: ([p[1] for p in c.points], [p[3] for p in c.points])),
        ("accuracy_vs_tokens", "tokens computed", "greedy held-out accuracy", lambda c: ([p[2] for p in c.points], [p[3] for p in c.points])),
        ("signal_vs_step", "step", "leaves in trees whose rewards differ", lambda c: (list(range(1, len(c.signals) + 1)), c.signals)),
    ]
    paths = []
    for name, x_label, y_label, xy in series:
        fig, ax = plt.subplots(figsize=(6, 4))
        for c in curves:
            x, y = xy(c)
            ax.plot(x, y, marker="o" if name != "signal_vs_step" else None, color=COLORS[c.arm], alpha=0.8,
                    label=f"{LABELS[c.arm]} seed {c.seed}")
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / f"{name}.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "cot.yaml"))
    parser.add_argument("--budget-s", type=float, default=200.0, help="training seconds per arm and seed")
    parser.add_argument("--seeds", type=int, default=2, help="run.seed 0..N-1, each trained by every arm")
    parser.add_argument("--evals", type=int, default=6, help="greedy evals per run after the start one")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma-separated, from {', '.join(ARMS)}; tree and grpo are always run")
    parser.add_argument("--out", default=str(REPO / "runs" / "bench_learning"))
    parser.add_argument("--tree-override", action="append", default=[], metavar="KEY=VALUE",
                        help="for the tree arms only (repeatable), e.g. rollout.width=16: a tree at the compute "
                             "of the GRPO arm's group rather than at its width")
    parser.add_argument("overrides", nargs="*", help="section.key=value for every arm, e.g. data.prompts_per_step=4")
    args = parser.parse_args()
    arms = ["tree", "grpo"] + [a for a in args.arms.split(",") if a and a not in ("tree", "grpo")]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown arm(s) {', '.join(unknown)}; allowed: {', '.join(ARMS)}")
    others = [a for a in arms if a not in ("tree", "grpo")]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    curves, figures, per_arm = [], [], []
    for seed in range(args.seeds):
        # Arms alternate so a machine that slows down over the session hurts all alike.
        runs = {arm: run_arm(args.config, arm, seed, args.budget_s, args.evals, out, args.overrides,
                             tuple(args.tree_override) if arm != "grpo" else ()) for arm in arms}
        curves += runs.values()
        figures.append(seed_figures(runs["tree"], runs["grpo"], window_s=args.budget_s / 6))
        per_arm.append({arm: arm_figures(c, runs["grpo"], args.budget_s) for arm, c in runs.items()})
        f = figures[-1]
        print(f"seed {seed}: start accuracy {f['start']:.3f}, target {f['target']:.3f}: "
              f"time_to_acc_ratio {f['time_to_acc_ratio']:.2f}", flush=True)
        for arm, a in per_arm[-1].items():
            print(f"  {arm}: {runs[arm].steps} steps ({a['seconds_per_step']:.1f} s, {a['tokens_per_step']:.3g} tokens "
                  f"each, {a['cached_ratio']:.2f} of the input from cache), leaves with signal {a['signal']:.2f}, final {a['final_acc']:.3f}, area {a['auc']:.3f}, "
                  f"time_to_80pct_ratio {a['time_to_80pct_ratio']:.2f}", flush=True)
    write_csv(curves, out / "curves.csv")
    write_steps_csv(curves, out / "steps.csv")
    paths = plot(curves, out)
    print(f"wrote {out / 'curves.csv'}, {out / 'steps.csv'}, {', '.join(map(str, paths))} "
          f"({time.monotonic() - t0:.0f} s in all)")
    keys = ("time_to_acc_ratio", "final_acc_tree", "final_acc_grpo", "step_speedup")
    mean = {k: sum(f[k] for f in figures) / len(figures) for k in keys}  # nan if any seed's ratio is nan

    def seeds(arm: str, key: str) -> list[float]:
        return [p[arm][key] for p in per_arm]

    def suffix(arm: str) -> str:
        return "" if arm == "tree" else f"_{arm}"

    # time_to_80pct_ratio: the median over seeds (every seed's value in SPREAD); the rest: means.
    extra = {f"time_to_80pct_ratio{suffix(a)}": median(seeds(a, "time_to_80pct_ratio")) for a in ["tree", *others]}
    extra |= {f"final_acc_{a}": sum(seeds(a, "final_acc")) / len(per_arm) for a in others}
    extra |= {f"auc_{a}": sum(seeds(a, "auc")) / len(per_arm) for a in arms}
    spread = {k: [f[k] for f in figures] for k in (*keys, "reward_time_ratio")}
    spread |= {f"time_to_80pct_ratio{suffix(a)}": seeds(a, "time_to_80pct_ratio") for a in ["tree", *others]}
    spread |= {f"auc_{a}": seeds(a, "auc") for a in arms}
    print("SPREAD " + " ".join(f"{k}=" + ",".join(f"{v:.3f}" for v in values) for k, values in spread.items()))
    # Why an arm teaches more or less per step: the share of its leaves with a learning signal
    # and what a step costs, means over seeds.
    print("SIGNAL " + " ".join(f"signal_{a}={sum(seeds(a, 'signal')) / len(per_arm):.3f} "
                               f"tokens_per_step_{a}={sum(seeds(a, 'tokens_per_step')) / len(per_arm):.0f}" for a in arms))
    # What prefix sharing saves per arm, means over seeds: the engines' cache hits on request input,
    # tokens computed (engines + learner) and training seconds per step.
    print("SHARING " + " ".join(f"cached_ratio_{a}={sum(seeds(a, 'cached_ratio')) / len(per_arm):.3f} "
                                f"tokens_per_step_{a}={sum(seeds(a, 'tokens_per_step')) / len(per_arm):.0f} "
                                f"seconds_per_step_{a}={sum(seeds(a, 'seconds_per_step')) / len(per_arm):.2f}"
                                for a in arms))
    # Not part of RESULT (its fields are fixed): the training reward's answer to the same question.
    print(f"TRAIN_REWARD reward_time_ratio={sum(f['reward_time_ratio'] for f in figures) / len(figures):.3f}")
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in ({k: mean[k] for k in keys} | extra).items()), flush=True)


if __name__ == "__main__":
    main()
