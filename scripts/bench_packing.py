"""Tree-packed vs linear training: forward + backward time and peak memory, side by side.

    python scripts/bench_packing.py [--reps 5] [--threads 2] [--attention auto] [--smoke]
    python scripts/bench_packing.py --real [--attention flex|dense]   # on a CUDA GPU

A tiny Qwen2-style model (hidden 256, 4 layers, 8 heads, vocab 4096, random weights)
runs ``policy_loss`` forward + backward on the same trees three ways, interleaved, medians:

- ``tree``: tree packing, every shared prefix once;
- ``packed``: the fair linear baseline, what verl, slime and OpenRLHF do: every leaf's
  full path its own sequence (``linearise_trees``), the sequences packed unpadded one after
  another with causal attention inside each (``pack_trees`` on the chains) through the
  same attention kernel as ``tree``;
- ``padded``: ``mode="padded"``, every leaf its own right-padded row of one batch.

Cases:

  (a) 16 leaves sharing a 512-token prefix, 64-token branches (ideal 6×)
  (b) a TreePO-shaped binary tree: depth 4, 64-token segments, 16 leaves
  (c) no sharing: 16 single-leaf trees of 64 + 256 tokens
  (d) uneven: 4 TreePO trees (``--uneven-trees``) with early stops (width ≤ 16, binary forks, segments of
      16–32 tokens, up to 6 deep; a path stops after a segment with probability 1/4, so
      leaves run 16–190 response tokens) — a chain-of-thought task's shapes

Per case: speed-up of ``tree`` over each baseline, its ideal (the token-count ratio:
linearised / unique tokens for ``packed``, padded / unique for ``padded``) and the
fraction of the ideal reached. ``--threads`` sets ``torch.set_num_threads`` (default 2,
the machine's cores). On a machine shared with other jobs use ``--threads 1``: with 2
threads every small op waits at a barrier for a thread the OS may have descheduled, so
wall times swing with other processes' load (tree mode, with 6× smaller ops, suffers
most). CPU time is printed beside wall time for the same reason. ``--smoke``: a tiny
model, cases shrunk 8×, one repeat, no memory runs (checks the script, measures nothing).

``--real`` (CUDA): the scale the method is for — a Qwen2.5-0.5B-shaped model (24 layers,
hidden 896, 14 query / 2 KV heads, MLP 4864, vocabulary 151,936, tied; random weights) in
bf16 on the GPU, case (a) scaled to 16 leaves × (2,048-token prefix + 512), the LM head
chunked as the learner runs it (1,024 tokens), times synchronised with the GPU, and peak
GPU memory per step (``torch.cuda.max_memory_allocated`` over what was allocated before
it) in-process. ``--attention flex`` (the CUDA default) or ``dense`` (one [N, N] mask
through SDPA) picks the kernel of ``tree`` and ``packed``; ``padded`` is the model's own
causal SDPA either way.

Ends with ``RESULT speedup=<a: padded/tree> ideal=<a: linearised/unique tokens>
fraction=<speedup/ideal> nosharing_ratio=<c: tree/padded>
uneven_speedup=<d: packed/tree> uneven_ideal=<d: linearised/unique>
uneven_fraction=<d: speedup/ideal> uneven_speedup_padded=<d: padded/tree>
uneven_ideal_padded=<d: padded/unique> uneven_fraction_padded=<d>
nosharing_ratio_packed=<c: tree/packed>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arbor.train.packed_loss import policy_loss  # noqa: E402
from arbor.train.packing import linearise_trees  # noqa: E402
from arbor.tree import RolloutTree  # noqa: E402

MODES = ("tree", "packed", "padded")
# --real leaves out "padded": arbor's reference path keeps whole logits, [leaves × response
# tokens, 151,936] — 11.5 GiB in bf16 for case (a), plus float32 copies — out of memory on an
# 80 GB H100; the fair baseline ("packed") runs the learner's chunked LM head as "tree" does.
REAL_MODES = ("tree", "packed")
PACK_TOKENS = 1 << 16  # every case in one pack: one varlen batch, as the linear frameworks run it


@dataclass
class Shape:
    """The cases' scale: token counts divided by ``shrink`` (8 under ``--smoke``), the
    vocabulary token ids are drawn from, and case (a)'s prefix and branch lengths."""

    shrink: int = 1
    vocab: int = 4096
    prefix: int = 512
    branch: int = 64
    uneven_trees: int = 4  # case (d)'s trees (--uneven-trees; a quickstart step has 32)

    def __call__(self, n: int) -> int:
        return max(2, n // self.shrink)


SMOKE = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64)
TOY = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
           intermediate_size=1024)
QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, tie_word_embeddings=True)
REAL = Shape(vocab=151936, prefix=2048, branch=512)  # --real: case (a) at 16 × (2,048 + 512)


def build_model(smoke: bool = False, real: bool = False) -> torch.nn.Module:
    """The toy model; ``smoke``: a tinier one; ``real``: the 0.5B shape in bf16 on the GPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    size, vocab = (QWEN25_05B, REAL.vocab) if real else (SMOKE if smoke else TOY, Shape().vocab)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, attn_implementation="sdpa", **size))
    return (model.to(dtype=torch.bfloat16, device="cuda") if real else model.float()).train()


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def segment(tree: RolloutTree, parent, rng: random.Random, n: int, vocab: int):
    return tree.add_segment(parent, tokens(rng, n, vocab), logprobs=[-rng.random() for _ in range(n)])


def case_shared_prefix(rng: random.Random, size: Shape) -> list[RolloutTree]:
    """(a) 16 leaves under one shared prefix (a 32-token prompt + a segment), 512 + 64 tokens
    each (``--real``: 2,048 + 512)."""
    tree = RolloutTree(tokens(rng, size(32), size.vocab), problem={"id": "a"})
    stem = segment(tree, tree.root, rng, size(size.prefix - 32), size.vocab)
    for _ in range(16):
        segment(tree, stem, rng, size(size.branch), size.vocab)
    return [tree]


def case_binary(rng: random.Random, size: Shape) -> list[RolloutTree]:
    """(b) TreePO-shaped: binary, depth 4, 64-token segments → 2+4+8+16 nodes, 16 leaves."""
    tree = RolloutTree(tokens(rng, size(64), size.vocab), problem={"id": "b"})
    frontier = [tree.root]
    for _ in range(4):
        frontier = [segment(tree, p, rng, size(64), size.vocab) for p in frontier for _ in range(2)]
    return [tree]


def case_no_sharing(rng: random.Random, size: Shape) -> list[RolloutTree]:
    """(c) 16 independent trees, one leaf each: nothing to share."""
    trees = []
    for i in range(16):
        tree = RolloutTree(tokens(rng, size(64), size.vocab), problem={"id": f"c{i}"})
        segment(tree, tree.root, rng, size(256), size.vocab)
        trees.append(tree)
    return trees


def case_uneven(rng: random.Random, size: Shape, width: int = 16, max_depth: int = 6) -> list[RolloutTree]:
    """(d) ``size.uneven_trees`` (4) TreePO trees with early stops: leaves of 1 to ``max_depth``
    segments of 16–32 tokens.

    Grown as TreePO samples: the root forks in two; after every segment each live path
    stops (EOS) with probability 1/4, and the survivors fork in two while the tree has
    room for more leaves (``width`` minus stopped and live paths), else continue alone —
    the budget of the paths that stopped goes to the survivors.
    """
    trees = []
    for i in range(size.uneven_trees):
        tree = RolloutTree(tokens(rng, size(48), size.vocab), problem={"id": f"d{i}"})
        live = [segment(tree, tree.root, rng, size(rng.randint(16, 32)), size.vocab) for _ in range(2)]
        stopped = 0
        for _ in range(max_depth - 1):
            survivors = [node for node in live if rng.random() >= 0.25]
            stopped += len(live) - len(survivors)
            room = width - stopped - len(survivors)
            live = []
            for node in survivors:
                forks = 2 if room > 0 else 1
                room -= forks - 1
                live += [segment(tree, node, rng, size(rng.randint(16, 32)), size.vocab) for _ in range(forks)]
        trees.append(tree)
    return trees


CASES: dict[str, Callable[[random.Random, Shape], list[RolloutTree]]] = {
    "a": case_shared_prefix, "b": case_binary, "c": case_no_sharing, "d": case_uneven,
}


@dataclass
class Batch:
    """One case ready for one mode: what ``policy_loss`` gets."""

    trees: list[RolloutTree]
    advantages: list
    policy_mode: str  # policy_loss's mode: "tree" packs the trees, "padded" pads every leaf


def batch_for(mode: str, trees: list[RolloutTree], advantages: list) -> Batch:
    """``tree``: the trees; ``packed``: every leaf its own chain, packed (tree mode on
    single-path trees is unpadded linear training); ``padded``: the trees, padded per leaf."""
    if mode == "packed":
        return Batch(*linearise_trees(trees, advantages), "tree")
    if mode not in ("tree", "padded"):
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return Batch(trees, advantages, "tree" if mode == "tree" else "padded")


def batch_loss(model: torch.nn.Module, batch: Batch, attention: str, chunk_tokens: int = 0) -> torch.Tensor:
    """The scalar loss of ``batch`` (normalize="token"): the same number in every mode."""
    loss, _ = policy_loss(model, batch.trees, batch.advantages, mode=batch.policy_mode,  # type: ignore[arg-type]
                          attention=attention, pack_tokens=PACK_TOKENS, chunk_tokens=chunk_tokens)  # type: ignore[arg-type]
    return loss


def step(model: torch.nn.Module, batch: Batch, attention: str, chunk_tokens: int = 0) -> tuple[float, float]:
    """One forward + backward: (wall seconds, process CPU seconds); on a GPU, synchronised."""
    cuda = next(model.parameters()).is_cuda
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    batch_loss(model, batch, attention, chunk_tokens).backward()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


def cuda_peak_mib(model: torch.nn.Module, batch: Batch, attention: str, chunk_tokens: int) -> float:
    """Peak GPU memory of one forward + backward over what was allocated before it (MiB)."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(model, batch, attention, chunk_tokens)
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def padded_tokens(trees: list[RolloutTree]) -> int:
    """Tokens the padded batch forwards: every leaf's row as long as the longest path."""
    lengths = [len(t.prompt_ids) + leaf.end for t in trees for leaf in t.leaves()]
    return len(lengths) * max(lengths)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def measure_memory(case: str, mode: str, attention: str, uneven_trees: int) -> None:
    """In a fresh process: peak RSS growth of one step over the RSS before it (MiB).

    RSS is sampled every millisecond by a thread: ru_maxrss cannot be used, Linux carries
    it over from the parent across fork + exec.
    """
    model = build_model()
    trees = CASES[case](random.Random(0), Shape(uneven_trees=uneven_trees))
    batch = batch_for(mode, trees, [[1.0] * len(t.leaves()) for t in trees])
    before = rss_mib()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    step(model, batch, attention)
    done.set()
    sampler.join()
    print(f"{max(peak[0], rss_mib()) - before:.1f}")


