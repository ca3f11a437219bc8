"""Tree packing: DFS serialisation, parents, subtree ends, weights, partitioning, rank balance."""

import pytest
import torch

from arbor.train.packing import (
    PackedBatch,
    assign_to_ranks,
    leaf_weights,
    loss_denominator,
    pack_trees,
)
from arbor.train.tree_attention import dense_tree_mask
from arbor.tree import RolloutTree


def fork_tree() -> RolloutTree:
    # prompt [1, 2]; a = [3, 4] → b = [5] (A=+1), c = [6, 7] (A=-2, loss mask 0,1)
    tree = RolloutTree([1, 2], problem={"id": "fork"})
    a = tree.add_segment(tree.root, [3, 4], logprobs=[-0.1, -0.2])
    tree.add_segment(a, [5], logprobs=[-0.3])
    tree.add_segment(a, [6, 7], logprobs=[-0.4, -0.5], loss_mask=[0, 1])
    return tree


def deep_tree() -> RolloutTree:
    """prompt [1, 2, 3]; a [4] * 3 → b [5] * 3 → c1 [6] * 3, c2 [7] * 3 (problem 'deep')."""
    tree = RolloutTree([1, 2, 3], problem={"id": "deep"})
    a = tree.add_segment(tree.root, [4] * 3, logprobs=[-1.0] * 3)
    b = tree.add_segment(a, [5] * 3, logprobs=[-1.0] * 3)
    for k in range(2):
        tree.add_segment(b, [6 + k] * 3, logprobs=[-1.0] * 3)
    return tree


def test_layout_by_hand():
    (pack,) = pack_trees([fork_tree()], [[1.0, -2.0]])
    assert pack.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert pack.position_ids.tolist() == [0, 1, 2, 3, 4, 4, 5]
    assert pack.parent.tolist() == [-1, 0, 1, 2, 3, 3, 5]  # 5 and 6 are both predicted by row 3
    assert pack.subtree_end.tolist() == [7, 7, 7, 7, 5, 7, 7]
    assert pack.trained.tolist() == [False, False, True, True, True, False, True]
    assert pack.old_logprobs.tolist() == [0, 0, -0.1, -0.2, -0.3, 0, -0.5]
    # a's tokens are on both leaves' paths: count 2, +1 and -2 advantage mass.
    assert pack.leaf_count.tolist() == [0, 0, 2, 2, 1, 1, 1]
    assert pack.adv_pos.tolist() == [0, 0, 1, 1, 1, 0, 0]
    assert pack.adv_neg.tolist() == [0, 0, -2, -2, 0, -2, -2]
    assert pack.n_pos.tolist() == [0, 0, 1, 1, 1, 0, 0]
    # Blocks: prompt + a + b causally; then c attends to its ancestors (prompt + a).
    assert [(b.start, b.end, b.context.tolist()) for b in pack.blocks] == [(0, 5, []), (5, 7, [0, 1, 2, 3])]


