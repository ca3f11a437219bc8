"""One RL step, TreePO + tree packing vs GRPO + linear training, side by side in one run.

    python scripts/bench_train_step.py [--prompts 4] [--width 16] [--branch 2]
        [--segment-tokens 32] [--max-depth 8] [--repeats 3] [--hidden 256] [--layers 4]
        [--reward coin|boxed] [--threads 1]

A random Qwen2 (``tests/tiny_model.py``, hidden 256, 4 layers, vocab 320) is served by
``arbor serve`` (through the launcher) and trained by a single-process
``arbor.train.learner.Learner`` (backend torch, float32, the same config for both modes, each
mode its own fresh copy of the weights). Problems are made-up sums ("What is 37+48?")
with numeric answers. One step, each phase timed:

1. rollout: ``sample_trees`` — ``mode: tree`` (width ``w`` leaves, ``branch``-way forks,
   ``max_depth`` segments of ``segment_tokens``) vs ``mode: independent`` (one request
   ``n = w`` with the whole budget ``max_depth · segment_tokens``); radix cache flushed
   before each rollout, as after a weight update;
2. reward: decode every leaf, score it with ``rewards/math.py:boxed_accuracy`` in a
   ``RewardPool`` (kept alive, as the trainer does);
3. advantage: ``compute_advantages`` — ``treepo`` (token-whitened, docs/algorithms.md) vs
   ``grpo`` (plain group-normalised);
4. pack: ``pack_trees`` on the trees vs on ``linearise_trees(...)`` (every leaf its own
   sequence: ordinary linear training through the same learner code);
5. train: one ``Learner.step`` (forward + backward over every pack, one AdamW update).

Rewards: the random model never writes ``\\boxed{}``, so with ``--reward coin`` (the
default) each completion gets a boxed answer appended before scoring — the right one or
one off, by a coin seeded per (repeat, problem, leaf) — and the real checker scores it:
a fixed random reward whose scoring cost is math-verify's. ``--reward boxed`` scores the
model's own text (all 0 for an untrained model: every advantage is then 0).

Not measured: the weight push to the engine. It costs the same in both modes (same
model), so it would add one constant to both sides; the engine keeps the initial
weights, so both modes sample from the same policy in every repeat.

After a warm-up step of each mode, ``--repeats`` steps per mode run alternately (the
first mode alternates too); medians per phase. ``--threads`` sets ``torch.set_num_threads``
here and ``OMP_NUM_THREADS`` of the server (default 1: the machine is shared). CPU
seconds (this process + the server, from /proc) are printed beside wall time: the work
done, less sensitive to other processes than wall time; during rollout the client and
the server run at once, so there CPU seconds may exceed wall seconds. Ends with

    RESULT step_speedup=<grpo_linear / treepo_tree step seconds> rollout_ratio=...
           train_ratio=... train_tokens_ratio=... rollout_compute_ratio=... cpu_step_speedup=...
           per_token_speedup=... len_ratio=<tree / linear mean response tokens>
           step_ideal=<the step speed-up at the token ratios> step_fraction=<step_speedup / step_ideal>

(ratios are linear / tree: > 1 means the tree mode is cheaper). Both modes give ``width``
trajectories per prompt, but not of the same length: TreePO hands the budget of paths
that end early to the survivors, so its leaves run longer on average (``len_ratio``).
``per_token_speedup`` compares step seconds per response token of the trajectories.
``step_ideal``: the speed-up if the tree step's rollout cost the linear one's times the
ratio of tokens the engines computed, and its training the linear one's times the ratio of
tokens forwarded (other phases as the linear step's); ``step_fraction`` how much of it is
reached. At a chain-of-thought task's shapes (answers of 60–150 tokens, width 8–16,
segments of 16–32 tokens): ``--width 16 --segment-tokens 24 --max-depth 6``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from arbor.config import LearnerConfig, LossConfig, ModelConfig, OptimConfig, RolloutConfig  # noqa: E402
from arbor.engines.client import SGLangClient  # noqa: E402
from arbor.engines.launch import launch_engines  # noqa: E402
from arbor.rollout.rewards import RewardPool  # noqa: E402
from arbor.rollout.sampler import sample_trees  # noqa: E402
from arbor.train.advantage import compute_advantages  # noqa: E402
from arbor.train.learner import Learner  # noqa: E402
from arbor.train.packing import linearise_trees, loss_denominator, pack_trees  # noqa: E402
from arbor.tree import RolloutTree  # noqa: E402

EOS_ID = 0  # tests/tiny_model.py's <|endoftext|>
VOCAB = 320
REWARD = "rewards/math.py:boxed_accuracy"
INSTRUCTION = " Put the answer in \\boxed{}."
PHASES = ("rollout", "reward", "advantage", "pack", "train")


@dataclass
class Mode:
    name: str
    rollout: RolloutConfig
    estimator: str  # arbor.train.advantage estimator
    whiten: bool
    linear: bool  # train on linearise_trees(...) instead of the trees
    learner: Learner


@dataclass
class StepRecord:
    """What one step of one mode cost."""

    seconds: dict[str, float]  # phase -> wall seconds
    cpu: dict[str, float]  # phase -> CPU seconds of this process and the server
    rollout_computed: int  # prefill + decode tokens the engine ran
    train_tokens: int  # tokens forwarded by the learner (Σ pack sizes)
    trained_tokens: int  # tokens entering the loss (unique in tree packs)
    trajectories: int
    response_tokens: int  # Σ over leaves of the response length (linearised)
    eos_leaves: int  # leaves that ended on EOS (the rest hit a length or depth limit)
    packs: int
    reward_mean: float

    @property
    def step(self) -> float:
        return sum(self.seconds.values())


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_problems(count: int, tokenizer) -> tuple[list[dict], list[list[int]]]:
    rng = random.Random(0)
    problems, prompts = [], []
    for i in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        problems.append({"id": f"sum-{i}", "answer": str(a + b)})
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a}+{b}?{INSTRUCTION}"}],
            add_generation_prompt=True, tokenize=True,
        )
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return problems, prompts


async def rollout(url: str, mode: Mode, problems: list[dict], prompts: list[list[int]], seed: int):
    async with SGLangClient([url]) as client:
        return await sample_trees(
            client, problems, prompts, mode.rollout, eos_token_ids=[EOS_ID], seed=seed
        )


async def flush(url: str) -> None:
    async with SGLangClient([url]) as client:
        await client.flush_cache()


def score(trees: list[RolloutTree], pool: RewardPool, tokenizer, how: str, seed: int) -> None:
    """Set every leaf's reward (see the module docstring for ``coin``)."""
    items, leaves = [], []
    for t, tree in enumerate(trees):
        for b, leaf in enumerate(tree.leaves()):
            text = tokenizer.decode(tree.response_ids(leaf), skip_special_tokens=True)
            if how == "coin":
                right = random.Random(f"{seed}/{t}/{b}").random() < 0.5
                answer = int(tree.problem["answer"]) + (0 if right else 1)
                text += f" \\boxed{{{answer}}}"
            items.append((tree.problem, text))
            leaves.append(leaf)
    result = pool.score(items)
    if result.timeouts:
        print(f"  {result.timeouts} reward checks timed out (scored 0)", flush=True)
    for leaf, value in zip(leaves, result.scores):
        leaf.reward = value


