"""Depth-first tree execution (learner.tree_execution: dfs) equals linear training: loss,
gradients and metrics, with every loss setting; its plan on a hand-made tree; its refusals.

The random trees are test_tree_vs_linear's (random shapes, branch points inside segments,
masked segments, several trees and partitioned trees per pack, empty nodes).
"""

import functools
import random

import pytest
import torch
from test_tree_vs_linear import (
    assert_close,
    budget,
    loss_and_grads,
    random_advantages,
    random_case,
    random_tree,
    tiny,
    tree_with_empty_nodes,
)

from arbor.train.dfs import DfsWalk, dfs_token_logprobs, plan_walk
from arbor.train.logprobs import pack_token_logprobs
from arbor.train.packed_loss import PolicyObjective, pack_loss, policy_backward
from arbor.train.packing import loss_denominator, pack_trees
from arbor.train.rollout_correction import (
    Correction,
    attach_learner_logprobs,
    leaf_correction_weights,
)
from arbor.tree import RolloutTree


def dfs_loss_and_grads(model, trees, advantages, **kw):
    model.zero_grad()
    loss, metrics = policy_backward(model, trees, advantages, execution="dfs", **kw)
    return loss, [p.grad.clone() for p in model.parameters()], metrics


CASES = [
    # (seed, model, normalize, kl, entropy_coef, per_token, slack, group_tokens, chunk_tokens)
    # slack as in test_tree_vs_linear (None: one pack; small: partitioned trees); group_tokens
    # 1: every chain its own forward; 8: a few siblings batched; 4096: all siblings at once.
    (0, "qwen2", "token", None, 0.0, False, None, 4096, 0),
    (1, "qwen2", "sequence", None, 0.0, False, None, 1, 3),
    (2, "llama", "token", "k3", 0.01, False, 0, 8, 0),
    (3, "llama", "sequence", "k1", 0.0, True, 2, 8, 2),
    (4, "qwen2", "token", "k1", 0.05, True, 5, 1, 0),
    (5, "qwen2", "sequence", "k3", 0.02, False, 1, 4096, 5),
]


@pytest.mark.parametrize("seed, kind, normalize, kl, entropy_coef, per_token, slack, group_tokens, chunk", CASES)
def test_dfs_equals_linear_float64(seed, kind, normalize, kl, entropy_coef, per_token, slack, group_tokens, chunk):
    trees, advantages, model, kw = random_case(seed, kind, normalize, kl, entropy_coef, per_token)
    lin_loss, lin_grads, lin_m = loss_and_grads(model, trees, advantages, mode="padded", **kw)
    loss, grads, metrics = dfs_loss_and_grads(model, trees, advantages, pack_tokens=budget(trees, slack),
                                              group_tokens=group_tokens, chunk_tokens=chunk, **kw)
    assert loss == pytest.approx(lin_loss.item(), rel=1e-6, abs=1e-12)
    for a, b in zip(lin_grads, grads):
        assert_close(a, b, 1e-6)
    for name in ("clip_fraction", "approx_kl", "entropy", "logprob_gap", "kl", "linearised_tokens"):
        assert metrics[name] == pytest.approx(lin_m[name], rel=1e-6, abs=1e-9), name


@pytest.mark.parametrize("seed", range(4))
def test_dfs_with_empty_nodes_equals_linear_float64(seed):
    rng = random.Random(200 + seed)
    trees = [tree_with_empty_nodes(rng, i) for i in range(3)]
    advantages = random_advantages(rng, trees, per_token=bool(seed % 2))
    model = tiny("qwen2", torch.float64, seed)
    kw = dict(normalize=["token", "sequence"][seed % 2], entropy_coef=0.01)
    lin_loss, lin_grads, _ = loss_and_grads(model, trees, advantages, mode="padded", **kw)
    loss, grads, _ = dfs_loss_and_grads(model, trees, advantages, pack_tokens=budget(trees, [None, 0, 2, 4][seed]),
                                        group_tokens=[1, 6, 4096, 3][seed], **kw)
    assert loss == pytest.approx(lin_loss.item(), rel=1e-6, abs=1e-12)
    for a, b in zip(lin_grads, grads):
        assert_close(a, b, 1e-6)


