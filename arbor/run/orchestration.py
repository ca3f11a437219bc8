"""Ray placement: learner ranks and rollout engines as actors, on one machine or a cluster.

    start_ray(cfg.ray, needs_cpus=cfg.learner.num_ranks + cfg.engine.num_engines)
    placement = Placement(cfg)                      # one placement group for the whole run
    engines = EngineGroup(cfg, placement, log_dir, wait=False)           # engines[i] on its bundle
    learners = LearnerGroup(cfg, placement, total_steps=cfg.run.steps, wait=False)
    start_groups(engines, learners, clock)         # both start at once; engines.urls once healthy
    results = learners.step(packs_per_rank, denominator)  # one update on every rank
    learners.push_weights(engines.urls, version="3")    # ZeRO-3 gather → engines

Each learner rank is a Ray actor that sets its torch.distributed variables (rank 0's node
address and a free port there) before DeepSpeed initialises: NCCL on GPUs, gloo on CPU.
Engines are actors that own a server process (SGLang on GPUs, ``arbor serve`` else) on
their node; ``engine.kind: external`` adopts running servers instead. Reward checks run
in the driver's process pool (:class:`arbor.rollout.rewards.RewardPool`).

Start-up on one machine: engines and learner ranks start at once (the engines' model load
overlaps DeepSpeed's init; the first failure of either stops both), this module imports
neither torch nor transformers (an engine actor imports it before it launches its server),
and Ray prestarts no idle workers (:func:`start_ray`).

Placement: one bundle per learner rank, then one per engine; ``ray.colocate`` puts
engine i on learner bundle i's GPU (the trainer releases the engine's memory during
training). ``ray.address: auto`` joins a cluster started with ``ray start``.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from arbor.config import Config, RayConfig
from arbor.engines.auth import API_KEY_ENV, run_api_key
from arbor.engines.launch import free_port
from arbor.errors import ConfigError
from arbor.run.startup import StartupClock

if TYPE_CHECKING:
    from arbor.train.learner import StepResult
    from arbor.train.packing import PackedBatch

# Nothing here imports torch, transformers or DeepSpeed at module level: an engine actor
# imports this module before it starts its server, which would wait for them for nothing.

# Environment every actor needs: no Ray auth token files, CPU DeepSpeed where no CUDA.
_ACTOR_ENV = ("RAY_AUTH_MODE", "DS_ACCELERATOR", "HF_HUB_OFFLINE", "PYTHONPATH", "TRANSFORMERS_OFFLINE", "PYTHONWARNINGS")
T = TypeVar("T")


def uses_gpu(cfg: Config) -> bool:
    if cfg.learner.device == "auto":
        import torch

        return torch.cuda.is_available()
    return cfg.learner.device == "cuda"


_started_here = False  # whether the running Ray instance is a local one start_ray made


def start_ray(ray_cfg: RayConfig, needs_cpus: int) -> None:
    """Start a local Ray instance (or join ``ray.address``) unless one is running.

    A running local instance too small for this run (an earlier, smaller run in the same
    process) is restarted when arbor started it; one the user started is refused, since
    the placement group would wait for CPUs that never come.
    """
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
    # torch.distributed's deprecation notices, once per collective, would flood the console.
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
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
    ray.init(num_cpus=cpus, num_gpus=ray_cfg.num_gpus, include_dashboard=False,
             runtime_env=runtime_env, log_to_driver=True, configure_logging=False,
             _system_config={"prestart_worker_first_driver": False})
    _started_here = True


def gpu_shortfall(cfg: Config, bundles: list[dict[str, float]], gpus: float) -> str | None:
    """Why ``bundles`` cannot be placed on a cluster of ``gpus`` GPUs (None: they can)."""
    needed = sum(b.get("GPU", 0) for b in bundles)
    if needed <= gpus:
        return None
    engines = len(bundles) - cfg.learner.num_ranks
    message = (f"this run places {needed:g} GPUs (learner.num_ranks={cfg.learner.num_ranks}"
               + (f" + engine.num_engines={engines} × engine.tp_size={cfg.engine.tp_size}" if engines else "")
               + f"), and the local Ray instance has {gpus:g}")
    if engines and not cfg.ray.colocate:
        message += (": set ray.colocate: true to put each engine on a learner's GPU (with "
                    "learner.weight_sync: disk), or use fewer learner ranks or engines")
    return message


class Placement:
    """One placement group: learner bundles first, then engine bundles (unless colocated)."""

    def __init__(self, cfg: Config) -> None:
        from ray.util.placement_group import placement_group

        self.gpu = uses_gpu(cfg)
        self.colocate = cfg.ray.colocate and self.gpu
        self.num_ranks = cfg.learner.num_ranks
        engines = 0 if cfg.engine.kind == "external" else cfg.engine.num_engines
        learner_bundle = {"CPU": 1, "GPU": 1} if self.gpu else {"CPU": 1}
        engine_bundle = {"CPU": 1, "GPU": cfg.engine.tp_size} if self.gpu else {"CPU": 1}
        if self.colocate and engines > self.num_ranks:
            raise ValueError(
                f"ray.colocate puts each engine on a learner GPU: engine.num_engines={engines} "
                f"> learner.num_ranks={self.num_ranks}"
            )
        bundles = [learner_bundle] * self.num_ranks
        if not self.colocate:
            bundles += [engine_bundle] * engines
        import ray

        # A local instance never grows: a group it cannot hold would wait the full 600 s.
        if _started_here:
            problem = gpu_shortfall(cfg, bundles, ray.cluster_resources().get("GPU", 0))
            if problem:
                raise ValueError(problem)
        self.group = placement_group(bundles, strategy=cfg.ray.placement_strategy)

        ready, _ = ray.wait([self.group.ready()], timeout=600)
        if not ready:
            raise RuntimeError(
                f"Ray could not place {len(bundles)} bundles ({bundles}) within 600 s: the "
                "cluster lacks the resources (check `ray status`, learner.num_ranks, engine.num_engines)"
            )

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
        return self.options(rank, (0.5 if self.colocate else 1.0) if self.gpu else 0)

    def engine_options(self, index: int, tp_size: int) -> dict[str, Any]:
        if self.colocate:
            return self.options(index, 0.5)
        return self.options(self.num_ranks + index, tp_size if self.gpu else 0)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


async def closing(client: Any, coroutine: Coroutine[Any, Any, T]) -> T:
    """Await ``coroutine``, then close ``client``'s HTTP session (it belongs to this event loop)."""
    try:
        return await coroutine
    finally:
        await client.close()


