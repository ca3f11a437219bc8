"""Pure loss functions with hand-worked numbers (docs/algorithms.md)."""

import math

import pytest
import torch
from tiny_model import uniform_qwen2

from arbor.train.lm_head import logprobs_and_entropy
from arbor.train.loss import (
    LossStats,
    LossSums,
    clipped_objective,
    combine,
    kl_penalty,
    token_sums,
)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_clipped_objective_hand_numbers():
    # ratios [1.5, 0.5, 1.1]; clip to [0.8, 1.28]
    logp = torch.log(t(1.5, 0.5, 1.1))
    old = t(0.0, 0.0, 0.0)
    # token 0: A = +2 → 2 · min(1.5, 1.28) = 2.56 (clipped)
    # token 1: A = -1 → -1 · max(0.5, 0.8) = -0.8 (clipped)
    # token 2: one leaf +1, one leaf -1 → 1.1 - 1.1 = 0 (inside the range)
    obj, ratio = clipped_objective(logp, old, t(2.0, 0.0, 1.0), t(0.0, -1.0, -1.0), 0.2, 0.28)
    assert obj.tolist() == pytest.approx([2.56, -0.8, 0.0])
    assert ratio.tolist() == pytest.approx([1.5, 0.5, 1.1])


def test_unclipped_side_keeps_gradient():
    # A > 0 with r < 1 - clip_low: min(rA, clip(r)A) = rA, the gradient flows (DAPO/PPO).
    logp = torch.log(t(0.5)).requires_grad_()
    obj, _ = clipped_objective(logp, t(0.0), t(1.0), t(0.0), 0.2, 0.28)
    obj.sum().backward()
    assert obj.item() == pytest.approx(0.5) and logp.grad.item() == pytest.approx(0.5)  # d(e^x)/dx = r


def test_kl_estimators():
    logp, ref = torch.log(t(0.5)), torch.log(t(0.25))
    # log r = log 2 = 0.693147; k3 = 1/r - 1 + log r = 0.5 - 1 + 0.693147 = 0.193147
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logp, ref, "k2")


def test_logprobs_and_entropy():
    logits = torch.zeros(2, 4, dtype=torch.float64)  # uniform over 4 tokens
    logits[1] = torch.tensor([0.0, 0.0, -math.inf, -math.inf])  # uniform over 2
    logp, entropy = logprobs_and_entropy(logits, torch.tensor([3, 1]))
    assert logp.tolist() == pytest.approx([-math.log(4), -math.log(2)])
    assert entropy[0].item() == pytest.approx(math.log(4))


def test_token_sums_and_metrics_by_hand():
    # Two tokens: the first shared by 3 leaves (2 with A>0, 1 with A<0), ratio 1.5 → the
    # two positive leaves are clipped; the second (1 leaf, A<0), ratio 1.0 → not clipped.
    logp = torch.log(t(1.5, 1.0))
    sums = token_sums(
        logp, t(0.7, 0.1), t(0.0, 0.0), None, weight=t(3.0, 1.0), adv_pos=t(2.0, 0.0),
        adv_neg=t(-1.0, -0.5), leaf_count=t(3.0, 1.0), n_pos=t(2.0, 0.0), n_neg=t(1.0, 1.0),
        clip_low=0.2, clip_high=0.28, kl_estimator="k3",
    )
    # objective = 2·1.28 + (-1)·1.5 + (-0.5)·1.0 = 0.56
    assert sums.objective.item() == pytest.approx(0.56)
    m = sums.stats.metrics()
    assert m["clip_fraction"] == pytest.approx(2 / 4)
    assert m["entropy"] == pytest.approx((3 * 0.7 + 0.1) / 4)
    assert m["logprob_gap"] == pytest.approx(3 * math.log(1.5) / 4)
    assert m["approx_kl"] == pytest.approx(3 * 0.5 * math.log(1.5) ** 2 / 4)
    assert (m["tokens"], m["linearised_tokens"]) == (2, 4)
    # loss = (-0.56 + 0 - 0.1 · (3·0.7 + 0.1)) / 4
    assert combine(sums, 4.0, kl_coef=0.5, entropy_coef=0.1).item() == pytest.approx((-0.56 - 0.22) / 4)
    # A denominator of 1 (one trainable token) divides by exactly 1: the floor only guards 0.
    assert combine(sums, 1.0, kl_coef=0.0, entropy_coef=0.0).item() == -sums.objective.item()


def test_sums_add_across_packs():
    a = LossSums(t(1.0)[0], t(0.0)[0], t(2.0)[0], LossStats(loss=0.25, clipped=1, tokens=2, linearised_tokens=3))
    b = LossSums(t(0.5)[0], t(1.0)[0], t(1.0)[0], LossStats(loss=0.5, clipped=2, tokens=1, linearised_tokens=1))
    c = a + b
    assert (c.objective.item(), c.kl.item(), c.entropy.item(), c.stats.clipped, c.stats.tokens) == (1.5, 1.0, 3.0, 3, 3)
    # The metrics divide once, after the sums over packs (and ranks): 3 clipped of 4 linearised.
    m = c.stats.metrics()
    assert (m["loss"], m["clip_fraction"], m["tokens"], m["linearised_tokens"]) == (0.75, 3 / 4, 3.0, 4.0)
    assert sum([a.stats, b.stats], LossStats()) == c.stats  # how the trainer adds the ranks' results


