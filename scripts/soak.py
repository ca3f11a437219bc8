"""A fault soak: the quickstart for N steps while its engine server and reward workers are killed.

    python scripts/soak.py [--steps 10] [--engine-kills 2] [--reward-kills 3] [--seed 0] [--out runs/soak]
    python scripts/soak.py --max-staleness 1      # the same, asynchronous (a producer samples ahead)

Runs ``configs/quickstart.yaml`` in this process (``arbor.run.trainer.train``) with a killer
thread that SIGKILLs, at random moments, processes this run started itself, by pid: the
engine server (``EngineWorker.pid``) while generate calls of the run are in flight
(``EngineRecovery.in_flight``, whichever thread sent them: the trainer's or the asynchronous
producer's) and no weight push is under way (``EngineWeights.held``: a broadcast cannot be
replayed), never in two steps in a row (a crash loop, which stops the run after
``engine.max_restarts`` by design); and a reward worker (an ``arbor-reward-worker`` child of
this process) while a batch is scored (``RewardPool.scoring``). Then it checks that the run
finished, that every step's metrics were written, and that the final checkpoint resumes
(one more step with ``run.resume=true``). Ends with

    RESULT steps=... engine_kills=2/2 engine_restarts=... reward_kills=3/3 reward_crashed=... lost_steps=0 resumed=yes

``engine_restarts`` and ``reward_crashed`` are the run's own counts (``engine/restarts``,
``reward/crashed``); ``lost_steps`` are steps without a metrics record. Exit code 0 when
every planned kill was made, every engine kill was recovered, nothing was lost and the
resume worked; a soak that kills less than planned has tested less than it says, and fails.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from arbor.config_load import load_config  # noqa: E402
from arbor.run.metrics import read_metrics  # noqa: E402
from arbor.run.trainer import train  # noqa: E402


class Killer:
    """Kills the run's engine server while it generates and reward workers while they score."""

    def __init__(self, engine_kills: int, reward_kills: int, seed: int) -> None:
        self.planned = {"engine": engine_kills, "reward": reward_kills}
        self.left = dict(self.planned)
        self.done = {"engine": 0, "reward": 0}
        self.rng = random.Random(seed)
        self.ctx: Any = None
        self.engine_pid: int | None = None  # None: killed this step; its restart's pid is read after the step
        self.rest_steps = 0  # steps to finish before the engine may be killed again
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def arm(self, ctx: Any) -> None:
        """Learn where the run's engine and reward pool are, then start killing."""
        self.ctx = ctx
        self.engine_pid = self._read_pid()
        self.thread.start()

    def refresh(self) -> None:
        """After a step: the engine may have been restarted (a new pid). After an engine kill
        one step is left whole: an engine killed in every step is a crash loop, which stops
        the run after engine.max_restarts by design."""
        self.rest_steps = max(0, self.rest_steps - 1)
        if self.rest_steps == 0 and self.engine_pid is None:
            self.engine_pid = self._read_pid()

    def _read_pid(self) -> int:
        import ray

        with self.ctx.weights.held():  # not while a recovery restarts it
            return ray.get(self.ctx.engines.workers[0].pid.remote())

    def loop(self) -> None:
        """A random pause, a random victim, then the next moment its phase is under way."""
        while not self.stop.wait(self.rng.uniform(0.2, 2.0)):
            what = self.rng.choice([k for k, n in self.left.items() if n > 0] or [None])
            if what is None:
                return
            while not self.stop.wait(0.005) and not self.strike(what):
                pass

    def strike(self, what: str) -> bool:
        """Kill a ``what`` process if its phase is under way now; whether the moment came."""
        if what == "reward":
            workers = [c for c in multiprocessing.active_children() if c.name == "arbor-reward-worker"]
            if not (self.ctx.rewards.scoring and workers):
                return False
            self.kill(what, self.rng.choice(workers).pid)
            return True
        if self.engine_pid is None:
            return False
        with self.ctx.weights.held():  # no push starts while the engine dies
            if self.ctx.recovery.in_flight == 0:
                return False
            if self.kill(what, self.engine_pid):
                self.engine_pid, self.rest_steps = None, 2
        return True

    def kill(self, what: str, pid: int) -> bool:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it had just exited: not a kill
            return False
        self.left[what] -= 1
        self.done[what] += 1
        print(f"soak: killed the {what} process {pid}", file=sys.stderr, flush=True)
        return True


def failures(steps: int, history: list[dict], logged: set[int], killer: Killer, resumed: bool) -> list[str]:
    """Why the soak failed (empty: it passed)."""
    found = []
    if len(history) != steps:
        found.append(f"the run stopped after {len(history)} of {steps} steps")
    lost = [s for s in range(1, steps + 1) if s not in logged]
    if lost:
        found.append(f"steps without a metrics record: {lost}")
    for what, planned in killer.planned.items():
        if killer.done[what] < planned:
            found.append(f"{killer.done[what]} of {planned} planned {what} kills were made: the soak tested less")
    restarts = sum(m.get("engine/restarts", 0) for m in history)
    if restarts < killer.done["engine"]:
        found.append(f"{killer.done['engine']} engine kills but {restarts:.0f} restarts")
    if not resumed:
        found.append("the final checkpoint did not resume")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--engine-kills", type=int, default=2)
    parser.add_argument("--reward-kills", type=int, default=3)
    parser.add_argument("--max-staleness", type=int, default=0, help="algorithm.max_staleness (≥ 1: asynchronous)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/soak")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.chdir(REPO)  # the quickstart's paths are relative to the repository
    overrides = [f"run.output_dir={out}", f"run.steps={args.steps}", "run.eval_every=0",
                 f"run.save_every={max(1, args.steps // 2)}", "run.loggers=[]",
                 f"algorithm.max_staleness={args.max_staleness}"]
    killer = Killer(args.engine_kills, args.reward_kills, args.seed)

    def after_step(ctx: Any, step: int, metrics: dict) -> None:
        if step == 1:
            killer.arm(ctx)
        else:
            killer.refresh()

    start = time.monotonic()
    history = train(load_config("configs/quickstart.yaml", overrides), after_step=after_step)
    killer.stop.set()
    logged = {int(m["step"]) for m in read_metrics(out)}
    print(f"soak: {len(history)} steps in {time.monotonic() - start:.0f} s; resuming the final checkpoint…", flush=True)
    resumed = train(load_config("configs/quickstart.yaml", [*overrides[:1], f"run.steps={args.steps + 1}",
                                                            *overrides[2:], "run.resume=true"]))
    resumes = len(resumed) == 1 and args.steps + 1 in {int(m["step"]) for m in read_metrics(out)}
    restarts = sum(m.get("engine/restarts", 0) for m in history)
    crashed = sum(m.get("reward/crashed", 0) for m in history)
    lost = [s for s in range(1, args.steps + 1) if s not in logged]
    print(f"RESULT steps={len(history)} engine_kills={killer.done['engine']}/{args.engine_kills} "
          f"engine_restarts={restarts:.0f} reward_kills={killer.done['reward']}/{args.reward_kills} "
          f"reward_crashed={crashed:.0f} lost_steps={len(lost)} resumed={'yes' if resumes else 'no'}")
    problems = failures(args.steps, history, logged, killer, resumes)
    for problem in problems:
        print(f"soak: FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
