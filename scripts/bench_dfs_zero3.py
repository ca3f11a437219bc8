"""What a depth-first walk costs under ZeRO-3: its collectives per learner step, packed vs dfs.

    python scripts/bench_dfs_zero3.py [--cases agentic,prefix,quickstart] [--group-tokens 128]

Two learner ranks (DeepSpeed ZeRO-3 over gloo, CPU, one thread each) train one step on
scripts/bench_tree_execution.py's cases shrunk 16× (its smoke model), once with
``learner.tree_execution: packed`` and once with ``dfs``; each rank gets the whole case (the
same work twice). Every collective DeepSpeed issues is counted with its bytes: parameter
gathers (all-gather) and gradient reduce-scatters. ZeRO-3 is set to gather every parameter at
every use (persistence threshold, live-parameter and reuse limits 0), as it does for models
larger than those limits (10^5 elements; 10^9 parameters); smaller models keep some
parameters gathered between calls and gather less.

A walk forwards once per group and runs one backward per group: ZeRO-3 gathers the
parameters in each forward and each backward, and reduce-scatters the gradients after each
backward, where a packed step does so once per pack. Per case it prints forwards, backwards,
gathered bytes and reduce-scattered bytes, each also in model sizes (the parameters' bytes).

Ends with ``RESULT`` and, per case c: ``c_packed_gathers``, ``c_dfs_gathers`` (parameter bytes
gathered / the model's bytes), ``c_packed_reductions``, ``c_dfs_reductions`` (gradient bytes
reduce-scattered / the model's bytes), ``c_dfs_forwards`` (forwards of the walk).
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CASE_NAMES = ("agentic", "prefix", "quickstart")


def count_collectives() -> collections.Counter:
    """Count DeepSpeed's collectives and their bytes from now on (its torch backend's calls)."""
    import torch

    backend = importlib.import_module("deepspeed.comm.torch").TorchBackend
    counts: collections.Counter = collections.Counter()
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast"):
        original = getattr(backend, name)

        def counted(self: Any, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
            counts[_name] += 1
            if tensors:  # the whole tensor: a gather's output, a reduce-scatter's input
                counts[_name + "_bytes"] += max(t.numel() * t.element_size() for t in tensors)
            return _original(self, *args, **kwargs)

        setattr(backend, name, counted)
    return counts


def rank_main(model_dir: str, execution: str, case: str, group_tokens: int, out: str) -> None:
    """One rank: a learner step on ``case`` with ``execution``; writes its counts as JSON."""
    import torch

    scripts = str(ROOT / "scripts")
    sys.path.insert(0, scripts)
    bench = importlib.import_module("bench_tree_execution")
    import arbor.train.learner as learner_module
    from arbor.config_load import load_config
    from arbor.train.deepspeed_setup import deepspeed_config
    from arbor.train.dfs import plan_walk
    from arbor.train.packing import loss_denominator, pack_trees

    def every_use_gathers(*args: Any, **kwargs: Any) -> dict[str, Any]:
        ds = deepspeed_config(*args, **kwargs)
        ds["zero_optimization"] |= {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
                                    "stage3_max_reuse_distance": 0}
        return ds

    learner_module.deepspeed_config = every_use_gathers  # the learner's own config, gathering at every use
    cfg = load_config(None, [f"model.path={model_dir}", "learner.backend=deepspeed", "learner.zero_stage=3",
                             "learner.num_ranks=2", "learner.device=cpu", "learner.dtype=float32",
                             f"learner.tree_execution={execution}", f"learner.dfs_group_tokens={group_tokens}"])
    learner = learner_module.Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=1)
    settings = bench.Settings(model="smoke", shrink=16)
    trees, advantages = bench.batch(case, settings, learner.model.config.vocab_size)
    packs = pack_trees(trees, advantages, pack_tokens=cfg.learner.pack_tokens)
    counts = count_collectives()
    learner.step(packs, loss_denominator(trees, "token"))
    model_bytes = sum(p.ds_numel * p.element_size() for p in learner.model.parameters())
    groups = sum(len(plan_walk(p, p.trained.nonzero()[:, 0], group_tokens).groups) for p in packs)
    if int(os.environ["RANK"]) == 0:
        Path(out).write_text(json.dumps(dict(counts) | {"model_bytes": model_bytes, "packs": len(packs),
                                                        "groups": groups}))
    learner.close()
    del torch


def run_case(model_dir: Path, execution: str, case: str, group_tokens: int) -> dict[str, Any]:
    from arbor.engines.ports import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "counts.json")
        port = str(free_port())
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                       PYTHONWARNINGS="ignore::FutureWarning")
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--rank", str(model_dir), execution, case, str(group_tokens), out],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=900)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{case}/{execution}: ranks exited {[p.returncode for p in procs]}\n"
                               + "\n".join(log[-2000:] for log in logs))
        return json.loads(Path(out).read_text())


def models(counts: dict[str, Any], collective: str, size: int) -> float:
    """The bytes ``collective`` moved, in model sizes (``size``: the parameters' bytes)."""
    return counts.get(collective + "_bytes", 0) / size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASE_NAMES))
    parser.add_argument("--group-tokens", type=int, default=128, help="learner.dfs_group_tokens (cases are 16x smaller)")
    parser.add_argument("--rank", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        model_dir, execution, case, group_tokens, out = args.rank
        return rank_main(model_dir, execution, case, int(group_tokens), out)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(ROOT / "scripts"))
    bench = importlib.import_module("bench_tree_execution")
    result = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**bench.SMOKE)).save_pretrained(tmp)
        for case in args.cases.split(","):
            packed, dfs = (run_case(Path(tmp), e, case, args.group_tokens) for e in ("packed", "dfs"))
            size = packed["model_bytes"]
            sizes = functools.partial(models, size=size)
            print(f"case {case}: packed {packed['packs']} pack(s): {packed.get('all_gather_into_tensor', 0)} gathers "
                  f"({sizes(packed, 'all_gather_into_tensor'):.1f} models), {packed.get('reduce_scatter_tensor', 0)} "
                  f"reduce-scatters ({sizes(packed, 'reduce_scatter_tensor'):.1f} models) | dfs {dfs['groups']} "
                  f"groups: {dfs.get('all_gather_into_tensor', 0)} gathers ({sizes(dfs, 'all_gather_into_tensor'):.1f} "
                  f"models), {dfs.get('reduce_scatter_tensor', 0)} reduce-scatters "
                  f"({sizes(dfs, 'reduce_scatter_tensor'):.1f} models) | model {size} bytes", flush=True)
            result += [f"{case}_packed_gathers={sizes(packed, 'all_gather_into_tensor'):.1f}",
                       f"{case}_dfs_gathers={sizes(dfs, 'all_gather_into_tensor'):.1f}",
                       f"{case}_packed_reductions={sizes(packed, 'reduce_scatter_tensor'):.1f}",
                       f"{case}_dfs_reductions={sizes(dfs, 'reduce_scatter_tensor'):.1f}",
                       f"{case}_dfs_forwards={dfs['groups']}"]
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
