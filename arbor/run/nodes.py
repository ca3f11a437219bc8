"""The cluster's nodes as a run sees them: can a placement fit, what must every node see, which are lost.

    cfg = with_absolute_paths(cfg)          # the paths actors read, as the driver resolves them
    problem = placement_problem(bundles, labels, "STRICT_SPREAD", cluster_nodes())   # None: it fits
    token = mark_output_dir(cfg.run.output_dir)       # the driver, before any actor starts
    check_node_paths(cfg, token, "learner rank 1")    # each actor, on its own node
    node_alive(node_id)                               # False once Ray has declared the node dead

A Ray worker runs in the directory ``ray start`` ran in on its node, so a relative
``model.path`` means something else there: the driver hands actors absolute paths. The file
system is the user's: a node may lack ``model.path``, or see another ``run.output_dir``
(checkpoints, where every learner rank writes its shard, and the weights a restarted or
``learner.weight_sync: disk`` engine loads must be one directory every node shares); each
actor checks on its node before anything starts and the error names the node.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from arbor.config import Config
from arbor.errors import ConfigError

MARKER = ".arbor-node-check"  # in run.output_dir: the token every node must read there


@dataclass(frozen=True)
class Node:
    """An alive node of the Ray cluster and everything it offers (not what is free now)."""

    address: str
    resources: dict[str, float]  # e.g. {"CPU": 8, "GPU": 1, "trainer": 1}


def cluster_nodes() -> list[Node]:
    """The alive nodes of the Ray cluster this process is connected to."""
    import ray

    return [Node(n["NodeManagerAddress"], {k: float(v) for k, v in n["Resources"].items()})
            for n in ray.nodes() if n["Alive"]]


def node_address() -> str:
    """The address Ray knows for this process's node (the one other nodes reach it by)."""
    import ray

    return ray.util.get_node_ip_address()


