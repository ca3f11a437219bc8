"""Advantage estimators with hand-worked numbers (ALGORITHMS.md §2)."""

import math

import pytest

from arbor.advantage import (
    ESTIMATORS,
    dynamic_sampling_filter,
    grpo_advantages,
    reinforce_pp_advantages,
    tempo_advantages,
    treepo_advantages,
    whiten,
)
from arbor.tree import RolloutTree

approx = lambda xs: pytest.approx(xs, rel=1e-5, abs=1e-6)  # noqa: E731


def figure3_tree() -> RolloutTree:
    """The TreePO paper's Figure 3: q → c1, c2 → c11, c12, c21, c22 → 8 leaves.

    Leaf rewards, in creation order: c11: 1, 1 | c12: 1, 0 | c21: 0, 0 | c22: 1, 0.
    """
    tree = RolloutTree([7, 7], problem={"id": "fig3"})
    rewards = iter([1, 1, 1, 0, 0, 0, 1, 0])
    for i in range(2):
        c = tree.add_segment(tree.root, [10 + i])
        for j in range(2):
            cc = tree.add_segment(c, [20 + 2 * i + j])
            for k in range(2):
                leaf = tree.add_segment(cc, [30 + k])
                leaf.reward = float(next(rewards))
    return tree


def test_grpo_hand_numbers():
    tree = RolloutTree.from_sequences([1], [[2], [3], [4], [5]], rewards=[1, 0, 0, 1])
    # mean 0.5; std with ddof=1: sqrt(4 · 0.25 / 3) = 0.57735; 0.5 / 0.57735 = 0.866025
    assert grpo_advantages([tree])[0] == approx([0.866025, -0.866025, -0.866025, 0.866025])
    # Dr.GRPO: no std division
    assert grpo_advantages([tree], std_normalize=False)[0] == approx([0.5, -0.5, -0.5, 0.5])


def test_grpo_degenerate_groups():
    single = RolloutTree.from_sequences([1], [[2]], rewards=[3.0])
    same = RolloutTree.from_sequences([1], [[2], [3]], rewards=[1.0, 1.0])
    assert grpo_advantages([single, same]) == [[0.0], [0.0, 0.0]]


def test_treepo_figure3_mean():
    # Group means: all 0.5; c1 0.75, c2 0.25; c11 1, c12 0.5, c21 0, c22 0.5.
    # Leaf c22/1 (R=1): s = (1-0.5, 1-0.25, 1-0.5) = (0.5, 0.75, 0.5) → mean 1.75/3.
    # Leaf c11/1 (R=1): (0.5, 0.25, 0) → 0.25.  Leaf c12/1: (0.5, 0.25, 0.5) → 1.25/3.
    # Leaf c12/2 (R=0): (-0.5, -0.75, -0.5) → -1.75/3.  c21/*: (-0.5, -0.25, 0) → -0.25.
    # Leaf c22/2 (R=0): (-0.5, -0.25, -0.5) → -1.25/3.
    expected = [0.25, 0.25, 1.25 / 3, -1.75 / 3, -0.25, -0.25, 1.75 / 3, -1.25 / 3]
    assert treepo_advantages([figure3_tree()])[0] == approx(expected)


def test_treepo_figure3_size_weighted():
    # Σ_j |G_j| s_ij / Σ_j |G_j| with sizes (8, 4, 2), Σ = 14.
    # c11/1: (8·0.5 + 4·0.25 + 2·0) / 14 = 5/14;  c12/1: (4 + 1 + 1) / 14 = 6/14
    # c12/2: (-4 - 3 - 1) / 14 = -8/14;  c21/*: (-4 - 1 + 0) / 14 = -5/14
    # c22/1: (4 + 3 + 1) / 14 = 8/14;  c22/2: (-4 - 1 - 1) / 14 = -6/14
    expected = [5 / 14, 5 / 14, 6 / 14, -8 / 14, -5 / 14, -5 / 14, 8 / 14, -6 / 14]
    got = treepo_advantages([figure3_tree()], aggregate="size_weighted")[0]
    assert got == approx(expected)