# -- engine and learner agree at any sampling temperature ------------------------------------


@pytest.fixture(scope="module")
def engine_and_model(tmp_path_factory):
    from tiny_model import build_tiny_model_dir
    from transformers import AutoModelForCausalLM

    from arbor.engines.embedded.engine import LocalEngine

    path = build_tiny_model_dir(tmp_path_factory.mktemp("tempered") / "model", seed=3)
    engine = LocalEngine(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    yield engine, model
    engine.shutdown()


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.3])
def test_old_logprobs_from_the_engine_match_the_learner_at_temperature(engine_and_model, temperature):
    """Trees sampled at T by the real embedded engine, scored by the same weights at T: the
    ratio is 1 (gap ≤ 1e-5, nothing clipped) in tree and linear mode. Scored at T = 1
    instead, the gap is the bias this guards against."""
    import asyncio

    from arbor.config import RolloutConfig
    from arbor.rollout.sampler import sample_trees
    from arbor.train.packed_loss import policy_loss

    engine, model = engine_and_model
    cfg = RolloutConfig(width=4, branch=2, segment_tokens=4, max_depth=3, temperature=temperature)
    prompts = [[17, 42, 99, 5, 63], [31, 200, 11, 54, 76, 150]]
    trees, _ = asyncio.run(sample_trees(engine, [{"id": "a"}, {"id": "b"}], prompts, cfg, eos_token_ids=[0], seed=1))
    advantages = [[(-1.0) ** i for i in range(len(t.leaves()))] for t in trees]
    for mode in ("tree", "padded"):
        _, metrics = policy_loss(model, trees, advantages, mode=mode, temperature=temperature, chunk_tokens=5)
        assert metrics["logprob_gap"] <= 1e-5, (mode, metrics)
        assert metrics["clip_fraction"] == 0.0
    if temperature != 1.0:
        _, untempered = policy_loss(model, trees, advantages, temperature=1.0)
        assert untempered["logprob_gap"] > 1e-3


# -- behaviours pinned by mutation testing (scripts/mutation.py train.loss) ------------------------
# A model whose weights are all 0 predicts the uniform distribution: log p = −log V for
# every token, entropy log V. Behaviour log-probs chosen relative to that give any ratio.

V = 32  # vocabulary of the uniform model


@pytest.fixture(scope="module")
def uniform_model():
    return uniform_qwen2(V)


@pytest.fixture(scope="module")
def random_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=32, vocab_size=V, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).double()


def forked_tree(ratio: float, masks=(None, None, None), d_logprobs: bool = True):
    """prompt [1, 2]; a [3, 4] → b [5], c [6, 7]; d [8] under the root. Behaviour
    log-probs −log V − log ratio, so the uniform model's ratio is ``ratio`` everywhere."""
    from arbor.tree import RolloutTree

    old = -math.log(V) - math.log(ratio)
    tree = RolloutTree([1, 2], problem={"id": "fork"})
    a = tree.add_segment(tree.root, [3, 4], logprobs=[old] * 2)
    tree.add_segment(a, [5], logprobs=[old], loss_mask=masks[0])
    tree.add_segment(a, [6, 7], logprobs=[old] * 2, loss_mask=masks[1])
    tree.add_segment(tree.root, [8], logprobs=[old] if d_logprobs else None, loss_mask=masks[2])
    return tree


def both_modes(model, trees, advantages, **kw):
    from arbor.train.packed_loss import policy_loss

    tree_loss, tree_m = policy_loss(model, trees, advantages, mode="tree", **kw)
    lin_loss, lin_m = policy_loss(model, trees, advantages, mode="padded", **kw)
    assert tree_loss.item() == pytest.approx(lin_loss.item(), rel=1e-9, abs=1e-12)
    # "tokens" counts unique tokens: fewer in a tree than in the linear batch.
    assert tree_m["tokens"] <= lin_m["tokens"]
    tree_m.pop("tokens"), lin_m.pop("tokens")
    assert tree_m == pytest.approx(lin_m, rel=1e-9, abs=1e-12)
    return tree_loss.item(), tree_m


def test_sequence_denominator_skips_a_leaf_without_trainable_tokens(uniform_model):
    # Ratio 1: o_t = A per (token, leaf). Leaf d's only token is masked (T_d = 0): weight 0
    # and not in the denominator. Leaves b (T 3, A 1) and c (T 4, A −0.5):
    # loss = −(1/2) · ((1/3)·3·1 + (1/4)·4·(−0.5)) = −(1 − 0.5) / 2 = −0.25
    # (counting d in the denominator would give −0.5 / 3).
    # d has no behaviour log-probs: nothing of it is trained, so none are needed.
    tree = forked_tree(1.0, masks=(None, None, [0]), d_logprobs=False)
    loss, metrics = both_modes(uniform_model, [tree], [[1.0, -0.5, 5.0]], normalize="sequence")
    assert loss == pytest.approx(-0.25)
    assert metrics["linearised_tokens"] == 7
    # Token normalisation: −(3·1 + 4·(−0.5)) / 7.
    loss, _ = both_modes(uniform_model, [tree], [[1.0, -0.5, 5.0]], normalize="token")
    assert loss == pytest.approx(-1 / 7)


