"""Engine–learner mismatch correction (TIS/MIS, token and sequence level) with hand-worked
numbers; tree-packed equals the linearised batch; the quickstart reports the mismatch."""

import math
import random

import pytest
import torch
from test_tree_vs_linear import assert_close, random_advantages, random_tree, tiny
from tiny_model import uniform_qwen2

from arbor.config_load import load_config
from arbor.errors import ConfigError
from arbor.train.loss import token_sums
from arbor.train.packed_loss import pack_loss
from arbor.train.packing import linearise_trees, loss_denominator, pack_trees
from arbor.train.rollout_correction import (
    Correction,
    attach_learner_logprobs,
    correction_of,
    is_weights,
    leaf_correction_weights,
    leaf_log_ratios,
    token_mismatch,
)
from arbor.tree import RolloutTree

V = 32  # vocabulary of the uniform model: π_θ = 1/32 on every token


@pytest.fixture(scope="module")
def uniform_model():
    return uniform_qwen2(V)

def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def log_w(*ratios):
    """log π_old − log π_rollout for the given w = π_old/π_rollout."""
    return torch.log(t(*ratios))


# -- pure functions ---------------------------------------------------------------------------------


def test_is_weights_by_hand():
    # w = [0.4, 0.5, 1.5, 2.0, 3.0]
    lw = log_w(0.4, 0.5, 1.5, 2.0, 3.0)
    assert is_weights(lw, Correction("none")).tolist() == [1.0] * 5
    # tis, cap 2: min(w, 2)
    assert is_weights(lw, Correction("tis", cap=2.0)).tolist() == pytest.approx([0.4, 0.5, 1.5, 2.0, 2.0])
    # mis, bounds [0.5, 2]: w inside (bounds included), 0 outside
    assert is_weights(lw, Correction("mis", bounds=(0.5, 2.0))).tolist() == pytest.approx([0.0, 0.5, 1.5, 2.0, 0.0])


def test_token_mismatch_by_hand():
    # w = [0.5, 1, 2], the middle token shared by two leaves (4 linearised tokens).
    # k3 = w − 1 − log w: [−0.5 + log 2, 0, 1 − log 2] = [0.193147, 0, 0.306853]; Σ = 0.5 → 0.5 / 4
    stats = token_mismatch(log_w(0.5, 1.0, 2.0), t(0.0, 0.0, 0.0), t(1.0, 2.0, 1.0),
                           Correction("tis", cap=1.5, bounds=(0.6, 1.8)))
    m = stats.metrics()
    assert m["kl"] == pytest.approx(0.125)
    assert m["is_weight_mean"] == pytest.approx((0.5 + 2 * 1.0 + 2.0) / 4)  # 1.125
    assert m["is_weight_max"] == pytest.approx(2.0)
    assert m["truncated_fraction"] == pytest.approx(1 / 4)  # w = 2 > cap 1.5
    assert m["masked_fraction"] == pytest.approx(2 / 4)  # 0.5 and 2 outside [0.6, 1.8]
    # Sums add over packs; the max is a max.
    both = (stats + token_mismatch(log_w(3.0), t(0.0), t(1.0), Correction())).metrics()
    assert both["is_weight_max"] == pytest.approx(3.0) and both["is_weight_mean"] == pytest.approx(7.5 / 5)


