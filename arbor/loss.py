"""Policy loss on rollout trees: DAPO/TreePO clipped objective, KL, entropy (ALGORITHMS.md §4).

    loss, metrics = policy_loss(model, trees, advantages)          # tree-packed (default)
    ref, _ = policy_loss(model, trees, advantages, mode="linear")  # every leaf its own sequence
    loss.backward()                                                # same gradients either way

Per token o_t = min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A), r = exp(logp − logp_old).
``normalize="token"``: loss = −Σ_i Σ_{t∈path i} o_t / Σ_i T_i; ``"sequence"``:
loss = −(1/L) Σ_i (1/T_i) Σ_t o_t — both defined on the linearised batch (each leaf its
own sequence). In tree mode each token appears once and carries, per leaf b through it,
Σ w_b·max(A,0) and Σ w_b·min(A,0) (w_b = 1 or 1/T_b): because r is the same for every
leaf through the token, Σ_b min(r A_b, clip(r) A_b) = pos·min(r, clip r) + neg·max(r, clip r).

Log-probs are those of softmax(logits / T) at the rollout temperature T, computed in
float32 (or wider): the engines (SGLang and arbor's own) report exactly these for each
sampled token, so r = 1 when the weights agree. top_p < 1 / top_k truncate what is
*sampled*, but engines report — and the learner computes — log-probs of the untruncated
tempered distribution; r is then the ratio of the full tempered distributions (as in
verl and OpenRLHF), not of the truncated sampling densities.

The learner accumulates gradients pack by pack: :func:`pack_loss` divides by the global
denominator (:func:`arbor.packing.loss_denominator` over the whole batch, all ranks), so
Σ over packs of ``pack_loss`` equals :func:`policy_loss`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

import torch
from transformers import PreTrainedModel

from arbor.lm_head import chunkable_head, chunked_head, logprobs_and_entropy
from arbor.packing import (
    Advantages,
    Normalize,
    PackedBatch,
    leaf_weights,
    loss_denominator,
    pack_trees,
)
from arbor.tree import RolloutTree
from arbor.tree_attention import Attention, packed_logits

KLEstimator = Literal["k1", "k3"]


# -- pure tensor functions ------------------------------------------------------------------


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


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token KL(π‖π_ref) estimate, [M]: k1 = log r, k3 = r⁻¹ − 1 + log r (Schulman), r = π/π_ref."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {estimator!r}")


@dataclass
class LossSums:
    """Additive pieces of the loss and metrics (sum over packs and ranks, then divide)."""

    objective: torch.Tensor  # [] Σ weighted clipped surrogate (with graph)
    kl: torch.Tensor  # [] Σ weight·KL to the reference (with graph)
    entropy: torch.Tensor  # [] Σ weight·entropy (with graph)
    clipped: float = 0.0  # linearised count of clipped (token, leaf) pairs
    approx_kl: float = 0.0  # Σ_lin ½(logp − old)²
    entropy_lin: float = 0.0  # Σ_lin entropy
    gap: float = 0.0  # Σ_lin |logp_engine − logp_learner|
    kl_lin: float = 0.0  # Σ_lin KL to the reference
    tokens: int = 0  # unique trained tokens
    linearised_tokens: float = 0.0  # Σ_i T_i of these tokens

    def __add__(self, other: LossSums) -> LossSums:
        return LossSums(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def metrics(self) -> dict[str, float]:
        n = max(self.linearised_tokens, 1.0)
        return {
            "clip_fraction": self.clipped / n,
            "approx_kl": self.approx_kl / n,
            "entropy": self.entropy_lin / n,
            "logprob_gap": self.gap / n,
            "kl": self.kl_lin / n,
            "tokens": float(self.tokens),
            "linearised_tokens": float(self.linearised_tokens),
        }


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
) -> LossSums:
    """Loss and metric sums of M trained tokens, each standing for ``leaf_count`` linear tokens."""
    objective, ratio = clipped_objective(logp, old_logp, adv_pos, adv_neg, clip_low, clip_high)
    kl = kl_penalty(logp, ref_logp, kl_estimator) if ref_logp is not None else torch.zeros_like(logp)
    with torch.no_grad():
        diff = logp - old_logp
        clipped = n_pos * (ratio > 1.0 + clip_high) + n_neg * (ratio < 1.0 - clip_low)
        lin = leaf_count
        sums = dict(
            clipped=float(clipped.sum()),
            approx_kl=float((lin * 0.5 * diff**2).sum()),
            entropy_lin=float((lin * entropy).sum()),
            gap=float((lin * diff.abs()).sum()),
            kl_lin=float((lin * kl).sum()),
            tokens=int(logp.numel()),
            linearised_tokens=float(lin.sum()),
        )
    return LossSums(
        objective=objective.sum(), kl=(weight * kl).sum(), entropy=(weight * entropy).sum(), **sums
    )


def combine(sums: LossSums, denominator: float, kl_coef: float, entropy_coef: float) -> torch.Tensor:
    """The scalar loss: (−objective + kl_coef·KL − entropy_coef·entropy) / denominator."""
    return (-sums.objective + kl_coef * sums.kl - entropy_coef * sums.entropy) / max(denominator, 1e-12)


# -- tree mode --------------------------------------------------------------------------------


def pack_token_logprobs(
    model: PreTrainedModel,
    pack: PackedBatch,
    select: torch.Tensor,  # [M] int64 packed indices of the tokens to score
    attention: Attention = "auto",
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p and entropy of softmax(logits / T) at the packed tokens ``select``: ([M], [M]), float32+.

    ``chunk_tokens`` > 0: the LM head runs on that many tokens at a time
    (:mod:`arbor.lm_head`), so [M, V] logits never exist; models whose logits are not a
    plain linear head of the last hidden state fall back to whole logits.
    """
    rows = pack.parent[select]
    targets = pack.input_ids[select].to(next(model.parameters()).device)
    head = chunkable_head(model) if chunk_tokens > 0 else None
    if head is None:
        return logprobs_and_entropy(packed_logits(model, pack, rows, attention), targets, temperature)
    with chunked_head(head, targets, temperature=temperature, chunk_tokens=chunk_tokens):
        scores = packed_logits(model, pack, rows, attention)  # [M, 2]: the head returns (log p, entropy)
    return scores[:, 0], scores[:, 1]


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
) -> tuple[torch.Tensor, LossSums]:
    """One pack's share of the loss (already divided by the global ``denominator``).

    Log-probs are those of softmax(logits / ``temperature``), the distribution the engine
    sampled from and reported; they and every per-token weight are float32 or wider
    whatever the model's dtype.
    """
    select = pack.trained.nonzero()[:, 0]
    scoring = dict(temperature=temperature, chunk_tokens=chunk_tokens)
    logp, entropy = pack_token_logprobs(model, pack, select, attention, **scoring)
    device, dtype = logp.device, logp.dtype  # float32, or float64 for a float64 model

    def field(t: torch.Tensor) -> torch.Tensor:
        return t[select].to(device=device, dtype=dtype)

    ref_logp = None
    if ref_model is not None and kl_coef:
        with torch.no_grad():
            ref_logp = pack_token_logprobs(ref_model, pack, select, attention, **scoring)[0].to(dtype)
    sums = token_sums(
        logp, entropy, field(pack.old_logprobs), ref_logp, field(pack.weight), field(pack.adv_pos),
        field(pack.adv_neg), field(pack.leaf_count), field(pack.n_pos), field(pack.n_neg),
        clip_low=clip_low, clip_high=clip_high, kl_estimator=kl_estimator,
    )
    return combine(sums, denominator, kl_coef, entropy_coef), sums


