"""The three tree-attention paths give the same logits as running each leaf on its own."""

import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from arbor.train.packing import pack_trees
from arbor.train.tree_attention import (
    dense_tree_mask,
    flex_block_mask,
    head_dim,
    packed_logits,
    plan_blocks,
    resolve_attention,
)
from arbor.tree import RolloutTree


def model_and_trees(attn="sdpa", dtype=torch.float64, hidden_size=32):
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=40, attn_implementation=attn)
    rng = random.Random(1)
    trees = []
    for i in range(2):
        stem = [rng.randrange(40) for _ in range(5)]
        responses = [stem[: rng.randint(1, 5)] + [rng.randrange(40) for _ in range(4)] for _ in range(4)]
        trees.append(RolloutTree.from_sequences([1 + i, 2, 3], responses, problem={"id": i}))
    return Qwen2ForCausalLM(cfg).to(dtype).eval(), trees


def per_leaf_reference(model, tree, leaf):
    ids = torch.tensor([tree.full_ids(leaf)])
    return model(input_ids=ids).logits[0]  # [T, V]


@pytest.mark.parametrize("attention", ["dense", "blocks", "flex"])
def test_packed_logits_equal_each_leaf_alone(attention):
    # FlexAttention on CPU runs forward only, compiled, in float32.
    dtype, tol = (torch.float32, 1e-4) if attention == "flex" else (torch.float64, 1e-9)
    model, trees = model_and_trees(dtype=dtype)
    (pack,) = pack_trees(trees, require_logprobs=False)
    rows = torch.arange(pack.num_tokens)
    with torch.no_grad():
        logits = packed_logits(model, pack, rows, attention=attention)
        for t, tree in enumerate(trees):
            for leaf in tree.leaves():
                ref = per_leaf_reference(model, tree, leaf)
                # Packed indices of this leaf's path, in order: prompt, then its nodes' tokens.
                path_ids = {0} | {n.id for n in tree.path(leaf)}
                idx = [i for i, (ti, node, _) in enumerate(pack.origin) if ti == t and node in path_ids]
                assert pack.input_ids[idx].tolist() == tree.full_ids(leaf)
                torch.testing.assert_close(logits[idx], ref, rtol=tol, atol=tol)


def test_eager_attention_gets_an_additive_mask():
    model, trees = model_and_trees(attn="eager")
    (pack,) = pack_trees(trees, require_logprobs=False)
    rows = torch.arange(pack.num_tokens)
    with torch.no_grad():
        eager = packed_logits(model, pack, rows, attention="dense")
        model.config._attn_implementation = "sdpa"
        sdpa = packed_logits(model, pack, rows, attention="dense")
    torch.testing.assert_close(eager, sdpa)


def test_flex_block_mask_matches_dense_rule():
    _, trees = model_and_trees()
    (pack,) = pack_trees(trees, require_logprobs=False)
    dense = dense_tree_mask(pack)[0, 0]
    block_mask = flex_block_mask(pack, "cpu")
    n = pack.num_tokens
    q = torch.arange(n)[:, None].expand(n, n)
    k = torch.arange(n)[None, :].expand(n, n)
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(block_mask.mask_mod(zero, zero, q, k), dense)


def test_flex_refuses_cpu_training():
    model, trees = model_and_trees()
    (pack,) = pack_trees(trees, require_logprobs=False)
    with pytest.raises(ValueError, match="CUDA only"):
        packed_logits(model, pack, torch.arange(3), attention="flex")


def wide_pack():
    rng = random.Random(3)
    trees = []
    for _ in range(3):
        stem = [rng.randrange(40) for _ in range(60)]
        responses = [stem[: rng.randint(1, 60)] + [rng.randrange(40) for _ in range(rng.randint(5, 70))]
                     for _ in range(5)]
        trees.append(RolloutTree.from_sequences([1, 2, 3], responses))
    (pack,) = pack_trees(trees, require_logprobs=False)
    return pack


