"""What the bubblewrap tool sandbox costs per call: the same calls sandboxed and unsandboxed.

    python3 scripts/bench_sandbox.py                 # 50 calls of each kind, interleaved
    python3 scripts/bench_sandbox.py --calls 5       # a quick check that it runs

Both arms go through arbor.rollout.tools' own call path (the bootstrap, the limits, the
output reading) one call at a time; they differ only in the prefix: bwrap with its
namespaces and read-only binds, or the unsandboxed fallback (``unshare -n`` where it works:
rlimits and no network only). Calls alternate between the arms so that a machine's drift
touches both. Two programs: ``print(1)`` (the interpreter's start-up, the floor of every
call) and ``import numpy`` (a tool that loads a library from the read-only site-packages).
Ends with

    RESULT sandboxed_ms=<median, print(1)> unsandboxed_ms=<median> overhead_ms=<difference> numpy_overhead_ms=...

Timings only mean something on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from arbor.rollout.sandbox import Sandbox
from arbor.rollout.tools import _call, _probe_sandbox, _run, network_isolation

PROGRAMS = {"print": "print(1)", "numpy": "import numpy\nprint(numpy.arange(3).sum())"}


def one_call(code: str, sandbox: Sandbox | None, isolation: list[str] | None) -> float:
    """Milliseconds for one call, from writing its script to its directory's removal."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="arbor-tool-") as workdir:
        command, env = _call(code, workdir, sandbox, timeout_s=30.0, memory_mb=1024, max_file_mb=16,
                             max_processes=64, isolation=isolation)
        result = asyncio.run(_run(command, workdir, env, 30.0, 8192))
    if not result.ok:
        raise RuntimeError(f"{'sandboxed' if sandbox else 'unsandboxed'} call of {code!r} failed: {result.observation}")
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50, help="calls per arm and program")
    args = parser.parse_args()
    sandbox, why = _probe_sandbox(os.environ.get("PATH", ""), 64)
    if sandbox is None:
        raise SystemExit(f"bench_sandbox: bubblewrap cannot run here: {why}")
    isolation = network_isolation()
    print(f"sandbox: {sandbox.bwrap}, read-only {', '.join(sandbox.read_only)}, as_root={sandbox.as_root}; "
          f"unsandboxed prefix: {' '.join(isolation or []) or '(none)'}")
    medians: dict[str, float] = {}
    for name, code in PROGRAMS.items():
        one_call(code, sandbox, isolation)  # warm the page cache for both arms
        times: dict[str, list[float]] = {"sandboxed": [], "unsandboxed": []}
        for _ in range(args.calls):
            times["sandboxed"].append(one_call(code, sandbox, isolation))
            times["unsandboxed"].append(one_call(code, None, isolation))
        for arm, values in times.items():
            medians[f"{name}_{arm}"] = statistics.median(values)
            print(f"{name:6s} {arm:12s} median {statistics.median(values):7.1f} ms  "
                  f"min {min(values):7.1f}  max {max(values):7.1f}  ({len(values)} calls)")
    print(f"RESULT sandboxed_ms={medians['print_sandboxed']:.1f} unsandboxed_ms={medians['print_unsandboxed']:.1f} "
          f"overhead_ms={medians['print_sandboxed'] - medians['print_unsandboxed']:.1f} "
          f"numpy_overhead_ms={medians['numpy_sandboxed'] - medians['numpy_unsandboxed']:.1f}")


if __name__ == "__main__":
    main()
