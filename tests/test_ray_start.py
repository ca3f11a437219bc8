"""A run without ray.address starts its own Ray instance, even beside a running cluster."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from arbor.engines.ports import free_port


def stop_processes_of(marker: str) -> None:
    """Kill the processes whose command line names ``marker`` (this test's Ray temp dir):
    `ray stop` would stop every Ray instance on the machine."""
    for process in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in process.info["cmdline"] or []):
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass


def test_a_run_without_ray_address_never_joins_a_running_cluster():
    # A `ray start` head on this machine writes ray_current_cluster in Ray's temp dir, and a plain
    # ray.init() joins it, refusing num_cpus ("When connecting to an existing cluster, num_cpus
    # ... must not be provided"): a user who left a cluster running could not start a run.
    # Short: Ray's Unix sockets live under it (a path of at most 107 bytes).
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    env = {**os.environ, "RAY_TMPDIR": str(temp), "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    try:
        subprocess.run(["ray", "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                        "--disable-usage-stats"], env=env, check=True, capture_output=True, timeout=120)
        assert (temp / "ray" / "ray_current_cluster").exists()  # RAY_TMPDIR/ray/...
        script = ("import ray; from arbor.config import RayConfig; from arbor.run.orchestration import start_ray; "
                  "start_ray(RayConfig(num_cpus=2), 2); print('GCS', ray.get_runtime_context().gcs_address); "
                  "print('CPUS', ray.cluster_resources()['CPU'])")
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("GCS", "CPUS")))
        assert not lines["GCS"].endswith(f":{port}")  # its own instance, not the running cluster
        assert float(lines["CPUS"]) == 2
    finally:
        stop_processes_of(str(temp))
        shutil.rmtree(temp, ignore_errors=True)