@pytest.mark.parametrize("ratio, clipped", [(1.5, 3), (0.5, 1)])
def test_clip_count_ignores_zero_advantage_leaves_outside_the_range(uniform_model, ratio, clipped):
    # Every token has ratio 1.5 (above 1 + 0.28) or 0.5 (below 1 − 0.2). Leaves: b (A +1, path
    # 3 tokens), c (A 0, 4 tokens), d (A −1, 1 token): 8 linearised tokens.
    # Ratio 1.5 clips b's 3 (A > 0); 0.5 clips d's 1 (A < 0); c's zero advantage is never
    # clipped, though its tokens (shared a included) are out of range.
    # Objective at 1.5: b 3·1.28 + d (−1)·1.5 = 2.34; at 0.5: b 3·0.5 + d (−1)·0.8 = 0.7.
    tree = forked_tree(ratio)
    loss, metrics = both_modes(uniform_model, [tree], [[1.0, 0.0, -1.0]])
    assert metrics["clip_fraction"] == pytest.approx(clipped / 8)
    assert loss == pytest.approx(-(2.34 if ratio > 1 else 0.7) / 8)
    # Metrics by hand: |log r| and ½ log² r on all 8 linearised tokens; uniform entropy.
    assert metrics["logprob_gap"] == pytest.approx(abs(math.log(ratio)))
    assert metrics["approx_kl"] == pytest.approx(0.5 * math.log(ratio) ** 2)
    assert metrics["entropy"] == pytest.approx(math.log(V))


def test_kl_with_a_reference_but_zero_coefficient(uniform_model, random_model):
    # A reference is given but kl_coef is 0: no extra forward pass, KL reported as 0 in
    # both modes. With kl_coef > 0 the reference runs and both modes report the same KL.
    calls = []
    hook = random_model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        tree = forked_tree(1.0)
        loss, metrics = both_modes(uniform_model, [tree], [[1.0, -0.5, 0.5]], ref_model=random_model)
        assert calls == [] and metrics["kl"] == 0.0
        with_kl, kl_metrics = both_modes(uniform_model, [tree], [[1.0, -0.5, 0.5]], ref_model=random_model,
                                         kl_coef=0.5, kl_estimator="k1")
        assert len(calls) == 2 and kl_metrics["kl"] != 0.0  # one forward per mode
        # k1 per token = log π − log π_ref, averaged over the 8 linearised tokens; the
        # loss adds kl_coef · the same average (token normalisation).
        assert with_kl == pytest.approx(loss + 0.5 * kl_metrics["kl"])
    finally:
        hook.remove()


def test_logprob_gap_counts_differences_of_both_signs():
    # Token 0: learner above the engine by 0.2; token 1: below by 0.2. Gap = mean |Δ| = 0.2,
    # not 0 (signed differences cancel); approx_kl = ½ · 0.04 either way.
    sums = token_sums(
        t(-1.0, -2.0), t(0.0, 0.0), t(-1.2, -1.8), None, weight=t(1.0, 1.0), adv_pos=t(0.0, 0.0),
        adv_neg=t(0.0, 0.0), leaf_count=t(1.0, 1.0), n_pos=t(0.0, 0.0), n_neg=t(0.0, 0.0),
        clip_low=0.2, clip_high=0.28, kl_estimator="k3",
    )
    assert sums.stats.metrics()["logprob_gap"] == pytest.approx(0.2)
    assert sums.stats.metrics()["approx_kl"] == pytest.approx(0.02)


def test_a_ratio_exactly_on_the_clip_bound_is_not_clipped():
    # r = exp(0) = 1 exactly, the clip range [1 − 0, 1 + 0]: min(r·A, clip(r)·A) = r·A on
    # both sides and the gradient still flows, so neither token counts as clipped.
    sums = token_sums(
        t(-1.0, -1.0), t(0.0, 0.0), t(-1.0, -1.0), None, weight=t(1.0, 1.0), adv_pos=t(1.0, 0.0),
        adv_neg=t(0.0, -1.0), leaf_count=t(1.0, 1.0), n_pos=t(1.0, 0.0), n_neg=t(0.0, 1.0),
        clip_low=0.0, clip_high=0.0, kl_estimator="k3",
    )
    assert sums.stats.clipped == 0.0


