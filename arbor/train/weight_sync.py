"""The learners' side of weight sync: whole parameters in buckets, rank 0's end of the
weight-update group that broadcasts them, and the logprob gap a probe measures.

    sender = BucketSender()
    sender.open("10.0.0.1", port, world_size=2, group_name="arbor_weight_sync_29500", backend="gloo")
    for part in sender.send(gathered_buckets(model, zero_stage=3, bucket_mb=512), FLATTENED):
        ...  # the engines are told `part` (names, dtypes, shapes) while it is broadcast
    gap = logprob_gap(model, samples)      # |engine − learner| logprob of probe samples

Everything that talks to the engines (the HTTP calls, SGLang's versions, adapters, restoring
a restarted server) is the run's: :mod:`arbor.run.weight_sync`. The learner only hands over
buckets (over the group) or directories (an HF export, a LoRA adapter).

Under ZeRO-3 the buckets are gathered one :class:`deepspeed.zero.GatheredParameters` each
(one coalesced all-gather over the learner ranks, not one per tensor), and rank 0 gathers the
next bucket while the previous one is broadcast to the engines.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from arbor.engines.distributed import (
    FLATTENED,
    FlatBuffer,
    close_group,
    dtype_name,
    flat_chunks,
    flatten,
    open_group,
)
from arbor.train.lm_head import logprobs_and_entropy

Bucket = list[tuple[str, torch.Tensor]]  # (parameter name, whole tensor)


def named_tensor_buckets(
    named: Iterator[tuple[str, torch.Tensor]], bucket_mb: float
) -> Iterator[Bucket]:
    """Group (name, tensor) pairs into lists of at most ``bucket_mb`` (a lone big tensor alone)."""
    limit = bucket_mb * 2**20
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = whole_nbytes(tensor)
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def whole_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the whole tensor: a ZeRO-3 placeholder holds 0 elements, ``ds_numel`` in all."""
    return getattr(tensor, "ds_numel", tensor.numel()) * tensor.element_size()


def gathered_buckets(
    model: torch.nn.Module, zero_stage: int, bucket_mb: float, copy: bool = True, trainable_only: bool = False
) -> Iterator[Bucket]:
    """Whole parameters in buckets of at most ``bucket_mb`` (a bigger tensor alone), in
    ``named_parameters`` order.

    Under ZeRO-3 each bucket is one ``GatheredParameters`` (collective: every rank iterates
    to the end) whose tensors are copied out before it is released, so a bucket stays
    valid while the next one is gathered. ``copy=False``: gather and release only (the
    ranks that take part but send nothing); the bucket then holds the empty placeholders.
    ``trainable_only``: only parameters with ``requires_grad`` (a LoRA adapter).
    """
    named = ((n, p) for n, p in model.named_parameters() if p.requires_grad or not trainable_only)
    if zero_stage != 3:
        yield from named_tensor_buckets(((name, param.detach()) for name, param in named), bucket_mb)
        return
    import deepspeed

    # The caller's GPU (the first bucket is taken in the caller's thread): the current GPU
    # is per thread, and BucketSender.send takes the later buckets in a worker thread.
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    for bucket in named_tensor_buckets(named, bucket_mb):
        if device is not None:
            torch.cuda.set_device(device)
        with deepspeed.zero.GatheredParameters([param for _, param in bucket]):
            out = [(name, param.detach().clone() if copy else param.detach()) for name, param in bucket]
        yield out


