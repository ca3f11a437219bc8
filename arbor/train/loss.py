"""The policy objective as pure tensor functions: DAPO/TreePO clipped surrogate, KL, entropy (docs/algorithms.md).

    sums = token_sums(logp, entropy, old_logp, ref_logp, weight, adv_pos, adv_neg, leaf_count,
                      n_pos, n_neg, clip_low=0.2, clip_high=0.28, kl_estimator="k3")   # [M] each
    loss = combine(sums, denominator, kl_coef=0.0, entropy_coef=0.0)   # a scalar to .backward()
    metrics = sums.stats.metrics()                                       # clip_fraction, entropy, ...

Per token o_t = min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A), r = exp(logp − logp_old).
``normalize="token"``: loss = −Σ_i Σ_{t∈path i} o_t / Σ_i T_i; ``"sequence"``:
loss = −(1/L) Σ_i (1/T_i) Σ_t o_t — both defined on the linearised batch (each leaf its
own sequence). Packed (:mod:`arbor.train.packing`) each token appears once and carries, per leaf b
through it, Σ w_b·max(A,0) and Σ w_b·min(A,0) (w_b = 1 or 1/T_b): because r is the same for
every leaf through the token, Σ_b min(r A_b, clip(r) A_b) = pos·min(r, clip r) + neg·max(r, clip r).

Off-policy batches (``algorithm.max_staleness`` ≥ 1: trees sampled by weights up to k
updates old) use AReaL's decoupled PPO objective (Fu et al. 2025, "AReaL: A Large-Scale
Asynchronous Reinforcement Learning System for Language Reasoning", arXiv 2505.24298, §5.2):
the trust region is taken around a *proximal* policy π_prox, and the behaviour gap is an
importance weight w = π_prox/π_behav, here truncated at ``behaviour_cap`` C (truncated
importance sampling, Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training"): o_t = min(w, C)·min(u·A, clip(u)·A), u = π_θ/π_prox
(:func:`decoupled_objective`).

The engine–learner mismatch correction (``loss.rollout_correction``: TIS/MIS,
:mod:`arbor.train.rollout_correction`) is the same objective with π_prox = π_old, the
learner's forward recomputed before the update, and the weight truncated or masked as
chosen: :func:`weighted_objective` is the one code path of both.

The model forwards that produce ``logp`` and the per-token columns live beside the packing:
:mod:`arbor.train.logprobs` (log-probs of packed trees or padded sequences) and
:mod:`arbor.train.packed_loss` (``policy_loss``, ``pack_loss``, the SFT loss). This module imports
torch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Literal

import torch

from arbor.train.rollout_correction import Correction, MismatchStats, is_weights, token_mismatch

KLEstimator = Literal["k1", "k3"]


def clipped_objective(
    logp: torch.Tensor,  # [M] learner log-probabilities
    old_logp: torch.Tensor,  # [M] behaviour log-probabilities
    adv_pos: torch.Tensor,  # [M] Σ of positive advantage mass through each token
    adv_neg: torch.Tensor,  # [M] Σ of negative advantage mass (≤ 0)
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate Σ_b min(r·A_b, clip(r)·A_b) and the ratio r, both [M]."""
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    # A > 0: min(rA, clip(r)A) = A·min(r, clip r); A < 0: A·max(r, clip r).
    return adv_pos * torch.minimum(ratio, clipped) + adv_neg * torch.maximum(ratio, clipped), ratio


