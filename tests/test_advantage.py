"""Advantage estimators with hand-worked numbers (docs/algorithms.md).

Every expected value is worked out in the comments next to it; a property test checks
TreePO and TEMPO against direct transcriptions of their definitions on random trees.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arbor.train.advantage import (
    ESTIMATORS,
    compute_advantages,
    dynamic_sampling_filter,
    grpo_advantages,
    reinforce_pp_advantages,
    tempo_advantages,
    treepo_advantages,
    treerl_advantages,
    whiten,
    whiten_token_values,
)
from arbor.tree import RolloutTree


def approx(xs):
    return pytest.approx(xs, rel=1e-5, abs=1e-6)


def flat(rewards: list[float], problem_id: str = "flat") -> RolloutTree:
    """One single-token leaf per reward under the root (independent sampling)."""
    responses = [[10 + i] for i in range(len(rewards))]
    return RolloutTree.from_sequences([1], responses, rewards=rewards, problem={"id": problem_id})


# -- GRPO ---------------------------------------------------------------------------------


def test_grpo_hand_numbers():
    # [1, 0, 0, 1]: mean 0.5; std (ddof 1) sqrt(4 · 0.25 / 3) = 0.57735; 0.5 / 0.57735 = 0.866025
    # [1, 0, 0, 0]: mean 0.25; Σ(R − mean)² = 0.5625 + 3 · 0.0625 = 0.75; std sqrt(0.75 / 3) = 0.5
    #               → 0.75 / 0.5 = 1.5 and −0.25 / 0.5 = −0.5. Each tree is its own group.
    got = grpo_advantages([flat([1, 0, 0, 1]), flat([1, 0, 0, 0])])
    assert got[0] == approx([0.866025, -0.866025, -0.866025, 0.866025])
    assert got[1] == approx([1.5, -0.5, -0.5, -0.5])
    # The 1e-6 is added to the std: 0.5 / (0.5 + 1e-6), not 0.5 / 0.5.
    assert got[1][1] == pytest.approx(-0.25 / (0.5 + 1e-6), rel=1e-12)
    # Dr.GRPO: no std division, R − mean.
    got = grpo_advantages([flat([1, 0, 0, 1]), flat([1, 0, 0, 0])], std_normalize=False)
    assert got == [approx([0.5, -0.5, -0.5, 0.5]), approx([0.75, -0.25, -0.25, -0.25])]


def test_grpo_degenerate_groups_give_zero_not_nan():
    assert grpo_advantages([flat([3.0]), flat([1.0, 1.0])]) == [[0.0], [0.0, 0.0]]
    assert grpo_advantages([flat([3.0])], std_normalize=False) == [[0.0]]


# -- TreePO: the paper's Figure 3 ----------------------------------------------------------


def figure3_tree() -> RolloutTree:
    """The TreePO paper's Figure 3: a binary tree of depth 3, 8 leaves.

    q ─ c1 ─ c11 ─ leaves 1, 1      (the paper's example leaf sits under c_{2,2}:
    │      └ c12 ─ leaves 1, 0       its subgroups are c_{2,2}, c_2 and q)
    └ c2 ─ c21 ─ leaves 0, 0
           └ c22 ─ leaves 1, 0
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


def test_figure3_shape():
    tree = figure3_tree()
    assert [leaf.depth for leaf in tree.leaves()] == [3] * 8
    assert [len(n.children) for n in tree.nodes() if n.children] == [2] * 6


def test_treepo_figure3_mean():
    # Subgroup means: q 4/8 = 0.5; c1 3/4 = 0.75, c2 1/4 = 0.25;
    #                 c11 1, c12 0.5, c21 0, c22 0.5.   Each leaf: s over (q, c_i, c_ij).
    # c11 leaves (R=1): (1−0.5, 1−0.75, 1−1)     = (0.5, 0.25, 0)      → 0.75/3 = 0.25
    # c12 first  (R=1): (0.5, 0.25, 1−0.5)       = (0.5, 0.25, 0.5)    → 1.25/3
    # c12 second (R=0): (−0.5, −0.75, −0.5)                            → −1.75/3
    # c21 leaves (R=0): (−0.5, 0−0.25, 0−0)      = (−0.5, −0.25, 0)    → −0.25
    # c22 first  (R=1): (0.5, 1−0.25, 1−0.5)     = (0.5, 0.75, 0.5)    → 1.75/3
    # c22 second (R=0): (−0.5, −0.25, −0.5)                            → −1.25/3
    expected = [0.25, 0.25, 1.25 / 3, -1.75 / 3, -0.25, -0.25, 1.75 / 3, -1.25 / 3]
    assert treepo_advantages([figure3_tree()])[0] == approx(expected)