def test_sequence_weights_and_denominators():
    tree = fork_tree()
    # T_b: leaf b = 2 + 1 = 3 trainable, leaf c = 2 + 1 = 3 (one masked token).
    assert loss_denominator([tree], "token") == 6 and loss_denominator([tree], "sequence") == 2
    (pack,) = pack_trees([tree], [[1.0, -2.0]], normalize="sequence")
    assert pack.weight.tolist() == pytest.approx([0, 0, 2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert pack.adv_neg.tolist() == pytest.approx([0, 0, -2 / 3, -2 / 3, 0, -2 / 3, -2 / 3])


def test_per_token_advantages():
    tree = fork_tree()
    per_token = [[1.0, 2.0, 3.0], [-1.0, 1.0, -4.0, 5.0]]  # leaf b: 3 tokens, leaf c: 4
    (pack,) = pack_trees([tree], [per_token])
    assert pack.adv_pos.tolist() == [0, 0, 1, 3, 3, 0, 5]
    assert pack.adv_neg.tolist() == [0, 0, -1, 0, 0, -4, 0]
    with pytest.raises(ValueError, match="3 response tokens but 2 per-token advantages"):
        pack_trees([tree], [[[1.0, 2.0], [0.0] * 4]])


def test_several_trees_share_a_pack_block_diagonally():
    t1, t2 = fork_tree(), RolloutTree.from_sequences([9], [[8, 8]], logprobs=[[-1, -1]])
    (pack,) = pack_trees([t1, t2], [[1.0, -1.0], [0.5]])
    assert pack.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 9, 8, 8]
    assert pack.parent.tolist()[7:] == [-1, 7, 8] and pack.subtree_end.tolist()[:7] == [7, 7, 7, 7, 5, 7, 7]
    assert pack.position_ids.tolist()[7:] == [0, 1, 2]
    assert pack.blocks[-1].start == 7 and pack.blocks[-1].context.numel() == 0


def test_partitioned_tree_trains_every_token_once():
    tree = RolloutTree([1, 2, 3])
    a = tree.add_segment(tree.root, [4, 5, 6], logprobs=[-1.0] * 3)
    for k in range(4):
        tree.add_segment(a, [10 + k] * 3, logprobs=[-1.0] * 3)
    packs = pack_trees([tree], [[1.0, 2.0, 3.0, 4.0]], pack_tokens=10)
    assert len(packs) > 1 and all(p.num_tokens <= 10 for p in packs)
    # Every response token is trained in exactly one pack, with its whole-tree weights.
    trained = [(o, float(p.adv_pos[i])) for p in packs for i, o in enumerate(p.origin) if p.trained[i]]
    assert len(trained) == tree.stats().unique_response_tokens == 15
    assert len({o for o, _ in trained}) == 15
    assert {w for (_, node, _), w in trained if node == a.id} == {10.0}
    # Context re-enters untrained: each pack starts with the prompt.
    assert all(p.input_ids[:3].tolist() == [1, 2, 3] for p in packs)


def test_path_longer_than_budget_names_problem():
    tree = RolloutTree.from_sequences([1, 2], [[3] * 20], logprobs=[[-1.0] * 20], problem={"id": "long-7"})
    with pytest.raises(ValueError, match="problem 'long-7': a path of 22 tokens"):
        pack_trees([tree], [[1.0]], pack_tokens=16)


def test_missing_logprobs_named():
    tree = RolloutTree.from_sequences([1], [[2, 3]], problem={"id": "nolp"})
    with pytest.raises(ValueError, match="problem 'nolp': node .* no logprobs"):
        pack_trees([tree], [[1.0]])
    (pack,) = pack_trees([tree], [[1.0]], require_logprobs=False)
    assert pack.trained.sum() == 2
    assert pack.old_logprobs.tolist() == [0.0] * 3  # unknown behaviour log-probs read 0


def test_assign_to_ranks_balances_cost():
    sizes = (40, 30, 20, 10, 10, 35, 25, 15)
    trees = [RolloutTree.from_sequences([1], [[2] * n], logprobs=[[-1.0] * n]) for n in sizes]
    packs = pack_trees(trees, [[0.0]] * len(trees), pack_tokens=45)
    ranks = assign_to_ranks(packs, 3)
    assert sorted(i for r in ranks for i in r) == list(range(len(packs)))
    cost = [p.num_tokens * 64 + p.attention_cost() for p in packs]
    loads = [sum(cost[i] for i in r) for r in ranks]
    # Greedy longest-first: the spread never exceeds the largest single pack.
    assert max(loads) - min(loads) <= max(cost)
    assert max(loads) <= 1.34 * sum(cost) / 3 + max(cost) / 3
    assert assign_to_ranks(packs, 3) == ranks  # deterministic


def test_dense_mask_matches_rule():
    (pack,) = pack_trees([fork_tree()], [[0.0, 0.0]])
    mask = dense_tree_mask(pack)[0, 0]
    # Token 5 (leaf c's first) sees prompt + a and itself, not leaf b's token 4.
    assert mask[5].tolist() == [True, True, True, True, False, True, False]
    assert torch.equal(mask, mask & torch.ones(7, 7, dtype=torch.bool).tril())


def test_an_empty_node_adds_no_token_and_its_child_follows_its_parent():
    tree = RolloutTree([1, 2], problem={"id": "e"})
    a = tree.add_segment(tree.root, [3, 4], logprobs=[-1.0, -1.0])
    empty = tree.add_segment(a, [], logprobs=[])  # an aborted segment
    tree.add_segment(empty, [5], logprobs=[-1.0])
    tree.add_segment(a, [6], logprobs=[-1.0])
    (pack,) = pack_trees([tree], [[1.0, 1.0]])
    assert pack.input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert pack.parent.tolist() == [-1, 0, 1, 2, 3, 3]  # 5 and 6 both follow token 4
    assert pack.subtree_end.tolist() == [6, 6, 6, 6, 5, 6]
    assert sum(b.end - b.start for b in pack.blocks) == 6


def test_packed_columns_must_line_up():
    (pack,) = pack_trees([RolloutTree.from_sequences([1], [[2, 3]], logprobs=[[-1.0, -1.0]])])
    fields = {k: getattr(pack, k) for k in pack.__dataclass_fields__}
    fields["parent"] = fields["parent"][:-1]
    with pytest.raises(ValueError, match="parent"):
        PackedBatch(**fields)


# -- behaviours pinned by mutation testing (scripts/mutation.py train.packing) ---------------------


def test_a_subtree_that_exactly_fills_the_budget_is_not_split():
    # fork_tree: prompt 2 + a 2 + b 1 + c 2 = 7 tokens. A budget of exactly 7 holds the
    # whole tree in one pack, every response token trained once; 6 must split it.
    (pack,) = pack_trees([fork_tree()], [[1.0, -2.0]], pack_tokens=7)
    assert pack.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7] and pack.owned.sum() == 5
    split = pack_trees([fork_tree()], [[1.0, -2.0]], pack_tokens=6)
    assert len(split) == 2 and all(p.num_tokens <= 6 for p in split)
    # Two trees that exactly fill a budget share one pack: 7 + 3 = 10.
    small = RolloutTree.from_sequences([9], [[8, 8]], logprobs=[[-1, -1]])
    assert len(pack_trees([fork_tree(), small], [[1.0, -2.0], [0.5]], pack_tokens=10)) == 1
    assert len(pack_trees([fork_tree(), small], [[1.0, -2.0], [0.5]], pack_tokens=9)) == 2


