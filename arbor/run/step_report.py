"""What a step lost, said once: a console line summarising the branches dropped or ended early,
and the rule for steps that train nothing (``run.max_empty_steps``).

    empty = EmptySteps(cfg.run.max_empty_steps)
    ...
    line = dropped_summary(batch, stale=taken.metrics.get("async/dropped", 0), cfg=cfg)
    if line: ctx.log.note(step, line)
    counts, said = empty.update(batch, line)          # run/empty_steps, the console line if empty
    ...write the step's metrics...
    empty.check(step)                                 # EmptyStepsError past the limit

An **empty step** trains no tree for any reason but dynamic sampling (groups whose leaves all
scored alike teach nothing, and that is the filter working): every tree was too stale, failed, or
lost its branches to the response budget. Such a step is never silent: it is said on the console
with the counts and the keys to change, counted in ``run/empty_steps``, and after
``run.max_empty_steps`` in a row the run stops (:class:`~arbor.errors.EmptyStepsError`).
"""

from __future__ import annotations

from collections import Counter

from arbor.config import Config
from arbor.errors import EmptyStepsError
from arbor.run.phases import Batch


def dropped_summary(batch: Batch, stale: float, cfg: Config) -> str:
    """One line: the step's failed branches (by kind, the first one named), the branches ended or
    dropped at the response budget, diverged replays and trees dropped as too stale; "" if none."""
    parts = []
    if batch.failures:
        kinds = Counter(f.kind for f in batch.failures)
        counted = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))
        parts.append(f"{len(batch.failures)} branches failed ({counted}; first: {batch.failures[0].describe()[:300]})")
    ended = sum(s.overflow_ended for s in batch.stats)
    too_long = sum(s.dropped_too_long for s in batch.stats)
    budget = (f"rollout.segment_tokens × rollout.max_depth = {cfg.rollout.max_response_tokens} tokens, "
              f"rollout.env_overflow: {cfg.rollout.env_overflow}")
    if ended:
        parts.append(f"{ended} episodes ended where the next message did not fit the response budget ({budget})")
    if too_long:
        parts.append(f"{too_long} branches dropped: the next message did not fit the response budget ({budget})")
    diverged = sum(s.env_diverged + s.program_diverged for s in batch.stats)
    if diverged:
        parts.append(f"{diverged} replays diverged and were dropped (hidden non-determinism, a global RNG or a "
                     "clock: seed everything from the episode's seed; env/diverged, program/diverged)")
    if stale:
        parts.append(f"{stale:.0f} trees dropped as older than algorithm.max_staleness="
                     f"{cfg.algorithm.max_staleness} updates (async/dropped)")
    return "; ".join(parts)


class EmptySteps:
    """Counts steps that train nothing and stops the run after ``limit`` in a row (0: never)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0  # run/empty_steps: empty steps so far in this run
        self.in_a_row = 0
        self.why = ""

    @staticmethod
    def is_empty(batch: Batch) -> bool:
        """No tree trains, and not only because every group scored alike (dynamic sampling)."""
        return not batch.trees and batch.alike < len(batch.sampled)

    def update(self, batch: Batch, dropped: str) -> tuple[dict[str, float], str]:
        """``run/empty_steps`` and the console line for an empty step ("" otherwise)."""
        if not self.is_empty(batch):
            self.in_a_row = 0
            return {"run/empty_steps": float(self.total)}, ""
        self.total += 1
        self.in_a_row += 1
        self.why = dropped or "every tree came back without a branch to train"
        line = (f"trained nothing: {len(batch.sampled)} trees sampled, none kept: {self.why} "
                f"(run/empty_steps {self.total}; {self.in_a_row} in a row, the run stops at run.max_empty_steps="
                f"{self.limit})")
        return {"run/empty_steps": float(self.total)}, line

    def check(self, step: int) -> None:
        """:class:`EmptyStepsError` once ``limit`` steps in a row trained nothing (after the step's
        metrics are written: nothing computed is lost)."""
        if self.limit and self.in_a_row >= self.limit:
            raise EmptyStepsError(f"step {step}: {self.in_a_row} steps in a row trained nothing; the last one: "
                                  f"{self.why}. Change what the counts point at (the keys named), or raise "
                                  "run.max_empty_steps (0: never stop)")