def test_treepo_figure3_size_weighted():
    # Σ_j |G_j| s_ij / Σ_j |G_j| with sizes (8, 4, 2): Σ = 14.
    # c11 leaves: (8·0.5 + 4·0.25 + 2·0) / 14 = 5/14
    # c12 first:  (8·0.5 + 4·0.25 + 2·0.5) / 14 = 6/14;   second: (−4 − 3 − 1) / 14 = −8/14
    # c21 leaves: (−4 − 1 + 0) / 14 = −5/14
    # c22 first:  (4 + 3 + 1) / 14 = 8/14;                 second: (−4 − 1 − 1) / 14 = −6/14
    expected = [5 / 14, 5 / 14, 6 / 14, -8 / 14, -5 / 14, -5 / 14, 8 / 14, -6 / 14]
    got = treepo_advantages([figure3_tree()], aggregate="size_weighted")[0]
    assert got == approx(expected)


# -- TreePO: ragged trees, chains, no branching ----------------------------------------------


def ragged_tree() -> RolloutTree:
    """Early stops and single-child chains; leaves created out of DFS order.

    root ─ a ─ b ─ c ─ L2, L3     (b → c: a single-child chain over 2 leaves; depth 4)
         │   └ L1                 (L1 stops early at depth 2)
         ├ d ─ e ─ L5             (a chain over one leaf: only the root group counts)
         └ L4                     (stops at depth 1)
    Rewards L1..L5 = 1, 0, 1, 0, 1. Creation order, hence leaves(): L5, L1, L2, L3, L4.
    """
    tree = RolloutTree([1, 2, 3], problem={"id": "ragged"})
    a = tree.add_segment(tree.root, [4, 5])
    b = tree.add_segment(a, [7])
    c = tree.add_segment(b, [8, 9])
    d = tree.add_segment(tree.root, [5])
    e = tree.add_segment(d, [6])
    l5 = tree.add_segment(e, [2])
    l1 = tree.add_segment(a, [6, 2])
    l2 = tree.add_segment(c, [2])
    l3 = tree.add_segment(c, [3, 2])
    l4 = tree.add_segment(tree.root, [2])
    for leaf, r in zip([l1, l2, l3, l4, l5], [1, 0, 1, 0, 1]):
        leaf.reward = float(r)
    assert tree.leaves() == [l5, l1, l2, l3, l4]
    assert [leaf.depth for leaf in tree.leaves()] == [3, 2, 4, 4, 1]
    return tree


def test_treepo_ragged_tree_mean():
    # Means: root 3/5 = 0.6; a (L1, L2, L3) 2/3; b and c (L2, L3) 0.5; d, e hold L5 alone.
    # L5 (depth 3): d and e are singletons → skipped; root only → 1 − 0.6 = 0.4
    # L1 (depth 2): (1 − 0.6, 1 − 2/3) = (0.4, 1/3)              → 0.7333/2 = 11/30
    # L2 (depth 4): (−0.6, −2/3, −0.5, −0.5); b and c both count → −2.2667/4 = −17/30
    # L3 (depth 4): (0.4, 1/3, 0.5, 0.5)                         → 1.7333/4 = 13/30
    # L4 (depth 1): root only → 0 − 0.6 = −0.6
    # (Radix-compressing b → c into one node would give L2 (−0.6 − 2/3 − 0.5)/3 = −0.5889.)
    got = treepo_advantages([ragged_tree()])[0]
    assert got == approx([0.4, 11 / 30, -17 / 30, 13 / 30, -0.6])


def test_treepo_ragged_tree_size_weighted():
    # Group sizes: root 5, a 3, b 2, c 2.
    # L5: 5·0.4 / 5 = 0.4;  L1: (5·0.4 + 3·1/3) / 8 = 3/8
    # L2: (5·(−0.6) + 3·(−2/3) + 2·(−0.5) + 2·(−0.5)) / 12 = (−3 − 2 − 1 − 1)/12 = −7/12
    # L3: (2 + 1 + 1 + 1) / 12 = 5/12;  L4: −0.6
    got = treepo_advantages([ragged_tree()], aggregate="size_weighted")[0]
    assert got == approx([0.4, 3 / 8, -7 / 12, 5 / 12, -0.6])


