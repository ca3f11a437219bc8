"""arbor.train.logprobs: tree-packed and padded log-probs equal per-leaf forwards (also for an ALiBi
model), the chunked head's memory bound, no KV cache, empty responses; and the SFT loss's tree ==
linear."""

import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import BloomConfig, BloomForCausalLM, Qwen2Config, Qwen2ForCausalLM

from arbor.train.logprobs import (
    pack_token_logprobs,
    padded_token_logprobs,
    set_behaviour_logprobs,
    tree_logprobs,
)
from arbor.train.packed_loss import sft_loss
from arbor.train.packing import pack_trees
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


def _packed(trees):
    """The first pack of ``trees`` and the packed indices of its owned (scored) tokens."""
    pack = next(iter(pack_trees(trees, pack_tokens=4096, require_logprobs=False)))
    return pack, pack.owned.nonzero()[:, 0]


class _LogitShapes(TorchDispatchMode):
    """Records the rows of every [rows, V] matmul (V = the vocabulary): the logits formed."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[1] == self.vocab:
            self.rows.append(out.shape[0])
        return out


def test_chunked_pack_logprobs_form_logits_chunk_tokens_rows_at_a_time():
    model, trees = setup()
    pack, select = _packed(trees)
    assert len(select) > 2
    with torch.no_grad(), _LogitShapes(model.config.vocab_size) as seen:
        logp, entropy = pack_token_logprobs(model, pack, select, chunk_tokens=2)
    assert seen.rows and max(seen.rows) == 2  # never [M, V]: the memory bound chunk_tokens promises
    with torch.no_grad():
        whole = pack_token_logprobs(model, pack, select)
    assert torch.allclose(logp, whole[0], atol=1e-12) and torch.allclose(entropy, whole[1], atol=1e-12)


@pytest.mark.parametrize("chunk_tokens", [0, 2])
def test_pack_logprobs_reject_an_unknown_attention(chunk_tokens):
    model, trees = setup()
    pack, select = _packed(trees)
    with pytest.raises(ValueError, match="attention must be auto, dense, blocks or flex, got 'sparse'"):
        pack_token_logprobs(model, pack, select, "sparse", chunk_tokens=chunk_tokens)


def test_padded_logprobs_build_no_kv_cache():
    model, trees = setup()
    assert model.config.use_cache  # the model's own default would build one
    caches = []
    model.register_forward_hook(lambda module, args, out: caches.append(out.past_key_values))
    with torch.no_grad():
        padded_token_logprobs(model, trees)
    assert caches == [None]  # one forward, no [layers, L, length] keys and values kept


def test_padded_logprobs_of_leaves_without_response_tokens_are_empty():
    model, _ = setup()
    trees = [RolloutTree.from_sequences([1, 2, 3], [[]]), RolloutTree.from_sequences([4], [[], []])]
    with torch.no_grad():
        logp, entropy, index = padded_token_logprobs(model, trees)
    assert logp.shape == entropy.shape == (0,) and logp.dtype == entropy.dtype == torch.float64
    assert index == [(0, 0, []), (1, 0, []), (1, 1, [])]


def test_padded_logprobs_of_a_zero_model_are_uniform_and_indexed_by_hand():
    model, _ = setup()
    for p in model.parameters():
        torch.nn.init.zeros_(p)  # every logit 0: the uniform distribution over V = 40 at any T
    trees = [RolloutTree.from_sequences([1, 2, 3], [[4, 5], [6]]), RolloutTree.from_sequences([7], [[8, 9, 10]])]
    with torch.no_grad():
        logp, entropy, index = padded_token_logprobs(model, trees, temperature=0.7)
    assert logp.tolist() == pytest.approx([-math.log(40)] * 6, abs=1e-12)
    assert entropy.tolist() == pytest.approx([math.log(40)] * 6, abs=1e-12)
    assert index == [(0, 0, [0, 1]), (0, 1, [2]), (1, 0, [3, 4, 5])]


def test_padded_logprobs_equal_per_leaf_forward_of_an_alibi_model():
    # BLOOM's ALiBi positions are the running sum of the attention mask: a mask of 0/1 per
    # real token is what makes a padded row score as the leaf alone.
    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=40, hidden_size=32, n_layer=2, n_head=4)).double()
    trees = [RolloutTree.from_sequences([1, 2, 3], [[4, 5], [6, 7, 8, 9]]),
             RolloutTree.from_sequences([10], [[11, 12, 13]])]
    with torch.no_grad():
        logp, _, index = padded_token_logprobs(model, trees)
        for t, b, flat in index:
            tree = trees[t]
            ids = tree.full_ids(tree.leaves()[b])
            alone = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
            p = len(tree.prompt_ids)
            expected = [alone[p + i - 1, ids[p + i]].item() for i in range(len(ids) - p)]
            assert logp[flat].tolist() == pytest.approx(expected, abs=1e-10)