def test_token_level_tis_and_mis_objective_by_hand():
    """π_θ = π_old (the first update: u = 1), w = π_old/π_rollout = [3, 0.5, 1.2], A = [+1, −1, +2].

    tis cap 2: o = [min(3, 2)·1, 0.5·(−1), 1.2·2] = [2, −0.5, 2.4], ∂o/∂logp = the same;
    mis [0.5, 2]: o = [0 (3 is outside), −0.5, 2.4]. PPO against π_rollout instead (none):
    [min(3, 1.28)·1, −1·max(2, 0.8)... ] — the ratio would carry the engine's gap.
    """
    logp = torch.log(t(0.3, 0.2, 0.6)).requires_grad_()
    rollout = logp.detach() - log_w(3.0, 0.5, 1.2)
    pos, neg, ones = t(1.0, 0.0, 2.0), t(0.0, -1.0, 0.0), t(1.0, 1.0, 1.0)
    counts = dict(n_pos=t(1.0, 0.0, 1.0), n_neg=t(0.0, 1.0, 0.0))
    kw = dict(clip_low=0.2, clip_high=0.28, kl_estimator="k3", prox_logp=logp.detach())
    tis = token_sums(logp, ones * 0, rollout, None, ones, pos, neg, ones, **counts, **kw,
                     correction=Correction("tis", cap=2.0))
    tis.objective.backward()
    assert tis.objective.item() == pytest.approx(2 - 0.5 + 2.4)
    assert logp.grad.tolist() == pytest.approx([2.0, -0.5, 2.4])
    mis = token_sums(logp.detach(), ones * 0, rollout, None, ones, pos, neg, ones, **counts, **kw,
                     correction=Correction("mis", bounds=(0.5, 2.0)))
    assert mis.objective.item() == pytest.approx(-0.5 + 2.4)
    assert mis.stats.mismatch.metrics()["masked_fraction"] == pytest.approx(1 / 3)
    # The ratio is π_θ/π_old: with π_θ = 1.5·π_old on token 0 it is clipped at 1.28, then weighted.
    moved = token_sums(logp.detach() + log_w(1.5, 1.0, 1.0), ones * 0, rollout, None, ones, pos, neg, ones,
                       **counts, **kw, correction=Correction("tis", cap=2.0))
    assert moved.objective.item() == pytest.approx(2 * 1.28 - 0.5 + 2.4)
    with pytest.raises(ValueError, match="needs π_old"):
        token_sums(logp.detach(), ones * 0, rollout, None, ones, pos, neg, ones, **counts, clip_low=0.2,
                   clip_high=0.28, kl_estimator="k3", correction=Correction("tis"))


# -- a tree whose shared node has two leaves with different weights ---------------------------------


def shared_node_tree():
    """prompt [1, 2]; shared s [3, 4] → leaf a [5], leaf b [6]. π_old = π_θ = 1/V (the uniform
    model, so u = 1); w = π_old/π_rollout: s [1.2, 1.0], a [1.25], b [2.5].
    Path sums: a log(1.2·1·1.25) = log 1.5, b log(1.2·1·2.5) = log 3."""
    old = -math.log(V)
    tree = RolloutTree([1, 2], problem={"id": "shared"})
    s = tree.add_segment(tree.root, [3, 4], logprobs=[old - math.log(1.2), old])
    tree.add_segment(s, [5], logprobs=[old - math.log(1.25)])
    tree.add_segment(s, [6], logprobs=[old - math.log(2.5)])
    for node in tree.nodes():
        node.learner_logprobs = [old] * len(node.token_ids) if node.parent is not None else None
    return tree


@pytest.mark.parametrize("mode, level, loss", [
    # Sequence level, A_a = +1, A_b = −1, 6 linearised tokens (denominator 6):
    #   tis cap 2: c_a = 1.5, c_b = min(3, 2) = 2 → objective 1.5·3·(+1) + 2·3·(−1) = −1.5 → loss 0.25;
    #   packed, each shared token carries 1.5 − 2 = −0.5 (×2), a +1.5, b −2: the same −1.5.
    ("tis", "sequence", 1.5 / 6),
    #   mis [0.5, 2]: c_b = 0 (3 is outside) → objective 4.5 → loss −0.75.
    ("mis", "sequence", -4.5 / 6),
    # Token level: weights s [1.2, 1.0] (the two leaves' advantages cancel there), a 1.25, b min(2.5, 2) = 2:
    #   objective 1.25 − 2 = −0.75 → loss 0.125; mis masks b (2.5 > 2): 1.25 → loss −1.25/6.
    ("tis", "token", 0.75 / 6),
    ("mis", "token", -1.25 / 6),
])
def test_shared_node_takes_each_leafs_weight(uniform_model, mode, level, loss):
    tree = shared_node_tree()
    correction = Correction(mode, level, cap=2.0, bounds=(0.5, 2.0))
    assert leaf_log_ratios(tree) == pytest.approx([math.log(1.5), math.log(3.0)])
    weights, leaf_stats = leaf_correction_weights([tree], correction)
    if level == "sequence":
        assert weights == [pytest.approx([1.5, 2.0] if mode == "tis" else [1.5, 0.0])]
        # Per leaf: w [1.5, 3] → mean 2.25, max 3, one of two above the cap and outside the bounds.
        assert leaf_stats.metrics() | {"kl": 0} == pytest.approx(
            {"kl": 0, "is_weight_mean": 2.25, "is_weight_max": 3.0, "truncated_fraction": 0.5, "masked_fraction": 0.5})
    (pack,) = pack_trees([tree], [[1.0, -1.0]], correction_weights=weights if level == "sequence" else None)
    value, sums = pack_loss(uniform_model, pack, 6.0, correction=correction)
    assert value.item() == pytest.approx(loss)
    # k3 per linearised token: s0 (×2) 0.2 − log 1.2, s1 (×2) 0, a 0.25 − log 1.25, b 1.5 − log 2.5.
    kl = (2 * (0.2 - math.log(1.2)) + 0.25 - math.log(1.25) + 1.5 - math.log(2.5)) / 6
    token = sums.stats.mismatch.metrics()
    assert token["kl"] == pytest.approx(kl)
    assert token["is_weight_mean"] == pytest.approx((2 * 1.2 + 2 * 1.0 + 1.25 + 2.5) / 6)
    assert token["is_weight_max"] == pytest.approx(2.5) and token["truncated_fraction"] == pytest.approx(1 / 6)