def test_kl_and_entropy_sums_are_weighted_per_token():
    # k1 = logp − ref = (0.1, −0.2); weights (2, 0.5): Σ w·kl = 0.2 − 0.1 = 0.1;
    # leaf counts (3, 1): Σ_lin kl = 0.3 − 0.2 = 0.1 over 4 linearised tokens → 0.025.
    # Entropy (0.5, 1.0): Σ w·H = 1.0 + 0.5 = 1.5; Σ_lin H = 1.5 + 1.0 = 2.5 → 0.625.
    sums = token_sums(
        t(-1.0, -2.0), t(0.5, 1.0), t(-1.0, -2.0), t(-1.1, -1.8), weight=t(2.0, 0.5), adv_pos=t(1.0, 0.0),
        adv_neg=t(0.0, -1.0), leaf_count=t(3.0, 1.0), n_pos=t(1.0, 0.0), n_neg=t(0.0, 1.0),
        clip_low=0.2, clip_high=0.28, kl_estimator="k1",
    )
    assert sums.kl.item() == pytest.approx(0.1) and sums.entropy.item() == pytest.approx(1.5)
    m = sums.stats.metrics()
    assert m["kl"] == pytest.approx(0.025) and m["entropy"] == pytest.approx(0.625)
    # Ratio 1: objective = Σ adv_pos + Σ adv_neg = 1 − 1 = 0. Loss = (0 + 0.5·0.1 − 0.2·1.5) / 4.
    assert combine(sums, 4.0, kl_coef=0.5, entropy_coef=0.2).item() == pytest.approx((0.05 - 0.3) / 4)


def test_metrics_of_one_token_and_of_nothing():
    # One linearised token: divided by 1. No token at all: 0, not a division by zero.
    sums = token_sums(
        torch.log(t(1.5)), t(0.3), t(0.0), None, weight=t(1.0), adv_pos=t(1.0), adv_neg=t(0.0),
        leaf_count=t(1.0), n_pos=t(1.0), n_neg=t(0.0), clip_low=0.2, clip_high=0.28, kl_estimator="k3",
    )
    m = sums.stats.metrics()
    assert (m["clip_fraction"], m["entropy"], m["tokens"], m["linearised_tokens"]) == pytest.approx((1.0, 0.3, 1, 1))
    empty = LossSums(t(0.0)[0], t(0.0)[0], t(0.0)[0]).stats.metrics()
    assert empty["clip_fraction"] == 0.0 and empty["logprob_gap"] == 0.0
    # A zero denominator (nothing trainable anywhere) gives a zero loss, not NaN.
    assert combine(LossSums(t(0.0)[0], t(0.0)[0], t(0.0)[0]), 0.0, 0.0, 0.0).item() == 0.0


@pytest.mark.parametrize("ratio", [1.5, 0.5])
def test_defaults_of_the_pack_loss_and_the_policy_loss_agree(random_model, uniform_model, ratio):
    # The learner calls pack_loss pack by pack; its defaults must be policy_loss's
    # (clip 0.2 / 0.28, T = 1, tree mode, token normalisation, k3).
    from arbor.train.packed_loss import pack_loss, policy_loss
    from arbor.train.packing import loss_denominator, pack_trees

    tree = forked_tree(ratio)
    advantages = [[1.0, 0.0, -1.0]]
    loss, metrics = policy_loss(random_model, [tree], advantages)
    (pack,) = pack_trees([tree], advantages)
    by_pack, sums = pack_loss(random_model, pack, loss_denominator([tree], "token"))
    assert by_pack.item() == pytest.approx(loss.item(), rel=1e-12)
    assert sums.stats.metrics() == pytest.approx(metrics)
    explicit, _ = policy_loss(random_model, [tree], advantages, clip_low=0.2, clip_high=0.28, temperature=1.0,
                              mode="tree", normalize="token")
    assert explicit.item() == pytest.approx(loss.item(), rel=1e-12)
    hotter, _ = policy_loss(random_model, [tree], advantages, temperature=2.0)
    assert hotter.item() != pytest.approx(loss.item(), rel=1e-6)
    # The linear mode computes the same with a model whose log-probs differ per position.
    both_modes(random_model, [tree], advantages, normalize="sequence")
    # k3 by default: the same loss as naming it.
    kw = dict(ref_model=uniform_model, kl_coef=0.5)
    k3 = policy_loss(random_model, [tree], advantages, kl_estimator="k3", **kw)[0].item()
    k1 = policy_loss(random_model, [tree], advantages, kl_estimator="k1", **kw)[0].item()
    assert policy_loss(random_model, [tree], advantages, **kw)[0].item() == pytest.approx(k3, rel=1e-12)
    assert k1 != pytest.approx(k3, rel=1e-6)


def test_policy_loss_errors(uniform_model):
    from arbor.train.packed_loss import policy_loss, sft_loss

    tree = forked_tree(1.0)
    with pytest.raises(ValueError, match="^kl_coef > 0 needs a ref_model$"):
        policy_loss(uniform_model, [tree], [[1.0, 0.0, 0.0]], kl_coef=0.1)
    with pytest.raises(ValueError, match="mode must be 'tree' or 'padded', got 'flat'"):
        policy_loss(uniform_model, [tree], [[1.0, 0.0, 0.0]], mode="flat")
    with pytest.raises(AssertionError, match="^no trees to train on$"):
        policy_loss(uniform_model, [], [])
    with pytest.raises(AssertionError, match="^no trees to train on$"):
        sft_loss(uniform_model, [])


