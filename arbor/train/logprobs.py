"""Log-probabilities of rollout tokens under a model: the forwards behind every loss.

    logp, entropy = pack_token_logprobs(model, pack, select)   # [M], [M] at packed tokens
    logp, entropy, index = padded_token_logprobs(model, trees) # every leaf its own padded row
    logps = tree_logprobs(ref_model, trees)    # per tree: {node id: tensor [len(node)]}

All are log-probs of softmax(logits / T) at the sampling temperature T, in float32 or
wider whatever the model's dtype. ``pack_token_logprobs`` runs a tree pack
(:mod:`arbor.train.packing`) with tree attention; ``padded_token_logprobs`` is the reference
it must agree with. ``tree_logprobs`` scores every response token once (reference-model
log-probs for KL, or recomputed behaviour log-probs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from arbor.train.lm_head import chunkable_head, chunked_head, logprobs_and_entropy
from arbor.train.packing import PackedBatch, pack_trees
from arbor.train.tree_attention import Attention, packed_logits
from arbor.tree import RolloutTree


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
    (:mod:`arbor.train.lm_head`), so [M, V] logits never exist; models whose logits are not a
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


def padded_token_logprobs(
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
    rows: list[tuple[int, int]] = []  # (sequence, logit position) of each response token
    targets, index = [], []
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