def test_treepo_without_branching_is_r_minus_mean():
    # Root with 4 independent 3-segment chains: every group below the root is a singleton.
    responses = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    tree = RolloutTree.from_sequences([0], responses, rewards=[1, 0, 0.5, 1], segment_tokens=1)
    assert [leaf.depth for leaf in tree.leaves()] == [3, 3, 3, 3]
    # mean 0.625 → R − mean = (0.375, −0.625, −0.125, 0.375), equal to Dr.GRPO.
    dr_grpo = grpo_advantages([tree], std_normalize=False)[0]
    assert dr_grpo == approx([0.375, -0.625, -0.125, 0.375])
    for aggregate in ("mean", "size_weighted"):
        assert treepo_advantages([tree], aggregate=aggregate)[0] == approx(dr_grpo)


def test_treepo_counts_sampling_depths_of_a_shared_chain():
    # Segment mode (l = 1): [1] → [2] → [3] is a single-child chain shared by two leaves,
    # then [4] (R=1) and [5] (R=0); [6] (R=0) leaves the root at once.
    # Root mean 1/3; chain groups (3 of them) mean 0.5.
    # leaf [..4] (depth 4): (2/3, 0.5, 0.5, 0.5) → 13/6 / 4 = 13/24
    # leaf [..5] (depth 4): (−1/3, −0.5, −0.5, −0.5) → −11/6 / 4 = −11/24;  [6]: −1/3
    responses = [[1, 2, 3, 4], [1, 2, 3, 5], [6]]
    segments = RolloutTree.from_sequences([0], responses, rewards=[1, 0, 0], segment_tokens=1)
    assert treepo_advantages([segments])[0] == approx([13 / 24, -11 / 24, -1 / 3])
    # The radix tree of the same responses stores the chain as one node [1, 2, 3]:
    # depth 2, so (2/3 + 0.5) / 2 = 7/12. Depth is whatever the tree says it is.
    radix = RolloutTree.from_sequences([0], responses, rewards=[1, 0, 0])
    assert treepo_advantages([radix])[0] == approx([7 / 12, -5 / 12, -1 / 3])


def test_treepo_batch_keeps_groups_apart():
    got = treepo_advantages([figure3_tree(), flat([1, 0])])
    assert got[1] == approx([0.5, -0.5]) and len(got[0]) == 8


# -- whitening ------------------------------------------------------------------------------


def test_whiten_is_token_weighted_over_linearised_tokens():
    # Tree A: s (2 tokens) → x (1 token, A=1) and y (2 tokens, A=−1): T_x = 3, T_y = 4.
    # Tree B: z (3 tokens, loss mask 1,0,1 → T_z = 2, A=0.5).
    # Σ T = 9; mean = (3 − 4 + 1) / 9 = 0; var = (3·1 + 4·1 + 2·0.25) / 8 = 0.9375
    a = RolloutTree([1])
    s = a.add_segment(a.root, [2, 3])
    a.add_segment(s, [4])
    a.add_segment(s, [5, 6])
    b = RolloutTree([1])
    b.add_segment(b.root, [7, 8, 9], loss_mask=[1, 0, 1])
    inv = 1 / math.sqrt(0.9375 + 1e-8)
    got_a, got_b = whiten([a, b], [[1.0, -1.0], [0.5]])
    assert got_a == approx([inv, -inv]) and got_b == approx([0.5 * inv])