def test_correction_without_recomputed_old_logprobs_is_an_error(uniform_model):
    tree = shared_node_tree()
    tree.leaves()[1].learner_logprobs = None
    (pack,) = pack_trees([tree], [[1.0, -1.0]])
    with pytest.raises(ValueError, match="1 trained tokens have no recomputed"):
        pack_loss(uniform_model, pack, 6.0, correction=Correction("tis"))
    with pytest.raises(ValueError, match="node 3 has trainable tokens but no recomputed"):
        leaf_log_ratios(tree)


def test_attach_learner_logprobs_maps_packs_back_to_nodes():
    tree = shared_node_tree()
    tree.add_segment(tree.leaves()[0], [7, 8], logprobs=[-1.0, -1.0], loss_mask=[0, 1])  # a tool token
    packs = pack_trees([tree], None, pack_tokens=7)  # split: the shared node is context of later parts
    trained = [int(p.trained.sum()) for p in packs]
    counter = iter(range(100))
    attach_learner_logprobs([tree], packs, [t(*(float(next(counter)) for _ in range(n))) for n in trained])
    got = {n.id: n.learner_logprobs for n in tree.nodes() if n.parent is not None}
    # DFS order: s [0, 1], a [2], its child [masked, 3], b [4]: each token once, the masked one NaN.
    assert got[1] == [0.0, 1.0] and got[2] == [2.0] and got[3] == [4.0]
    assert math.isnan(got[4][0]) and got[4][1] == 3.0


def test_asynchronous_behaviour_cap_and_the_correction_share_one_weight(uniform_model):
    """The decoupled objective (off-policy, ``behaviour_cap``) weights the same w by token-level
    TIS at its cap; a tis/mis correction takes its place. Shared-node tree, A = [+1, −1]:
    behaviour_cap 1.5: s [1.2, 1.0] (cancel), a 1.25, b min(2.5, 1.5) = 1.5 → loss (1.5 − 1.25)/6,
    one token in six above the cap; with a tis correction (cap 2): (2 − 1.25)/6 as above."""
    (pack,) = pack_trees([shared_node_tree()], [[1.0, -1.0]])
    decoupled, sums = pack_loss(uniform_model, pack, 6.0, behaviour_cap=1.5, correction=Correction())
    assert decoupled.item() == pytest.approx(0.25 / 6)
    assert sums.stats.mismatch.metrics()["truncated_fraction"] == pytest.approx(1 / 6)
    assert sums.stats.metrics()["behaviour_weight"] == pytest.approx((2 * 1.2 + 2 * 1.0 + 1.25 + 1.5) / 6)
    corrected, _ = pack_loss(uniform_model, pack, 6.0, behaviour_cap=1.5, correction=Correction("tis", cap=2.0))
    assert corrected.item() == pytest.approx(0.75 / 6)


