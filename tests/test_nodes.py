"""arbor.run.nodes: which placements can never fit, the paths every node needs, absolute paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from arbor.config_load import load_config
from arbor.errors import ConfigError
from arbor.run.nodes import (
    MARKER,
    Node,
    check_node_paths,
    mark_output_dir,
    placement_problem,
    with_absolute_paths,
)

TWO = [Node("10.0.0.1", {"CPU": 4, "node:10.0.0.1": 1, "memory": 8e9}), Node("10.0.0.2", {"CPU": 2, "trainer": 1})]
LABELS = ["learner rank 0", "learner rank 1", "engine 0"]


def test_strict_spread_needs_a_node_per_bundle():
    problem = placement_problem([{"CPU": 1}] * 3, LABELS, "STRICT_SPREAD", TWO)
    assert problem == ("ray.placement_strategy=STRICT_SPREAD puts each of the 3 bundles (learner rank 0, learner rank 1, "
                       "engine 0) on a node of its own, and the cluster has 2 alive nodes: use SPREAD or PACK, or fewer "
                       "learner ranks or engines")
    assert placement_problem([{"CPU": 1}] * 2, LABELS[:2], "STRICT_SPREAD", TWO) is None
    # Two bundles, two nodes, but both bundles want the one node that offers `trainer`.
    problem = placement_problem([{"CPU": 1, "trainer": 1}] * 2, LABELS[:2], "STRICT_SPREAD", TWO)
    assert problem is not None and "do not fit on distinct nodes" in problem
    # The first bundle takes node 2 first, then gives way to the one that only node 2 can hold.
    assert placement_problem([{"CPU": 1}, {"CPU": 1, "trainer": 1}], LABELS[:2], "STRICT_SPREAD", TWO[::-1]) is None


def test_a_bundle_no_node_offers_names_it_and_what_the_nodes_have():
    problem = placement_problem([{"CPU": 1}, {"CPU": 1, "rollout": 1}], ["learner rank 0", "engine 0"], "PACK", TWO)
    assert problem == ("engine 0 asks for {CPU: 1, rollout: 1}, which no node of the cluster offers "
                       "(nodes: 10.0.0.1 {CPU: 4}; 10.0.0.2 {CPU: 2, trainer: 1})")
    assert placement_problem([{"CPU": 5}], ["learner rank 0"], "SPREAD", TWO) is not None


def test_pack_and_spread_need_the_totals_strict_pack_one_node():
    assert placement_problem([{"CPU": 2}] * 3, LABELS, "PACK", TWO) is None  # 6 CPUs of 6
    problem = placement_problem([{"CPU": 2}] * 4, LABELS + ["engine 1"], "SPREAD", TWO)
    assert problem is not None and "need CPU 8 in all, and the cluster's alive nodes offer 6" in problem
    assert placement_problem([{"CPU": 1}] * 4, LABELS + ["engine 1"], "STRICT_PACK", TWO) is None  # node 1: 4 CPUs
    problem = placement_problem([{"CPU": 1}] * 5, LABELS + ["engine 1", "engine 2"], "STRICT_PACK", TWO)
    assert problem is not None and "STRICT_PACK puts all 5 bundles on one node, which needs {CPU: 5}" in problem
    assert placement_problem([{"CPU": 1}], ["learner rank 0"], "PACK", []) == "the Ray cluster has no alive node"


def test_actors_get_absolute_paths_and_a_hub_name_stays(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    cfg = with_absolute_paths(load_config(None, ["model.path=m", "run.output_dir=runs/x", "engine.python=venv/bin/python"]))
    assert (cfg.model.path, cfg.run.output_dir) == (str(tmp_path / "m"), str(tmp_path / "runs" / "x"))
    assert cfg.engine.python == str(tmp_path / "venv" / "bin" / "python")
    hub = with_absolute_paths(load_config(None, ["model.path=Qwen/Qwen2.5-0.5B", "engine.python=python3"]))
    assert (hub.model.path, hub.engine.python) == ("Qwen/Qwen2.5-0.5B", "python3")


def test_a_node_missing_the_model_or_the_output_dir_is_named(tmp_path, monkeypatch):
    import arbor.run.nodes as nodes

    monkeypatch.setattr(nodes, "node_address", lambda: "10.0.0.2")
    (tmp_path / "m").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    cfg = load_config(None, [f"model.path={tmp_path / 'm'}", f"run.output_dir={out}"])
    token = mark_output_dir(str(out))
    check_node_paths(cfg, token, "learner rank 1")  # this node sees both
    check_node_paths(cfg, None, "learner rank 1")
    (out / MARKER).write_text("another run's token")  # another directory at the same path
    with pytest.raises(ConfigError, match=rf"^learner rank 1 on node 10.0.0.2: run.output_dir {out} there is not the driver's"):
        check_node_paths(cfg, token, "learner rank 1")
    gone = load_config(None, [f"model.path={tmp_path / 'gone'}", f"run.output_dir={out}"])
    with pytest.raises(ConfigError, match=rf"^engine 0 on node 10.0.0.2: model.path {tmp_path / 'gone'} does not exist there"):
        check_node_paths(gone, None, "engine 0")
    assert Path(out / MARKER).read_text() != token
