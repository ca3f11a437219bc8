"""arbor's GPU measurements in one pass, for a single CUDA machine lent for a few minutes.

    python scripts/gpu_report.py --out OUT [--steps 15] [--skip packing,tree_execution,...]

What it measures, each in its own time-limited subprocess (a failure is reported and the
rest goes on), and what it writes under ``OUT`` (a handful of files, all small):

1. ``packing``: ``scripts/bench_packing.py --real --attention flex`` on a Qwen2.5-0.5B-shaped
   model in bf16, with case (d) at 32 uneven trees (a quickstart step's batch): tree packing's
   speed-up over the packed linear baseline and its fraction of the token ideal
   (``packing.txt``).
2. ``tree_execution``: ``scripts/bench_tree_execution.py --device cuda --quick`` (packed vs
   depth-first vs linear), when the script exists (``tree_execution.txt``).
3. ``mis``, ``lora``, ``async``: the quickstart colocated on the one GPU in bf16
   (``ray.colocate=true learner.weight_sync=disk``), ``--steps`` steps each: with
   ``loss.rollout_correction=mis``; with a rank-8 LoRA adapter; asynchronous
   (``algorithm.max_staleness=1``). Each run's ``metrics.jsonl`` is copied to
   ``OUT/<name>.jsonl``, their output to ``OUT/runs.log``; the GPU's used memory is
   sampled by ``nvidia-smi`` every 250 ms.

Ends with ``RESULT`` (``s_per_step_<run>`` is the median over the steps after the first two,
which include compilation; ``peak_gpu_mib_<run>`` the largest used memory seen minus the idle
reading before the run; ``mismatch_kl``, ``is_weight_max`` and the rest as the runs report
them) and writes ``OUT/summary.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART_GPU = ["learner.device=cuda", "model.dtype=bfloat16", "learner.dtype=bfloat16", "ray.colocate=true",
                  "learner.weight_sync=disk", "run.eval_every=0", "run.save_every=0", "run.save_trees_every=0"]
RUNS = {
    # The synchronous runs pin max_staleness 0: the quickstart itself is asynchronous since 2026-11-27.
    "mis": ["loss.rollout_correction=mis", "algorithm.max_staleness=0"],
    "lora": ["model.lora_rank=8", "model.lora_alpha=16", "optim.lr=2e-3", "algorithm.max_staleness=0"],
    "async": ["algorithm.max_staleness=1"],
}
# What each run reports: the mean over its steps of these metrics (those present).
REPORTED = {
    "mis": ["mismatch/kl", "mismatch/is_weight_mean", "mismatch/is_weight_max", "mismatch/truncated_fraction",
            "mismatch/masked_fraction", "sync/logprob_gap", "train/logprob_gap"],
    "lora": ["sync/bytes", "sync/logprob_gap", "train/logprob_gap"],
    "async": ["async/staleness_mean", "sync/logprob_gap", "train/logprob_gap"],
}


def summarise_run(name: str, metrics_path: Path, memory_mib: list[float], idle_mib: float) -> dict[str, float]:
    """The figures of one quickstart run: seconds per step (median after the first two steps),
    the peak GPU memory over the idle reading, and the mean of its ``REPORTED`` metrics."""
    steps = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [m for m in steps if m.get("step", 0) >= 1]
    times = [m["time/step_s"] for m in steps if "time/step_s" in m]
    out = {f"steps_{name}": float(len(steps))}
    if len(times) > 2:
        out[f"s_per_step_{name}"] = statistics.median(times[2:])
    if memory_mib:
        out[f"peak_gpu_mib_{name}"] = max(memory_mib) - idle_mib
    for key in REPORTED[name]:
        values = [m[key] for m in steps if key in m]
        if values:
            label = key.replace("/", "_")
            out[f"{label}_{name}"] = max(values) if key.endswith("_max") else statistics.fmean(values)
    return out


def gpu_memory_mib() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.split()[0])


def run_logged(command: list[str], log: Path, timeout_s: float) -> int:
    """``command`` with its output appended to ``log``; the exit code (124 past ``timeout_s``)."""
    print(f"$ {' '.join(command)}", flush=True)
    started = time.perf_counter()
    with log.open("a") as f:
        f.write(f"$ {' '.join(command)}\n")
        f.flush()
        try:
            rc = subprocess.run(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    tail = log.read_text(errors="replace").splitlines()[-6:]
    print(f"  rc={rc} in {time.perf_counter() - started:.0f} s; last lines:\n    " + "\n    ".join(tail), flush=True)
    return rc


def quickstart(name: str, steps: int, out: Path, timeout_s: float) -> dict[str, float]:
    run_dir = Path("/tmp") / f"arbor-gpu-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    idle = gpu_memory_mib()
    sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                "-lms", "250"], stdout=subprocess.PIPE, text=True)
    command = [sys.executable, "-m", "arbor", "train", "configs/quickstart.yaml", *QUICKSTART_GPU,
               f"run.steps={steps}", f"run.output_dir={run_dir}", *RUNS[name]]
    rc = run_logged(command, out / "runs.log", timeout_s)
    sampler.terminate()
    memory = [float(x) for x in (sampler.communicate()[0] or "").split() if x.replace(".", "", 1).isdigit()]
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return {f"rc_{name}": float(rc)}
    shutil.copy(metrics, out / f"{name}.jsonl")
    return {f"rc_{name}": float(rc)} | summarise_run(name, metrics, memory, idle)


def result_line(figures: dict[str, float]) -> str:
    return "RESULT " + " ".join(f"{k}={v:.4g}" for k, v in figures.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=15, help="steps of each quickstart run")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out")
    parser.add_argument("--run-timeout-s", type=float, default=150.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    figures: dict[str, float] = {}
    if "packing" not in skip:
        figures["rc_packing"] = run_logged(
            [sys.executable, "scripts/bench_packing.py", "--real", "--attention", "flex", "--uneven-trees", "32",
             "--reps", "3"], args.out / "packing.txt", 180)
    if "tree_execution" not in skip and (ROOT / "scripts" / "bench_tree_execution.py").exists():
        figures["rc_tree_execution"] = run_logged(
            [sys.executable, "scripts/bench_tree_execution.py", "--device", "cuda", "--quick"],
            args.out / "tree_execution.txt", 180)
    for name in RUNS:
        if name not in skip:
            figures |= quickstart(name, args.steps, args.out, args.run_timeout_s)
    line = result_line(figures)
    (args.out / "summary.txt").write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