def test_whiten_nonzero_mean_and_fully_masked_leaf():
    # Tree A: s (2 tokens) → x (1 token, A=2): T_x = 3;  y (2 tokens, both masked, A=0): T_y = 2.
    # Tree B: z (1 masked token, A=5): T_z = 0 — no weight, yet shifted and scaled.
    # Tree C: w (3 tokens, A=−1): T_w = 3.
    # Σ T = 8; mean = (3·2 + 2·0 + 0·5 + 3·(−1)) / 8 = 3/8 = 0.375
    # var = (3·1.625² + 2·0.375² + 3·1.375²) / 7 = (7.921875 + 0.28125 + 5.671875) / 7
    #     = 13.875 / 7 = 1.982143 → std 1.407886
    a = RolloutTree([1])
    s = a.add_segment(a.root, [2, 3])
    a.add_segment(s, [4])
    a.add_segment(s, [5, 6], loss_mask=[0, 0])
    b = RolloutTree([1])
    b.add_segment(b.root, [7], loss_mask=[0])
    c = RolloutTree([1])
    c.add_segment(c.root, [8, 9, 10])
    std = math.sqrt(13.875 / 7 + 1e-8)
    got = whiten([a, b, c], [[2.0, 0.0], [5.0], [-1.0]])
    assert got == [
        approx([1.625 / std, -0.375 / std]),
        approx([4.625 / std]),
        approx([-1.375 / std]),
    ]
    assert std == pytest.approx(1.407886, rel=1e-6)


def test_whiten_errors():
    tree = flat([1, 0])
    with pytest.raises(ValueError, match="problem 'flat': 1 advantages for 2 leaves"):
        whiten([tree], [[1.0]])
    with pytest.raises(ValueError, match="2 advantage lists for 1 trees"):
        whiten([tree], [[1.0, 0.0], [0.0]])
    with pytest.raises(ValueError, match="at least 2 trainable tokens, got 1"):
        whiten([flat([1])], [[1.0]])


def test_whiten_token_values_by_hand():
    # Leaf x: path s [2, 3] + x [4], values (1, 2, 3);  leaf y: s + y [5] masked, (1, 2, 9).
    # Trainable tokens: 1, 2, 3 and 1, 2 (the 9 has mask 0) → n = 5, mean 9/5 = 1.8
    # var = (0.64 + 0.04 + 1.44 + 0.64 + 0.04) / 4 = 2.8 / 4 = 0.7
    tree = RolloutTree([1])
    s = tree.add_segment(tree.root, [2, 3])
    tree.add_segment(s, [4])
    tree.add_segment(s, [5], loss_mask=[0])
    std = math.sqrt(0.7 + 1e-8)
    (got,) = whiten_token_values([tree], [[[1.0, 2.0, 3.0], [1.0, 2.0, 9.0]]])
    assert got[0] == approx([-0.8 / std, 0.2 / std, 1.2 / std])
    assert got[1] == approx([-0.8 / std, 0.2 / std, 7.2 / std])
    with pytest.raises(ValueError, match="leaf node 3 has 3 response tokens but 2 advantages"):
        whiten_token_values([tree], [[[1.0, 2.0, 3.0], [1.0, 2.0]]])


def test_whiten_token_values_equals_whiten_for_constant_paths():
    trees = [ragged_tree(), figure3_tree()]
    leaf_adv = treepo_advantages(trees)
    per_token = [
        [[a] * leaf.end for leaf, a in zip(t.leaves(), adv)] for t, adv in zip(trees, leaf_adv)
    ]
    expected = whiten(trees, leaf_adv)
    got = whiten_token_values(trees, per_token)
    for tree_got, tree_exp in zip(got, expected):
        for tokens, a in zip(tree_got, tree_exp):
            assert tokens == approx([a] * len(tokens))


def test_reinforce_pp_is_whitened_r_minus_mean():
    # One token per leaf: plain whitening (ddof 1) of R − mean = [0.5, −0.5, −0.5, 0.5]:
    # mean 0, var 1/3 → 0.5 / sqrt(1/3) = 0.866025.
    x = 0.5 / math.sqrt(1 / 3 + 1e-8)
    assert reinforce_pp_advantages([flat([1, 0, 0, 1])])[0] == approx([x, -x, -x, x])


# -- dynamic sampling -------------------------------------------------------------------------


def test_dynamic_sampling_filter_keeps_order_and_drops_flat_groups():
    kept = dynamic_sampling_filter(
        [
            flat([1, 1], "solved"),
            flat([1, 0], "mixed"),
            flat([0, 0], "failed"),
            flat([1], "single"),  # one leaf: no comparison, no signal
            flat([0, 0.5], "partial"),
            figure3_tree(),
        ]
    )
    assert [t.problem["id"] for t in kept] == ["mixed", "partial", "fig3"]
    assert dynamic_sampling_filter([]) == []


