"""linearise_trees: every leaf its own chain; packing those is linear training (the GRPO baseline)."""

import random

import pytest
import torch
from test_tree_vs_linear import assert_close, random_advantages, random_tree, tiny

from arbor.train.packed_loss import pack_loss, policy_loss
from arbor.train.packing import linearise_trees, loss_denominator, pack_trees
from arbor.tree import RolloutTree


def fork_tree() -> RolloutTree:
    # prompt [1, 2]; a = [3, 4] → b = [5] (R=1), c = [6, 7] (R=0, loss mask 0,1)
    tree = RolloutTree([1, 2], problem={"id": "fork", "answer": "4"})
    a = tree.add_segment(tree.root, [3, 4], logprobs=[-0.1, -0.2])
    b = tree.add_segment(a, [5], logprobs=[-0.3])
    c = tree.add_segment(a, [6, 7], logprobs=[-0.4, -0.5], loss_mask=[0, 1])
    b.reward, c.reward = 1.0, 0.0
    b.finish_reason, c.finish_reason = "stop", "max_length"
    return tree


def test_each_leaf_becomes_a_chain_by_hand():
    tree = fork_tree()
    chains, adv = linearise_trees([tree], [[0.5, -0.5]])
    assert adv == [[0.5], [-0.5]]
    assert [c.full_ids(c.leaves()[0]) for c in chains] == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7]]
    b, c = (chain.leaves()[0] for chain in chains)
    assert chains[1].response_logprobs(c) == [-0.1, -0.2, -0.4, -0.5]
    assert chains[1].response_loss_mask(c) == [1, 1, 0, 1]
    assert (b.reward, b.finish_reason, c.reward, c.finish_reason) == (1.0, "stop", 0.0, "max_length")
    assert [n.depth for n in chains[1].path(c)] == [1, 2]  # segments stay nodes
    assert all(chain.problem is tree.problem for chain in chains)
    assert all(len(chain.leaves()) == 1 for chain in chains)


def test_per_token_advantages_follow_their_leaf():
    _, adv = linearise_trees([fork_tree()], [[[1.0, 2.0, 3.0], [-1.0, 1.0, -4.0, 5.0]]])
    assert adv == [[[1.0, 2.0, 3.0]], [[-1.0, 1.0, -4.0, 5.0]]]


def test_wrong_advantage_count_names_the_problem():
    with pytest.raises(ValueError, match="problem 'fork': 1 advantages for 2 leaves"):
        linearise_trees([fork_tree()], [[1.0]])
    with pytest.raises(ValueError, match="2 advantage lists for 1 trees"):
        linearise_trees([fork_tree()], [[1.0, 0.0], [1.0]])


def test_unique_tokens_of_chains_are_the_linearised_tokens():
    rng = random.Random(3)
    trees = [random_tree(rng, i) for i in range(6)]
    chains, _ = linearise_trees(trees, [[0.0] * len(t.leaves()) for t in trees])
    linearised = sum(t.stats().linearised_tokens for t in trees)
    assert sum(c.stats().unique_tokens for c in chains) == linearised
    assert sum(c.stats().linearised_tokens for c in chains) == linearised  # nothing shared left
    assert sum(p.num_tokens for p in pack_trees(chains)) == linearised
    for normalize in ("token", "sequence"):
        assert loss_denominator(chains, normalize) == loss_denominator(trees, normalize)


@pytest.mark.parametrize("normalize", ["token", "sequence"])
@pytest.mark.parametrize("per_token", [False, True])
def test_packed_chains_equal_the_linear_loss_float64(normalize, per_token):
    # The learner's path: pack_trees on the chains, pack_loss per pack with the global
    # denominator, gradients accumulated; the reference is policy_loss(mode="padded").
    seed = 20 + 2 * per_token + (normalize == "sequence")
    rng = random.Random(seed)
    trees = [random_tree(rng, i) for i in range(4)]
    advantages = random_advantages(rng, trees, per_token)
    model = tiny("qwen2", torch.float64, seed)
    model.zero_grad()
    ref_loss, ref_metrics = policy_loss(model, trees, advantages, mode="padded", normalize=normalize)
    ref_loss.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]

    chains, chain_adv = linearise_trees(trees, advantages)
    longest = max(len(c.prompt_ids) + c.leaves()[0].end for c in chains)
    packs = pack_trees(chains, chain_adv, pack_tokens=2 * longest, normalize=normalize)
    assert len(packs) > 1  # accumulation over packs is exercised
    denominator = loss_denominator(chains, normalize)
    model.zero_grad()
    total, sums = 0.0, None
    for pack in packs:
        loss, s = pack_loss(model, pack, denominator)
        loss.backward()
        total += loss.item()
        sums = s if sums is None else sums + s
    assert total == pytest.approx(ref_loss.item(), rel=1e-6, abs=1e-12)
    for ref, p in zip(ref_grads, model.parameters()):
        assert_close(ref, p.grad, 1e-6)
    metrics = sums.stats.metrics()
    for name in ("loss", "clip_fraction", "approx_kl", "entropy", "logprob_gap", "linearised_tokens"):
        assert metrics[name] == pytest.approx(ref_metrics[name], rel=1e-6, abs=1e-9), name
    assert metrics["tokens"] == ref_metrics["tokens"]  # linear: every trained token unique
