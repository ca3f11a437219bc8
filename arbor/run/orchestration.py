"""Ray placement: learner ranks and rollout engines as actors, on one machine or a cluster.

    start_ray(cfg.ray, needs_cpus=cfg.learner.num_ranks + cfg.engine.num_engines)
    placement = Placement(cfg)                      # one placement group for the whole run
    engines = EngineGroup(cfg, placement, log_dir, wait=False)           # engines[i] on its bundle
    learners = LearnerGroup(cfg, placement, total_steps=cfg.run.steps, wait=False)
    start_groups(engines, learners, clock)         # both start at once; engines.urls once healthy
    results = learners.step(packs_per_rank, denominator)  # one update on every rank
    EngineWeights(cfg, learners, engines.urls).push("3")  # ZeRO-3 gather → engines (arbor.run.weight_sync)

The groups live beside this module: :mod:`arbor.run.learner_group` (each learner rank a Ray
actor that sets its torch.distributed variables, rank 0's node address and a free port
there, before DeepSpeed initialises: NCCL on GPUs, gloo on CPU) and
:mod:`arbor.run.engine_group` (actors that own a server process, SGLang on GPUs, ``arbor
serve`` else, on their node; ``engine.kind: external`` adopts running servers instead).
Reward checks run in the driver's process pool (:class:`arbor.rollout.rewards.RewardPool`).

Start-up on one machine: engines and learner ranks start at once (the engines' model load
overlaps DeepSpeed's init; the first failure of either stops both), this module imports
neither torch nor transformers (an engine actor imports it before it launches its server),
and Ray prestarts no idle workers (:func:`start_ray`).

Placement: one bundle per learner rank, then one per engine; ``ray.colocate`` puts
engine i on learner bundle i's GPU (the trainer releases the engine's memory during
training). ``ray.address: auto`` joins a cluster started with ``ray start``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

from arbor.config import Config, RayConfig
from arbor.engines.interfaces import user_socket_ifnames
from arbor.errors import RunStopped
from arbor.run.nodes import cluster_nodes, placement_problem, show_resources
from arbor.run.startup import StartupClock, uses_gpu

# Nothing here imports torch, transformers or DeepSpeed at module level: an engine actor
# imports this module before it starts its server, which would wait for them for nothing.

# Environment every actor needs: no Ray auth token files, CPU DeepSpeed where no CUDA.
_ACTOR_ENV = ("RAY_AUTH_MODE", "DS_ACCELERATOR", "HF_HUB_OFFLINE", "PYTHONPATH", "TRANSFORMERS_OFFLINE", "PYTHONWARNINGS",
              "TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")


_started_here = False  # whether the running Ray instance is a local one start_ray made
_early_start: concurrent.futures.Future[None] | None = None  # start_ray_early's, until start_ray takes it


def ray_cpus(cfg: Config) -> int:
    """Logical CPUs a run's actors ask Ray for: one per learner rank and engine (teachers' too)."""
    return cfg.learner.num_ranks + cfg.engine.num_engines + teacher_engines(cfg)


def teacher_engines(cfg: Config) -> int:
    """Teacher engines the run starts (``algorithm.distill.teacher``; none when it is external)."""
    teacher = cfg.algorithm.distill.teacher
    return teacher.num_engines if cfg.algorithm.distill.enabled and teacher.kind != "external" else 0


def start_ray_early(cfg: Config) -> None:
    """Begin :func:`start_ray` in a background thread; the next ``start_ray`` waits for it.

    ``arbor train`` calls this as soon as the config is read: Ray's processes (GCS, raylet,
    agents: seconds of start-up) come up while the driver imports torch and transformers,
    checks the model and loads the tokenizer and data. What the start raised, ``start_ray``
    raises.
    """
    global _early_start
    if _early_start is not None:
        return
    if threading.current_thread() is threading.main_thread():
        # What ray.init does in the main thread, and skips (with a warning, dropped here)
        # in ours: a SIGTERM exits through sys.exit, so the run's shutdown code still runs.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        logging.getLogger("ray._private.worker").addFilter(
            lambda record: "SIGTERM handler is not set" not in record.getMessage())
    future: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run() -> None:
        try:
            _start_ray(cfg.ray, ray_cpus(cfg))
        except BaseException as exc:  # handed to the start_ray that waits for it
            future.set_exception(exc)
        else:
            future.set_result(None)
        # Ray's processes die with the *thread* that started them (Linux PR_SET_PDEATHSIG
        # follows the creating thread): this one must outlive the run. A daemon: it holds
        # nothing, and a run that stops meanwhile (a config error) does not wait for it.
        threading.Event().wait()

    _early_start = future
    threading.Thread(target=run, name="arbor-ray-start", daemon=True).start()


def start_ray(ray_cfg: RayConfig, needs_cpus: int) -> None:
    """Start a local Ray instance (or join ``ray.address``) unless one is running.

    A running local instance too small for this run (an earlier, smaller run in the same
    process) is restarted when arbor started it; one the user started is refused, since
    the placement group would wait for CPUs that never come.
    """
    global _early_start
    early, _early_start = _early_start, None
    if early is not None:
        early.result()  # the start begun by start_ray_early (re-raises its error)
    _start_ray(ray_cfg, needs_cpus)


def _start_ray(ray_cfg: RayConfig, needs_cpus: int) -> None:
    import ray

    global _started_here
    if ray.is_initialized():
        have = ray.cluster_resources().get("CPU", 0)
        if ray_cfg.address is not None or have >= needs_cpus:
            return
        if not _started_here:
            raise RuntimeError(
                f"the running Ray instance has {have:g} CPUs but this run places {needs_cpus} "
                f"actors of one CPU each: ray.shutdown() it, start it with num_cpus >= "
                f"{needs_cpus}, or set ray.address to join a cluster"
            )
        ray.shutdown()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    env = {k: os.environ[k] for k in _ACTOR_ENV if k in os.environ}
    # A user's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME reach every actor and win over the
    # interface each rank chooses from its node's address.
    env |= user_socket_ifnames()
    # torch.distributed's deprecation notices, once per collective, would flood the console.
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    # Ray forwards actors' stderr to the driver's console, where a progress bar (transformers'
    # "Writing model shards", "Loading weights") is an escape-coded line between arbor's own.
    env.setdefault("TQDM_DISABLE", "1")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' and the hub's bars
    # Actors import arbor (and the user's rewards/agents) from the driver's directory.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    runtime_env = {"env_vars": env}
    if ray_cfg.address is not None:
        ray.init(address=ray_cfg.address, runtime_env=runtime_env, log_to_driver=True)
        _started_here = False
        return
    # Actors ask for one logical CPU each; a small machine still runs them all (they take
    # turns: rollout, then training).
    cpus = ray_cfg.num_cpus or max(os.cpu_count() or 1, needs_cpus)
    # Ray would prestart one idle worker per CPU for the first driver; they lack the job's
    # runtime_env, so no actor of ours can use them (checked on Ray 2.60: each actor gets a
    # fresh worker) and on a small machine they only take CPU from the start-up.
    # address="local": a new instance even when a Ray cluster already runs on this machine
    # (`ray start`, or a leftover /tmp/ray/ray_current_cluster), which ray.init() would join
    # otherwise, refusing num_cpus; joining one is ray.address's job.
    ray.init(address="local", num_cpus=cpus, num_gpus=ray_cfg.num_gpus, include_dashboard=False,
             runtime_env=runtime_env, log_to_driver=True, configure_logging=False,
             _system_config={"prestart_worker_first_driver": False})
    _started_here = True


def gpu_shortfall(cfg: Config, bundles: list[dict[str, float]], gpus: float,
                  where: str = "the local Ray instance has") -> str | None:
    """Why ``bundles`` cannot be placed where there are ``gpus`` GPUs (None: they can);
    ``where`` says what has them."""
    needed = sum(b.get("GPU", 0) for b in bundles)
    if needed <= gpus:
        return None
    engines = len(bundles) - cfg.learner.num_ranks
    message = (f"this run places {needed:g} GPUs (learner.num_ranks={cfg.learner.num_ranks}"
               + (f" + engine.num_engines={engines} × engine.tp_size={cfg.engine.tp_size}" if engines else "")
               + f"), and {where} {gpus:g}")
    if engines and not cfg.ray.colocate:
        message += (": set ray.colocate: true to put each engine on a learner's GPU (with "
                    "learner.weight_sync: disk), or use fewer learner ranks or engines")
    return message


class PlacementError(RunStopped, ValueError):
    """Ray cannot place the run's bundles on the cluster's alive nodes (the reason is the message)."""


PLACEMENT_TIMEOUT_S = 600.0  # how long a placement that could fit may wait for free resources
WAIT_REPORT_S = 30.0  # a placement still waiting says what for, this often


class Placement:
    """One placement group: learner bundles first, then engine bundles (unless colocated).
    Learner ranks are numbered node by node, the driver's node first.

    A placement that can never fit the cluster's alive nodes (more GPUs than they have, more
    ``STRICT_SPREAD`` bundles than nodes, a bundle no node offers) fails at once with the
    reason (:func:`arbor.run.nodes.placement_problem`); one that waits for resources others
    hold says what it waits for every ``WAIT_REPORT_S`` seconds, up to ``PLACEMENT_TIMEOUT_S``.
    """

    def __init__(self, cfg: Config) -> None:
        from ray.util.placement_group import placement_group

        self.gpu = uses_gpu(cfg)
        self.colocate = cfg.ray.colocate and self.gpu
        self.num_ranks = cfg.learner.num_ranks
        engines = 0 if cfg.engine.kind == "external" else cfg.engine.num_engines
        learner_bundle: dict[str, float] = {"CPU": 1, "GPU": 1} if self.gpu else {"CPU": 1}
        engine_bundle: dict[str, float] = {"CPU": 1, "GPU": cfg.engine.tp_size} if self.gpu else {"CPU": 1}
        if self.colocate and engines > self.num_ranks:
            raise ValueError(
                f"ray.colocate puts each engine on a learner GPU: engine.num_engines={engines} "
                f"> learner.num_ranks={self.num_ranks}"
            )
        self.bundles = [learner_bundle | cfg.ray.learner_resources] * self.num_ranks
        self.labels = [f"learner rank {r}" for r in range(self.num_ranks)]
        if not self.colocate:
            self.bundles += [engine_bundle | cfg.ray.engine_resources] * engines
            self.labels += [f"engine {i}" for i in range(engines)]
        # A distilling run's teacher engines: a bundle each after the policy's (one GPU on GPUs).
        self.teacher_start = len(self.bundles)
        teacher_bundle = engine_bundle | cfg.ray.engine_resources | ({"GPU": 1} if self.gpu else {})
        self.bundles += [teacher_bundle] * teacher_engines(cfg)
        self.labels += [f"teacher engine {i}" for i in range(teacher_engines(cfg))]
        self.strategy = cfg.ray.placement_strategy
        nodes = cluster_nodes()
        where = "the local Ray instance has" if _started_here else "the Ray cluster's alive nodes have"
        problem = (gpu_shortfall(cfg, self.bundles, sum(n.resources.get("GPU", 0) for n in nodes), where)
                   or placement_problem(self.bundles, self.labels, self.strategy, nodes))
        if problem:
            raise PlacementError(f"Ray cannot place this run: {problem}")
        self.group = placement_group(self.bundles, strategy=self.strategy)
        self._wait_placed()
        self.rank_bundles = self._ranks_by_node()  # rank r runs on learner bundle rank_bundles[r]
        for rank, bundle in enumerate(self.rank_bundles):
            self.labels[bundle] = f"learner rank {rank}"

    def _ranks_by_node(self) -> list[int]:
        """The learner bundles in rank order: those on the driver's node first, then node by
        node (by address), so rank 0 runs beside the driver where it can and each node's
        ranks are consecutive (Ray numbers bundles in no such order)."""
        import ray
        from ray.util.placement_group import placement_group_table

        placed = placement_group_table(self.group).get("bundles_to_node_id", {})
        driver = ray.get_runtime_context().get_node_id()
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}

        def order(bundle: int) -> tuple[bool, str, str, int]:
            node = placed.get(bundle, "")
            return node != driver, address.get(node, ""), node, bundle

        return sorted(range(self.num_ranks), key=order)

    def describe(self) -> str:
        return f"{len(self.bundles)} bundles with ray.placement_strategy={self.strategy}"

    def _wait_placed(self) -> None:
        import ray

        ready_ref = self.group.ready()
        waited = 0.0
        while not ray.wait([ready_ref], timeout=min(WAIT_REPORT_S, PLACEMENT_TIMEOUT_S - waited))[0]:
            waited = min(waited + WAIT_REPORT_S, PLACEMENT_TIMEOUT_S)
            if waited >= PLACEMENT_TIMEOUT_S:
                reason = self.waiting_for()
                self.remove()  # else the pending group would take the resources once they free up
                raise PlacementError(
                    f"Ray could not place {self.describe()} within {PLACEMENT_TIMEOUT_S:.0f} s: {reason} "
                    "(check `ray status`, learner.num_ranks, engine.num_engines)"
                )
            print(f"arbor train: still waiting for Ray to place {self.describe()} ({waited:.0f} s): {self.waiting_for()}",
                  file=sys.stderr, flush=True)

    def waiting_for(self) -> str:
        """Which bundles are not placed yet and what the cluster has free now."""
        import ray
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(self.group)
        placed = table.get("bundles_to_node_id", {})
        waiting = [f"{label} {show_resources(self.bundles[i])}" for i, label in enumerate(self.labels) if not placed.get(i)]
        state = table.get("stats", {}).get("scheduling_state", table.get("state", "?"))
        free = show_resources(ray.available_resources())
        placement = f"{', '.join(waiting)} not placed yet ({state})" if waiting else "every bundle is placed"
        return f"{placement}; free in the cluster now: {free}"

    def options(self, bundle: int, gpus: float) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_cpus": 1 if not self.colocate or bundle >= self.num_ranks else 0.5,
            "num_gpus": gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=bundle
            ),
        }

    def learner_options(self, rank: int) -> dict[str, Any]:
        return self.options(self.rank_bundles[rank], (0.5 if self.colocate else 1.0) if self.gpu else 0)

    def engine_options(self, index: int, tp_size: int) -> dict[str, Any]:
        if self.colocate:
            return self.options(index, 0.5)
        return self.options(self.num_ranks + index, tp_size if self.gpu else 0)

    def teacher_options(self, index: int, tp_size: int) -> dict[str, Any]:
        """Teacher engine ``index``'s actor options (its own bundle; ``tp_size`` is 1)."""
        return self.options(self.teacher_start + index, tp_size if self.gpu else 0)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def gather(refs: list[Any], catch: type[Exception], failure: Callable[[int, Exception], Exception]) -> list[Any]:
    """``ray.get(refs)``, awaited as they come: the first ref that fails with ``catch`` raises
    ``failure(its index, the error)`` at once, whatever the others are still doing."""
    import ray

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except catch as e:
            raise failure(refs.index(ready[0]), e) from e
    return ray.get(refs)