def test_the_learner_recomputes_old_logprobs_before_the_update(tmp_path):
    """π_old from :meth:`Learner.old_logprobs` is the model's own forward (the padded reference
    agrees), and one corrected update then starts at ratio 1 (nothing clipped)."""
    from test_learner import batch, config, tiny_model_dir
    from transformers import Qwen2ForCausalLM

    from arbor.train.learner import Learner
    from arbor.train.logprobs import padded_token_logprobs

    path = tiny_model_dir(tmp_path / "m")
    cfg = config(path, "learner.backend=torch", "learner.zero_stage=0", "loss.rollout_correction=tis")
    trees, advantages = batch()
    learner = Learner(cfg.model, cfg.learner, cfg.optim, cfg.loss, total_steps=2)
    packs = pack_trees(trees, None, pack_tokens=20)  # several packs
    attach_learner_logprobs(trees, packs, learner.old_logprobs(packs))
    with torch.no_grad():
        reference, _, owners = padded_token_logprobs(Qwen2ForCausalLM.from_pretrained(path), trees)
    for (tree_index, leaf_index, flat) in owners:
        tree = trees[tree_index]
        path_old = [x for n in tree.path(tree.leaves()[leaf_index]) for x in n.learner_logprobs]
        assert path_old == pytest.approx(reference[flat].tolist(), abs=1e-5)
    train_packs = pack_trees(trees, advantages, pack_tokens=20)
    result = learner.step(train_packs, loss_denominator(trees, "token"))
    assert result.stats.metrics()["clip_fraction"] == 0.0
    # The "engine's" log-probs here are random in [−2, 0], above the model's (≈ −log 40): a
    # large mismatch with w < 1, reported; mis's default bounds would mask some tokens.
    mismatch = result.stats.mismatch_metrics()
    assert mismatch["kl"] > 0.1 and mismatch["is_weight_mean"] < 1 and mismatch["masked_fraction"] > 0


# -- tree-packed equals the linearised batch ---------------------------------------------------------


def corrected_loss_and_grads(model, trees, advantages, correction, normalize, pack_tokens):
    model.zero_grad()
    weights = leaf_correction_weights(trees, correction)[0] if correction.level == "sequence" else None
    denominator = loss_denominator(trees, normalize)
    total, stats = 0.0, None
    for pack in pack_trees(trees, advantages, pack_tokens=pack_tokens, normalize=normalize,
                           correction_weights=weights):
        loss, sums = pack_loss(model, pack, denominator, correction=correction, attention="dense")
        loss.backward()
        total += loss.item()
        stats = sums.stats if stats is None else stats + sums.stats
    return total, [p.grad.clone() for p in model.parameters()], stats


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode, level", [("tis", "token"), ("mis", "token"), ("tis", "sequence"), ("mis", "sequence")])
def test_tree_packed_equals_linearised_per_leaf(seed, mode, level):
    rng = random.Random(seed)
    model = tiny("qwen2", torch.float64, seed)
    trees = [random_tree(rng, i) for i in range(3)]
    # π_old: the engine's log-probs moved by up to ±0.3 nats a token (±0.1 at sequence level,
    # where they add up along a path), so weights spread around 1.
    spread = 0.3 if level == "token" else 0.1
    for tree in trees:
        for node in tree.nodes():
            if node.parent is not None:
                node.learner_logprobs = [x + rng.uniform(-spread, spread) for x in node.logprobs]
    advantages = random_advantages(rng, trees, per_token=seed % 2 == 1)
    normalize = "sequence" if seed >= 2 else "token"
    # Bounds tight enough that some tokens (or leaves) are masked, a cap that truncates some.
    correction = (Correction(mode, level, cap=1.2, bounds=(0.8, 1.25)) if level == "token"
                  else Correction(mode, level, cap=1.05, bounds=(0.9, 1.1)))
    budget = 4096 if seed % 2 == 0 else max(len(t.prompt_ids) + leaf.end for t in trees for leaf in t.leaves())
    tree_loss, tree_grads, tree_stats = corrected_loss_and_grads(model, trees, advantages, correction, normalize, budget)
    lin_trees, lin_adv = linearise_trees(trees, advantages)
    lin_loss, lin_grads, lin_stats = corrected_loss_and_grads(model, lin_trees, lin_adv, correction, normalize, budget)
    assert tree_loss == pytest.approx(lin_loss, rel=1e-6, abs=1e-12) and tree_loss != 0.0
    for a, b in zip(tree_grads, lin_grads):
        assert_close(a, b, 1e-6)  # as test_tree_vs_linear: HF upcasts RMSNorm to float32
    assert tree_stats.mismatch.metrics() == pytest.approx(lin_stats.mismatch.metrics(), rel=1e-6)
    # The cap truncates and the bounds mask some of the tokens (or leaves) here.
    applied = tree_stats.mismatch if level == "token" else leaf_correction_weights(trees, correction)[1]
    assert applied.truncated > 0 and applied.masked > 0
    # The correction changed the loss: without it (PPO against the engine's log-probs) it differs.
    plain = corrected_loss_and_grads(model, trees, advantages, Correction(), normalize, budget)[0]
    assert plain != pytest.approx(tree_loss, rel=1e-6)


