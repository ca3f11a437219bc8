"""The weight-update group against SGLang's own code: rank layout, flat buckets, a real push.

The end-to-end tests run SGLang 0.5's receiving code (``init_custom_process_group``,
``FlattenedTensorBucket``) in ``tests/sglang_receiver.py`` processes, one per TP rank, and
push to them with arbor's public ``WeightSync``. The receivers run in SGLang's own venv
(``$ARBOR_SGLANG_PYTHON``, tests/sglang_env.py; its torch 2.14.1 receives from this
process's torch over gloo); without it they skip, and under CI they fail.
"""

from __future__ import annotations

import asyncio
import functools
import subprocess
from pathlib import Path

import pytest
import torch
from sglang_env import sglang_python

from arbor.engines.client import SGLangClient
from arbor.engines.distributed import FlatBuffer, flat_chunks, flatten, unflatten
from arbor.engines.ports import free_port
from arbor.engines.wire import rank_layout
from arbor.run.weight_sync import WeightSync, accepts_flattened_bucket, engine_ranks
from arbor.train.weight_sync import named_tensor_buckets

RECEIVER = Path(__file__).with_name("sglang_receiver.py")


@functools.cache
def _importable(python: str) -> str:
    probe = (
        "from sglang.srt.utils.common import init_custom_process_group\n"
        "from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket"
    )
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{python} cannot import SGLang's group code: {done.stderr[-2000:]}"
    return python


def sglang_group_python() -> str:
    """The interpreter that runs SGLang's group code (in a subprocess: importing sglang
    patches transformers, which other tests in this process must not see)."""
    return _importable(sglang_python())


def test_rank_layout_gives_every_tp_rank_its_own_rank():
    # learner 0; engine 0 (tp 2) ranks 1-2; engine 1 (tp 1) rank 3; engine 2 (tp 4) ranks 4-7
    assert rank_layout([2, 1, 4]) == (8, [1, 3, 4])
    assert rank_layout([1, 1]) == (3, [1, 2])
    with pytest.raises(ValueError, match="tp_size"):
        rank_layout([1, 0])


def test_server_info_decides_format_and_ranks():
    assert accepts_flattened_bucket({"version": "0.5.23"})
    assert accepts_flattened_bucket({"version": "0.5.10.post1"})
    assert not accepts_flattened_bucket({"version": "0.5.5.post3"})  # per-tensor receive only
    assert not accepts_flattened_bucket({})
    assert accepts_flattened_bucket({"engine": "arbor"})
    assert engine_ranks({"tp_size": 4}, "u") == 4
    with pytest.raises(ValueError, match="dp_size=2"):
        engine_ranks({"tp_size": 1, "dp_size": 2}, "http://e0")


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=gen).to(torch.bfloat16)),  # 30 bytes
        ("b.weight", torch.randn(4, generator=gen)),  # float32 at byte 30: unaligned
        ("c.bias", torch.randn(2, 2, generator=gen).to(torch.float16)),
        ("d.count", torch.arange(3, dtype=torch.int64)),
    ]


def test_flat_chunks_split_only_where_alignment_breaks():
    chunks = list(flat_chunks(mixed_tensors()))
    assert [[name for name, _ in c] for c in chunks] == [["a.weight"], ["b.weight", "c.bias", "d.count"]]
    same_dtype = [(f"t{i}", torch.zeros(3, dtype=torch.bfloat16)) for i in range(4)]
    assert len(list(flat_chunks(same_dtype))) == 1


def test_flatten_round_trip_is_bit_exact():
    for chunk in flat_chunks(mixed_tensors()):
        flat = flatten(chunk)
        assert flat.dtype == torch.uint8 and flat.numel() == sum(t.nbytes for _, t in chunk)
        back = unflatten(flat, [n for n, _ in chunk], [t.dtype for _, t in chunk], [list(t.shape) for _, t in chunk])
        for name, tensor in chunk:
            assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    with pytest.raises(ValueError, match="announced 8 bytes"):
        unflatten(torch.zeros(9, dtype=torch.uint8), ["x"], [torch.float32], [[2]])


