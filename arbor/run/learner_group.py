"""The learner ranks of a run: ``learner.num_ranks`` Ray actors forming one data-parallel group.

    # total_steps: the optimizer updates the learning-rate schedule spans (arbor.run.context.updates_per_step)
    learners = LearnerGroup(cfg, placement, total_steps=cfg.run.steps * updates_per_step(cfg), wait=False)
    start_groups(engines, learners, clock)                # arbor.run.orchestration
    results = learners.step(packs_per_rank, denominator)  # one update on every rank
    learners.push_weights(engines.urls, version="3")      # ZeRO-3 gather → engines

Each rank (:class:`LearnerWorker`) sets its torch.distributed variables (rank 0's node
address and a free port there) before DeepSpeed initialises: NCCL on GPUs, gloo on CPU.
Weight pushes: the rank side (which ranks gather, which one sends, where the disk copy
goes) is here, with the actor's state; what crosses to the engines is
:class:`arbor.train.weight_sync.WeightSync`. Nothing here imports torch, transformers or
DeepSpeed at module level (the actors import them when they set up).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from arbor.config import Config
from arbor.engines.connect import closing
from arbor.engines.ports import free_port
from arbor.run.orchestration import Placement, cpu_threads, gather, node_address, uses_gpu

if TYPE_CHECKING:
    from arbor.train.learner import StepResult
    from arbor.train.packing import PackedBatch


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
            torch.set_num_threads(cpu_threads(cfg))  # its share of the cores (run.cpu_threads)
        torch.manual_seed(cfg.run.seed + self.rank)
        from arbor.train.learner import Learner

        self.learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=total_steps,
                               temperature=cfg.rollout.temperature)

    def step(
        self, packs: Sequence[PackedBatch], denominator: float, filler: PackedBatch | None = None,
        behaviour_cap: float | None = None,
    ) -> StepResult:
        return self.learner.step(packs, denominator, filler, behaviour_cap)

    def old_logprobs(self, packs: Sequence[PackedBatch], filler: PackedBatch | None = None) -> list[Any]:
        """π_old of this rank's packs before the update (:meth:`arbor.train.learner.Learner.old_logprobs`)."""
        return self.learner.old_logprobs(packs, filler)

    def push_weights(self, urls: list[str], version: str) -> int:
        """Gather the parameters (collective) and, on rank 0, send them to every engine; the
        bytes sent (0 on other ranks). A LoRA run sends only its adapter (``push_adapter``).

        ``learner.weight_sync: distributed`` gathers and broadcasts ``learner.sync_bucket_mb``
        buckets over a gloo/NCCL group, gathering the next while one is sent; ``disk`` writes an HF directory (``<run.output_dir>/weight-sync``)
        that the engines load (for engines the learner cannot reach over torch.distributed).
        """
        from arbor.engines.client import adapter_name
        from arbor.train.weight_sync import gathered_buckets

        cfg = self.cfg
        if cfg.learner.weight_sync == "disk" or self.learner.lora:
            directory = os.path.join(self.sync_dir, adapter_name(version)) if self.learner.lora else self.sync_dir
            if self.learner.lora:
                self.learner.export_hf(directory)  # the adapter alone: the engines have the tokenizer
            else:
                self.export_hf(directory)
            if self.rank != 0:
                return 0
            sync = self._weight_sync(urls)
            push = sync.push_adapter if self.learner.lora else sync.push_directory
            return asyncio.run(closing(sync.client, push(directory, version)))
        buckets = gathered_buckets(self.learner.model, self._zero_stage(), cfg.learner.sync_bucket_mb,
                                   copy=self.rank == 0)
        if self.rank != 0:
            for _ in buckets:  # take part in each gather
                pass
            return 0
        sync = self._weight_sync(urls)
        return asyncio.run(closing(sync.client, sync.push(buckets, version)))

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
            from arbor.engines.connect import engine_client

            group = self.sync.group_name
            if group is not None and alive_urls:
                client = engine_client(self.cfg.engine, alive_urls)
                asyncio.run(closing(client, client.destroy_weights_update_group(group)))
            self.sync.close_local()
        self.sync = None

    def _weight_sync(self, urls: list[str]) -> Any:
        if self.sync is None or self.sync.client.urls != [u.rstrip("/") for u in urls]:
            from arbor.engines.connect import engine_client
            from arbor.train.weight_sync import WeightSync

            self.sync = WeightSync(engine_client(self.cfg.engine, urls), self.cfg.learner.weight_sync, master_address=node_address(),
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
        self.workers: list[Any] = [  # Ray actor handles
            actor.options(**placement.learner_options(rank)).remote(cfg, rank)
            for rank in range(cfg.learner.num_ranks)
        ]
        self.output_dir = cfg.run.output_dir
        self.lora = cfg.model.lora_rank > 0
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

    def old_logprobs(
        self, packs_per_rank: Sequence[Sequence[PackedBatch]], filler: PackedBatch | None = None
    ) -> list[list[Any]]:
        """Per rank, per pack of its: the learner's log-probs of the trained tokens, no update
        (π_old of ``loss.rollout_correction``); a rank without packs forwards ``filler``."""
        return self.results([
            w.old_logprobs.remote(list(p), None if p else filler) for w, p in zip(self.workers, packs_per_rank)
        ])

    # Every method below runs on all ranks at once (collectives need every rank); results by rank.

    def push_weights(self, urls: list[str], version: str) -> int:
        """Weights (a LoRA run: the adapter) to every engine; the bytes sent."""
        sent = self.results([w.push_weights.remote(urls, version) for w in self.workers])[0]
        self.weight_version = version
        return sent

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter the engines serve, which requests must name (None: no LoRA or no push yet)."""
        from arbor.engines.client import adapter_name

        return adapter_name(self.weight_version) if self.lora and self.weight_version is not None else None

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
