"""Learner peak memory of a LoRA run with KL: the reference as the adapter-disabled policy vs a second copy.

    python scripts/bench_lora_memory.py [--shape smollm2-135m|qwen2.5-0.5b|tiny] [--rank 8]

A random float32 model of the shape (SmolLM2-135M: 30 layers, hidden 576, vocabulary 49,152;
Qwen2.5-0.5B: 24 layers, hidden 896, vocabulary 151,936) is saved once; then, each in its
own process (an allocator never gives back what another variant held), a plain-torch
learner with ``model.lora_rank: --rank`` and ``loss.kl_coef: 0.01`` takes one step on a
batch of four small trees:

- ``adapter_off``: arbor's reference, the policy with its adapter disabled (no copy);
- ``second_copy``: the same learner given a whole frozen copy of the model as its
  reference, as a full fine-tuning run with KL holds one.

Peak memory is the process's peak resident set (``ru_maxrss``): the Python runtime, the
model, the adapter and its optimizer state, the step's activations. Memory does not depend
on load, so the figures hold on a busy machine. Ends with

    RESULT model_mib=<float32 weights> peak_mib_adapter_off=... peak_mib_second_copy=...
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.bench_weight_sync import SHAPES, build_model  # noqa: E402  (the same model shapes)


def build(shape: dict, path: Path) -> int:
    """Save a random float32 model of ``shape``; its weight bytes."""
    import torch

    model = build_model(shape, path, torch.float32)
    return sum(p.numel() * 4 for p in model.parameters())


def run_variant(path: str, variant: str, rank: int) -> int:
    """One learner step (this process); returns its peak resident bytes."""
    import random

    import torch

    from arbor.config_load import load_config
    from arbor.train.learner import Learner, load_policy
    from arbor.train.packing import loss_denominator, pack_trees
    from arbor.tree import RolloutTree

    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={path}", "learner.backend=torch", "learner.zero_stage=0",
                             "learner.device=cpu", "learner.dtype=float32", f"model.lora_rank={rank}",
                             "loss.kl_coef=0.01", "data.max_prompt_tokens=16", "rollout.segment_tokens=16"])
    learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=1)
    if variant == "second_copy":
        learner.ref_model = load_policy(cfg.model, torch.float32).eval().requires_grad_(False)
    rng = random.Random(0)
    trees = [RolloutTree.from_sequences([1, 2, i], [[rng.randrange(3, 500) for _ in range(32)] for _ in range(4)],
                                        logprobs=[[-1.0] * 32 for _ in range(4)], segment_tokens=16,
                                        problem={"id": i}) for i in range(4)]
    advantages = [[1.0, -1.0, 0.5, -0.5] for _ in trees]
    learner.step(pack_trees(trees, advantages, pack_tokens=4096), loss_denominator(trees, "token"))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # a child process: run this one
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps({"peak": run_variant(args.path, args.variant, args.rank)}))
        return
    with tempfile.TemporaryDirectory(prefix="bench-lora-memory-") as tmp:
        model_bytes = build(SHAPES[args.shape], Path(tmp) / "model")
        peaks = {}
        for variant in ("adapter_off", "second_copy"):
            done = subprocess.run([sys.executable, __file__, "--variant", variant, "--path", str(Path(tmp) / "model"),
                                   "--rank", str(args.rank)], capture_output=True, text=True, cwd=REPO)
            if done.returncode != 0:
                raise SystemExit(f"variant {variant} failed:\n{done.stderr[-3000:]}")
            peaks[variant] = json.loads(done.stdout.strip().splitlines()[-1])["peak"] / 2**20
            print(f"{variant}: peak {peaks[variant]:.0f} MiB", flush=True)
    print(f"RESULT model_mib={model_bytes / 2**20:.1f} peak_mib_adapter_off={peaks['adapter_off']:.1f} "
          f"peak_mib_second_copy={peaks['second_copy']:.1f}", flush=True)


if __name__ == "__main__":
    main()
