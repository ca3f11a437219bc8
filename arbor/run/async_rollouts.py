"""Asynchronous RL (``algorithm.max_staleness`` = k ≥ 1): a driver thread samples and scores the
next steps' batches while the learners train on the current one.

    with RolloutProducer(ctx.sampling, ctx.rewards, ctx.stream, cfg, first_step=1) as producer:
        for step in range(1, cfg.run.steps + 1):
            taken = producer.take(step)            # blocks until the batch of `step` is scored
            ...train on taken.batch.trees, push weights version str(step)...
            producer.step_done(step, pushed=True)  # the batch of step + k + 1 may start now
            ctx.save_checkpoint(step, stream_state=producer.stream_state(step + 1))

**Bounded staleness** (as AReaL's rollout controller bounds it: Fu et al. 2025, arXiv
2505.24298, §4.2): the batch of step t is trained by the weights pushed after step t − 1.
The producer starts sampling it only once step t − 1 − k is done, so at most k weight
updates separate any of its segments from the weights that train on it. The bound is
checked again when a batch is taken: a tree with a segment sampled more than k updates
before (an engine restarted with older weights, a run resumed mid-flight) is dropped
from the batch and counted (``async/dropped``); ``async/staleness_mean`` is the mean over
trained trees of the updates since their oldest segment.

**Versions**: the trainer pushes weights labelled ``str(step)`` (``"default"``: the
model's own weights, 0); every node the engine sampled keeps the label it was sampled under
(``Node.weight_version``), so the staleness of a tree is the number of pushes with a label
above its oldest sampled node's. Environment, agent and tool messages carry no label: they
are context, not samples, and do not age a tree.

**Checkpoints** hold no samples in flight: ``stream_state(step + 1)`` is the problem
stream's cursor before the first batch not yet trained, so a resumed run samples the
problems of the queued and in-flight batches again (under its restored weights).

The producer samples through engines of its own (:meth:`RecoveringEngine.fresh
<arbor.run.recovery.RecoveringEngine.fresh>`: an aiohttp session belongs to one event loop
and thread) that share the run's recovery and weights: a server that dies mid-sampling is
restarted with the weights the other engines serve, its requests sent again, and the
restart counted in ``engine/restarts`` as in a synchronous run; its requests name the LoRA
adapter of the last push. The reward pool serialises its batches with the trainer's evals.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

from arbor.config import Config
from arbor.data import ProblemStream
from arbor.rollout.rewards import RewardPool
from arbor.run import phases
from arbor.run.phases import Batch, Sampling
from arbor.tree import RolloutTree


def version_number(label: str | None) -> int:
    """A weight-version label as the step that pushed it: ``"default"`` (or none) is 0.

    >>> version_number("12"), version_number("default")
    (12, 0)
    """
    if label is None or label == "default":
        return 0
    try:
        return int(label)
    except ValueError:
        raise ValueError(f"weight version {label!r} is not a step number: asynchronous runs "
                         "(algorithm.max_staleness ≥ 1) need the versions arbor pushes") from None


def updates_since(tree: RolloutTree, pushed: list[int]) -> int:
    """Weight updates (labels in ``pushed``) after the oldest segment of ``tree`` the policy sampled.

    Only nodes the engine sampled carry a weight version: an environment's, an agent's or a
    tool's messages (and anything else appended as context) carry none and have no age. Reading
    their missing version as 0 made every multi-turn tree look as old as the first weights, so an
    asynchronous run dropped them all from its third step on. A tree with no sampled node is 0 old.
    """
    sampled = [version_number(n.weight_version) for n in tree.nodes() if n.weight_version is not None]
    oldest = min(sampled, default=None)
    if oldest is None:
        return 0
    return sum(1 for label in pushed if label > oldest)


def drop_stale(trees: list[RolloutTree], pushed: list[int], max_staleness: int) -> tuple[list[RolloutTree], list[int]]:
    """The trees at most ``max_staleness`` updates old, and the staleness of each kept one."""
    ages = [updates_since(tree, pushed) for tree in trees]
    kept = [(tree, age) for tree, age in zip(trees, ages) if age <= max_staleness]
    return [t for t, _ in kept], [a for _, a in kept]


@dataclass
class Taken:
    """One step's batch as the learner gets it, with its ``async/*`` metrics."""

    batch: Batch  # .trees: the trees within the staleness bound
    metrics: dict[str, float]


class _ThreadLog:
    """Phase timing of the producer's thread (the trainer's MetricsLog belongs to its thread)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    def status(self, text: str) -> None:
        """Progress lines stay off the console: the trainer's thread owns it."""


