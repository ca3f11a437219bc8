"""Tree-packed log-probabilities and SFT loss on the same packing as the policy loss.

    logps = tree_logprobs(ref_model, trees)    # per tree: {node id: tensor [len(node)]}
    loss = sft_loss(model, trees)              # weighted NLL, each shared prefix once

``tree_logprobs`` scores every response token once (reference-model log-probs for KL,
or recomputed behaviour log-probs). ``sft_loss`` is the negative log-likelihood of the
trainable tokens of every root-to-leaf path, normalised like the policy loss, and equals
linear SFT (each leaf its own sequence) in value and gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from transformers import PreTrainedModel

from arbor.loss import linear_token_fields, linear_token_logprobs, pack_token_logprobs
from arbor.packing import Normalize, loss_denominator, pack_trees
from arbor.tree import RolloutTree
from arbor.tree_attention import Attention


@torch.no_grad()
def tree_logprobs(
    model: PreTrainedModel,
    trees: Sequence[RolloutTree],
    *,
    pack_tokens: int = 16384,
    attention: Attention = "auto",
    temperature: float = 1.0,
    chunk_tokens: int = 0,
) -> list[dict[int, torch.Tensor]]:
    """log p of every response token under ``model``: per tree, node id -> [len(node)] float64.

    ``temperature``: log-probs of softmax(logits / T), the distribution sampled at T
    (reference-model KL and recomputed behaviour log-probs must use the rollout's T).
    Computed in float32 or wider whatever the model's dtype.
    """
    out: list[dict[int, torch.Tensor]] = [
        {n.id: torch.zeros(len(n.token_ids), dtype=torch.float64) for n in t.nodes()} for t in trees
    ]
    for pack in pack_trees(trees, pack_tokens=pack_tokens, require_logprobs=False):
        select = pack.owned.nonzero()[:, 0]
        logp, _ = pack_token_logprobs(
            model, pack, select, attention, temperature=temperature, chunk_tokens=chunk_tokens
        )
        for i, value in zip(select.tolist(), logp.double().cpu().tolist()):
            tree_index, node_id, offset = pack.origin[i]
            out[tree_index][node_id][offset] = value
    return out


def set_behaviour_logprobs(trees: Sequence[RolloutTree], logprobs: list[dict[int, torch.Tensor]]) -> None:
    """Store recomputed log-probs as the nodes' behaviour ``logprobs`` (old policy)."""
    for tree, per_node in zip(trees, logprobs):
        for node in tree.nodes():
            node.logprobs = per_node[node.id].tolist()


def sft_loss(
    model: PreTrainedModel,
    trees: Sequence[RolloutTree],
    leaf_weights: Sequence[Sequence[float]] | None = None,
    *,
    normalize: Normalize = "token",
    mode: Literal["tree", "linear"] = "tree",
    pack_tokens: int = 16384,
    attention: Attention = "auto",
) -> torch.Tensor:
    """−Σ_leaves w_b Σ_{t∈path b} log p_t / denominator (Σ T_b, or the number of leaves).

    ``leaf_weights`` per tree per leaf (default 1): e.g. to up-weight good branches.
    """
    weights = leaf_weights or [[1.0] * len(t.leaves()) for t in trees]
    if any(w < 0 for ws in weights for w in ws):
        raise ValueError("SFT leaf weights must be ≥ 0")
    denominator = max(loss_denominator(trees, normalize), 1e-12)
    if mode == "linear":
        logp, _, _ = linear_token_logprobs(model, trees)
        f = linear_token_fields(trees, weights, normalize, require_logprobs=False)
        sel = torch.tensor(f["mask"], dtype=torch.bool, device=logp.device)
        w = torch.tensor(f["pos"], dtype=logp.dtype, device=logp.device)  # w_b · weight_b (≥ 0)
        return -(w[sel] * logp[sel]).sum() / denominator
    if mode != "tree":
        raise ValueError(f"mode must be 'tree' or 'linear', got {mode!r}")
    total = None
    for pack in pack_trees(trees, weights, pack_tokens=pack_tokens, normalize=normalize,
                           require_logprobs=False):
        select = pack.trained.nonzero()[:, 0]
        logp, _ = pack_token_logprobs(model, pack, select, attention)
        # adv_pos carries Σ_b w_b · weight_b over the leaves through each token.
        part = -(pack.adv_pos[select].to(logp) * logp).sum() / denominator
        total = part if total is None else total + part
    assert total is not None, "no trees to train on"
    return total