def test_pack_token_logprobs_defaults(random_model):
    # Defaults: T = 1, attention "auto", the whole LM head (no chunks); what pack_loss passes.
    from arbor.train.logprobs import pack_token_logprobs
    from arbor.train.packing import pack_trees

    (pack,) = pack_trees([forked_tree(1.0)], [[1.0, 0.0, -1.0]])
    select = pack.trained.nonzero()[:, 0]
    logp, entropy = pack_token_logprobs(random_model, pack, select)
    same = pack_token_logprobs(random_model, pack, select, "auto", temperature=1.0, chunk_tokens=0)
    assert torch.equal(logp, same[0]) and torch.equal(entropy, same[1])
    hotter = pack_token_logprobs(random_model, pack, select, temperature=2.0)[0]
    assert not torch.allclose(logp, hotter)
    chunked = pack_token_logprobs(random_model, pack, select, chunk_tokens=2)
    assert torch.allclose(logp, chunked[0], rtol=1e-10) and torch.allclose(entropy, chunked[1], rtol=1e-10)


def test_padded_token_logprobs_index_each_leafs_tokens(random_model):
    # forked_tree's leaves b (path a b: 3 tokens), c (a c: 4), d (1): flat positions 0-2, 3-6, 7.
    from arbor.train.logprobs import padded_token_logprobs

    logp, entropy, index = padded_token_logprobs(random_model, [forked_tree(1.0)])
    assert index == [(0, 0, [0, 1, 2]), (0, 1, [3, 4, 5, 6]), (0, 2, [7])]
    assert logp.shape == entropy.shape == (8,)
    assert torch.allclose(logp[[0, 1]], logp[[3, 4]])  # the shared segment a, scored twice


def test_pack_loss_defaults_leave_the_kl_out_and_estimate_it_with_k3(random_model, uniform_model):
    # The learner names every setting, but pack_loss's own defaults are public API: a
    # reference alone (kl_coef unset) costs nothing, not even its forward; with a
    # coefficient the KL is k3.
    from arbor.train.packed_loss import pack_loss
    from arbor.train.packing import loss_denominator, pack_trees

    tree = forked_tree(1.5)
    (pack,) = pack_trees([tree], [[1.0, 0.0, -1.0]])
    denominator = loss_denominator([tree], "token")
    plain, _ = pack_loss(random_model, pack, denominator)
    with_ref, sums = pack_loss(random_model, pack, denominator, ref_model=uniform_model)
    assert with_ref.item() == pytest.approx(plain.item(), rel=1e-12)
    assert sums.stats.kl_lin == 0.0
    kw = dict(ref_model=uniform_model, kl_coef=0.5)
    k3 = pack_loss(random_model, pack, denominator, kl_estimator="k3", **kw)[0].item()
    k1 = pack_loss(random_model, pack, denominator, kl_estimator="k1", **kw)[0].item()
    assert pack_loss(random_model, pack, denominator, **kw)[0].item() == pytest.approx(k3, rel=1e-12)
    assert k1 != pytest.approx(k3, rel=1e-6)


def test_decoupled_objective_hand_numbers():
    """AReaL's decoupled PPO with the proximal policy = the current one (one update per batch):
    u = π_θ/π_prox = 1, so o_t = min(π_prox/π_behav, C)·A per token; C = 2.

    One path whose segments came from two weight versions (per-token behaviour log-probs):
      token 0 (version 1): π 0.6, π_behav 0.5 → w = 1.2;          A = +1 → o = +1.2, ∂o/∂logp = 1.2
      token 1 (version 2): π 0.6, π_behav 0.2 → w = 3 → capped 2; A = −1 → o = −2.0, ∂o/∂logp = −2
      token 2 (version 2): π 0.45, π_behav 0.9 → w = 0.5;         A = +2 → o = +1.0, ∂o/∂logp = 1.0
    PPO against π_behav instead would give 1.2, −1·max(3, 1.28) = −3, 2·min(0.5, 0.8) = 1.0.
    """
    from arbor.train.loss import decoupled_objective

    logp = torch.log(t(0.6, 0.6, 0.45)).requires_grad_()
    behaviour = torch.log(t(0.5, 0.2, 0.9))
    pos, neg = t(1.0, 0.0, 2.0), t(0.0, -1.0, 0.0)
    obj, u, w = decoupled_objective(logp, logp.detach(), behaviour, pos, neg, 0.2, 0.28, 2.0)
    assert obj.tolist() == pytest.approx([1.2, -2.0, 1.0])
    assert u.tolist() == pytest.approx([1.0, 1.0, 1.0]) and w.tolist() == pytest.approx([1.2, 2.0, 0.5])
    obj.sum().backward()
    assert logp.grad.tolist() == pytest.approx([1.2, -2.0, 1.0])
    ppo, _ = clipped_objective(logp.detach(), behaviour, pos, neg, 0.2, 0.28)
    assert ppo.tolist() == pytest.approx([1.2, -3.0, 1.0])
    # The metric sums: mean behaviour weight (1.2 + 2 + 0.5)/3, one token in three truncated.
    ones, zeros = t(1.0, 1.0, 1.0), t(0.0, 0.0, 0.0)
    sums = token_sums(logp.detach(), zeros, behaviour, None, ones, pos, neg, ones, t(1.0, 0.0, 1.0),
                      t(0.0, 1.0, 0.0), clip_low=0.2, clip_high=0.28, kl_estimator="k3",
                      prox_logp=logp.detach(), behaviour_cap=2.0)
    assert sums.objective.item() == pytest.approx(0.2)
    metrics = sums.stats.metrics()
    assert metrics["behaviour_weight"] == pytest.approx(3.7 / 3) and metrics["truncated_fraction"] == pytest.approx(1 / 3)
    # On-policy sums report no behaviour weights (max_staleness 0 logs what it logged before).
    on_policy = token_sums(logp.detach(), zeros, behaviour, None, ones, pos, neg, ones, t(1.0, 0.0, 1.0),
                           t(0.0, 1.0, 0.0), clip_low=0.2, clip_high=0.28, kl_estimator="k3")
    assert "behaviour_weight" not in on_policy.stats.metrics()
    assert on_policy.objective.item() == pytest.approx(-0.8)


