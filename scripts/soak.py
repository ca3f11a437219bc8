"""A fault soak: the quickstart for N steps while its engine server and reward workers are killed.

    python scripts/soak.py [--steps 10] [--engine-kills 2] [--reward-kills 3] [--seed 0] [--out runs/soak]

Runs ``configs/quickstart.yaml`` in this process (``arbor.run.trainer.train``) with a killer
thread that SIGKILLs, at random moments, processes this run started itself, by pid: the
engine server (``EngineWorker.pid``; only while a rollout is under way, the phase where a
dead engine's requests are sent again, and never in two steps in a row: that is a crash
loop, which stops the run after ``engine.max_restarts``) and a reward worker (a ``arbor-reward-worker``
child of this process; only while rewards are being scored). Then it checks that the run
finished, that every step's metrics were written, and that the final checkpoint resumes
(one more step with ``run.resume=true``). Ends with

    RESULT steps=... engine_kills=... engine_restarts=... reward_kills=... reward_crashed=... lost_steps=0

``engine_restarts`` and ``reward_crashed`` are the run's own counts (``engine/restarts``,
``reward/crashed``); ``lost_steps`` are steps without a metrics record. Exit code 0 when
nothing was lost and the resume worked.
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
    """Kills the run's engine server during rollouts and reward workers during scoring."""

    def __init__(self, engine_kills: int, reward_kills: int, seed: int) -> None:
        self.left = {"engine": engine_kills, "reward": reward_kills}
        self.done = {"engine": 0, "reward": 0}
        self.rng = random.Random(seed)
        self.phase = ""  # the run's last status line: "rollout: 3/32 trees", "rewards: 10/256", ...
        self.engine_pid: Any = lambda: None  # the engine server's pid (None: not to be killed now)
        self.rest_steps = 0  # steps to finish before the engine may be killed again
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def arm(self, ctx: Any) -> None:
        """Follow the run's phases (its status lines) and learn how to find its engine."""
        import ray

        show, worker = ctx.log.status, ctx.engines.workers[0]
        pid = ray.get(worker.pid.remote())
        self.engine_pid = lambda: pid

        def status(text: str) -> None:
            self.phase = text
            show(text)

        ctx.log.status = status
        self.thread.start()

    def refresh(self, ctx: Any) -> None:
        """After a step: the engine may have been restarted (a new pid). After an engine kill
        one step is left whole: an engine killed in every step is a crash loop, which stops
        the run after engine.max_restarts by design."""
        import ray

        self.rest_steps = max(0, self.rest_steps - 1)
        if self.rest_steps == 0:
            pid = ray.get(ctx.engines.workers[0].pid.remote())
            self.engine_pid = lambda: pid

    def loop(self) -> None:
        """A random pause, a random victim, then the next moment its phase is under way."""
        while not self.stop.wait(self.rng.uniform(0.5, 6.0)):
            what = self.rng.choice([k for k, n in self.left.items() if n > 0] or [None])
            if what is None:
                return
            phase = "rollout: " if what == "engine" else "rewards: "
            while not self.stop.wait(0.02) and not self.phase.startswith(phase):
                pass
            if self.stop.is_set():
                return
            if what == "engine":
                pid = self.engine_pid()
                if pid is not None:  # None: killed this step; its restart's pid is read after the step
                    self.kill(what, pid)
                    self.engine_pid, self.rest_steps = (lambda: None), 2
                continue
            workers = [c for c in multiprocessing.active_children() if c.name == "arbor-reward-worker"]
            if workers:
                self.kill(what, self.rng.choice(workers).pid)

    def kill(self, what: str, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it had just exited: not a kill
            return
        self.left[what] -= 1
        self.done[what] += 1
        print(f"soak: killed the {what} process {pid} during {self.phase!r}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--engine-kills", type=int, default=2)
    parser.add_argument("--reward-kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/soak")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.chdir(REPO)  # the quickstart's paths are relative to the repository
    overrides = [f"run.output_dir={out}", f"run.steps={args.steps}", "run.eval_every=0",
                 f"run.save_every={max(1, args.steps // 2)}", "run.loggers=[]"]
    killer = Killer(args.engine_kills, args.reward_kills, args.seed)

    def after_step(ctx: Any, step: int, metrics: dict) -> None:
        if step == 1:
            killer.arm(ctx)
        else:
            killer.refresh(ctx)

    start = time.monotonic()
    history = train(load_config("configs/quickstart.yaml", overrides), after_step=after_step)
    killer.stop.set()
    logged = {int(m["step"]) for m in read_metrics(out)}
    lost = [s for s in range(1, args.steps + 1) if s not in logged]
    restarts = sum(m.get("engine/restarts", 0) for m in history)
    crashed = sum(m.get("reward/crashed", 0) for m in history)
    print(f"soak: {len(history)} steps in {time.monotonic() - start:.0f} s; resuming the final checkpoint…", flush=True)
    resumed = train(load_config("configs/quickstart.yaml", [*overrides[:1], f"run.steps={args.steps + 1}",
                                                            *overrides[2:], "run.resume=true"]))
    resumes = len(resumed) == 1 and args.steps + 1 in {int(m["step"]) for m in read_metrics(out)}
    print(f"RESULT steps={len(history)} engine_kills={killer.done['engine']} engine_restarts={restarts:.0f} "
          f"reward_kills={killer.done['reward']} reward_crashed={crashed:.0f} lost_steps={len(lost)} "
          f"resumed={'yes' if resumes else 'no'}")
    return 0 if not lost and resumes and len(history) == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
