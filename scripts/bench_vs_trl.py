"""arbor against TRL's GRPOTrainer on the quickstart's task, side by side in one run.

    pip install -e ".[bench]"          # TRL
    python scripts/bench_vs_trl.py [--seeds 0 1 2] [--systems arbor trl] [--tag NAME]
        [--config configs/quickstart.yaml] [--eval-problems 200] [--plot docs/figures/vs-trl.png]
        [--clear-thread-vars] [section.key=value ...]

Per seed, each system trains models/tiny-arith on the same problems (``data.train_path``),
prompts (the chat template with ``data.prompt_suffix``), reward (``rewards/math.py:boxed_accuracy``)
and settings, all read from the config (``section.key=value`` overrides apply to both):

- **arbor**: ``arbor train CONFIG`` as a user runs it (Ray, ``arbor serve``, DeepSpeed ZeRO-3,
  tree rollouts of ``rollout.width`` leaves), its periodic evals (``run.eval_every``) and
  checkpoints included: the config as shipped;
- **TRL**: ``GRPOTrainer`` with ``data.prompts_per_step`` prompts x ``rollout.width``
  completions per step (one optimizer step each), ``rollout.max_response_tokens`` tokens,
  ``rollout.temperature``, ``optim.lr`` with ``optim.warmup_steps`` and ``optim.schedule``,
  ``optim.max_grad_norm``, clipping ``loss.clip_low`` / ``loss.clip_high``, ``loss_type:
  dapo``, ``beta`` = ``loss.kl_coef`` (0: no KL), ``run.steps`` steps, no checkpoints, on the CPU.

Each system runs at its own defaults: no thread setting favours either. The script refuses
to start when a thread variable (``OMP_NUM_THREADS`` and the like) is set, since both
children would inherit it (with ``OMP_NUM_THREADS=1`` TRL runs on one core of the machine);
``--clear-thread-vars`` removes them for both, saying so.

Each system runs in its own process, timed from its start to its exit (``wall_s``), and its
whole process tree's CPU time is summed (``cpu_s``: Ray's workers and the engine server
included; polled every 0.2 s, so a process that lives less than that may be missed). The
reward curve is each step's mean reward over the completions sampled (arbor: every tree
sampled, dynamic-sampling refills included). Before and after, the same greedy eval scores
the model (``--eval-problems`` of ``data.eval_path``, ``rollout.max_response_tokens`` new
tokens, stopping on the model's stop tokens, in transformers): ``eval_before`` is the
starting model, ``arbor_eval`` / ``trl_eval`` the trained ones (means over seeds).

The plot (``--plot``) shows the reward curves, one thin line per seed and the mean. Ends
with ``RESULT wall_ratio=<arbor/trl wall> arbor_wall_s=... trl_wall_s=... arbor_cpu_s=...
trl_cpu_s=... eval_before=... arbor_eval=... trl_eval=...`` (means over seeds; a system
left out of ``--systems`` is left out of the line). Run it on a quiet machine: both systems
are CPU-bound, and anything else running changes both walls.
"""

from __future__ import annotations

import argparse
import json
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

    rewards = [m["reward/mean"] for m in read_metrics(out) if "reward/mean" in m]
    return Run("arbor", seed, wall, cpu, float("nan"), rewards), out / "hf"


def run_trl(config: str, overrides: list[str], seed: int, out: Path) -> tuple[Run, Path]:
    """TRL's GRPOTrainer (this script's ``--trl-child``) on ``seed``; the run and its model."""
    command = [sys.executable, __file__, "--trl-child", str(out), "--config", config, *overrides,
               f"run.seed={seed}"]
    wall, cpu = timed(command, out.parent / f"{out.name}.log")
    rewards = json.loads((out / "rewards.json").read_text())
    return Run("trl", seed, wall, cpu, float("nan"), rewards), out / "model"