def test_decoupled_objective_clips_around_the_proximal_policy():
    # π_θ 0.6, π_prox 0.4, π_behav 0.4: w = 1, u = 1.5 > 1.28: A = +1 → 1.28, no gradient (clipped).
    from arbor.train.loss import decoupled_objective

    logp = torch.log(t(0.6)).requires_grad_()
    obj, u, w = decoupled_objective(logp, torch.log(t(0.4)), torch.log(t(0.4)), t(1.0), t(0.0), 0.2, 0.28, 2.0)
    obj.sum().backward()
    assert obj.item() == pytest.approx(1.28) and u.item() == pytest.approx(1.5) and w.item() == pytest.approx(1.0)
    assert logp.grad.item() == 0.0


def test_the_named_attention_reaches_every_forward(random_model, uniform_model):
    # "dense" runs a forward with a [1, 1, L, L] attention_mask; "auto" would run "blocks" on
    # the CPU (an arbor_blocks argument) with the same numbers, so only the call tells them apart.
    from arbor.train.logprobs import tree_logprobs
    from arbor.train.packed_loss import policy_loss, sft_loss

    seen = []

    def record(name):
        def hook(module, args, kwargs):
            seen.append((name, sorted(k for k in ("attention_mask", "arbor_blocks") if kwargs.get(k) is not None)))
        return hook

    hooks = [m.register_forward_pre_hook(record(name), with_kwargs=True)
             for name, m in (("policy", random_model), ("reference", uniform_model))]
    try:
        tree = forked_tree(1.0)
        policy_loss(random_model, [tree], [[1.0, 0.0, -1.0]], ref_model=uniform_model, kl_coef=0.5, attention="dense")
        tree_logprobs(random_model, [tree], attention="dense")
        sft_loss(random_model, [tree], attention="dense")
    finally:
        for h in hooks:
            h.remove()
    assert seen == [("policy", ["attention_mask"]), ("reference", ["attention_mask"])] + [("policy", ["attention_mask"])] * 2


def test_the_lm_head_runs_in_chunks_exactly_when_asked(random_model):
    # Chunked, the head's own call returns [1, M, 2] scores (log p, entropy), so [M, V]
    # logits never exist; whole, it returns [1, M, V]. The numbers agree either way, so
    # only the head's output width tells the memory-saving path from the default.
    from arbor.train.logprobs import pack_token_logprobs, tree_logprobs
    from arbor.train.packed_loss import pack_loss, pack_sft_loss, policy_loss
    from arbor.train.packing import loss_denominator, pack_trees

    widths = []
    hook = random_model.lm_head.register_forward_hook(lambda m, a, out: widths.append(out.shape[-1]))
    try:
        tree, advantages = forked_tree(1.0), [[1.0, 0.0, -1.0]]
        (pack,) = pack_trees([tree], advantages)
        select = pack.trained.nonzero()[:, 0]
        pack_token_logprobs(random_model, pack, select)
        pack_token_logprobs(random_model, pack, select, chunk_tokens=1)
        pack_loss(random_model, pack, loss_denominator([tree], "token"))
        pack_loss(random_model, pack, loss_denominator([tree], "token"), chunk_tokens=1)
        policy_loss(random_model, [tree], advantages)
        policy_loss(random_model, [tree], advantages, chunk_tokens=1)
        tree_logprobs(random_model, [tree])
        tree_logprobs(random_model, [tree], chunk_tokens=1)
        pack_sft_loss(random_model, pack, loss_denominator([tree], "token"))
        pack_sft_loss(random_model, pack, loss_denominator([tree], "token"), chunk_tokens=1)
    finally:
        hook.remove()
    assert widths == [V, 2] * 5


