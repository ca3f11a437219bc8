"""Multi-node: two ZeRO-3 learner ranks on two simulated Ray nodes give the single-process gradient.

``ray.cluster_utils.Cluster`` starts two Ray nodes on this machine (one CPU each);
arbor's own ``start_ray`` joins the cluster by address and its ``Placement`` spreads the
learner bundles over both nodes (``ray.placement_strategy: STRICT_SPREAD``). Each rank is
arbor's ``LearnerWorker`` (rank variables, rank 0's node address, DeepSpeed over gloo),
held by a probe actor that returns the whole accumulated gradient after one backward.
"""

import os
from pathlib import Path

import pytest
import ray
import torch
from test_learner import batch, config, tiny_model_dir
from transformers import Qwen2ForCausalLM

from arbor.train.packed_loss import policy_loss


class GradientProbe:
    """A :class:`~arbor.run.learner_group.LearnerWorker` and the gradient of its share of ``batch()``."""

    def __init__(self, cfg, rank: int) -> None:
        from arbor.run.learner_group import LearnerWorker

        self.rank = rank
        self.worker = LearnerWorker(cfg, rank)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def address(self) -> tuple[str, int]:
        return self.worker.address()

    def setup(self, master: tuple[str, int]) -> None:
        self.worker.setup(master, total_steps=1)

    def gradients(self) -> dict[str, torch.Tensor]:
        """Backward over this rank's packs; the whole (all-reduced) gradient of every parameter."""
        from deepspeed.utils import safe_get_full_grad

        from arbor.train.packing import assign_to_ranks, loss_denominator, pack_trees

        trees, advantages = batch()
        packs = pack_trees(trees, advantages, pack_tokens=20)
        mine = [packs[i] for i in assign_to_ranks(packs, 2)[self.rank]]
        learner = self.worker.learner
        denominator = loss_denominator(trees, "token")
        learner.backward(mine, lambda model, pack: learner.policy_pack_loss(model, pack, denominator))
        # Collective under ZeRO-3 (gathers the gradient partitions): both ranks, same order.
        return {name: safe_get_full_grad(p).detach().cpu().clone() for name, p in learner.model.named_parameters()}


def test_two_ranks_on_two_nodes_give_the_single_process_gradient(tmp_path, monkeypatch):
    from ray.cluster_utils import Cluster

    from arbor.run.orchestration import Placement, start_ray

    path = tiny_model_dir(tmp_path / "m")
    # The probe actors import this module: the workers need tests/ on their path.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    try:
        cfg = config(path, "learner.backend=deepspeed", "learner.zero_stage=3", "learner.num_ranks=2",
                     "engine.kind=external", "engine.urls=[http://127.0.0.1:1]", f"ray.address={cluster.address}",
                     "ray.placement_strategy=STRICT_SPREAD")
        start_ray(cfg.ray, needs_cpus=2)
        placement = Placement(cfg)
        probe = ray.remote(GradientProbe)
        probes = [probe.options(**placement.learner_options(rank)).remote(cfg, rank) for rank in range(2)]
        nodes = ray.get([p.node.remote() for p in probes])
        assert len(set(nodes)) == 2, "the two ranks share a node"
        assert nodes[0] == ray.get_runtime_context().get_node_id(), "rank 0 is not on the driver's node"
        master = ray.get(probes[0].address.remote())
        ray.get([p.setup.remote(master) for p in probes])
        grads = ray.get([p.gradients.remote() for p in probes], timeout=300)
        placement.remove()
    finally:
        ray.shutdown()
        cluster.shutdown()

    trees, advantages = batch()
    reference = Qwen2ForCausalLM.from_pretrained(path)
    policy_loss(reference, trees, advantages, mode="padded")[0].backward()
    for rank_grads in grads:
        assert rank_grads.keys() == dict(reference.named_parameters()).keys()
        for name, param in reference.named_parameters():
            torch.testing.assert_close(rank_grads[name], param.grad, rtol=1e-4, atol=1e-7)


