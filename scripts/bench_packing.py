"""Tree-packed vs linear training: forward + backward time and peak memory, side by side.

    python scripts/bench_packing.py [--reps 5] [--threads 2] [--attention auto]

A tiny Qwen2-style model (hidden 256, 4 layers, 8 heads, vocab 4096, random weights)
runs ``policy_loss`` forward + backward on the same trees in ``mode="tree"`` and
``mode="padded"`` (every leaf its own right-padded sequence), interleaved, medians:

  (a) 16 leaves sharing a 512-token prefix, 64-token branches (ideal 6×)
  (b) a TreePO-shaped binary tree: depth 4, 64-token segments, 16 leaves
  (c) no sharing: 16 single-leaf trees of 64 + 256 tokens

``--threads`` sets ``torch.set_num_threads`` (default 2, the machine's cores). On a
machine shared with other jobs use ``--threads 1``: with 2 threads every small op waits
at a barrier for a thread the OS may have descheduled, so wall times swing with other
processes' load (tree mode, with 6× smaller ops, suffers most). CPU time is printed beside
wall time for the same reason.

Ends with ``RESULT speedup=<a: linear/tree> ideal=<a: linearised/unique tokens>
fraction=<speedup/ideal> nosharing_ratio=<c: tree/linear>``.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arbor.packed_loss import policy_loss  # noqa: E402
from arbor.tree import RolloutTree  # noqa: E402

VOCAB = 4096


def build_model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=1024, vocab_size=VOCAB, attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(cfg).float().train()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def segment(tree: RolloutTree, parent, rng: random.Random, n: int):
    return tree.add_segment(parent, tokens(rng, n), logprobs=[-rng.random() for _ in range(n)])


def case_shared_prefix(rng: random.Random) -> list[RolloutTree]:
    """(a) 16 leaves under one 512-token prefix (a 32-token prompt + a 480-token segment)."""
    tree = RolloutTree(tokens(rng, 32), problem={"id": "a"})
    stem = segment(tree, tree.root, rng, 480)
    for _ in range(16):
        segment(tree, stem, rng, 64)
    return [tree]


def case_binary(rng: random.Random) -> list[RolloutTree]:
    """(b) TreePO-shaped: binary, depth 4, 64-token segments → 2+4+8+16 nodes, 16 leaves."""
    tree = RolloutTree(tokens(rng, 64), problem={"id": "b"})
    frontier = [tree.root]
    for _ in range(4):
        frontier = [segment(tree, p, rng, 64) for p in frontier for _ in range(2)]
    return [tree]


def case_no_sharing(rng: random.Random) -> list[RolloutTree]:
    """(c) 16 independent trees, one leaf each: nothing to share."""
    trees = []
    for i in range(16):
        tree = RolloutTree(tokens(rng, 64), problem={"id": f"c{i}"})
        segment(tree, tree.root, rng, 256)
        trees.append(tree)
    return trees


CASES = {"a": case_shared_prefix, "b": case_binary, "c": case_no_sharing}


def step(
    model: torch.nn.Module, trees: list[RolloutTree], advantages, mode: str, attention: str
) -> tuple[float, float]:
    """One forward + backward: (wall seconds, process CPU seconds)."""
    model.zero_grad(set_to_none=True)
    t0, c0 = time.perf_counter(), time.process_time()
    loss, _ = policy_loss(model, trees, advantages, mode=mode, attention=attention, pack_tokens=1 << 15)
    loss.backward()
    return time.perf_counter() - t0, time.process_time() - c0


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def measure_memory(case: str, mode: str, attention: str) -> None:
    """In a fresh process: peak RSS growth of one step over the RSS before it (MiB).

    RSS is sampled every millisecond by a thread: ru_maxrss cannot be used, Linux carries
    it over from the parent across fork + exec.
    """
    model = build_model()
    rng = random.Random(0)
    trees = CASES[case](rng)
    advantages = [[1.0] * len(t.leaves()) for t in trees]
    before = rss_mib()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    step(model, trees, advantages, mode, attention)
    done.set()
    sampler.join()
    print(f"{max(peak[0], rss_mib()) - before:.1f}")


def peak_memory(case: str, mode: str, attention: str) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--memory", case, mode, "--attention", attention],
        capture_output=True, text=True, check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--attention", default="auto", choices=["auto", "blocks", "dense", "flex"])
    parser.add_argument("--memory", nargs=2, metavar=("CASE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory:
        return measure_memory(*args.memory, args.attention)
    model = build_model()
    results = {}
    for name, build in CASES.items():
        rng = random.Random(0)
        trees = build(rng)
        advantages = [[rng.gauss(0, 1) for _ in t.leaves()] for t in trees]
        unique = sum(t.stats().unique_tokens for t in trees)
        linear = sum(t.stats().linearised_tokens for t in trees)
        for mode in ("tree", "padded"):  # warm-up
            step(model, trees, advantages, mode, args.attention)
        times: dict[str, list[float]] = {"tree": [], "padded": []}
        cpu: dict[str, list[float]] = {"tree": [], "padded": []}
        for _ in range(args.reps):  # interleaved, so drifts in machine load hit both
            for mode in ("tree", "padded"):
                wall, used = step(model, trees, advantages, mode, args.attention)
                times[mode].append(wall)
                cpu[mode].append(used)
        tree_t, linear_t = statistics.median(times["tree"]), statistics.median(times["padded"])
        # CPU seconds are less sensitive to other processes on a shared machine than wall
        # time; printed beside it, the RESULT line uses wall time.
        tree_c, linear_c = statistics.median(cpu["tree"]), statistics.median(cpu["padded"])
        mem = {m: peak_memory(name, m, args.attention) for m in ("tree", "padded")}
        results[name] = (linear_t / tree_t, linear / unique)
        print(
            f"case {name}: unique {unique} tokens, linearised {linear} (ideal {linear / unique:.2f}x) | "
            f"tree {tree_t * 1e3:.0f} ms, linear {linear_t * 1e3:.0f} ms, speedup {linear_t / tree_t:.2f}x "
            f"(CPU time {tree_c * 1e3:.0f} / {linear_c * 1e3:.0f} ms: {linear_c / tree_c:.2f}x) | "
            f"peak step memory tree {mem['tree']:.0f} MiB, linear {mem['padded']:.0f} MiB",
            flush=True,
        )
    speedup, ideal = results["a"]
    print(f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB, "
          f"threads {args.threads}, attention {args.attention}, load average {os.getloadavg()[0]:.1f}")
    print(
        f"RESULT speedup={speedup:.2f} ideal={ideal:.2f} fraction={speedup / ideal:.2f} "
        f"nosharing_ratio={1 / results['c'][0]:.2f}"
    )


if __name__ == "__main__":
    main()