def peak_memory(case: str, mode: str, attention: str, uneven_trees: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--memory", case, mode, "--attention", attention,
         "--uneven-trees", str(uneven_trees)],
        capture_output=True, text=True, check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


@dataclass
class CaseResult:
    unique: int  # tokens in the tree packs
    linearised: int  # tokens of the packed linear batch (Σ leaf path lengths)
    padded: int  # tokens of the padded batch (leaves × longest path)
    wall: dict[str, float]  # mode -> median wall seconds
    cpu: dict[str, float]  # mode -> median CPU seconds
    memory: dict[str, float] | None = None  # mode -> peak GPU MiB of a step (CUDA only)
    out_of_memory: tuple[str, ...] = ()  # modes whose step did not fit on the GPU

    def speedup(self, baseline: str) -> float:
        if baseline not in self.wall or "tree" not in self.wall:
            return float("nan")
        return self.wall[baseline] / self.wall["tree"]

    def ideal(self, baseline: str) -> float:
        return (self.linearised if baseline == "packed" else self.padded) / self.unique


def run_case(model: torch.nn.Module, name: str, size: Shape, reps: int, attention: str,
             chunk_tokens: int = 0, modes: tuple[str, ...] = MODES) -> CaseResult:
    rng = random.Random(0)
    trees = CASES[name](rng, size)
    advantages = [[rng.gauss(0, 1) for _ in t.leaves()] for t in trees]
    # Linearised outside the clock: a linear framework receives its batch linear. Packing
    # (pack_trees inside policy_loss) is timed in both packed modes.
    batches = {mode: batch_for(mode, trees, advantages) for mode in modes}
    failed = []
    for mode in modes:  # warm-up (on a GPU also FlexAttention's compilation for this length)
        try:
            step(model, batches[mode], attention, chunk_tokens)
        except torch.OutOfMemoryError:  # e.g. a dense [N, N] mask at 41k tokens: reported, not fatal
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            failed.append(mode)
    modes = tuple(m for m in modes if m not in failed)
    wall: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(reps):  # interleaved, so drifts in machine load hit every mode
        for mode in modes:
            w, c = step(model, batches[mode], attention, chunk_tokens)
            wall[mode].append(w)
            cpu[mode].append(c)
    return CaseResult(
        unique=sum(t.stats().unique_tokens for t in trees),
        linearised=sum(t.stats().linearised_tokens for t in trees),
        padded=padded_tokens(trees),
        wall={m: statistics.median(v) for m, v in wall.items()},
        cpu={m: statistics.median(v) for m, v in cpu.items()},
        memory=({m: cuda_peak_mib(model, batches[m], attention, chunk_tokens) for m in modes}
                if next(model.parameters()).is_cuda else None),
        out_of_memory=tuple(failed),
    )


