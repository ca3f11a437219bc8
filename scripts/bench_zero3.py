"""ZeRO-3 at scale on 2 CPU ranks (gloo): host memory while loading, and gather + push per sync.

    python scripts/bench_zero3.py [--bucket-mb 512] [--repeats 3] [--dtype bfloat16] [--tiny]

A Qwen2.5-0.5B-shaped model (24 layers, hidden 896, 14 query / 2 KV heads, MLP 4864,
vocabulary 151,936, tied embeddings: 494M parameters) with random weights is saved once;
then two pairs of learner ranks (``DS_ACCELERATOR=cpu``, gloo, ``OMP_NUM_THREADS=1``) run:

- **load**: the peak resident memory of each rank (``VmHWM``, reset through
  ``/proc/self/clear_refs`` just before, minus the resident memory then) while the policy
  is loaded and partitioned: ``full`` loads the whole model on every rank
  (``load_policy``, unsharded loading), then partitions it as
  ``deepspeed.initialize`` does (``zero.Init(module=model)``; transformers maps the
  safetensors file, so the whole model becomes resident only as it is read there);
  ``sharded`` builds it partitioned (``arbor.train.zero3.build_partitioned``). The larger rank
  counts; the optimizer (the same on both paths) is not included.
- **sync** (the sharded pair, after ``deepspeed.initialize``): seconds from the first
  gather to the engine's confirmed version, rank 0 pushing to an ``arbor serve`` engine
  over a gloo weight-update group: ``per_param`` gathers one parameter at a time (one
  ``GatheredParameters`` each) into ``--bucket-mb`` flat buckets;
  ``bucketed`` gathers ``--bucket-mb`` buckets (one ``GatheredParameters`` each), the
  next while one is broadcast. One untimed push first opens the group; best of ``--repeats``.

Ends with ``RESULT load_peak_mib_full=... load_peak_mib_sharded=... sync_s_per_param=...
sync_s_bucketed=...``. Memory needs ~2 GB per rank plus the engine's copy; on a 2-core
machine the ranks and the engine share the cores: run it on a quiet machine.
``--tiny``: a 2-layer toy model, to check that the script runs (seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.bench_weight_sync import QWEN25_05B, TINY  # noqa: E402  (the same model shapes)


def save_model(config_kwargs: dict, path: Path, dtype: str) -> None:
    """Random weights in ``dtype``, saved as an HF directory (no download)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**config_kwargs, dtype=dtype)).to(getattr(torch, dtype))
    model.save_pretrained(path)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {dtype}", flush=True)