def gathered_parameters(model: torch.nn.Module, zero_stage: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole parameters one at a time (ZeRO-3 gathers each, then frees it again): one
    all-gather per tensor; :func:`gathered_buckets` is the bucketed gather."""
    if zero_stage != 3:
        for name, param in model.named_parameters():
            yield name, param.detach()
        return
    import deepspeed

    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            yield name, param.detach().clone()


@dataclass
class Announcement:
    """One broadcast the engines must take part in: what ``/update_weights_from_distributed``
    announces before the tensors arrive."""

    names: list[str]
    dtypes: list[str]  # "bfloat16", as SGLang resolves a dtype (getattr(torch, name))
    shapes: list[list[int]]
    nbytes: int  # bytes of the whole tensors
    last: bool  # the push's last broadcast: its request flushes the cache and sets the version


class BucketSender:
    """Learner rank 0's end of the weight-update group (the engines' TP ranks are the others)."""

    def __init__(self) -> None:
        self.group: Any = None
        self._buffer = FlatBuffer()  # the flat bucket being sent, reused push after push

    def open(self, address: str, port: int, world_size: int, group_name: str, backend: str) -> None:
        """Join as rank 0 (blocks until every engine rank joined: they are told to meanwhile)."""
        self.group = open_group(address, port, 0, world_size, group_name, backend)

    def close(self) -> None:
        """Leave the group on this side (the engines leave it when they are told to)."""
        if self.group is not None:
            close_group(self.group)
            self.group = None

    def send(self, buckets: Iterator[Bucket], load_format: str | None) -> Iterator[Announcement]:
        """Broadcast every bucket; before each broadcast, yield what the engines are to receive.

        Run it ahead of its consumer (a Ray streaming generator does; in a process of its
        own, :func:`arbor.run.weight_sync.ahead`): each broadcast waits for the engines, which
        join it once they are told the announcement. ``load_format: "flattened_bucket"``: one
        broadcast per bucket (split where a tensor would start off its alignment), else one
        per tensor. The bucket after next is gathered in a thread while one is broadcast, the
        next one is already held (so the last announcement says it is the last). Memory: the
        bucket being sent, the next one, the one being gathered and the flat buffer.
        """
        if self.group is None:
            raise RuntimeError("BucketSender.send before open: the engines are not in a group yet")
        buckets = iter(buckets)
        pending, following = next(buckets, None), next(buckets, None)
        if pending is None:
            raise ValueError("weight sync got no tensors to push")
        with ThreadPoolExecutor(1, thread_name_prefix="arbor-gather") as pool:
            while pending is not None:
                # The gather (learner group) and the broadcast (weight-update group) share no
                # rank but this one, so running both at once cannot deadlock.
                after = pool.submit(next, buckets, None)
                parts = list(flat_chunks(pending)) if load_format == FLATTENED else [pending]
                for index, part in enumerate(parts):
                    yield Announcement(
                        [name for name, _ in part], [dtype_name(t.dtype) for _, t in part],
                        [list(t.shape) for _, t in part], sum(whole_nbytes(t) for _, t in part),
                        last=following is None and index == len(parts) - 1,
                    )
                    self._broadcast(part, load_format)
                pending, following = following, after.result()

    def _broadcast(self, part: Bucket, load_format: str | None) -> None:
        if load_format == FLATTENED:
            nbytes = sum(t.numel() * t.element_size() for _, t in part)
            dist.broadcast(flatten(part, self._buffer.take(nbytes, part[0][1].device)), src=0, group=self.group)
            return
        for _, tensor in part:
            dist.broadcast(tensor.detach().contiguous(), src=0, group=self.group)


ProbeSample = tuple[list[int], list[int], list[float]]  # prompt ids, output ids, engine logprobs


@torch.no_grad()
def logprob_gap(model: torch.nn.Module, samples: list[ProbeSample], temperature: float = 1.0) -> float:
    """Mean |logp_engine − logp_learner| over the sampled tokens (nats per token).

    The learner's log-probs are float32 log_softmax(logits / ``temperature``): the
    temperature the probe was sampled at.
    """
    device = next(model.parameters()).device
    gaps = []
    for ids, output_ids, engine_logprobs in samples:
        if not output_ids:
            continue
        full = torch.tensor([ids + output_ids], device=device)
        logits = model(input_ids=full).logits[0, len(ids) - 1 : -1]
        learner, _ = logprobs_and_entropy(logits, torch.tensor(output_ids, device=device), temperature)
        gaps.append((learner.cpu() - torch.tensor(engine_logprobs)).abs())
    return float(torch.cat(gaps).mean()) if gaps else 0.0
