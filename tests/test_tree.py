"""RolloutTree: building, traversal, prefix-to-tree, stats and JSON round-trip."""

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from arbor.tree import Node, RolloutTree


def small_tree() -> RolloutTree:
    # prompt [1, 2, 3]; a = [10, 11] forks into b1 = [12, 2] and b2 = [13, 14, 2]
    tree = RolloutTree([1, 2, 3], problem={"id": "p0", "answer": "4"})
    a = tree.add_segment(tree.root, [10, 11], logprobs=[-0.1, -0.2])
    b1 = tree.add_segment(a, [12, 2], logprobs=[-0.3, -0.4])
    b2 = tree.add_segment(a, [13, 14, 2], logprobs=[-0.5, -0.6, -0.7], loss_mask=[1, 0, 1])
    b1.reward, b2.reward = 1.0, 0.0
    b1.finish_reason, b2.finish_reason = "stop", "length"
    return tree


def test_structure_and_offsets():
    tree = small_tree()
    a = tree.root.children[0]
    b1, b2 = a.children
    assert tree.prompt_ids == [1, 2, 3] and tree.problem == {"id": "p0", "answer": "4"}
    assert tree.root.depth == 0 and tree.root.token_ids == [] and tree.root.parent is None
    assert (a.depth, b1.depth, b2.depth) == (1, 2, 2)
    # Offsets within the response: a = [0, 2), b1 = [2, 4), b2 = [2, 5).
    assert (a.start, a.end, b1.start, b1.end, b2.start, b2.end) == (0, 2, 2, 4, 2, 5)
    assert b1.parent is a and a.parent is tree.root and tree.leaves() == [b1, b2]
    assert [n.id for n in tree.nodes()] == [a.id, b1.id, b2.id]
    assert tree.num_nodes == 3 and not a.is_leaf and not tree.root.is_leaf and b1.is_leaf
    assert (a.num_trainable(), b2.num_trainable()) == (2, 2)


def test_path_helpers():
    tree = small_tree()
    b1, b2 = tree.leaves()
    assert tree.path(b2) == [tree.root.children[0], b2] and tree.path(tree.root) == []
    assert tree.response_ids(b2) == [10, 11, 13, 14, 2]
    assert tree.full_ids(b1) == [1, 2, 3, 10, 11, 12, 2]
    assert tree.response_logprobs(b1) == [-0.1, -0.2, -0.3, -0.4]
    assert tree.response_loss_mask(b2) == [1, 1, 1, 0, 1]
    assert tree.response_loss_mask(b1) == [1, 1, 1, 1]
    # T_i counts the shared segment a on both paths: 2 + 2 and 2 + (3 - 1 masked).
    assert tree.num_trainable(b2) == 4 and tree.num_trainable(b1) == 4
    counts = tree.leaf_counts()
    assert counts == {0: 2, 1: 2, 2: 1, 3: 1}


def test_leaves_in_creation_order_after_later_forks():
    # x is created before y, although y comes first in DFS order.
    tree = RolloutTree([0])
    a = tree.add_segment(tree.root, [1])
    x = tree.add_segment(tree.root, [2])
    y = tree.add_segment(a, [3])
    assert tree.leaves() == [x, y]
    assert list(tree.nodes()) == [a, y, x]
    # Extending a leaf turns it into an inner node; the new segment takes its place.
    z = tree.add_segment(x, [4])
    assert tree.leaves() == [y, z] and z.depth == 2 and z.start == 1


def test_dropping_leaves_removes_the_nodes_only_they_pass_through():
    tree = small_tree()
    a = tree.root.children[0]
    b1, b2 = a.children
    c = tree.add_segment(b1, [15, 2])
    d = tree.add_segment(tree.root, [20, 2])
    assert tree.drop_leaves([c]) == 2  # c, then b1 (it leads to no other leaf); a still leads to b2
    assert tree.leaves() == [b2, d] and a.children == [b2]
    assert [n.id for n in (tree.root, a, b2, d)] == [0, 1, 2, 3]  # renumbered in creation order
    assert tree.stats().nodes == 3 and tree.leaf_counts() == {0: 2, 1: 1, 2: 1, 3: 1}
    with pytest.raises(ValueError, match="is not a leaf of this tree"):
        tree.drop_leaves([a])
    assert tree.drop_leaves([b2, d]) == 3 and tree.leaves() == [] and tree.num_nodes == 0
    rewarded = small_tree()
    rewarded.leaves()[0].env_reward = 0.5
    assert [leaf.env_reward for leaf in RolloutTree.from_json(rewarded.to_json()).leaves()] == [0.5, None]