# -- linear mode (the reference: every leaf its own padded sequence) ---------------------------


def linear_token_logprobs(
    model: PreTrainedModel, trees: Sequence[RolloutTree], temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, list[int]]]]:
    """Forward every leaf as its own right-padded sequence.

    Returns the log-probs and entropies (of softmax(logits / T), float32+) of every
    response token, flattened over leaves, and per leaf (tree index, leaf index, flat
    indices of its response tokens).
    """
    device = next(model.parameters()).device
    seqs, starts, owners = [], [], []
    for t, tree in enumerate(trees):
        for b, leaf in enumerate(tree.leaves()):
            seqs.append(tree.full_ids(leaf))
            starts.append(len(tree.prompt_ids))
            owners.append((t, b))
    length = max(map(len, seqs))
    keep = length - min(starts) + 1  # logits from the first prediction of a response on
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    logits = model(
        input_ids=ids.to(device), attention_mask=mask.to(device), logits_to_keep=keep, use_cache=False
    ).logits  # [L, keep, V]
    rows, targets, index = [], [], []
    offset = length - keep
    for i, s in enumerate(seqs):
        positions = list(range(starts[i], len(s)))  # response tokens
        flat = list(range(len(rows), len(rows) + len(positions)))
        rows += [(i, p - 1 - offset) for p in positions]
        targets += [s[p] for p in positions]
        index.append((*owners[i], flat))
    r = torch.tensor(rows, dtype=torch.long, device=device).reshape(-1, 2)
    targets_t = torch.tensor(targets, dtype=torch.long, device=device)
    logp, entropy = logprobs_and_entropy(logits[r[:, 0], r[:, 1]], targets_t, temperature)
    return logp, entropy, index