def test_losses_compute_in_the_dtype_of_the_policy_log_probs(random_model, uniform_model):
    # A float32 policy: its log-probs are float32, and the float64 pack columns and a float64
    # reference's log-probs are cast to them, so the loss is float32 like the model's work,
    # in both modes and for SFT too.
    import copy

    from arbor.train.packed_loss import pack_loss, pack_sft_loss, policy_loss
    from arbor.train.packing import loss_denominator, pack_trees

    policy = copy.deepcopy(random_model).float()
    tree, advantages = forked_tree(1.5), [[1.0, 0.0, -1.0]]
    (pack,) = pack_trees([tree], advantages)
    assert pack.weight.dtype == torch.float64
    loss, _ = pack_loss(policy, pack, loss_denominator([tree], "token"), ref_model=uniform_model, kl_coef=0.5)
    assert loss.dtype == torch.float32
    for mode in ("tree", "padded"):
        loss, _ = policy_loss(policy, [tree], advantages, mode=mode, ref_model=uniform_model, kl_coef=0.5)
        assert loss.dtype == torch.float32, mode
    assert pack_sft_loss(policy, pack, loss_denominator([tree], "token")).dtype == torch.float32


def test_tree_losses_pack_16384_tokens_by_default(monkeypatch, uniform_model):
    # The default pack budget of policy_loss, sft_loss and tree_logprobs, seen by a spy on
    # the real pack_trees (a 16 385-token forward to tell 16 384 from 16 385 is too slow here).
    import arbor.train.logprobs
    import arbor.train.packed_loss
    from arbor.train.packing import pack_trees

    budgets = []

    def spy(*args, **kwargs):
        budgets.append(kwargs["pack_tokens"])
        return pack_trees(*args, **kwargs)

    monkeypatch.setattr(arbor.train.packed_loss, "pack_trees", spy)
    monkeypatch.setattr(arbor.train.logprobs, "pack_trees", spy)
    tree = forked_tree(1.0)
    arbor.train.packed_loss.policy_loss(uniform_model, [tree], [[1.0, 0.0, -1.0]])
    arbor.train.packed_loss.sft_loss(uniform_model, [tree])
    arbor.train.logprobs.tree_logprobs(uniform_model, [tree])
    assert budgets == [16384] * 3


def test_a_reference_equal_to_the_policy_has_zero_kl_at_any_temperature(random_model):
    # The reference is scored at the rollout temperature like the policy: against itself
    # its KL is 0 at T = 0.7 in both modes (scored at T = 1 it would not be), so the loss
    # is the one without a KL term.
    tree, advantages = forked_tree(1.0), [[1.0, 0.0, -1.0]]
    plain, _ = both_modes(random_model, [tree], advantages, temperature=0.7)
    with_kl, metrics = both_modes(random_model, [tree], advantages, temperature=0.7, ref_model=random_model,
                                  kl_coef=0.5)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-12)
    assert with_kl == pytest.approx(plain, rel=1e-12)


def test_pack_loss_with_a_behaviour_cap_is_the_decoupled_objective(uniform_model):
    # π/π_behav = 2 on every token; leaves b (A +1, 3 path tokens), c (A 0, 4), d (A −1, 1);
    # denominator 8 linearised tokens. Off-policy, cap C = 1.5: the proximal policy is this
    # forward, so u = 1 and o = min(2, 1.5)·A: b 3·1.5, d −1.5 → loss −3/8, every token's
    # weight at the cap. On-policy PPO clips instead: b 3·1.28, d −1·max(2, 1.28) → −1.84/8.
    from arbor.train.packed_loss import pack_loss
    from arbor.train.packing import pack_trees

    (pack,) = pack_trees([forked_tree(2.0)], [[1.0, 0.0, -1.0]])
    loss, sums = pack_loss(uniform_model, pack, 8.0, behaviour_cap=1.5)
    assert loss.item() == pytest.approx(-3 / 8)
    metrics = sums.stats.metrics()
    assert metrics["behaviour_weight"] == pytest.approx(1.5) and metrics["truncated_fraction"] == 1.0
    on_policy, sums = pack_loss(uniform_model, pack, 8.0)
    assert on_policy.item() == pytest.approx(-1.84 / 8) and "behaviour_weight" not in sums.stats.metrics()


def test_padded_fields_of_sft_have_no_advantage_and_no_behaviour_log_probs():
    # advantages None (SFT): every token's advantage is 0, so no positive or negative
    # part; require_logprobs False: old log-probs 0, though the nodes have some.
    from arbor.train.packed_loss import padded_token_fields

    f = padded_token_fields([forked_tree(2.0)], None, "token", require_logprobs=False)
    assert f["mask"] == [1] * 8 and f["weight"] == [1.0] * 8
    for name in ("old", "pos", "neg", "npos", "nneg"):
        assert f[name] == [0.0] * 8, name


