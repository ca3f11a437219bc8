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
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from arbor.config import Config
from arbor.engines.interfaces import bind_collectives
from arbor.engines.ports import free_port
from arbor.errors import ConfigError, RunStopped
from arbor.run.nodes import check_node_paths, node_address, node_alive, node_id, node_lost
from arbor.run.orchestration import Placement, cpu_threads, uses_gpu

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

    def setup(self, master: tuple[str, int], total_steps: int, output_token: str | None = None) -> tuple[str, str]:
        """Join the learner group and build the model, DeepSpeed engine and optimizer; this
        node's Ray id and address. ``output_token``: :func:`arbor.run.nodes.mark_output_dir`'s,
        checked first with the model's path (:func:`~arbor.run.nodes.check_node_paths`)."""
        import torch

        cfg = self.cfg
        check_node_paths(cfg, output_token, f"learner rank {self.rank}")
        # Gloo/NCCL listen on the interface of the address Ray knows for this node (the one
        # the other nodes reach it by), chosen here on the rank's own node.
        bind_collectives(node_address(), reason=f"Ray's address of learner rank {self.rank}'s node")
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
        return node_id(), node_address()

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


class LearnerFailedError(RunStopped):
    """A learner rank died (its Ray actor was lost): the run stops; the last checkpoint is intact."""


LOST_RANK_GRACE_S = 60.0  # after a rank's error, how long to wait for a lost rank or node to show


class LearnerGroup:
    """``learner.num_ranks`` :class:`LearnerWorker` actors forming one data-parallel group.

    A rank that dies (killed, out of memory, node lost) stops the run with
    :class:`LearnerFailedError` naming the rank, its node and the last checkpoint, at once:
    the other ranks may be blocked in a collective with it, so results are awaited as they
    come. When a node is lost its peers' collectives fail first (``Connection closed by
    peer``) while Ray takes seconds to declare the node dead: a rank's error is held up to
    ``LOST_RANK_GRACE_S`` for a lost rank to show, which is then the error reported.
    """

    def __init__(self, cfg: Config, placement: Placement, total_steps: int, wait: bool = True,
                 output_token: str | None = None) -> None:
        """Start the ranks; with ``wait=False`` return at once (:func:`start_groups` awaits ``starting``).
        ``output_token``: :func:`arbor.run.nodes.mark_output_dir`'s, which every rank checks on its node."""
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
        self.starting = [w.setup.remote(master, total_steps, output_token) for w in self.workers]  # ref r: rank r is set up
        self.nodes: list[tuple[str, str] | None] = [None] * len(self.workers)  # rank r's (Ray node id, address), once set up
        if wait:
            self.wait_started()

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def results(self, refs: list[Any], first_rank: int = 0) -> list[Any]:
        """``ray.get(refs)`` (ref r from rank ``first_rank`` + r), or LearnerFailedError as soon as
        a rank is lost; a rank's own error (a bug, a config problem) is raised as it is."""
        import ray

        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                raise self._lost(first_rank + refs.index(ready[0]), _first_line(e)) from e
            except ray.exceptions.RayError as e:
                cause = getattr(e, "cause", None)  # what a rank raised (Ray's RayTaskError)
                if isinstance(cause, ConfigError):  # its node lacks a path: say so at once
                    raise ConfigError(str(cause)) from None
                lost = self._lost_meanwhile(refs, first_rank, refs.index(ready[0]), e, pending)
                if lost is None:
                    raise
                raise lost from e
        return ray.get(refs)

    def _lost_meanwhile(self, refs: list[Any], first_rank: int, index: int, error: Exception,
                        pending: list[Any]) -> LearnerFailedError | None:
        """After rank ``first_rank + index`` raised ``error``: the LearnerFailedError of a rank found lost
        within ``LOST_RANK_GRACE_S`` (the cause of the error, when a node died), else None."""
        import ray

        if pending:
            print(f"arbor train: learner rank {first_rank + index} failed ({_first_line(error)}); waiting up to {LOST_RANK_GRACE_S:.0f} s "
                  "for whether another rank or its node was lost", file=sys.stderr, flush=True)
        deadline = time.monotonic() + LOST_RANK_GRACE_S
        while pending and time.monotonic() < deadline:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    return self._lost(first_rank + refs.index(ref), _first_line(e))
                except ray.exceptions.RayError:
                    continue  # another rank's error: the peers of a lost one fail alike
        return None

    def _lost(self, rank: int, cause: str) -> LearnerFailedError:
        """The error naming rank ``rank``, its node (and whether Ray lists the node as lost),
        ``cause`` and the last checkpoint."""
        from arbor.run import checkpoint

        node = self.nodes[rank]
        where = ""
        if node is not None:
            where = f" on node {node[1]}"
            if node_lost(node[0]):  # waits for Ray's verdict when it has none yet
                where += " (the node is lost: Ray lists it as dead)"
        return LearnerFailedError(
            f"learner rank {rank}{where} died ({cause}); the run stops. {checkpoint.resume_hint(self.output_dir)}"
        )

    def lost_rank_error(self) -> LearnerFailedError | None:
        """A LearnerFailedError for the first rank whose node Ray lists as dead, else None
        (an engine's recovery asks before moving the engine off a lost node)."""
        for rank, node in enumerate(self.nodes):
            if node is not None and not node_alive(node[0]):
                return self._lost(rank, "found when an engine on a lost node stopped answering")
        return None

    def node_addresses(self) -> str:
        """Where the ranks run, rank by rank: ``10.0.0.1, 10.0.0.2`` (after :meth:`wait_started`)."""
        return ", ".join(node[1] if node is not None else "?" for node in self.nodes)

    def wait_started(self) -> None:
        """Wait until every rank is set up (after ``wait=False``)."""
        self.nodes = self.results(self.starting)

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
            raise self._lost(0, _first_line(e)) from e
        await asyncio.to_thread(self.results, others, 1)

    async def close_group(self) -> None:
        await asyncio.to_thread(self.results, [self.workers[0].close_weight_group.remote()])

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []


def _first_line(error: BaseException) -> str:
    """The first line of what ``error`` says (of a rank's own exception, for Ray's task errors)."""
    cause = getattr(error, "cause", None) or error  # RayTaskError.cause: the exception the rank raised
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0]}" if text else type(cause).__name__
