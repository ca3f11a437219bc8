"""arbor against TRL's GRPOTrainer on a config's task, side by side in one run.

    pip install -e ".[bench]"          # TRL
    python scripts/bench_vs_trl.py [--seeds 0 1 2] [--systems arbor trl] [--tag NAME]
        [--config configs/quickstart.yaml] [--eval-problems N] [--plot docs/figures/vs-trl.png]
        [--out DIR] [--clear-thread-vars] [section.key=value ...]
    python scripts/bench_vs_trl.py --config CONFIG --replot DIR1/runs.json DIR2/runs.json [--plot PNG]

Per seed, each system trains the config's model on the same problems (``data.train_path``),
prompts (the chat template with ``data.prompt_suffix``), reward (``reward.functions``, each
with its weight) and settings, all read from the config (``section.key=value`` overrides
apply to both):

- **arbor**: ``arbor train CONFIG`` as a user runs it (Ray, ``arbor serve``, the config's
  learner, tree rollouts of ``rollout.width`` leaves), its periodic evals (``run.eval_every``)
  and checkpoints included: the config as shipped;
- **TRL**: ``GRPOTrainer`` with ``data.prompts_per_step`` prompts x ``rollout.width``
  completions per step (one optimizer step each), ``rollout.max_response_tokens`` tokens,
  ``rollout.temperature``, ``optim.lr`` with ``optim.warmup_steps`` and ``optim.schedule``,
  ``optim.max_grad_norm``, clipping ``loss.clip_low`` / ``loss.clip_high``, ``loss_type:
  dapo``, ``beta`` = ``loss.kl_coef`` (0: no KL), ``run.steps`` steps, no checkpoints, on the
  CPU; a callback runs the greedy eval below every ``run.eval_every`` steps (and before the
  first), as arbor's periodic eval does.

Each system runs at its own defaults: no thread setting favours either. The script refuses
to start when a thread variable (``OMP_NUM_THREADS`` and the like) is set, since both
children would inherit it (with ``OMP_NUM_THREADS=1`` TRL runs on one core of the machine);
``--clear-thread-vars`` removes them for both, saying so.

Each system runs in its own process, timed from its start to its exit (``wall_s``), and its
whole process tree's CPU time is summed (``cpu_s``: Ray's workers and the engine server
included; polled every 0.2 s, so a process that lives less than that may be missed).
``train_s`` is the training time alone: arbor's step phases (``time/step_s`` less
``time/eval_s``), TRL's time from the start of training less its evals; start-up and evals
are left out of both. The eval set is the config's (``eval.path`` or ``data.eval_path``),
its first ``--eval-problems`` (default ``eval.max_problems``; 0 there: all), passed to both
systems' periodic evals. Before and after, the same greedy eval scores the model in
transformers (``eval.max_response_tokens`` new tokens, else ``rollout.max_response_tokens``,
stopping on the model's stop tokens; a sample is right when the first reward function scores
it above 0, as ``eval/accuracy`` counts): ``eval_before`` is the starting model, ``arbor_eval``
/ ``trl_eval`` the trained ones (means over seeds).

The plot (``--plot``) shows greedy accuracy against training seconds (the periodic evals)
and each step's mean reward, one line per seed and system. ``--out DIR`` keeps each run's
output and ``DIR/runs.json``; ``--replot`` draws and summarises several such files together
(seeds run at different times). Ends with ``RESULT wall_ratio=<arbor/trl wall>
time_to_trl_final_ratio=<per seed, arbor's training seconds to first reach TRL's final
periodic accuracy, over TRL's training seconds; the median> arbor_wall_s=... arbor_train_s=...
arbor_cpu_s=... trl_... eval_before=... arbor_eval=... arbor_final_periodic=... trl_eval=...
trl_final_periodic=...`` (means over seeds; a system left out of ``--systems`` is left out of
the line). Run it on a quiet machine: both systems are CPU-bound, and anything else running
changes both walls.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arbor.config import Config  # noqa: E402
from arbor.config_load import load_config  # noqa: E402

# Variables that set the threads of torch (OpenMP, MKL, OpenBLAS) or of other numeric libraries.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "TORCH_NUM_THREADS")


def thread_vars_check(clear: bool) -> None:
    """Each system at its defaults: refuse set thread variables, or clear them (``clear``) for both."""
    found = {name: os.environ[name] for name in THREAD_VARS if name in os.environ}
    if not found:
        return
    shown = ", ".join(f"{k}={v}" for k, v in found.items())
    if not clear:
        raise SystemExit(f"bench_vs_trl: {shown} is set: both systems would inherit it and run off their own "
                         "defaults (TRL on fewer cores); unset it, or pass --clear-thread-vars")
    for name in found:
        del os.environ[name]
    print(f"bench_vs_trl: cleared {shown} for both systems (--clear-thread-vars)", flush=True)


@dataclass
class Run:
    """One system's run on one seed."""

    system: str
    seed: int
    wall_s: float
    cpu_s: float
    eval_after: float
    rewards: list[float] = field(default_factory=list)  # mean reward per step
    # (step, training seconds so far, greedy accuracy): the periodic evals, step 0 first;
    # training seconds exclude start-up and the evals themselves.
    curve: list[tuple[int, float, float]] = field(default_factory=list)
    train_s: float = float("nan")  # training seconds of the whole run (evals excluded)