def run_step(mode: Mode, url: str, pid: int, pool: RewardPool, tokenizer, problems, prompts,
             seed: int, args: argparse.Namespace) -> StepRecord:
    asyncio.run(flush(url))  # not timed: every step starts from an empty radix cache
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}
    t, c = time.perf_counter(), time.process_time() + cpu_seconds(pid)

    def lap(phase: str) -> None:
        nonlocal t, c
        now, now_cpu = time.perf_counter(), time.process_time() + cpu_seconds(pid)
        seconds[phase], cpu[phase] = now - t, now_cpu - c
        t, c = now, now_cpu

    trees, stats = asyncio.run(rollout(url, mode, problems, prompts, seed))
    lap("rollout")
    score(trees, pool, tokenizer, args.reward, seed)
    lap("reward")
    advantages = compute_advantages(trees, mode.estimator, whiten_tokens=mode.whiten)
    lap("advantage")
    batch, batch_adv = linearise_trees(trees, advantages) if mode.linear else (trees, advantages)
    packs = pack_trees(batch, batch_adv, pack_tokens=args.pack_tokens, normalize="token")
    denominator = loss_denominator(batch, "token")
    lap("pack")
    mode.learner.step(packs, denominator)
    lap("train")
    leaves = [leaf for tree in trees for leaf in tree.leaves()]
    return StepRecord(
        seconds=seconds,
        cpu=cpu,
        rollout_computed=sum(s.tokens_computed for s in stats),
        train_tokens=sum(p.num_tokens for p in packs),
        trained_tokens=sum(int(p.trained.sum()) for p in packs),
        trajectories=len(leaves),
        response_tokens=sum(leaf.end for leaf in leaves),
        eos_leaves=sum(leaf.finish_reason == "stop" for leaf in leaves),
        packs=len(packs),
        reward_mean=sum(leaf.reward for leaf in leaves) / max(len(leaves), 1),
    )