def decoupled_objective(
    logp: torch.Tensor,  # [M] learner log-probabilities (with graph)
    prox_logp: torch.Tensor,  # [M] proximal policy's log-probabilities (no graph)
    old_logp: torch.Tensor,  # [M] behaviour log-probabilities (the engine's, per token)
    adv_pos: torch.Tensor,  # [M]
    adv_neg: torch.Tensor,  # [M]
    clip_low: float,
    clip_high: float,
    behaviour_cap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AReaL's decoupled PPO surrogate per token, with a truncated behaviour weight; [M] each.

    Returns ``(objective, u, w)``: objective = w·Σ_b min(u·A_b, clip(u)·A_b) with u = π_θ/π_prox
    (the clipped ratio, as in PPO but around the proximal policy) and w = min(π_prox/π_behav, C)
    (no gradient). Tokens of one path may come from different weight versions (partial
    rollouts): ``old_logp`` is per token, so each token is weighted by its own sampler.

    >>> lp = torch.log(torch.tensor([0.5]))
    >>> decoupled_objective(lp, lp, torch.log(torch.tensor([0.25])), torch.ones(1), torch.zeros(1), 0.2, 0.28, 2.0)[0]
    tensor([2.])
    """
    weight = is_weights(prox_logp - old_logp, Correction("tis", cap=behaviour_cap)).detach()
    objective, ratio = weighted_objective(logp, prox_logp, adv_pos, adv_neg, clip_low, clip_high, weight)
    return objective, ratio, weight


def weighted_objective(
    logp: torch.Tensor,  # [M] learner log-probabilities (with graph)
    prox_logp: torch.Tensor,  # [M] π_prox = π_old, the learner before the update (no graph)
    adv_pos: torch.Tensor,  # [M]
    adv_neg: torch.Tensor,  # [M]
    clip_low: float,
    clip_high: float,
    weight: torch.Tensor,  # [M] importance weight of each token (no graph)
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight·Σ_b min(u·A_b, clip(u)·A_b), u = π_θ/π_prox, and u; [M] each.

    The objective of off-policy batches (weight = min(π_prox/π_behav, C)) and of the
    rollout correction (weight = TIS/MIS of π_old/π_rollout, or 1 where a sequence-level
    weight already sits in ``adv_pos``/``adv_neg``).
    """
    objective, ratio = clipped_objective(logp, prox_logp.detach(), adv_pos, adv_neg, clip_low, clip_high)
    return weight.detach() * objective, ratio


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token KL(π‖π_ref) estimate, [M]: k1 = log r, k3 = r⁻¹ − 1 + log r (Schulman), r = π/π_ref."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {estimator!r}")


@dataclass
class LossStats:
    """Additive sums behind the loss metrics: add them over packs, ranks and updates, then
    :meth:`metrics` divides once. Plain floats: this is what a learner rank returns over Ray."""

    loss: float = 0.0  # Σ of the loss values (each already divided by the global denominator)
    clipped: float = 0.0  # linearised count of clipped (token, leaf) pairs
    approx_kl: float = 0.0  # Σ_lin ½(logp − old)²
    entropy_lin: float = 0.0  # Σ_lin entropy
    gap: float = 0.0  # Σ_lin |logp_engine − logp_learner|
    kl_lin: float = 0.0  # Σ_lin KL to the reference
    behaviour_weight: float = 0.0  # Σ_lin min(π_prox/π_behav, C) (decoupled objective only)
    truncated: float = 0.0  # linearised tokens whose behaviour weight hit the cap C
    tokens: float = 0.0  # unique trained tokens
    linearised_tokens: float = 0.0  # Σ_i T_i of these tokens
    mismatch: MismatchStats = field(default_factory=MismatchStats)  # engine vs learner (``mismatch/*``)

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def mismatch_metrics(self) -> dict[str, float]:
        """``mismatch/*`` without the prefix (:meth:`arbor.train.rollout_correction.MismatchStats.metrics`)."""
        return self.mismatch.metrics()

    def metrics(self) -> dict[str, float]:
        """``loss``, ``clip_fraction``, ``approx_kl``, ``entropy``, ``logprob_gap``, ``kl`` (per
        linearised token), ``tokens``, ``linearised_tokens`` (``train/*`` in docs/metrics.md)."""
        n = max(self.linearised_tokens, 1.0)
        # Only off-policy runs (the decoupled objective) have behaviour weights to report.
        decoupled = {"behaviour_weight": self.behaviour_weight / n, "truncated_fraction": self.truncated / n}
        return ({} if not self.behaviour_weight else decoupled) | {
            "loss": self.loss,
            "clip_fraction": self.clipped / n,
            "approx_kl": self.approx_kl / n,
            "entropy": self.entropy_lin / n,
            "logprob_gap": self.gap / n,
            "kl": self.kl_lin / n,
            "tokens": float(self.tokens),
            "linearised_tokens": float(self.linearised_tokens),
        }


@dataclass
class LossSums:
    """The loss's additive pieces with their graph (sum over packs), and their metric sums."""

    objective: torch.Tensor  # [] Σ weighted clipped surrogate (with graph)
    kl: torch.Tensor  # [] Σ weight·KL to the reference (with graph)
    entropy: torch.Tensor  # [] Σ weight·entropy (with graph)
    stats: LossStats = field(default_factory=LossStats)

    def __add__(self, other: LossSums) -> LossSums:
        return LossSums(self.objective + other.objective, self.kl + other.kl, self.entropy + other.entropy,
                        self.stats + other.stats)