def node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


# -- learners ---------------------------------------------------------------------------------


class LearnerWorker:
    """One learner rank (run as a Ray actor; plain methods so tests may call them directly)."""

    def __init__(self, cfg: Config, rank: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.learner: Any = None
        self.sync: Any = None

    def address(self) -> tuple[str, int]:
        return node_address(), free_port("")  # free on every interface of this node

    def pid(self) -> int:
        """This rank's process id (fault tests kill it)."""
        return os.getpid()

    def setup(self, master: tuple[str, int], total_steps: int) -> None:
        """Join the learner group and build the model, DeepSpeed engine and optimizer."""
        import torch

        cfg = self.cfg
        os.environ.update(
            RANK=str(self.rank), WORLD_SIZE=str(cfg.learner.num_ranks), LOCAL_RANK="0",
            MASTER_ADDR=master[0], MASTER_PORT=str(master[1]),
        )
        if not uses_gpu(cfg):
            # Rollout and training take turns, so each rank may use its share of the cores.
            torch.set_num_threads(cpu_threads(cfg, sharers=cfg.learner.num_ranks))
        torch.manual_seed(cfg.run.seed + self.rank)
        from arbor.train.learner import Learner

        self.learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=total_steps,
                               temperature=cfg.rollout.temperature)

    def step(
        self, packs: Sequence[PackedBatch], denominator: float, filler: PackedBatch | None = None,
        behaviour_cap: float | None = None,
    ) -> StepResult:
        return self.learner.step(packs, denominator, filler, behaviour_cap)

    def push_weights(self, urls: list[str], version: str) -> None:
        """Gather the parameters (collective) and, on rank 0, send them to every engine.

        ``learner.weight_sync: distributed`` gathers and broadcasts ``learner.sync_bucket_mb``
        buckets over a gloo/NCCL group, gathering the next while one is sent; ``disk`` writes an HF directory (``<run.output_dir>/weight-sync``)
        that the engines load (for engines the learner cannot reach over torch.distributed).
        """
        from arbor.train.weight_sync import gathered_buckets

        cfg = self.cfg
        if cfg.learner.weight_sync == "disk":
            self.export_hf(self.sync_dir)
            if self.rank == 0:
                sync = self._weight_sync(urls)
                asyncio.run(closing(sync.client, sync.push_directory(self.sync_dir, version)))
            return
        buckets = gathered_buckets(self.learner.model, self._zero_stage(), cfg.learner.sync_bucket_mb,
                                   copy=self.rank == 0)
        if self.rank != 0:
            for _ in buckets:  # take part in each gather
                pass
            return
        sync = self._weight_sync(urls)
        asyncio.run(closing(sync.client, sync.push(buckets, version)))

    def logprob_gap(self, samples: list[tuple[list[int], list[int], list[float]]]) -> float:
        """Mean |engine − learner| logprob over probe samples (every rank: ZeRO-3 forwards are collective)."""
        from arbor.train.weight_sync import logprob_gap

        model = self.learner.model
        was_training = model.training
        model.eval()
        try:
            return logprob_gap(model, samples, temperature=self.cfg.rollout.temperature)
        finally:
            model.train(was_training)

    def reset_weight_sync(self, alive_urls: list[str]) -> None:
        """An engine of the weight-update group was restarted (outside it now): the engines
        still in it (``alive_urls``) leave it, and the next push opens a new group with all."""
        if self.sync is not None:  # only rank 0 holds one, after its first push
            from arbor.engines.client import run_sync

            group = self.sync.group_name
            if group is not None and alive_urls:
                run_sync(lambda client: client.destroy_weights_update_group(group), alive_urls,
                         api_key=self.cfg.engine.api_key)
            self.sync.close_local()
        self.sync = None

    def _weight_sync(self, urls: list[str]) -> Any:
        if self.sync is None or self.sync.client.urls != [u.rstrip("/") for u in urls]:
            from arbor.train.weight_sync import WeightSync

            client = engine_client(self.cfg, urls)
            self.sync = WeightSync(client, self.cfg.learner.weight_sync, master_address=node_address(),
                                   export_dir=self.sync_dir)
        return self.sync

    @property
    def sync_dir(self) -> str:
        """Where ``learner.weight_sync: disk`` writes the weights the engines load."""
        return os.path.join(self.cfg.run.output_dir, "weight-sync")

    def _zero_stage(self) -> int:
        return self.cfg.learner.zero_stage if self.cfg.learner.backend == "deepspeed" else 0

    def save(self, directory: str) -> None:
        self.learner.save(directory)

    def load(self, directory: str) -> int:
        self.learner.load(directory)
        return self.learner.steps

    def export_hf(self, directory: str) -> None:
        self.learner.export_hf(directory, self.tokenizer if self.rank == 0 else None)

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The policy's tokenizer, saved with every export (loaded once: disk sync exports each step)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.cfg.model.path, trust_remote_code=self.cfg.model.trust_remote_code)

    def state_checksum(self) -> float:
        """Σ |parameters| of the whole model (collective under ZeRO-3): "did weights change"."""
        return float(sum(t.double().abs().sum() for t in self.learner.full_state_dict().values()))