def timed(command: list[str], log: Path) -> tuple[float, float]:
    """Run ``command`` (output to ``log``); its wall seconds and its process tree's CPU seconds."""
    import psutil

    cpu: dict[int, float] = {}  # pid -> the last CPU seconds seen (user + system)
    start = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        root = psutil.Process(process.pid)
        while process.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                tree = []
            for p in tree:
                try:
                    times = p.cpu_times()
                    cpu[p.pid] = times.user + times.system + times.children_user + times.children_system
                except psutil.Error:  # it ended between the listing and the reading
                    pass
            time.sleep(0.2)
    wall = time.perf_counter() - start
    if process.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"bench_vs_trl: {' '.join(command[:4])} ... failed (exit {process.returncode}):\n{tail}")
    return wall, sum(cpu.values())


def run_arbor(config: str, overrides: list[str], seed: int, out: Path) -> tuple[Run, Path]:
    """``arbor train`` on ``seed``; the run and its exported model directory."""
    command = [sys.executable, "-m", "arbor", "train", config, *overrides, f"run.seed={seed}",
               f"run.output_dir={out}"]
    wall, cpu = timed(command, out.parent / f"{out.name}.log")
    from arbor.run.metrics import read_metrics

    records = read_metrics(out)
    rewards = [m["reward/mean"] for m in records if "reward/mean" in m]
    curve, train_s = [], 0.0
    for m in records:
        if m["step"] > 0:
            train_s += m.get("time/step_s", 0.0) - m.get("time/eval_s", 0.0)
        if "eval/accuracy" in m:
            curve.append((int(m["step"]), train_s, m["eval/accuracy"]))
    return Run("arbor", seed, wall, cpu, float("nan"), rewards, curve, train_s), out / "hf"


def run_trl(config: str, overrides: list[str], seed: int, out: Path) -> tuple[Run, Path]:
    """TRL's GRPOTrainer (this script's ``--trl-child``) on ``seed``; the run and its model."""
    command = [sys.executable, __file__, "--trl-child", str(out), "--config", config, *overrides,
               f"run.seed={seed}"]
    wall, cpu = timed(command, out.parent / f"{out.name}.log")
    rewards = json.loads((out / "rewards.json").read_text())
    timing = json.loads((out / "curve.json").read_text())
    curve = [tuple(point) for point in timing["curve"]]
    return Run("trl", seed, wall, cpu, float("nan"), rewards, curve, timing["train_s"]), out / "model"


def reward_fns(cfg: Config) -> list:
    """The config's reward functions, loaded as the trainer loads them."""
    from arbor.rollout.rewards import load_reward_terms

    return load_reward_terms(cfg.reward.functions, search_dirs=[str(ROOT)])


