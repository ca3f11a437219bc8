"""A cluster of distinct node addresses on this machine for tests (scripts/two_node_cluster.sh).

    cluster = namespace_cluster(nodes=2)           # skips (fails under CI) where it cannot be built
    cluster.start_ray(1, cpus=4, resources={"trainer": 1})        # the head, at 10.77.0.1:6379
    cluster.start_ray(2, cpus=3, resources={"trainer": 1})        # a worker joining it
    done = cluster.run(1, [sys.executable, "-m", "arbor", "train", ...])   # the driver on node 1
    cluster.kill(2)                                # every process of node 2 dies at once
    cluster.down()

Each node is a network namespace (its own address, interfaces named differently on each node)
in a PID namespace of its own, so ``ray stop`` and a node's death stay inside the test. The
file system is shared, as a cluster's NFS would be, except Ray's temp directory.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ci_rule import unavailable

from arbor.engines.interfaces import SOCKET_IFNAME_VARIABLES

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "two_node_cluster.sh"
RAY_PORT = 6379
# Ray's own settings stay as users have them (a lost node is declared dead after 5 missed
# health checks, one every 3 s: shorter periods declared a busy node dead on a loaded machine),
# except one: every node here sees the whole machine's memory, other nodes' and other jobs'
# included, and Ray's memory monitor (which kills workers past 95% of it) killed ours for it.
RAY_NODE_SETTINGS = {"RAY_memory_monitor_refresh_ms": "0"}


def node_env(**extra: str) -> dict[str, str]:
    """The environment of every process the tests start on a node."""
    # An interface a test process chose for itself (or a developer's setting) is no node's here.
    env = {k: v for k, v in os.environ.items() if k not in SOCKET_IFNAME_VARIABLES}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])), RAY_AUTH_MODE="disabled",
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RAY_USAGE_STATS_ENABLED="0",
               PYTHONWARNINGS="ignore::FutureWarning", **extra)
    return env


class NamespaceCluster:
    """Nodes built by scripts/two_node_cluster.sh, and Ray on them."""

    def __init__(self, directory: str, nodes: int) -> None:
        self.directory, self.nodes = directory, nodes
        self.ray_args: dict[int, list[str]] = {}  # node -> its `ray start` arguments (to start it again)

    def address(self, node: int) -> str:
        return (Path(self.directory) / "subnet").read_text().strip() + f".{node}"

    @property
    def ray_address(self) -> str:
        return f"{self.address(1)}:{RAY_PORT}"

    def command(self, node: int, args: Sequence[str]) -> list[str]:
        """``args`` as a command that runs on ``node``."""
        return ["bash", str(SCRIPT), "exec", self.directory, str(node), *map(str, args)]

    def run(self, node: int, args: Sequence[str], timeout: float = 900, env: dict[str, str] | None = None,
            check: bool = False) -> subprocess.CompletedProcess:
        done = subprocess.run(self.command(node, args), cwd=REPO, env=env or node_env(), capture_output=True,
                              text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, args))} on node {node} exited {done.returncode}:\n"
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def popen(self, node: int, args: Sequence[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start ``args`` on ``node`` (its own session: the test may kill its group)."""
        return subprocess.Popen(self.command(node, args), cwd=REPO, env=env or node_env(), start_new_session=True,
                                text=True, **kw)

    def start_ray(self, node: int, cpus: int, resources: dict[str, float] | None = None) -> None:
        """Ray on ``node``: the head on node 1, a worker joining it elsewhere."""
        import json

        ray = str(Path(sys.executable).with_name("ray")) if Path(sys.executable).with_name("ray").exists() else "ray"
        args = [ray, "start", "--node-ip-address", self.address(node), f"--num-cpus={cpus}", "--num-gpus=0",
                "--disable-usage-stats", f"--resources={json.dumps(resources or {})}"]
        if node == 1:
            args += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
        else:
            args += [f"--address={self.ray_address}"]
        self.ray_args[node] = args
        self.run(node, args, timeout=180, env=node_env(**RAY_NODE_SETTINGS), check=True)

    def kill(self, node: int) -> None:
        """Every process of ``node`` dies at once (the machine is lost); its address stays."""
        subprocess.run(["bash", str(SCRIPT), "kill", self.directory, str(node)], check=True, timeout=60)

    def restart(self, node: int) -> None:
        """A fresh machine at ``node``'s address, running the Ray it ran before."""
        subprocess.run(["bash", str(SCRIPT), "start", self.directory, str(node)], check=True, timeout=60)
        if node in self.ray_args:
            self.run(node, self.ray_args[node], timeout=180, env=node_env(**RAY_NODE_SETTINGS), check=True)

    def down(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "down", self.directory], timeout=120)


def why_no_cluster() -> str | None:
    """Why this machine cannot build the cluster (None: it may)."""
    if platform.system() != "Linux":
        return f"network and PID namespaces need Linux (this is {platform.system()})"
    missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (install iproute2 and util-linux)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    return None


def namespace_cluster(nodes: int = 2) -> NamespaceCluster:
    """Build a cluster of ``nodes`` nodes; skip where that is impossible, fail under CI (tests/ci_rule.py)."""
    reason = why_no_cluster()
    if reason is None:
        done = subprocess.run(["bash", str(SCRIPT), "up", "--nodes", str(nodes)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode == 0:
            return NamespaceCluster(done.stdout.strip().splitlines()[-1], nodes)
        reason = f"scripts/two_node_cluster.sh up failed: {done.stderr.strip()[-500:]}"
    unavailable(f"the multi-node tests need a cluster of node addresses: {reason}")