# -- TEMPO ------------------------------------------------------------------------------------


def test_tempo_per_token_values():
    # root ─ a [2, 3] ─ L1 [4, 5] (R=1)
    #      │          └ L2 [6]    (R=0)
    #      └ L3 [7, 8]            (R=0)
    # mean 1/3; std (ddof 1) sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3) = 0.57735
    # GRPO: L1 (2/3)/0.57735 = 1.154701; L2 = L3 = −0.57735.
    # V(root) 1/3, V(a) 0.5, V(L1) 1, V(L2) 0, V(L3) 0. The root and a both branch, so:
    # a's first token:  + (0.5 − 1/3) / 0.57735 = +0.288675
    # L1's first token: + (1 − 0.5) / 0.57735 = +0.866025;  L2's: + (0 − 0.5) / 0.57735
    # L3's first token: + (0 − 1/3) / 0.57735 = −0.57735.  Second tokens: GRPO alone.
    tree = RolloutTree([1])
    a = tree.add_segment(tree.root, [2, 3])
    l1 = tree.add_segment(a, [4, 5])
    l2 = tree.add_segment(a, [6])
    l3 = tree.add_segment(tree.root, [7, 8])
    l1.reward, l2.reward, l3.reward = 1.0, 0.0, 0.0
    (got,) = tempo_advantages([tree])
    assert [len(v) for v in got] == [leaf.end for leaf in tree.leaves()] == [4, 3, 2]
    assert got[0] == approx([1.154701 + 0.288675, 1.154701, 1.154701 + 0.866025, 1.154701])
    assert got[1] == approx([-0.57735 + 0.288675, -0.57735, -0.57735 - 0.866025])
    assert got[2] == approx([-0.57735 - 0.57735, -0.57735])


def test_tempo_single_child_parents_add_nothing():
    # root ─ [2] ─ [3] (R=1)   and   root ─ [4] ─ [5, 6] (R=0): chains below a branching root.
    # mean 0.5, std sqrt(0.5) = 0.707107; GRPO ±0.707107.
    # First tokens at the root's branch: ± (R − 0.5) / 0.707107 = ±0.707107 extra.
    # [3], [5, 6] have single-child parents: V(child) = V(parent), plain GRPO.
    tree = RolloutTree([1])
    for first, rest, r in (([2], [3], 1.0), ([4], [5, 6], 0.0)):
        leaf = tree.add_segment(tree.add_segment(tree.root, first), rest)
        leaf.reward = r
    got = tempo_advantages([tree])[0]
    assert got == [approx([1.414214, 0.707107]), approx([-1.414214, -0.707107, -0.707107])]


def test_tempo_flat_group_is_zero_everywhere():
    # All rewards equal: GRPO 0 and every V equal, so no division-by-eps blow-up.
    assert tempo_advantages([figure3_tree_with(1.0)])[0] == [[0.0] * 3] * 8


def figure3_tree_with(reward: float) -> RolloutTree:
    tree = figure3_tree()
    for leaf in tree.leaves():
        leaf.reward = reward
    return tree


# -- TreeRL: global + local advantage per step ---------------------------------------------------


def test_treerl_global_plus_local_over_sqrt_leaves():
    # root -> A [2] -> {B [3] R=1, C [4] R=0}; root -> D [5] R=1 (radix tree, A split where B, C part).
    tree = RolloutTree.from_sequences([1], [[2, 3], [2, 4], [5]], rewards=[1.0, 0.0, 1.0])
    b, c, d = tree.leaves()
    assert tree.path(b)[0] is tree.path(c)[0] and tree.path(b)[0].token_ids == [2]
    # V(root) = 2/3, V(A) = 1/2, V(B) = 1, V(C) = 0, V(D) = 1.
    # R(A) = ((1/2 - 2/3) + (1/2 - 2/3)) / sqrt(2) = -0.2357 (two leaves under A)
    # R(B) = ((1 - 2/3) + (1 - 1/2)) / 1 = 0.8333;  R(C) = ((0 - 2/3) + (0 - 1/2)) = -1.1667
    # R(D) = ((1 - 2/3) + (1 - 2/3)) = 0.6667 (its parent is the root: LA = GA)
    a = -1 / 3 / math.sqrt(2)
    (got,) = treerl_advantages([tree])
    assert [approx(x) for x in ([a, 5 / 6], [a, -7 / 6], [2 / 3])] == got
    # Leaves straight under the root (independent answers): 2 (R - mean), one value per leaf.
    assert treerl_advantages([flat([1, 0])]) == [[[1.0], [-1.0]]]


