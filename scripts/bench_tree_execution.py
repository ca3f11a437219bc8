"""Tree execution packed vs dfs vs linear: time and peak memory of a training step, as ratios.

    python scripts/bench_tree_execution.py [--reps 3] [--threads 2]          # CPU, a toy model
    python scripts/bench_tree_execution.py --device cuda [--quick]         # a 0.5B-shaped model, bf16
    python scripts/bench_tree_execution.py --smoke                          # checks the script (seconds)

One forward + backward of the policy loss (``policy_backward``) on the same trees three ways,
interleaved, medians:

- ``packed``: ``learner.tree_execution: packed`` — each pack of at most ``--pack-tokens``
  tokens (the learner's default, 16,384) in one forward with tree attention (block attention
  on the CPU, FlexAttention on CUDA); a tree larger than a pack is split into parts that
  forward their ancestors again as context;
- ``dfs``: ``learner.tree_execution: dfs`` — whole trees walked depth first (never split into
  packs), groups of sibling (and cousin) branches of at most ``--group-tokens`` tokens
  forwarded with their ancestors' keys and values as the KV cache (``arbor.train.dfs``);
- ``linear``: every leaf its own sequence (``linearise_trees``), packed without padding into
  ``--pack-tokens`` packs, what verl, slime and OpenRLHF train on.

Cases (AREAL-DTA's shapes and arbor's own):

  (a) agentic: a 256-token prompt, 8 turns of a 96-token model response and a 400-token
      observation (loss mask 0); forks in two at each of the first 4 turns: 16 leaves
  (b) prefix: 64 leaves of 256 tokens under one 2,048-token prefix
  (c) quickstart: 32 trees as configs/quickstart.yaml samples them (40-token prompts, width 8,
      binary forks, 3 segments of 8 tokens)

Per case: the tokens (unique = the physical ideal of a tree execution, linearised = linear
training's, the longest root-to-leaf path = what a depth-first walk must hold), each mode's
time and peak memory, and the ratios dfs/packed and linear/packed. Peak memory is the step's
growth over what was allocated before it: ``torch.cuda.max_memory_allocated`` on CUDA; on the
CPU the high-water mark of resident memory (VmHWM, reset through ``/proc/self/clear_refs``)
in a fresh process per case and mode (on CUDA the timed steps are measured). A mode that runs
out of GPU memory is reported as such (its ratios nan). ``--quick``: one timed repeat after
the warm-up (the CUDA run in about a minute or two; each case's line is printed as soon as it
is measured); ``--smoke``: a tiny model and cases shrunk 16×, no memory runs.

Ends with ``RESULT`` and, per case c in agentic, prefix, quickstart: ``c_unique`` (tokens),
``c_ideal`` (linearised / unique tokens), ``c_dfs_time``, ``c_dfs_memory`` (dfs / packed),
``c_linear_time``, ``c_linear_memory`` (linear / packed).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arbor.train.packed_loss import policy_backward  # noqa: E402
from arbor.train.packing import linearise_trees  # noqa: E402
from arbor.tree import RolloutTree  # noqa: E402

MODES = ("packed", "dfs", "linear")
CASE_NAMES = ("agentic", "prefix", "quickstart")
SMOKE = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=512)
TOY = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
           intermediate_size=1024, vocab_size=4096)
QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)


@dataclass
class Settings:
    """What a step needs besides the trees: device, kernel and budgets."""

    device: str = "cpu"
    attention: str = "auto"
    pack_tokens: int = 16384
    group_tokens: int = 2048
    chunk_tokens: int = 1024  # the learner's default LM-head chunk
    shrink: int = 1  # token counts divided by this (--smoke)
    model: str = "toy"  # smoke, toy or 0.5b


def build_model(settings: Settings) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    size = {"smoke": SMOKE, "toy": TOY, "0.5b": QWEN25_05B}[settings.model]
    with torch.device(settings.device):  # initialised where it runs: seconds, not a minute, for 0.5B
        model = Qwen2ForCausalLM(Qwen2Config(attn_implementation="sdpa", **size))
    dtype = torch.bfloat16 if settings.device == "cuda" else torch.float32
    return model.to(dtype=dtype).train()


def segment(tree: RolloutTree, parent, rng: random.Random, n: int, vocab: int, trained: bool = True):
    return tree.add_segment(parent, [rng.randrange(vocab) for _ in range(n)], logprobs=[-rng.random() for _ in range(n)],
                            loss_mask=None if trained else [0] * n)


def case_agentic(rng: random.Random, shrink: int, vocab: int) -> list[RolloutTree]:
    """(a) 8 turns of a response and an observation; binary forks at the first 4 turns: 16 leaves."""
    def size(n: int) -> int:
        return max(2, n // shrink)

    tree = RolloutTree([rng.randrange(vocab) for _ in range(size(256))], problem={"id": "agentic"})
    frontier = [tree.root]
    for turn in range(8):
        forks = 2 if turn < 4 else 1
        frontier = [segment(tree, segment(tree, node, rng, size(96), vocab), rng, size(400), vocab, trained=False)
                    for node in frontier for _ in range(forks)]
    return [tree]


def case_prefix(rng: random.Random, shrink: int, vocab: int) -> list[RolloutTree]:
    """(b) 64 leaves of 256 tokens under a 2,048-token prefix (a 64-token prompt and a segment)."""
    tree = RolloutTree([rng.randrange(vocab) for _ in range(max(2, 64 // shrink))], problem={"id": "prefix"})
    stem = segment(tree, tree.root, rng, max(2, 1984 // shrink), vocab)
    for _ in range(64):
        segment(tree, stem, rng, max(2, 256 // shrink), vocab)
    return [tree]


def case_quickstart(rng: random.Random, shrink: int, vocab: int) -> list[RolloutTree]:
    """(c) 32 trees: 40-token prompts, binary forks at each of 3 segments of 8 tokens (8 leaves)."""
    trees = []
    for i in range(max(2, 32 // shrink)):
        tree = RolloutTree([rng.randrange(vocab) for _ in range(40)], problem={"id": f"q{i}"})
        frontier = [tree.root]
        for _ in range(3):
            frontier = [segment(tree, node, rng, 8, vocab) for node in frontier for _ in range(2)]
        trees.append(tree)
    return trees


CASES: dict[str, Callable[[random.Random, int, int], list[RolloutTree]]] = {
    "agentic": case_agentic, "prefix": case_prefix, "quickstart": case_quickstart,
}


def batch(case: str, settings: Settings, vocab: int) -> tuple[list[RolloutTree], list]:
    rng = random.Random(0)
    trees = CASES[case](rng, settings.shrink, vocab)
    return trees, [[rng.gauss(0, 1) for _ in t.leaves()] for t in trees]


def step(model: torch.nn.Module, mode: str, trees: list[RolloutTree], advantages: list, settings: Settings) -> float:
    """One forward + backward of ``mode`` (the gradients accumulate in ``model``); the loss."""
    kw = dict(pack_tokens=settings.pack_tokens, chunk_tokens=settings.chunk_tokens, attention=settings.attention)
    if mode == "linear":
        trees, advantages = linearise_trees(trees, advantages)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    execution = "dfs" if mode == "dfs" else "packed"
    loss, _ = policy_backward(model, trees, advantages, execution=execution, group_tokens=settings.group_tokens,
                              **kw)  # type: ignore[arg-type]
    return loss


def timed(model: torch.nn.Module, mode: str, trees: list[RolloutTree], advantages: list,
          settings: Settings) -> tuple[float, float]:
    """Wall seconds of one step (synchronised with the GPU) and, on CUDA, its peak memory over
    what was allocated before it (MiB; nan on the CPU, measured in a process of its own)."""
    model.zero_grad(set_to_none=True)
    cuda = settings.device == "cuda"
    before = 0
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step(model, mode, trees, advantages, settings)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return seconds, (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else math.nan


def status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def measure_cpu_memory(case: str, mode: str, settings: Settings) -> None:
    """In a fresh process: the step's peak resident memory over the resident memory before it (MiB).

    The model and the trees are built before the high-water mark is reset
    (``/proc/self/clear_refs``; Linux keeps ru_maxrss across fork + exec, so a clean peak needs
    the reset). The peak includes the parameters' gradients, the same in every mode.
    """
    model = build_model(settings)
    trees, advantages = batch(case, settings, model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kib("VmRSS")
    timed(model, mode, trees, advantages, settings)
    print(f"{(status_kib('VmHWM') - before) / 1024:.1f}")


def cpu_peak_mib(case: str, mode: str, settings: Settings, threads: int) -> float:
    args = [sys.executable, __file__, "--memory", case, mode, "--threads", str(threads), "--pack-tokens",
            str(settings.pack_tokens), "--group-tokens", str(settings.group_tokens), "--model", settings.model]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the memory run of {case}/{mode} failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


@dataclass
class CaseResult:
    unique: int  # tokens of the trees, each once
    linearised: int  # tokens of linear training (every leaf's path)
    longest_path: int  # the longest root-to-leaf path
    seconds: dict[str, float] = field(default_factory=dict)  # mode -> median wall seconds
    memory: dict[str, float] = field(default_factory=dict)  # mode -> peak MiB of a step
    out_of_memory: list[str] = field(default_factory=list)  # modes that did not fit on the GPU

    def ratio(self, what: str, mode: str) -> float:
        values = self.seconds if what == "time" else self.memory
        if mode not in values or not values.get("packed"):
            return math.nan
        return values[mode] / values["packed"]


def run_case(model: torch.nn.Module, case: str, settings: Settings, reps: int, threads: int,
             measure_memory: bool) -> CaseResult:
    trees, advantages = batch(case, settings, model.config.vocab_size)
    result = CaseResult(
        unique=sum(t.stats().unique_tokens for t in trees),
        linearised=sum(t.stats().linearised_tokens for t in trees),
        longest_path=max(len(t.prompt_ids) + leaf.end for t in trees for leaf in t.leaves()),
    )
    modes = []
    for mode in MODES:  # warm-up (on a GPU FlexAttention compiles for these lengths)
        try:
            timed(model, mode, trees, advantages, settings)
            modes.append(mode)
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            result.out_of_memory.append(mode)
    times: dict[str, list[float]] = {m: [] for m in modes}
    peaks: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(reps):  # interleaved: drifts in machine load hit every mode
        for mode in modes:
            seconds, peak = timed(model, mode, trees, advantages, settings)
            times[mode].append(seconds)
            peaks[mode].append(peak)
    result.seconds = {m: statistics.median(v) for m, v in times.items()}
    if settings.device == "cuda":  # measured in the timed steps
        result.memory = {m: max(v) for m, v in peaks.items()}
    elif measure_memory:
        result.memory = {m: cpu_peak_mib(case, m, settings, threads) for m in modes}
    model.zero_grad(set_to_none=True)
    return result


def describe(case: str, r: CaseResult) -> str:
    modes = ", ".join(f"{m} {r.seconds[m] * 1e3:.0f} ms" + (f" {r.memory[m]:.0f} MiB" if m in r.memory else "")
                      for m in r.seconds)
    oom = "".join(f" | {m}: out of GPU memory" for m in r.out_of_memory)
    return (f"case {case}: tokens unique {r.unique}, linearised {r.linearised} (ideal {r.linearised / r.unique:.2f}x), "
            f"longest path {r.longest_path} | {modes} | dfs/packed time {r.ratio('time', 'dfs'):.2f} memory "
            f"{r.ratio('memory', 'dfs'):.2f} | linear/packed time {r.ratio('time', 'linear'):.2f} memory "
            f"{r.ratio('memory', 'linear'):.2f}{oom}")


def result_line(results: dict[str, CaseResult]) -> str:
    keys = []
    for case, r in results.items():
        keys += [f"{case}_unique={r.unique}", f"{case}_ideal={r.linearised / r.unique:.2f}"]
        keys += [f"{case}_{mode}_{what}={r.ratio(what, mode):.2f}" for mode in ("dfs", "linear") for what in ("time", "memory")]
    return "RESULT " + " ".join(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one timed repeat per mode (after a warm-up)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, cases shrunk 16x, no memory runs")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    parser.add_argument("--pack-tokens", type=int, default=16384, help="learner.pack_tokens of packed and linear")
    parser.add_argument("--group-tokens", type=int, default=2048, help="learner.dfs_group_tokens of dfs")
    parser.add_argument("--model", choices=["smoke", "toy", "0.5b"], help="default: toy on the CPU, 0.5b on CUDA")
    parser.add_argument("--cases", default=",".join(CASE_NAMES), help="comma-separated cases to run")
    parser.add_argument("--memory", nargs=2, metavar=("CASE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if args.smoke and args.device == "cuda":
        parser.error("--smoke checks the script on the CPU; use --quick on CUDA")
    torch.set_num_threads(args.threads)
    settings = Settings(device=args.device, pack_tokens=args.pack_tokens, group_tokens=args.group_tokens,
                        shrink=16 if args.smoke else 1,
                        model=args.model or ("smoke" if args.smoke else "0.5b" if args.device == "cuda" else "toy"))
    if args.smoke:
        settings.group_tokens = max(1, args.group_tokens // 16)
    if args.memory:
        return measure_cpu_memory(*args.memory, settings)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known: {', '.join(CASE_NAMES)}")
    model = build_model(settings)
    reps = 1 if args.quick or args.smoke else args.reps
    results = {}
    for case in cases:
        results[case] = run_case(model, case, settings, reps, args.threads, measure_memory=not args.smoke)
        print(describe(case, results[case]), flush=True)
    where = (f"GPU {torch.cuda.get_device_name()}, bf16" if args.device == "cuda"
             else f"CPU, {args.threads} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"{where}, model {settings.model}, pack_tokens {settings.pack_tokens}, dfs group_tokens "
          f"{settings.group_tokens}, attention {settings.attention}, reps {reps}")
    print(result_line(results))


if __name__ == "__main__":
    main()
