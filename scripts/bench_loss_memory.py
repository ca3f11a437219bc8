"""Memory and time of one tree-packed loss forward+backward, whole logits vs a chunked LM head.

    python scripts/bench_loss_memory.py [--tokens 8192] [--prompt 4096] [--vocab 151936]
        [--hidden 896] [--layers 2] [--chunk 1024] [--repeats 2] [--threads 2]

A random model shaped like Qwen2.5-0.5B's head (vocab 151,936, hidden 896, 14 query / 2
KV heads, MLP 4,864, tied embeddings; ``--layers`` 2 of its 24 are enough: the head is
what differs) trains on one packed tree of ``--tokens`` tokens (a ``--prompt``-token
prompt, two 256-token branches, 16 leaves below them; every response token is trained)
with :func:`arbor.train.packed_loss.pack_loss`, float32 on the CPU:

- ``unchunked``: ``learner.logit_chunk_tokens: 0`` — [tokens, vocab] logits from the
  model's forward, log-softmax, entropy through autograd (arbor before the chunked head);
- ``chunked``: ``learner.logit_chunk_tokens: --chunk`` — the head runs ``--chunk`` rows at
  a time inside one autograd function that keeps no logits (:mod:`arbor.train.lm_head`).

- ``body``: the model body alone (forward to the final hidden states of the trained
  rows, backward from their sum): the activations every variant holds, so that
  ``peak − body`` is what the loss itself adds (the head, log-softmax, entropy).

Each variant runs in its own process (one cannot free what the other's allocator holds);
a thread samples the resident set (/proc/self/statm) every millisecond, and the peak
over the forward+backward minus the resident set just before it is the step's extra
memory (gradient buffers exist before). Time: the best of ``--repeats`` passes. Ends with

    RESULT peak_mib_unchunked=... peak_mib_chunked=... time_ratio=<chunked / unchunked seconds>
           body_peak_mib=<the model body's share of both peaks>

For scale: one [4,096 × 151,936] float32 tensor (the default's trained rows) is 2,374 MiB;
one chunk of 1,024 rows is 594 MiB. The unchunked variant needs ~15 GB free at the
defaults (a 512-token prompt, 7,680 trained rows, would need ~26 GB: more than this
machine has). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakSampler:
    """Highest resident set seen while active (sampled every ``interval_s``)."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s, self.peak, self._stop = interval_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, resident_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self.peak = resident_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())


def bench_tree(tokens: int, prompt: int, vocab: int, seed: int):
    """A prompt, two 256-token branches, 16 leaves sharing the rest: ``tokens`` in all."""
    import random

    from arbor.tree import RolloutTree

    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def segment(parent, n: int):
        return tree.add_segment(parent, ids(n), logprobs=[-12.0 + rng.random() for _ in range(n)])

    tree = RolloutTree(ids(prompt), problem={"id": "bench"})
    leaf_tokens = (tokens - prompt - 2 * 256) // 16
    if leaf_tokens < 1:
        raise SystemExit(f"--tokens {tokens} leaves no room for 16 leaves after --prompt {prompt} + 512")
    for _ in range(2):
        branch = segment(tree.root, 256)
        for _ in range(8):
            segment(branch, leaf_tokens)
    return tree


def run_variant(args: argparse.Namespace) -> dict[str, float]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from arbor.train.packed_loss import pack_loss
    from arbor.train.packing import loss_denominator, pack_trees
    from arbor.train.tree_attention import BLOCKS_IMPL, attention_implementation

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        # Qwen2.5-0.5B at hidden 896: 14 heads of 64, 2 KV heads, MLP 4,864 (same ratios when smaller).
        num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=2 if args.hidden // 64 % 2 == 0 else 1,
        intermediate_size=args.hidden * 4864 // 896,
        tie_word_embeddings=True, max_position_embeddings=32768, attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).float()
    tree = bench_tree(args.tokens, args.prompt, args.vocab, seed=0)
    advantages = [[(-1.0) ** i * 0.5 for i in range(len(tree.leaves()))]]
    (pack,) = pack_trees([tree], advantages, pack_tokens=args.tokens + 1)
    denominator = loss_denominator([tree], "token")
    chunk = args.chunk if args.variant == "chunked" else 0
    rows = pack.parent[pack.trained.nonzero()[:, 0]]

    def forward_backward() -> None:
        if args.variant == "body":
            with attention_implementation(model, BLOCKS_IMPL):
                out = model.model(input_ids=pack.input_ids[None], position_ids=pack.position_ids[None],
                                  arbor_blocks=pack.blocks, use_cache=False)
            out.last_hidden_state[0, rows].sum().backward()
            return
        loss, _ = pack_loss(model, pack, denominator, entropy_coef=0.01, chunk_tokens=chunk, attention="blocks")
        loss.backward()

    for p in model.parameters():  # gradient buffers exist before the measurement: not the loss's memory
        p.grad = torch.zeros_like(p)
    seconds, peak = [], 0
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=False)
        before = resident_bytes()
        with PeakSampler() as sampler:
            start = time.perf_counter()
            forward_backward()
            seconds.append(time.perf_counter() - start)
        peak = max(peak, sampler.peak - before)
    return {"seconds": min(seconds), "peak_mib": peak / 2**20, "tokens": pack.num_tokens,
            "trained": int(pack.trained.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variant", choices=["chunked", "unchunked", "body"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # a child: one variant, JSON on the last line
        print(json.dumps(run_variant(args)))
        return
    results = {}
    for variant in ("body", "chunked", "unchunked"):
        cmd = [sys.executable, __file__, "--variant", variant] + [
            f"--{k}={v}" for k, v in vars(args).items() if k != "variant"
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{variant} failed (exit {proc.returncode}; killed for memory?):\n{proc.stderr[-2000:]}")
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = results[variant]
        print(f"{variant:>9}: {r['tokens']} packed tokens ({r['trained']} trained), "
              f"forward+backward {r['seconds']:.2f} s, extra memory {r['peak_mib']:.0f} MiB", flush=True)
    print(f"RESULT peak_mib_unchunked={results['unchunked']['peak_mib']:.0f} "
          f"peak_mib_chunked={results['chunked']['peak_mib']:.0f} "
          f"time_ratio={results['chunked']['seconds'] / results['unchunked']['seconds']:.3f} "
          f"body_peak_mib={results['body']['peak_mib']:.0f}")


if __name__ == "__main__":
    main()
