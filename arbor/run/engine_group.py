"""The rollout engines of a run: Ray actors that each own a server process on their node.

    cfg = settled(cfg)                                   # arbor.run.startup: kind and key decided
    engines = EngineGroup(cfg, placement, log_dir, wait=False)
    start_groups(engines, learners, clock)               # engines.urls once every server is healthy

SGLang on GPUs, ``arbor serve`` (the embedded engine) else; ``engine.kind: external``
adopts running servers instead. ``arbor eval`` launches the same servers in its own
process with :func:`launch_options`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from arbor.config import Config
from arbor.engines.interfaces import bind_collectives
from arbor.errors import ConfigError
from arbor.run.nodes import check_node_paths, node_address, node_id
from arbor.run.orchestration import Placement, cpu_threads, gather
from arbor.run.startup import engine_device, uses_gpu


class EngineWorker:
    """Owns one engine server process on its node (a Ray actor)."""

    def __init__(self, cfg: Config, index: int, log_dir: str, bind_node_address: bool,
                 output_token: str | None = None) -> None:
        """``output_token``: :func:`arbor.run.nodes.mark_output_dir`'s, checked on this node
        with the model's path before the server starts (:func:`~arbor.run.nodes.check_node_paths`)."""
        from arbor.engines.launch import launch_engines

        check_node_paths(cfg, output_token, f"engine {index}")
        if not uses_gpu(cfg):
            # Ray gives actors one thread; the server gets its share of the cores (run.cpu_threads).
            os.environ["OMP_NUM_THREADS"] = str(cpu_threads(cfg))
        host = node_address() if bind_node_address else cfg.engine.host
        # The server's end of the weight-update group (gloo/NCCL) uses this node's address too.
        bind_collectives(node_address(), reason=f"Ray's address of engine {index}'s node")
        self.handle = launch_engines(**launch_options(cfg), num_engines=1, host=host,
                                     log_dir=os.path.join(log_dir, f"engine-{index}"))
        self.startup_timeout_s = cfg.engine.startup_timeout_s

    def urls(self) -> list[str]:
        return self.handle.urls

    def node(self) -> tuple[str, str]:
        """This engine's Ray node id and address."""
        return node_id(), node_address()

    def pid(self) -> int:
        """The server's process id (what a fault test or scripts/soak.py kills)."""
        return self.handle.processes[0].pid

    def restart(self) -> None:
        """Start the dead server again on its port (model.path's weights; EngineRecovery restores the run's)."""
        self.handle.restart(0, self.startup_timeout_s)

    def log_tail(self, lines: int = 30) -> str:
        return self.handle.log_tail(0, lines)

    def shutdown(self) -> None:
        self.handle.shutdown()


def _not_started(index: int, e: Exception) -> Exception:
    from arbor.engines.launch import EngineLaunchError

    # Ray's message holds the actor's whole traceback; the launcher's own error (exit code, log
    # tail) or the config error it found (engine.python) says it all.
    message = str(e)
    for error in (ConfigError, EngineLaunchError):
        at = message.rfind(f"{error.__name__}: ")
        if at >= 0:
            reason = message[at + len(error.__name__) + 2:]
            return error(reason) if error is ConfigError else error(f"engine {index} did not start: {reason}")
    return EngineLaunchError(f"engine {index} did not start: {message}")


def launch_options(cfg: Config) -> dict[str, Any]:
    """:func:`~arbor.engines.launch.launch_engines` arguments from a settled config
    (:func:`~arbor.run.startup.settled`), the same for the run's engine actors and ``arbor eval``;
    the caller adds how many engines, where, and their log directory."""
    return dict(
        kind=cfg.engine.kind, model_path=cfg.model.path, urls=cfg.engine.urls or None,
        dtype=None if cfg.model.dtype == "auto" else cfg.model.dtype,
        device=engine_device(cfg), extra_args=engine_args(cfg),
        startup_timeout_s=cfg.engine.startup_timeout_s, gpus_per_engine=cfg.engine.tp_size,
        api_key=cfg.engine.api_key, python=cfg.engine.python,
    )


def engine_args(cfg: Config) -> list[str]:
    """Server flags from a settled config (the embedded server's cache bound, SGLang's memory;
    its rules were checked as it was settled: :func:`arbor.run.startup.settled`)."""
    from arbor.engines.launch import sglang_cpu_flags, sglang_flags

    if cfg.engine.kind == "auto":
        raise ValueError("engine.kind is still auto: settle the config first (arbor.run.startup.settled)")
    if cfg.engine.kind == "sglang":
        cpu = engine_device(cfg) == "cpu"
        # With model.dtype auto, the learner's (its auto: bfloat16 on GPUs, float32 on CPUs); an
        # explicit model.dtype reaches the server as launch_engines(dtype=...).
        dtype = None if cfg.model.dtype != "auto" else cfg.learner.dtype.replace("auto", "float32" if cpu else "bfloat16")
        args = sglang_flags(
            mem_fraction=cfg.engine.mem_fraction, tp_size=cfg.engine.tp_size, dtype=dtype,
            seed=cfg.run.seed, trust_remote_code=cfg.model.trust_remote_code,
            memory_saver=cfg.ray.colocate, deterministic=cfg.engine.deterministic,
        )
        if cpu:
            args += sglang_cpu_flags(cfg.engine.max_cached_tokens)
        if cfg.model.lora_rank:  # the adapters each push loads
            from arbor.run.weight_sync import lora_engine_flags

            args += lora_engine_flags(cfg.model)
    else:
        args = ["--max-cached-tokens", str(cfg.engine.max_cached_tokens)]
    return args + list(cfg.engine.extra_args)


