"""Tree-packed training equals linear training: loss, gradients and metrics (docs/algorithms.md).

Random trees: random shapes, branch points inside segments (prefix-to-tree of random
responses), masked segments, several trees per pack, partitioned trees (tiny budgets),
per-leaf and per-token advantages, random old logprobs, KL (k1, k3) and entropy.
"""

import random
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from arbor.train.packed_loss import policy_loss
from arbor.tree import RolloutTree

VOCAB = 48


def tiny(kind: str, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, vocab_size=VOCAB, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(Qwen2Config(**common)) if kind == "qwen2" else LlamaForCausalLM(LlamaConfig(**common))
    return model.to(dtype)


def random_tree(rng: random.Random, i: int) -> RolloutTree:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
    if rng.random() < 0.5:
        # Grown segment by segment, some segments masked (tool output).
        tree = RolloutTree(prompt, problem={"id": f"t{i}"})
        nodes = [tree.root]
        for _ in range(rng.randint(1, 9)):
            n = rng.randint(1, 5)
            mask = None if rng.random() < 0.7 else [rng.randint(0, 1) for _ in range(n)]
            nodes.append(tree.add_segment(
                rng.choice(nodes), [rng.randrange(VOCAB) for _ in range(n)],
                logprobs=[-3 * rng.random() for _ in range(n)], loss_mask=mask,
            ))
        return tree
    # Prefix-to-tree of random responses: branch points fall inside segments.
    stem = [rng.randrange(4) for _ in range(rng.randint(0, 6))]
    responses = [stem[: rng.randint(0, len(stem))] + [rng.randrange(4) for _ in range(rng.randint(1, 6))]
                 for _ in range(rng.randint(1, 6))]
    logprobs = [[-3 * rng.random() for _ in r] for r in responses]
    return RolloutTree.from_sequences(prompt, responses, segment_tokens=rng.choice([None, 2, 3]),
                                      logprobs=logprobs, problem={"id": f"s{i}"})


def random_advantages(rng: random.Random, trees, per_token: bool):
    if per_token:
        return [[[rng.gauss(0, 1) for _ in range(leaf.end)] for leaf in t.leaves()] for t in trees]
    return [[rng.choice([0.0, rng.gauss(0, 1)]) for _ in t.leaves()] for t in trees]


def loss_and_grads(model, trees, advantages, **kw):
    model.zero_grad()
    loss, metrics = policy_loss(model, trees, advantages, **kw)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], metrics


def assert_close(a, b, rtol):
    scale = max(a.abs().max().item(), 1e-12)
    assert (a - b).abs().max().item() <= rtol * scale


CASES = [
    # (seed, model, normalize, kl, entropy_coef, per_token, slack, attention)
    # slack: pack budget = longest root-to-leaf path + slack (small → partitioned trees);
    # None: one big pack holding several trees.
    (0, "qwen2", "token", None, 0.0, False, None, "blocks"),
    (1, "qwen2", "sequence", None, 0.0, False, None, "dense"),
    (2, "llama", "token", "k3", 0.01, False, 0, "blocks"),
    (3, "llama", "sequence", "k1", 0.0, True, 2, "blocks"),
    (4, "qwen2", "token", "k1", 0.05, True, 5, "dense"),
    (5, "qwen2", "sequence", "k3", 0.02, False, 1, "blocks"),
]


def budget(trees, slack):
    if slack is None:
        return 4096
    return max(len(t.prompt_ids) + leaf.end for t in trees for leaf in t.leaves()) + slack


def random_case(seed, kind, normalize, kl, entropy_coef, per_token):
    """A CASES row's trees, advantages, float64 model and loss settings (a KL reference with ``kl``)."""
    rng = random.Random(seed)
    trees = [random_tree(rng, i) for i in range(rng.randint(2, 4))]
    advantages = random_advantages(rng, trees, per_token)
    kw = dict(normalize=normalize, entropy_coef=entropy_coef, clip_low=0.2, clip_high=0.28)
    if kl:
        kw.update(kl_coef=0.1, kl_estimator=kl, ref_model=tiny(kind, torch.float64, seed + 100))
    return trees, advantages, tiny(kind, torch.float64, seed), kw