def ragged_tree() -> RolloutTree:
    """Early stops and single-child chains.

    root ─ a ─ L1                      (L1 stops early at depth 2)
         │   └ b ─ c ─ L2, L3           (b → c is a single-child chain; leaves at depth 4)
         ├ L4                           (stops at depth 1)
         └ d ─ e ─ L5                   (a chain of singletons: only the root group counts)
    Rewards L1..L5 = 1, 0, 1, 0, 1.
    """
    tree = RolloutTree([1, 2, 3], problem={"id": "ragged"})
    a = tree.add_segment(tree.root, [4, 5])
    l1 = tree.add_segment(a, [6, 2])
    b = tree.add_segment(a, [7])
    c = tree.add_segment(b, [8, 9])
    l2 = tree.add_segment(c, [2])
    l3 = tree.add_segment(c, [3, 2])
    l4 = tree.add_segment(tree.root, [2])
    d = tree.add_segment(tree.root, [5])
    e = tree.add_segment(d, [6])
    l5 = tree.add_segment(e, [2])
    for leaf, r in zip([l1, l2, l3, l4, l5], [1, 0, 1, 0, 1]):
        leaf.reward = float(r)
    return tree


def test_treepo_ragged_tree():
    tree = ragged_tree()
    # Means: root 3/5 = 0.6; a (L1, L2, L3) 2/3; b and c (L2, L3) 0.5; d, e: singletons.
    # L1 (depth 2): (1-0.6, 1-2/3) → (0.4 + 0.3333) / 2 = 11/30
    # L2 (depth 4): (-0.6, -2/3, -0.5, -0.5) → -2.26667 / 4 = -17/30
    # L3 (depth 4): (0.4, 1/3, 0.5, 0.5) → 1.73333 / 4 = 13/30
    # L4 (depth 1): root only → -0.6
    # L5 (depth 3): d and e hold one leaf → skipped; root only → 0.4
    assert treepo_advantages([tree])[0] == approx([11 / 30, -17 / 30, 13 / 30, -0.6, 0.4])
    # size weighted: L1 (5·0.4 + 3·1/3) / 8 = 3/8; L2 (-3 - 2 - 1 - 1) / 12 = -7/12;
    # L3 (2 + 1 + 1 + 1) / 12 = 5/12; L4 -0.6; L5 0.4
    got = treepo_advantages([tree], aggregate="size_weighted")[0]
    assert got == approx([3 / 8, -7 / 12, 5 / 12, -0.6, 0.4])


def test_treepo_without_branching_is_r_minus_mean():
    # Four independent 3-segment chains: every subgroup below the root is a singleton.
    responses = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    tree = RolloutTree.from_sequences([0], responses, rewards=[1, 0, 0, 1], segment_tokens=1)
    assert tree.stats().max_depth == 3
    for aggregate in ("mean", "size_weighted"):
        assert treepo_advantages([tree], aggregate=aggregate)[0] == approx([0.5, -0.5, -0.5, 0.5])


def test_treepo_counts_sampling_depths_of_chains():
    # A shared single-child chain of 3 segments counts 3 depths, each a group of 2.
    # Rewards (1, 0): every group's mean is 0.5 → s = ±0.5 at each of 4 depths.
    tree = RolloutTree.from_sequences([0], [[1, 2, 3, 4], [1, 2, 3, 5]], rewards=[1, 0], segment_tokens=1)
    assert treepo_advantages([tree])[0] == approx([0.5, -0.5])


def test_whiten_is_token_weighted_over_linearised_tokens():
    # Tree A: s (2 tokens) → x (1 token, A=1) and y (2 tokens, A=-1): T_x = 3, T_y = 4.
    # Tree B: z (3 tokens, loss mask 1,0,1 → T_z = 2, A=0.5).
    # n = 9; mean = (3 - 4 + 1) / 9 = 0; var = (3 + 4 + 2·0.25) / 8 = 0.9375
    a = RolloutTree([1])
    s = a.add_segment(a.root, [2, 3])
    a.add_segment(s, [4])
    a.add_segment(s, [5, 6])
    b = RolloutTree([1])
    b.add_segment(b.root, [7, 8, 9], loss_mask=[1, 0, 1])
    inv = 1 / math.sqrt(0.9375)
    got_a, got_b = whiten([a, b], [[1.0, -1.0], [0.5]])
    assert got_a == approx([inv, -inv]) and got_b == approx([0.5 * inv])


def test_whiten_rejects_mismatched_shapes():
    tree = RolloutTree.from_sequences([1], [[2], [3]], rewards=[1, 0])
    with pytest.raises(ValueError, match="1 advantages for 2 leaves"):
        whiten([tree], [[1.0]])


