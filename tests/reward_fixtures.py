"""Reward functions used by the reward-pool tests (loaded by spec in worker processes)."""

import multiprocessing
import os
import signal
import time

# A worker that dies while importing its reward module (the pool must not respawn forever).
if (os.environ.get("ARBOR_TEST_DIE_AT_IMPORT")
        and multiprocessing.current_process().name == "arbor-reward-worker"):
    os._exit(7)
# Workers that die while importing until the folder ARBOR_TEST_DEATHS_DIR holds
# ARBOR_TEST_DEATHS marks, one left by each death: a few deaths in a row, then a worker lives.
if (os.environ.get("ARBOR_TEST_DEATHS_DIR")
        and multiprocessing.current_process().name == "arbor-reward-worker"
        and len(os.listdir(os.environ["ARBOR_TEST_DEATHS_DIR"])) < int(os.environ["ARBOR_TEST_DEATHS"])):
    open(os.path.join(os.environ["ARBOR_TEST_DEATHS_DIR"], str(os.getpid())), "w").close()
    os._exit(7)
# A worker that takes a while to import (so a test can kill it while it starts).
if (os.environ.get("ARBOR_TEST_SLOW_IMPORT")
        and multiprocessing.current_process().name == "arbor-reward-worker"):
    time.sleep(float(os.environ["ARBOR_TEST_SLOW_IMPORT"]))


def length(problem: dict, completion: str) -> float:
    return float(len(completion))


def one(problem: dict, completion: str) -> float:
    return 1.0


def sleepy(problem: dict, completion: str) -> float:
    """Sleeps for problem['sleep'] seconds, then scores 1."""
    time.sleep(problem.get("sleep", 0))
    return 1.0


def raises_on_bad(problem: dict, completion: str) -> float:
    """Raises on the completion "bad" (with the whole completion in the message); sleeps
    problem['sleep'] seconds otherwise."""
    if completion.startswith("bad"):
        raise ValueError(f"cannot score this: {completion}")
    time.sleep(problem.get("sleep", 0))
    return 1.0


def nan(problem: dict, completion: str) -> float:
    return float("nan")


def text(problem: dict, completion: str) -> float:
    return "1.0"  # type: ignore[return-value]  # a str, not a number


def dies(problem: dict, completion: str) -> float:
    if completion == "die":
        os._exit(3)  # a worker that vanishes mid-check (e.g. killed for memory)
    return 1.0


def segfaults(problem: dict, completion: str) -> float:
    if completion == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)  # what a crash in a C extension looks like
    return 1.0


def in_worker(problem: dict, completion: str) -> float:
    from arbor.rollout.rewards import in_reward_worker

    return float(in_reward_worker())


not_callable = 42


def boolean(problem: dict, completion: str) -> float:
    return True  # type: ignore[return-value]  # a bool is not a score


def waits_for_file(problem: dict, completion: str) -> float:
    """Waits until the file problem['go'] exists (the test says when), then raises on the
    completion "bad" and scores 1 otherwise."""
    deadline = time.monotonic() + 30
    while not os.path.exists(problem["go"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    if completion == "bad":
        raise ValueError("cannot score this")
    if completion == "die":
        os._exit(3)
    return 1.0


def meets(problem: dict, completion: str) -> float:
    """Leaves a mark in the folder problem['dir'], waits (up to problem['wait'] seconds)
    until problem['n'] marks are there, then scores how many there are: checks that run
    at the same time meet, checks that run one after another do not."""
    folder = problem["dir"]
    open(os.path.join(folder, f"{os.getpid()}-{completion}"), "w").close()
    deadline = time.monotonic() + problem["wait"]
    while len(os.listdir(folder)) < problem["n"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return float(len(os.listdir(folder)))


def raises_deep(problem: dict, completion: str) -> float:
    """Raises five calls deep (the error shows the innermost three frames)."""

    def level(k: int) -> float:
        if k == 0:
            raise KeyError("deep")
        return level(k - 1)

    return level(4)


def logs(problem: dict, completion: str) -> float:
    """Logs the completion as a warning (as math-verify logs its input on a timeout) and
    a line at info level, which the worker does not show."""
    import logging

    logging.getLogger("math_verify").warning("%s", completion)
    logging.getLogger("math_verify").info("not shown")
    return 1.0


# Defined in the parent only: the parent's check passes, the worker's own load fails.
if multiprocessing.current_process().name != "arbor-reward-worker":

    def parent_only(problem: dict, completion: str) -> float:
        return 1.0
