"""Engine kills at a point the test chooses, for the runs that check an engine's restart.

    arm, kills = kill_while_the_producer_samples(1, victim=scheduler_of)
    history = train(cfg, after_step=arm)     # engine 0's server dies once, mid-sampling
    assert len(kills) == 1

A barrier, not a timing window: after step ``N`` (its push done, the producer free to sample
the next batch) the trainer waits in its ``after_step`` hook, no push possible, until the
asynchronous producer's requests are in flight, and kills engine 0's server then. The trainer
cannot move on before the kill, so the run's length does not decide whether it happens.

:class:`KillAtTheProducersRequest` chooses the very request instead (the run's functions
patched): which thread finds the server dead, and when the producer's request reaches the
restarted server (before its restore, or before the trainer's push).
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


class KillAtTheProducersRequest:
    """Kills the server that the producer's first request of step ``step`` goes to, at a point
    the test chooses (functions of the run patched with ``monkeypatch``, no timing window):

    - ``by="producer"``: once step ``step − 1`` has ended (its push done, the trainer's
      ``after_step`` hook run), the producer's request finds the server dead and the producer
      restarts it; the trainer waits for that batch meanwhile, so it cannot restart it first.
    - ``by="trainer"``: the race of the two threads, forced. The producer's request waits
      until the trainer, about to push step ``step − 1``'s weights, finds the server dead and
      restarts it; the request reaches the restarted server ``before="push"`` (restored: it
      serves model.path's weights until that push, or with LoRA the last pushed adapter) or
      ``before="restore"`` (nothing loaded yet), and the trainer waits for its answer first.

        kill = KillAtTheProducersRequest(monkeypatch, 3, by="trainer")
        history = train(cfg, after_step=kill.after_step)
        assert kill.kills == [url]
    """

    def __init__(self, monkeypatch, step: int, *, by: str = "producer", before: str = "push",
                 timeout_s: float = 120) -> None:
        import threading

        from arbor.engines.client import SGLangClient
        from arbor.run import phases
        from arbor.run.weight_sync import EngineWeights

        assert by in ("producer", "trainer") and before in ("push", "restore") and step >= 2
        self.step, self.by, self.timeout_s = step, by, timeout_s
        self.kills: list[str] = []  # the URLs killed
        self.engines = None  # the run's EngineGroup, from the after_step hook or the push
        self._armed = False
        self._url: str | None = None
        self._events = {name: threading.Event() for name in ("step ended", "request waiting", "server back", "answered")}
        collect, generate_many = phases.collect_rollouts, SGLangClient.generate_many
        push_weights, restore, push = phases.push_weights, EngineWeights.restore, EngineWeights.push

        def in_producer() -> bool:
            return threading.current_thread().name == "arbor-rollouts"

        def collect_rollouts(sampling, rewards, stream, log, cfg, step):
            if in_producer() and step == self.step:
                if by == "producer":
                    self._wait("step ended")
                self._armed = True
            return collect(sampling, rewards, stream, log, cfg, step)

        async def generate_many_(client, requests):
            import asyncio

            if not (in_producer() and self._armed and requests):
                return await generate_many(client, requests)
            self._armed = False
            url = client.server_for(requests[0].affinity_key)
            if by == "producer":
                await asyncio.to_thread(self._kill, url)
                return await generate_many(client, requests)
            self._url = url
            self._events["request waiting"].set()
            await asyncio.to_thread(self._wait, "server back")
            try:
                return await generate_many(client, requests)
            finally:
                self._events["answered"].set()

        def push_weights_(weights, recovery, version):
            if by == "trainer" and version == str(self.step - 1):
                self._wait("request waiting")
                self.engines = recovery.engines
                assert self._url is not None
                self._kill(self._url)
            return push_weights(weights, recovery, version)

        def restore_(weights, url):
            if before == "restore":
                self._events["server back"].set()
                self._wait("answered")  # the restarted server answered the producer before its restore
                return restore(weights, url)
            served = restore(weights, url)
            self._events["server back"].set()
            return served

        def push_(weights, version):
            if self._events["server back"].is_set() and not self._events["answered"].is_set():
                self._wait("answered")  # the restarted server answered the producer before this push
            return push(weights, version)

        monkeypatch.setattr(phases, "collect_rollouts", collect_rollouts)
        monkeypatch.setattr(SGLangClient, "generate_many", generate_many_)
        if by == "trainer":
            monkeypatch.setattr(phases, "push_weights", push_weights_)
            monkeypatch.setattr(EngineWeights, "restore", restore_)
            monkeypatch.setattr(EngineWeights, "push", push_)

    def after_step(self, ctx, step: int, metrics: dict) -> None:
        self.engines = ctx.engines
        if step == self.step - 1:
            self._events["step ended"].set()

    def _wait(self, event: str) -> None:
        assert self._events[event].wait(self.timeout_s), f"no '{event}' within {self.timeout_s:.0f} s (step {self.step})"

    def _kill(self, url: str) -> None:
        assert self.engines is not None
        kill_server(self.engines, url, self.timeout_s)
        self.kills.append(url)


def kill_server(engines, url: str, timeout_s: float = 120) -> None:
    """SIGKILL the server at ``url`` (one of ``engines``, the run's EngineGroup) and wait until
    it stops answering."""
    import urllib.error
    import urllib.request

    import ray

    os.kill(ray.get(engines.worker(url).pid.remote()), signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
        except urllib.error.HTTPError:
            pass  # it answered (with an error): alive
        except OSError:
            return
        time.sleep(0.01)
    raise AssertionError(f"{url} still answers {timeout_s:.0f} s after its SIGKILL")


def kill_after_the_health_check(monkeypatch, step: int) -> list[str]:
    """Kills engine 0's server in step ``step``'s push, just after the check that every server
    answers: the push itself finds it dead. The list it returns gets the URL."""
    from arbor.run.recovery import EngineRecovery

    kills: list[str] = []
    revive_dead = EngineRecovery.revive_dead

    def revive_then_kill(recovery) -> None:
        revive_dead(recovery)
        if recovery.weights.version == str(step - 1) and not kills:
            url = recovery.engines.urls[0]
            kill_server(recovery.engines, url)
            kills.append(url)

    monkeypatch.setattr(EngineRecovery, "revive_dead", revive_then_kill)
    return kills