def token_sums(
    logp: torch.Tensor,  # [M]
    entropy: torch.Tensor,  # [M]
    old_logp: torch.Tensor,  # [M]
    ref_logp: torch.Tensor | None,  # [M] or None
    weight: torch.Tensor,  # [M] Σ_b w_b over leaves through the token
    adv_pos: torch.Tensor,  # [M]
    adv_neg: torch.Tensor,  # [M]
    leaf_count: torch.Tensor,  # [M] linearised multiplicity
    n_pos: torch.Tensor,  # [M] leaves with A > 0
    n_neg: torch.Tensor,  # [M] leaves with A < 0
    *,
    clip_low: float,
    clip_high: float,
    kl_estimator: KLEstimator,
    prox_logp: torch.Tensor | None = None,  # [M] or None
    behaviour_cap: float = math.inf,
    correction: Correction | None = None,
) -> LossSums:
    """Loss and metric sums of M trained tokens, each standing for ``leaf_count`` linear tokens.

    ``prox_logp`` None: PPO's clipped surrogate against the behaviour log-probs (on-policy
    runs, ``correction`` mode none). Given: :func:`weighted_objective` around it — with a
    ``correction`` (tis/mis; ``prox_logp`` = π_old recomputed before the update) its
    weights at token level, or 1 at sequence level (already in the advantage columns);
    with none, :func:`decoupled_objective`'s behaviour weights capped at ``behaviour_cap``.
    ``stats.mismatch`` compares ``old_logp`` (the engine's) with ``prox_logp``, or with
    ``logp`` (this forward) where there is none.
    """
    correction = correction or Correction()
    behaviour = None
    if prox_logp is None:
        if correction.recompute:
            raise ValueError(f"loss.rollout_correction {correction.mode!r} needs π_old (prox_logp) recomputed")
        objective, ratio = clipped_objective(logp, old_logp, adv_pos, adv_neg, clip_low, clip_high)
        learner_logp = logp.detach()
    else:
        decoupled = not correction.recompute
        if decoupled:  # the decoupled objective: token-level TIS at behaviour_cap
            correction = replace(correction, mode="tis", level="token", cap=behaviour_cap)
        weight_t = (is_weights(prox_logp - old_logp, correction) if correction.level == "token"
                    else torch.ones_like(logp))
        behaviour = weight_t if decoupled else None
        objective, ratio = weighted_objective(logp, prox_logp, adv_pos, adv_neg, clip_low, clip_high, weight_t)
        learner_logp = prox_logp.detach()
    kl = kl_penalty(logp, ref_logp, kl_estimator) if ref_logp is not None else torch.zeros_like(logp)
    with torch.no_grad():
        diff = logp - old_logp
        clipped = n_pos * (ratio > 1.0 + clip_high) + n_neg * (ratio < 1.0 - clip_low)
        lin = leaf_count
        stats = LossStats(
            clipped=float(clipped.sum()),
            approx_kl=float((lin * 0.5 * diff**2).sum()),
            entropy_lin=float((lin * entropy).sum()),
            gap=float((lin * diff.abs()).sum()),
            kl_lin=float((lin * kl).sum()),
            tokens=int(logp.numel()),
            linearised_tokens=float(lin.sum()),
        )
        stats.mismatch = token_mismatch(learner_logp, old_logp, lin, correction)
        if behaviour is not None:  # the decoupled objective's own metrics (README: train/behaviour_weight)
            stats.behaviour_weight = float((lin * behaviour).sum())
            stats.truncated = float((lin * (torch.exp(learner_logp - old_logp) > correction.cap)).sum())
    return LossSums(objective=objective.sum(), kl=(weight * kl).sum(), entropy=(weight * entropy).sum(), stats=stats)


def combine(sums: LossSums, denominator: float, kl_coef: float, entropy_coef: float) -> torch.Tensor:
    """The scalar loss: (−objective + kl_coef·KL − entropy_coef·entropy) / denominator (global:
    :func:`arbor.train.packing.loss_denominator` over the whole batch, all ranks)."""
    return (-sums.objective + kl_coef * sums.kl - entropy_coef * sums.entropy) / max(denominator, 1e-12)