@pytest.mark.parametrize("seed, kind, normalize, kl, entropy_coef, per_token, slack, attention", CASES)
def test_tree_equals_linear_float64(seed, kind, normalize, kl, entropy_coef, per_token, slack, attention):
    trees, advantages, model, kw = random_case(seed, kind, normalize, kl, entropy_coef, per_token)
    lin_loss, lin_grads, lin_m = loss_and_grads(model, trees, advantages, mode="padded", **kw)
    tree_loss, tree_grads, tree_m = loss_and_grads(
        model, trees, advantages, mode="tree", pack_tokens=budget(trees, slack), attention=attention, **kw
    )
    assert tree_loss.item() == pytest.approx(lin_loss.item(), rel=1e-6, abs=1e-12)
    for a, b in zip(lin_grads, tree_grads):
        assert_close(a, b, 1e-6)
    for name in ("clip_fraction", "approx_kl", "entropy", "logprob_gap", "kl", "linearised_tokens"):
        assert tree_m[name] == pytest.approx(lin_m[name], rel=1e-6, abs=1e-9), name
    assert tree_m["tokens"] <= lin_m["tokens"]  # unique ≤ linearised


# bf16 tolerance: the two modes run different kernels (one packed forward with block
# attention vs padded per-leaf sequences), so bf16 rounding differs per op. With float32
# log-probs the loss agrees to ~1e-3 relative and gradients to ~2e-2 of their largest
# entry (bf16 has 8 mantissa bits: 2^-8 ≈ 4e-3 per rounding, over two layers).
LOW_PRECISION = [  # (dtype, seed, loss rtol, gradient rtol)
    (torch.float32, 7, 1e-4, 1e-4),
    (torch.bfloat16, 21, 1e-2, 5e-2),
]


@pytest.mark.parametrize("dtype, seed, loss_rtol, grad_rtol", LOW_PRECISION)
@pytest.mark.parametrize("normalize", ["token", "sequence"])
def test_tree_equals_linear_in_low_precision(normalize, dtype, seed, loss_rtol, grad_rtol):
    rng = random.Random(seed)
    trees = [random_tree(rng, i) for i in range(3)]
    advantages = random_advantages(rng, trees, per_token=False)
    model = tiny("qwen2", dtype, seed)
    lin_loss, lin_grads, lin_m = loss_and_grads(model, trees, advantages, mode="padded", normalize=normalize)
    tree_loss, tree_grads, tree_m = loss_and_grads(model, trees, advantages, mode="tree", normalize=normalize,
                                                   pack_tokens=budget(trees, 3))
    # Probabilities are formed in float32 whatever the model's dtype (arbor.train.lm_head).
    assert tree_loss.dtype == torch.float32 and lin_loss.dtype == torch.float32
    assert tree_loss.item() == pytest.approx(lin_loss.item(), rel=loss_rtol, abs=1e-7)
    for a, b in zip(lin_grads, tree_grads):
        assert_close(a.float(), b.float(), grad_rtol)
    assert tree_m["logprob_gap"] == pytest.approx(lin_m["logprob_gap"], rel=loss_rtol, abs=1e-7)


def test_clipping_is_exercised():
    # Old logprobs far from the model's make ratios leave the trust region, so the
    # equality above also covers clipped tokens.
    rng = random.Random(0)
    trees = [random_tree(rng, i) for i in range(3)]
    _, metrics = policy_loss(tiny("qwen2", torch.float64), trees, random_advantages(rng, trees, False))
    assert 0.0 < metrics["clip_fraction"] < 1.0


def test_kl_without_reference_is_an_error():
    tree = RolloutTree.from_sequences([1], [[2]], logprobs=[[-1.0]])
    with pytest.raises(ValueError, match="ref_model"):
        policy_loss(tiny("qwen2", torch.float64), [tree], [[1.0]], kl_coef=0.1)