def node_id() -> str:
    """This process's Ray node id (what :func:`node_alive` takes)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def node_alive(node_id: str) -> bool:
    """Whether the Ray node ``node_id`` is alive (False once Ray has declared it dead)."""
    import ray

    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


NODE_VERDICT_S = 120.0  # how long node_lost waits for Ray to declare a silent node dead


def node_lost(node_id: str, timeout_s: float = NODE_VERDICT_S) -> bool:
    """Whether the Ray node ``node_id`` is lost: True once Ray declares it dead, False once it
    runs a task. An actor dies at once with its node, but Ray declares the node dead only
    after its missed health checks (by default 5, one every 3 s): until one of the two
    happens, this waits (at most ``timeout_s``; then it goes by Ray's node table)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0)(_process_id).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not node_alive(node_id):
            return True
        if ray.wait([probe], timeout=1.0)[0]:
            try:
                ray.get(probe)
                return False  # it ran a task: alive
            except ray.exceptions.RayError:
                return not node_alive(node_id)
    ray.cancel(probe, force=True)
    return not node_alive(node_id)


def _process_id() -> int:
    """What :func:`node_lost` runs on a node to see it alive."""
    return os.getpid()


def _fits(bundle: dict[str, float], offer: dict[str, float]) -> bool:
    return all(offer.get(name, 0.0) >= amount for name, amount in bundle.items())


def show_resources(resources: dict[str, float]) -> str:
    """``{CPU: 2, trainer: 1}``: leaves out what Ray adds to every node (``node:<address>``,
    memory, object store) and its placement-group bookkeeping, which no bundle asks for."""
    shown = {k: v for k, v in resources.items()
             if not k.startswith(("node:", "memory", "object_store_memory", "bundle_group")) and "_group_" not in k}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"


def _offers(nodes: Sequence[Node]) -> str:
    return "; ".join(f"{n.address} {show_resources(n.resources)}" for n in nodes)


def _distinct_nodes(bundles: Sequence[dict[str, float]], nodes: Sequence[Node]) -> bool:
    """Whether every bundle fits on a node of its own (a bipartite matching, by augmenting paths)."""
    owner: dict[int, int] = {}  # node index -> bundle index

    def place(b: int, seen: set[int]) -> bool:
        for n, node in enumerate(nodes):
            if n in seen or not _fits(bundles[b], node.resources):
                continue
            seen.add(n)
            if n not in owner or place(owner[n], seen):
                owner[n] = b
                return True
        return False

    return all(place(b, set()) for b in range(len(bundles)))


def placement_problem(
    bundles: Sequence[dict[str, float]], labels: Sequence[str], strategy: str, nodes: Sequence[Node]
) -> str | None:
    """Why ``bundles`` (``labels[i]`` says whose bundle i is) can never be placed with
    ``strategy`` on ``nodes`` (what they offer in all, not what is free now); None: they can.

        placement_problem([{"CPU": 1}] * 3, ["rank 0", "rank 1", "engine 0"], "STRICT_SPREAD",
                          [Node("10.0.0.1", {"CPU": 4}), Node("10.0.0.2", {"CPU": 4})])
        # "ray.placement_strategy=STRICT_SPREAD puts each of the 3 bundles ... 2 alive nodes ..."
    """
    if not nodes:
        return "the Ray cluster has no alive node"
    for bundle, label in zip(bundles, labels):
        if not any(_fits(bundle, n.resources) for n in nodes):
            return f"{label} asks for {show_resources(bundle)}, which no node of the cluster offers (nodes: {_offers(nodes)})"
    if strategy == "STRICT_SPREAD":
        if len(bundles) > len(nodes):
            return (f"ray.placement_strategy=STRICT_SPREAD puts each of the {len(bundles)} bundles ({', '.join(labels)}) "
                    f"on a node of its own, and the cluster has {len(nodes)} alive nodes: use SPREAD or PACK, "
                    "or fewer learner ranks or engines")
        if not _distinct_nodes(bundles, nodes):
            return (f"ray.placement_strategy=STRICT_SPREAD: the {len(bundles)} bundles ({', '.join(labels)}) do not fit "
                    f"on distinct nodes (nodes: {_offers(nodes)})")
        return None
    total: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            total[name] = total.get(name, 0.0) + amount
    if strategy == "STRICT_PACK":
        if not any(_fits(total, n.resources) for n in nodes):
            return (f"ray.placement_strategy=STRICT_PACK puts all {len(bundles)} bundles on one node, which needs "
                    f"{show_resources(total)}; no node offers that (nodes: {_offers(nodes)})")
        return None
    for name, amount in total.items():
        have = sum(n.resources.get(name, 0.0) for n in nodes)
        if have < amount:
            return (f"the {len(bundles)} bundles ({', '.join(labels)}) need {name} {amount:g} in all, and the "
                    f"cluster's alive nodes offer {have:g} (nodes: {_offers(nodes)})")
    return None


def with_absolute_paths(cfg: Config) -> Config:
    """``cfg`` with the paths actors read (``model.path``, ``model.ref_path``,
    ``run.output_dir``, an ``engine.python`` path) made absolute as the driver resolves them;
    a ``model.path`` that is no local directory (a hub name) stays as it is."""
    def local(path: str) -> str:
        return os.path.abspath(path) if os.path.exists(path) else path

    ref_path = local(cfg.model.ref_path) if cfg.model.ref_path else cfg.model.ref_path
    model = dataclasses.replace(cfg.model, path=local(cfg.model.path), ref_path=ref_path)
    python = cfg.engine.python
    if python and os.sep in python:
        python = os.path.abspath(python)
    return dataclasses.replace(cfg, model=model, engine=dataclasses.replace(cfg.engine, python=python),
                               run=dataclasses.replace(cfg.run, output_dir=os.path.abspath(cfg.run.output_dir)))


def mark_output_dir(output_dir: str) -> str:
    """Write a fresh token into ``output_dir`` (which must exist) for :func:`check_node_paths`; the token."""
    token = secrets.token_hex(8)
    (Path(output_dir) / MARKER).write_text(token)
    return token


def check_node_paths(cfg: Config, token: str | None, who: str) -> None:
    """:class:`ConfigError` naming ``who``, this node and each problem, unless this node sees
    ``model.path`` (and ``model.ref_path``) where the driver does and the driver's
    ``run.output_dir`` (the ``token`` of :func:`mark_output_dir` in it; None: not checked)."""
    problems = []
    for key, path in (("model.path", cfg.model.path), ("model.ref_path", cfg.model.ref_path)):
        if path and os.path.isabs(path) and not os.path.exists(path):
            problems.append(f"{key} {path} does not exist there (every node needs the model at the same path)")
    marker = Path(cfg.run.output_dir) / MARKER
    if token is not None and (not marker.exists() or marker.read_text() != token):
        problems.append(
            f"run.output_dir {cfg.run.output_dir} there is not the driver's (checkpoints and the weights engines "
            "load are written there by every node: put it on a file system all nodes share)"
        )
    if problems:
        raise ConfigError(f"{who} on node {node_address()}: " + "; ".join(problems))
