"""Pure loss functions with hand-worked numbers (ALGORITHMS.md §4)."""

import math

import pytest
import torch

from arbor.lm_head import logprobs_and_entropy
from arbor.loss import (
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


def test_sums_add_across_packs():
    a = LossSums(t(1.0)[0], t(0.0)[0], t(2.0)[0], LossStats(loss=0.25, clipped=1, tokens=2, linearised_tokens=3))
    b = LossSums(t(0.5)[0], t(1.0)[0], t(1.0)[0], LossStats(loss=0.5, clipped=2, tokens=1, linearised_tokens=1))
    c = a + b
    assert (c.objective.item(), c.entropy.item(), c.stats.clipped, c.stats.tokens) == (1.5, 3.0, 3, 3)
    # The metrics divide once, after the sums over packs (and ranks): 3 clipped of 4 linearised.
    m = c.stats.metrics()
    assert (m["loss"], m["clip_fraction"], m["tokens"], m["linearised_tokens"]) == (0.75, 3 / 4, 3.0, 4.0)
    assert sum([a.stats, b.stats], LossStats()) == c.stats  # how the trainer adds the ranks' results


# -- engine and learner agree at any sampling temperature ------------------------------------


@pytest.fixture(scope="module")
def engine_and_model(tmp_path_factory):
    from tiny_model import build_tiny_model_dir
    from transformers import AutoModelForCausalLM

    from arbor.engines.local import LocalEngine

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
    from arbor.packed_loss import policy_loss
    from arbor.sampler import sample_trees

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
