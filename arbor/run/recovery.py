"""Engine failures during a run: restart the server, give it the run's weights, send again.

    recovery = EngineRecovery(engines, learners, cfg.engine, cfg.learner.weight_sync, out_dir)
    recovery.client                       # the run's engine client: it awaits recover() when a server stops answering
    ...                                   # one RL step
    metrics |= recovery.step_metrics()    # engine/restarts of the step

A server that dies mid-step (killed, out of memory) makes the client's retries of a
request fail; the client then awaits :meth:`EngineRecovery.recover` and sends the request
again. Recovery, once per death whichever request noticed it first:

1. nothing, if the server answers ``/health`` (a hiccup, or another request restarted it);
2. its :class:`~arbor.run.engine_group.EngineWorker` starts it again (same command and port:
   the URL, and so the client's routing of trees to servers, stays as it was);
3. it gets the run's weights and version: the learners export them (the HF directory
   ``learner.weight_sync: disk`` uses) and the server loads them and flushes its cache. With
   ``learner.weight_sync: distributed`` the other engines leave the weight-update group and
   the learner drops it, so the next sync opens a new group with every engine.

The requests in flight are sent again as they were (seeded), so the step completes with
the same trees. An engine that needs more than ``engine.max_restarts`` restarts without a
step in between that it served whole stops the run: :class:`EngineFailedError` with its
log's last lines and the last checkpoint (``run.resume=true`` continues from it).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from arbor.config import EngineConfig
from arbor.engines.client import SGLangClient
from arbor.engines.connect import engine_client, run_sync
from arbor.engines.errors import EngineError
from arbor.engines.launch import EngineLaunchError
from arbor.run import checkpoint
from arbor.run.engine_group import EngineGroup
from arbor.run.learner_group import LearnerGroup
from arbor.run.nodes import node_lost

T = TypeVar("T")
HEALTH_TIMEOUT_S = 30.0


class EngineFailedError(RuntimeError):
    """An engine could not be kept running: the run stops (the last checkpoint is intact)."""


class EngineRecovery:
    """Owns the driver's engine client (:attr:`client`), restarts the engines that die under
    it and counts the restarts."""

    def __init__(self, engines: EngineGroup, learners: LearnerGroup, engine_cfg: EngineConfig, weight_sync: str,
                 output_dir: str) -> None:
        self.engines, self.learners, self.engine_cfg = engines, learners, engine_cfg
        self.max_restarts, self.weight_sync, self.output_dir = engine_cfg.max_restarts, weight_sync, output_dir
        # The client awaits recover() when a server stopped answering, then sends the call again.
        self.client: SGLangClient = engine_client(engine_cfg, engines.urls, recover=self.recover)
        self.in_a_row = dict.fromkeys(engines.urls, 0)  # restarts since the engine last served a whole step
        self.died_this_step: set[str] = set()
        self.restarts_this_step = 0
        self._locks = {url: threading.Lock() for url in engines.urls}
        self.moved: dict[str, str] = {}  # an engine's old URL -> its URL after it moved to another node

    async def recover(self, url: str, error: EngineError) -> str:
        """Bring the server at ``url`` back with the run's weights, or raise EngineFailedError;
        the URL it answers at now."""
        return await asyncio.to_thread(self._recover, url, error)

    def revive_dead(self) -> None:
        """Recover every server that does not answer ``/health`` now (before a weight sync,
        whose broadcast cannot be replayed: a server that died after its last rollout
        request is found here rather than in the middle of the broadcast)."""
        for url in list(self.engines.urls):  # a moved engine changes its entry
            if not self._healthy(url):
                self._recover(url, EngineError("not answering /health before the weight sync", url=url))

    def _healthy(self, url: str) -> bool:
        """Whether the server at ``url`` answers ``/health`` within ``HEALTH_TIMEOUT_S`` (a
        lost machine answers nothing: a health check must not wait engine.request_timeout_s)."""
        return run_sync(lambda c: c.health(), [url], timeout_s=min(HEALTH_TIMEOUT_S, self.engine_cfg.request_timeout_s),
                        api_key=self.engine_cfg.api_key)

    def _on(self, url: str, make_call: Callable[[SGLangClient], Awaitable[T]]) -> T:
        """One call to the server at ``url`` alone, from this thread (its own client and loop)."""
        return run_sync(make_call, [url], timeout_s=self.engine_cfg.request_timeout_s, api_key=self.engine_cfg.api_key)

    def step_metrics(self) -> dict[str, float]:
        """``engine/restarts`` of the step now ending; engines that did not die in it start
        counting their restarts in a row from 0 again."""
        for url in self.in_a_row:
            if url not in self.died_this_step:
                self.in_a_row[url] = 0
        metrics = {"engine/restarts": float(self.restarts_this_step)}
        self.died_this_step, self.restarts_this_step = set(), 0
        return metrics

    def _recover(self, url: str, error: EngineError) -> str:
        with self._locks[url]:  # the other requests to this server wait for its restart
            if url in self.moved:  # another request moved it already
                return self.moved[url]
            if self._healthy(url):
                return url
            worker = self.engines.worker(url)
            if worker is None:
                raise EngineFailedError(
                    f"engine {url} stopped answering ({error}); it is external (engine.kind: external), "
                    f"so arbor cannot restart it. {checkpoint.resume_hint(self.output_dir)}"
                )
            import ray

            while True:
                self.in_a_row[url] += 1
                if self.in_a_row[url] > self.max_restarts:
                    tail = ray.get(worker.log_tail.remote())
                    raise EngineFailedError(
                        f"engine {url} died {self.in_a_row[url]} times without serving a whole step in between "
                        f"(engine.max_restarts={self.max_restarts}); last error: {error}. {checkpoint.resume_hint(self.output_dir)}{tail}"
                    )
                print(f"arbor train: engine {url} stopped answering ({error}); restarting it "
                      f"({self.in_a_row[url]}/{self.max_restarts} in a row)", file=sys.stderr, flush=True)
                try:
                    ray.get(worker.restart.remote())
                    break
                except EngineLaunchError as e:  # died again while starting: counts as another failure
                    error = EngineError(str(e).splitlines()[0], url=url)
                except ray.exceptions.RayActorError:
                    url = self._move(url)  # its actor is gone with its node (or process): start it anew
                    break
            self.restarts_this_step += 1
            self.died_this_step.add(url)
            self._restore_weights(url)
            return url

    def _move(self, url: str) -> str:
        """Start the engine at ``url``, whose actor is gone, in a new actor (on an alive node when
        its own was lost); its new URL. A learner rank on a lost node stops the run instead."""
        node = self.engines.node_of(url)
        # Wait for Ray's verdict on the node: until it declares a lost node dead, the engine's
        # bundle stays there and a new actor would be sent to a dead machine.
        if node is not None and node_lost(node[0]):
            lost = self.learners.lost_rank_error()
            if lost is not None:
                raise lost
            print(f"arbor train: engine {url}'s node {node[1]} is lost; starting the engine again where Ray "
                  "re-places its bundle", file=sys.stderr, flush=True)
        else:
            print(f"arbor train: engine {url}'s actor is gone; starting it again", file=sys.stderr, flush=True)
        try:
            new_url = self.engines.replace(url)
        except EngineLaunchError as e:
            raise EngineFailedError(f"{e}. {checkpoint.resume_hint(self.output_dir)}") from e
        self.moved[url] = new_url
        self.in_a_row[new_url] = self.in_a_row.pop(url)
        self._locks[new_url] = self._locks[url]
        self.client.urls[self.client.urls.index(url)] = new_url
        print(f"arbor train: engine {url} now runs at {new_url}", file=sys.stderr, flush=True)
        return new_url

    def _restore_weights(self, url: str) -> None:
        """The restarted server serves model.path's weights: give it the run's current ones."""
        version = self.learners.weight_version
        if version is not None:
            sync_dir = os.path.join(self.output_dir, "weight-sync")  # where disk and LoRA sync write too
            if self.learners.adapter is not None:
                # LoRA: every adapter the other engines hold (their directories are kept until
                # unloaded), oldest first, so the current one is loaded last and served.
                held = sorted(Path(sync_dir).glob("arbor-lora-*"), key=lambda p: p.stat().st_mtime)
                for path in held:
                    name, directory = path.name, str(path)
                    self._on(url, lambda c: c.load_lora_adapter(name, directory))  # noqa: B023 (awaited at once)
                self._on(url, lambda c: c.update_weight_version(version))
            else:
                self.learners.export_hf(sync_dir)
                self._on(url, lambda c: c.update_weights_from_disk(sync_dir, weight_version=version))
            self._on(url, lambda c: c.flush_cache())
            served = self._on(url, lambda c: c.get_weight_version())
            if served != [version]:
                raise EngineFailedError(f"engine {url} restarted but serves weight version {served}, not {version!r}")
        if self.weight_sync == "distributed" and not self.learners.lora:  # LoRA pushes open no group
            # The old group had the dead server in it: the others leave, the next sync opens a new one.
            self.learners.reset_weight_sync([u for u in self.engines.urls if u != url])
        print(f"arbor train: engine {url} is back, serving weight version {version or 'of model.path'}",
              file=sys.stderr, flush=True)