class LearnerFailedError(RuntimeError):
    """A learner rank died (its Ray actor was lost): the run stops; the last checkpoint is intact."""


class LearnerGroup:
    """``learner.num_ranks`` :class:`LearnerWorker` actors forming one data-parallel group.

    A rank that dies (killed, out of memory, node lost) stops the run with
    :class:`LearnerFailedError` naming the rank and the last checkpoint, at once: the other
    ranks may be blocked in a collective with it, so results are awaited as they come.
    """

    def __init__(self, cfg: Config, placement: Placement, total_steps: int, wait: bool = True) -> None:
        """Start the ranks; with ``wait=False`` return at once (:func:`start_groups` awaits ``starting``)."""
        import ray

        actor = ray.remote(LearnerWorker)
        self.workers = [
            actor.options(**placement.learner_options(rank)).remote(cfg, rank)
            for rank in range(cfg.learner.num_ranks)
        ]
        self.output_dir = cfg.run.output_dir
        # Rank 0's address reaches every setup as a ref: Ray resolves it, nothing blocks here.
        master = self.workers[0].address.remote()
        self.starting = [w.setup.remote(master, total_steps) for w in self.workers]  # ref r: rank r is set up
        self.weight_version: str | None = None  # what the engines serve; None: model.path's weights
        if wait:
            self.wait_started()

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def results(self, refs: list[Any]) -> list[Any]:
        """``ray.get(refs)`` (ref r from rank r), or LearnerFailedError as soon as a rank is lost."""
        import ray

        return gather(refs, ray.exceptions.RayActorError, self._lost)

    def _lost(self, rank: int, e: Exception) -> LearnerFailedError:
        from arbor.run import checkpoint

        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return LearnerFailedError(
            f"learner rank {rank} died ({type(e).__name__}: {cause}); the run stops. "
            f"{checkpoint.resume_hint(self.output_dir)}"
        )

    def wait_started(self) -> None:
        """Wait until every rank is set up (after ``wait=False``)."""
        self.results(self.starting)

    def step(
        self, packs_per_rank: Sequence[Sequence[PackedBatch]], denominator: float, filler: PackedBatch | None = None,
        behaviour_cap: float | None = None,
    ) -> list[StepResult]:
        """One update: rank r trains ``packs_per_rank[r]``; a rank without packs runs ``filler`` at zero loss.
        ``behaviour_cap``: off-policy batches' decoupled objective (None: on-policy PPO)."""
        return self.results([
            w.step.remote(list(p), denominator, None if p else filler, behaviour_cap)
            for w, p in zip(self.workers, packs_per_rank)
        ])

    # Every method below runs on all ranks at once (collectives need every rank); results by rank.

    def push_weights(self, urls: list[str], version: str) -> None:
        self.results([w.push_weights.remote(urls, version) for w in self.workers])
        self.weight_version = version

    def logprob_gap(self, samples: list[tuple[list[int], list[int], list[float]]]) -> float:
        return self.results([w.logprob_gap.remote(samples) for w in self.workers])[0]

    def save(self, directory: str) -> None:
        """Every rank's model, optimizer and schedule state under ``directory``."""
        self.results([w.save.remote(directory) for w in self.workers])

    def load(self, directory: str) -> None:
        """Every rank's state from a :meth:`save` directory."""
        self.results([w.load.remote(directory) for w in self.workers])

    def export_hf(self, directory: str) -> None:
        """The current weights as an HF directory (gathered from every rank; rank 0 writes)."""
        self.results([w.export_hf.remote(directory) for w in self.workers])

    def reset_weight_sync(self, alive_urls: list[str]) -> None:
        """Drop the weight-update group after an engine restart (:meth:`LearnerWorker.reset_weight_sync`)."""
        self.results([w.reset_weight_sync.remote(alive_urls) for w in self.workers])

    def state_checksum(self) -> list[float]:
        """Σ |parameters| as each rank sees the whole model (tests: "did weights change")."""
        return self.results([w.state_checksum.remote() for w in self.workers])

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []


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


