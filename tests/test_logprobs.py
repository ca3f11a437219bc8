"""Tree-packed log-probs and SFT loss equal their per-leaf (linear) counterparts."""

import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from arbor.logprobs import set_behaviour_logprobs, tree_logprobs
from arbor.packed_loss import sft_loss
from arbor.tree import RolloutTree


def setup(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=40, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).double()
    rng = random.Random(seed)
    trees = []
    for i in range(3):
        stem = [rng.randrange(40) for _ in range(6)]
        responses = [stem[: rng.randint(0, 6)] + [rng.randrange(40) for _ in range(rng.randint(1, 5))]
                     for _ in range(rng.randint(1, 5))]
        tree = RolloutTree.from_sequences([rng.randrange(40) for _ in range(3)], responses, segment_tokens=2,
                                          problem={"id": i})
        # A masked segment (tool output) under the first node.
        tree.add_segment(tree.root.children[0], [5, 6, 7], loss_mask=[0, 0, 1])
        trees.append(tree)
    return model, trees


def test_tree_logprobs_equal_per_leaf_forward():
    model, trees = setup()
    per_tree = tree_logprobs(model, trees, pack_tokens=12)  # small budget: partitioned trees
    for tree, per_node in zip(trees, per_tree):
        for leaf in tree.leaves():
            ids = tree.full_ids(leaf)
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
            p = len(tree.prompt_ids)
            expected = [logp[p + i - 1, ids[p + i]].item() for i in range(len(ids) - p)]
            got = [x for n in tree.path(leaf) for x in per_node[n.id].tolist()]
            assert got == pytest.approx(expected, abs=1e-10)
    set_behaviour_logprobs(trees, per_tree)
    assert trees[0].response_logprobs(trees[0].leaves()[0])


@pytest.mark.parametrize("normalize", ["token", "sequence"])
def test_sft_tree_equals_linear(normalize):
    model, trees = setup(1)
    weights = [[1.0 + k for k in range(len(t.leaves()))] for t in trees]
    grads, values = {}, {}
    for mode in ("padded", "tree"):
        model.zero_grad()
        loss = sft_loss(model, trees, weights, normalize=normalize, mode=mode, pack_tokens=14)
        loss.backward()
        values[mode] = loss.item()
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    assert values["tree"] == pytest.approx(values["padded"], rel=1e-9)
    for a, b in zip(grads["padded"], grads["tree"]):
        # HF's RMSNorm computes in float32 even in a float64 model: compare to the scale.
        assert (a - b).abs().max() <= 1e-6 * a.abs().max()


@pytest.mark.parametrize("mode", ["tree", "padded"])
def test_negative_sft_weights_rejected_in_both_modes(mode):
    model, trees = setup()
    weights = [[-1.0] * len(t.leaves()) for t in trees]
    with pytest.raises(ValueError, match="must be ≥ 0"):
        sft_loss(model, trees, weights, mode=mode)