def median(records: list[StepRecord], key) -> float:
    return statistics.median(key(r) for r in records)


def report(tree: list[StepRecord], linear: list[StepRecord]) -> None:
    rows: list[tuple[str, object]] = [(f"{p} s", lambda r, p=p: r.seconds[p]) for p in PHASES]
    rows += [("step s", lambda r: r.step)]
    rows += [(f"{p} cpu s", lambda r, p=p: r.cpu[p]) for p in ("rollout", "train")]
    rows += [
        ("step cpu s", lambda r: sum(r.cpu.values())),
        ("rollout tokens computed", lambda r: r.rollout_computed),
        ("train tokens forwarded", lambda r: r.train_tokens),
        ("tokens in the loss", lambda r: r.trained_tokens),
        ("packs", lambda r: r.packs),
        ("trajectories", lambda r: r.trajectories),
        ("leaves ended by EOS", lambda r: r.eos_leaves),
        ("mean response tokens", lambda r: r.response_tokens / r.trajectories),
        ("step ms / response token", lambda r: 1000 * r.step / r.response_tokens),
        ("mean reward", lambda r: r.reward_mean),
    ]
    print(f"\nmedians over {len(tree)} steps per mode; ratio = grpo+linear / treepo+tree")
    print(f"{'':26s}{'treepo+tree':>14s}{'grpo+linear':>14s}{'ratio':>9s}")
    for name, key in rows:
        a, b = median(tree, key), median(linear, key)
        print(f"{name:26s}{a:14.3f}{b:14.3f}{b / a if a else float('nan'):9.2f}")