def trl_child(cfg: Config, out: Path) -> None:
    """Train with GRPOTrainer on the config's task; writes ``out/model`` and ``out/rewards.json``."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from arbor.data import load_problems, prompt_messages
    from rewards.math import boxed_accuracy

    def reward(prompts, completions, answer, id, **_) -> list[float]:  # noqa: A002 (TRL passes the column)
        return [boxed_accuracy({"id": i, "answer": a}, c[-1]["content"] if isinstance(c, list) else c)
                for c, a, i in zip(completions, answer, id)]

    reward.__name__ = "boxed_accuracy"
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
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    trainer.save_model(str(out / "model"))
    tokenizer.save_pretrained(str(out / "model"))
    (out / "rewards.json").write_text(json.dumps(rewards))


def greedy_accuracy(model_dir: Path | str, cfg: Config, problems: list[dict]) -> float:
    """Greedy accuracy of ``model_dir`` on ``problems``: the config's prompts, at most
    ``rollout.max_response_tokens`` new tokens, scored by ``boxed_accuracy``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arbor.data import format_prompt, stop_token_ids
    from rewards.math import boxed_accuracy

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stops = stop_token_ids(tokenizer, str(model_dir))
    by_length: dict[int, list[tuple[dict, list[int]]]] = {}
    for p in problems:  # prompts of one length batch without padding
        ids = format_prompt(p, cfg.data, tokenizer, cfg.model.chat_template)
        by_length.setdefault(len(ids), []).append((p, ids))
    correct = 0.0
    with torch.no_grad():
        for length, group in by_length.items():
            batch = torch.tensor([ids for _, ids in group])
            out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                                 max_new_tokens=cfg.rollout.max_response_tokens, eos_token_id=stops,
                                 pad_token_id=stops[0])
            for (problem, _), row in zip(group, out[:, length:].tolist()):
                cut = next((i for i, t in enumerate(row) if t in stops), len(row))
                correct += boxed_accuracy(problem, tokenizer.decode(row[:cut], skip_special_tokens=True))
    return correct / len(problems)


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for system, color in (("arbor", "tab:green"), ("trl", "tab:blue")):
        mine = [r for r in runs if r.system == system and r.rewards]
        if not mine:
            continue
        for r in mine:
            ax.plot(range(1, len(r.rewards) + 1), r.rewards, color=color, alpha=0.25, linewidth=0.8)
        steps = min(len(r.rewards) for r in mine)
        mean = [statistics.fmean(r.rewards[s] for r in mine) for s in range(steps)]
        wall = statistics.fmean(r.wall_s for r in mine)
        after = statistics.fmean(r.eval_after for r in mine)
        ax.plot(range(1, steps + 1), mean, color=color, linewidth=2,
                label=f"{'arbor' if system == 'arbor' else 'TRL GRPOTrainer'}: {wall:.0f} s, eval {after:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the step's samples")
    ax.set_title(f"quickstart task, {len({r.seed for r in runs})} seed(s)")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--systems", nargs="+", choices=["arbor", "trl"], default=["arbor", "trl"])
    parser.add_argument("--eval-problems", type=int, default=200, help="the first N of data.eval_path")
    parser.add_argument("--plot", default="docs/figures/vs-trl.png", help="'' for none")
    parser.add_argument("--tag", default="", help="a name for this comparison in the printed lines")
    parser.add_argument("--clear-thread-vars", action="store_true",
                        help="remove OMP_NUM_THREADS and the like for both systems instead of refusing to run")
    parser.add_argument("--trl-child", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args()
    cfg = load_config(ROOT / args.config, args.overrides)
    if args.trl_child:
        trl_child(cfg, Path(args.trl_child))
        return 0
    thread_vars_check(args.clear_thread_vars)
    if cfg.data.eval_path is None:
        raise SystemExit("bench_vs_trl: the config has no data.eval_path to evaluate on")
    from arbor.data import load_problems

    problems = load_problems(cfg.data.eval_path, cfg.data)[: args.eval_problems]
    before = greedy_accuracy(cfg.model.path, cfg, problems)
    print(f"{args.tag or 'bench_vs_trl'}: {cfg.model.path}, {cfg.run.steps} steps of {cfg.data.prompts_per_step} "
          f"prompts x {cfg.rollout.width}, {cfg.rollout.max_response_tokens} tokens; greedy eval on "
          f"{len(problems)} problems before training: {before:.3f}", flush=True)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as tmp:
        for seed in args.seeds:
            for system in args.systems:
                out = Path(tmp) / f"{system}-{seed}"
                start = run_arbor if system == "arbor" else run_trl
                run, model_dir = start(args.config, args.overrides, seed, out)
                run.eval_after = greedy_accuracy(model_dir, cfg, problems)
                runs.append(run)
                print(f"seed {seed} {system:5s} wall_s={run.wall_s:.1f} cpu_s={run.cpu_s:.1f} "
                      f"eval {before:.3f} -> {run.eval_after:.3f} reward first/last "
                      f"{run.rewards[0] if run.rewards else float('nan'):.3f}/"
                      f"{run.rewards[-1] if run.rewards else float('nan'):.3f}", flush=True)
    if args.plot:
        plot(runs, ROOT / args.plot)
        print(f"plot: {args.plot}")

    def mean(system: str, attr: str) -> float:
        return statistics.fmean(getattr(r, attr) for r in runs if r.system == system)

    result = ""
    if {"arbor", "trl"} <= set(args.systems):
        result += f" wall_ratio={mean('arbor', 'wall_s') / mean('trl', 'wall_s'):.3f}"
    for system in args.systems:
        result += f" {system}_wall_s={mean(system, 'wall_s'):.1f} {system}_cpu_s={mean(system, 'cpu_s'):.1f}"
    result += f" eval_before={before:.3f}"
    for system in args.systems:
        result += f" {system}_eval={mean(system, 'eval_after'):.3f}"
    print("RESULT" + result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