def test_a_run_needing_more_gpus_than_the_local_ray_instance_fails_at_once(tmp_path, monkeypatch):
    """A 1-GPU machine with an embedded engine and a learner on CUDA needs 2 GPUs unless
    colocated (seen on an H100: the placement group waited its whole 600 s). A local
    instance never grows, so the run stops at once with the keys to change. Here the
    instance has no GPU at all (num_gpus=1 would be a lie Ray would believe)."""
    import time

    from arbor.run.orchestration import Placement, gpu_shortfall, start_ray

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    cfg = config(tiny_model_dir(tmp_path / "m"), "learner.device=cuda", "engine.kind=embedded", "ray.num_gpus=0")
    start_ray(cfg.ray, needs_cpus=2)
    try:
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"places 2 GPUs \(learner.num_ranks=1 \+ engine.num_engines=1 × "
                                             r"engine.tp_size=1\), and the local Ray instance has 0: set ray.colocate"):
            Placement(cfg)
        assert time.monotonic() - start < 30
    finally:
        ray.shutdown()
    # Colocated, one GPU holds both; without engines to place, colocation is not the advice.
    colocated = config(tmp_path / "m", "learner.device=cuda", "ray.colocate=true", "learner.weight_sync=disk")
    assert gpu_shortfall(colocated, [{"CPU": 1, "GPU": 1}], 1) is None
    two_ranks = config(tmp_path / "m", "learner.device=cuda", "learner.num_ranks=2", "engine.kind=external",
                       "engine.urls=[http://127.0.0.1:1]")
    message = gpu_shortfall(two_ranks, [{"CPU": 1, "GPU": 1}] * 2, 1)
    assert message == "this run places 2 GPUs (learner.num_ranks=2), and the local Ray instance has 1"
    on_a_cluster = gpu_shortfall(two_ranks, [{"CPU": 1, "GPU": 1}] * 2, 1, "the Ray cluster's alive nodes have")
    assert on_a_cluster == "this run places 2 GPUs (learner.num_ranks=2), and the Ray cluster's alive nodes have 1"


def test_a_placement_that_waits_says_what_for_and_gives_up_with_the_reason(tmp_path, monkeypatch, capsys):
    """Another placement group holds the local instance's 2 CPUs: the run's group (2 bundles)
    could fit, so it waits, saying every WAIT_REPORT_S which bundles and what is free; past
    PLACEMENT_TIMEOUT_S it stops with that reason. Freed, it is placed."""
    import threading

    from ray.util.placement_group import placement_group, remove_placement_group

    import arbor.run.orchestration as orchestration
    from arbor.run.orchestration import Placement, PlacementError, start_ray

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setattr(orchestration, "WAIT_REPORT_S", 1.0)
    monkeypatch.setattr(orchestration, "PLACEMENT_TIMEOUT_S", 2.5)
    if ray.is_initialized():
        ray.shutdown()
    cfg = config(tiny_model_dir(tmp_path / "m"), "engine.kind=embedded", "ray.num_cpus=2")
    start_ray(cfg.ray, needs_cpus=2)
    try:
        blocker = placement_group([{"CPU": 2}])
        ray.get(blocker.ready(), timeout=60)
        with pytest.raises(PlacementError, match=r"could not place 2 bundles with ray.placement_strategy=PACK within "
                                                 r"2 s: learner rank 0 \{CPU: 1\}, engine 0 \{CPU: 1\} not placed yet"):
            Placement(cfg)
        err = capsys.readouterr().err
        assert "still waiting for Ray to place 2 bundles with ray.placement_strategy=PACK (1 s): learner rank 0 " \
               "{CPU: 1}, engine 0 {CPU: 1} not placed yet" in err and "free in the cluster now: {}" in err, err
        threading.Timer(1.5, remove_placement_group, [blocker]).start()
        monkeypatch.setattr(orchestration, "PLACEMENT_TIMEOUT_S", 60.0)
        placement = Placement(cfg)  # placed once the blocker is gone
        assert "still waiting" in capsys.readouterr().err
        placement.remove()
    finally:
        ray.shutdown()