@pytest.mark.parametrize("dtype, loss_rtol, grad_rtol", [(torch.float32, 1e-4, 1e-4), (torch.bfloat16, 1e-2, 5e-2)])
def test_dfs_equals_linear_in_low_precision(dtype, loss_rtol, grad_rtol):
    # The tolerances of test_tree_vs_linear's: the walk runs other kernels than the padded rows.
    rng = random.Random(21)
    trees = [random_tree(rng, i) for i in range(3)]
    advantages = random_advantages(rng, trees, per_token=False)
    model = tiny("qwen2", dtype, 21)
    lin_loss, lin_grads, _ = loss_and_grads(model, trees, advantages, mode="padded")
    loss, grads, _ = dfs_loss_and_grads(model, trees, advantages, group_tokens=6)
    assert loss == pytest.approx(lin_loss.item(), rel=loss_rtol, abs=1e-7)
    for a, b in zip(lin_grads, grads):
        assert_close(a.float(), b.float(), grad_rtol)


def walk_backward(model, pack, objective, group_tokens):
    """One pack's depth-first backward; its summed loss value."""
    select = pack.trained.nonzero()[:, 0]
    walk = DfsWalk(model, pack, select, group_tokens=group_tokens, token_loss=functools.partial(objective.with_stats, pack))
    for _ in walk.ops():
        pass
    return sum(r.loss for r in walk.records)


@pytest.mark.parametrize("mode, level, behaviour_cap", [
    ("tis", "token", None), ("mis", "token", None), ("tis", "sequence", None), ("mis", "sequence", None),
    ("none", "token", 1.5),  # the decoupled off-policy objective
])
def test_dfs_with_rollout_correction_equals_packed_float64(mode, level, behaviour_cap):
    # Packed training is exact against linear with every correction (test_rollout_correction);
    # the walk must be exact against packed, pack by pack, with the same columns.
    rng = random.Random(7)
    trees = [random_tree(rng, i) for i in range(3)]
    advantages = random_advantages(rng, trees, per_token=False)
    model = tiny("qwen2", torch.float64, 7)
    correction = Correction(mode, level, cap=1.2, bounds=(0.8, 1.25))
    if correction.recompute:  # π_old: the learner's log-probs, here the model's perturbed a little
        packs = pack_trees(trees, None)
        logps = [pack_token_logprobs(model, p, p.trained.nonzero()[:, 0])[0].detach() for p in packs]
        attach_learner_logprobs(trees, packs, [lp + 0.3 * torch.randn(lp.shape, dtype=lp.dtype) for lp in logps])
    weights = leaf_correction_weights(trees, correction)[0] if level == "sequence" and correction.recompute else None
    packs = pack_trees(trees, advantages, pack_tokens=budget(trees, 2), correction_weights=weights)
    objective = PolicyObjective(loss_denominator(trees, "token"), behaviour_cap=behaviour_cap,
                                correction=correction if correction.recompute else None)
    model.zero_grad()
    packed = sum(pack_loss(model, p, objective.denominator, behaviour_cap=behaviour_cap,
                           correction=objective.correction)[0] for p in packs)
    packed.backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    walked = sum(walk_backward(model, p, objective, group_tokens=5) for p in packs)
    assert walked == pytest.approx(packed.item(), rel=1e-9, abs=1e-12)
    for a, p in zip(reference, model.parameters()):
        assert_close(a, p.grad, 1e-6)


