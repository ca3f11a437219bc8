"""Build the distillation example's teacher: the quickstart's model trained longer by SFT.

    python scripts/build_teacher.py                       # -> models/teacher-arith
    python scripts/build_teacher.py --steps 20 --out /tmp/teacher   # a quick one (tests)

Starts from ``models/tiny-arith`` (``scripts/build_tiny_model.py`` stops its warm-up early on
purpose, right about a third of the time at temperature 1) and continues the same supervised
training, ``arbor sft``'s step on a plain-torch learner, on the same warm-up problems
(``data/arith/sft.jsonl``, disjoint from the RL run's train and test splits), with the answers
written as the warm-up wrote them ("12+30=42 \\boxed{42}"). The tokenizer is copied unchanged:
a teacher must share the student's tokenizer. No download; deterministic for a seed (CPU).
The last line printed is ``RESULT sampled_acc=... greedy_acc=... steps=... build_s=...`` on
the test split (the accuracies the student's distillation runs aim at).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import build_tiny_model as tiny  # noqa: E402

from arbor.config import LearnerConfig, LossConfig, ModelConfig, OptimConfig  # noqa: E402
from arbor.run.sft import sft_step  # noqa: E402
from arbor.train.learner import Learner  # noqa: E402


def with_solution(problem: dict[str, str]) -> dict[str, str]:
    """A problem file's line with the warm-up's answer text, e.g. "12+30=42 \\boxed{42}"."""
    expression = problem["prompt"].removeprefix("What is ").removesuffix("?")
    return problem | {"solution": f"{expression}={problem['answer']} \\boxed{{{problem['answer']}}}"}


def read(path: Path) -> list[dict[str, str]]:
    return [with_solution(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--student", default=str(REPO / "models" / "tiny-arith"))
    parser.add_argument("--data", default=str(REPO / "data" / "arith"))
    parser.add_argument("--out", default=str(REPO / "models" / "teacher-arith"))
    parser.add_argument("--steps", type=int, default=500, help="further SFT steps")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--eval-samples", type=int, default=8, help="samples per test problem at T=1")
    args = parser.parse_args()

    started = time.monotonic()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.student)
    model = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32)
    sft, test = read(Path(args.data) / "sft.jsonl"), read(Path(args.data) / "test.jsonl")
    optim = OptimConfig(lr=args.lr, weight_decay=0.01, betas=[0.9, 0.98], warmup_steps=min(50, args.steps // 10),
                        schedule="cosine", min_lr_ratio=0.1, max_grad_norm=1.0)
    learner = Learner(ModelConfig(path=args.student), LearnerConfig(backend="torch", device="cpu", dtype="float32"),
                      optim, LossConfig(), total_steps=args.steps, model=model)
    examples = {p["id"]: tiny.sft_example(tokenizer, p) for p in sft}
    loss = float("nan")
    for step in range(args.steps):
        model.train()
        loss = sft_step(learner, [examples[p["id"]] for p in rng.sample(sft, args.batch)])["sft/loss"]
        if (step + 1) % 250 == 0:
            print(f"step {step + 1}/{args.steps} loss {loss:.3f} ({time.monotonic() - started:.0f} s)", flush=True)
    model.eval()
    tiny.save_model(model, tokenizer, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the student's, byte for byte
        shutil.copy(Path(args.student) / name, out / name)
    evaluated = test[: args.eval_problems]
    sampled = tiny.evaluate(model, tokenizer, evaluated, samples=args.eval_samples, seed=args.seed + 1)
    greedy = tiny.evaluate(model, tokenizer, evaluated, samples=0, seed=args.seed)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(f"saved {out} ({size:.1f} MiB); last loss {loss:.3f}")
    print(f"RESULT sampled_acc={sampled['acc']:.3f} greedy_acc={greedy['acc']:.3f} steps={args.steps} "
          f"build_s={time.monotonic() - started:.0f}", flush=True)


if __name__ == "__main__":
    main()
