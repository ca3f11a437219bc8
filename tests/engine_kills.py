"""Engine kills at a point the test chooses, for the runs that check an engine's restart.

    arm, kills = kill_while_the_producer_samples(1, victim=scheduler_of)
    history = train(cfg, after_step=arm)     # engine 0's server dies once, mid-sampling
    assert len(kills) == 1

A barrier, not a timing window: after step ``N`` (its push done, the producer free to sample
the next batch) the trainer waits in its ``after_step`` hook, no push possible, until the
asynchronous producer's requests are in flight, and kills engine 0's server then. The trainer
cannot move on before the kill, so the run's length does not decide whether it happens.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable


def kill_while_the_producer_samples(after_step: int, victim: Callable[[int], int] = lambda pid: pid,
                                    timeout_s: float = 120) -> tuple[Callable, list[int]]:
    """An ``after_step`` hook that, after step ``after_step``, SIGKILLs ``victim(engine 0's pid)``
    (that process or one of its children) while the producer's requests are in flight; the
    list it returns gets the killed pid."""
    import ray

    kills: list[int] = []

    def arm(ctx, step: int, metrics: dict) -> None:
        if step != after_step:
            return
        pid = victim(ray.get(ctx.engines.workers[0].pid.remote()))
        deadline = time.monotonic() + timeout_s
        with ctx.weights.held():  # no push starts meanwhile (the trainer waits here anyway)
            # The recovery counts every generate call of the run; the trainer's own engine is idle.
            while ctx.recovery.in_flight <= ctx.sampling.engine.in_flight:
                assert time.monotonic() < deadline, f"the producer sent no request within {timeout_s:.0f} s of step {step}"
                time.sleep(0.001)
            os.kill(pid, signal.SIGKILL)
            kills.append(pid)

    return arm, kills