class EngineGroup:
    """The run's rollout engines: Ray actors owning servers, or ``engine.urls`` (external).

    ``cfg`` is settled (:func:`~arbor.run.startup.settled`): the actors start the kind and
    require the key it names.
    """

    def __init__(self, cfg: Config, placement: Placement, log_dir: str, wait: bool = True,
                 output_token: str | None = None, place: Callable[[int, int], dict[str, Any]] | None = None) -> None:
        """Start the engines; with ``wait=False`` return at once and fill ``urls`` in :meth:`started`.
        ``output_token``: :func:`arbor.run.nodes.mark_output_dir`'s, which every engine checks on its node.
        ``place(index, tp_size)``: engine ``index``'s actor options (default ``placement.engine_options``;
        a distilling run's teacher engines: ``placement.teacher_options``)."""
        self.place = place or placement.engine_options
        self.workers: list[Any] = []
        self.starting: list[Any] = []  # ref i: engine i's URLs, once its server is healthy
        self.startup_timeout_s = cfg.engine.startup_timeout_s
        self.urls: list[str] = []
        self.cfg, self.placement, self.log_dir, self.output_token = cfg, placement, log_dir, output_token
        self.starts = [1] * cfg.engine.num_engines  # actors started per engine (a replaced one logs apart)
        self.nodes: list[tuple[str, str]] = []  # engine i's Ray node id and address, once started
        if cfg.engine.kind == "external":
            from arbor.engines.launch import launch_engines

            self.urls = launch_engines("external", urls=cfg.engine.urls,
                                       startup_timeout_s=cfg.engine.startup_timeout_s).urls
            return
        self.workers = [self._actor(i) for i in range(cfg.engine.num_engines)]
        self.starting = [w.urls.remote() for w in self.workers]
        if wait:
            self.wait_started()

    def _actor(self, index: int) -> Any:
        """A new actor starting engine ``index``'s server on the engine's bundle."""
        import ray

        log_dir = os.path.join(self.log_dir, f"engine-{index}" + (f"-{self.starts[index]}" if self.starts[index] > 1 else ""))
        return ray.remote(EngineWorker).options(**self.place(index, self.cfg.engine.tp_size)).remote(
            self.cfg, index, log_dir, self.cfg.ray.address is not None, self.output_token
        )

    def replace(self, url: str) -> str:
        """Start the engine at ``url``, whose actor is gone (its node lost, its process killed),
        in a new actor on the engine's bundle, which Ray re-places on an alive node when the old
        one died; its URL once healthy. :class:`EngineLaunchError` when it does not come up
        within ``engine.startup_timeout_s`` (plus the placement's wait), with the reason."""
        import ray

        from arbor.engines.launch import EngineLaunchError
        from arbor.run.orchestration import PLACEMENT_TIMEOUT_S, WAIT_REPORT_S

        index = self.urls.index(url)
        ray.kill(self.workers[index])
        self.starts[index] += 1
        self.workers[index] = self._actor(index)
        ref = self.workers[index].urls.remote()
        waited, limit = 0.0, PLACEMENT_TIMEOUT_S + self.startup_timeout_s
        while not ray.wait([ref], timeout=WAIT_REPORT_S)[0]:
            waited += WAIT_REPORT_S
            if waited >= limit:
                raise EngineLaunchError(f"engine {index} (was {url}) did not start again within {limit:.0f} s: "
                                        f"{self.placement.waiting_for()}")
            print(f"arbor train: engine {index} (was {url}) is still starting again ({waited:.0f} s; "
                  f"{self.placement.waiting_for()})", file=sys.stderr, flush=True)
        (new_url,) = gather([ref], ray.exceptions.RayError, lambda _, e: _not_started(index, e))[0]
        self.urls[index] = new_url
        self.nodes[index] = ray.get(self.workers[index].node.remote())
        return new_url

    def wait_started(self) -> None:
        """Wait until every engine is healthy and take their URLs (after ``wait=False``);
        :class:`EngineLaunchError` names the first engine that failed, with its log's tail."""
        import ray

        if not self.workers:
            return  # external engines: their URLs were taken at __init__
        self.urls = [u for urls in gather(self.starting, ray.exceptions.RayError, _not_started) for u in urls]
        self.nodes = ray.get([w.node.remote() for w in self.workers])

    def node_of(self, url: str) -> tuple[str, str] | None:
        """The Ray node id and address of the engine at ``url`` (None: external)."""
        return self.nodes[self.urls.index(url)] if self.nodes else None

    def worker(self, url: str) -> Any:
        """The actor owning the server at ``url`` (one server per actor); None for external engines."""
        return self.workers[self.urls.index(url)] if self.workers else None

    def shutdown(self) -> None:
        import ray

        # An engine still starting (a learner rank failed meanwhile) runs shutdown only after its
        # start: wait that long, since killing the actor first would orphan its server process.
        starting = self.starting and ray.wait(self.starting, num_returns=len(self.starting), timeout=0)[1]
        grace_s = 60 + (self.startup_timeout_s if starting else 0)
        for w in self.workers:
            try:
                ray.get(w.shutdown.remote(), timeout=grace_s)
            except ray.exceptions.RayActorError:
                pass  # it died (a failed start already stopped its server): nothing left to stop
            finally:
                ray.kill(w)
        self.workers = []