def start_groups(engines: EngineGroup, learners: LearnerGroup, clock: StartupClock) -> None:
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


def cpu_threads(cfg: Config, sharers: int) -> int:
    """Torch threads for a CPU process: ``run.cpu_threads``, or the cores split ``sharers`` ways.

    Asynchronous runs (``algorithm.max_staleness`` ≥ 1) sample while they train: every engine
    and learner rank is busy at once, so they split the cores between all of them (OpenMP
    threads waiting for a busy core slow decoding tenfold: ``run.cpu_threads``)."""
    if cfg.algorithm.max_staleness:
        sharers = cfg.learner.num_ranks + cfg.engine.num_engines
    return cfg.run.cpu_threads or max(1, (os.cpu_count() or 1) // sharers)


# -- engines ----------------------------------------------------------------------------------


class EngineWorker:
    """Owns one engine server process on its node (a Ray actor)."""

    def __init__(self, cfg: Config, index: int, log_dir: str, bind_node_address: bool) -> None:
        from arbor.engines.launch import launch_engines

        if not uses_gpu(cfg):
            # Ray gives actors one thread; the server has the cores while rollouts run.
            os.environ["OMP_NUM_THREADS"] = str(cpu_threads(cfg, sharers=1))
        host = node_address() if bind_node_address else cfg.engine.host
        self.handle = launch_engines(
            cfg.engine.kind, model_path=cfg.model.path, num_engines=1, host=host,
            dtype=None if cfg.model.dtype == "auto" else cfg.model.dtype, device=engine_device(cfg),
            extra_args=engine_args(cfg), log_dir=os.path.join(log_dir, f"engine-{index}"),
            startup_timeout_s=cfg.engine.startup_timeout_s, gpus_per_engine=cfg.engine.tp_size,
            api_key=cfg.engine.api_key, python=cfg.engine.python,
        )
        self.startup_timeout_s = cfg.engine.startup_timeout_s

    def urls(self) -> list[str]:
        return self.handle.urls

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


def engine_device(cfg: Config) -> str | None:
    """The engines' device: ``cpu`` on a machine whose learner runs without CUDA (SGLang then
    runs its CPU engine), else ``learner.device`` (None: auto)."""
    if not uses_gpu(cfg):
        return "cpu"
    return None if cfg.learner.device == "auto" else cfg.learner.device


def runs_sglang(cfg: Config) -> bool:
    """Whether arbor starts SGLang servers (``engine.kind`` sglang, or auto on a GPU machine with it)."""
    from arbor.engines.launch import sglang_available

    return cfg.engine.kind == "sglang" or (
        cfg.engine.kind == "auto" and uses_gpu(cfg) and sglang_available(cfg.engine.python)
    )


def engine_args(cfg: Config) -> list[str]:
    """Server flags from the config (the embedded server's cache bound, SGLang's memory)."""
    from arbor.engines.launch import sglang_cpu_flags, sglang_flags

    if runs_sglang(cfg):
        cpu = not uses_gpu(cfg)
        if cpu and cfg.engine.deterministic:
            raise ConfigError("engine.deterministic: SGLang's seeded sampling runs a Triton kernel, which needs "
                              "a GPU; on a CPU machine set engine.deterministic: false")
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
    else:
        args = ["--max-cached-tokens", str(cfg.engine.max_cached_tokens)]
    return args + list(cfg.engine.extra_args)


def engine_client(cfg: Config, urls: list[str]) -> Any:
    """The run's :class:`~arbor.engines.client.SGLangClient` on ``urls``, with ``engine``'s
    timeouts, retries and key. Per-request seeds go only to servers that honour them: SGLang
    uses them only with ``--enable-deterministic-inference`` (``engine.deterministic``)."""
    from arbor.engines.client import SGLangClient

    return SGLangClient(urls, timeout_s=cfg.engine.request_timeout_s, max_retries=cfg.engine.max_retries,
                        api_key=cfg.engine.api_key, send_seeds=cfg.engine.deterministic or not runs_sglang(cfg))


class EngineGroup:
    """The run's rollout engines: Ray actors owning servers, or ``engine.urls`` (external).

    Settles the run's engine key first (:func:`~arbor.engines.auth.run_api_key`) into
    ``cfg.engine.api_key``, which the engine and learner actors receive with ``cfg``, and into
    this process's ``$ARBOR_ENGINE_API_KEY``, which the driver's clients read (restored at
    :meth:`shutdown`, so a later run in this process settles its own).
    """

    def __init__(self, cfg: Config, placement: Placement, log_dir: str, wait: bool = True) -> None:
        """Start the engines; with ``wait=False`` return at once and fill ``urls`` in :meth:`started`."""
        import ray

        self._env_key = os.environ.get(API_KEY_ENV)
        cfg.engine.api_key = run_api_key(cfg.engine.api_key, launch=cfg.engine.kind != "external")
        if cfg.engine.api_key:
            os.environ[API_KEY_ENV] = cfg.engine.api_key
        self.workers: list[Any] = []
        self.starting: list[Any] = []  # ref i: engine i's URLs, once its server is healthy
        self.startup_timeout_s = cfg.engine.startup_timeout_s
        self.urls: list[str] = []
        if cfg.engine.kind == "external":
            from arbor.engines.launch import launch_engines

            self.urls = launch_engines("external", urls=cfg.engine.urls,
                                       startup_timeout_s=cfg.engine.startup_timeout_s).urls
            return
        actor = ray.remote(EngineWorker)
        self.workers = [
            actor.options(**placement.engine_options(i, cfg.engine.tp_size)).remote(
                cfg, i, log_dir, cfg.ray.address is not None
            )
            for i in range(cfg.engine.num_engines)
        ]
        self.starting = [w.urls.remote() for w in self.workers]
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Wait until every engine is healthy and take their URLs (after ``wait=False``);
        :class:`EngineLaunchError` names the first engine that failed, with its log's tail."""
        import ray

        if not self.workers:
            return  # external engines: their URLs were taken at __init__
        self.urls = [u for urls in gather(self.starting, ray.exceptions.RayError, _not_started) for u in urls]

    def worker(self, url: str) -> Any:
        """The actor owning the server at ``url`` (one server per actor); None for external engines."""
        return self.workers[self.urls.index(url)] if self.workers else None

    def shutdown(self) -> None:
        import ray

        os.environ.pop(API_KEY_ENV, None)
        if self._env_key is not None:
            os.environ[API_KEY_ENV] = self._env_key
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