def test_flex_block_tiles_classified_from_subtree_ends():
    # Built without an N² tensor: every tile must be skipped / partial / full exactly as
    # the dense rule says (the last tiles are ragged: N is not a multiple of 16).
    pack = wide_pack()
    bs, n = 16, pack.num_tokens
    assert n % bs
    dense = dense_tree_mask(pack)[0, 0]
    bm = flex_block_mask(pack, "cpu", block_size=bs)
    kinds = {"partial": (bm.kv_num_blocks, bm.kv_indices), "full": (bm.full_kv_num_blocks, bm.full_kv_indices)}
    seen = {k: set() for k in kinds}
    for kind, (num, idx) in kinds.items():
        for qb in range(num.shape[-1]):
            for kb in idx[0, 0, qb, : num[0, 0, qb]].tolist():
                seen[kind].add((qb, kb))
    assert not seen["partial"] & seen["full"]
    for qb in range(-(-n // bs)):
        for kb in range(-(-n // bs)):
            tile = dense[qb * bs : (qb + 1) * bs, kb * bs : (kb + 1) * bs]
            ragged = tile.shape != (bs, bs)
            if (qb, kb) in seen["full"]:
                assert tile.all()
            elif (qb, kb) in seen["partial"]:
                assert tile.any() and (ragged or not tile.all())
            else:
                assert not tile.any()
    assert 0 < len(seen["full"]) and 0 < len(seen["partial"])


def test_flex_attention_with_tree_block_mask_matches_dense_sdpa():
    # FlexAttention runs forward on CPU (eager, float64): check the BlockMask end to end.
    from torch.nn.attention.flex_attention import flex_attention

    pack = wide_pack()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, pack.num_tokens, 8, dtype=torch.float64) for _ in range(3))
    out = flex_attention(q, k, v, block_mask=flex_block_mask(pack, "cpu", block_size=16))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_tree_mask(pack))
    torch.testing.assert_close(out, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention training needs CUDA")
def test_flex_trains_on_cuda_like_dense():
    model, trees = model_and_trees(dtype=torch.float32, hidden_size=64)  # heads of 16: Flex's least
    model = model.cuda().train()
    (pack,) = pack_trees(trees, require_logprobs=False)
    rows = torch.arange(pack.num_tokens)
    grads = {}
    for attention in ("dense", "flex"):
        model.zero_grad()
        packed_logits(model, pack, rows, attention=attention).float().logsumexp(-1).sum().backward()
        grads[attention] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["dense"], grads["flex"]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def assert_blocks_match_dense_with_gradients(model, pack):
    rows = torch.arange(pack.num_tokens)
    grads, logits = {}, {}
    for attention in ("dense", "blocks"):
        model.zero_grad()
        logits[attention] = packed_logits(model, pack, rows, attention=attention)
        logits[attention].logsumexp(-1).sum().backward()
        grads[attention] = [p.grad.clone() for p in model.parameters()]
    torch.testing.assert_close(logits["blocks"], logits["dense"], rtol=1e-9, atol=1e-9)
    for a, b in zip(grads["dense"], grads["blocks"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_blocks_of_one_shape_batched_match_dense_with_gradients():
    # Equal branches under one prefix (bench case (a) in small) make one batched group;
    # a deeper branch makes another: outputs and gradients must equal the dense mask.
    model, _ = model_and_trees()
    tree = RolloutTree([1, 2, 3])
    stem = tree.add_segment(tree.root, [4, 5, 6, 7])
    for k in range(4):
        leaf = tree.add_segment(stem, [10 + k, 11, 12])
    tree.add_segment(leaf.parent, [20, 21])  # a sibling with another shape
    tree.add_segment(leaf, [30])  # `leaf` gets a child: a chain block
    (pack,) = pack_trees([tree], require_logprobs=False)
    shapes = [(b.end - b.start, len(b.context)) for b in pack.blocks]
    assert len(set(shapes)) < len(shapes)  # some blocks share a shape: batched together
    assert_blocks_match_dense_with_gradients(model, pack)


def test_adjacent_blocks_without_context_match_dense():
    # Separate one-leaf trees of one length: one group of adjacent blocks (a view, no gather).
    model, _ = model_and_trees()
    trees = [RolloutTree.from_sequences([1, 2], [[3 + i, 4, 5]]) for i in range(3)]
    (pack,) = pack_trees(trees, require_logprobs=False)
    assert [(b.start, b.end, b.context.numel()) for b in pack.blocks] == [(0, 5, 0), (5, 10, 0), (10, 15, 0)]
    rows = torch.arange(pack.num_tokens)
    with torch.no_grad():
        dense = packed_logits(model, pack, rows, attention="dense")
        blocks = packed_logits(model, pack, rows, attention="blocks")
    torch.testing.assert_close(blocks, dense, rtol=1e-9, atol=1e-9)


def test_uneven_blocks_each_their_own_group_match_dense_with_gradients():
    # Segments of distinct lengths (a chain-of-thought tree with early stops): nearly every
    # block is a group of its own; the plan gathers all of them at once, then splits.
    model, _ = model_and_trees()
    rng = random.Random(5)
    tree = RolloutTree([1, 2, 3])
    frontier = [tree.root]
    for depth in range(3):
        frontier = [tree.add_segment(node, [rng.randrange(40) for _ in range(2 + depth * 4 + k)])
                    for node in frontier for k in range(2)]
    (pack,) = pack_trees([tree], require_logprobs=False)
    plan = plan_blocks(pack.blocks, "cpu")
    assert len(plan.groups) >= len(pack.blocks) - 2 > 4
    assert sum(g * n for g, n, _ in plan.groups) == pack.num_tokens
    assert torch.equal(plan.query_index[plan.restore], torch.arange(pack.num_tokens))  # restore inverts it
    assert_blocks_match_dense_with_gradients(model, pack)


def test_plan_gathers_nothing_when_groups_are_in_packed_order():
    # Adjacent context-free blocks of one length (separate one-leaf trees): one group,
    # already in packed order, so neither queries nor keys are gathered.
    trees = [RolloutTree.from_sequences([1, 2], [[3 + i, 4, 5]]) for i in range(3)]
    (pack,) = pack_trees(trees, require_logprobs=False)
    plan = plan_blocks(pack.blocks, "cpu")
    assert plan.groups == [(3, 5, 5)]
    assert plan.query_index is None and plan.key_index is None and plan.restore is None
    # Another length in the middle: the two 5-token blocks are no longer adjacent.
    trees.insert(1, RolloutTree.from_sequences([1, 2], [[6, 7]]))
    (pack,) = pack_trees(trees, require_logprobs=False)
    plan = plan_blocks(pack.blocks, "cpu")
    assert plan.groups == [(3, 5, 5), (1, 4, 4)]
    assert plan.query_index.tolist() == [*range(0, 5), *range(9, 19), *range(5, 9)]
    assert torch.equal(plan.key_index, plan.query_index)  # no context: keys are the queries


def test_auto_attention_avoids_flex_for_heads_flex_cannot_compile():
    # FlexAttention's compiled kernel needs head dimensions of at least 16 (seen on an H100:
    # inductor's "NYI: embedding dimension ... must be at least 16"); auto picks block attention
    # for smaller heads, and an explicit flex names the problem and the key.
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_attention("auto", cuda, head_dim=64) == "flex"
    assert resolve_attention("auto", cuda, head_dim=16) == "flex"
    assert resolve_attention("auto", cuda, head_dim=8) == "blocks"
    assert resolve_attention("auto", cpu, head_dim=64) == "blocks"
    assert resolve_attention("dense", cuda, head_dim=8) == "dense"
    with pytest.raises(ValueError, match=r"at least 16 dimensions.*have 8.*learner.attention"):
        resolve_attention("flex", cuda, head_dim=8)
    model, _ = model_and_trees()
    assert head_dim(model) == 8  # hidden 32 / 4 heads
    model.config.head_dim = 24
    assert head_dim(model) == 24