def test_weights_are_float64_and_zero_advantages_count_on_neither_side():
    # 0.1 stays 0.1 (not float32's 0.10000000149); a zero advantage is neither positive
    # nor negative (the clip fraction counts it nowhere), yet it is a leaf on the path.
    (pack,) = pack_trees([fork_tree()], [[0.1, 0.0]])
    assert pack.adv_pos.dtype == torch.float64 and pack.adv_pos.tolist() == [0, 0, 0.1, 0.1, 0.1, 0, 0]
    assert pack.n_pos.tolist() == [0, 0, 1, 1, 1, 0, 0] and pack.n_neg.tolist() == [0] * 7
    assert pack.leaf_count.tolist() == [0, 0, 2, 2, 1, 1, 1]
    (pack,) = pack_trees([fork_tree()], [[[0.1, 0.0, 0.3], [0.0, -0.1, 0.0, 0.2]]])
    assert pack.adv_pos.tolist() == [0, 0, 0.1, 0, 0.3, 0, 0.2]
    assert pack.adv_neg.tolist() == [0, 0, 0, -0.1, 0, 0, 0]
    with pytest.raises(ValueError, match="problem 'fork': 1 advantages for 2 leaves"):
        pack_trees([fork_tree()], [[1.0]])


def test_leaf_weights_and_denominator_with_an_untrainable_leaf():
    tree = fork_tree()
    tree.add_segment(tree.root, [8], logprobs=[-1.0], loss_mask=[0])  # d: nothing to train
    assert leaf_weights(tree, "token") == [1.0, 1.0, 1.0]
    assert leaf_weights(tree, "sequence") == [1 / 3, 1 / 3, 0.0]
    assert loss_denominator([tree], "sequence") == 2 and loss_denominator([tree], "token") == 6
    for fn in (leaf_weights, lambda t, n: loss_denominator([t], n)):
        with pytest.raises(ValueError, match="normalize must be 'token' or 'sequence', got 'mean'"):
            fn(tree, "mean")