def linear_token_fields(
    trees: Sequence[RolloutTree], advantages: Advantages, normalize: Normalize, require_logprobs: bool = True
) -> dict[str, list[float]]:
    """Per response token of every leaf (flat, leaf by leaf): mask, old logp, weights, advantages."""
    out: dict[str, list[float]] = {k: [] for k in ("mask", "old", "weight", "pos", "neg", "npos", "nneg")}
    for tree, adv in zip(trees, advantages):
        w = leaf_weights(tree, normalize)
        for b, leaf in enumerate(tree.leaves()):
            n = leaf.end
            a = [float(adv[b])] * n if isinstance(adv[b], (int, float)) else [float(x) for x in adv[b]]
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


def _linear_sums(
    model: PreTrainedModel, trees: Sequence[RolloutTree], advantages: Advantages, normalize: Normalize,
    ref_model: PreTrainedModel | None, temperature: float, **kw: float | str,
) -> LossSums:
    logp, entropy, _ = linear_token_logprobs(model, trees, temperature)
    f = linear_token_fields(trees, advantages, normalize)
    sel = torch.tensor(f["mask"], dtype=torch.bool, device=logp.device)

    def t(name: str) -> torch.Tensor:
        return torch.tensor(f[name], dtype=logp.dtype, device=logp.device)[sel]

    ref_logp = None
    if ref_model is not None and kw.get("kl_coef"):
        with torch.no_grad():
            ref_logp = linear_token_logprobs(ref_model, trees, temperature)[0].to(logp.dtype)[sel]
    return token_sums(
        logp[sel], entropy[sel], t("old"), ref_logp, t("weight"), t("pos"), t("neg"),
        torch.ones(int(sel.sum()), dtype=logp.dtype, device=logp.device), t("npos"), t("nneg"),
        clip_low=kw["clip_low"], clip_high=kw["clip_high"], kl_estimator=kw["kl_estimator"],  # type: ignore[arg-type]
    )


# -- public entry point --------------------------------------------------------------------------


def policy_loss(
    model: PreTrainedModel,
    trees: Sequence[RolloutTree],
    advantages: Advantages,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    normalize: Normalize = "token",
    mode: Literal["tree", "linear"] = "tree",
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

    ``advantages``: per tree one float per leaf (``arbor.advantage``), or per leaf one float
    per response token (TEMPO). Returns a scalar loss to ``.backward()`` and metrics
    (``clip_fraction``, ``approx_kl``, ``entropy``, ``logprob_gap``, ``kl``, ``tokens``,
    ``linearised_tokens``), weighted so both modes report the same numbers.

    ``temperature``: the sampling temperature T of the behaviour log-probs; the learner's
    log-probs, entropy and KL are those of softmax(logits / T), as the engine's are.
    ``chunk_tokens`` (tree mode): run the LM head on this many tokens at a time (0: all).
    """
    if kl_coef and ref_model is None:
        raise ValueError("kl_coef > 0 needs a ref_model")
    denominator = loss_denominator(trees, normalize)
    kw = dict(clip_low=clip_low, clip_high=clip_high, kl_estimator=kl_estimator)
    if mode == "linear":
        sums = _linear_sums(model, trees, advantages, normalize, ref_model, temperature, kl_coef=kl_coef, **kw)
        return combine(sums, denominator, kl_coef, entropy_coef), sums.metrics()
    if mode != "tree":
        raise ValueError(f"mode must be 'tree' or 'linear', got {mode!r}")
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
    return total, all_sums.metrics()
