"""Learner -> engine weight transfer over a torch.distributed group, built as SGLang builds it.

The learner is rank 0 and broadcasts; every tensor-parallel rank of every engine is a rank
of its own (:func:`~arbor.engines.wire.rank_layout`). Both ends make the group exactly as SGLang 0.5's
``init_custom_process_group`` does (behind ``/init_weights_update_group``): a TCP
rendezvous at ``master_address:master_port``, ``PrefixStore(group_name, store)``, then
torch's ``_new_process_group_helper`` with the announced backend (NCCL when the tensors
are on a GPU, gloo on CPU). The group is standalone: it never touches the learner's
default process group (DeepSpeed's) or the server's.

Two receive formats, as in SGLang's ``receive_weights_from_distributed``:
- per tensor (``load_format`` absent): one broadcast per announced tensor, in name order;
- ``load_format: "flattened_bucket"`` (SGLang >= 0.5.6): one broadcast of a ``uint8``
  buffer holding the tensors' bytes back to back in announced order (SGLang's
  ``FlattenedTensorBucket``); each tensor must start at a multiple of its item size.

The learner's end (rank 0, which broadcasts) is :class:`arbor.train.weight_sync.BucketSender`;
the engine's end, :class:`WeightUpdateGroup`; the requests that tell the engines to join and
receive, :mod:`arbor.run.weight_sync`.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

from arbor.engines.interfaces import bind_collectives_towards

DEFAULT_GROUP = "weight_update_group"
FLATTENED = "flattened_bucket"  # SGLang's load_format for one broadcast per bucket


def open_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> Any:
    """Join the group as SGLang's ``init_custom_process_group`` does; blocks until all joined.

    Any other construction (a plain ``ProcessGroupGloo``, another store prefix) waits on
    store keys SGLang never writes, and both ends time out.
    """
    # The others dial this process at its interface towards the master (unless a node
    # address was bound already, or the user set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME).
    bind_collectives_towards(master_address)
    timeout = datetime.timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    store, _, _ = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,  # type: ignore[arg-type]  # torch types it GroupName, a str NewType
        backend_options=None,
        timeout=timeout,
        device_id=None,
    )
    # What SGLang sets too: collectives on this group map ranks to themselves.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def close_group(group: Any) -> None:
    """Destroy ``group`` (frees its name: torch refuses two live groups of one name)."""
    dist.destroy_process_group(group)


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    # SGLang resolves dtypes with getattr(torch, name): send "bfloat16", not "torch.bfloat16".
    return str(dtype).removeprefix("torch.")


def flat_chunks(
    named_tensors: list[tuple[str, torch.Tensor]],
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Split a bucket where a tensor would start off its item-size alignment in the flat
    buffer (SGLang 0.5.23 refuses those); a bucket of one dtype is never split."""
    chunk: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for name, tensor in named_tensors:
        if chunk and offset % tensor.element_size():
            yield chunk
            chunk, offset = [], 0
        chunk.append((name, tensor))
        offset += tensor.numel() * tensor.element_size()
    if chunk:
        yield chunk


def flatten(named_tensors: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors' bytes back to back, ``uint8 [Σ nbytes]`` (SGLang's FlattenedTensorBucket),
    written into ``out`` when given (exactly that many bytes)."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in named_tensors]
    return torch.cat(parts, out=out) if out is not None else torch.cat(parts)


class FlatBuffer:
    """One ``uint8`` buffer reused for every flat bucket on CPU.

    Fresh memory is page-faulted in on first touch, on every allocation of this size: on
    the 2-core dev VM filling a new 512 MB buffer took ~2 s, refilling a used one ~0.1 s.
    CUDA tensors get a fresh buffer (the caching allocator already reuses its blocks, and
    a buffer kept for good would hold GPU memory through training).
    """

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A ``uint8 [nbytes]`` view to write into (contents undefined)."""
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        if self.data is None or self.data.numel() < nbytes:
            self.data = torch.empty(nbytes, dtype=torch.uint8)
        return self.data[:nbytes]


def unflatten(
    flat: torch.Tensor, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]
) -> dict[str, torch.Tensor]:
    """Views into ``flat`` (``uint8 [Σ nbytes]``) with the announced dtypes and shapes."""
    out, offset = {}, 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        size = torch.Size(shape).numel() * dtype.itemsize
        if offset % dtype.itemsize:
            raise ValueError(f"tensor {name} starts at byte {offset}, not a multiple of {dtype}'s size")
        out[name] = flat[offset : offset + size].view(dtype).reshape(shape)
        offset += size
    if offset != flat.numel():
        raise ValueError(f"announced {offset} bytes, the buffer holds {flat.numel()}")
    return out


def flat_size(dtypes: list[torch.dtype], shapes: list[list[int]]) -> int:
    return sum(torch.Size(shape).numel() * dtype.itemsize for dtype, shape in zip(dtypes, shapes))


class WeightUpdateGroup:
    """The engine (server) end: join the learner's group, then receive broadcasts."""

    def __init__(self) -> None:
        self.group: Any = None
        self.group_name: str | None = None
        self.buffer = FlatBuffer()  # flat buckets land here; the caller copies them out
        self.device = torch.device("cpu")  # where broadcasts land: the GPU under NCCL

    def init_from_request(self, body: dict[str, Any]) -> str:
        """Handle ``/init_weights_update_group`` (blocks until the learner joins)."""
        backend = body.get("backend", "nccl")  # SGLang's default
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA; this engine runs on CPU: use 'gloo'")
        address, port = body.get("master_address"), body.get("master_port")
        offset, world = body.get("rank_offset"), body.get("world_size")
        if not isinstance(address, str) or not isinstance(port, int):
            raise ValueError("master_address (str) and master_port (int) are required")
        if not isinstance(offset, int) or not isinstance(world, int) or not 0 < offset < world:
            raise ValueError(f"need 0 < rank_offset < world_size, got {offset} and {world}")
        if self.group is not None:
            raise ValueError(f"a weight update group ({self.group_name}) is already open")
        name = body.get("group_name", DEFAULT_GROUP)
        if not isinstance(name, str) or not name:
            raise ValueError("group_name must be a non-empty string")
        self.group = open_group(address, port, offset, world, name, backend)
        self.group_name = name
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        return f"joined {name} as rank {offset} of {world}"

    def receive(self, body: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Handle ``/update_weights_from_distributed``: the announced tensors, received
        (a flat bucket's are views into a buffer the next flat bucket overwrites)."""
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise ValueError("names, dtypes and shapes must be lists")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
        load_format = body.get("load_format")
        if load_format not in (None, FLATTENED):
            raise ValueError(f"load_format must be absent or {FLATTENED!r}, got {load_format!r}")
        if self.group is None:
            raise ValueError("no weight update group: call /init_weights_update_group first")
        name = body.get("group_name", DEFAULT_GROUP)
        if name != self.group_name:
            raise ValueError(f"unknown group {name!r} (open: {self.group_name!r})")
        torch_dtypes = [parse_dtype(d) for d in dtypes]
        if not all(isinstance(shape, list) and all(isinstance(s, int) for s in shape) for shape in shapes):
            raise ValueError(f"shapes must be lists of integers, got {shapes!r}")
        if load_format == FLATTENED:
            flat = self.buffer.take(flat_size(torch_dtypes, shapes), self.device)
            dist.broadcast(flat, src=0, group=self.group)
            return unflatten(flat, names, torch_dtypes, shapes)
        received = {}
        for tensor_name, dtype, shape in zip(names, torch_dtypes, shapes):
            received[tensor_name] = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(received[tensor_name], src=0, group=self.group)
        return received

    def destroy(self) -> None:
        if self.group is not None:
            close_group(self.group)
        self.group, self.group_name = None, None
