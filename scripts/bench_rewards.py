"""Reward-scoring throughput with adversarial completions mixed in.

    python scripts/bench_rewards.py [--n 1000] [--adversarial 20] [--timeout-s 5] [--workers 2]

Scores ``n`` completions of MATH-style problems with ``rewards/math.py:boxed_accuracy``
through arbor's reward pool: ordinary completions (right and wrong answers in varied
forms after ~700 characters of filler reasoning) and ``adversarial`` ones that make checkers hang
(9^{9^{9^9}}, 99999999!, megabyte nested \\frac, unbalanced braces, ...). The elapsed
time includes starting the workers. Acceptance: n=1000 with 20 adversarial in < 60 s on
2 cores with --timeout-s 5. Ends with
``RESULT completions_per_s=... timeouts=... elapsed_s=...``; ``timeouts`` counts checks
the pool killed; checks that math-verify's own 2 s limits cut short are reported as
"slow" above it.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from arbor.rollout.rewards import RewardPool  # noqa: E402

# (gold, right answers, wrong answers) in the forms models write.
PROBLEMS = [
    (r"\frac{\sqrt{3}}{2}", [r"\frac{\sqrt3}{2}", r"\frac{\sqrt{3}}{2}"], [r"\frac{\sqrt2}{2}", r"\sqrt{3}"]),
    (r"(0,1]", [r"(0,1]", r"(0, 1]"], [r"[0,1]", r"(0,1)"]),
    (r"x^2+2x+1", [r"(x+1)^2", r"x^2+2x+1"], [r"x^2+1", r"(x-1)^2"]),
    (r"\dfrac{1}{2}", [r"0.5", r"\frac12"], [r"\frac13", r"2"]),
    (r"\text{(B)}", [r"B", r"\text{(B)}"], [r"C", r"\text{(A)}"]),
    (r"-3", [r"-3", r"-3.0"], [r"3", r"-2"]),
    (r"2\sqrt{2}", [r"\sqrt{8}", r"2\sqrt2"], [r"\sqrt{2}", r"4"]),
    (r"[-2,7)", [r"[-2,7)", r"[-2, 7)"], [r"(-2,7)", r"[-2,7]"]),
    (r"12", [r"12", r"12.0"], [r"21", r"11"]),
    (r"\{1,2\}", [r"\{2,1\}", r"\{1, 2\}"], [r"\{1,3\}", r"\{1\}"]),
]

ADVERSARIAL = [
    r"\boxed{9^{9^{9^9}}}",
    r"\boxed{99999999!}",
    r"\boxed{" + r"\frac{1}{" * 100_000 + "2" + "}" * 100_001,  # ~1 MB nested \frac
    r"\boxed{" + "{" * 100_000,  # unbalanced
    r"\boxed{10^{10^{10^{10}}}}",
    r"\boxed{(10^{8})!}",
    r"\boxed{\binom{10^{9}}{10^{8}}}",
    r"\boxed{1234567^{7654321}}",
    r"\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    r"\boxed{\prod_{k=1}^{10^{7}} k}",
    r"\boxed{5} " + r"\boxed{" + "5+" * 500_000 + "0}",  # a good box, then a megabyte one
]


def build_items(n: int, n_adversarial: int, seed: int = 0) -> list[tuple[dict, str]]:
    rng = random.Random(seed)
    items = []
    for i in range(n - n_adversarial):
        gold, right, wrong = PROBLEMS[i % len(PROBLEMS)]
        answer = rng.choice(right if rng.random() < 0.5 else wrong)
        reasoning = " ".join(rng.choice(["so", "then", "we", "get", "x", "=", "2"]) for _ in range(200))
        items.append(({"id": f"math-{i}", "answer": gold}, f"{reasoning} \\boxed{{{answer}}}"))
    for k in range(n_adversarial):
        items.append(({"id": f"adv-{k}", "answer": "5"}, ADVERSARIAL[k % len(ADVERSARIAL)]))
    rng.shuffle(items)
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--adversarial", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    items = build_items(args.n, args.adversarial)
    t0 = time.monotonic()
    with RewardPool(
        "rewards/math.py:boxed_accuracy", workers=args.workers, timeout_s=args.timeout_s,
        search_dirs=[str(REPO)],
    ) as pool:
        started = time.monotonic()
        last = [0.0]

        def progress(done: int, total: int) -> None:
            if time.monotonic() - last[0] > 2 or done == total:
                last[0] = time.monotonic()
                print(f"  {done}/{total} scored, {time.monotonic() - started:.1f} s", flush=True)

        result = pool.score(items, on_progress=progress)
    elapsed = time.monotonic() - t0
    accuracy = sum(result.scores) / len(result.scores)
    check_s = sorted(result.check_seconds)
    slow = [items[i][0]["id"] for i, s in enumerate(result.check_seconds) if s > 1.0]
    print(f"pool start-up {started - t0:.1f} s, scoring {result.seconds:.1f} s, "
          f"mean reward {accuracy:.3f}")
    print(f"check time: median {1000 * check_s[len(check_s) // 2]:.1f} ms, "
          f"max {check_s[-1]:.2f} s; slow (> 1 s): {len(slow)} {sorted(slow)}")
    print(f"killed at timeout: {[items[i][0]['id'] for i in result.timed_out]}, "
          f"crashed: {[items[i][0]['id'] for i in result.crashed]}")
    print(f"RESULT completions_per_s={len(items) / elapsed:.1f} timeouts={result.timeouts} "
          f"elapsed_s={elapsed:.1f}")


if __name__ == "__main__":
    main()