def ideal_step_speedup(tree: list[StepRecord], linear: list[StepRecord]) -> float:
    """The step speed-up if the tree step cost the linear one's seconds scaled by tokens.

    Rollout scales with the tokens the engine computed, training with the tokens the
    learner forwarded, the other phases (rewards, advantages, packing) stay as the linear
    step's: linear step seconds / (Σ_phase linear seconds / token ratio of the phase).
    """
    def tokens_ratio(key) -> float:
        return median(linear, key) / median(tree, key)

    scale = {"rollout": tokens_ratio(lambda r: r.rollout_computed), "train": tokens_ratio(lambda r: r.train_tokens)}
    ideal_tree = sum(median(linear, lambda r, p=p: r.seconds[p]) / scale.get(p, 1.0) for p in PHASES)
    return median(linear, lambda r: r.step) / ideal_tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--branch", type=int, default=2)
    parser.add_argument("--segment-tokens", type=int, default=32)
    parser.add_argument("--max-depth", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pack-tokens", type=int, default=4096)
    parser.add_argument("--reward", choices=("coin", "boxed"), default="coin")
    parser.add_argument("--reward-workers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads here and in the server")
    args = parser.parse_args()

    from tiny_model import build_tiny_model_dir
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server inherits it
    common = dict(width=args.width, branch=args.branch, segment_tokens=args.segment_tokens,
                  max_depth=args.max_depth)
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-train-step-") as tmp:
        model_dir = build_tiny_model_dir(
            Path(tmp) / "model", vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers
        )
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        problems, prompts = make_problems(args.prompts, tokenizer)

        def learner() -> Learner:  # a fresh copy of the initial weights, same config
            return Learner(
                ModelConfig(path=str(model_dir)),
                LearnerConfig(backend="torch", device="cpu", dtype="float32", pack_tokens=args.pack_tokens),
                OptimConfig(lr=1e-6), LossConfig(), total_steps=1000,
            )

        tree_mode = Mode("treepo+tree", RolloutConfig(mode="tree", **common), "treepo", True, False, learner())
        linear_mode = Mode("grpo+linear", RolloutConfig(mode="independent", **common), "grpo", False, True,
                           learner())
        with (
            launch_engines("embedded", model_path=str(model_dir), log_dir=Path(tmp) / "logs",
                           startup_timeout_s=300) as handle,
            RewardPool(REWARD, workers=args.reward_workers, timeout_s=5.0, search_dirs=[str(ROOT)]) as pool,
        ):
            url, pid = handle.urls[0], handle.processes[0].pid
            print(
                f"Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {VOCAB}, {args.threads} "
                f"thread(s); {args.prompts} prompts of ~{statistics.mean(map(len, prompts)):.0f} tokens, "
                f"width {args.width}, branch {args.branch}, {args.max_depth} x {args.segment_tokens} "
                f"tokens, pack_tokens {args.pack_tokens}, reward {args.reward}",
                flush=True,
            )
            results: dict[str, list[StepRecord]] = {tree_mode.name: [], linear_mode.name: []}
            # Warm-up, not timed: first shapes are slow (allocator, oneDNN kernel choice),
            # the reward workers import math-verify, AdamW allocates its state.
            for mode in (tree_mode, linear_mode):
                run_step(mode, url, pid, pool, tokenizer, problems, prompts, 10_000, args)
            for repeat in range(args.repeats):
                order = [tree_mode, linear_mode] if repeat % 2 == 0 else [linear_mode, tree_mode]
                for mode in order:
                    record = run_step(mode, url, pid, pool, tokenizer, problems, prompts, repeat, args)
                    results[mode.name].append(record)
                    phases = " ".join(f"{p} {record.seconds[p]:.2f}" for p in PHASES)
                    print(f"repeat {repeat} {mode.name}: step {record.step:.2f}s ({phases})", flush=True)
    tree, linear = results[tree_mode.name], results[linear_mode.name]
    report(tree, linear)

    def ratio(key) -> float:
        return median(linear, key) / median(tree, key)

    print(f"load after: {os.getloadavg()[0]:.2f}")
    ideal = ideal_step_speedup(tree, linear)
    print(
        f"RESULT step_speedup={ratio(lambda r: r.step):.3f} "
        f"rollout_ratio={ratio(lambda r: r.seconds['rollout']):.3f} "
        f"train_ratio={ratio(lambda r: r.seconds['train']):.3f} "
        f"train_tokens_ratio={ratio(lambda r: r.train_tokens):.3f} "
        f"rollout_compute_ratio={ratio(lambda r: r.rollout_computed):.3f} "
        f"cpu_step_speedup={ratio(lambda r: sum(r.cpu.values())):.3f} "
        f"per_token_speedup={ratio(lambda r: r.step / r.response_tokens):.3f} "
        f"len_ratio={1 / ratio(lambda r: r.response_tokens):.3f} "
        f"step_ideal={ideal:.3f} step_fraction={ratio(lambda r: r.step) / ideal:.3f}"
    )


if __name__ == "__main__":
    main()
