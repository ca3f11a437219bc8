"""Environments for the tests: stateful ones with side effects under each fork mode, one with
hidden non-determinism, slow ones, and a chat-level one for `arbor train` / `arbor eval` runs
(``tests/env_fixtures.py:Recheck``)."""

from __future__ import annotations

import asyncio
import copy
import random
import threading
import time

from arbor import Env, Step

TOOL = 1000  # an environment turn's ids: TOOL, then TOOL + ord(c) per character (see render)


def render(messages: list[dict]) -> list[int]:
    """Token-level rendering that keeps the text: ``decode_turn`` reads it back."""
    return [TOOL] + [TOOL + ord(c) for m in messages for c in m["content"]]


def decode_turn(ids: list[int]) -> str:
    return "".join(chr(i - TOOL) for i in ids[1:])


class Registry:
    """Instances made and closed, per class (a test resets it)."""

    opened: list = []
    closed: list = []

    @classmethod
    def reset(cls) -> None:
        cls.opened, cls.closed = [], []


class Notebook(Env):
    """Stateful, with a side effect per step: it notes the model turn it is shown and answers with
    every note so far. A branch that saw another branch's step would show that turn in its notes.
    Its reward is the number of notes (steps taken on the branch). Replays are exact: forks by replay."""

    def __init__(self, turns: int = 2) -> None:
        self.turns = turns
        self.notes: list[str] = []
        Registry.opened.append(self)

    def reset(self, problem, seed):
        self.seed = seed
        return [{"role": "user", "content": f"problem {problem['id']} seed {seed}"}]

    def step(self, history):
        self.notes.append(history[-1]["content"])
        return Step([{"role": "tool", "content": "|".join(self.notes)}], done=len(self.notes) > self.turns)

    def reward(self):
        return float(len(self.notes))

    def close(self):
        Registry.closed.append(self)


class CopyNotebook(Notebook):
    fork = "copy"

    def copy(self):
        twin = copy.deepcopy(self)
        Registry.opened.append(twin)
        return twin


class NoForkNotebook(Notebook):
    fork = "none"


class Dice(Notebook):
    """Hidden non-determinism: its observation draws from the global RNG, not from reset's seed, so
    a replay of its steps gives other numbers."""

    def step(self, history):
        step = super().step(history)
        step.messages[0]["content"] += f" rolled {random.random():.6f}"
        return step


class SeededDice(Notebook):
    """Dice done right: its randomness comes from reset's seed, so replays agree."""

    def reset(self, problem, seed):
        self.rng = random.Random(seed)
        return super().reset(problem, seed)

    def step(self, history):
        step = super().step(history)
        step.messages[0]["content"] += f" rolled {self.rng.random():.6f}"
        return step


class Clock(Notebook):
    """Hidden non-determinism in reset: the prompt holds the time."""

    def reset(self, problem, seed):
        return [{"role": "user", "content": f"it is {time.perf_counter_ns()}"}]


class SlowOnce(Notebook):
    """Its first step on the first instance of each problem hangs (past the time limit)."""

    hung: set = set()
    release = threading.Event()

    def step(self, history):
        key = history[0]["content"]
        if key not in SlowOnce.hung:
            SlowOnce.hung.add(key)
            SlowOnce.release.wait(10)
        return super().step(history)


class Together(Notebook):
    """A plain step that only returns once ``parties`` steps run at the same time: steps of
    different branches overlap (in threads), or it raises."""

    barrier: threading.Barrier | None = None

    def step(self, history):
        assert Together.barrier is not None
        Together.barrier.wait(timeout=10)
        return super().step(history)


class AsyncNotebook(Notebook):
    """Every method ``async def``; a step waits until ``parties`` steps are in flight together."""

    fork = "copy"
    parties = 2
    waiting = 0
    all_in: asyncio.Event | None = None

    async def reset(self, problem, seed):
        await asyncio.sleep(0)
        return Notebook.reset(self, problem, seed)

    async def step(self, history):
        if AsyncNotebook.all_in is None:
            AsyncNotebook.all_in = asyncio.Event()
        AsyncNotebook.waiting += 1
        if AsyncNotebook.waiting >= AsyncNotebook.parties:
            AsyncNotebook.all_in.set()
        await asyncio.wait_for(AsyncNotebook.all_in.wait(), 10)
        return Notebook.step(self, history)

    async def reward(self):
        return float(len(self.notes))

    def copy(self):
        twin = copy.copy(self)
        twin.notes = list(self.notes)
        Registry.opened.append(twin)
        return twin

    async def close(self):
        Registry.closed.append(self)


class Recheck(Env):
    """A chat-level environment for runs on the quickstart model: the first answer is noted and
    answered "Check your answer." (a side effect: a note), the second ends the episode; the
    reward is 1 when an answer boxes the gold one."""

    def __init__(self) -> None:
        self.answers: list[str] = []

    def reset(self, problem, seed):
        self.gold = str(problem["answer"])
        return [{"role": "user", "content": problem["prompt"] + " Put the answer in \\boxed{}."}]

    def step(self, history):
        self.answers.append(history[-1]["content"])
        if len(self.answers) >= 2:
            return Step([], done=True)
        return Step([{"role": "user", "content": "Check your answer."}])

    def reward(self):
        return float(any(f"\\boxed{{{self.gold}}}" in answer for answer in self.answers))


class Exploding(Recheck):
    """Recheck whose every step raises: a broken environment, every episode of every step."""

    def step(self, history):
        raise KeyError(f"no account for {len(history)} messages")


class Silent(Env):
    """An environment that gives no reward (Env's default)."""

    def reset(self, problem, seed):
        return [{"role": "user", "content": problem["prompt"]}]

    def step(self, history):
        return Step([], done=True)


class Broken(Notebook):
    """Its second step raises (a bug in the environment)."""

    def step(self, history):
        if len(self.notes) == 1:
            raise KeyError("no such account")
        return super().step(history)