def test_reinforce_pp_is_whitened_r_minus_mean():
    # One token per leaf: whitening is plain whitening with ddof=1 over [0.5, -0.5, -0.5, 0.5].
    tree = RolloutTree.from_sequences([1], [[2], [3], [4], [5]], rewards=[1, 0, 0, 1])
    x = 0.5 / math.sqrt(1 / 3 + 1e-8)
    assert reinforce_pp_advantages([tree])[0] == approx([x, -x, -x, x])


def test_dynamic_sampling_filter():
    mixed = RolloutTree.from_sequences([1], [[2], [3]], rewards=[1, 0], problem={"id": "a"})
    solved = RolloutTree.from_sequences([1], [[2], [3]], rewards=[1, 1], problem={"id": "b"})
    failed = RolloutTree.from_sequences([1], [[2], [3]], rewards=[0, 0], problem={"id": "c"})
    single = RolloutTree.from_sequences([1], [[2]], rewards=[1], problem={"id": "d"})
    mixed2 = RolloutTree.from_sequences([1], [[2], [3]], rewards=[0, 0.5], problem={"id": "e"})
    kept = dynamic_sampling_filter([solved, mixed, failed, single, mixed2])
    assert [t.problem["id"] for t in kept] == ["a", "e"]


def test_tempo_per_token_values():
    # root ─ a (2 tokens) ─ L1 (2 tokens, R=1)
    #      │              └ L2 (1 token, R=0)
    #      └ L3 (2 tokens, R=0)
    # mean 1/3, std (ddof 1) = sqrt(1/3) = 0.57735; GRPO: L1 1.154701, L2 = L3 = -0.57735.
    # V(root) 1/3, V(a) 0.5, V(L1) 1, V(L2) 0, V(L3) 0. The root and a both branch.
    # a's first token: + (0.5 - 1/3) / 0.57735 = +0.288675
    # L1's first token: + (1 - 0.5) / 0.57735 = +0.866025;  L2's: + (0 - 0.5) / 0.57735
    # L3's first token: + (0 - 1/3) / 0.57735 = -0.57735
    tree = RolloutTree([1])
    a = tree.add_segment(tree.root, [2, 3])
    l1 = tree.add_segment(a, [4, 5])
    l2 = tree.add_segment(a, [6])
    l3 = tree.add_segment(tree.root, [7, 8])
    l1.reward, l2.reward, l3.reward = 1.0, 0.0, 0.0
    (got,) = tempo_advantages([tree])
    assert got[0] == approx([1.443376, 1.154701, 2.020726, 1.154701])
    assert got[1] == approx([-0.288675, -0.57735, -1.443376])
    assert got[2] == approx([-1.154701, -0.57735])
    assert [len(v) for v in got] == [leaf.end for leaf in tree.leaves()]


def test_tempo_reduces_to_grpo_without_branches():
    tree = RolloutTree([1])
    for tokens, r in (([2, 3], 1.0), ([4, 5, 6], 0.0)):
        leaf = tree.add_segment(tree.add_segment(tree.root, tokens[:1]), tokens[1:])
        leaf.reward = r
    # The root branches, so each path's first token carries (V(child) - V(root)) / std.
    # Below it, single-child parents: no correction.
    grpo = grpo_advantages([tree])[0]
    got = tempo_advantages([tree])[0]
    assert got[0][1:] == approx([grpo[0]]) and got[1][1:] == approx([grpo[1]] * 2)
    assert got[0][0] != pytest.approx(grpo[0])


def test_missing_reward_names_problem_and_leaf():
    tree = RolloutTree.from_sequences([1], [[2], [3]], rewards=[1, 0], problem={"id": "p-17"})
    tree.leaves()[1].reward = None
    for fn in (grpo_advantages, treepo_advantages, tempo_advantages, dynamic_sampling_filter):
        with pytest.raises(ValueError, match="problem 'p-17': leaf node"):
            fn([tree])
    with pytest.raises(ValueError, match="has no leaves"):
        grpo_advantages([RolloutTree([1], problem={"id": "empty"})])


def test_estimator_registry_and_bad_aggregate():
    assert set(ESTIMATORS) == {"grpo", "treepo", "reinforce_pp"}
    with pytest.raises(ValueError, match="aggregate"):
        treepo_advantages([figure3_tree()], aggregate="max")  # type: ignore[arg-type]