def test_attention_cost_and_rank_assignment_by_hand():
    # Blocks (0, 5, no context) and (5, 7, 4 context tokens): 5 · (0 + 6/2) + 2 · (4 + 3/2) = 26.
    (pack,) = pack_trees([fork_tree()], [[0.0, 0.0]])
    assert pack.attention_cost() == 26
    # Chains of 1, 4, 3 and 2 tokens after a 1-token prompt: costs 64·n + n(n+1)/2 rise with n.
    # Longest first onto the least loaded rank: 4 → r0, 3 → r1, 2 → r1, 1 → r0.
    trees = [RolloutTree.from_sequences([1], [[2] * n], logprobs=[[-1.0] * n]) for n in (1, 4, 3, 2)]
    packs = [pack_trees([t], [[0.0]])[0] for t in trees]
    assert assign_to_ranks(packs, 2) == [[0, 1], [2, 3]]
    assert assign_to_ranks(packs, 1) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="world_size must be ≥ 1, got 0"):
        assign_to_ranks(packs, 0)


def _one_pack(count: int, length: int) -> PackedBatch:
    """``count`` sequences of a 1-token prompt and ``length`` − 1 response tokens, in one pack."""
    trees = [RolloutTree.from_sequences([1], [[2] * (length - 1)], logprobs=[[-1.0] * (length - 1)])
             for _ in range(count)]
    (pack,) = pack_trees(trees, [[0.0]] * count)
    return pack


@pytest.mark.parametrize("first, second", [
    # 5 sequences of 7 tokens: 64·35 + 5·28 = 2380; one 30-token chain: 64·30 + 465 = 2385.
    # The chain goes first, by 5: with 65 per token (a tie, lower index first) or attention
    # subtracted (2100 vs 1455) the 5 sequences would.
    ((5, 7), (1, 30)),
    # A 10-token chain: 64·10 + 55 = 695; 6 sequences of 2 tokens: 64·12 + 18 = 786. Tokens
    # outweigh attention pairs: with tokens / 64 (55.2 vs 18.2) the chain would go first.
    ((1, 10), (6, 2)),
])
def test_rank_cost_weighs_64_per_token_against_attention_pairs(first, second):
    # Pack 1 costs more than pack 0 and goes first, onto rank 0; pack 0 to rank 1; pack 2
    # (2 tokens, 64·2 + 3 = 131) to the less loaded rank 1. Swapped, it would be [[0], [1, 2]].
    packs = [_one_pack(*first), _one_pack(*second), _one_pack(1, 2)]
    assert [p.num_tokens * 64 + p.attention_cost() for p in packs][2] == 131
    assert assign_to_ranks(packs, 2) == [[1], [0, 2]]


def test_the_default_budget_is_16384_tokens():
    # A 1-token prompt and a 16 384-token response: one token over the default budget.
    tree = RolloutTree.from_sequences([1], [[2] * 16384], logprobs=[[-1.0] * 16384])
    with pytest.raises(ValueError, match=r"a path of 16385 tokens .* does not fit pack_tokens=16384"):
        pack_trees([tree], [[0.0]])
    assert len(pack_trees([tree], [[0.0]], pack_tokens=16385)) == 1


