"""Small verifiers environments (the classic API) for tests/test_adapters_verifiers.py.

    env = load_lookup_env()            # a ToolEnv: a lookup tool over a table, rubric: the right value
    env = load_countdown_env(turns=3)  # a MultiTurnEnv: the environment counts the turns down
    env = load_clock_env(turns=3)      # the same, its answers reading the clock (replays differ)

Both are built the way verifiers' own examples are (``load_environment`` returning the
environment with its dataset and rubric), so arbor loads them as a user's would be.
"""

from __future__ import annotations

import time

import verifiers as vf
from datasets import Dataset

TABLE = {f"k{i}": f"v{(7 * i) % 10}" for i in range(10)}


def lookup(key: str) -> str:
    """The value stored under a key.

    Args:
        key: the key, like k3
    """
    return TABLE[key]


def found_value(completion, answer) -> float:
    """1 when the last assistant message names the right value."""
    last = [m for m in completion if m.role == "assistant"][-1]
    return float(answer in (last.content or ""))


def load_lookup_env(max_turns: int = 3) -> vf.Environment:
    rows = [{"question": f"What is stored under {key}? Use the lookup tool.", "answer": value}
            for key, value in TABLE.items()]
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[lookup], max_turns=max_turns,
                      rubric=vf.Rubric(funcs=[found_value]),
                      system_prompt="Call tools with <tool_call>{...}</tool_call>.")


class Countdown(vf.MultiTurnEnv):
    """The environment answers each turn with how many remain; done after ``max_turns``."""

    async def env_response(self, messages, state, **kwargs):
        left = self.max_turns - len(state["trajectory"])
        return [vf.UserMessage(content=f"{left} turns left. You said: {messages[-1].content}")]


def turns_taken(state) -> float:
    return float(len(state["trajectory"]))


def load_countdown_env(turns: int = 3) -> vf.Environment:
    rows = [{"question": f"Count with me ({i}).", "answer": ""} for i in range(4)]
    return Countdown(dataset=Dataset.from_list(rows), max_turns=turns, rubric=vf.Rubric(funcs=[turns_taken]))


class Clock(Countdown):
    """Countdown whose answers carry the clock: hidden non-determinism a replay cannot repeat."""

    async def env_response(self, messages, state, **kwargs):
        (message,) = await super().env_response(messages, state, **kwargs)
        return [vf.UserMessage(content=f"{message.content} ({time.monotonic_ns()})")]


def load_clock_env(turns: int = 3) -> vf.Environment:
    rows = [{"question": f"Count with me ({i}).", "answer": ""} for i in range(4)]
    return Clock(dataset=Dataset.from_list(rows), max_turns=turns, rubric=vf.Rubric(funcs=[turns_taken]))