def trl_child(cfg: Config, out: Path, eval_problems: list[dict], eval_every: int) -> None:
    """Train with GRPOTrainer on the config's task; writes ``out/model``, ``out/rewards.json``
    and ``out/curve.json`` (greedy accuracy on ``eval_problems`` every ``eval_every`` steps,
    against training seconds: the evals' own time and the start-up left out)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from arbor.data import load_problems, prompt_messages

    fns, weights = reward_fns(cfg), [t.weight for t in cfg.reward.functions]

    def reward(prompts, completions, answer, id, **_) -> list[float]:  # noqa: A002 (TRL passes the column)
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [sum(w * float(fn({"id": i, "answer": a}, t)) for fn, w in zip(fns, weights))
                for t, a, i in zip(texts, answer, id)]

    reward.__name__ = cfg.reward.functions[0].fn.rsplit(":", 1)[-1]
    problems = load_problems(cfg.data.train_path, cfg.data)
    dataset = Dataset.from_list([
        {"prompt": prompt_messages(p["prompt"], cfg.data.prompt_suffix, cfg.data.system_prompt),
         "answer": str(p["answer"]), "id": str(p["id"])} for p in problems
    ])
    schedule = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[cfg.optim.schedule]
    args = GRPOConfig(
        output_dir=str(out / "trainer"), seed=cfg.run.seed, max_steps=cfg.run.steps, use_cpu=True,
        per_device_train_batch_size=cfg.data.prompts_per_step * cfg.rollout.width, gradient_accumulation_steps=1,
        num_generations=cfg.rollout.width, max_completion_length=cfg.rollout.max_response_tokens,
        temperature=cfg.rollout.temperature, learning_rate=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps,
        lr_scheduler_type=schedule, max_grad_norm=cfg.optim.max_grad_norm, weight_decay=cfg.optim.weight_decay,
        loss_type="dapo", beta=cfg.loss.kl_coef, epsilon=cfg.loss.clip_low, epsilon_high=cfg.loss.clip_high,
        save_strategy="no", logging_steps=1, report_to="none", bf16=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype="float32")
    curve: list[tuple[int, float, float]] = []
    clock = {"start": 0.0, "eval_s": 0.0}

    def evaluate(step: int) -> None:
        started = time.perf_counter()
        was_training = model.training
        model.eval()
        accuracy = greedy_accuracy_of(model, tokenizer, cfg, eval_problems)
        model.train(was_training)
        train_s = started - clock["start"] - clock["eval_s"]
        clock["eval_s"] += time.perf_counter() - started
        curve.append((step, train_s, accuracy))
        print(f"trl: step {step}, {train_s:.0f} training s: greedy accuracy {accuracy:.3f}", flush=True)

    class PeriodicEval(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201 (TRL's signature)
            clock["start"] = time.perf_counter()
            if eval_every and eval_problems:
                evaluate(0)

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            if eval_every and eval_problems and (state.global_step % eval_every == 0
                                                  or state.global_step == state.max_steps):
                evaluate(state.global_step)

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[PeriodicEval()])
    trainer.train()
    train_s = time.perf_counter() - clock["start"] - clock["eval_s"]
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    trainer.save_model(str(out / "model"))
    tokenizer.save_pretrained(str(out / "model"))
    (out / "rewards.json").write_text(json.dumps(rewards))
    (out / "curve.json").write_text(json.dumps({"curve": curve, "train_s": train_s}))


def greedy_accuracy(model_dir: Path | str, cfg: Config, problems: list[dict]) -> float:
    """Greedy accuracy of the model saved in ``model_dir`` on ``problems`` (:func:`greedy_accuracy_of`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return greedy_accuracy_of(model, tokenizer, cfg, problems, model_dir)


def greedy_accuracy_of(model, tokenizer, cfg: Config, problems: list[dict], model_dir: Path | str | None = None) -> float:  # noqa: ANN001
    """Greedy accuracy of ``model`` on ``problems``: the config's prompts, at most
    ``eval.max_response_tokens`` new tokens (``rollout.max_response_tokens`` when unset), a
    sample correct when the first reward function scores it > 0 (what ``eval/accuracy`` counts)."""
    import torch

    from arbor.data import format_prompt, stop_token_ids

    score = reward_fns(cfg)[0]
    stops = stop_token_ids(tokenizer, str(model_dir or cfg.model.path))
    budget = cfg.eval.max_response_tokens or cfg.rollout.max_response_tokens
    by_length: dict[int, list[tuple[dict, list[int]]]] = {}
    for p in problems:  # prompts of one length batch without padding
        ids = format_prompt(p, cfg.data, tokenizer, cfg.model.chat_template)
        by_length.setdefault(len(ids), []).append((p, ids))
    correct = 0.0
    with torch.no_grad():
        for length, group in by_length.items():
            batch = torch.tensor([ids for _, ids in group])
            out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                                 max_new_tokens=budget, eos_token_id=stops, pad_token_id=stops[0])
            for (problem, _), row in zip(group, out[:, length:].tolist()):
                cut = next((i for i, t in enumerate(row) if t in stops), len(row))
                correct += float(score(problem, tokenizer.decode(row[:cut], skip_special_tokens=True)) > 0)
    return correct / len(problems)


