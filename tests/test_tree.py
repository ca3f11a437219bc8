"""RolloutTree: building, traversal, prefix-to-tree, stats and JSON round-trip."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arbor.tree import RolloutTree


def small_tree() -> RolloutTree:
    # prompt [1, 2, 3]; a = [10, 11] forks into b1 = [12, 2] and b2 = [13, 14, 2]
    tree = RolloutTree([1, 2, 3], problem={"id": "p0", "answer": "4"})
    a = tree.add_segment(tree.root, [10, 11], logprobs=[-0.1, -0.2])
    b1 = tree.add_segment(a, [12, 2], logprobs=[-0.3, -0.4])
    b2 = tree.add_segment(a, [13, 14, 2], logprobs=[-0.5, -0.6, -0.7], loss_mask=[1, 0, 1])
    b1.reward, b2.reward = 1.0, 0.0
    b1.finish_reason = b2.finish_reason = "stop"
    return tree


def test_structure_and_offsets():
    tree = small_tree()
    a = tree.root.children[0]
    b1, b2 = a.children
    assert tree.root.depth == 0 and tree.root.token_ids == [] and tree.root.parent is None
    assert (a.depth, b1.depth, b2.depth) == (1, 2, 2)
    assert (a.start, a.end, b1.start, b2.end) == (0, 2, 2, 5)
    assert b1.parent is a and tree.leaves() == [b1, b2]
    assert [n.id for n in tree.nodes()] == [a.id, b1.id, b2.id]
    assert tree.num_nodes == 3 and not a.is_leaf and not tree.root.is_leaf


def test_path_helpers():
    tree = small_tree()
    b1, b2 = tree.leaves()
    assert tree.path(b2) == [tree.root.children[0], b2]
    assert tree.response_ids(b2) == [10, 11, 13, 14, 2]
    assert tree.full_ids(b1) == [1, 2, 3, 10, 11, 12, 2]
    assert tree.response_logprobs(b1) == [-0.1, -0.2, -0.3, -0.4]
    assert tree.response_loss_mask(b2) == [1, 1, 1, 0, 1]
    assert tree.num_trainable(b2) == 4 and tree.num_trainable(b1) == 4
    counts = tree.leaf_counts()
    assert counts[tree.root.id] == 2 and counts[b1.id] == 1


def test_leaves_in_creation_order_after_later_forks():
    tree = RolloutTree([0])
    a = tree.add_segment(tree.root, [1])
    x = tree.add_segment(tree.root, [2])
    y = tree.add_segment(a, [3])
    assert tree.leaves() == [x, y]


def test_add_segment_validation():
    tree = RolloutTree([0])
    with pytest.raises(ValueError, match="logprobs has 1 entries for 2 tokens"):
        tree.add_segment(tree.root, [1, 2], logprobs=[-0.1])
    with pytest.raises(ValueError, match="loss_mask has 3 entries for 2 tokens"):
        tree.add_segment(tree.root, [1, 2], loss_mask=[1, 1, 0])
    with pytest.raises(ValueError, match="0 or 1"):
        tree.add_segment(tree.root, [1], loss_mask=[2])
    with pytest.raises(ValueError, match="does not belong"):
        tree.add_segment(RolloutTree([0]).root.__class__(5, None, [], None, None), [1])
    other = RolloutTree([0])
    with pytest.raises(ValueError, match="does not belong"):
        tree.add_segment(other.add_segment(other.root, [1]), [2])
    with pytest.raises(ValueError, match="has no logprobs"):
        leaf = tree.add_segment(tree.root, [5])
        tree.response_logprobs(leaf)


def test_stats_by_hand():
    s = small_tree().stats()
    # unique response tokens: 2 + 2 + 3 = 7; linearised: leaf paths 4 + 5 = 9
    # with the prompt (3 tokens): unique 10, linearised 9 + 2·3 = 15
    assert (s.unique_response_tokens, s.linearised_response_tokens) == (7, 9)
    assert (s.unique_tokens, s.linearised_tokens) == (10, 15)
    assert s.sharing_ratio == pytest.approx(1.5) and s.response_sharing_ratio == pytest.approx(9 / 7)
    assert (s.leaves, s.nodes, s.max_depth, s.prompt_tokens) == (2, 3, 2, 3)


def test_from_sequences_radix_splits_only_at_divergence():
    responses = [[5, 6, 7, 8], [5, 6, 9], [4]]
    tree = RolloutTree.from_sequences([1, 2], responses, rewards=[1, 0, 1])
    shared = tree.root.children[0]
    assert shared.token_ids == [5, 6] and [c.token_ids for c in shared.children] == [[7, 8], [9]]
    assert [tree.response_ids(leaf) for leaf in tree.leaves()] == responses
    assert [leaf.reward for leaf in tree.leaves()] == [1, 0, 1]
    assert [leaf.depth for leaf in tree.leaves()] == [2, 2, 1]


def test_from_sequences_identical_and_prefix_responses_stay_distinct():
    responses = [[5, 6, 7], [5, 6, 7], [5, 6], [5, 6, 7, 8]]
    for seg in (None, 2):
        tree = RolloutTree.from_sequences([1], responses, rewards=[0, 1, 2, 3], segment_tokens=seg)
        leaves = tree.leaves()
        assert len(leaves) == 4 and all(leaf.token_ids for leaf in leaves)
        assert [tree.response_ids(leaf) for leaf in leaves] == responses
        assert [leaf.reward for leaf in leaves] == [0, 1, 2, 3]
        assert all(not leaf.children for leaf in leaves)


def test_from_sequences_segment_boundaries_at_multiples():
    # l = 2: responses share [5, 6] and diverge inside the second segment.
    responses = [[5, 6, 7, 8, 9], [5, 6, 7, 3]]
    tree = RolloutTree.from_sequences([1], responses, segment_tokens=2,
                                      logprobs=[[-1, -2, -3, -4, -5], [-1, -2, -3, -6]])
    first = tree.root.children[0]
    assert first.token_ids == [5, 6] and len(first.children) == 2
    # Every node starts at a multiple of l, so depth = segment index + 1.
    for node in tree.nodes():
        assert node.start % 2 == 0 and node.depth == node.start // 2 + 1
    a, b = tree.leaves()
    assert a.depth == 3 and b.depth == 2 and b.token_ids == [7, 3]
    assert tree.response_logprobs(a) == [-1, -2, -3, -4, -5]
    assert tree.response_logprobs(b) == [-1, -2, -3, -6]


def test_from_sequences_argument_errors():
    with pytest.raises(ValueError, match="1 rewards for 2 responses"):
        RolloutTree.from_sequences([1], [[2], [3]], rewards=[1])
    with pytest.raises(ValueError, match="response 0: 2 logprobs for 1 tokens"):
        RolloutTree.from_sequences([1], [[2]], logprobs=[[-1, -2]])
    with pytest.raises(ValueError, match="segment_tokens"):
        RolloutTree.from_sequences([1], [[2]], segment_tokens=0)


def test_json_round_trip_keeps_ids_order_and_fields():
    tree = RolloutTree.from_sequences(
        [1, 2], [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8], [4]], rewards=[1, 0, 1, 0],
        logprobs=[[-1, -2, -3, -4], [-1, -2, -5], [-1, -2, -3, -4], [-9]],
        problem={"id": "q", "answer": "2"},
    )
    tree.leaves()[0].finish_reason = "stop"
    tree.leaves()[1].weight_version = "3"
    again = RolloutTree.from_json(tree.to_json())
    assert again.to_dict() == tree.to_dict()
    assert [n.id for n in again.leaves()] == [n.id for n in tree.leaves()]
    assert [again.response_ids(leaf) for leaf in again.leaves()] == [
        tree.response_ids(leaf) for leaf in tree.leaves()
    ]
    assert again.problem == {"id": "q", "answer": "2"} and again.stats() == tree.stats()
    with_mask = small_tree()
    assert RolloutTree.from_json(with_mask.to_json()).to_dict() == with_mask.to_dict()


responses_strategy = st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=8
)


@settings(max_examples=60, deadline=None)
@given(responses=responses_strategy, seg=st.sampled_from([None, 1, 2, 3]))
def test_prefix_to_tree_properties(responses, seg):
    tree = RolloutTree.from_sequences([9], responses, segment_tokens=seg,
                                      rewards=list(range(len(responses))))
    leaves = tree.leaves()
    assert [tree.response_ids(leaf) for leaf in leaves] == responses
    assert [leaf.reward for leaf in leaves] == list(range(len(responses)))
    s = tree.stats()
    assert s.linearised_response_tokens == sum(map(len, responses))
    assert s.unique_response_tokens <= s.linearised_response_tokens
    assert all(not leaf.children for leaf in leaves)
    again = RolloutTree.from_json(tree.to_json())
    assert again.to_dict() == tree.to_dict()


def test_radix_tree_is_minimal_for_distinct_responses():
    # Distinct responses ending in a shared EOS token: the unique count equals a trie's.
    rng = random.Random(0)
    responses = [[rng.randint(0, 2) for _ in range(rng.randint(1, 6))] + [99] for _ in range(20)]
    responses = [list(r) for r in {tuple(r) for r in responses}]
    tree = RolloutTree.from_sequences([1], responses)
    prefixes = {tuple(r[:k]) for r in responses for k in range(1, len(r) + 1)}
    assert tree.stats().unique_response_tokens == len(prefixes)