class StartingGroup(Protocol):
    """A group started with ``wait=False``: :class:`~arbor.run.engine_group.EngineGroup`,
    :class:`~arbor.run.learner_group.LearnerGroup`."""

    starting: list[Any]  # Ray refs, one per member, ready once it is up

    def wait_started(self) -> None: ...


def start_groups(engines: StartingGroup, learners: StartingGroup, clock: StartupClock) -> None:
    """Wait for engines and learner ranks started with ``wait=False``: one machine loads the
    engines' model and initialises DeepSpeed at once. The first failure of either group raises
    at once (the caller stops both); ``clock`` gets the phases ``engines`` and ``learners``."""
    import ray

    groups = {"engines": engines, "learners": learners}
    pending = [*engines.starting, *learners.starting]
    for name, group in groups.items():
        if not group.starting:  # external engines: nothing to wait for
            group.wait_started()
            clock.end(name)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        name = "engines" if ready[0] in engines.starting else "learners"
        group = groups[name]
        try:
            ray.get(ready[0])
            done = not any(ref in pending for ref in group.starting)
        except ray.exceptions.RayError:
            done = True  # the group's own wait raises, naming the engine or rank
        if done:
            group.wait_started()
            clock.end(name)


def cpu_threads(cfg: Config, processes: int | None = None) -> int:
    """Torch threads of each CPU process of a run: ``run.cpu_threads``, or the cores split
    between the ``processes`` that compute (default: every engine server, every learner rank
    and the driver), at least one each; the same rule synchronous and asynchronous.

    Each process gets its share even when they take turns (a synchronous run samples, then
    trains): an OpenMP thread spinning for a core another process holds stalls the rest, and
    the driver, the reward workers and Ray's own processes run beside them. On 2 cores the
    quickstart as shipped took 84 s with one thread per process and 112 s with the engine on
    both cores (docs/benchmarks.md, "CPU threads")."""
    if cfg.run.cpu_threads:
        return cfg.run.cpu_threads
    if processes is None:
        processes = cfg.engine.num_engines + cfg.learner.num_ranks + 1 + teacher_engines(cfg)
    return max(1, (os.cpu_count() or 1) // processes)