def test_add_segment_validation():
    tree = RolloutTree([0])
    with pytest.raises(ValueError, match="logprobs has 1 entries for 2 tokens"):
        tree.add_segment(tree.root, [1, 2], logprobs=[-0.1])
    with pytest.raises(ValueError, match="loss_mask has 3 entries for 2 tokens"):
        tree.add_segment(tree.root, [1, 2], loss_mask=[1, 1, 0])
    with pytest.raises(ValueError, match="0 or 1"):
        tree.add_segment(tree.root, [1], loss_mask=[2])
    with pytest.raises(ValueError, match="does not belong"):
        tree.add_segment(Node(5, None, [], None, None), [1])
    other = RolloutTree([0])
    with pytest.raises(ValueError, match="does not belong"):
        tree.add_segment(other.add_segment(other.root, [1]), [2])
    leaf = tree.add_segment(tree.root, [5])
    with pytest.raises(ValueError, match=f"node {leaf.id} has no logprobs"):
        tree.response_logprobs(leaf)
    assert tree.num_nodes == 1  # the rejected segments left nothing behind


def test_stats_by_hand():
    s = small_tree().stats()
    # unique response tokens: 2 + 2 + 3 = 7; linearised: leaf paths 4 + 5 = 9
    # with the prompt (3 tokens): unique 3 + 7 = 10, linearised 9 + 2·3 = 15
    assert (s.unique_response_tokens, s.linearised_response_tokens) == (7, 9)
    assert (s.unique_tokens, s.linearised_tokens) == (10, 15)
    assert s.sharing_ratio == pytest.approx(15 / 10)
    assert s.response_sharing_ratio == pytest.approx(9 / 7)
    assert (s.leaves, s.nodes, s.max_depth, s.prompt_tokens) == (2, 3, 2, 3)
    # An empty tree: ratios stay finite.
    empty = RolloutTree([1, 2]).stats()
    assert (empty.leaves, empty.linearised_tokens, empty.unique_tokens) == (0, 0, 2)
    assert empty.sharing_ratio == 0.0


def test_from_sequences_radix_splits_only_at_divergence():
    responses = [[5, 6, 7, 8], [5, 6, 9], [4]]
    tree = RolloutTree.from_sequences([1, 2], responses, rewards=[1, 0, 1])
    shared = tree.root.children[0]
    assert shared.token_ids == [5, 6] and [c.token_ids for c in shared.children] == [[7, 8], [9]]
    assert [c.token_ids for c in tree.root.children] == [[5, 6], [4]]
    assert [tree.response_ids(leaf) for leaf in tree.leaves()] == responses
    assert [leaf.reward for leaf in tree.leaves()] == [1, 0, 1]
    assert [leaf.depth for leaf in tree.leaves()] == [2, 2, 1]
    # The split kept the first response's node object (its id) as the lower half.
    assert [leaf.id for leaf in tree.leaves()] == [1, 3, 4] and shared.id == 2
    # prompt 2 tokens; unique 2 + 2 + 1 + 1 = 6 response tokens; linearised 4 + 3 + 1 = 8
    s = tree.stats()
    assert (s.unique_response_tokens, s.linearised_response_tokens) == (6, 8)
    assert (s.unique_tokens, s.linearised_tokens) == (8, 8 + 3 * 2)


def test_from_sequences_radix_shares_past_a_leaf_that_cannot_grow():
    # [5] is a leaf and must stay one; [5, 6, 7] and [5, 6, 8] still share [5, 6].
    tree = RolloutTree.from_sequences([1], [[5], [5, 6, 7], [5, 6, 8]])
    assert [c.token_ids for c in tree.root.children] == [[5], [5, 6]]
    assert [c.token_ids for c in tree.root.children[1].children] == [[7], [8]]
    assert tree.stats().unique_response_tokens == 1 + 2 + 1 + 1