def test_sft_loss_by_hand(uniform_model):
    # The uniform model: −log p = log V on every token, so the token-normalised NLL is
    # log V whatever the tree, with the default leaf weights 1; pack_sft_loss's own defaults
    # (attention "auto", whole LM head) give the same for one pack.
    from arbor.train.packed_loss import pack_sft_loss, sft_loss
    from arbor.train.packing import pack_trees
    from arbor.tree import RolloutTree

    tree = forked_tree(1.0)
    for mode in ("tree", "padded"):
        assert sft_loss(uniform_model, [tree], mode=mode).item() == pytest.approx(math.log(V), rel=1e-12)
    (pack,) = pack_trees([tree], None, require_logprobs=False)
    assert pack_sft_loss(uniform_model, pack, 8.0).item() == pytest.approx(math.log(V), rel=1e-12)
    # Leaf weights 2, 0.5, 1 over paths of 3, 4, 1 tokens: log V · (6 + 2 + 1) / 8.
    weighted = sft_loss(uniform_model, [tree], [[2.0, 0.5, 1.0]])
    assert weighted.item() == pytest.approx(math.log(V) * 9 / 8, rel=1e-12)
    # One trainable token: the denominator 1 is used as it is (the 1e-12 floor only keeps
    # an empty batch from dividing by 0), so the loss is log V to the last bits.
    single = RolloutTree([1, 2], problem={"id": "one"})
    single.add_segment(single.root, [3])
    assert sft_loss(uniform_model, [single]).item() == pytest.approx(math.log(V), rel=1e-14, abs=0)
    with pytest.raises(ValueError, match="^SFT leaf weights must be ≥ 0$"):
        sft_loss(uniform_model, [tree], [[1.0, -0.5, 1.0]])


# -- the off-policy paths of token_sums, by hand (the survivors of the 2026-11-28 mutation run) --

LOG4 = math.log(4.0)


def _one_token(correction=None, prox_gap=LOG4, behaviour_cap=2.0, prox_logp=True):
    """One token, A = +1, π_θ = π_prox, π_prox/π_behav = exp(prox_gap)."""
    from arbor.train.rollout_correction import Correction

    old = t(-2.0)
    prox = old + prox_gap
    return token_sums(
        prox.clone(), t(0.0), old, None, weight=t(1.0), adv_pos=t(1.0), adv_neg=t(0.0), leaf_count=t(1.0),
        n_pos=t(1.0), n_neg=t(0.0), clip_low=0.2, clip_high=0.28, kl_estimator="k3",
        prox_logp=prox if prox_logp else None, behaviour_cap=behaviour_cap, correction=correction or Correction(),
    )


def test_the_decoupled_objective_weighs_by_its_own_cap_whatever_the_corrections_level():
    from arbor.train.loss import decoupled_objective
    from arbor.train.rollout_correction import Correction

    # π_prox/π_behav = 4, capped at behaviour_cap 1.5 (not Correction's default 2): 1.5 · A.
    lp, old = t(-1.0), t(-1.0 - math.log(4.0))
    objective, _, weight = decoupled_objective(lp, lp, old, t(1.0), t(0.0), 0.2, 0.28, 1.5)
    assert weight.item() == pytest.approx(1.5) and objective.item() == pytest.approx(1.5)
    # No correction recomputes π_old: the decoupled objective is token-level TIS at the cap, even
    # when loss.rollout_correction_level says sequence (it applies to tis/mis only).
    sums = _one_token(Correction(mode="none", level="sequence"), behaviour_cap=2.0)
    assert sums.objective.item() == pytest.approx(2.0) and sums.stats.behaviour_weight == pytest.approx(2.0)
    # The engine-vs-learner mismatch is measured against π_prox on this path too.
    assert sums.stats.mismatch.tokens == 1.0 and sums.stats.mismatch.kl > 0


def test_a_sequence_level_correction_leaves_token_weights_at_one_and_reports_no_behaviour_weight():
    from arbor.train.rollout_correction import Correction

    # tis at sequence level: the leaf's weight is already in its advantage columns, so the token
    # weight is 1 (a token-level weight would be min(4, 2) = 2), and it is no decoupled objective.
    sums = _one_token(Correction(mode="tis", level="sequence"))
    assert sums.objective.item() == pytest.approx(1.0)
    assert sums.stats.behaviour_weight == 0.0 and sums.stats.truncated == 0.0


def test_a_behaviour_weight_exactly_at_the_cap_is_not_counted_truncated():
    # π_prox = π_behav: weight exp(0) = 1 exactly, the cap 1: min(1, 1) = 1 truncates nothing.
    sums = _one_token(prox_gap=0.0, behaviour_cap=1.0)
    assert sums.stats.behaviour_weight == 1.0 and sums.stats.truncated == 0.0
    sums = _one_token(prox_gap=math.log(4.0), behaviour_cap=1.0)
    assert sums.stats.truncated == 1.0


def test_a_correction_without_pi_old_is_an_error_naming_it():
    from arbor.train.rollout_correction import Correction

    with pytest.raises(ValueError, match=r"loss.rollout_correction 'mis' needs π_old \(prox_logp\) recomputed"):
        _one_token(Correction(mode="mis"), prox_logp=False)
