"""Weight sync speed: learner -> `arbor serve`, per tensor vs flat buckets vs disk, vs raw gloo.

    python scripts/bench_weight_sync.py [--bucket-mb 512] [--repeats 1] [--tiny]

This process is the learner: it builds a Qwen2.5-0.5B-shaped model (24 layers, hidden
896, 14 query / 2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings: 494M
parameters, ~0.99 GB) with random bfloat16 weights, saves it, starts ``arbor serve
--dtype bfloat16`` on it through the launcher, and times, on the same bytes:

- **per tensor**: ``WeightSync(..., flatten=False).push``: one broadcast per tensor (what
  SGLang < 0.5.6 receives);
- **bucketed**: ``WeightSync(...).push``: one flat broadcast per ``--bucket-mb`` bucket
  (``load_format: "flattened_bucket"``);
- **disk**: ``save_pretrained`` into a directory + ``/update_weights_from_disk``;
- **raw**: gloo broadcasts of buffers of the bucketed push's sizes to a bare receiver
  process (a group built the same way, nothing else): the ceiling for the bucketed push.

Each distributed push includes the session calls, the HTTP round trips, the server's copy
into its parameters and the cache flush; one untimed bucketed push first opens the group
and touches the flat buffers both ends reuse (a training run pushes every step). Fresh
memory is slow here (page faults: ~2 s to fill a new 512 MB buffer on the 2-core dev VM),
so the raw receiver, too, receives into one buffer touched beforehand.
Ends with ``RESULT gb=<GB pushed> sync_s_per_tensor=... sync_s_bucketed=... sync_s_disk=...
raw_gbps=<GB/s> bucketed_gbps=<GB/s>`` (best of ``--repeats``). On a 2-core machine the
learner, the server and the receiver share the cores: run it on a quiet machine, note
``uptime``. ``--tiny``: a 2-layer toy model, to check that the script runs.

    python scripts/bench_weight_sync.py --lora [--lora-rank 8] [--shapes smollm2-135m qwen2.5-0.5b]

``--lora``: full vs adapter sync instead, for each shape (SmolLM2-135M: Llama, 30 layers,
hidden 576, vocabulary 49,152, tied; Qwen2.5-0.5B as above), bfloat16: the bucketed full
push, and a LoRA run's push (the adapter of rank ``--lora-rank`` on every attention and MLP
linear, written in peft's format and loaded by the server, which merges it). One line per
shape: ``RESULT_LORA shape=... full_bytes=... adapter_bytes=... full_s=... adapter_s=...``
(bytes are exact anywhere; seconds need a quiet machine).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from arbor.engines.client import SGLangClient  # noqa: E402
from arbor.engines.distributed import close_group, open_group  # noqa: E402
from arbor.engines.launch import launch_engines  # noqa: E402
from arbor.engines.ports import free_port  # noqa: E402
from arbor.run.weight_sync import WeightSync  # noqa: E402
from arbor.train.weight_sync import named_tensor_buckets  # noqa: E402

QWEN25_05B = dict(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
)
TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=512,
)
SMOLLM2_135M = dict(
    model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
)
SHAPES = {"qwen2.5-0.5b": QWEN25_05B, "smollm2-135m": SMOLLM2_135M, "tiny": TINY}  # model_type default: qwen2

# The raw receiver: joins the group as rank 1 and receives buffers of the given sizes into
# one buffer touched beforehand (pure transfer: no page faults, no copies).
RAW_RECEIVER = """
import sys, torch, torch.distributed as dist
from arbor.engines.distributed import open_group
port, sizes = int(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
buffer = torch.ones(max(sizes), dtype=torch.uint8)
group = open_group("127.0.0.1", port, 1, 2, "raw_bench")
for _ in range(int(sys.argv[3])):
    for size in sizes:
        dist.broadcast(buffer[:size], src=0, group=group)
print("received", flush=True)
"""


def build_model(config_kwargs: dict, path: Path, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A random model of ``config_kwargs`` (Qwen2 unless ``model_type`` says otherwise), saved
    to ``path`` for the server to load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    kwargs = dict(config_kwargs)
    config = AutoConfig.for_model(kwargs.pop("model_type", "qwen2"), **kwargs, dtype=dtype)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(path)
    return model


async def time_lora(url: str, model: torch.nn.Module, sync_dir: Path, rank: int, bucket_mb: float,
                    repeats: int) -> dict[str, float]:
    """Bytes and best seconds of a full bucketed push and of a LoRA adapter push."""
    from arbor.config_load import load_config
    from arbor.run.weight_sync import adapter_name
    from arbor.train.lora import adapter_state, add_adapter, save_adapter

    named = [(name, param.detach()) for name, param in model.named_parameters()]
    cfg = load_config(None, ["model.path=bench", f"model.lora_rank={rank}"]).model
    adapted = add_adapter(model, cfg)
    with torch.no_grad():  # a trained adapter: B away from its zero start
        for param in adapted.parameters():
            if param.requires_grad:
                param.normal_(0, 0.01)
    out = {"full_s": float("inf"), "adapter_s": float("inf")}
    async with SGLangClient([url], timeout_s=3600) as client:
        sync = WeightSync(client, master_address="127.0.0.1")
        out["full_bytes"] = await sync.push(named_tensor_buckets(iter(named), bucket_mb), "warm-up")
        for repeat in range(repeats):
            start = time.perf_counter()
            await sync.push(named_tensor_buckets(iter(named), bucket_mb), f"full-{repeat}")
            out["full_s"] = min(out["full_s"], time.perf_counter() - start)
            version = f"lora-{repeat}"
            start = time.perf_counter()  # what a LoRA run's push does: write the adapter, then load it
            whole = {name: p.detach() for name, p in adapted.named_parameters() if p.requires_grad}
            save_adapter(adapted, sync_dir / adapter_name(version), adapter_state(adapted, whole))
            out["adapter_bytes"] = await sync.push_adapter(sync_dir / adapter_name(version), version)
            out["adapter_s"] = min(out["adapter_s"], time.perf_counter() - start)
            print(f"repeat {repeat}: full {out['full_s']:.2f} s, adapter {out['adapter_s']:.2f} s", flush=True)
    return out


def bench_lora(args: argparse.Namespace) -> None:
    for shape in ["tiny"] if args.tiny else args.shapes:
        with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
            model = build_model(SHAPES[shape], Path(tmp) / "model")
            with launch_engines("embedded", model_path=str(Path(tmp) / "model"), dtype="bfloat16",
                                log_dir=Path(tmp) / "logs", startup_timeout_s=600) as handle:
                out = asyncio.run(time_lora(handle.urls[0], model, Path(tmp) / "sync", args.lora_rank,
                                            args.bucket_mb, args.repeats))
        print(f"RESULT_LORA shape={shape} full_bytes={out['full_bytes']} adapter_bytes={out['adapter_bytes']} "
              f"full_s={out['full_s']:.3f} adapter_s={out['adapter_s']:.3f}", flush=True)


def bucket_sizes(named: list[tuple[str, torch.Tensor]], bucket_mb: float) -> list[int]:
    """Bytes of each bucket the bucketed push broadcasts."""
    return [sum(t.nbytes for _, t in bucket) for bucket in named_tensor_buckets(iter(named), bucket_mb)]


def time_raw(sizes: list[int], repeats: int) -> float:
    """Best seconds to broadcast buffers of ``sizes`` bytes to a bare receiver process."""
    port = free_port()
    receiver = subprocess.Popen(
        [sys.executable, "-c", RAW_RECEIVER, str(port), ",".join(map(str, sizes)), str(repeats)],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )
    group = open_group("127.0.0.1", port, 0, 2, "raw_bench")
    buffers = [torch.randint(0, 255, (size,), dtype=torch.uint8) for size in sizes]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for buffer in buffers:
            torch.distributed.broadcast(buffer, src=0, group=group)
        best = min(best, time.perf_counter() - start)
    assert "received" in receiver.communicate(timeout=600)[0]
    close_group(group)
    return best


async def time_pushes(
    url: str, model: torch.nn.Module, export_dir: Path, bucket_mb: float, repeats: int
) -> dict[str, float]:
    """Best seconds of each transport over ``repeats`` pushes."""
    named = [(name, param.detach()) for name, param in model.named_parameters()]
    best = {"per_tensor": float("inf"), "bucketed": float("inf"), "disk": float("inf")}
    async with SGLangClient([url], timeout_s=3600) as client:
        sync = WeightSync(client, master_address="127.0.0.1")
        # Not timed: opens the group and touches the reused flat buffers of both ends once
        # (the steady state of a training run, which pushes every step).
        await sync.push(named_tensor_buckets(iter(named), bucket_mb), "warm-up")
        for repeat in range(repeats):
            for mode in ("per_tensor", "bucketed"):
                sync.flatten = mode == "bucketed"
                start = time.perf_counter()
                await sync.push(named_tensor_buckets(iter(named), bucket_mb), f"{mode}-{repeat}")
                best[mode] = min(best[mode], time.perf_counter() - start)
                print(f"{mode}: {time.perf_counter() - start:.2f} s", flush=True)
            start = time.perf_counter()
            model.save_pretrained(export_dir)
            await sync.push_directory(export_dir, f"disk-{repeat}")
            best["disk"] = min(best["disk"], time.perf_counter() - start)
            print(f"disk: {time.perf_counter() - start:.2f} s", flush=True)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", type=float, default=512.0, help="learner.sync_bucket_mb")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="a toy model: check that it runs")
    parser.add_argument("--lora", action="store_true", help="full vs LoRA adapter sync per shape")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["smollm2-135m", "qwen2.5-0.5b"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.lora:
        bench_lora(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        model = build_model(TINY if args.tiny else QWEN25_05B, Path(tmp) / "model")
        named = [(name, param.detach()) for name, param in model.named_parameters()]
        gigabytes = sum(t.nbytes for _, t in named) / 1e9
        print(f"model: {sum(t.numel() for _, t in named) / 1e6:.1f}M parameters, {gigabytes:.3f} GB bf16, "
              f"{len(named)} tensors", flush=True)
        raw_s = time_raw(bucket_sizes(named, args.bucket_mb), args.repeats)
        print(f"raw gloo: {raw_s:.2f} s", flush=True)
        with launch_engines("embedded", model_path=str(Path(tmp) / "model"), dtype="bfloat16",
                            log_dir=Path(tmp) / "logs", startup_timeout_s=600) as handle:
            best = asyncio.run(time_pushes(handle.urls[0], model, Path(tmp) / "export", args.bucket_mb,
                                           args.repeats))
    print(
        f"RESULT gb={gigabytes:.4g} sync_s_per_tensor={best['per_tensor']:.3f} "
        f"sync_s_bucketed={best['bucketed']:.3f} sync_s_disk={best['disk']:.3f} "
        f"raw_gbps={gigabytes / raw_s:.3f} bucketed_gbps={gigabytes / best['bucketed']:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
