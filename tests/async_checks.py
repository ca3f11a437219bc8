"""What every asynchronous run's test asserts (``algorithm.max_staleness`` = k ≥ 1), so that a run
that trained nothing, or whose producer ran in series, fails:

    history = train(cfg)                 # at least k + 2 steps
    check_async_trained(history, k)

- it ran past the point where staleness can drop trees (k + 2 steps: the batch of step k + 2 is
  the first that can be older than the bound),
- every step from 2 on trained trees (``rollout/trees_trained`` > 0: an agentic tree dropped as
  too stale, the bug this guards, trains none),
- the producer overlapped the learner: from step 2 on, the trees trained were sampled under
  older weights on average (``async/staleness_mean`` > 0; a producer run in series samples each
  batch after the previous push, 0 old).
"""

from __future__ import annotations


def check_async_trained(history: list[dict], max_staleness: int, first_step: int = 1) -> None:
    """``history``: the metrics of the steps a run made, from ``first_step``."""
    assert len(history) >= max_staleness + 2, f"an asynchronous test runs ≥ max_staleness + 2 = {max_staleness + 2} steps"
    later = [(first_step + i, m) for i, m in enumerate(history) if first_step + i >= 2]
    untrained = [step for step, m in later if not m["rollout/trees_trained"] > 0]
    assert not untrained, f"steps {untrained} trained no tree (async/dropped: " \
                          f"{[m.get('async/dropped') for _, m in later]})"
    staleness = [m["async/staleness_mean"] for _, m in later]
    assert sum(staleness) / len(staleness) > 0, f"the producer never sampled ahead: async/staleness_mean {staleness}"
    assert all(m["async/staleness_mean"] <= max_staleness for _, m in later)
