"""Log-probs through the LM head: temperature, float32 whatever the model dtype, token chunks.

Chunked must equal unchunked in value and gradients (float64, 1e-9) in the whole policy
loss, both normalisations, with KL and entropy.
"""

import math
import random

import pytest
import torch
from test_tree_vs_linear import assert_close, budget, random_advantages, random_tree, tiny
from transformers import Gemma2Config, Gemma2ForCausalLM

from arbor.train.lm_head import chunkable_head, head_logprobs, logprobs_and_entropy
from arbor.train.logprobs import tree_logprobs
from arbor.train.packed_loss import policy_loss


def test_logprobs_and_entropy_at_a_temperature_by_hand():
    # logits [0, ln 3] at T = 0.5 are [0, 2 ln 3]: p = [1/10, 9/10].
    logits = torch.tensor([[0.0, math.log(3.0)]])
    logp, entropy = logprobs_and_entropy(logits, torch.tensor([1]), temperature=0.5)
    assert logp.item() == pytest.approx(math.log(0.9), abs=1e-6)
    assert entropy.item() == pytest.approx(-(0.1 * math.log(0.1) + 0.9 * math.log(0.9)), abs=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        logprobs_and_entropy(logits, torch.tensor([1]), temperature=0.0)


def test_bf16_logits_become_float32_before_the_softmax():
    # Near −10 a bf16 log-prob is quantised to steps of 0.0625; in float32 it is not.
    logits = torch.tensor([[0.0, -9.97]], dtype=torch.bfloat16)
    logp, entropy = logprobs_and_entropy(logits, torch.tensor([1]))
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32
    exact = float(logits[0, 1]) - math.log(1 + math.exp(float(logits[0, 1])))
    assert logp.item() == pytest.approx(exact, abs=1e-5)
    float64, _ = logprobs_and_entropy(logits.double(), torch.tensor([1]))
    assert float64.dtype == torch.float64  # wider inputs are not narrowed


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_head_logprobs_chunked_equal_whole(chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False).double()
    hidden = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (10,))
    weights = torch.randn(10, dtype=torch.float64)
    results = []
    for chunk_tokens in (0, chunk):
        head.zero_grad()
        hidden.grad = None
        logp, entropy = head_logprobs(hidden, head, targets, temperature=0.7, chunk_tokens=chunk_tokens)
        ((weights * logp).sum() + (entropy * weights.flip(0)).sum()).backward()
        results.append((logp.detach(), entropy.detach(), hidden.grad.clone(), head.weight.grad.clone()))
    for whole, chunked in zip(*results):
        assert torch.allclose(whole, chunked, rtol=1e-12, atol=1e-12)


CHUNK_CASES = [
    # (seed, normalize, kl, entropy_coef, per_token, chunk_tokens, temperature)
    (0, "token", "k3", 0.01, False, 4, 1.0),
    (1, "sequence", "k1", 0.02, True, 3, 0.7),
    (2, "token", "k1", 0.05, True, 1, 1.3),
    (3, "sequence", "k3", 0.01, False, 5, 0.6),
]


@pytest.mark.parametrize("seed, normalize, kl, entropy_coef, per_token, chunk_tokens, temperature", CHUNK_CASES)
def test_chunked_policy_loss_equals_unchunked_float64(seed, normalize, kl, entropy_coef, per_token, chunk_tokens,
                                                      temperature):
    rng = random.Random(seed)
    trees = [random_tree(rng, i) for i in range(3)]
    advantages = random_advantages(rng, trees, per_token)
    model = tiny("qwen2", torch.float64, seed)
    kw = dict(normalize=normalize, entropy_coef=entropy_coef, kl_coef=0.1, kl_estimator=kl,
              ref_model=tiny("qwen2", torch.float64, seed + 50), temperature=temperature,
              pack_tokens=budget(trees, 2), mode="tree")
    out = []
    for chunk in (0, chunk_tokens):
        model.zero_grad()
        loss, metrics = policy_loss(model, trees, advantages, chunk_tokens=chunk, **kw)
        loss.backward()
        out.append((loss.item(), [p.grad.clone() for p in model.parameters()], metrics))
    (whole_loss, whole_grads, whole_m), (chunk_loss, chunk_grads, chunk_m) = out
    assert chunk_loss == pytest.approx(whole_loss, rel=1e-9, abs=1e-12)
    for a, b in zip(whole_grads, chunk_grads):
        assert_close(a, b, 1e-9)
    for name in ("entropy", "kl", "logprob_gap", "clip_fraction", "approx_kl"):
        assert chunk_m[name] == pytest.approx(whole_m[name], rel=1e-9, abs=1e-12), name


def test_tree_logprobs_chunked_and_tempered():
    rng = random.Random(4)
    trees = [random_tree(rng, i) for i in range(3)]
    model = tiny("llama", torch.float64, 4)
    whole = tree_logprobs(model, trees, temperature=0.8)
    chunked = tree_logprobs(model, trees, temperature=0.8, chunk_tokens=2)
    for a, b in zip(whole, chunked):
        for node_id in a:
            assert torch.allclose(a[node_id], b[node_id], atol=1e-12)
    # The tempered log-prob of one token, by a plain forward over its leaf.
    tree = trees[0]
    leaf = tree.leaves()[0]
    ids = tree.full_ids(leaf)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    p = len(tree.prompt_ids)
    expected = torch.log_softmax(logits[p - 1] / 0.8, -1)[ids[p]].item()
    first = tree.path(leaf)[0]
    assert whole[0][first.id][0].item() == pytest.approx(expected, abs=1e-10)


def test_bf16_tree_logprobs_are_float32_and_close_to_float64():
    rng = random.Random(5)
    trees = [random_tree(rng, i) for i in range(3)]
    model64 = tiny("qwen2", torch.float64, 5)
    model16 = tiny("qwen2", torch.float64, 5).to(torch.bfloat16)
    exact = tree_logprobs(model64.to(torch.bfloat16).double(), trees)  # the bf16 weights, in float64
    got = tree_logprobs(model16, trees, chunk_tokens=4)
    diffs = torch.cat([(got[t][n] - exact[t][n]).abs() for t in range(len(trees)) for n in exact[t]])
    # bf16 activations round (≈1e-2 here); the log-softmax itself adds no 2^-4 quantisation
    # near −4 (a bf16 log-softmax would give ~5x this mean gap).
    assert diffs.mean().item() < 2e-2


def test_models_with_post_head_transforms_use_whole_logits():
    common = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=32, vocab_size=40, head_dim=8)
    gemma = Gemma2ForCausalLM(Gemma2Config(final_logit_softcapping=30.0, **common))
    assert chunkable_head(gemma) is None  # logits = cap·tanh(head(h)/cap), not head(h)
    plain = tiny("qwen2", torch.float32)
    assert chunkable_head(plain) is plain.lm_head
