"""Engine–learner mismatch: the importance weight π_old/π_rollout, truncated (TIS) or masked (MIS).

    correction = Correction(mode="tis", level="token", cap=2.0, bounds=(0.5, 2.0))
    w = is_weights(old_logp - rollout_logp, correction)          # [M] what multiplies each token's loss
    stats = token_mismatch(old_logp, rollout_logp, leaf_count, correction)   # mismatch/* sums
    weights, leaf_stats = leaf_correction_weights(trees, correction)  # sequence level, per tree per leaf

Three policies meet in a step (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
You Off-Policy RL Training"): π_rollout, the engine's log-probs of what it sampled; π_old,
the learner's forward on the same tokens before the update (no gradient); π_θ, the learner
being trained. Engines and learners compute differently (bf16 kernels, fused sampling, a
different attention), so π_rollout ≠ π_old even with identical weights. With a correction
on, PPO's ratio is π_θ/π_old and each token's loss is multiplied by a function of
w = π_old/π_rollout:

- ``tis``: min(w, cap) (truncated importance sampling);
- ``mis``: w where lo ≤ w ≤ hi, else 0 (masked importance sampling, IcePop's masking):
  those tokens carry no loss but still count in the loss's denominator.

``level="token"`` uses each token's own w. ``level="sequence"`` gives every token of a
leaf's path the leaf's weight w_b = exp(Σ_{t∈path b} log w_t) (trained tokens only). In a
tree a shared token belongs to every leaf below it: its loss is already a sum over those
leaves (tree packing), and each leaf's share carries that leaf's w_b — exactly the
linearised batch where each leaf is its own sequence (:func:`leaf_correction_weights` feeds
these to :func:`arbor.train.packing.pack_trees` as ``correction_weights``).

Asynchronous runs' decoupled objective (:func:`arbor.train.loss.decoupled_objective`) uses the
same weight: π_prox there is π_old here, π_behav is π_rollout. With ``mode="none"`` an
off-policy batch keeps its token-level truncation at ``loss.behaviour_cap``; a ``tis`` or
``mis`` correction replaces it (same weight, the correction's treatment).

This module imports torch only (the trees it reads are :class:`arbor.tree.RolloutTree`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal, Protocol

import torch

if TYPE_CHECKING:  # trees are read, never built: the loss modules import torch only
    from arbor.train.packing import PackedBatch
    from arbor.tree import RolloutTree

CorrectionMode = Literal["none", "tis", "mis"]
CorrectionLevel = Literal["token", "sequence"]


@dataclass(frozen=True)
class Correction:
    """How w = π_old/π_rollout enters the loss (``loss.rollout_correction*``, ``loss.rollout_is_cap``,
    ``loss.rollout_mask_bounds``). The cap and bounds also define the truncated/masked
    fractions reported in every mode."""

    mode: CorrectionMode = "none"
    level: CorrectionLevel = "token"
    cap: float = 2.0  # tis: w is truncated at this value
    bounds: tuple[float, float] = (0.5, 2.0)  # mis: w outside [lo, hi] masks the token (or leaf)

    @property
    def recompute(self) -> bool:
        """Does this correction need π_old recomputed by the learner before the update?"""
        return self.mode != "none"


class LossSettings(Protocol):
    """The ``loss`` keys a :class:`Correction` is read from (``arbor.config.LossConfig``)."""

    # Read-only: a LossConfig's Literal-typed fields satisfy them.
    @property
    def rollout_correction(self) -> str: ...
    @property
    def rollout_correction_level(self) -> str: ...
    @property
    def rollout_is_cap(self) -> float: ...
    @property
    def rollout_mask_bounds(self) -> Sequence[float]: ...


def correction_of(loss: LossSettings) -> Correction:
    """The :class:`Correction` the ``loss`` section asks for."""
    lo, hi = loss.rollout_mask_bounds
    return Correction(loss.rollout_correction, loss.rollout_correction_level,  # type: ignore[arg-type]
                      float(loss.rollout_is_cap), (float(lo), float(hi)))


def is_weights(log_ratio: torch.Tensor, correction: Correction) -> torch.Tensor:
    """The weight each token (or leaf) of ``log_ratio`` = log π_old − log π_rollout carries, same shape.

    >>> c = Correction("tis", cap=2.0)
    >>> is_weights(torch.log(torch.tensor([0.5, 1.5, 3.0])), c)
    tensor([0.5000, 1.5000, 2.0000])
    >>> is_weights(torch.log(torch.tensor([0.4, 1.5, 3.0])), Correction("mis", bounds=(0.5, 2.0)))
    tensor([0.0000, 1.5000, 0.0000])
    """
    weight = torch.exp(log_ratio)
    if correction.mode == "none":
        return torch.ones_like(weight)
    if correction.mode == "tis":
        return weight.clamp(max=correction.cap)
    if correction.mode == "mis":
        lo, hi = correction.bounds
        return torch.where((weight >= lo) & (weight <= hi), weight, torch.zeros_like(weight))
    raise ValueError(f"loss.rollout_correction must be 'none', 'tis' or 'mis', got {correction.mode!r}")


@dataclass
class MismatchStats:
    """Additive sums behind ``mismatch/*`` (add over packs, ranks, updates; :meth:`metrics` divides)."""

    kl: float = 0.0  # Σ_lin k3 estimate of KL(π_rollout‖π_old) per token
    tokens: float = 0.0  # linearised tokens behind ``kl``
    weight: float = 0.0  # Σ of w = π_old/π_rollout over the units (tokens, or leaves at sequence level)
    weight_max: float = 0.0  # max of w (combined by max, not sum)
    truncated: float = 0.0  # units with w > cap
    masked: float = 0.0  # units with w outside the bounds
    units: float = 0.0  # linearised tokens (token level) or leaves (sequence level)

    def __add__(self, other: MismatchStats) -> MismatchStats:
        out = MismatchStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))
        out.weight_max = max(self.weight_max, other.weight_max)
        return out

    def metrics(self) -> dict[str, float]:
        """``kl``, ``is_weight_mean``, ``is_weight_max``, ``truncated_fraction``, ``masked_fraction``."""
        units = max(self.units, 1.0)
        return {
            "kl": self.kl / max(self.tokens, 1.0),
            "is_weight_mean": self.weight / units,
            "is_weight_max": self.weight_max,
            "truncated_fraction": self.truncated / units,
            "masked_fraction": self.masked / units,
        }


def weight_stats(log_ratio: torch.Tensor, count: torch.Tensor, correction: Correction) -> MismatchStats:
    """w's sum, max, truncated and masked counts over units of ``log_ratio`` [U], each counted ``count`` [U] times."""
    with torch.no_grad():
        weight = torch.exp(log_ratio)
        lo, hi = correction.bounds
        return MismatchStats(
            weight=float((count * weight).sum()),
            weight_max=float(weight.max()) if weight.numel() else 0.0,
            truncated=float((count * (weight > correction.cap)).sum()),
            masked=float((count * ((weight < lo) | (weight > hi))).sum()),
            units=float(count.sum()),
        )


def token_mismatch(
    old_logp: torch.Tensor,  # [M] π_old (the learner before the update)
    rollout_logp: torch.Tensor,  # [M] π_rollout (the engine's)
    leaf_count: torch.Tensor,  # [M] linearised multiplicity of each token
    correction: Correction,
) -> MismatchStats:
    """``mismatch/*`` sums of M tokens, each standing for ``leaf_count`` linearised ones.

    KL(π_rollout‖π_old) is estimated on tokens sampled from π_rollout with Schulman's k3:
    w − 1 − log w, w = π_old/π_rollout (unbiased, ≥ 0).
    """
    with torch.no_grad():
        log_ratio = old_logp - rollout_logp
        stats = weight_stats(log_ratio, leaf_count, correction)
        stats.kl = float((leaf_count * (torch.exp(log_ratio) - 1.0 - log_ratio)).sum())
        stats.tokens = float(leaf_count.sum())
        return stats


# -- sequence level: one weight per leaf --------------------------------------------------------------


def leaf_log_ratios(tree: RolloutTree) -> list[float]:
    """Σ over each leaf's trained path tokens of log π_old − log π_rollout, in ``tree.leaves()`` order.

    π_old is ``node.learner_logprobs`` (recomputed before the update), π_rollout ``node.logprobs``.
    """
    by_node: dict[int, float] = {}
    for node in tree.nodes():
        if node.parent is None or not node.num_trainable():
            by_node[node.id] = 0.0
            continue
        if node.learner_logprobs is None or node.logprobs is None:
            raise ValueError(f"problem {tree.problem_id}: node {node.id} has trainable tokens but no "
                             f"{'recomputed π_old' if node.learner_logprobs is None else 'engine logprobs'}")
        mask = node.loss_mask or [1] * len(node.token_ids)
        by_node[node.id] = math.fsum(o - r for o, r, m in zip(node.learner_logprobs, node.logprobs, mask) if m == 1)
    return [math.fsum(by_node[n.id] for n in tree.path(leaf)) for leaf in tree.leaves()]


def leaf_correction_weights(
    trees: Sequence[RolloutTree], correction: Correction
) -> tuple[list[list[float]], MismatchStats]:
    """Per tree per leaf the sequence-level weight (:func:`is_weights` of the path's log-ratio sum),
    and its ``mismatch/*`` weight sums over leaves (leaves with nothing to train are left out)."""
    weights: list[list[float]] = []
    log_ratios: list[float] = []
    for tree in trees:
        sums = leaf_log_ratios(tree)
        weights.append(is_weights(torch.tensor(sums, dtype=torch.float64), correction).tolist())
        log_ratios += [s for s, leaf in zip(sums, tree.leaves()) if tree.num_trainable(leaf)]
    ratios = torch.tensor(log_ratios, dtype=torch.float64)
    return weights, weight_stats(ratios, torch.ones_like(ratios), correction)


def attach_learner_logprobs(
    trees: Sequence[RolloutTree], packs: Sequence[PackedBatch], logprobs: Sequence[torch.Tensor]
) -> None:
    """Set every node's ``learner_logprobs`` (π_old) from the learner's log-probs of ``packs``
    (``pack_trees(trees, ...)``; ``logprobs[i]`` [trained tokens of pack i], in ``pack.trained`` order).

    Tokens no pack trains (loss mask 0) stay NaN: π_old of them is never used.
    """
    if len(packs) != len(logprobs):
        raise ValueError(f"{len(logprobs)} log-prob lists for {len(packs)} packs")
    values = [{n.id: [math.nan] * len(n.token_ids) for n in tree.nodes()} for tree in trees]
    for pack, logp in zip(packs, logprobs):
        trained = pack.trained.nonzero()[:, 0].tolist()
        if len(trained) != len(logp):
            raise ValueError(f"{len(logp)} log-probs for a pack of {len(trained)} trained tokens")
        for i, value in zip(trained, logp.tolist()):
            tree_index, node_id, offset = pack.origin[i]
            values[tree_index][node_id][offset] = value
    for tree, by_node in zip(trees, values):
        for node in tree.nodes():
            node.learner_logprobs = by_node[node.id] if node.parent is not None else None