def test_from_sequences_radix_split_keeps_sibling_order():
    # [5, 6, 7] is split when [5, 6, 8] arrives; its upper half takes its place before [4].
    tree = RolloutTree.from_sequences([1], [[5, 6, 7], [4], [5, 6, 8]])
    assert [c.token_ids for c in tree.root.children] == [[5, 6], [4]]
    assert [tree.response_ids(n) for n in tree.nodes() if not n.children] == [
        [5, 6, 7],
        [5, 6, 8],
        [4],
    ]


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
    logprobs = [[-1, -2, -3, -4, -5], [-1, -2, -3, -6]]
    tree = RolloutTree.from_sequences([1], responses, segment_tokens=2, logprobs=logprobs)
    first = tree.root.children[0]
    assert first.token_ids == [5, 6] and len(first.children) == 2
    # The shared token 7 is not split off: segments are whole, [7, 8] and [7, 3].
    assert [c.token_ids for c in first.children] == [[7, 8], [7, 3]]
    # Every node starts at a multiple of l, so depth = segment index + 1.
    for node in tree.nodes():
        assert node.start % 2 == 0 and node.depth == node.start // 2 + 1
    a, b = tree.leaves()
    assert a.token_ids == [9] and a.depth == 3 and b.depth == 2 and b.token_ids == [7, 3]
    assert tree.response_logprobs(a) == [-1, -2, -3, -4, -5]
    assert tree.response_logprobs(b) == [-1, -2, -3, -6]
    # unique 2 + 2 + 1 + 2 = 7, linearised 5 + 4 = 9
    assert (tree.stats().unique_response_tokens, tree.stats().linearised_response_tokens) == (7, 9)


def test_from_sequences_segment_mode_keeps_a_chain_without_branching():
    # No shared prefix: every response is its own chain of ceil(len / l) segments.
    tree = RolloutTree.from_sequences([0], [[1, 2, 3, 4, 5], [6, 7]], segment_tokens=2)
    a, b = tree.leaves()
    assert [n.token_ids for n in tree.path(a)] == [[1, 2], [3, 4], [5]]
    assert [n.token_ids for n in tree.path(b)] == [[6, 7]]
    assert (a.depth, b.depth) == (3, 1)


def test_from_sequences_radix_logprobs_follow_tokens_across_splits():
    responses = [[5, 6, 7], [5, 6, 8], [5, 9]]
    logprobs = [[-0.5, -0.6, -0.7], [-0.5, -0.6, -0.8], [-0.55, -0.9]]
    tree = RolloutTree.from_sequences([1], responses, logprobs=logprobs)
    # Splits cut the logprobs with the tokens: [5] | [6] | [7], [8] and [9].
    assert [tree.response_logprobs(leaf) for leaf in tree.leaves()] == [
        [-0.5, -0.6, -0.7],
        [-0.5, -0.6, -0.8],
        [-0.5, -0.9],  # token 5 is shared: the first response's logprob is kept
    ]
    assert tree.root.children[0].logprobs == [-0.5]


def test_from_sequences_argument_errors():
    with pytest.raises(ValueError, match="1 rewards for 2 responses"):
        RolloutTree.from_sequences([1], [[2], [3]], rewards=[1])
    with pytest.raises(ValueError, match="1 logprob lists for 2 responses"):
        RolloutTree.from_sequences([1], [[2], [3]], logprobs=[[-1.0]])
    with pytest.raises(ValueError, match="response 0: 2 logprobs for 1 tokens"):
        RolloutTree.from_sequences([1], [[2]], logprobs=[[-1, -2]])
    with pytest.raises(ValueError, match="segment_tokens"):
        RolloutTree.from_sequences([1], [[2]], segment_tokens=0)


def _snapshot(tree: RolloutTree) -> list[tuple]:
    # Every field a consumer reads, node by node in id order (children by id, in order).
    return [
        (
            n.id,
            None if n.parent is None else n.parent.id,
            [c.id for c in n.children],
            n.depth,
            n.start,
            n.token_ids,
            n.logprobs,
            n.loss_mask,
            n.reward,
            n.finish_reason,
            n.weight_version,
        )
        for n in [tree.root, *sorted(tree.nodes(), key=lambda n: n.id)]
    ]


def test_json_round_trip_after_radix_splits():
    tree = RolloutTree.from_sequences(
        [1, 2],
        [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8], [4]],
        rewards=[1, 0, 1, 0],
        logprobs=[[-1, -2, -3, -4], [-1, -2, -5], [-1, -2, -3, -4], [-9]],
        problem={"id": "q", "answer": "2"},
    )
    tree.leaves()[0].finish_reason = "stop"
    tree.leaves()[1].weight_version = "3"
    # Splits give upper nodes larger ids than the leaves below them: ids are not DFS order.
    assert [n.id for n in tree.nodes()] != sorted(n.id for n in tree.nodes())
    again = RolloutTree.from_json(tree.to_json())
    assert _snapshot(again) == _snapshot(tree)
    assert [n.id for n in again.leaves()] == [n.id for n in tree.leaves()] == [1, 3, 5, 6]
    assert [again.response_ids(leaf) for leaf in again.leaves()] == [
        tree.response_ids(leaf) for leaf in tree.leaves()
    ]
    assert again.problem == {"id": "q", "answer": "2"} and again.stats() == tree.stats()


