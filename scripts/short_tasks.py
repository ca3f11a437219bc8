"""Short-answer tasks for a small real model: generate them, and screen a model on them.

    python scripts/short_tasks.py screen --model models/smollm2-135m-instruct [--tasks add2 compare ...]
        [--problems 100] [--samples 8] [--temperature 0.7]
    python scripts/short_tasks.py write TASK [--out data/short/TASK] [--train 2000] [--test 400] [--seed 0]

Each task draws problems whose answer is one whole number of at most three digits, asked
without chain of thought ("Answer with just the number."): the model's first few tokens
are the answer, so a rollout is a handful of tokens and a 2-core CPU can sample and train
hundreds of them a minute. ``screen`` measures, per task, the model's greedy accuracy and
its pass@k (k = ``--samples`` answers at ``--temperature``; a problem passes when one of
them is right) on ``--problems`` fresh problems, in transformers, with the prompt and the
scoring a run uses (the chat template, ``rewards/short_answer.py:number_answer``). RL has
room where pass@k is well above greedy and between ~20% and ~80%: groups of answers then
hold right and wrong ones. It prints one row per task and a Markdown table to paste into
the docs. ``write`` writes a task's disjoint train/test splits (no prompt in both), a
function of the arguments only, so re-running writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SUFFIX = " Answer with just the number."
Problem = tuple[str, int]  # (question, gold answer)

# Short common words for the letter-counting task (written here, not taken from a word list).
WORDS = ["apple", "banana", "cherry", "letter", "coffee", "bottle", "pepper", "balloon", "committee", "mississippi",
         "strawberry", "bookkeeper", "assessment", "possession", "success", "address", "giraffe", "hippopotamus",
         "parallel", "tomorrow", "referee", "engineer", "kangaroo", "butterfly", "millennium", "necessary",
         "accommodate", "occurrence", "teepee", "puppy", "grammar", "summer", "rabbit", "little", "yellow",
         "football", "classroom", "sunflower", "tennessee", "excellent", "raccoon", "cucumber", "beekeeper",
         "marshmallow", "umbrella", "volleyball", "waterfall", "woodpecker", "zucchini", "baggage"]


def add1(rng: random.Random) -> Problem:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"What is {a} + {b}?", a + b


def add2(rng: random.Random) -> Problem:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a} + {b}?", a + b


def sub2(rng: random.Random) -> Problem:
    a = rng.randint(20, 99)
    b = rng.randint(10, a - 1)
    return f"What is {a} - {b}?", a - b


def mul1(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"What is {a} times {b}?", a * b


def mul12(rng: random.Random) -> Problem:
    a, b = rng.randint(11, 29), rng.randint(2, 9)
    return f"What is {a} times {b}?", a * b


def larger(rng: random.Random) -> Problem:
    a, b = rng.sample(range(10, 100), 2)
    return f"Which number is larger, {a} or {b}?", max(a, b)


def smallest3(rng: random.Random) -> Problem:
    a, b, c = rng.sample(range(10, 100), 3)
    return f"Which is the smallest of {a}, {b} and {c}?", min(a, b, c)


def compare(rng: random.Random) -> Problem:
    """The larger or smaller of two numbers, or the largest or smallest of three."""
    if rng.random() < 0.5:
        a, b = rng.sample(range(10, 100), 2)
        word, pick = rng.choice([("larger", max), ("smaller", min)])
        return f"Which number is {word}, {a} or {b}?", pick(a, b)
    a, b, c = rng.sample(range(10, 100), 3)
    word, pick = rng.choice([("largest", max), ("smallest", min)])
    return f"Which is the {word} of {a}, {b} and {c}?", pick(a, b, c)


def count_letter(rng: random.Random) -> Problem:
    word = rng.choice(WORDS)
    letter = rng.choice(sorted(set(word)))
    return f"How many times does the letter '{letter}' appear in the word '{word}'?", word.count(letter)


def next_number(rng: random.Random) -> Problem:
    a = rng.randint(10, 998)
    return f"What number comes right after {a}?", a + 1


def sequence_step(rng: random.Random) -> Problem:
    start, step = rng.randint(1, 30), rng.randint(2, 9)
    terms = [start + step * i for i in range(4)]
    return f"What is the next number in the sequence {', '.join(map(str, terms))}?", start + step * 4


def word_problem(rng: random.Random) -> Problem:
    """One-step stories of scripts/make_word_problems.py (its generators, new draws)."""
    import make_word_problems as wp

    return rng.choice([wp.buys_more, wp.gives_away, wp.containers])(rng)


TASKS: dict[str, Callable[[random.Random], Problem]] = {
    f.__name__: f for f in (add1, add2, sub2, mul1, mul12, larger, smallest3, compare, count_letter, next_number,
                            sequence_step, word_problem)
}


def draw(task: str, count: int, seed: int, exclude: frozenset[str] = frozenset(), strict: bool = True) -> list[dict]:
    """``count`` problems of ``task`` with distinct prompts not in ``exclude`` (fewer when
    the task has fewer and not ``strict``)."""
    rng, seen, rows = random.Random(f"{task}-{seed}"), set(exclude), []
    tries = 0
    while len(rows) < count:
        tries += 1
        if tries > 200 * count:
            if not strict:
                break
            raise SystemExit(f"short_tasks: {task} has fewer than {count} distinct new prompts")
        prompt, answer = TASKS[task](rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"id": f"{task}-{seed}-{len(rows)}", "prompt": prompt, "answer": str(answer)})
    return rows


def write(task: str, out: Path, train: int, test: int, seed: int) -> None:
    test_rows = draw(task, test, seed + 1)
    train_rows = draw(task, train, seed, exclude=frozenset(r["prompt"] for r in test_rows))
    for i, r in enumerate(test_rows):
        r["id"] = f"{task}-test-{i}"
    for i, r in enumerate(train_rows):
        r["id"] = f"{task}-train-{i}"
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train_rows), ("test", test_rows)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"RESULT task={task} train={len(train_rows)} test={len(test_rows)} out={out}")


def answers(model, tokenizer, prompts: list[list[int]], stops: list[int], samples: int, temperature: float,
            max_new_tokens: int) -> list[list[str]]:
    """``samples`` answers per prompt (greedy when ``temperature`` is 0), batched with left padding."""
    import torch

    width = max(len(p) for p in prompts)
    pad = stops[0]
    batch = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = {"do_sample": False} if temperature == 0 else {
        "do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0, "num_return_sequences": samples}
    with torch.no_grad():
        out = model.generate(batch, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=stops,
                             pad_token_id=pad, **kwargs)
    rows = out[:, width:].tolist()
    texts = []
    for row in rows:
        cut = next((i for i, t in enumerate(row) if t in stops), len(row))
        texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    per = 1 if temperature == 0 else samples
    return [texts[i * per:(i + 1) * per] for i in range(len(prompts))]


def screen(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arbor.config import DataConfig
    from arbor.data import format_prompt, stop_token_ids
    from rewards.short_answer import number_answer

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    stops = stop_token_ids(tokenizer, args.model)
    data_cfg = DataConfig(prompt_suffix=SUFFIX, system_prompt=None)
    table = []
    for task in args.tasks:
        start = time.perf_counter()
        problems = draw(task, args.problems, seed=10_000 + args.seed, strict=False)
        prompts = [format_prompt(p, data_cfg, tokenizer, True) for p in problems]
        greedy, passed, sampled, shown = 0.0, 0, 0.0, ""
        for lo in range(0, len(problems), args.batch):
            chunk, ids = problems[lo:lo + args.batch], prompts[lo:lo + args.batch]
            first = answers(model, tokenizer, ids, stops, 1, 0.0, args.max_new_tokens)
            many = answers(model, tokenizer, ids, stops, args.samples, args.temperature, args.max_new_tokens)
            shown = shown or first[0][0]
            for p, g, m in zip(chunk, first, many):
                greedy += number_answer(p, g[0])
                scores = [number_answer(p, a) for a in m]
                passed += any(s == 1.0 for s in scores)
                sampled += sum(scores) / len(scores)
        n = len(problems)
        row = (task, greedy / n, sampled / n, passed / n)
        table.append(row)
        print(f"{task:14s} greedy={row[1]:.3f} sample_mean={row[2]:.3f} pass@{args.samples}={row[3]:.3f} "
              f"e.g. {problems[0]['prompt']!r} -> {shown!r} ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"\n| task | example | greedy | mean of {args.samples} samples | pass@{args.samples} |\n|---|---|---|---|---|")
    for task, g, s, p in table:
        example = draw(task, 1, seed=10_000 + args.seed)[0]["prompt"].replace("|", "\\|")
        print(f"| `{task}` | {example} | {g:.2f} | {s:.2f} | {p:.2f} |")
    print("RESULT " + " ".join(f"{task}={g:.3f}/{p:.3f}" for task, g, _, p in table))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("screen")
    s.add_argument("--model", default="models/smollm2-135m-instruct")
    s.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS))
    s.add_argument("--problems", type=int, default=100)
    s.add_argument("--samples", type=int, default=8)
    s.add_argument("--temperature", type=float, default=0.7)
    s.add_argument("--max-new-tokens", type=int, default=12)
    s.add_argument("--batch", type=int, default=25)
    s.add_argument("--seed", type=int, default=0)
    w = sub.add_parser("write")
    w.add_argument("task", choices=sorted(TASKS))
    w.add_argument("--out")
    w.add_argument("--train", type=int, default=2000)
    w.add_argument("--test", type=int, default=400)
    w.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "screen":
        screen(args)
    else:
        write(args.task, Path(args.out or ROOT / "data" / "short" / args.task), args.train, args.test, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
