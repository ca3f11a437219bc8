"""Ranks' shares of a batch balanced by tokens (arbor.train.rank_balance): every token trained
once over the ranks, the loss and gradients of the whole batch, big trees split into subtrees."""

import random
from collections import Counter

import pytest
import torch
from test_tree_vs_linear import assert_close, loss_and_grads, random_advantages, random_tree, tiny

from arbor.train.packed_loss import pack_loss
from arbor.train.packing import loss_denominator, pack_trees
from arbor.train.rank_balance import balance_trees, rank_imbalance, rank_packs, tree_tokens
from arbor.tree import RolloutTree


def chain(tokens: int, problem: str) -> RolloutTree:
    """A prompt of 2 tokens and one response of ``tokens - 2``."""
    tree = RolloutTree([1, 2], problem={"id": problem})
    tree.add_segment(tree.root, [3] * (tokens - 2), logprobs=[-1.0] * (tokens - 2))
    return tree


def test_trees_go_largest_first_to_the_least_loaded_rank():
    trees = [chain(n, str(i)) for i, n in enumerate([10, 60, 30, 40])]
    shares = balance_trees(trees, 2)
    # 60 -> rank 0; 40 -> rank 1; 30 -> rank 1 (40 < 60); 10 -> rank 0 (60 < 70).
    assert [[t for t, nodes in enumerate(s.train_only) if nodes is None] for s in shares] == [[0, 1], [2, 3]]
    assert [s.tokens for s in shares] == [70, 70]
    # One rank keeps everything, whole.
    (alone,) = balance_trees(trees, 1)
    assert alone.train_only == [None] * 4 and alone.tokens == 140


def test_balance_follows_tokens_not_tree_counts():
    # Four trees that fit one pack: dealing out packs gave one rank everything.
    trees = [chain(n, str(i)) for i, n in enumerate([50, 50, 50, 50])]
    assert len(pack_trees(trees, None, require_logprobs=False)) == 1
    per_rank, tokens = rank_packs(trees, None, 2, require_logprobs=False)
    assert tokens == [100, 100] and rank_imbalance(tokens) == 1.0
    assert rank_imbalance([150, 50]) == 1.5 and rank_imbalance([0, 0]) == 1.0


def test_a_tree_larger_than_a_ranks_share_is_split_into_subtrees():
    # One prompt of 20 tokens, 8 branches of 30: 260 tokens for 4 ranks (65 each).
    tree = RolloutTree(list(range(20)), problem={"id": "wide"})
    for b in range(8):
        tree.add_segment(tree.root, [b] * 30, logprobs=[-1.0] * 30)
    per_rank, tokens = rank_packs([tree], [[1.0] * 8], 4)
    assert all(packs for packs in per_rank)  # every rank has a part
    # Each part forwards the prompt again as context: 4 × 20 + 8 × 30 tokens in all.
    assert sum(tokens) == 4 * 20 + 8 * 30 == tree_tokens(tree) + 3 * 20
    assert rank_imbalance(tokens) == 1.0


@pytest.mark.parametrize("seed", range(12))
def test_every_token_is_trained_once_over_the_ranks(seed):
    rng = random.Random(seed)
    trees = [random_tree(rng, i) for i in range(rng.randint(1, 6))]
    world = rng.randint(1, 8)
    per_rank, tokens = rank_packs(trees, None, world, pack_tokens=rng.choice([4096, 24]), require_logprobs=False)
    assert len(per_rank) == world and tokens == [sum(p.num_tokens for p in packs) for packs in per_rank]
    owned = Counter(pack.origin[i] for packs in per_rank for pack in packs for i in pack.owned.nonzero()[:, 0].tolist())
    want = Counter((t, node.id, k) for t, tree in enumerate(trees) for node in tree.nodes()
                   if node.parent is not None for k in range(len(node.token_ids)))
    assert owned == want


@pytest.mark.parametrize("seed, world", [(0, 2), (1, 3), (2, 5)])
def test_the_ranks_gradients_add_up_to_the_linear_batch_float64(seed, world):
    rng = random.Random(seed)
    trees = [random_tree(rng, i) for i in range(3)]
    advantages = random_advantages(rng, trees, per_token=bool(seed % 2))
    model = tiny("qwen2", torch.float64, seed)
    lin_loss, lin_grads, _ = loss_and_grads(model, trees, advantages, mode="padded", normalize="sequence")
    model.zero_grad()
    denominator = loss_denominator(trees, "sequence")
    per_rank, _ = rank_packs(trees, advantages, world, normalize="sequence")
    total = sum(pack_loss(model, pack, denominator)[0] for packs in per_rank for pack in packs)
    total.backward()
    assert total.item() == pytest.approx(lin_loss.item(), rel=1e-9, abs=1e-12)
    for a, p in zip(lin_grads, model.parameters()):
        assert_close(a, p.grad, 1e-6)
