"""Exceptions that cross module boundaries, and the record of a failed episode.

Two kinds of trouble, two rules (docs/failures.md):

- **A failure of one episode's user code** (an environment, agent, program or reward function
  raised, returned a bad value or ran past its time limit) drops that branch, never trained
  on, and is recorded as an :class:`EpisodeFailure` (counted in ``failures/<kind>``). The run goes
  on unless more than ``reward.max_failure_fraction`` of a step's episodes failed: then
  :class:`RewardFailureError` stops it, naming the first failure's problem id, turn and message.
- **What no branch can survive** (a config error, a lost engine or node, too many failures, steps
  that train nothing) is a :class:`RunStopped`: ``arbor train`` / ``eval`` / ``sft`` print its
  message as one line, exit with status 1 and keep the traceback in ``<run.output_dir>/arbor.log``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration problem, found before any work starts.

    The message names the offending key (``loss.clip_high``) and, where known, the file.
    """


class RunStopped(RuntimeError):
    """An error that stops a run. Its message names what failed and the fix; the command line
    prints it as one line (the traceback goes to the run's ``arbor.log``)."""


# What failed in an episode, as counted in ``failures/<kind>`` (docs/metrics.md).
FAILURE_KINDS = (
    "env_error",  # an environment's reset/step/copy/reward raised or returned a bad value
    "env_timeout",  # ... ran past rollout.env_timeout_s
    "agent_error",  # a stateless agent's start/step raised or returned a bad value
    "agent_timeout",  # ... ran past rollout.agent_timeout_s
    "program_error",  # an agent program raised, exited non-zero or returned a bad reward
    "program_timeout",  # ... ran past its time limit
    "reward_error",  # a reward function raised or returned a non-finite value
    "reward_timeout",  # ... ran past reward.timeout_s (killed)
    "reward_crash",  # ... its worker process died
)
# Served judges and reward models (reward.functions kind judge / classifier / http) are not in
# this list: a call that fails scores the term's failure_value, counted in reward/served_failures.


@dataclass(frozen=True)
class EpisodeFailure:
    """One branch dropped because user code failed on it."""

    kind: str  # one of FAILURE_KINDS
    problem_id: str  # repr of the problem's id, as in every message that names a problem
    turn: int | None  # the environment turn (or program call) it failed at; None: not turn-based
    message: str  # what the user code said (its exception's message, the bad value)

    def __post_init__(self) -> None:
        if self.kind not in FAILURE_KINDS:
            raise ValueError(f"unknown failure kind {self.kind!r}: one of {', '.join(FAILURE_KINDS)}")

    def describe(self) -> str:
        """``problem 'p3', turn 2: env_error: step raised KeyError: 'x'``"""
        turn = "" if self.turn is None else f", turn {self.turn}"
        return f"problem {self.problem_id}{turn}: {self.kind}: {self.message}"


def failure_counts(failures: Sequence[EpisodeFailure]) -> dict[str, float]:
    """``failures/<kind>`` for every kind (0 included, so curves are continuous) and ``failures/total``."""
    counts = {f"failures/{kind}": 0.0 for kind in FAILURE_KINDS}
    for failure in failures:
        counts[f"failures/{failure.kind}"] += 1
    counts["failures/total"] = float(len(failures))
    return counts


class RewardFailureError(RunStopped):
    """More than ``reward.max_failure_fraction`` of a step's episodes failed (user code raised,
    returned a bad value or timed out; reward checks that timed out or crashed count too): what is
    left is what happened to survive, and training on it would hide the failure."""


def check_failure_share(
    failures: Sequence[EpisodeFailure], episodes: int, max_fraction: float, where: str,
) -> None:
    """:class:`RewardFailureError` when more than ``max_fraction`` of ``episodes`` failed; the
    message names the first failure's problem id, turn and message, and the keys to change.

    >>> f = EpisodeFailure("env_error", "'p0'", 1, "step raised KeyError: 'x'")
    >>> check_failure_share([f], 10, 0.1, "step 1")   # 10% is not more than 10%
    >>> check_failure_share([f, f], 10, 0.1, "step 1")
    Traceback (most recent call last):
    ...
    arbor.errors.RewardFailureError: step 1: 2 of 10 episodes failed (20% > reward.max_failure_fraction=0.1). First: problem 'p0', turn 1: env_error: step raised KeyError: 'x'. Fix the code that failed, or raise reward.max_failure_fraction (1.0: never stop); every failure is in the run's arbor.log
    """
    if not failures:
        return
    episodes = max(episodes, len(failures))
    share = len(failures) / episodes
    if share <= max_fraction:
        return
    kinds = sorted({f.kind for f in failures})
    more = f" (kinds: {', '.join(kinds)})" if len(kinds) > 1 else ""
    raise RewardFailureError(
        f"{where}: {len(failures)} of {episodes} episodes failed ({share:.0%} > reward.max_failure_fraction="
        f"{max_fraction:g}){more}. First: {failures[0].describe()}. Fix the code that failed, or raise "
        "reward.max_failure_fraction (1.0: never stop); every failure is in the run's arbor.log"
    )


class EmptyStepsError(RunStopped):
    """``run.max_empty_steps`` steps in a row trained nothing (every tree dropped)."""