def test_sequence_weights_keep_float64_precision():
    # w = 1/3 for a 3-token leaf: float64's 1/3, not float32's 0.3333333432674408.
    tree = RolloutTree.from_sequences([1], [[2, 3, 4]], logprobs=[[-1.0] * 3])
    (pack,) = pack_trees([tree], [[0.5]], normalize="sequence")
    assert pack.weight.dtype == pack.adv_pos.dtype == torch.float64
    assert pack.weight.tolist() == [0.0] + [1 / 3] * 3
    assert pack.adv_pos.tolist() == [0.0] + [(1 / 3) * 0.5] * 3


def test_a_second_tree_in_a_pack_sees_only_its_own_prompt():
    # Tree 1 takes packed indices 0-1 (a block of its own); tree 2's prompt 2-3, its children
    # [7] at 4 and [8] at 5. [8] does not follow [7]: a block whose context is tree 2's prompt.
    first = RolloutTree.from_sequences([1], [[2]], logprobs=[[-1.0]])
    second = RolloutTree.from_sequences([5, 6], [[7], [8]], logprobs=[[-1.0], [-1.0]])
    (pack,) = pack_trees([first, second], [[0.0], [0.0, 0.0]])
    assert [(b.start, b.end, b.context.tolist()) for b in pack.blocks] == [(0, 2, []), (2, 5, []), (5, 6, [2, 3])]
    # Without a prompt the context is empty, and still an index tensor.
    bare = RolloutTree.from_sequences([], [[7], [8]], logprobs=[[-1.0], [-1.0]])
    (pack,) = pack_trees([bare], [[0.0, 0.0]])
    assert [(b.context.tolist(), b.context.dtype) for b in pack.blocks] == [([], torch.long)] * 2


def test_context_copies_in_other_packs_carry_no_weight():
    # The deep tree split under a budget of 12: a and b reappear as context of c1 and c2, and
    # train only where they are owned, so the packs' weights and advantages add up to the
    # unsplit pack's.
    tree = deep_tree()
    (whole,) = pack_trees([tree], [[1.0, -0.5]])
    split = pack_trees([tree], [[1.0, -0.5]], pack_tokens=12)
    assert len(split) > 1
    for name in ("weight", "adv_pos", "adv_neg", "leaf_count", "n_pos", "n_neg"):
        assert sum(getattr(p, name).sum().item() for p in split) == getattr(whole, name).sum().item(), name


def test_a_subtree_that_exactly_fills_a_fresh_pack_moves_whole():
    # prompt 1; x [2]; y [3] → z1 [4, 4], z2 [5, 5]. Budget 6: x's pack holds 2 tokens; y's
    # subtree with the prompt is exactly 6, so it goes whole to a second pack (split, y and
    # z1 would join x's pack and z2 follow alone: [5, 4]).
    tree = RolloutTree([1])
    tree.add_segment(tree.root, [2], logprobs=[-1.0])
    y = tree.add_segment(tree.root, [3], logprobs=[-1.0])
    tree.add_segment(y, [4, 4], logprobs=[-1.0] * 2)
    tree.add_segment(y, [5, 5], logprobs=[-1.0] * 2)
    assert [p.input_ids.tolist() for p in pack_trees([tree], [[0.0] * 3], pack_tokens=6)] == [
        [1, 2], [1, 3, 4, 4, 5, 5]]


def test_the_first_node_over_the_budget_is_named():
    # prompt 1 + a [2, 2, 2] fill a budget of 4 exactly (a trains alone); a's child b makes
    # the path 5 tokens: b (node 2) is the one named, with the budget.
    tree = RolloutTree([1])
    a = tree.add_segment(tree.root, [2] * 3, logprobs=[-1.0] * 3)
    tree.add_segment(a, [3], logprobs=[-1.0])
    with pytest.raises(ValueError, match=r"a path of 5 tokens \(prompt 1 \+ response 4, node 2\) does not fit pack_tokens=4"):
        pack_trees([tree], [[0.0]], pack_tokens=4)