def test_the_padded_reference_is_named_padded():
    """``mode="linear"`` named it before the trainer's loss.mode: linear (packed chains) took the
    word: asking for it says both names."""
    tree = RolloutTree.from_sequences([1], [[2]], logprobs=[[-1.0]])
    message = ("mode 'linear' is now 'padded' (every leaf its own padded sequence); the trainer's loss.mode: "
               "linear (every leaf its own packed chain) is arbor.train.packing.linearise_trees")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        policy_loss(tiny("qwen2", torch.float64), [tree], [[1.0]], mode="linear")
    with pytest.raises(ValueError, match="mode must be 'tree' or 'padded'"):
        policy_loss(tiny("qwen2", torch.float64), [tree], [[1.0]], mode="dense")


def test_learner_style_accumulation_over_packs_and_ranks():
    # The learner calls backward pack by pack with one global denominator, packs spread
    # over ranks: the accumulated gradients equal one linear step over the whole batch.
    from arbor.train.packed_loss import pack_loss
    from arbor.train.packing import assign_to_ranks, loss_denominator, pack_trees

    rng = random.Random(11)
    trees = [random_tree(rng, i) for i in range(4)]
    advantages = random_advantages(rng, trees, per_token=True)
    model = tiny("llama", torch.float64, 11)
    lin_loss, lin_grads, _ = loss_and_grads(model, trees, advantages, mode="padded", normalize="sequence")
    packs = pack_trees(trees, advantages, pack_tokens=budget(trees, 1), normalize="sequence")
    assert len(packs) > 2  # the budget forces several packs
    denominator = loss_denominator(trees, "sequence")
    model.zero_grad()
    total = 0.0
    for rank in assign_to_ranks(packs, 2):
        for i in rank:
            loss, _ = pack_loss(model, packs[i], denominator, attention="blocks")
            loss.backward()
            total += loss.item()
    assert total == pytest.approx(lin_loss.item(), rel=1e-6, abs=1e-12)
    for a, p in zip(lin_grads, model.parameters()):
        assert_close(a, p.grad, 1e-6)


def tree_with_empty_nodes(rng: random.Random, i: int) -> RolloutTree:
    """A grown tree in which about a third of the segments are empty (aborted, or empty at the
    context limit), some of them with children and some of them leaves."""
    tree = RolloutTree([rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))], problem={"id": f"e{i}"})
    nodes = [tree.root]
    for _ in range(rng.randint(3, 10)):
        n = 0 if rng.random() < 0.35 else rng.randint(1, 4)
        nodes.append(tree.add_segment(rng.choice(nodes), [rng.randrange(VOCAB) for _ in range(n)],
                                      logprobs=[-3 * rng.random() for _ in range(n)]))
    return tree


@pytest.mark.parametrize("seed", range(6))
def test_empty_nodes_tree_equals_linear_float64(seed):
    rng = random.Random(100 + seed)
    trees = [tree_with_empty_nodes(rng, i) for i in range(3)]
    assert any(not n.token_ids for t in trees for n in t.nodes())
    advantages = random_advantages(rng, trees, per_token=bool(seed % 2))
    model = tiny("qwen2", torch.float64, seed)
    kw = dict(normalize=["token", "sequence"][seed % 2], entropy_coef=0.01)
    lin_loss, lin_grads, lin_m = loss_and_grads(model, trees, advantages, mode="padded", **kw)
    slack = None if seed < 3 else seed - 3  # one pack, or partitioned trees
    tree_loss, tree_grads, tree_m = loss_and_grads(
        model, trees, advantages, mode="tree", pack_tokens=budget(trees, slack),
        attention=["blocks", "dense"][seed % 2], **kw,
    )
    assert tree_loss.item() == pytest.approx(lin_loss.item(), rel=1e-6, abs=1e-12)
    for a, b in zip(lin_grads, tree_grads):
        assert_close(a, b, 1e-6)
    assert tree_m["entropy"] == pytest.approx(lin_m["entropy"], rel=1e-6)