# -- errors and the dispatcher -------------------------------------------------------------------


def test_missing_reward_names_problem_and_leaf():
    tree = RolloutTree.from_sequences([1], [[2], [3]], rewards=[1, 0], problem={"id": "p-17"})
    missing = tree.leaves()[1]
    missing.reward = None
    for fn in (grpo_advantages, treepo_advantages, tempo_advantages, treerl_advantages, dynamic_sampling_filter):
        with pytest.raises(ValueError, match=f"problem 'p-17': leaf node {missing.id} has no"):
            fn([flat([1, 0]), tree])
    with pytest.raises(ValueError, match="problem '<no id>': leaf node"):
        grpo_advantages([RolloutTree.from_sequences([1], [[2]])])


def test_empty_tree_is_an_error():
    empty = RolloutTree([1], problem={"id": "empty"})
    for fn in (grpo_advantages, treepo_advantages, tempo_advantages, dynamic_sampling_filter):
        with pytest.raises(ValueError, match="problem 'empty': the tree has no leaves"):
            fn([empty])


def test_compute_advantages_dispatch():
    trees = [ragged_tree(), figure3_tree()]
    assert ESTIMATORS == ("grpo", "treepo", "reinforce_pp", "tempo", "treerl")
    raw = treepo_advantages(trees, aggregate="size_weighted")
    got = compute_advantages(trees, "treepo", treepo_aggregate="size_weighted", whiten_tokens=False)
    assert got == raw
    assert compute_advantages(trees, "treepo", treepo_aggregate="size_weighted") == whiten(
        trees, raw
    )
    dr_grpo = grpo_advantages(trees, std_normalize=False)
    assert compute_advantages(trees, "grpo", std_normalize=False, whiten_tokens=False) == dr_grpo
    # REINFORCE++ is whitened by definition: whiten_tokens does not whiten it twice.
    for whiten_tokens in (True, False):
        got = compute_advantages(trees, "reinforce_pp", whiten_tokens=whiten_tokens)
        assert got == reinforce_pp_advantages(trees)
    # TEMPO: per-token values, whitened per token.
    tempo = compute_advantages(trees, "tempo", whiten_tokens=False)
    assert tempo == tempo_advantages(trees)
    assert compute_advantages(trees, "tempo") == whiten_token_values(trees, tempo)
    treerl = compute_advantages(trees, "treerl", whiten_tokens=False)
    assert treerl == treerl_advantages(trees)
    assert compute_advantages(trees, "treerl") == whiten_token_values(trees, treerl)
    with pytest.raises(ValueError, match="'ppo'; allowed: grpo, treepo, reinforce_pp, tempo, treerl"):
        compute_advantages(trees, "ppo")
    with pytest.raises(ValueError, match="aggregate must be"):
        treepo_advantages(trees, aggregate="max")  # type: ignore[arg-type]


# -- properties: the implementation against the definitions on random trees ---------------------


@st.composite
def random_trees(draw) -> RolloutTree:
    tree = RolloutTree([0], problem={"id": "random"})
    nodes = [tree.root]
    for _ in range(draw(st.integers(1, 14))):
        parent = nodes[draw(st.integers(0, len(nodes) - 1))]
        nodes.append(tree.add_segment(parent, [5] * draw(st.integers(1, 3))))
    for leaf in tree.leaves():
        leaf.reward = draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]))
    return tree


def _mean(xs):
    return sum(xs) / len(xs)


def treepo_by_definition(tree: RolloutTree, aggregate: str) -> list[float]:
    # G_j(i) = leaves whose path holds leaf i's depth-j ancestor; skip |G_j| = 1 for j ≥ 1.
    leaves = tree.leaves()
    paths = {leaf.id: [tree.root, *tree.path(leaf)] for leaf in leaves}
    out = []
    for leaf in leaves:
        terms = []
        for j in range(leaf.depth):
            anc = paths[leaf.id][j]
            group = [k.reward for k in leaves if len(paths[k.id]) > j and paths[k.id][j] is anc]
            if j == 0 or len(group) > 1:
                terms.append((len(group), leaf.reward - _mean(group)))
        w = [1.0 if aggregate == "mean" else size for size, _ in terms]
        out.append(sum(wi * s for wi, (_, s) in zip(w, terms)) / sum(w))
    return out