def test_packs_fill_exactly_to_the_budget_across_trees_and_units():
    # Four 4-token trees (prompt 1 + 3), budget 8: two per pack, the third opens a pack that
    # the fourth fills exactly.
    trees = [RolloutTree.from_sequences([1], [[2] * 3], logprobs=[[-1.0] * 3]) for _ in range(4)]
    assert [p.num_tokens for p in pack_trees(trees, [[0.0]] * 4, pack_tokens=8)] == [8, 8]
    # One tree split into units, budget 5: prompt + a (2 tokens), b joins with its 3 new
    # tokens (exactly 5); c opens a second pack with its context: [1, 2, 4, 4, 4].
    tree = RolloutTree([1])
    a = tree.add_segment(tree.root, [2], logprobs=[-1.0])
    tree.add_segment(a, [3] * 3, logprobs=[-1.0] * 3)
    tree.add_segment(a, [4] * 3, logprobs=[-1.0] * 3)
    packs = pack_trees([tree], [[0.0, 0.0]], pack_tokens=5)
    assert [p.input_ids.tolist() for p in packs] == [[1, 2, 3, 3, 3], [1, 2, 4, 4, 4]]


def test_pack_trees_defaults_and_loss_weights():
    tree = RolloutTree.from_sequences([1], [[2, 3]], logprobs=[[-1.0, -1.0]])
    # No advantages: 0 for every leaf (tree_logprobs and SFT packs).
    (pack,) = pack_trees([tree])
    assert pack.adv_pos.tolist() == pack.adv_neg.tolist() == [0.0] * 3
    # loss_weights scale each leaf's weight (SFT example weights).
    (pack,) = pack_trees([tree], [[0.0]], loss_weights=[[2.5]])
    assert pack.weight.tolist() == [0.0, 2.5, 2.5]
    with pytest.raises(ValueError, match="^1 advantage lists for 2 trees$"):
        pack_trees([tree, tree], [[0.0]])
    with pytest.raises(ValueError, match="^1 loss weight lists for 2 trees$"):
        pack_trees([tree, tree], [[0.0], [0.0]], loss_weights=[[1.0]])
    fork = fork_tree()
    with pytest.raises(ValueError, match=rf"^problem {fork.problem_id}: 1 loss weights for 2 leaves$"):
        pack_trees([fork], [[1.0, -2.0]], loss_weights=[[1.0]])


def test_packed_origin_and_blocks_must_line_up():
    (pack,) = pack_trees([fork_tree()], [[1.0, -2.0]])
    fields = {k: getattr(pack, k) for k in pack.__dataclass_fields__}
    with pytest.raises(ValueError, match=r"\{'origin': 6\}"):
        PackedBatch(**{**fields, "origin": fields["origin"][:-1]})
    with pytest.raises(ValueError, match="attention blocks cover 5 of 7 tokens"):
        PackedBatch(**{**fields, "blocks": fields["blocks"][:1]})
    # The blocks are [0, 5) and [5, 7): the second alone covers 2 tokens, not 5 + 7.
    with pytest.raises(ValueError, match="^attention blocks cover 2 of 7 tokens$"):
        PackedBatch(**{**fields, "blocks": fields["blocks"][1:]})


def test_partitioning_counts_the_context_of_every_level():
    # prompt 3, a 3 → b 3 → c1 3, c2 3; budget 12. a + subtree (15) and b + its subtree with
    # context (6 + 9) do not fit: a and b train alone, c1 and c2 follow with context [a, b]
    # (9 + 3 = 12, exactly the budget). No pack may exceed 12 tokens.
    tree = deep_tree()
    packs = pack_trees([tree], [[1.0, 1.0]], pack_tokens=12)
    assert all(p.num_tokens <= 12 for p in packs)
    assert sum(int(p.trained.sum()) for p in packs) == 12
    # Units that share context merge into a pack by their new tokens only: a [2] then four
    # 4-token children, budget 12: a (5), + c1 (4) = 9; c2 needs 4 more → a new pack.
    wide = RolloutTree([1, 2, 3])
    a = wide.add_segment(wide.root, [4] * 2, logprobs=[-1.0] * 2)
    for k in range(4):
        wide.add_segment(a, [6 + k] * 4, logprobs=[-1.0] * 4)
    packs = pack_trees([wide], [[1.0] * 4], pack_tokens=12)
    assert [p.num_tokens for p in packs] == [9, 9, 9, 9]
    with pytest.raises(ValueError, match=r"problem 'deep': the prompt alone \(3 tokens\) fills pack_tokens=3"):
        pack_trees([tree], [[1.0, 1.0]], pack_tokens=3)


