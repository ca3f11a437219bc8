"""The run's weights on its engines, with one owner: which way they travel, every push,
restoring a restarted server, and the LoRA adapter requests name.

    weights = EngineWeights(cfg, learners, engines.urls)   # cfg settled (arbor.run.startup)
    with weights.changing():        # the learners' weights move ahead of the engines' ...
        learners.step(...)
        weights.push("12")          # ... until every engine serves version "12" (checked)
    weights.adapter                 # "arbor-lora-12" with LoRA (requests name it), else None
    weights.restore(url)            # a restarted server serves "12" again

The ways, by ``learner.weight_sync`` and ``model.lora_rank``, all SGLang's own endpoints, so
the same calls drive SGLang and ``arbor serve``:

- ``distributed``: learner rank 0 broadcasts ``learner.sync_bucket_mb`` buckets over a
  gloo/NCCL group whose other members are every TP rank of every engine
  (``/init_weights_update_group``); the engines are told each broadcast
  (``/update_weights_from_distributed``) while rank 0 makes it, each bucket as one flat
  broadcast (``load_format: "flattened_bucket"``) where every server takes it (SGLang >= 0.5.6,
  ``arbor serve``), else one per tensor. It runs in a weight-update session
  (``/begin_weight_update`` ... ``/end_weight_update``, which SGLang >= 0.5.22 requires;
  older servers answer 404 and go without).
- ``disk``: the learners write an HF directory (``<run.output_dir>/weight-sync``), the
  engines load it (``/update_weights_from_disk``): engines the learner cannot reach over
  torch.distributed.
- LoRA (``model.lora_rank`` > 0): the learners write the adapter in peft's format under a new
  name per version (:func:`adapter_name`), every engine loads it (``/load_lora_adapter``),
  the version is set, and all but the newest ``2 + algorithm.max_staleness`` adapters are
  unloaded (requests sent before a push may still name an older one). Every request of
  the run names :attr:`EngineWeights.adapter` (``GenerateRequest.adapter``: SGLang's ``lora_path``).

Generation is paused around a push (SGLang flushes its cache only when no request runs;
asynchronous rollouts keep some in flight), and the radix cache is flushed with it: KV
computed by old weights never serves new rollouts. Every push ends with each engine's
version checked.

A server restarted after it died (:mod:`arbor.run.recovery`) gets the version the others
serve: the adapters they hold (LoRA), the last pushed directory (disk), or an HF export of
the learners' weights (distributed; the other engines then leave the group and the next
push opens a new one with all). The learners' weights are the pushed ones except inside a
:meth:`EngineWeights.changing` block, which restores wait for; a restore inside it (the
block's own thread, before its push) leaves full weights to that push; the calls that reach
the server meanwhile answer under model.path's version (:func:`behind` the run's), and the
run's engine sends them again after the push (:mod:`arbor.run.recovery`).

:class:`WeightSync` is the engine side alone: ``await WeightSync(client).push(buckets, "3")``
pushes the weights of a model in this process (this process is the group's rank 0).
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import contextmanager
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from arbor.engines.client import SGLangClient
from arbor.engines.connect import closing, engine_client
from arbor.engines.distributed import FLATTENED
from arbor.engines.ports import free_port
from arbor.engines.types import GenerateRequest, RolloutEngine, SamplingParams
from arbor.train.weight_sync import Announcement, Bucket, BucketSender, ProbeSample

if TYPE_CHECKING:
    from arbor.config import Config, ModelConfig
    from arbor.run.learner_group import LearnerGroup

T = TypeVar("T")
ADAPTER_PREFIX = "arbor-lora-"


def adapter_name(version: str) -> str:
    """The LoRA adapter of weight version ``version``: a new name per push, so an engine never
    confuses two versions of the adapter."""
    return f"{ADAPTER_PREFIX}{version}"


def lora_engine_flags(model_cfg: ModelConfig) -> list[str]:
    """SGLang's launch flags for serving a LoRA run's adapters: LoRA on, its rank, its targets."""
    from transformers import AutoConfig

    from arbor.train.lora import lora_targets

    model_type = AutoConfig.from_pretrained(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code).model_type
    return ["--enable-lora", "--max-lora-rank", str(model_cfg.lora_rank),
            "--lora-target-modules", *lora_targets(model_cfg, model_type)]


class LearnerEnd(Protocol):
    """The learners' side of a broadcast push: rank 0's end of the group, and its buckets
    (:class:`~arbor.run.learner_group.LearnerGroup` for Ray-placed ranks)."""

    backend: str  # "nccl" where rank 0's tensors are on a GPU, else "gloo"

    def group_address(self) -> tuple[str, int]:
        """Rank 0's address and a free port there."""

    async def open_group(self, address: str, port: int, world_size: int, group_name: str) -> None:
        """Rank 0 joins (returns once the engines joined too)."""

    def announced(self, load_format: str | None) -> AsyncIterator[Announcement]:
        """Each broadcast's announcement, made ahead: rank 0 broadcasts it on its own."""

    async def close_group(self) -> None: ...


