"""The learner ranks of a run: ``learner.num_ranks`` Ray actors forming one data-parallel group.

    # total_steps: the optimizer updates the learning-rate schedule spans (arbor.run.context.updates_per_step)
    learners = LearnerGroup(cfg, placement, total_steps=cfg.run.steps * updates_per_step(cfg), wait=False)
    start_groups(engines, learners, clock)                # arbor.run.orchestration
    results = learners.step(packs_per_rank, denominator)  # one update on every rank
    learners.export_hf("out/hf")                          # ZeRO-3 gather → rank 0 writes

Each rank (:class:`LearnerWorker`) sets its torch.distributed variables (rank 0's node
address and a free port there) before DeepSpeed initialises: NCCL on GPUs, gloo on CPU.
Weight pushes are :mod:`arbor.run.weight_sync`'s; the ranks only hand over a directory
(:meth:`LearnerGroup.export_hf`) or buckets: every rank gathers them, rank 0 broadcasts each
to the engines (the group's :class:`~arbor.run.weight_sync.LearnerEnd` side). Calls from
several threads (an asynchronous run restores a restarted engine from its producer's) reach
every rank in one order. Nothing here imports torch, transformers or DeepSpeed at module
level (the actors import them when they set up).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from arbor.config import Config
from arbor.engines.ports import free_port
from arbor.run.orchestration import Placement, cpu_threads, gather, node_address, uses_gpu

if TYPE_CHECKING:
    from arbor.train.learner import StepResult
    from arbor.train.packing import PackedBatch
    from arbor.train.weight_sync import Announcement


class LearnerWorker:
    """One learner rank (run as a Ray actor; plain methods so tests may call them directly)."""

    def __init__(self, cfg: Config, rank: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.learner: Any = None
        self.sender: Any = None  # rank 0's end of the weight-update group (a BucketSender), once open

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

    # -- weight pushes: rank 0 broadcasts, every rank gathers (arbor.run.weight_sync drives them)

    def weight_group_address(self) -> tuple[str, int]:
        """Where the engines join rank 0's weight-update group: this node, a free port."""
        return node_address(), free_port("")

    def open_weight_group(self, address: str, port: int, world_size: int, group_name: str, backend: str) -> None:
        from arbor.train.weight_sync import BucketSender

        self.sender = BucketSender()
        self.sender.open(address, port, world_size, group_name, backend)

    def send_buckets(self, load_format: str | None) -> Iterator[Announcement]:
        """Rank 0 (a Ray streaming generator): each bucket's announcement, then its broadcast."""
        yield from self.sender.send(self._buckets(copy=True), load_format)

    def gather_buckets(self) -> None:
        """The other ranks: take part in every bucket's gather (collective under ZeRO-3)."""
        for _ in self._buckets(copy=False):
            pass

    def _buckets(self, copy: bool) -> Iterator[Any]:
        from arbor.train.weight_sync import gathered_buckets

        return gathered_buckets(self.learner.model, self._zero_stage(), self.cfg.learner.sync_bucket_mb, copy=copy)

    def close_weight_group(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def _zero_stage(self) -> int:
        return self.cfg.learner.zero_stage if self.cfg.learner.backend == "deepspeed" else 0

    def save(self, directory: str) -> None:
        self.learner.save(directory)

    def load(self, directory: str) -> int:
        self.learner.load(directory)
        return self.learner.steps

    def export_hf(self, directory: str, tokenizer: bool = True) -> None:
        self.learner.export_hf(directory, self.tokenizer if tokenizer and self.rank == 0 else None)

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
        self.backend = "nccl" if uses_gpu(cfg) else "gloo"  # of the weight-update group rank 0 opens
        self._ordered = threading.Lock()  # held while a call is submitted to every rank (see _each)
        # Rank 0's address reaches every setup as a ref: Ray resolves it, nothing blocks here.
        master = self.workers[0].address.remote()
        self.starting = [w.setup.remote(master, total_steps) for w in self.workers]  # ref r: rank r is set up
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

    def _each(self, submit: Callable[[int, Any], Any]) -> list[Any]:
        """``submit(rank, worker)`` (one Ray call) for every rank, under one lock: a call another
        thread submits reaches every rank before this one or after it, never between (the
        ranks' collectives would wait for each other forever)."""
        with self._ordered:
            return [submit(rank, w) for rank, w in enumerate(self.workers)]

    def step(
        self, packs_per_rank: Sequence[Sequence[PackedBatch]], denominator: float, filler: PackedBatch | None = None,
        behaviour_cap: float | None = None,
    ) -> list[StepResult]:
        """One update: rank r trains ``packs_per_rank[r]``; a rank without packs runs ``filler`` at zero loss.
        ``behaviour_cap``: off-policy batches' decoupled objective (None: on-policy PPO)."""
        return self.results(self._each(lambda r, w: w.step.remote(
            list(packs_per_rank[r]), denominator, None if packs_per_rank[r] else filler, behaviour_cap)))

    def old_logprobs(
        self, packs_per_rank: Sequence[Sequence[PackedBatch]], filler: PackedBatch | None = None
    ) -> list[list[Any]]:
        """Per rank, per pack of its: the learner's log-probs of the trained tokens, no update
        (π_old of ``loss.rollout_correction``); a rank without packs forwards ``filler``."""
        return self.results(self._each(lambda r, w: w.old_logprobs.remote(
            list(packs_per_rank[r]), None if packs_per_rank[r] else filler)))

    # Every method below runs on all ranks at once (collectives need every rank); results by rank.

    def logprob_gap(self, samples: list[tuple[list[int], list[int], list[float]]]) -> float:
        return self.results(self._each(lambda r, w: w.logprob_gap.remote(samples)))[0]

    def save(self, directory: str) -> None:
        """Every rank's model, optimizer and schedule state under ``directory``."""
        self.results(self._each(lambda r, w: w.save.remote(directory)))

    def load(self, directory: str) -> None:
        """Every rank's state from a :meth:`save` directory."""
        self.results(self._each(lambda r, w: w.load.remote(directory)))

    def export_hf(self, directory: str, tokenizer: bool = True) -> None:
        """The current weights as an HF directory, with the tokenizer unless ``tokenizer`` is
        False (gathered from every rank; rank 0 writes); with LoRA the adapter in peft's format."""
        self.results(self._each(lambda r, w: w.export_hf.remote(directory, tokenizer)))

    def state_checksum(self) -> list[float]:
        """Σ |parameters| as each rank sees the whole model (tests: "did weights change")."""
        return self.results(self._each(lambda r, w: w.state_checksum.remote()))

    # -- the learners' end of a broadcast push (arbor.run.weight_sync.LearnerEnd) ------------

    def group_address(self) -> tuple[str, int]:
        address, port = self.results([self.workers[0].weight_group_address.remote()])[0]
        return address, port

    async def open_group(self, address: str, port: int, world_size: int, group_name: str) -> None:
        ref = self.workers[0].open_weight_group.remote(address, port, world_size, group_name, self.backend)
        await asyncio.to_thread(self.results, [ref])

    async def announced(self, load_format: str | None) -> AsyncIterator[Announcement]:
        """Rank 0's announcements as it makes them (it broadcasts each on its own, gathering
        the buckets with the other ranks)."""
        import ray

        stream, *others = self._each(
            lambda r, w: w.send_buckets.remote(load_format) if r == 0 else w.gather_buckets.remote())
        try:
            async for ref in stream:
                yield await ref
        except ray.exceptions.RayActorError as e:
            raise self._lost(0, e) from e
        await asyncio.to_thread(gather, others, ray.exceptions.RayActorError, lambda i, e: self._lost(i + 1, e))

    async def close_group(self) -> None:
        await asyncio.to_thread(self.results, [self.workers[0].close_weight_group.remote()])

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []
