"""Learner -> engine weight transfer over a torch.distributed group (gloo on CPU).

The learner is rank 0 and broadcasts each tensor; every engine is a rank
``rank_offset + i``. Both ends build the group the same way — TCP rendezvous at
``master_address:master_port``, a store prefixed with ``group_name``, a standalone gloo
process group — so it never touches (or needs) the default process group of the learner
(which DeepSpeed owns) or of the server.

Learner side, with an :class:`~arbor.engines.client.SGLangClient` over the engines (works
against SGLang too: same endpoints, same group set-up)::

    group = await connect_learner(client, "10.0.0.1", port, world_size=1 + len(client.urls))
    await send_weights(client, group, list(model.state_dict().items()), weight_version="7")
"""

from __future__ import annotations

import asyncio
import datetime
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from arbor.engines.client import SGLangClient

DEFAULT_GROUP = "weight_update_group"


def open_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP,
    timeout_s: float = 120.0,
) -> Any:
    """A standalone gloo process group (blocks until all ``world_size`` ranks joined)."""
    url = f"tcp://{master_address}:{master_port}"
    store, _, _ = next(
        dist.rendezvous(url, rank, world_size, timeout=datetime.timedelta(seconds=timeout_s))
    )
    prefixed = dist.PrefixStore(group_name, store)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, datetime.timedelta(seconds=timeout_s))


def broadcast(group: Any, tensor: torch.Tensor, src: int = 0) -> None:
    """In-place broadcast of ``tensor`` from rank ``src`` over ``group``."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class WeightUpdateGroup:
    """The engine (server) end: join the learner's group, then receive broadcasts."""

    def __init__(self) -> None:
        self.group: Any = None
        self.group_name: str | None = None

    def init_from_request(self, body: dict[str, Any]) -> str:
        """Handle ``/init_weights_update_group`` (blocks until the learner joins)."""
        backend = body.get("backend", "gloo")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA; this engine runs on CPU: use 'gloo'")
        address, port = body.get("master_address"), body.get("master_port")
        offset, world = body.get("rank_offset", 1), body.get("world_size")
        if not isinstance(address, str) or not isinstance(port, int):
            raise ValueError("master_address (str) and master_port (int) are required")
        if not isinstance(offset, int) or not isinstance(world, int) or not 0 < offset < world:
            raise ValueError(f"need 0 < rank_offset < world_size, got {offset} and {world}")
        if self.group is not None:
            raise ValueError(f"a weight update group ({self.group_name}) is already open")
        name = body.get("group_name", DEFAULT_GROUP)
        self.group = open_group(address, port, offset, world, name)
        self.group_name = name
        return f"joined {name} as rank {offset} of {world}"

    def receive(self, body: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Handle ``/update_weights_from_distributed``: one broadcast per named tensor."""
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise ValueError("names, dtypes and shapes must be lists")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
        if self.group is None:
            raise ValueError("no weight update group: call /init_weights_update_group first")
        name = body.get("group_name", self.group_name)
        if name != self.group_name:
            raise ValueError(f"unknown group {name!r} (open: {self.group_name!r})")
        received = {}
        for tensor_name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty([int(s) for s in shape], dtype=parse_dtype(dtype))
            broadcast(self.group, tensor)
            received[tensor_name] = tensor
        return received

    def destroy(self) -> None:
        self.group, self.group_name = None, None


async def connect_learner(
    client: SGLangClient,
    master_address: str,
    master_port: int,
    world_size: int,
    *,
    group_name: str = DEFAULT_GROUP,
    backend: str = "gloo",
) -> Any:
    """Open the group as rank 0 while the servers join it (both sides block until all meet)."""
    _, group = await asyncio.gather(
        client.init_weights_update_group(
            master_address, master_port, world_size, group_name=group_name, backend=backend
        ),
        asyncio.to_thread(open_group, master_address, master_port, 0, world_size, group_name),
    )
    return group


async def send_weights(
    client: SGLangClient,
    group: Any,
    named_tensors: list[tuple[str, torch.Tensor]],
    *,
    group_name: str = DEFAULT_GROUP,
    flush_cache: bool = True,
    weight_version: str | None = None,
) -> None:
    """Broadcast ``named_tensors`` to every server: one POST announcing names, dtypes and
    shapes, and (concurrently) one broadcast per tensor in that order."""
    names = [name for name, _ in named_tensors]
    # SGLang resolves dtypes with getattr(torch, name): send "bfloat16", not "torch.bfloat16".
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named_tensors]
    shapes = [list(t.shape) for _, t in named_tensors]

    def broadcast_all() -> None:
        for _, tensor in named_tensors:
            broadcast(group, tensor.detach().contiguous())

    await asyncio.gather(
        client.update_weights_from_distributed(
            names,
            dtypes,
            shapes,
            group_name=group_name,
            flush_cache=flush_cache,
            weight_version=weight_version,
        ),
        asyncio.to_thread(broadcast_all),
    )