def test_dfs_trains_a_lora_adapter_exactly():
    from peft import LoraConfig, get_peft_model

    rng = random.Random(3)
    trees = [random_tree(rng, i) for i in range(3)]
    advantages = random_advantages(rng, trees, per_token=False)
    model = get_peft_model(tiny("qwen2", torch.float64, 3), LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    for name, p in model.named_parameters():  # B starts at 0: make the adapter act
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    trained = [p for p in model.parameters() if p.requires_grad]
    grads = {}
    for execution in ("packed", "dfs"):
        model.zero_grad()
        policy_backward(model, trees, advantages, execution=execution, group_tokens=4)
        grads[execution] = [p.grad.clone() for p in trained]
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    for a, b in zip(grads["packed"], grads["dfs"]):
        assert_close(a, b, 1e-6)


def test_forward_only_walk_gives_the_packed_logprobs():
    rng = random.Random(5)
    trees = [random_tree(rng, i) for i in range(4)]
    model = tiny("llama", torch.float64, 5)
    for pack in pack_trees(trees, None, pack_tokens=budget(trees, 3), require_logprobs=False):
        select = pack.owned.nonzero()[:, 0]
        want_logp, want_entropy = pack_token_logprobs(model, pack, select, temperature=0.7)
        logp, entropy = dfs_token_logprobs(model, pack, select, group_tokens=3, temperature=0.7, chunk_tokens=2)
        torch.testing.assert_close(logp, want_logp.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(entropy, want_entropy.detach(), rtol=1e-10, atol=1e-12)


def hand_tree() -> RolloutTree:
    """prompt [1, 2] -> a [3, 4] -> {b [5], c [6, 7] -> d [8]}, and e [9] under the prompt."""
    tree = RolloutTree([1, 2], problem={"id": "hand"})
    a = tree.add_segment(tree.root, [3, 4], logprobs=[-1.0, -1.0])
    tree.add_segment(a, [5], logprobs=[-1.0])
    c = tree.add_segment(a, [6, 7], logprobs=[-1.0, -1.0])
    tree.add_segment(c, [8], logprobs=[-1.0])
    tree.add_segment(tree.root, [9], logprobs=[-1.0])
    return tree


def test_plan_of_a_hand_made_tree():
    (pack,) = pack_trees([hand_tree()], [[1.0, 1.0, 1.0]])
    assert pack.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    select = pack.trained.nonzero()[:, 0]
    # Chains: the prompt (it branches), a (branches), b, c+d (c's only child d), e.
    plan = plan_walk(pack, select, group_tokens=4096)
    assert plan.chains == [(0, 2), (2, 4), (4, 5), (5, 8), (8, 9)]
    assert plan.ancestors == [[], [0], [0, 1], [0, 1], [0]]
    assert plan.parents == {0, 1}
    # Groups: the prompt; {a, e} (longest first); {c+d, b} below a.
    assert [(g.members, g.past, g.width) for g in plan.groups] == [([0], 0, 2), ([1, 4], 2, 2), ([3, 2], 4, 3)]
    assert plan.ops() == "FFFBBB" and plan.forward_tokens() == 2 + 4 + 6
    # The prompt's last row predicts a's and e's first tokens; a's last row b's and c's.
    assert plan.groups[0].keep.tolist() == [1] and plan.groups[0].rows.tolist() == [0, 0]
    assert pack.input_ids[select[plan.groups[0].scored]].tolist() == [3, 9]
    # One chain per forward: the walk's calls follow the tree.
    plan = plan_walk(pack, select, group_tokens=1)
    assert sorted(g.members for g in plan.groups) == [[0], [1], [2], [3], [4]]
    assert plan.ops() == "FFFBFBBFBB"  # prompt (a (c+d) (b)) (e)


def test_cousins_with_equally_long_paths_share_a_forward_float64():
    # Two trees with 3-token prompts, each forking in two: the four second-level chains of both
    # trees have paths of 5 tokens and run in one batch, each row with its own tree's cache.
    trees = []
    for t in range(2):
        tree = RolloutTree([1 + t, 2, 3], problem={"id": t})
        for a in range(2):
            node = tree.add_segment(tree.root, [4 + a, 5], logprobs=[-1.0, -1.0])
            for b in range(2):
                tree.add_segment(node, [6 + b + t, 7, 8], logprobs=[-1.0] * 3)
        trees.append(tree)
    advantages = [[1.0, -0.5, 0.25, 2.0], [-1.0, 0.5, 1.5, -0.75]]
    (pack,) = pack_trees(trees, advantages)
    plan = plan_walk(pack, pack.trained.nonzero()[:, 0], group_tokens=4096)
    assert [(len(g.members), g.past) for g in plan.groups] == [(2, 0), (4, 3), (8, 5)]
    assert plan.ops() == "FFFBBB"
    model = tiny("qwen2", torch.float64, 9)
    lin_loss, lin_grads, _ = loss_and_grads(model, trees, advantages, mode="padded")
    loss, grads, _ = dfs_loss_and_grads(model, trees, advantages)
    assert loss == pytest.approx(lin_loss.item(), rel=1e-9)
    for a, b in zip(lin_grads, grads):
        assert_close(a, b, 1e-6)


def test_a_walk_refuses_gradient_checkpointing_and_the_config_names_both_keys():
    from arbor.config_load import load_config
    from arbor.errors import ConfigError

    model = tiny("qwen2", torch.float64)
    model.gradient_checkpointing_enable()
    (pack,) = pack_trees([hand_tree()], [[1.0, 1.0, 1.0]])
    objective = PolicyObjective(1.0)
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        DfsWalk(model, pack, pack.trained.nonzero()[:, 0], group_tokens=8,
                token_loss=functools.partial(objective.with_stats, pack))
    with pytest.raises(ConfigError, match="learner.tree_execution dfs needs model.gradient_checkpointing: false"):
        load_config(None, ["learner.tree_execution=dfs", "model.gradient_checkpointing=true"])
    with pytest.raises(ConfigError, match="learner.dfs_group_tokens must be ≥ 1"):
        load_config(None, ["learner.dfs_group_tokens=0"])
    with pytest.raises(ValueError, match="execution must be 'packed' or 'dfs'"):
        policy_backward(model, [hand_tree()], [[1.0, 1.0, 1.0]], execution="tree")


class _RaisingModel(torch.nn.Module):
    """A KL reference that must never run (kl_coef 0)."""

    def forward(self, *args, **kwargs):
        raise AssertionError("the KL reference ran with kl_coef 0")


@pytest.mark.parametrize("execution", [None, "packed", "dfs"])
def test_policy_backward_runs_each_execution_as_documented_float64(execution, monkeypatch):
    # As the learner runs it (None: the default, packed): the padded reference's loss, gradients
    # and metrics with a temperature, a KL reference, sequence normalisation and several packs;
    # packed runs one pack_loss a pack of pack_tokens and no walk, dfs one walk over whole trees.
    import arbor.train.packed_loss as packed_loss

    calls = {"pack_loss": 0, "walk": 0}

    def counted_pack_loss(*args, **kwargs):
        calls["pack_loss"] += 1
        return pack_loss(*args, **kwargs)

    class CountedWalk(DfsWalk):
        def __init__(self, *args, **kwargs):
            calls["walk"] += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(packed_loss, "pack_loss", counted_pack_loss)
    monkeypatch.setattr(packed_loss, "DfsWalk", CountedWalk)
    trees, advantages, model, kw = random_case(3, "qwen2", "sequence", "k3", 0.02, True)
    kw.update(temperature=0.7, clip_low=0.1, clip_high=0.15)
    lin_loss, lin_grads, lin_m = loss_and_grads(model, trees, advantages, mode="padded", **kw)
    pack_tokens = budget(trees, 0)
    packs = len(pack_trees(trees, advantages, pack_tokens=pack_tokens, normalize="sequence"))
    assert packs > 1
    model.zero_grad()
    chosen = {} if execution is None else {"execution": execution}
    loss, metrics = policy_backward(model, trees, advantages, pack_tokens=pack_tokens, group_tokens=5, **chosen, **kw)
    assert calls == ({"pack_loss": 0, "walk": 1} if execution == "dfs" else {"pack_loss": packs, "walk": 0})
    assert loss == pytest.approx(lin_loss.item(), rel=1e-6, abs=1e-12)
    for a, p in zip(lin_grads, model.parameters()):
        assert_close(a, p.grad, 1e-6)
    for name in ("clip_fraction", "approx_kl", "entropy", "logprob_gap", "kl", "linearised_tokens"):
        assert metrics[name] == pytest.approx(lin_m[name], rel=1e-6, abs=1e-9), name
    assert metrics["kl"] > 0
    # kl_coef 0: a reference given is never run; kl_coef > 0 without one is refused.
    kw.update(kl_coef=0.0, ref_model=_RaisingModel())
    policy_backward(model, trees, advantages, **chosen, **kw)
    kw.update(kl_coef=0.1, ref_model=None)
    with pytest.raises(ValueError, match="^kl_coef > 0 needs a ref_model$"):
        policy_backward(model, trees, advantages, **chosen, **kw)


def test_dfs_walks_whole_trees_past_the_packed_budget(monkeypatch):
    # dfs packs whole trees (one path's activations are what it keeps), however many tokens
    # they hold: two trees of 9,000 response tokens, more than pack_trees' 16,384 default,
    # reach the walk as one pack. The walk is recorded, not run.
    import arbor.train.packed_loss as packed_loss

    walked = []

    class RecordedWalk:
        def __init__(self, model, pack, select, **kwargs):
            walked.append(int(pack.input_ids.numel()))
            self.records = []

        def ops(self):
            return iter(())

    monkeypatch.setattr(packed_loss, "DfsWalk", RecordedWalk)
    trees = []
    for t in range(2):
        tree = RolloutTree([1, 2], problem={"id": t})
        tree.add_segment(tree.root, [3] * 9000, logprobs=[-1.0] * 9000)
        trees.append(tree)
    policy_backward(tiny("qwen2", torch.float64), trees, [[1.0], [-1.0]], execution="dfs", pack_tokens=100)
    assert walked == [2 * 9002]
