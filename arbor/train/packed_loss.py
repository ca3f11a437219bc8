"""The policy and SFT losses of a model on rollout trees: forwards on packs, then the pure objective.

    loss, metrics = policy_loss(model, trees, advantages)                # tree-packed (default)
    ref, _ = policy_loss(model, trees, advantages, mode="padded")       # every leaf its own padded row
    loss.backward()                                                      # same gradients either way
    loss, sums = pack_loss(model, pack, denominator)                     # one pack's share (the learner)
    nll = sft_loss(model, trees, leaf_weights)                           # weighted NLL, prefixes once

The objective itself is :mod:`arbor.train.loss` (pure tensor functions); the log-prob forwards
are :mod:`arbor.train.logprobs`. ``mode="padded"`` is the reference these must agree with: every
leaf a right-padded sequence of its own (not to be confused with the trainer's
``loss.mode: linear``, which packs every leaf as a chain of its own:
:func:`arbor.train.packing.linearise_trees`).

Log-probs are those of softmax(logits / T) at the rollout temperature T, computed in
float32 (or wider): the engines (SGLang and arbor's own) report exactly these for each
sampled token, so r = 1 when the weights agree. top_p < 1 / top_k truncate what is
*sampled*, but engines report — and the learner computes — log-probs of the untruncated
tempered distribution; r is then the ratio of the full tempered distributions (as in
verl and OpenRLHF), not of the truncated sampling densities.

The learner accumulates gradients pack by pack: :func:`pack_loss` divides by the global
denominator (:func:`arbor.train.packing.loss_denominator` over the whole batch, all ranks), so
Σ over packs of ``pack_loss`` equals :func:`policy_loss`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import PreTrainedModel

from arbor.train.dfs import DfsWalk, dfs_token_logprobs, pack_budget
from arbor.train.logprobs import pack_token_logprobs, padded_token_logprobs
from arbor.train.loss import KLEstimator, LossStats, LossSums, combine, token_sums
from arbor.train.packing import (
    Advantages,
    Normalize,
    PackedBatch,
    leaf_weights,
    loss_denominator,
    pack_trees,
)
from arbor.train.rollout_correction import Correction
from arbor.train.tree_attention import Attention
from arbor.tree import RolloutTree

LossMode = Literal["tree", "padded"]  # tree-packed, or every leaf its own padded sequence
TreeExecution = Literal["packed", "dfs"]  # learner.tree_execution: a pack at once, or depth first


# -- tree-packed ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyObjective:
    """The loss settings that turn log-probs of a pack's trained tokens into its loss (``loss.*``).

    Called on all of a pack's trained tokens (:func:`pack_loss`) or on any subset of them (a
    depth-first walk scores a pack group by group, :mod:`arbor.train.dfs`): the loss is a sum
    over tokens, so the parts add up to the whole. See :func:`pack_loss` for the arguments.
    """

    denominator: float
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    behaviour_cap: float | None = None
    correction: Correction | None = None

    def __call__(
        self,
        pack: PackedBatch,
        tokens: torch.Tensor,  # [M] int64 packed indices of the scored (trained) tokens
        logp: torch.Tensor,  # [M] log-probs with graph, float32+
        entropy: torch.Tensor,  # [M]
        ref_logp: torch.Tensor | None = None,  # [M] the KL reference's (no graph), when kl_coef > 0
    ) -> tuple[torch.Tensor, LossSums]:
        device, dtype = logp.device, logp.dtype  # float32, or float64 for a float64 model

        def field(t: torch.Tensor) -> torch.Tensor:
            return t[tokens.to(t.device)].to(device=device, dtype=dtype)

        correction = self.correction
        prox: dict = {}
        if correction is not None and correction.recompute:
            prox_logp = field(pack.prox_logprobs)
            if torch.isnan(prox_logp).any():
                raise ValueError(f"loss.rollout_correction {correction.mode!r}: {int(torch.isnan(prox_logp).sum())} "
                                 "trained tokens have no recomputed π_old (node.learner_logprobs)")
            prox = {"prox_logp": prox_logp}
        elif self.behaviour_cap is not None:
            prox = {"prox_logp": logp.detach(), "behaviour_cap": self.behaviour_cap}
        sums = token_sums(
            logp, entropy, field(pack.old_logprobs), None if ref_logp is None else ref_logp.to(device, dtype),
            field(pack.weight), field(pack.adv_pos), field(pack.adv_neg), field(pack.leaf_count),
            field(pack.n_pos), field(pack.n_neg), clip_low=self.clip_low, clip_high=self.clip_high,
            kl_estimator=self.kl_estimator, correction=correction, **prox,
        )
        loss = combine(sums, self.denominator, self.kl_coef, self.entropy_coef)
        sums.stats.loss = float(loss.detach())
        return loss, sums

    def with_stats(self, pack: PackedBatch, tokens: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor,
                   ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, LossStats]:
        """The loss and its metric sums as plain floats (no graph kept past the backward)."""
        loss, sums = self(pack, tokens, logp, entropy, ref_logp)
        return loss, sums.stats


def pack_loss(
    model: PreTrainedModel,
    pack: PackedBatch,
    denominator: float,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy_coef: float = 0.0,
    ref_model: PreTrainedModel | None = None,
    attention: Attention = "auto",
    temperature: float = 1.0,
    chunk_tokens: int = 0,
    behaviour_cap: float | None = None,
    correction: Correction | None = None,
) -> tuple[torch.Tensor, LossSums]:
    """One pack's share of the loss (already divided by the global ``denominator``), and its
    sums (``sums.stats.loss`` is this loss's value).

    ``behaviour_cap`` None: PPO against the behaviour log-probs (on-policy). Given (off-policy,
    ``algorithm.max_staleness`` ≥ 1): AReaL's decoupled objective (:func:`arbor.train.loss.decoupled_objective`)
    with the proximal policy = these weights before this update, i.e. this forward's log-probs
    without their graph: exact for one update per batch (``algorithm.ppo_epochs`` 1), where it
    reduces to the truncated-IS policy gradient min(π_θ/π_behav, C)·A·∇log π_θ.

    ``correction`` (``loss.rollout_correction*``) tis/mis: the same objective around π_old =
    ``pack.prox_logprobs`` (recomputed by the learner before the update; the trees' nodes
    must carry ``learner_logprobs``), its weight truncated or masked as chosen; it takes
    the place of ``behaviour_cap``'s truncation. At sequence level the leaves' weights must
    already sit in the pack's advantage columns (``pack_trees(..., correction_weights=
    leaf_correction_weights(trees, correction)[0])``). Its cap and bounds also define the
    ``mismatch/*`` fractions reported in every mode.

    Log-probs are those of softmax(logits / ``temperature``), the distribution the engine
    sampled from and reported; they and every per-token weight are float32 or wider
    whatever the model's dtype.
    """
    objective = PolicyObjective(denominator, clip_low, clip_high, kl_coef, kl_estimator, entropy_coef,
                                behaviour_cap, correction)
    select = pack.trained.nonzero()[:, 0]
    scoring: dict[str, Any] = dict(temperature=temperature, chunk_tokens=chunk_tokens)
    logp, entropy = pack_token_logprobs(model, pack, select, attention, **scoring)
    ref_logp = None
    if ref_model is not None and kl_coef:
        with torch.no_grad():
            ref_logp = pack_token_logprobs(ref_model, pack, select, attention, **scoring)[0]
    return objective(pack, select, logp, entropy, ref_logp)


def pack_sft_loss(
    model: PreTrainedModel, pack: PackedBatch, denominator: float, attention: Attention = "auto", chunk_tokens: int = 0
) -> torch.Tensor:
    """−Σ weight · log p over the pack's trained tokens / the batch's ``denominator``.

    ``pack.weight`` is Σ_b w_b · weight_b over the leaves through each token (the pack was
    made with ``pack_trees(..., loss_weights=...)``): the token's multiplicity in linear SFT.
    ``chunk_tokens``: the LM head's chunk (``learner.logit_chunk_tokens``; 0: whole logits).
    """
    select = pack.trained.nonzero()[:, 0]
    logp, _ = pack_token_logprobs(model, pack, select, attention, chunk_tokens=chunk_tokens)
    return sft_token_loss(pack, select, logp, denominator)


def sft_token_loss(
    pack: PackedBatch,
    tokens: torch.Tensor,  # [M] int64 packed indices of trained tokens
    logp: torch.Tensor,  # [M] their log-probs (with graph)
    denominator: float,
) -> torch.Tensor:
    """−Σ weight · log p over ``tokens`` / ``denominator``: :func:`pack_sft_loss` of any of a pack's
    trained tokens (a depth-first walk's group, :mod:`arbor.train.dfs`)."""
    return -(pack.weight[tokens.to(pack.weight.device)].to(logp) * logp).sum() / denominator


# -- padded (the reference: every leaf its own padded sequence) -------------------------------------


def padded_token_fields(
    trees: Sequence[RolloutTree], advantages: Advantages | None, normalize: Normalize,
    loss_weights: Sequence[Sequence[float]] | None = None, require_logprobs: bool = True,
) -> dict[str, list[float]]:
    """Per response token of every leaf (flat, leaf by leaf): mask, old logp, weights, advantages.

    ``advantages`` None: 0 everywhere (SFT); ``loss_weights`` per tree per leaf scale its
    ``weight`` as :func:`~arbor.train.packing.pack_trees` does.
    """
    out: dict[str, list[float]] = {k: [] for k in ("mask", "old", "weight", "pos", "neg", "npos", "nneg")}
    for t, tree in enumerate(trees):
        w = leaf_weights(tree, normalize)
        if loss_weights is not None:
            w = [a * b for a, b in zip(w, loss_weights[t])]
        for b, leaf in enumerate(tree.leaves()):
            n = leaf.end
            adv = advantages[t][b] if advantages is not None else 0.0
            a = [float(adv)] * n if isinstance(adv, (int, float)) else [float(x) for x in adv]
            mask = tree.response_loss_mask(leaf)
            old = tree.response_logprobs(leaf) if require_logprobs and any(mask) else [0.0] * n
            out["mask"] += mask
            out["old"] += old
            out["weight"] += [w[b]] * n
            out["pos"] += [w[b] * max(x, 0.0) for x in a]
            out["neg"] += [w[b] * min(x, 0.0) for x in a]
            out["npos"] += [float(x > 0) for x in a]
            out["nneg"] += [float(x < 0) for x in a]
    return out


def _padded_sums(
    model: PreTrainedModel, trees: Sequence[RolloutTree], advantages: Advantages, normalize: Normalize,
    ref_model: PreTrainedModel | None, temperature: float, **kw: float | str,
) -> LossSums:
    logp, entropy, _ = padded_token_logprobs(model, trees, temperature)
    f = padded_token_fields(trees, advantages, normalize)
    sel = torch.tensor(f["mask"], dtype=torch.bool, device=logp.device)

    def t(name: str) -> torch.Tensor:
        return torch.tensor(f[name], dtype=logp.dtype, device=logp.device)[sel]

    ref_logp = None
    if ref_model is not None and kw.get("kl_coef"):
        with torch.no_grad():
            ref_logp = padded_token_logprobs(ref_model, trees, temperature)[0].to(logp.dtype)[sel]
    return token_sums(
        logp[sel], entropy[sel], t("old"), ref_logp, t("weight"), t("pos"), t("neg"),
        torch.ones(int(sel.sum()), dtype=logp.dtype, device=logp.device), t("npos"), t("nneg"),
        clip_low=kw["clip_low"], clip_high=kw["clip_high"], kl_estimator=kw["kl_estimator"],  # type: ignore[arg-type]
    )


def _check_mode(mode: str) -> None:
    if mode == "linear":  # loss.mode's name for packed chains, not this padded reference
        raise ValueError("mode 'linear' is now 'padded' (every leaf its own padded sequence); the trainer's "
                         "loss.mode: linear (every leaf its own packed chain) is arbor.train.packing.linearise_trees")
    if mode != "tree":
        raise ValueError(f"mode must be 'tree' or 'padded', got {mode!r}")


# -- public entry points ------------------------------------------------------------------------------


def policy_loss(
    model: PreTrainedModel,
    trees: Sequence[RolloutTree],
    advantages: Advantages,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    normalize: Normalize = "token",
    mode: LossMode = "tree",
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    ref_model: PreTrainedModel | None = None,
    entropy_coef: float = 0.0,
    pack_tokens: int = 16384,
    attention: Attention = "auto",
    temperature: float = 1.0,
    chunk_tokens: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy loss of ``trees`` (old logprobs = the nodes' ``logprobs``).

    ``advantages``: per tree one float per leaf (``arbor.train.advantage``), or per leaf one float
    per response token (TEMPO). Returns a scalar loss to ``.backward()`` and metrics
    (:meth:`arbor.train.loss.LossStats.metrics`: ``loss``, ``clip_fraction``, ``approx_kl``,
    ``entropy``, ``logprob_gap``, ``kl``, ``tokens``, ``linearised_tokens``), weighted so
    both modes report the same numbers.

    ``mode``: ``"tree"`` packs each tree once; ``"padded"`` forwards every leaf as its own
    right-padded sequence (the reference). ``temperature``: the sampling temperature T of
    the behaviour log-probs; the learner's log-probs, entropy and KL are those of
    softmax(logits / T), as the engine's are. ``chunk_tokens`` (tree mode): run the LM head
    on this many tokens at a time (0: all).
    """
    if kl_coef and ref_model is None:
        raise ValueError("kl_coef > 0 needs a ref_model")
    denominator = loss_denominator(trees, normalize)
    kw = dict(clip_low=clip_low, clip_high=clip_high, kl_estimator=kl_estimator)
    if mode == "padded":
        sums = _padded_sums(model, trees, advantages, normalize, ref_model, temperature, kl_coef=kl_coef, **kw)
        loss = combine(sums, denominator, kl_coef, entropy_coef)
        sums.stats.loss = float(loss.detach())
        return loss, sums.stats.metrics()
    _check_mode(mode)
    total: torch.Tensor | None = None
    all_sums: LossSums | None = None
    for pack in pack_trees(trees, advantages, pack_tokens=pack_tokens, normalize=normalize):
        loss, sums = pack_loss(
            model, pack, denominator, kl_coef=kl_coef, entropy_coef=entropy_coef, ref_model=ref_model,
            attention=attention, temperature=temperature, chunk_tokens=chunk_tokens, **kw,  # type: ignore[arg-type]
        )
        total = loss if total is None else total + loss
        all_sums = sums if all_sums is None else all_sums + sums
    assert total is not None and all_sums is not None, "no trees to train on"
    return total, all_sums.stats.metrics()


def policy_backward(
    model: PreTrainedModel,
    trees: Sequence[RolloutTree],
    advantages: Advantages,
    *,
    execution: TreeExecution = "packed",
    group_tokens: int = 2048,
    normalize: Normalize = "token",
    pack_tokens: int = 16384,
    attention: Attention = "auto",
    temperature: float = 1.0,
    chunk_tokens: int = 0,
    ref_model: PreTrainedModel | None = None,
    **objective: Any,
) -> tuple[float, dict[str, float]]:
    """:func:`policy_loss` and its backward, pack by pack as the learner runs it (one pack's graph
    in memory at a time): the gradients accumulate in ``model``; returns the loss's value and
    metrics.

    ``execution``: ``"packed"`` (each pack of ``pack_tokens`` one forward and backward) or
    ``"dfs"`` (whole trees walked depth first, :class:`arbor.train.dfs.DfsWalk`: one path's
    activations in memory, ``group_tokens`` a group's most tokens) — the same loss and gradients.
    ``objective``: :class:`PolicyObjective`'s settings (``clip_low``, ``kl_coef``, ...).

        loss, metrics = policy_backward(model, trees, advantages, execution="dfs")
    """
    if execution not in ("packed", "dfs"):
        raise ValueError(f"execution must be 'packed' or 'dfs', got {execution!r}")
    if objective.get("kl_coef") and ref_model is None:
        raise ValueError("kl_coef > 0 needs a ref_model")
    policy = PolicyObjective(loss_denominator(trees, normalize), **objective)
    stats = LossStats()
    if execution == "packed":  # pack by pack, as the learner: one pack's graph at a time
        for pack in pack_trees(trees, advantages, pack_tokens=pack_tokens, normalize=normalize):
            loss, sums = pack_loss(model, pack, policy.denominator, ref_model=ref_model, attention=attention,
                                   temperature=temperature, chunk_tokens=chunk_tokens, **objective)
            loss.backward()
            stats += sums.stats
        return stats.loss, stats.metrics()
    scoring: dict[str, Any] = dict(group_tokens=group_tokens, temperature=temperature, chunk_tokens=chunk_tokens)
    for pack in pack_trees(trees, advantages, pack_tokens=pack_budget("dfs", pack_tokens), normalize=normalize):
        select = pack.trained.nonzero()[:, 0]
        ref = None
        if ref_model is not None and policy.kl_coef:
            with torch.no_grad():
                ref = dfs_token_logprobs(ref_model, pack, select, **scoring)[0]
        walk = DfsWalk(model, pack, select, token_loss=functools.partial(policy.with_stats, pack), reference=ref,
                       **scoring)
        for _ in walk.ops():
            pass
        stats = sum(walk.records, stats)
    return stats.loss, stats.metrics()


def sft_loss(
    model: PreTrainedModel,
    trees: Sequence[RolloutTree],
    leaf_weights: Sequence[Sequence[float]] | None = None,
    *,
    normalize: Normalize = "token",
    mode: LossMode = "tree",
    pack_tokens: int = 16384,
    attention: Attention = "auto",
) -> torch.Tensor:
    """−Σ_leaves w_b Σ_{t∈path b} log p_t / denominator (Σ T_b, or the number of leaves).

    The negative log-likelihood of the trainable tokens of every root-to-leaf path,
    normalised like the policy loss; ``mode="tree"`` equals ``"padded"`` (linear SFT, each
    leaf its own sequence) in value and gradients. ``leaf_weights`` per tree per leaf
    (default 1): e.g. to up-weight good branches.
    """
    weights = leaf_weights or [[1.0] * len(t.leaves()) for t in trees]
    if any(w < 0 for ws in weights for w in ws):
        raise ValueError("SFT leaf weights must be ≥ 0")
    denominator = max(loss_denominator(trees, normalize), 1e-12)
    if mode == "padded":
        logp, _, _ = padded_token_logprobs(model, trees)
        f = padded_token_fields(trees, None, normalize, loss_weights=weights, require_logprobs=False)
        sel = torch.tensor(f["mask"], dtype=torch.bool, device=logp.device)
        w = torch.tensor(f["weight"], dtype=logp.dtype, device=logp.device)  # w_b · weight_b (≥ 0)
        return -(w[sel] * logp[sel]).sum() / denominator
    _check_mode(mode)
    total = None
    for pack in pack_trees(trees, None, pack_tokens=pack_tokens, normalize=normalize, loss_weights=weights,
                           require_logprobs=False):
        part = pack_sft_loss(model, pack, denominator, attention)
        total = part if total is None else total + part
    assert total is not None, "no trees to train on"
    return total
