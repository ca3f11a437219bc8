"""Learner ranks in step through depth-first walks of different shapes.

    schedule = merge_schedules(["FFBB", "FBFB"])        # "FFBFBB": holds both, in order
    Lockstep(distributed=True).run(walk.ops(), walk.plan.ops(), IdleCalls(model, backward))

Under DeepSpeed every model call is collective: a ZeRO-3 forward gathers each module's
parameters from all ranks, and a backward (any stage) reduces gradients in buckets, stage 3
gathering again. Every rank must issue the same sequence of forwards (F) and backwards (B),
but a depth-first walk's sequence follows its tree's shape (:mod:`arbor.train.dfs`). So the
ranks exchange their sequences, agree on one schedule that holds each of them in order
(:func:`merge_schedules`), and fill each slot they have no call for with an idle one on a
single token (:class:`IdleCalls`): an idle F forwards it and keeps its graph, an idle B runs
the backward of such a graph with its loss multiplied by 0. Each backward, real or idle,
reaches every parameter (the walk adds a 0-weighted logits term where a group scores nothing:
``anchor_every_backward``), so the gradient buckets fill alike on every rank.

DeepSpeed's ZeRO-3 accumulates a backward's gradients only from its second micro-step on,
and counts a micro-step at each forward that follows a backward; a walk runs backwards back
to back (a leaf's, then its parent's). :meth:`Lockstep.warm_up` runs one idle forward and
backward first, so the walk's first forward starts micro-step 1 and every backward adds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch


def merge_schedules(sequences: Sequence[str]) -> str:
    """A common schedule of the F/B ``sequences`` (one per rank, each a walk:
    every B closes an earlier F), forwards first: a slot is F while any rank's next call is F.

    Every rank can then fill its idle B slots with graphs of its idle F slots: at an idle B
    slot some rank's next call is a real B, so the schedule so far has more F than B slots.

    >>> merge_schedules(["FB", "FFBB"])
    'FFBB'
    >>> merge_schedules(["FFBFBB", "FB", ""])
    'FFBFBB'
    """
    at = [0] * len(sequences)
    out: list[str] = []
    while True:
        following = [s[i] for s, i in zip(sequences, at) if i < len(s)]
        if not following:
            return "".join(out)
        slot = "F" if "F" in following else "B"
        out.append(slot)
        at = [i + (i < len(s) and s[i] == slot) for s, i in zip(sequences, at)]


class IdleCalls:
    """Forwards and backwards of one token on ``model``, with collectives like real ones'."""

    def __init__(self, model: Any, backward: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.model, self.backward_fn = model, backward
        self.pending: list[torch.Tensor] = []  # idle forwards' zero losses, graph kept

    def forward(self) -> None:
        device = next(self.model.parameters()).device
        one = torch.zeros(1, 1, dtype=torch.long, device=device)
        with torch.set_grad_enabled(self.backward_fn is not None):
            logits = self.model(input_ids=one, position_ids=one, use_cache=False).logits
        if self.backward_fn is not None:
            self.pending.append(0.0 * logits.float().sum())

    def backward(self) -> None:
        if self.backward_fn is None or not self.pending:
            raise RuntimeError("an idle backward needs the graph of an earlier idle forward")
        self.backward_fn(self.pending.pop())


class Lockstep:
    """Runs walks alone (``distributed`` False) or on the schedule all ranks agree on."""

    def __init__(self, distributed: bool) -> None:
        self.distributed = distributed

    def run(self, ops: Iterator[str] | None, own: str, idle: IdleCalls) -> None:
        """Run this rank's walk ``ops`` (None: no pack this pass) whose sequence is ``own``."""
        if not self.distributed:
            for _ in ops or ():
                pass
            return
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, own)
        schedule = merge_schedules(gathered)
        announced = next(ops, None) if ops is not None else None
        for slot in schedule:
            if slot == announced:
                announced = next(ops, None)  # type: ignore[arg-type]  # resuming runs the announced call
            elif slot == "F":
                idle.forward()
            else:
                idle.backward()
        if announced is not None:
            raise RuntimeError(f"this rank's walk {own!r} did not fit the schedule {schedule!r}")

    @staticmethod
    def warm_up(idle: IdleCalls) -> None:
        """One idle forward and backward (every rank: before an update's walks under DeepSpeed)."""
        idle.forward()
        idle.backward()
