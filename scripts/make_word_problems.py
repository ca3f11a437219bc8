"""Templated one- and two-step arithmetic word problems with gold answers (configs/smollm2_math.yaml).

    python scripts/make_word_problems.py                        # -> data/word-problems/{train,test}.jsonl
    python scripts/make_word_problems.py --out /tmp/wp --train 500 --test 100 --seed 1

Each problem is a short story whose answer is a whole number: one step (``a + b``,
``a - b``, ``a × b``) or two (``a + b - c``, ``a × b + c``, ``a + (a + b)``, change from a
bill). Small numbers (sums under 50, products under 50), so a 135M model can often do the arithmetic and RL has something to fix
in how it sets the problem up and reports the answer. Rows are ``{"id", "prompt",
"answer", "steps"}``; no prompt text is in both splits. The output is a function of the
arguments only (seeded ``random.Random``): re-running writes the same bytes, which is why
the generated files may be committed. The last line printed is ``RESULT train=... test=...``.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonah", "Kai", "Lena",
         "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
ITEMS = ["apples", "pencils", "marbles", "stickers", "books", "cookies", "stamps", "shells", "cards", "eggs"]
CONTAINERS = {"box": "boxes", "bag": "bags", "jar": "jars", "basket": "baskets", "crate": "crates"}

Problem = tuple[str, int]  # (story, gold answer)
Template = Callable[[random.Random], Problem]


def _people(rng: random.Random) -> tuple[str, str]:
    first, second = rng.sample(NAMES, 2)
    return first, second


def buys_more(rng: random.Random) -> Problem:
    name, _ = _people(rng)
    item, a, b = rng.choice(ITEMS), rng.randint(2, 20), rng.randint(2, 20)
    return f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", a + b


def gives_away(rng: random.Random) -> Problem:
    name, friend = _people(rng)
    item, a = rng.choice(ITEMS), rng.randint(5, 30)
    b = rng.randint(1, a - 1)
    return f"{name} had {a} {item} and gave {b} of them to {friend}. How many {item} does {name} have left?", a - b


def containers(rng: random.Random) -> Problem:
    box, item = rng.choice(sorted(CONTAINERS)), rng.choice(ITEMS)
    a, b = rng.randint(2, 9), rng.randint(2, 5)
    return f"Each {box} holds {a} {item}. How many {item} are in {b} {CONTAINERS[box]}?", a * b


def buys_then_gives(rng: random.Random) -> Problem:
    name, friend = _people(rng)
    item, a, b = rng.choice(ITEMS), rng.randint(5, 20), rng.randint(2, 10)
    c = rng.randint(1, a + b - 1)
    story = (f"{name} has {a} {item}, buys {b} more, and then gives {c} to {friend}. "
             f"How many {item} does {name} have now?")
    return story, a + b - c


def packs_and_extra(rng: random.Random) -> Problem:
    name, _ = _people(rng)
    box, item = rng.choice(sorted(CONTAINERS)), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 5), rng.randint(2, 6), rng.randint(1, 9)
    story = (f"{name} buys {a} {CONTAINERS[box]} with {b} {item} in each and finds {c} more {item} at home. "
             f"How many {item} does {name} have in all?")
    return story, a * b + c


def more_than(rng: random.Random) -> Problem:
    name, friend = _people(rng)
    item, a, b = rng.choice(ITEMS), rng.randint(2, 15), rng.randint(1, 9)
    story = (f"{name} has {a} {item}. {friend} has {b} more {item} than {name}. "
             f"How many {item} do they have together?")
    return story, a + (a + b)


def change_from_bill(rng: random.Random) -> Problem:
    name, _ = _people(rng)
    price, count = rng.randint(1, 5), rng.randint(2, 4)
    bill = next(b for b in (10, 20, 50) if b > price * count)
    story = (f"A notebook costs {price} dollars. {name} buys {count} notebooks and pays with a "
             f"{bill}-dollar bill. How many dollars of change does {name} get?")
    return story, bill - price * count


ONE_STEP: list[Template] = [buys_more, gives_away, containers]
TWO_STEP: list[Template] = [buys_then_gives, packs_and_extra, more_than, change_from_bill]


def make_problems(n: int, seed: int) -> list[dict[str, object]]:
    """``n`` distinct problems, half one-step and half two-step, in a seeded order."""
    rng, seen, rows = random.Random(seed), set(), []
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 100 * n:
            raise ValueError(f"could not draw {n} distinct problems (only {len(rows)}): ask for fewer")
        steps = 1 if len(rows) % 2 == 0 else 2
        story, answer = rng.choice(ONE_STEP if steps == 1 else TWO_STEP)(rng)
        if story in seen:
            continue
        seen.add(story)
        rows.append({"prompt": story, "answer": str(answer), "steps": steps})
    return rows


def split(rows: list[dict[str, object]], test: int) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """The first ``test`` rows are the test split, the rest train (prompts are distinct)."""
    tagged = [{"id": f"wp-{'test' if i < test else 'train'}-{i if i < test else i - test}", **row}
              for i, row in enumerate(rows)]
    return tagged[test:], tagged[:test]


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, sort_keys=False) + "\n" for row in rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "word-problems")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--test", type=int, default=300)
    parser.add_argument("--seed", type=int, default=15)
    args = parser.parse_args(argv)
    train, test = split(make_problems(args.train + args.test, args.seed), args.test)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "test.jsonl", test)
    print(f"RESULT train={len(train)} test={len(test)} out={args.out}")


if __name__ == "__main__":
    main()