def plot(runs: list[Run], path: Path, title: str) -> None:
    """Left: greedy accuracy against training seconds (the periodic evals); right: each step's
    mean reward. One thin line per seed; the legend gives each system's mean wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, reward_ax) = plt.subplots(1, 2, figsize=(12, 4))
    for system, color in (("arbor", "tab:green"), ("trl", "tab:blue")):
        mine = [r for r in runs if r.system == system]
        if not mine:
            continue
        name = "arbor" if system == "arbor" else "TRL GRPOTrainer"
        wall = statistics.fmean(r.wall_s for r in mine)
        for i, r in enumerate(mine):
            label = f"{name}: {wall:.0f} s wall" if i == 0 else None
            if r.curve:
                acc_ax.plot([t for _, t, _ in r.curve], [a for _, _, a in r.curve], color=color, marker="o",
                            markersize=3, alpha=0.8, linewidth=1.2, label=label)
            if r.rewards:
                reward_ax.plot(range(1, len(r.rewards) + 1), r.rewards, color=color, alpha=0.5, linewidth=0.8,
                               label=label)
    acc_ax.set_xlabel("training seconds (start-up and evals excluded)")
    acc_ax.set_ylabel("greedy accuracy, held-out set")
    reward_ax.set_xlabel("step")
    reward_ax.set_ylabel("mean reward of the step's samples")
    fig.suptitle(f"{title}, {len({r.seed for r in runs})} seed(s)")
    acc_ax.legend()
    reward_ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def time_to(curve: list[tuple[int, float, float]], accuracy: float) -> float:
    """Training seconds at the first eval of ``curve`` at or above ``accuracy`` (inf: never)."""
    return next((t for _, t, a in curve if a >= accuracy - 1e-9), math.inf)


def result_line(runs: list[Run], systems: list[str], before: float) -> str:
    def mean(system: str, attr: str) -> float:
        return statistics.fmean(getattr(r, attr) for r in runs if r.system == system)

    result = ""
    if {"arbor", "trl"} <= set(systems):
        result += f" wall_ratio={mean('arbor', 'wall_s') / mean('trl', 'wall_s'):.3f}"
        # Per seed: arbor's training seconds to reach TRL's final accuracy, over TRL's training seconds.
        ratios = []
        for trl in (r for r in runs if r.system == "trl" and r.curve):
            mine = [r for r in runs if r.system == "arbor" and r.seed == trl.seed and r.curve]
            if mine:
                ratios.append(time_to(mine[0].curve, trl.curve[-1][2]) / trl.train_s)
        if ratios:
            result += f" time_to_trl_final_ratio={statistics.median(ratios):.3f}"
    for system in systems:
        result += (f" {system}_wall_s={mean(system, 'wall_s'):.1f} {system}_train_s={mean(system, 'train_s'):.1f}"
                   f" {system}_cpu_s={mean(system, 'cpu_s'):.1f}")
    result += f" eval_before={before:.3f}"
    for system in systems:
        result += f" {system}_eval={mean(system, 'eval_after'):.3f}"
        finals = [r.curve[-1][2] for r in runs if r.system == system and r.curve]
        if finals:
            result += f" {system}_final_periodic={statistics.fmean(finals):.3f}"
    return "RESULT" + result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--systems", nargs="+", choices=["arbor", "trl"], default=["arbor", "trl"])
    parser.add_argument("--eval-problems", type=int, default=0,
                        help="the first N of the eval set (0: eval.max_problems, as arbor's periodic eval)")
    parser.add_argument("--plot", default="docs/figures/vs-trl.png", help="'' for none")
    parser.add_argument("--out", default="", help="keep each run and runs.json here (default: a temporary folder)")
    parser.add_argument("--replot", nargs="+", metavar="RUNS_JSON",
                        help="only plot (--plot) and print the RESULT line of earlier runs' runs.json files")
    parser.add_argument("--tag", default="", help="a name for this comparison in the printed lines")
    parser.add_argument("--clear-thread-vars", action="store_true",
                        help="remove OMP_NUM_THREADS and the like for both systems instead of refusing to run")
    parser.add_argument("--trl-child", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args()
    cfg = load_config(ROOT / args.config, args.overrides)
    title = args.tag or Path(args.config).stem
    if args.replot:
        saved = [json.loads(Path(f).read_text()) for f in args.replot]
        runs = [Run(**r) for part in saved for r in part["runs"]]
        for r in runs:
            r.curve = [tuple(point) for point in r.curve]  # type: ignore[misc]
        systems = [s for s in ("arbor", "trl") if any(r.system == s for r in runs)]
        if args.plot:
            plot(runs, ROOT / args.plot, title)
            print(f"plot: {args.plot}")
        print(result_line(runs, systems, saved[0]["eval_before"]))
        return 0
    eval_path = cfg.eval.path or cfg.data.eval_path
    if eval_path is None:
        raise SystemExit("bench_vs_trl: the config has no eval.path or data.eval_path to evaluate on")
    from arbor.data import load_problems

    count = args.eval_problems or cfg.eval.max_problems
    problems = load_problems(eval_path, cfg.data, key="eval.path")
    problems = problems[:count] if count else problems
    if args.trl_child:
        trl_child(cfg, Path(args.trl_child), problems, cfg.run.eval_every or 0)
        return 0
    thread_vars_check(args.clear_thread_vars)
    before = greedy_accuracy(cfg.model.path, cfg, problems)
    print(f"{args.tag or 'bench_vs_trl'}: {cfg.model.path}, {cfg.run.steps} steps of {cfg.data.prompts_per_step} "
          f"prompts x {cfg.rollout.width}, {cfg.rollout.max_response_tokens} tokens; greedy eval on "
          f"{len(problems)} problems before training: {before:.3f}", flush=True)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as tmp:
        base = Path(args.out) if args.out else Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            for system in args.systems:
                out = base / f"{system}-{seed}"
                start = run_arbor if system == "arbor" else run_trl
                # Both systems' periodic evals score the problems the evals here score.
                overrides = [*args.overrides, f"eval.max_problems={len(problems)}"]
                run, model_dir = start(args.config, overrides, seed, out)
                run.eval_after = greedy_accuracy(model_dir, cfg, problems)
                runs.append(run)
                shown = " ".join(f"{t:.0f}s:{a:.3f}" for _, t, a in run.curve)
                print(f"seed {seed} {system:5s} wall_s={run.wall_s:.1f} train_s={run.train_s:.1f} "
                      f"cpu_s={run.cpu_s:.1f} eval {before:.3f} -> {run.eval_after:.3f} reward first/last "
                      f"{run.rewards[0] if run.rewards else float('nan'):.3f}/"
                      f"{run.rewards[-1] if run.rewards else float('nan'):.3f} periodic evals {shown}", flush=True)
                if args.out:
                    (base / "runs.json").write_text(json.dumps(
                        {"eval_before": before, "runs": [dataclasses.asdict(r) for r in runs]}))
    if args.plot:
        plot(runs, ROOT / args.plot, title)
        print(f"plot: {args.plot}")
    print(result_line(runs, args.systems, before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
