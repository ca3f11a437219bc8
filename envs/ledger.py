"""A ledger the model keeps: the environment of docs/environments.md, runnable on the quickstart's
model (models/tiny-arith answers two-number sums and differences).

    arbor train configs/quickstart.yaml rollout.env=envs/ledger.py:Ledger reward.functions=[] \
        data.train_path=data/env/ledger.jsonl data.eval_path=null rollout.segment_tokens=16 \
        rollout.max_depth=4 run.eval_every=0 run.output_dir=runs/ledger

Each episode opens an account with a balance and a deposit drawn from the tree's seed and asks
for the new balance; the model's answer **is written into the ledger** (a side effect: a wrong
answer stays wrong for the rest of the episode), then a withdrawal is asked for from what the
ledger holds. The reward is the share of the two entries the model got right, so it varies
between branches. The ledger is state: branches fork by ``copy`` (each gets its own ledger) and
must never see each other's entries.

The environment writes its own prompt and judges the episode itself: its problems need no
``prompt`` or ``answer`` column (data/env/ledger.jsonl holds ids only).
"""

from __future__ import annotations

import copy
import random
import re

from arbor import Step

SUFFIX = " Put the answer in \\boxed{}."  # the instruction the quickstart's model was warm-started with
BOXED = re.compile(r"\\boxed\{(-?\d+)\}")


class Ledger:
    fork = "copy"  # the ledger is state: a branch gets a copy in the state its path left

    def __init__(self, entries: int = 2) -> None:
        self.entries = entries  # questions per episode (a deposit, then withdrawals)
        self.balance = 0  # what the ledger holds: the model's last answer
        self.true_balance = 0
        self.right = 0
        self.asked = 0
        self.rng = random.Random(0)

    def reset(self, problem: dict, seed: int) -> list[dict]:
        # Every draw from (problem, seed): a replay or a copy rebuilds the same episode.
        self.rng = random.Random(f"{problem['id']}/{seed}")
        self.balance = self.true_balance = self.rng.randint(10, 49)
        return [self._ask("+", self.rng.randint(1, 49))]

    def step(self, history: list[dict]) -> Step:
        found = BOXED.findall(history[-1]["content"])
        if found:
            self.balance = int(found[-1])  # the side effect: the ledger holds what the model wrote
            self.right += self.balance == self.true_balance
        if not found or self.asked >= self.entries:
            return Step([], done=True)  # no balance to go on from, or every entry made
        return Step([self._ask("-", self.rng.randint(1, max(1, self.balance)))], done=False)

    def reward(self) -> float:
        return self.right / self.entries

    def copy(self) -> Ledger:
        return copy.deepcopy(self)  # the RNG travels with the copy

    def close(self) -> None:
        pass

    def _ask(self, op: str, amount: int) -> dict:
        self.asked += 1
        # Each entry is judged on its own sum: from what the ledger holds, right or not.
        self.true_balance = self.balance + amount if op == "+" else self.balance - amount
        return {"role": "user", "content": f"What is {self.balance}{op}{amount}?{SUFFIX}"}