def resident_mib(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` of this process, MiB."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", status).group(1)) / 1024


def load_peak(load) -> tuple[object, float]:
    """``load()``'s result and the MiB it raised this process's resident peak by."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = resident_mib("VmRSS")
    result = load()
    return result, resident_mib("VmHWM") - before


def rank_main(mode: str, model_dir: str, url: str, bucket_mb: float, repeats: int, dtype: str, out: str) -> None:
    """One learner rank: load (``mode`` full or sharded); the sharded pair also times syncs."""
    import deepspeed
    import torch

    from arbor.config_load import load_config
    from arbor.train.deepspeed_setup import deepspeed_config, init_distributed
    from arbor.train.learner import Learner, load_policy
    from arbor.train.zero3 import build_partitioned

    rank = int(os.environ["RANK"])
    cfg = load_config(None, [
        f"model.path={model_dir}", "learner.device=cpu", f"learner.dtype={dtype}", "learner.backend=deepspeed",
        "learner.zero_stage=3", "learner.num_ranks=2", f"learner.sync_bucket_mb={bucket_mb}",
    ])
    init_distributed("gloo")
    ds_config = deepspeed_config(cfg.learner, cfg.optim, getattr(torch, dtype))  # the learner's own
    if mode == "full":
        def load_then_partition():
            # What deepspeed.initialize does first with a whole model under ZeRO-3
            # (DeepSpeedZeRoOffload._convert_to_zero_parameters), without the optimizer.
            model = load_policy(cfg.model, getattr(torch, dtype))
            deepspeed.zero.Init(module=model, config_dict_or_path=ds_config)
            return model

        _, peak = load_peak(load_then_partition)
    else:
        _, peak = load_peak(lambda: build_partitioned(cfg.model, getattr(torch, dtype), ds_config))
    result = {"load_peak_mib": peak}
    if mode == "sharded":
        learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=1)
        result.update(time_syncs(learner.model, rank, url, bucket_mb, repeats))
    Path(f"{out}.{rank}").write_text(json.dumps(result))


def time_syncs(model, rank: int, url: str, bucket_mb: float, repeats: int) -> dict[str, float]:
    """Best seconds of a per-parameter and a bucketed gather + push (every rank gathers)."""
    import torch

    from arbor.engines.client import SGLangClient
    from arbor.run.weight_sync import WeightSync
    from arbor.train.weight_sync import gathered_buckets, gathered_parameters, named_tensor_buckets

    def buckets(kind: str):
        if kind == "per_param":
            return named_tensor_buckets(gathered_parameters(model, 3), bucket_mb)
        return gathered_buckets(model, 3, bucket_mb, copy=rank == 0)

    async def pushes() -> dict[str, float]:
        best = {"per_param": float("inf"), "bucketed": float("inf")}
        client = SGLangClient([url], timeout_s=3600) if rank == 0 else None
        sync = WeightSync(client, master_address="127.0.0.1") if client else None
        runs = [("bucketed", "warm-up")] + [(kind, str(i)) for i in range(repeats) for kind in best]
        for kind, tag in runs:
            torch.distributed.barrier()
            start = time.perf_counter()
            if sync is not None:
                await sync.push(buckets(kind), f"{kind}-{tag}")
            else:
                for _ in buckets(kind):  # take part in every gather
                    pass
            torch.distributed.barrier()
            if tag != "warm-up":
                best[kind] = min(best[kind], time.perf_counter() - start)
                print(f"rank {rank} {kind}: {time.perf_counter() - start:.2f} s", flush=True)
        if client is not None:
            await client.close()
        return best

    return asyncio.run(pushes())


def run_pair(mode: str, model_dir: Path, url: str, args: argparse.Namespace, out: Path) -> list[dict]:
    """Both ranks of ``mode``; their result records."""
    from arbor.engines.ports import free_port

    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   PYTHONWARNINGS="ignore::FutureWarning", PYTHONPATH=str(REPO))
        command = [sys.executable, __file__, "--rank-mode", mode, "--model-dir", str(model_dir), "--url", url,
                   "--bucket-mb", str(args.bucket_mb), "--repeats", str(args.repeats), "--dtype", args.dtype,
                   "--out", str(out)]
        procs.append(subprocess.Popen(command, env=env))
    codes = [p.wait(timeout=3600) for p in procs]
    if any(codes):
        raise RuntimeError(f"{mode} ranks exited with {codes}")
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", type=float, default=512.0, help="learner.sync_bucket_mb")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tiny", action="store_true", help="a toy model: check that the script runs")
    parser.add_argument("--rank-mode", choices=["full", "sharded"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_mode:
        rank_main(args.rank_mode, args.model_dir, args.url, args.bucket_mb, args.repeats, args.dtype, args.out)
        return

    from arbor.engines.launch import launch_engines

    with tempfile.TemporaryDirectory(prefix="bench-zero3-") as tmp:
        model_dir = Path(tmp) / "model"
        save_model(TINY if args.tiny else QWEN25_05B, model_dir, args.dtype)
        full = run_pair("full", model_dir, "", args, Path(tmp) / "full")
        with launch_engines("embedded", model_path=str(model_dir), dtype=args.dtype, log_dir=Path(tmp) / "logs",
                            startup_timeout_s=600) as handle:
            sharded = run_pair("sharded", model_dir, handle.urls[0], args, Path(tmp) / "sharded")
    print("load peak MiB per rank: full", [round(r["load_peak_mib"]) for r in full],
          "sharded", [round(r["load_peak_mib"]) for r in sharded], flush=True)
    print(
        f"RESULT load_peak_mib_full={max(r['load_peak_mib'] for r in full):.0f} "
        f"load_peak_mib_sharded={max(r['load_peak_mib'] for r in sharded):.0f} "
        f"sync_s_per_param={sharded[0]['per_param']:.3f} sync_s_bucketed={sharded[0]['bucketed']:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