def test_json_round_trip_keeps_loss_mask_and_creation_order():
    tree = small_tree()
    late = tree.add_segment(tree.root, [20], logprobs=[-1.5], loss_mask=[0])
    late.reward = 0.5
    tree.add_segment(tree.root.children[0].children[0], [21])  # b1 grows: leaf order changes
    again = RolloutTree.from_json(tree.to_json())
    assert _snapshot(again) == _snapshot(tree)
    assert [leaf.id for leaf in again.leaves()] == [leaf.id for leaf in tree.leaves()] == [3, 4, 5]
    assert again.response_loss_mask(again.leaves()[0]) == [1, 1, 1, 0, 1]


def test_from_dict_rejects_a_child_before_its_parent():
    data = small_tree().to_dict()
    data["nodes"].reverse()
    with pytest.raises(ValueError, match="comes before its parent"):
        RolloutTree.from_dict(data)


responses_strategy = st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=8
)


def _fake_logprob(prefix: list[int]) -> float:
    # A function of the prefix, as a real policy's: shared prefixes agree on logprobs.
    return -float(hash(tuple(prefix)) % 1000) / 100


@settings(max_examples=80, deadline=None)
@given(responses=responses_strategy, seg=st.sampled_from([None, 1, 2, 3]))
@example(responses=[[0], [0, 1, 2], [0, 1, 3]], seg=None)  # a leaf [0] before [0, 1]
@example(responses=[[0, 1], [0, 1], [0, 1, 2, 3], [0, 1, 2, 0]], seg=2)
def test_prefix_to_tree_properties(responses, seg):
    logprobs = [[_fake_logprob(r[: k + 1]) for k in range(len(r))] for r in responses]
    tree = RolloutTree.from_sequences(
        [9], responses, segment_tokens=seg, rewards=list(range(len(responses))), logprobs=logprobs
    )
    leaves = tree.leaves()
    assert [tree.response_ids(leaf) for leaf in leaves] == responses
    assert [tree.response_logprobs(leaf) for leaf in leaves] == logprobs
    assert [leaf.reward for leaf in leaves] == list(range(len(responses)))
    assert all(not leaf.children and leaf.token_ids for leaf in leaves)
    s = tree.stats()
    assert s.linearised_response_tokens == sum(map(len, responses))
    assert s.linearised_response_tokens == sum(len(tree.response_ids(leaf)) for leaf in leaves)
    assert s.unique_response_tokens <= s.linearised_response_tokens
    if seg is None:
        # Radix: an inner node exists only where responses diverge (≥ 2 children), and
        # every non-final token prefix is stored once; final tokens are each a leaf's own.
        assert all(len(n.children) >= 2 for n in tree.nodes() if n.children)
        inner = {tuple(r[:k]) for r in responses for k in range(1, len(r))}
        assert s.unique_response_tokens == len(inner) + len(responses)
    else:
        # Segments: boundaries at multiples of l, depth = segment index + 1, and every
        # non-final segment prefix is stored once.
        assert all(n.start % seg == 0 and n.depth == n.start // seg + 1 for n in tree.nodes())
        assert all(0 < len(n.token_ids) <= seg for n in tree.nodes())
        inner = {tuple(r[:e]) for r in responses for e in range(seg, len(r), seg)}
        last = sum(len(r) - (len(r) - 1) // seg * seg for r in responses)
        assert s.unique_response_tokens == seg * len(inner) + last
    again = RolloutTree.from_json(tree.to_json())
    assert _snapshot(again) == _snapshot(tree)


def test_radix_tree_is_minimal_for_distinct_responses():
    # Distinct responses ending in a shared EOS token: the unique count equals a trie's.
    rng = random.Random(0)
    responses = [[rng.randint(0, 2) for _ in range(rng.randint(1, 6))] + [99] for _ in range(20)]
    responses = [list(r) for r in {tuple(r) for r in responses}]
    tree = RolloutTree.from_sequences([1], responses)
    prefixes = {tuple(r[:k]) for r in responses for k in range(1, len(r) + 1)}
    assert tree.stats().unique_response_tokens == len(prefixes)