def test_flat_buffer_is_reused_and_grows():
    buffer, cpu = FlatBuffer(), torch.device("cpu")
    first = buffer.take(100, cpu)
    assert buffer.take(60, cpu).data_ptr() == first.data_ptr()  # no new memory
    assert buffer.take(200, cpu).numel() == 200
    chunk = list(flat_chunks(mixed_tensors()))[1]
    into = flatten(chunk, buffer.take(sum(t.nbytes for _, t in chunk), cpu))
    assert into.data_ptr() == buffer.data.data_ptr() and torch.equal(into, flatten(chunk))


def test_flat_layout_is_sglangs(tmp_path):
    """SGLang's FlattenedTensorBucket lays the same tensors out byte for byte as flatten()."""
    python = sglang_group_python()
    chunk = list(flat_chunks(mixed_tensors()))[1]
    code = (
        "import sys, torch\n"
        "from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket\n"
        "chunk = torch.load(sys.argv[1])\n"
        "torch.save(FlattenedTensorBucket(named_tensors=chunk).get_flattened_tensor(), sys.argv[1])\n"
    )
    path = tmp_path / "chunk.pt"
    torch.save(chunk, path)
    done = subprocess.run([python, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert torch.equal(torch.load(path), flatten(chunk))


def start_receivers(tp_sizes: list[int], version: str | None) -> tuple[list[subprocess.Popen], list[str]]:
    python = sglang_group_python()
    processes, urls = [], []
    for tp_size in tp_sizes:
        port = free_port()
        command = [python, str(RECEIVER), "--port", str(port), "--tp-size", str(tp_size)]
        if version is not None:
            command += ["--version", version]
        processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        urls.append(f"http://127.0.0.1:{port}")
    return processes, urls


@pytest.mark.parametrize(("version", "load_format"), [(None, "flattened_bucket"), ("0.5.2", None)])
def test_weight_sync_into_sglangs_own_group_code(tmp_path, version, load_format):
    """Two engines (TP 2 and TP 1: ranks 1-2 and 3 of 4) receive with SGLang's code, bit-exact.

    ``version`` None: the installed SGLang's (flat buckets, sessions); "0.5.2": an older
    server that receives per tensor and has no session routes (404: pushed without).
    """
    named = mixed_tensors() + [(f"layer{i}.weight", torch.randn(64, 32).to(torch.bfloat16)) for i in range(6)]
    processes, urls = start_receivers([2, 1], version)

    async def main() -> tuple[str | None, list[str]]:
        async with SGLangClient(urls, timeout_s=120) as client:
            await client.wait_healthy(timeout_s=120)
            sync = WeightSync(client, master_address="127.0.0.1")
            await sync.push(named_tensor_buckets(iter(named), bucket_mb=0.01), "7")
            # A second push runs in a new session over the same group.
            await sync.push(named_tensor_buckets(iter(named), bucket_mb=1), "8")
            for i, url in enumerate(urls):
                await client._call(url, "POST", "/dump", {"path": str(tmp_path / f"engine{i}")})
            versions = await client.get_weight_version()
            await sync.close()
            return sync._load_format, versions

    try:
        for i in range(len(urls)):
            (tmp_path / f"engine{i}").mkdir()
        used_format, versions = asyncio.run(main())
    finally:
        for process in processes:
            process.terminate()
        errors = [p.communicate(timeout=30)[1] for p in processes]
    assert used_format == load_format, errors
    assert versions == ["8", "8"]
    dumps = [tmp_path / "engine0" / "tp0.pt", tmp_path / "engine0" / "tp1.pt", tmp_path / "engine1" / "tp0.pt"]
    for dump in dumps:  # every TP rank got every tensor, bit for bit
        received = torch.load(dump)
        assert list(received) == [name for name, _ in named]
        for name, tensor in named:
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), (dump, name)