@settings(max_examples=60, deadline=None)
@given(tree=random_trees())
def test_estimators_match_their_definitions(tree):
    for aggregate in ("mean", "size_weighted"):
        expected = treepo_by_definition(tree, aggregate)
        assert treepo_advantages([tree], aggregate=aggregate)[0] == approx(expected)
    leaves = tree.leaves()
    rewards = [leaf.reward for leaf in leaves]
    grpo = grpo_advantages([tree])[0]
    assert sum(grpo) == pytest.approx(0.0, abs=1e-9)
    # TEMPO: GRPO everywhere, plus (V(node) − V(parent)) / std on a branch's first token,
    # V = mean reward of the leaves whose path passes through the node.
    std = (sum((r - _mean(rewards)) ** 2 for r in rewards) / max(len(rewards) - 1, 1)) ** 0.5

    def value(node):
        return _mean([k.reward for k in leaves if node is tree.root or node in tree.path(k)])

    for leaf, a, tokens in zip(leaves, grpo, tempo_advantages([tree])[0]):
        expected = []
        for node in tree.path(leaf):
            gate = len(node.parent.children) >= 2
            bonus = (value(node) - value(node.parent)) / (std + 1e-6) if gate else 0.0
            expected += [a + bonus] + [a] * (len(node.token_ids) - 1)
        assert tokens == approx(expected) and len(tokens) == leaf.end


# -- behaviours pinned by mutation testing (scripts/mutation.py train.advantage) ------------------


def test_reinforce_pp_over_groups_with_different_spreads():
    # Group A [1, 0]: mean 0.5, R − mean = ±0.5.  Group B [4, 0, 2]: mean 2, R − mean = 2, −2, 0.
    # No per-group std: whiten (0.5, −0.5, 2, −2, 0) over 5 one-token leaves: mean 0,
    # var = (2·0.25 + 2·4) / 4 = 2.125 → std 1.457738: ±0.342997, ±1.371989, 0.
    # (Dividing each group by its own std first would give (±0.7071, ±1, 0) and, whitened,
    # A's leaves nearly as large as B's: one group alone cannot tell the two apart.)
    got = reinforce_pp_advantages([flat([1, 0], "a"), flat([4, 0, 2], "b")])
    assert got == [approx([0.342997, -0.342997]), approx([1.371989, -1.371989, 0.0])]


def test_whiten_two_tokens_is_enough_and_equal_values_give_zero():
    # Exactly 2 tokens (the minimum): mean 0.5, var (0.25 + 0.25) / 1 = 0.5 → ±0.5 / 0.707107.
    assert whiten([flat([1, 0])], [[1.0, 0.0]]) == [approx([0.707107, -0.707107])]
    # All equal: var 0, the 1e-8 is added (not subtracted) under the root: 0, not a math error.
    assert whiten([flat([1, 1, 1])], [[2.0, 2.0, 2.0]]) == [[0.0, 0.0, 0.0]]


def test_compute_advantages_defaults():
    trees = [ragged_tree(), figure3_tree()]
    # Defaults: TreePO "mean", GRPO divided by the group std.
    assert compute_advantages(trees, "treepo", whiten_tokens=False) == treepo_advantages(trees, "mean")
    assert compute_advantages(trees, "grpo", whiten_tokens=False) == grpo_advantages(trees)
    assert grpo_advantages(trees) != grpo_advantages(trees, std_normalize=False)


def test_tempo_empty_leaf_under_a_branching_parent_gets_no_values():
    # A leaf that ended at once (no tokens) beside a one-token leaf: it has no first token
    # to carry a TD term. Rewards 1 and 0: mean 0.5, std 0.707107; GRPO ±0.707107, and the
    # [2] leaf's first token adds (1 − 0.5) / 0.707107.
    tree = RolloutTree([1])
    full = tree.add_segment(tree.root, [2])
    empty = tree.add_segment(tree.root, [])
    full.reward, empty.reward = 1.0, 0.0
    assert tempo_advantages([tree])[0] == [approx([1.414214]), []]
