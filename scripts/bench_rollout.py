"""TreePO tree sampling vs independent sampling on `arbor serve`, side by side in one run.

    python scripts/bench_rollout.py [--width 16] [--branch 2] [--segment-tokens 32]
        [--max-depth 8] [--prompts 16] [--repeats 3] [--hidden 512] [--layers 4]
        [--heads 8] [--kv-heads 1] [--intermediate 2752] [--threads 1]
        [--engine embedded|sglang] [--sglang-python PATH] [--model PATH] [--device cpu|cuda]
        [--dtype bfloat16] [--batching across_trees|per_tree]

Starts ``python -m arbor.engines.embedded.server`` (through the launcher) on a random Qwen2 model
built into a temp dir by ``tests/tiny_model.py`` (with ``--model``, any model directory:
random prompts from its tokenizer's regular vocabulary, its EOS ids), then alternates,
``--repeats`` times,
one TreePO batch and one independent batch over the same prompts (cache flushed before
each batch, a new seed per repeat):

- **tree**: ``mode: tree`` — width ``w`` leaves per prompt, ``branch``-way forks, one
  ``segment_tokens`` segment per round, ``max_depth`` segments at most;
- **independent** (the GRPO baseline): ``mode: independent`` — per prompt one request
  ``n = w`` with the whole response budget ``max_depth · segment_tokens``. Same width,
  same maximum response length, same engine; this is the fastest way the engine can
  sample w independent answers (one prefill, one continuous-batching run, no round
  barriers), which is what TreePO's "+40% trajectories/s" is measured against.

The sampler batches each round's paths: ``--batching across_trees`` (the default, as
training runs) sends the rounds that all trees submit together as one ``/generate``;
``per_tree`` sends one per round of each tree. Run it both ways to compare.

Both stop on EOS. Reported per mode: trajectories/s (leaves / wall time), tokens/s
(response tokens per trajectory summed over trajectories, i.e. linearised, / s),
tokens computed (prefill + decode = Σ prompt − cached + generated, summed over
outputs), the cached-token ratio (cached / prompt tokens), and the embedded server's
decode steps and rows per step (round barriers show up as extra steps), the paths sent
and the ``/generate`` calls they went out in (``calls/batch``, ``paths/call``). Ends with
``RESULT trajps_ratio=<tree/independent trajectories/s> compute_ratio=<independent/tree
tokens computed> cpu_trajps_ratio=<the same per server CPU second, embedded only>``.
Timings are noisy on a shared machine: compare the two modes of one run only.

``--engine sglang`` measures a real SGLang server (``--sglang-python``: the interpreter of its
venv, e.g. from scripts/sglang_cpu_env.sh; on ``--device cpu`` its CPU engine, torch_native
attention) the same way, then the embedded engine on the same model, prompts, seeds and
shapes, one server at a time, and adds ``cached_ratio_tree``, ``cached_ratio_independent``
and ``sglang_vs_embedded_tokps_tree`` / ``_independent`` (SGLang's linearised tokens/s over
the embedded engine's) to the RESULT line (whose trajps and compute ratios are SGLang's).

The defaults are the regime a training step runs in and TreePO measured in (64 queries
per batch on an inference server): 16 prompts x width 16 keep ~256 rows decoding, as
the quickstart's 32 prompts x 8 paths do. Both modes run the same ~256 sequential
decode steps; the tree wins by running fewer rows in them (it forks as it goes, so early
steps carry 16, 32, 64, 128 rows where the baseline carries 256: ~1.6x fewer row-steps)
and by serving each fork's prefix from the radix cache. A step's cost splits into
per-row matmuls, which fewer rows shrink, and attention over each row's context, which
they shrink little here: the embedded engine reads every row's prefix from its own copy
(no cascade attention), and in the late steps the tree has as many rows, with contexts
as long, as the baseline. The model is therefore sized like a small real LLM at these
contexts: hidden 512 x 4 layers, 8 query heads of 64 and 1 KV head (8:1 grouped-query
attention, as Qwen2.5-3B), an MLP 5.4x the hidden size (Qwen2.5's ratio). At the bench's
~200-token mean context attention is ~4% of its FLOPs per token (Qwen2.5-0.5B: ~2.5%);
a smaller toy measures mostly attention, which on CPU runs ~8x less efficiently than the
matmuls: ``--hidden 256 --heads 4 --intermediate 1376`` (attention ~8% of FLOPs, ~30% of
the step time) gives a ratio of ~1.2-1.3. Long contexts (TreePO's 7k-token budget)
would need cascade attention in the embedded engine to keep the gain. Each repeat's
ratio is printed: on a shared machine they spread by +-10%, so read the RESULT line
(the ratio of the summed throughputs), not one repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from arbor.config import RolloutConfig  # noqa: E402
from arbor.data import stop_token_ids  # noqa: E402
from arbor.engines.client import SGLangClient  # noqa: E402
from arbor.engines.launch import EngineLaunchError, launch_engines, sglang_cpu_flags  # noqa: E402
from arbor.errors import ConfigError  # noqa: E402
from arbor.rollout.sampler import sample_trees  # noqa: E402

EOS_ID = 0  # tests/tiny_model.py's <|endoftext|>


@dataclass
class Totals:
    """Sums over the batches of one mode."""

    seconds: float = 0.0
    server_cpu: float = 0.0  # CPU seconds the server process used (immune to time-sharing)
    trajectories: int = 0
    linear_tokens: int = 0  # Σ over trajectories of their response length
    generated: int = 0  # unique tokens sampled (each tree node once)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    paths: int = 0  # requests the sampler made (one per path and round)
    calls: int = 0  # /generate calls they went out in
    batches: int = 0
    decode_steps: int = 0  # the server's batched decode forwards
    row_steps: int = 0  # rows summed over those forwards
    rounds: list[int] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.linear_tokens / self.seconds

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens + self.generated

    def engine_counters(self) -> str:
        """What only the embedded engine reports (its steps, its one process's CPU)."""
        if not self.decode_steps:
            return "decode_steps=n/a server_cpu=n/a"
        return (
            f"decode_steps={self.decode_steps} rows/step={self.row_steps / self.decode_steps:.1f} "
            f"server_cpu={self.server_cpu:.2f}"
        )

    def line(self, name: str) -> str:
        return (
            f"{name:12s} traj/s={self.trajectories / self.seconds:7.2f} "
            f"tok/s={self.tokens_per_s:8.1f} "
            f"computed={self.computed:7d} (prefill {self.prompt_tokens - self.cached_tokens}, "
            f"decode {self.generated}) cached_ratio={self.cached_tokens / self.prompt_tokens:.3f} "
            f"trajectories={self.trajectories} mean_len={self.linear_tokens / self.trajectories:.1f} "
            f"paths={self.paths} calls={self.calls} calls/batch={self.calls / self.batches:.1f} "
            f"paths/call={self.paths / max(self.calls, 1):.1f} {self.engine_counters()} seconds={self.seconds:.2f} "
            f"endings={self.reasons}"
        )


def server_counters(url: str) -> tuple[int, int] | None:
    """(decode steps, row steps) the embedded engine has run so far; None from a server
    that does not report them (SGLang)."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"{url}/get_server_info") as reply:
        info = json.load(reply)
    if "decode_steps" not in info or "row_steps" not in info:
        return None
    return info["decode_steps"], info["row_steps"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_batch(
    url: str,
    pid: int | None,
    cfg: RolloutConfig,
    prompts: list[list[int]],
    eos_ids: list[int],
    seed: int,
    into: Totals,
    across_trees: bool = True,
) -> None:
    """One batch of ``cfg.mode`` over ``prompts``, added to ``into``; ``pid``: the server
    process whose CPU time is counted (None: not counted); ``across_trees``: the sampler's
    batching (one call per round of all trees, or of each tree)."""
    async with SGLangClient([url]) as client:
        await client.flush_cache()  # both modes start cold
        counters = server_counters(url)
        start, cpu = time.perf_counter(), cpu_seconds(pid) if pid else 0.0
        calls = client.generate_calls
        trees, stats = await sample_trees(
            client, [None] * len(prompts), prompts, cfg, eos_token_ids=eos_ids, seed=seed,
            across_trees=across_trees,
        )
        into.seconds += time.perf_counter() - start
        into.calls += client.generate_calls - calls
        into.batches += 1
        into.server_cpu += cpu_seconds(pid) - cpu if pid else 0.0
    after = server_counters(url)
    if counters and after:
        into.decode_steps += after[0] - counters[0]
        into.row_steps += after[1] - counters[1]
    for tree, s in zip(trees, stats):
        into.trajectories += len(tree.leaves())
        into.linear_tokens += tree.stats().linearised_response_tokens
        into.generated += s.tokens_generated
        into.prompt_tokens += s.prompt_tokens
        into.cached_tokens += s.cached_tokens
        into.paths += s.requests
        into.rounds.append(s.rounds)
        for reason, count in s.finish_reasons.items():
            into.reasons[reason] = into.reasons.get(reason, 0) + count
        if s.shortfall_reason:
            print(f"  shortfall ({cfg.mode}): {s.shortfall_reason}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--branch", type=int, default=2)
    parser.add_argument("--segment-tokens", type=int, default=32)
    parser.add_argument("--max-depth", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--intermediate", type=int, default=2752, help="MLP width")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    parser.add_argument(
        "--engine", choices=["embedded", "sglang"], default="embedded", help="server to measure"
    )
    parser.add_argument("--sglang-python", help="with --engine sglang: the interpreter of SGLang's venv "
                        "(default: this one)")
    parser.add_argument("--model", help="model directory to serve instead of the random toy")
    parser.add_argument("--device", default="cpu", help="the engines' device (cpu: SGLang's CPU engine)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="the engine's dtype (default: bfloat16 on cuda, else the server's float32)")
    parser.add_argument("--batching", choices=["across_trees", "per_tree"], default="across_trees",
                        help="one /generate per round of all trees, or of each tree")
    args = parser.parse_args()

    common = dict(
        width=args.width,
        branch=args.branch,
        segment_tokens=args.segment_tokens,
        max_depth=args.max_depth,
    )
    tree_cfg = RolloutConfig(mode="tree", **common)
    indep_cfg = RolloutConfig(mode="independent", **common)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server inherits it
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        if args.model:
            model, vocab, eos_ids = args.model, *vocabulary_and_eos(args.model)
            described = f"{args.model}, vocab {vocab}"
        else:
            from tiny_model import build_tiny_model_dir

            vocab, eos_ids = 320, [EOS_ID]
            model = build_tiny_model_dir(
                Path(tmp) / "model",
                vocab_size=vocab,
                hidden_size=args.hidden,
                num_hidden_layers=args.layers,
                num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads,
                intermediate_size=args.intermediate,
            )
            described = (
                f"Qwen2 hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
                f"({args.kv_heads} KV), MLP {args.intermediate}, vocab {vocab}"
            )
        rng = random.Random(0)
        prompts = [
            [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
            for _ in range(args.prompts)
        ]
        shape = (f"{described}, {args.threads} thread(s); {args.prompts} prompts of {args.prompt_tokens} tokens, "
                 f"width {args.width}, branch {args.branch}, {args.max_depth} x {args.segment_tokens} tokens, "
                 f"batching {args.batching}")
        engines = ["sglang", "embedded"] if args.engine == "sglang" else ["embedded"]
        # SGLang's KV pool is allocated up front: room for every path of a batch at full length.
        kv_tokens = 2 * args.prompts * args.width * (args.prompt_tokens + args.max_depth * args.segment_tokens)
        results = {kind: serve_and_measure(kind, str(model), args, Path(tmp), shape, prompts, eos_ids,
                                           (tree_cfg, indep_cfg), kv_tokens) for kind in engines}
    tree, indep = results[engines[0]]
    print(tree.line("tree"))
    print(indep.line("independent"))
    trajps = (tree.trajectories / tree.seconds) / (indep.trajectories / indep.seconds)
    result = f"RESULT trajps_ratio={trajps:.3f} compute_ratio={indep.computed / tree.computed:.3f}"
    if tree.server_cpu and indep.server_cpu:
        cpu = (tree.trajectories / tree.server_cpu) / (indep.trajectories / indep.server_cpu)
        result += f" cpu_trajps_ratio={cpu:.3f}"
    if args.engine == "sglang":
        result += (f" cached_ratio_tree={tree.cached_tokens / tree.prompt_tokens:.3f}"
                   f" cached_ratio_independent={indep.cached_tokens / indep.prompt_tokens:.3f}")
        for name, ours, theirs in zip(("tree", "independent"), results["embedded"], results["sglang"]):
            print(ours.line(f"embedded {name}"))
            result += f" sglang_vs_embedded_tokps_{name}={theirs.tokens_per_s / ours.tokens_per_s:.3f}"
    print(result)


def serve_and_measure(
    kind: str, model: str, args: argparse.Namespace, tmp: Path, shape: str, prompts: list[list[int]],
    eos_ids: list[int], cfgs: tuple[RolloutConfig, RolloutConfig], kv_tokens: int,
) -> tuple[Totals, Totals]:
    """Start a ``kind`` server on ``model``, warm it up, measure tree and independent batches
    ``args.repeats`` times (alternating which goes first), stop it; (tree, independent) totals."""
    embedded = kind == "embedded"
    cpu = args.device == "cpu"
    try:
        handle = launch_engines(
            kind,
            model_path=model,
            device=args.device,
            dtype=args.dtype or ("bfloat16" if not cpu else None if embedded else "float32"),
            extra_args=[] if embedded or not cpu else sglang_cpu_flags(kv_tokens),
            log_dir=tmp / f"logs-{kind}",
            startup_timeout_s=600,
            python=None if embedded else args.sglang_python,
        )
    except (EngineLaunchError, ConfigError) as exc:
        sys.exit(f"bench_rollout: {exc}")
    tree_cfg, indep_cfg = cfgs
    with handle:
        # The embedded server is one process; SGLang's work runs in its children.
        url, pid = handle.urls[0], handle.processes[0].pid if embedded else None
        print(f"{kind} {url}: {shape}", flush=True)
        # Warm-up, not timed: one full batch of each mode. The first steps at each new
        # batch shape are slow (allocator growth, oneDNN kernel selection), and tree
        # sampling meets many more shapes (rows 4, 8, 16, ... per step) than one n = w
        # request; a training run amortises these over thousands of steps.
        across = args.batching == "across_trees"
        for cfg in (tree_cfg, indep_cfg):
            asyncio.run(one_batch(url, pid, cfg, prompts, eos_ids, 10_000, Totals(), across))
        tree, indep = Totals(), Totals()
        for repeat in range(args.repeats):
            before = [(t.seconds, t.trajectories) for t in (tree, indep)]
            order = [(tree_cfg, tree), (indep_cfg, indep)]
            if repeat % 2:  # alternate which mode goes first
                order.reverse()
            for cfg, totals in order:
                asyncio.run(one_batch(url, pid, cfg, prompts, eos_ids, repeat, totals, across))
            (tree_s, tree_n), (indep_s, indep_n) = (
                (t.seconds - s0, t.trajectories - n0)
                for t, (s0, n0) in zip((tree, indep), before)
            )
            print(
                f"{kind} repeat {repeat}: tree {tree_s:.1f}s, independent {indep_s:.1f}s, "
                f"trajectories/s ratio {(tree_n / tree_s) / (indep_n / indep_s):.3f}",
                flush=True,
            )
    return tree, indep


def vocabulary_and_eos(model: str) -> tuple[int, list[int]]:
    """How many regular (non-special) token ids ``model``'s tokenizer has, and its stop ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return tokenizer.vocab_size, stop_token_ids(tokenizer, model)


if __name__ == "__main__":
    main()