class RolloutProducer:
    """Samples and scores the batches of steps ``first_step``..``run.steps`` ahead of the learner."""

    def __init__(
        self, sampling: Sampling, rewards: RewardPool, stream: ProblemStream, cfg: Config, *, first_step: int,
    ) -> None:
        self.cfg, self.max_staleness = cfg, cfg.algorithm.max_staleness
        stale = self._overtaken if cfg.engine.partial_rollouts else None
        self.sampling = replace(sampling, engine=sampling.engine.fresh(), is_stale=stale)
        self.rewards, self.stream = rewards, stream
        # Labels of the weights pushed so far: a resumed run's engines serve step first_step − 1.
        self.pushed: list[int] = [first_step - 1] if first_step > 1 else []
        self._done = first_step - 1  # the last step the learner finished
        self._cond = threading.Condition()
        self._ready: dict[int, tuple[Batch, dict[str, float]]] = {}
        self._states: dict[int, dict[str, int]] = {}  # stream cursor before each step's batch
        self._error: BaseException | None = None
        self._stop = False
        self._engine_s = 0.0  # rollout seconds since engine_seconds() was last read
        self._thread = threading.Thread(target=self._run, args=(first_step,), name="arbor-rollouts", daemon=True)

    def __enter__(self) -> RolloutProducer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        # A batch being sampled ends with the run's engines (closed after this).
        self._thread.join(timeout=self.cfg.engine.request_timeout_s)

    # -- the trainer's side --------------------------------------------------------------------

    def take(self, step: int) -> Taken:
        """The batch of ``step`` (waits for it), stale trees dropped; re-raises the producer's error."""
        with self._cond:
            self._cond.wait_for(lambda: step in self._ready or self._error is not None)
            if step not in self._ready:
                assert self._error is not None
                raise self._error
            batch, times = self._ready.pop(step)
            pushed = list(self.pushed)
        kept, ages = drop_stale(batch.trees, pushed, self.max_staleness)
        metrics = {
            "async/dropped": float(len(batch.trees) - len(kept)),
            "async/staleness_mean": sum(ages) / max(len(ages), 1),
            "async/resampled": float(sum(s.resampled for s in batch.stats)),
        } | {f"async/{name}_s": seconds for name, seconds in times.items()}
        batch.trees = kept
        return Taken(batch, metrics)

    def step_done(self, step: int, pushed: bool) -> None:
        """The learner finished ``step`` (and pushed weights ``str(step)`` if ``pushed``)."""
        with self._cond:
            if pushed:
                self.pushed.append(step)
            self._done = step
            self._cond.notify_all()

    def stream_state(self, step: int) -> dict[str, int]:
        """The problem stream's cursor before the batch of ``step`` (what a checkpoint keeps)."""
        with self._cond:
            # Not started yet: the producer records the cursor under this lock before it moves it.
            return dict(self._states[step]) if step in self._states else self.stream.state_dict()

    def engine_seconds(self) -> float:
        """Seconds the producer spent sampling since the last call."""
        with self._cond:
            seconds, self._engine_s = self._engine_s, 0.0
        return seconds

    # -- the producer's thread -----------------------------------------------------------------

    def _overtaken(self, weight_version: str) -> bool:
        """Partial rollouts: a segment sampled by weights older than the newest pushed ones."""
        with self._cond:
            newest = self.pushed[-1] if self.pushed else 0
        return version_number(weight_version) < newest

    def _run(self, first_step: int) -> None:
        try:
            for step in range(first_step, self.cfg.run.steps + 1):
                with self._cond:
                    # The bound: the batch of step t starts once step t − 1 − k is done.
                    start_after = step - 1 - self.max_staleness
                    self._cond.wait_for(lambda: self._stop or self._done >= start_after)  # noqa: B023 (waited here)
                    if self._stop:
                        return
                    self._states[step] = self.stream.state_dict()
                log = _ThreadLog()
                batch = phases.collect_rollouts(self.sampling, self.rewards, self.stream, log, self.cfg, step)
                with self._cond:
                    self._ready[step] = (batch, log.phases)
                    self._engine_s += log.phases.get("rollout", 0.0)
                    self._states = {s: v for s, v in self._states.items() if s > self._done}
                    self._cond.notify_all()
        except BaseException as error:  # the trainer's take() raises it, with its own message
            with self._cond:
                self._error = error
                self._cond.notify_all()


def producer_for(
    cfg: Config, sampling: Sampling, rewards: RewardPool, stream: ProblemStream, first_step: int
) -> AbstractContextManager[RolloutProducer | None]:
    """A running :class:`RolloutProducer` with ``algorithm.max_staleness`` ≥ 1, else None (on-policy)."""
    if not cfg.algorithm.max_staleness:
        return nullcontext()
    return RolloutProducer(sampling, rewards, stream, cfg, first_step=first_step)


def busy_metrics(engine_s: float, learner_s: float, wall_s: float) -> dict[str, Any]:
    """``async/engine_busy`` and ``async/learner_busy``: the share of ``wall_s`` each side worked."""
    wall_s = max(wall_s, 1e-9)
    return {"async/engine_busy": min(engine_s / wall_s, 1.0), "async/learner_busy": min(learner_s / wall_s, 1.0)}
