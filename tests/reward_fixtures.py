"""Reward functions used by the reward-pool tests (loaded by spec in worker processes)."""

import os
import time


def length(problem: dict, completion: str) -> float:
    return float(len(completion))


def one(problem: dict, completion: str) -> float:
    return 1.0


def sleepy(problem: dict, completion: str) -> float:
    """Sleeps for problem['sleep'] seconds, then scores 1."""
    time.sleep(problem.get("sleep", 0))
    return 1.0


def raises_on_bad(problem: dict, completion: str) -> float:
    if completion == "bad":
        raise ValueError("cannot score this")
    return 1.0


def nan(problem: dict, completion: str) -> float:
    return float("nan")


def dies(problem: dict, completion: str) -> float:
    if completion == "die":
        os._exit(3)  # a worker that vanishes mid-check (e.g. killed for memory)
    return 1.0


not_callable = 42
