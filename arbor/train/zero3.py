"""ZeRO-3 construction: a policy no rank ever holds whole, and a sharded reference model.

    ds_config = deepspeed_config(cfg.learner, cfg.optim, torch.bfloat16)   # zero_stage 3
    policy = build_partitioned(cfg.model, torch.bfloat16, ds_config)
    ref = reference_engine(cfg.model, torch.bfloat16, ds_config).module  # frozen

Without this every rank reads the whole checkpoint before DeepSpeed partitions it, so
host memory grows with ranks × model size. Here the module is built inside
``deepspeed.zero.Init`` (each parameter is split over the ranks as soon as its module
exists, with weight initialisation skipped), then each rank reads from the safetensors
files only the rows that hold its own shard of each tensor, ``READ_MB`` at a time (plain
reads, no memory map), and writes them into the shard: no collective, no whole tensor
anywhere. A rank's peak is its shard plus one read, or while the module is built, the
shards so far plus the module being built (zero.Init partitions each module when its
``__init__`` returns; a tied head is built whole, then dropped for the embedding).

Why not ``HfDeepSpeedConfig`` + ``from_pretrained``: transformers 5.23 builds under
``zero.Init`` then, but rank 0 first loads the *whole* checkpoint into one state dict
(``modeling_utils``: ``map_location="cpu" if rank == 0 else "meta"``), so rank 0 still
holds the full model, and then gathers and broadcasts every module. The construction contexts here are the ones ``from_config`` enters
under ZeRO-3 (``no_init_weights``, ``prevent_arange_dtype_change`` so RoPE buffers keep
their dtype, ``zero.Init``), minus its random initialisation of every module.

The reference model (``loss.kl_coef`` > 0) is built the same way and wrapped in a
DeepSpeed engine without an optimizer, which DeepSpeed 0.19 turns into
``DeepSpeedZeRoOffload``: its forward gathers each layer's parameters and frees them
after, as the policy's does (``learner.offload_params`` keeps the shards on the CPU).
Its forwards are collective, so every rank scores every pack (idle passes included).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from arbor.config import ModelConfig

SAFETENSORS = "model.safetensors"
# The DeepSpeed releases whose internals arbor patches or reads were tested against: Init's
# _zero_init_param and _convert_to_deepspeed_param (partition_without_broadcast), the shard
# layout of _partition_param (load_partitioned_weights) and comm.torch.build_shm_op
# (deepspeed_setup.init_distributed). pyproject.toml pins the same range.
TESTED_DEEPSPEED = (">=0.19.8", "<0.20")
SAFETENSORS_INDEX = "model.safetensors.index.json"
READ_MB = 64  # the most one read from a checkpoint file holds (sharded loading's transient)
# safetensors dtype codes (the format's header) -> torch dtypes
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsReader:
    """Rows of the tensors of one ``.safetensors`` file, read with plain file reads.

    Not memory-mapped: mapped pages a rank has read count in its resident memory until
    the file is closed (half the checkpoint per rank by the end of a load), while pages
    read through ``readinto`` stay in the page cache, outside the process. The format: an
    8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape",
    "data_offsets": [begin, end]}}``, then the data (offsets relative to its start).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        self.entries: dict[str, dict[str, Any]] = header
        self.data_start = 8 + length

    def shape(self, name: str) -> list[int]:
        return list(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self.entries[name]["dtype"]
        if code not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has dtype {code}, which sharded loading does not read")
        return _DTYPES[code]

    def read_rows(self, name: str, top: int, bottom: int) -> torch.Tensor:
        """Rows ``[top, bottom)`` of the leading dimension, flat: ``[(bottom - top) · row]``."""
        shape, dtype = self.shape(name), self.dtype(name)
        row = math.prod(shape[1:]) if shape else 1
        begin = self.entries[name]["data_offsets"][0]
        out = torch.empty((bottom - top) * row, dtype=dtype)
        raw = out.view(torch.uint8).numpy()
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin + top * row * out.element_size())
            if f.readinto(raw.data) != raw.nbytes:
                raise ValueError(f"{self.path}: tensor {name} is cut short (truncated file?)")
        return out


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for an HF model directory."""
    path = Path(path)
    if (path / SAFETENSORS_INDEX).exists():
        weight_map = json.loads((path / SAFETENSORS_INDEX).read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    if (path / SAFETENSORS).exists():
        return dict.fromkeys(SafetensorsReader(path / SAFETENSORS).entries, path / SAFETENSORS)
    raise FileNotFoundError(
        f"model.path {path}: no {SAFETENSORS} or {SAFETENSORS_INDEX}; sharded loading under "
        "learner.zero_stage 3 reads safetensors (re-save the model with save_pretrained)"
    )


def build_partitioned(
    model_cfg: ModelConfig, dtype: torch.dtype, ds_config: dict[str, Any], path: str | None = None,
    read_mb: float = READ_MB,
) -> PreTrainedModel:
    """The model at ``path`` (default ``model.path``), partitioned over the ranks as it is built.

    Collective: every rank of the default process group calls it. Parameters come out
    as ZeRO-3 placeholders (``param.ds_numel`` elements, ``param.ds_tensor`` this rank's
    share); buffers are whole on every rank.
    """
    import deepspeed
    from transformers.initialization import no_init_weights
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    path = path or model_cfg.path
    config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    # prevent_arange_dtype_change must be entered before zero.Init (transformers' rule).
    with (no_init_weights(), prevent_arange_dtype_change(), partition_without_broadcast(),
          deepspeed.zero.Init(config_dict_or_path=ds_config)):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=model_cfg.trust_remote_code, attn_implementation="sdpa",
        )
    model.tie_weights()  # skipped with the weight init; ties the partitioned parameters
    load_partitioned_weights(model, path, read_mb)
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def check_deepspeed_version(version: str, needed_for: str) -> None:
    """Raise where ``version`` is outside :data:`TESTED_DEEPSPEED`: a renamed or re-laid-out
    internal could fail silently (a patch never called, a shard read at the wrong offset).

        check_deepspeed_version("0.19.8", "x")   # fine
        check_deepspeed_version("0.20.0", "x")   # RuntimeError naming 0.20.0
    """
    from packaging.specifiers import SpecifierSet

    tested = SpecifierSet(",".join(TESTED_DEEPSPEED))
    if version not in tested:
        raise RuntimeError(
            f"deepspeed {version} is untested with arbor's {needed_for}, which relies on DeepSpeed internals "
            f"checked against deepspeed{tested}: install that (pip install 'deepspeed{tested}') "
            "or use learner.backend: torch"
        )


def require_tested_deepspeed(needed_for: str) -> None:
    """:func:`check_deepspeed_version` of the installed DeepSpeed."""
    import deepspeed

    check_deepspeed_version(deepspeed.__version__, needed_for)


@contextmanager
def partition_without_broadcast() -> Iterator[None]:
    """``zero.Init`` partitions each new parameter without first broadcasting it from rank 0.

    DeepSpeed 0.19.8 (``partition_parameters.Init._zero_init_param``) broadcasts every
    parameter before splitting it, so that ranks agree on a random initialisation. Here
    every parameter is then read from the checkpoint (``load_partitioned_weights`` refuses
    a missing one), so the broadcast only costs time and, on the receiving ranks, memory.
    """
    require_tested_deepspeed("ZeRO-3 construction (partition_parameters.Init._zero_init_param)")
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._zero_init_param

    def partition_only(self: Init, param: Any) -> None:  # a DeepSpeed parameter (partition, ds_*)
        self._convert_to_deepspeed_param(param)
        param.partition()

    Init._zero_init_param = partition_only
    try:
        yield
    finally:
        Init._zero_init_param = original


def load_partitioned_weights(model: PreTrainedModel, path: str | Path, read_mb: float = READ_MB) -> None:
    """Copy the checkpoint at ``path`` into this rank's shards of the partitioned ``model``.

    No collective and no whole tensor: a ZeRO-3 parameter of n elements is split into
    ``ds_tensor`` shards of ceil(n / world) elements, rank r holding elements
    [r·size, (r+1)·size) of the flattened tensor (DeepSpeed 0.19's ``_partition_param``;
    the last shard's padding is never read). Each rank reads just the rows of each
    checkpoint tensor that cover its range, at most ``read_mb`` at a time, cast to the
    parameter's dtype as ``from_pretrained`` casts. Every parameter must be in the
    checkpoint (an error names the first missing one); checkpoint tensors the model has no
    parameter for (a tied head's copy) are skipped, as ``from_pretrained`` skips them.
    """
    require_tested_deepspeed("sharded checkpoint loading (the ds_tensor shard layout)")
    files = checkpoint_files(path)
    missing = [name for name, _ in model.named_parameters() if name not in files]
    if missing:
        raise KeyError(f"model.path {path}: the checkpoint has no tensor {missing[0]!r} "
                       f"({len(missing)} parameters missing) for {type(model).__name__}")
    readers = {file: SafetensorsReader(file) for file in set(files.values())}
    limit = max(1, int(read_mb * 2**20))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            param: Any = parameter  # ZeRO-3 gave it ds_tensor, ds_process_group, ds_numel
            reader = readers[files[name]]
            shard = param.ds_tensor  # [ceil(n / world)] this rank's flat share
            first = torch.distributed.get_rank(group=param.ds_process_group) * shard.numel()
            last = min(first + shard.numel(), param.ds_numel)
            copy_flat_range(reader, name, first, last, shard, limit)
        for name, buffer in model.named_buffers():
            if name in files:  # persistent buffers: whole on every rank (small)
                reader = readers[files[name]]
                rows = reader.shape(name)[0] if reader.shape(name) else 1
                buffer.copy_(reader.read_rows(name, 0, rows).reshape(buffer.shape))


def copy_flat_range(
    reader: SafetensorsReader, name: str, first: int, last: int, out: torch.Tensor, limit_bytes: int
) -> None:
    """``out[: last - first] = flatten(tensor)[first:last]``, reading whole rows of ``name``,
    at most ~``limit_bytes`` of them at a time."""
    shape = reader.shape(name)
    row = math.prod(shape[1:]) if shape else 1  # elements per leading-dimension row
    rows_per_read = max(1, limit_bytes // max(1, row * reader.dtype(name).itemsize))
    done = first
    while done < last:
        top = done // row
        bottom = min(top + rows_per_read, -(-last // row))
        chunk = reader.read_rows(name, top, bottom)  # flat elements [top·row, bottom·row)
        take = min(last, bottom * row) - done
        offset = done - top * row
        out[done - first : done - first + take].copy_(chunk[offset : offset + take])
        done += take


def reference_engine(model_cfg: ModelConfig, dtype: torch.dtype, ds_config: dict[str, Any]) -> Any:
    """The frozen reference model (``model.ref_path``, else ``model.path``), ZeRO-3 sharded.

    Returns the DeepSpeed engine; call its ``module`` as a plain model: the ZeRO-3 hooks
    gather each layer for the forward (collective: every rank calls it equally often).
    """
    import deepspeed

    ref_config = {
        key: ds_config[key] for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16")
    }
    zero = {"stage": 3}
    if "offload_param" in ds_config["zero_optimization"]:
        zero["offload_param"] = ds_config["zero_optimization"]["offload_param"]
    ref_config.update(zero_optimization=zero, steps_per_print=1 << 30, wall_clock_breakdown=False)
    path = model_cfg.ref_path or model_cfg.path
    model = build_partitioned(model_cfg, dtype, ref_config, path)
    model.requires_grad_(False)
    model.gradient_checkpointing_disable()  # no backward through the reference
    engine, *_ = deepspeed.initialize(model=model, config=ref_config)  # no optimizer: ZeRO-3 inference
    engine.module.eval()
    return engine
