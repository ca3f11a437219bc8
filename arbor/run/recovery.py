"""Engine failures during a run: restart the server, give it the run's weights, send again.

    recovery = EngineRecovery(engines, weights, cfg.engine, out_dir)
    engine = RecoveringEngine(engine_client(cfg.engine, engines.urls), recovery, weights)
    outs = await engine.generate_many(requests)   # a server that died meanwhile is back, the calls sent again
    metrics |= recovery.step_metrics()            # engine/restarts of the step

The engine client only reports that a server stopped answering: an ``unreachable``
:class:`~arbor.engines.errors.EngineError` once its retries are spent. Whether to restart it
is the run's decision, made here. The run's engines, as the sampler, the evals and the
weight-sync probe see them, are a :class:`RecoveringEngine`: every request names the LoRA
adapter the engines serve (:attr:`arbor.run.weight_sync.EngineWeights.adapter`), and a call
that finds its server dead has :class:`EngineRecovery` bring it back, then is sent again
once. Each thread that samples (the trainer's; an asynchronous run's producer, see
:mod:`arbor.run.async_rollouts`) has its own (an HTTP session belongs to one event loop);
all share one recovery. Recovery, once per death whichever request noticed it first:

1. nothing, if the server answers ``/health`` (a hiccup, or another request restarted it);
2. its :class:`~arbor.run.engine_group.EngineWorker` starts it again (same command and port:
   the URL, and so the routing of trees to servers, stays as it was); when the worker itself
   is gone (its node lost, its process killed), a new one starts where Ray re-places the
   engine's bundle (an alive node), and every client sends that engine's requests to its new
   URL (:meth:`EngineRecovery.recover` returns it);
3. it gets the weights and version the other engines serve
   (:meth:`~arbor.run.weight_sync.EngineWeights.restore`). A recovery waits while the
   learners' weights are ahead of the engines' (from a step's training to its push), so the
   restored server serves what the others do.

The requests in flight are sent again as they were (seeded), so the step completes with
the same trees. A restarted server may answer before it serves the run's weights: a call
retried by the client (or sent by another thread) reaches it between its restart and its
restore, or, restarted before a push, until that push. Such an answer (labelled with a
weight version older than the one the call was sent under) or refusal (LoRA: the adapter not
loaded yet) is not used: the call waits for the restore (or the push) and is sent again,
counted in ``engine/stale_answers``; otherwise an asynchronous run would train on, or drop,
trees sampled by model.path's weights.

An engine that needs more than ``engine.max_restarts`` restarts without a step in between
that it served whole stops the run: :class:`EngineFailedError` with its log's last lines and
the last checkpoint (``run.resume=true`` continues from it).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TypeVar

from arbor.config import EngineConfig
from arbor.engines.client import SGLangClient
from arbor.engines.connect import run_sync
from arbor.engines.errors import EngineError
from arbor.engines.launch import EngineLaunchError
from arbor.engines.types import GenerateOutput, GenerateRequest
from arbor.errors import RunStopped
from arbor.run import checkpoint
from arbor.run.engine_group import EngineGroup
from arbor.run.nodes import node_lost
from arbor.run.weight_sync import EngineWeights, behind

HEALTH_TIMEOUT_S = 30.0  # a lost machine answers nothing: a health check waits no longer

T = TypeVar("T")


class EngineFailedError(RunStopped):
    """An engine could not be kept running: the run stops (the last checkpoint is intact)."""


class EngineRecovery:
    """Restarts the run's engines that die and counts the restarts (from any thread)."""

    def __init__(self, engines: EngineGroup, weights: EngineWeights, engine_cfg: EngineConfig, output_dir: str) -> None:
        self.engines, self.weights, self.engine_cfg, self.output_dir = engines, weights, engine_cfg, output_dir
        self.max_restarts = engine_cfg.max_restarts
        self.in_a_row = dict.fromkeys(engines.urls, 0)  # restarts since the engine last served a whole step
        self.died_this_step: set[str] = set()
        self.restarts_this_step = 0
        self.in_flight = 0  # generate calls of the run's engines awaiting an answer (a soak kills engines then)
        self.moved: dict[str, str] = {}  # an engine's old URL -> its URL after it started in a new actor
        self.stale_answers = 0  # calls sent again this step: a restarted server answered before its restore
        # Per URL, +1 when a recovery restarts it and +1 when its restore ends (odd: being restored).
        self._restores: dict[str, int] = {}
        self._counts = threading.Lock()  # the fields above; never held while waiting for anything

    def recover(self, url: str, error: EngineError) -> str:
        """Bring the server at ``url`` back with the run's weights, or raise EngineFailedError;
        the URL it answers at now (another one when it moved to a new actor)."""
        with self.weights.held():  # one recovery at a time; no push meanwhile
            while url in self.moved:  # another request moved it already
                url = self.moved[url]
            if self._healthy(url):
                return url
            self._mark(url)
            try:
                new_url = self._restart(url, error)
                served = self.weights.restore(new_url)
            finally:
                self._mark(url)
            url = new_url
        print(f"arbor train: engine {url} is back, serving {served}", file=sys.stderr, flush=True)
        return url

    def _mark(self, url: str) -> None:
        with self._counts:
            self._restores[url] = self._restores.get(url, 0) + 1

    def restores(self) -> dict[str, int]:
        """The restore marks now (:meth:`restored_since` compares a later moment with them)."""
        with self._counts:
            return dict(self._restores)

    def restored_since(self, url: str | None, marks: dict[str, int]) -> bool:
        """Whether the server at ``url`` was being restored at ``marks`` or has been restarted since."""
        with self._counts:
            now = self._restores.get(url, 0) if url is not None else 0
        then = marks.get(url, 0) if url is not None else 0
        return now != then or then % 2 == 1

    def wait_restored(self) -> None:
        """Until no restore runs and the learners' weights are the engines' (a push under way ended)."""
        with self.weights.held():
            pass

    def count_stale_answer(self) -> None:
        with self._counts:
            self.stale_answers += 1

    def push(self, version: str) -> int:
        """``weights.push(version)`` once every server answers (:meth:`revive_dead`); the bytes sent.

        A server that stops answering during the push itself: with ``learner.weight_sync:
        disk`` (each engine loads a directory: a load can be sent again) it is recovered and
        the push made again, once (a learner rank on the server's lost node stops the run, as
        in any recovery); a broadcast or an adapter load, which cannot be replayed on the
        engines that took it, stops the run naming the server, or the learner rank that was
        lost with its node.
        """
        self.revive_dead()
        try:
            return self.weights.push(version)
        except EngineError as exc:
            if not exc.unreachable or exc.server is None:
                raise
            if self.weights.method != "disk":
                self._lost_node(exc.server)  # a learner rank lost with it is the cause
                raise EngineFailedError(
                    f"engine {exc.server} stopped answering during the push of weight version {version} "
                    f"({self.weights.method}), which cannot be sent again to the engines that took it: "
                    f"{exc}. {checkpoint.resume_hint(self.output_dir)}"
                ) from exc
            self.recover(exc.server, exc)
        return self.weights.push(version)

    def revive_dead(self) -> None:
        """Recover every server that does not answer ``/health`` now (before a weight sync,
        whose broadcast cannot be replayed: a server that died after its last rollout
        request is found here rather than in the middle of the broadcast)."""
        for url in list(self.engines.urls):  # a moved engine changes its entry
            if not self._healthy(url):
                self.recover(url, EngineError("not answering /health before the weight sync", url=url))

    def step_metrics(self) -> dict[str, float]:
        """``engine/restarts`` and ``engine/stale_answers`` since the last call (the step now
        ending); engines that did not die meanwhile start counting their restarts in a row from 0 again."""
        with self._counts:
            for url in self.in_a_row:
                if url not in self.died_this_step:
                    self.in_a_row[url] = 0
            metrics = {"engine/restarts": float(self.restarts_this_step),
                       "engine/stale_answers": float(self.stale_answers)}
            self.died_this_step, self.restarts_this_step, self.stale_answers = set(), 0, 0
        return metrics

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Counts a generate call in :attr:`in_flight` while it runs."""
        with self._counts:
            self.in_flight += 1
        try:
            yield
        finally:
            with self._counts:
                self.in_flight -= 1

    def _healthy(self, url: str) -> bool:
        """Whether the server at ``url`` answers ``/health`` within ``HEALTH_TIMEOUT_S`` (a client
        and loop of this thread's own; a lost machine answers nothing, and a health check must
        not wait engine.request_timeout_s)."""
        return run_sync(lambda c: c.health(), [url], timeout_s=min(HEALTH_TIMEOUT_S, self.engine_cfg.request_timeout_s),
                        api_key=self.engine_cfg.api_key)

    def _restart(self, url: str, error: EngineError) -> str:
        """Start the engine at ``url`` again; the URL it answers at now."""
        worker = self.engines.worker(url)
        if worker is None:
            raise EngineFailedError(
                f"engine {url} stopped answering ({error}); it is external (engine.kind: external), "
                f"so arbor cannot restart it. {checkpoint.resume_hint(self.output_dir)}"
            )
        import ray

        while True:
            with self._counts:
                self.in_a_row[url] += 1
                in_a_row = self.in_a_row[url]
            if in_a_row > self.max_restarts:
                tail = ray.get(worker.log_tail.remote())
                raise EngineFailedError(
                    f"engine {url} died {in_a_row} times without serving a whole step in between "
                    f"(engine.max_restarts={self.max_restarts}); last error: {error}. "
                    f"{checkpoint.resume_hint(self.output_dir)}{tail}"
                )
            print(f"arbor train: engine {url} stopped answering ({error}); restarting it "
                  f"({in_a_row}/{self.max_restarts} in a row)", file=sys.stderr, flush=True)
            try:
                ray.get(worker.restart.remote())
                break
            except EngineLaunchError as e:  # died again while starting: counts as another failure
                error = EngineError(str(e).splitlines()[0], url=url)
            except ray.exceptions.RayActorError:
                url = self._move(url)  # its actor is gone with its node (or process): start it anew
                break
        with self._counts:
            self.restarts_this_step += 1
            self.died_this_step.add(url)
        return url

    def _lost_node(self, url: str) -> str | None:
        """The address of the engine at ``url``'s node if Ray declares it lost (waiting for the
        verdict), else None; a learner rank lost with it stops the run (LearnerFailedError)."""
        node = self.engines.node_of(url)
        if node is None or not node_lost(node[0]):
            return None
        lost = self.weights.learners.lost_rank_error()
        if lost is not None:
            raise lost
        return node[1]

    def _move(self, url: str) -> str:
        """Start the engine at ``url``, whose actor is gone, in a new actor (on an alive node when
        its own was lost); its new URL. A learner rank on a lost node stops the run instead."""
        # Wait for Ray's verdict on the node: until it declares a lost node dead, the engine's
        # bundle stays there and a new actor would be sent to a dead machine.
        node = self._lost_node(url)
        if node is not None:
            print(f"arbor train: engine {url}'s node {node} is lost; starting the engine again where Ray "
                  "re-places its bundle", file=sys.stderr, flush=True)
        else:
            print(f"arbor train: engine {url}'s actor is gone; starting it again", file=sys.stderr, flush=True)
        try:
            new_url = self.engines.replace(url)
        except EngineLaunchError as e:
            raise EngineFailedError(f"{e}. {checkpoint.resume_hint(self.output_dir)}") from e
        with self._counts:
            self.moved[url] = new_url
            self.in_a_row[new_url] = self.in_a_row.pop(url)
        self.weights.moved(url, new_url)
        print(f"arbor train: engine {url} now runs at {new_url}", file=sys.stderr, flush=True)
        return new_url


class RecoveringEngine:
    """The run's engines as the sampler, evals and probe see them (a
    :class:`~arbor.engines.types.RolloutEngine` with the client's batch call): requests name
    the served adapter; a dead server is recovered and the call sent again once."""

    def __init__(self, client: SGLangClient, recovery: EngineRecovery, weights: EngineWeights) -> None:
        self.client, self.recovery, self.weights = client, recovery, weights
        self.in_flight = 0  # this one's generate calls awaiting an answer (the recovery counts all)

    @contextmanager
    def _generating(self) -> Iterator[None]:
        self.in_flight += 1  # this engine's own loop is its only user
        try:
            with self.recovery.generating():
                yield
        finally:
            self.in_flight -= 1

    def fresh(self) -> RecoveringEngine:
        """One for another thread: a client of its own (a session belongs to one event loop)."""
        return RecoveringEngine(self.client.over(self.client.urls), self.recovery, self.weights)

    def server_for(self, affinity_key: str | None) -> str:
        return self.client.server_for(affinity_key)

    @property
    def generate_calls(self) -> int:
        """``/generate`` calls this one's client sent (``rollout/requests``)."""
        return self.client.generate_calls

    async def close(self) -> None:
        """Close the client's HTTP session (it belongs to the event loop that made it)."""
        await self.client.close()

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        async def one() -> list[list[GenerateOutput]]:
            return [await self.client.generate(self._named(request))]

        with self._generating():
            return (await self._current(one))[0]

    async def generate_many(self, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
        """The client's batch call, one per server, each recovered on its own (a survivor's
        requests are not sent twice when another server died)."""
        by_server: dict[str | None, list[int]] = {}
        for i, request in enumerate(requests):
            key = request.affinity_key
            by_server.setdefault(None if key is None else self.client.server_for(key), []).append(i)

        async def send(indices: list[int]) -> list[list[GenerateOutput]]:
            return await self._current(lambda: self.client.generate_many([self._named(requests[i]) for i in indices]))

        results: list[list[GenerateOutput]] = [[] for _ in requests]
        with self._generating():
            for indices, outputs in zip(by_server.values(), await asyncio.gather(*map(send, by_server.values()))):
                for i, output in zip(indices, outputs):
                    results[i] = output
        return results

    async def flush_cache(self) -> None:
        await self._sent(self.client.flush_cache)

    def _named(self, request: GenerateRequest) -> GenerateRequest:
        """``request`` naming the adapter the engines serve now (named when sent: a call sent
        again after a push samples the pushed weights)."""
        adapter = self.weights.adapter
        return request if request.adapter == adapter else replace(request, adapter=adapter)

    async def _current(
        self, call: Callable[[], Awaitable[list[list[GenerateOutput]]]]
    ) -> list[list[GenerateOutput]]:
        """``call``'s outputs (:meth:`_sent`), sent again once a restarted server that answered
        or refused it before its restore (or the push under way) serves the run's weights."""
        version, marks = self.weights.version, self.recovery.restores()
        try:
            outputs = await self._sent(call)
        except EngineError as exc:
            if exc.unreachable or exc.status is None or not self.recovery.restored_since(exc.server, marks):
                raise
        else:
            if not any(behind(out.weight_version, version) for outs in outputs for out in outs):
                return outputs
        self.recovery.count_stale_answer()
        await asyncio.to_thread(self.recovery.wait_restored)
        return await self._sent(call)

    async def _sent(self, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await call()
        except EngineError as exc:
            if not exc.unreachable or exc.server is None:
                raise  # the request's fault (4xx) or a reply arbor cannot read: not a dead server
            # In a thread: a recovery may wait for a push (and a restart takes seconds) while
            # this loop's other requests go on.
            url = await asyncio.to_thread(self.recovery.recover, exc.server, exc)
            if url != exc.server and exc.server in self.client.urls:  # it moved: its requests follow
                self.client.urls[self.client.urls.index(exc.server)] = url
        return await call()