# -- configuration -----------------------------------------------------------------------------------


def test_config_keys_and_errors():
    cfg = load_config(None, [])
    assert correction_of(cfg.loss) == Correction("none", "token", 2.0, (0.5, 2.0))
    cfg = load_config(None, ["loss.rollout_correction=mis", "loss.rollout_correction_level=sequence",
                             "loss.rollout_mask_bounds=[0.2, 5.0]", "loss.rollout_is_cap=3"])
    assert correction_of(cfg.loss) == Correction("mis", "sequence", 3.0, (0.2, 5.0))
    with pytest.raises(ConfigError, match=r"loss.rollout_is_cap must be > 0, got 0"):
        load_config(None, ["loss.rollout_is_cap=0"])
    with pytest.raises(ConfigError, match=r"loss.rollout_mask_bounds must be \[lo, hi\] with 0 ≤ lo ≤ 1 ≤ hi"):
        load_config(None, ["loss.rollout_mask_bounds=[2.0, 0.5]"])
    with pytest.raises(ConfigError, match=r"loss.rollout_mask_bounds"):
        load_config(None, ["loss.rollout_mask_bounds=[0.5]"])
    with pytest.raises(ConfigError, match=r"loss.rollout_correction must be one of 'none', 'tis', 'mis'"):
        load_config(None, ["loss.rollout_correction=icepop"])


# -- the quickstart: a bf16 engine for a float32 learner ---------------------------------------------


def quickstart_mismatch(out, *overrides):
    """``mismatch/*`` of one short quickstart step (CPU, `arbor serve`, a DeepSpeed learner)."""
    import subprocess
    import sys
    from pathlib import Path

    from arbor.run.metrics import read_metrics

    repo = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "arbor", "train", "configs/quickstart.yaml", "run.steps=1", "run.eval_every=0",
               "data.prompts_per_step=4", "run.save_every=0", "algorithm.max_refill_rounds=1", f"run.output_dir={out}", *overrides]
    done = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (step,) = [m for m in read_metrics(out) if m["step"] == 1]
    return {k.removeprefix("mismatch/"): v for k, v in step.items() if k.startswith("mismatch/")}


def test_a_bf16_engine_shows_a_mismatch_the_float32_engine_does_not(tmp_path):
    """The quickstart's learner is float32; `model.dtype` is the engine's. A float32 engine
    agrees with it to float rounding (KL 2e-9–3e-9 measured); a bf16 engine's log-probs differ
    (KL 1e-5–7e-4 measured, weights up to ~1.3), and with tis the run trains on the corrected objective."""
    same = quickstart_mismatch(tmp_path / "f32", "model.dtype=float32", "learner.dtype=float32")
    bf16 = quickstart_mismatch(tmp_path / "bf16", "model.dtype=bfloat16", "learner.dtype=float32",
                               "loss.rollout_correction=tis")
    assert set(same) == set(bf16) == {"kl", "is_weight_mean", "is_weight_max", "truncated_fraction", "masked_fraction"}
    assert same["kl"] < 1e-7 and abs(same["is_weight_max"] - 1) < 1e-3
    assert bf16["kl"] > 1e-6 and bf16["kl"] > 100 * same["kl"]
    assert bf16["is_weight_max"] > 1.01