async def ahead(items: Iterator[T]) -> AsyncIterator[T]:
    """``items`` produced in a thread, ahead of this consumer (as a Ray streaming generator
    runs ahead on its actor): :meth:`BucketSender.send` in the consumer's own process."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()  # (finished, item or error)

    def produce() -> None:
        try:
            for item in items:
                loop.call_soon_threadsafe(queue.put_nowait, (False, item))
        except BaseException as error:  # handed to the consumer
            loop.call_soon_threadsafe(queue.put_nowait, (True, error))
        else:
            loop.call_soon_threadsafe(queue.put_nowait, (True, None))

    producer = asyncio.ensure_future(asyncio.to_thread(produce))
    while True:
        finished, item = await queue.get()
        if finished:
            await producer
            if item is not None:
                raise item
            return
        yield item


class _ThisProcess:
    """:class:`LearnerEnd` for a model in this process: it is rank 0."""

    def __init__(self, sender: BucketSender, buckets: Iterator[Bucket], master_address: str) -> None:
        first = next(buckets, None)
        if first is None:
            raise ValueError("weight sync got no tensors to push")
        self.sender, self.buckets, self.master_address = sender, chain([first], buckets), master_address
        self.backend = "nccl" if first[0][1].is_cuda else "gloo"

    def group_address(self) -> tuple[str, int]:
        return self.master_address, free_port(self.master_address)

    async def open_group(self, address: str, port: int, world_size: int, group_name: str) -> None:
        await asyncio.to_thread(self.sender.open, address, port, world_size, group_name, self.backend)

    def announced(self, load_format: str | None) -> AsyncIterator[Announcement]:
        return ahead(self.sender.send(self.buckets, load_format))

    async def close_group(self) -> None:
        self.sender.close()


class WeightSync:
    """Pushes weights to every engine of ``client`` (the engine side: SGLang's HTTP calls)."""

    def __init__(self, client: SGLangClient, *, master_address: str = "127.0.0.1", flatten: bool = True) -> None:
        """``master_address``: where engines reach this process for :meth:`push`; ``flatten``:
        flat broadcasts where every engine takes them (False: one per tensor everywhere)."""
        self.client, self.master_address, self.flatten = client, master_address, flatten
        self.adapters: list[str] = []  # LoRA adapters the engines hold, oldest first
        self.group_name: str | None = None  # the open weight-update group's, else None
        self._learner: LearnerEnd | None = None  # whose end the group has
        self._load_format: str | None = None  # set with the group, from the servers' versions
        self._sender = BucketSender()  # rank 0's end when this process pushes

    async def push(self, buckets: Iterator[Bucket], version: str) -> int:
        """Broadcast the buckets of a model in this process; the bytes sent."""
        return await self.push_from(_ThisProcess(self._sender, iter(buckets), self.master_address), version)

    async def push_from(self, learner: LearnerEnd, version: str) -> int:
        """Every broadcast ``learner`` announces; the last flushes the cache and sets ``version``."""
        group = self.group_name or await self._connect(learner)
        sent = 0
        paused = await self.client.pause_generation()
        sessions = await self.client.begin_weight_update()
        try:
            async for part in learner.announced(self._load_format if self.flatten else None):
                await self.client.update_weights_from_distributed(
                    part.names, part.dtypes, part.shapes, group_name=group,
                    load_format=self._load_format if self.flatten else None,
                    flush_cache=part.last, weight_version=version if part.last else None,
                )
                sent += part.nbytes
        finally:
            await self.client.end_weight_update(sessions)
            await self.client.continue_generation(paused)
        await self.check_version(version)
        return sent

    async def _connect(self, learner: LearnerEnd) -> str:
        """Join every engine's TP ranks and rank 0 in a new group (its name returned); pick the
        fastest format all accept."""
        infos = await self.client.server_info()
        self._load_format = FLATTENED if all(map(accepts_flattened_bucket, infos)) else None
        tp_sizes = [engine_ranks(info, url) for info, url in zip(infos, self.client.urls)]
        address, port = learner.group_address()
        # A name of its own: torch allows one live group per name in a process, and a learner
        # may open a new group (an engine restarted) before the old one is gone everywhere.
        name = f"arbor_weight_sync_{port}"
        await asyncio.gather(
            self.client.init_weights_update_group(address, port, tp_sizes=tp_sizes, group_name=name,
                                                  backend=learner.backend),
            learner.open_group(address, port, 1 + sum(tp_sizes), name),
        )
        self.group_name, self._learner = name, learner
        return name

    async def leave_group(self, urls: list[str]) -> None:
        """Close the group on the engines at ``urls`` (those still in it: after a restart the
        restarted one is not) and on the learner's side; the next push opens a new one."""
        if self.group_name is None:
            return
        if urls:
            client = self.client.over(urls)
            await closing(client, client.destroy_weights_update_group(self.group_name))
        if self._learner is not None:
            await self._learner.close_group()
        self.group_name, self._learner = None, None

    async def close(self) -> None:
        """Destroy the group everywhere (a later push opens a new one)."""
        await self.leave_group(self.client.urls)

    async def push_directory(self, model_dir: str | Path, version: str) -> int:
        """Engines load an HF directory the learner wrote; the bytes of its weight files.
        Generation is paused around it (SGLang updates and flushes only when idle)."""
        paused = await self.client.pause_generation()
        try:
            await self.client.update_weights_from_disk(str(model_dir), weight_version=version)
            await self.client.flush_cache()
        finally:
            await self.client.continue_generation(paused)
        await self.check_version(version)
        return tensor_bytes(model_dir)

    async def push_adapter(self, adapter_dir: str | Path, version: str, keep: int = 2) -> int:
        """Engines load the LoRA adapter directory ``adapter_dir`` (peft's format) as
        ``adapter_name(version)``; the cache is flushed, the version set, all but the newest
        ``keep`` adapters unloaded (and the directories of adapters no engine holds deleted).
        Returns the bytes of the adapter's weights.

        Why a path, not SGLang's ``/load_lora_adapter_from_tensors``: that endpoint takes
        tensors pickled by SGLang's own ``MultiprocessingSerializer`` (shared-memory handles,
        same host only), which arbor's learner does not import; a path needs the engines to
        see the learner's ``run.output_dir`` (as ``learner.weight_sync: disk`` does).
        """
        name = adapter_name(version)
        await self.client.load_lora_adapter(name, str(adapter_dir))
        self.adapters.append(name)
        await self.client.flush_cache()
        await self.client.update_weight_version(version)
        while len(self.adapters) > keep:
            await self.client.unload_lora_adapter(self.adapters.pop(0))
        # Directories of adapters no engine holds (unloaded, or a previous process's) go.
        for stale in Path(adapter_dir).parent.glob(adapter_name("*")):
            if stale.name not in self.adapters:
                shutil.rmtree(stale, ignore_errors=True)
        await self.check_version(version)
        return tensor_bytes(adapter_dir)

    async def load_adapters(self, directory: str | Path, names: list[str], version: str) -> None:
        """Engines (a restarted one) load the adapters ``names`` (oldest first: the last is
        served) from ``directory``, report ``version`` and flush their cache."""
        for name in names:
            await self.client.load_lora_adapter(name, str(Path(directory) / name))
        await self.client.update_weight_version(version)
        await self.client.flush_cache()
        await self.check_version(version)

    async def check_version(self, version: str) -> None:
        versions = await self.client.get_weight_version()
        stale = [(url, v) for url, v in zip(self.client.urls, versions) if v != version]
        if stale:
            raise RuntimeError(f"weight sync to version {version!r} failed: engines report {stale}")


class EngineWeights:
    """The one owner of the weights a run's engines serve (see the module docstring)."""

    def __init__(self, cfg: Config, learners: LearnerGroup, urls: list[str]) -> None:
        self.learners, self.urls = learners, list(urls)
        self.method = "adapter" if cfg.model.lora_rank > 0 else cfg.learner.weight_sync
        self.sync_dir = Path(cfg.run.output_dir) / "weight-sync"  # disk and LoRA pushes write here
        self.keep = 2 + cfg.algorithm.max_staleness  # adapters held: requests in flight may name older ones
        self.version: str | None = None  # what every engine serves; None: model.path's weights
        self._sync = WeightSync(engine_client(cfg.engine, self.urls))
        # Held by a push, a restore, and changing()'s whole block: one at a time, from any thread.
        self._lock = threading.RLock()
        self._ahead = False  # inside changing(), before its push: the learners' weights are newer

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter the engines serve, which every request names (None: no LoRA or no push yet)."""
        return adapter_name(self.version) if self.method == "adapter" and self.version is not None else None

    @contextmanager
    def changing(self) -> Iterator[None]:
        """The learners change their weights and push them: no restore meanwhile."""
        with self._lock:
            self._ahead = True
            yield

    @contextmanager
    def held(self) -> Iterator[None]:
        """Nothing pushes meanwhile, and the learners hold the pushed weights once this
        thread holds them (a restore: :class:`~arbor.run.recovery.EngineRecovery`)."""
        with self._lock:
            yield

    def push(self, version: str) -> int:
        """The learners' weights to every engine as ``version``; the bytes sent."""
        with self._lock:
            sent = _run(self._sync.client, self._push(version))
            self.version, self._ahead = version, False
        return sent

    async def _push(self, version: str) -> int:
        if self.method == "adapter":
            directory = self.sync_dir / adapter_name(version)
            # The adapter alone: the engines have the tokenizer.
            await asyncio.to_thread(self.learners.export_hf, str(directory), tokenizer=False)
            return await self._sync.push_adapter(directory, version, keep=self.keep)
        if self.method == "disk":
            await asyncio.to_thread(self.learners.export_hf, str(self.sync_dir))
            return await self._sync.push_directory(self.sync_dir, version)
        return await self._sync.push_from(self.learners, version)

    def moved(self, url: str, new_url: str) -> None:
        """The engine at ``url`` answers at ``new_url`` now (started in a new actor): pushes go there."""
        with self._lock:
            self.urls[self.urls.index(url)] = new_url
            urls = self._sync.client.urls
            urls[urls.index(url)] = new_url

    def restore(self, url: str) -> str:
        """The restarted server at ``url`` (serving model.path's weights) gets the others';
        what it serves now, in words."""
        with self._lock:
            one = WeightSync(self._sync.client.over([url]))
            served = f"weight version {self.version}"
            if self.version is None:
                served = "model.path's weights, as the others"
            elif self.method == "adapter":
                _run(one.client, one.load_adapters(self.sync_dir, self._sync.adapters, self.version))
            elif self._ahead:
                served = "model.path's weights until the push under way"
            else:
                if self.method == "distributed":
                    self.learners.export_hf(str(self.sync_dir))
                _run(one.client, one.push_directory(self.sync_dir, self.version))
            if self.method == "distributed":  # the old group had the dead server in it
                others = [u for u in self.urls if u != url]
                _run(self._sync.client, self._sync.leave_group(others))
        return served


def behind(label: str, version: str | None) -> bool:
    """Whether weights labelled ``label`` (an engine's reply) predate the pushed ``version``.

    A run labels its pushes by step number and model.path's weights carry the server's
    ``"default"``; the engines' versions only move forward, except a restarted server's until
    its restore (or, restarted inside :meth:`EngineWeights.changing`, until the push). A label
    that is neither cannot be ordered: not behind.
    """
    if version is None:
        return False
    ours, theirs = _step_label(version), _step_label(label)
    return ours is not None and theirs is not None and theirs < ours


def _step_label(label: str) -> int | None:
    """``"12"`` -> 12, ``"default"`` (model.path's weights) -> 0, any other label -> None."""
    if label == "default":
        return 0
    return int(label) if label.isdigit() else None


def _run(client: SGLangClient, coroutine: Coroutine[Any, Any, T]) -> T:
    """A call from synchronous code on a loop of its own (its session closed after)."""
    return asyncio.run(closing(client, coroutine))


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


async def probe_samples(
    engine: RolloutEngine, prompts: list[list[int]], max_new_tokens: int = 16, temperature: float = 1.0,
    adapter: str | None = None,
) -> list[ProbeSample]:
    """Continuations of ``prompts`` sampled by the engine at ``temperature`` (from the LoRA
    ``adapter``, if any), with its logprobs.

    No top-k/top-p: the engine's logprobs are those of softmax(logits / T), the distribution
    the learner computes at the same T (:func:`arbor.train.weight_sync.logprob_gap`).
    """
    requests = [
        GenerateRequest(ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=i),
                        adapter=adapter)
        for i, ids in enumerate(prompts)
    ]
    outputs = await asyncio.gather(*(engine.generate(r) for r in requests))
    return [(list(ids), out.output_ids, out.logprobs) for ids, (out,) in zip(prompts, outputs)]


async def probe_logprob_gap(
    engine: RolloutEngine, model: Any, prompts: list[list[int]], max_new_tokens: int = 16, temperature: float = 1.0,
    adapter: str | None = None,
) -> float:
    """Mean |logp_engine − logp_learner| over probe continuations (nats per token) of a model in this process."""
    from arbor.train.weight_sync import logprob_gap

    samples = await probe_samples(engine, prompts, max_new_tokens, temperature, adapter)
    return logprob_gap(model, samples, temperature)
