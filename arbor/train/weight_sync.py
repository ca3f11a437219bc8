"""Learner → engine weights: bucketed transfer, cache flush, version check, logprob-gap probe.

    sync = WeightSync(client, method="distributed")
    await sync.push(gathered_buckets(model, zero_stage=3, bucket_mb=512), version="12")  # engines serve "12"
    gap = await probe_logprob_gap(client, learner.model, prompts)   # ~0 after a correct sync

Two transports, both SGLang's own endpoints so the same code drives SGLang and
``arbor serve``: ``distributed`` (a gloo/NCCL group built as SGLang builds it, with every
TP rank of every engine a member; ``/update_weights_from_distributed``), and ``disk`` (the
learner writes an HF directory, ``/update_weights_from_disk``). A distributed push runs in
a weight-update session (``/begin_weight_update`` ... ``/end_weight_update``, which SGLang
>= 0.5.22 requires; older servers answer 404 and go without) and sends each bucket as one
flat broadcast (``load_format: "flattened_bucket"``) where every server supports it
(SGLang >= 0.5.6, ``arbor serve``), else one broadcast per tensor. The radix cache is
flushed with the last bucket: KV computed by old weights must never serve new rollouts.
SGLang pauses generation around a push (its flush needs no request running; asynchronous
rollouts keep some in flight), which resumes with KV recomputed under the new weights.

A LoRA run (``model.lora_rank`` > 0) pushes only the adapter (:meth:`WeightSync.push_adapter`):
the learner writes it in peft's format under a new name per version (``arbor-lora-<version>``),
every engine loads it (SGLang's ``/load_lora_adapter``; ``arbor serve`` merges it into its
base weights), the cache is flushed, the version set, and the adapter before the previous one
unloaded (the previous one stays until requests sent before this push are done).

Under ZeRO-3 the buckets are gathered one :class:`deepspeed.zero.GatheredParameters` each
(one coalesced all-gather over the learner ranks, not one per tensor), and a push gathers
the next bucket while the previous one is broadcast to the engines.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from arbor.engines.client import SGLangClient, adapter_name
from arbor.engines.distributed import (
    FLATTENED,
    FlatBuffer,
    close_group,
    connect_learner,
    send_weights,
)
from arbor.engines.ports import free_port
from arbor.engines.types import GenerateRequest, SamplingParams
from arbor.train.lm_head import logprobs_and_entropy


def named_tensor_buckets(
    named: Iterator[tuple[str, torch.Tensor]], bucket_mb: float
) -> Iterator[list[tuple[str, torch.Tensor]]]:
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
) -> Iterator[list[tuple[str, torch.Tensor]]]:
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
    # is per thread, and WeightSync.push takes the later buckets in a worker thread.
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


class WeightSync:
    """Pushes weights from learner rank 0 to every engine of ``client``."""

    def __init__(
        self,
        client: SGLangClient,
        method: str = "distributed",
        *,
        master_address: str = "127.0.0.1",
        export_dir: str | Path | None = None,
        flatten: bool = True,
    ) -> None:
        """``flatten``: send each bucket as one flat broadcast where every engine takes it
        (False: one broadcast per tensor everywhere, e.g. to compare the two)."""
        if method not in ("distributed", "disk"):
            raise ValueError(f"weight sync method must be 'distributed' or 'disk', got {method!r}")
        if method == "disk" and export_dir is None:
            raise ValueError("weight sync over disk needs export_dir")
        self.client, self.method = client, method
        self.master_address = master_address
        self.flatten = flatten
        self.export_dir = Path(export_dir) if export_dir is not None else None
        self._group: Any = None
        self._group_name = ""
        self._load_format: str | None = None  # set with the group, from the servers' versions
        self._buffer = FlatBuffer()  # the flat bucket being sent, reused push after push
        self.adapters: list[str] = []  # LoRA adapters the engines hold, oldest first

    async def push(self, buckets: Iterator[list[tuple[str, torch.Tensor]]], version: str) -> int:
        """Send every bucket; the last one flushes the cache and sets ``version``. Returns the
        bytes sent.

        The bucket after next is taken from ``buckets`` (e.g. gathered over the learner
        ranks by :func:`gathered_buckets`) in a thread while a bucket is broadcast; the one
        after is already held, so each send knows whether it is the last. Memory: the bucket
        being sent, the next one, the one being gathered (twice while it is copied out of
        ZeRO-3's gather) and the flat buffer: about five ``bucket_mb``.
        """
        if self.method == "disk":
            raise ValueError("disk sync writes a directory: use push_directory")
        buckets = iter(buckets)
        pending = next(buckets, None)
        if pending is None:
            raise ValueError("weight sync got no tensors to push")
        following = next(buckets, None)
        sent = 0
        if self._group is None:
            await self._connect(on_gpu=pending[0][1].is_cuda)
        paused = await self.client.pause_generation()
        sessions = await self.client.begin_weight_update()
        try:
            while pending is not None:
                last = following is None
                sent += sum(whole_nbytes(tensor) for _, tensor in pending)
                send = send_weights(
                    self.client, self._group, pending, group_name=self._group_name,
                    load_format=self._load_format if self.flatten else None,
                    flush_cache=last, weight_version=version if last else None, buffer=self._buffer,
                )
                # The gather (learner group) and the broadcast (weight-update group) share no
                # rank but the learner's rank 0, so running both at once cannot deadlock.
                _, after = await asyncio.gather(send, asyncio.to_thread(next, buckets, None))
                pending, following = following, after
        finally:
            await self.client.end_weight_update(sessions)
            await self.client.continue_generation(paused)
        await self.check_version(version)
        return sent

    async def _connect(self, on_gpu: bool) -> None:
        """Join every engine's TP ranks to a new group; pick the fastest format all accept."""
        infos = await self.client.server_info()
        self._load_format = FLATTENED if all(map(accepts_flattened_bucket, infos)) else None
        port = free_port(self.master_address)
        # A name of its own: torch allows one live group per name in a process, and a
        # learner may open a new sync (new engines) before the old group is gone.
        self._group_name = f"arbor_weight_sync_{port}"
        # NCCL where the learner's tensors live on a GPU, gloo on CPUs (SGLang's CPU engine too).
        self._group = await connect_learner(
            self.client, self.master_address, port,
            tp_sizes=[engine_ranks(info, url) for info, url in zip(infos, self.client.urls)],
            group_name=self._group_name, backend="nccl" if on_gpu else "gloo",
        )

    async def close(self) -> None:
        """Destroy the group on the engines and here (a later push opens a new one)."""
        if self._group is None:
            return
        await self.client.destroy_weights_update_group(self._group_name)
        self.close_local()

    @property
    def group_name(self) -> str | None:
        """The weight-update group's name while one is open, else None."""
        return self._group_name if self._group is not None else None

    def close_local(self) -> None:
        """Leave the group on this side only (the engines' side is the caller's: e.g. after
        an engine restart, only the engines still in the group can destroy it)."""
        if self._group is not None:
            close_group(self._group)
            self._group = None

    async def push_directory(self, model_dir: str | Path, version: str) -> int:
        """Engines load an HF directory the learner wrote (the fallback transport); returns
        the bytes of its weight files. Generation is paused around it (SGLang updates and
        flushes only when idle)."""
        paused = await self.client.pause_generation()
        try:
            await self.client.update_weights_from_disk(str(model_dir), weight_version=version)
            await self.client.flush_cache()
        finally:
            await self.client.continue_generation(paused)
        await self.check_version(version)
        return tensor_bytes(model_dir)

    async def push_adapter(self, adapter_dir: str | Path, version: str, keep: int = 2) -> int:
        """Engines load the LoRA adapter directory ``adapter_dir`` (peft's format, named
        ``adapter_name(version)``); the cache is flushed, the version set, and all but the
        newest ``keep`` adapters unloaded (the directories of adapters no engine holds deleted). Returns the bytes of
        the adapter's weights.

        Why a path, not SGLang's ``/load_lora_adapter_from_tensors``: that endpoint takes
        tensors pickled by SGLang's own ``MultiprocessingSerializer`` (shared-memory handles,
        same host only), which arbor's learner does not import; a path needs the engines to
        see the learner's ``run.output_dir`` (as ``learner.weight_sync: disk`` does).
        """
        import shutil

        name = adapter_name(version)
        await self.client.load_lora_adapter(name, str(adapter_dir))
        self.adapters.append(name)
        await self.client.flush_cache()
        await self.client.update_weight_version(version)
        while len(self.adapters) > keep:
            old = self.adapters.pop(0)
            await self.client.unload_lora_adapter(old)
        # Directories of adapters no engine holds (unloaded, or a previous process's) go.
        for stale in Path(adapter_dir).parent.glob(adapter_name("*")):
            if stale.name not in self.adapters:
                shutil.rmtree(stale, ignore_errors=True)
        await self.check_version(version)
        return tensor_bytes(adapter_dir)

    async def check_version(self, version: str) -> None:
        versions = await self.client.get_weight_version()
        stale = [(url, v) for url, v in zip(self.client.urls, versions) if v != version]
        if stale:
            raise RuntimeError(f"weight sync to version {version!r} failed: engines report {stale}")


def tensor_bytes(directory: str | Path) -> int:
    """Bytes of the tensors in ``directory``'s safetensors files (their headers excluded)."""
    from arbor.train.zero3 import SafetensorsReader

    return sum(
        end - begin
        for file in Path(directory).glob("*.safetensors")
        for begin, end in (entry["data_offsets"] for entry in SafetensorsReader(file).entries.values())
    )


FLATTENED_SINCE = (0, 5, 6)  # the first SGLang whose distributed receive takes flat buckets


def accepts_flattened_bucket(server_info: dict[str, Any]) -> bool:
    """The server takes ``load_format: "flattened_bucket"`` over the distributed group."""
    if server_info.get("engine") == "arbor":
        return True
    return _version(str(server_info.get("version", "0"))) >= FLATTENED_SINCE


def _version(text: str) -> tuple[int, ...]:
    """``"0.5.10.post1"`` -> ``(0, 5, 10)``; unparsable parts end it."""
    parts = []
    for piece in text.split(".")[:3]:
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def engine_ranks(server_info: dict[str, Any], url: str) -> int:
    """How many group ranks an engine takes: its tensor-parallel size (one per TP rank)."""
    if int(server_info.get("dp_size", 1)) != 1:
        # Each data-parallel replica would join with the same TP ranks: the ranks collide.
        raise ValueError(f"{url} runs dp_size={server_info['dp_size']}: distributed weight sync "
                         "needs dp_size 1 (run one engine per replica, engine.num_engines)")
    return int(server_info.get("tp_size", 1))


ProbeSample = tuple[list[int], list[int], list[float]]  # prompt ids, output ids, engine logprobs


async def probe_samples(
    client: SGLangClient, prompts: list[list[int]], max_new_tokens: int = 16, temperature: float = 1.0
) -> list[ProbeSample]:
    """Continuations of ``prompts`` sampled by the engine at ``temperature``, with its logprobs.

    No top-k/top-p: the engine's logprobs are those of softmax(logits / T), the
    distribution the learner computes at the same T (:func:`logprob_gap`).
    """
    requests = [
        GenerateRequest(ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=i))
        for i, ids in enumerate(prompts)
    ]
    outputs = await asyncio.gather(*(client.generate(r) for r in requests))
    return [(list(ids), out.output_ids, out.logprobs) for ids, (out,) in zip(prompts, outputs)]


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


async def probe_logprob_gap(
    client: SGLangClient, model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int = 16,
    temperature: float = 1.0,
) -> float:
    """Mean |logp_engine − logp_learner| over sampled probe continuations (nats per token)."""
    samples = await probe_samples(client, prompts, max_new_tokens, temperature)
    return logprob_gap(model, samples, temperature)