def test_an_empty_later_sibling_attaches_its_child_to_the_parent():
    # a [3, 4] → b [5], then an empty e → f [6]: f follows a's last token (index 3), not b's.
    tree = RolloutTree([1, 2])
    a = tree.add_segment(tree.root, [3, 4], logprobs=[-1.0, -1.0])
    tree.add_segment(a, [5], logprobs=[-1.0])
    empty = tree.add_segment(a, [], logprobs=[])
    tree.add_segment(empty, [6], logprobs=[-1.0])
    (pack,) = pack_trees([tree], [[1.0, 1.0]])
    assert pack.input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert pack.parent.tolist() == [-1, 0, 1, 2, 3, 3]
    # Prompt tokens come from node 0 (the root); block contexts are index tensors.
    assert pack.origin[:2] == [(0, 0, 0), (0, 0, 1)]
    assert all(b.context.dtype == torch.long for b in pack.blocks)


def test_correction_weights_and_recomputed_logprobs_stay_exact_float64():
    # A leaf's sequence-level correction weight c multiplies its advantage mass, in float64:
    # 1/3 and 2/7 are not float32 numbers. π_old (node.learner_logprobs) enters as given.
    tree = fork_tree()
    for node in tree.nodes():
        node.learner_logprobs = [-1 / 3] * len(node.token_ids)
    (plain,) = pack_trees([tree], [[1.0, -2.0]])
    (pack,) = pack_trees([tree], [[1.0, -2.0]], correction_weights=[[1 / 3, 2 / 7]])
    # b (index 4) is below leaf 0 only, c's trained token (index 6) below leaf 1 only.
    assert pack.adv_pos[4].item() == plain.adv_pos[4].item() * (1 / 3)
    assert pack.adv_neg[6].item() == plain.adv_neg[6].item() * (2 / 7)
    assert pack.weight.tolist() == plain.weight.tolist()  # only the advantage mass
    trained = pack.trained.nonzero()[:, 0]
    assert pack.prox_logprobs.dtype == torch.float64
    assert pack.prox_logprobs[trained].tolist() == [-1 / 3] * len(trained)


def test_per_tree_lists_of_the_wrong_length_are_named():
    trees = [fork_tree(), deep_tree()]
    advantages = [[1.0, -2.0], [0.5, 0.5]]
    with pytest.raises(ValueError, match=r"^1 correction weight lists for 2 trees$"):
        pack_trees(trees, advantages, correction_weights=[[1.0, 1.0]])
    with pytest.raises(ValueError, match=r"^problem 'deep': 1 correction weights for 2 leaves$"):
        pack_trees(trees, advantages, correction_weights=[[1.0, 1.0], [1.0]])
    with pytest.raises(ValueError, match=r"^1 train_only sets for 2 trees$"):
        pack_trees(trees, advantages, train_only=[None])


def test_training_only_a_deep_node_brings_every_ancestor_in_as_context():
    # deep_tree: a → b → {c1, c2}. Training c2 alone needs a and b as its context (untrained).
    tree = deep_tree()
    c2 = tree.leaves()[1]
    (pack,) = pack_trees([tree], [[0.5, 0.5]], train_only=[{c2.id}])
    assert pack.input_ids.tolist() == [1, 2, 3] + [4] * 3 + [5] * 3 + [7] * 3
    assert pack.trained.tolist() == [False] * 9 + [True] * 3
    assert pack.parent.tolist() == [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_attention_cost_is_a_whole_number_of_pairs():
    (pack,) = pack_trees([fork_tree()], [[1.0, -2.0]])
    assert type(pack.attention_cost()) is int