def describe(name: str, r: CaseResult, memory: dict[str, float] | None) -> str:
    ms = ", ".join(f"{m} {r.wall[m] * 1e3:.0f} ms (CPU {r.cpu[m] * 1e3:.0f})" for m in r.wall)
    vs = " | ".join(
        f"vs {b}: speedup {r.speedup(b):.2f}x, ideal {r.ideal(b):.2f}x, fraction {r.speedup(b) / r.ideal(b):.2f}"
        for b in ("packed", "padded") if b in r.wall
    )
    mem = "" if memory is None else " | peak step memory " + ", ".join(f"{m} {memory[m]:.0f} MiB" for m in memory)
    mem += "".join(f" | {m}: out of GPU memory" for m in r.out_of_memory)
    return (f"case {name}: tokens unique {r.unique}, linearised {r.linearised}, padded {r.padded} | "
            f"{ms} | {vs}{mem}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--attention", default="auto", choices=["auto", "blocks", "dense", "flex"])
    parser.add_argument("--smoke", action="store_true", help="tiny model and cases, 1 repeat, no memory runs")
    parser.add_argument("--real", action="store_true",
                        help="CUDA: a Qwen2.5-0.5B-shaped model in bf16, case (a) at 16 × (2,048 + 512)")
    parser.add_argument("--uneven-trees", type=int, default=4,
                        help="trees in case (d): 4 by default; 32 is a quickstart step's batch, which a GPU "
                             "needs to be fed enough tokens per forward")
    parser.add_argument("--memory", nargs=2, metavar=("CASE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory:
        return measure_memory(*args.memory, args.attention, args.uneven_trees)
    if args.real:
        if not torch.cuda.is_available():
            parser.error("--real runs on a CUDA GPU (a 0.5B model over 40k tokens: hours on a CPU)")
        model = build_model(real=True)
        size, reps, chunk = REAL, args.reps, 1024  # chunk: the learner's default logit_chunk_tokens
    else:
        model = build_model(args.smoke)
        size, reps = (Shape(8), 1) if args.smoke else (Shape(), args.reps)
        chunk = 0
    size = dataclasses.replace(size, uneven_trees=args.uneven_trees)
    results = {}
    for name in CASES:
        results[name] = run_case(model, name, size, reps, args.attention, chunk, REAL_MODES if args.real else MODES)
        memory = results[name].memory
        if memory is None and not args.smoke:
            memory = {m: peak_memory(name, m, args.attention, args.uneven_trees) for m in MODES}
        print(describe(name, results[name], memory), flush=True)
    a, c, d = results["a"], results["c"], results["d"]
    if args.real:
        print(f"GPU {torch.cuda.get_device_name()}, bf16, attention {args.attention}")
        memory = {f"peak_mib_{case}_{m}": (results[case].memory or {}).get(m, float("nan"))
                  for case in "ad" for m in REAL_MODES}
        print(f"RESULT speedup={a.speedup('packed'):.2f} ideal={a.ideal('packed'):.2f} "
              f"fraction={a.speedup('packed') / a.ideal('packed'):.2f} "
              f"uneven_speedup={d.speedup('packed'):.2f} uneven_ideal={d.ideal('packed'):.2f} "
              f"uneven_fraction={d.speedup('packed') / d.ideal('packed'):.2f} "
              f"nosharing_ratio_packed={1 / c.speedup('packed'):.2f} "
              + " ".join(f"{k}={v:.0f}" for k, v in memory.items()))
        return
    print(f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB, "
          f"threads {args.threads}, attention {args.attention}, load average {os.getloadavg()[0]:.1f}")
    # Case (a)'s leaves are all as long: its padded batch has no padding, so its ideal is
    # the linearised / unique ratio the earlier RESULT keys always reported.
    print(
        f"RESULT speedup={a.speedup('padded'):.2f} ideal={a.ideal('packed'):.2f} "
        f"fraction={a.speedup('padded') / a.ideal('packed'):.2f} nosharing_ratio={1 / c.speedup('padded'):.2f} "
        f"uneven_speedup={d.speedup('packed'):.2f} uneven_ideal={d.ideal('packed'):.2f} "
        f"uneven_fraction={d.speedup('packed') / d.ideal('packed'):.2f} "
        f"uneven_speedup_padded={d.speedup('padded'):.2f} uneven_ideal_padded={d.ideal('padded'):.2f} "
        f"uneven_fraction_padded={d.speedup('padded') / d.ideal('padded'):.2f} "
        f"nosharing_ratio_packed={1 / c.speedup('packed'):.2f}"
    )


if __name__ == "__main__":
    main()
