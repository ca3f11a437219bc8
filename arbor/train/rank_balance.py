"""Learner ranks' shares of a batch, balanced by the tokens each computes, not by count.

    shares = balance_trees(trees, world_size=4)                  # per rank: node ids per tree
    per_rank, tokens = rank_packs(trees, advantages, 4, pack_tokens=16384)
    rank_imbalance(tokens)                                        # train/rank_imbalance: max / mean

A tree's work is its unique tokens (a tree pack forwards each once, depth first or packed).
Trees go to ranks largest first, each to the least loaded rank (longest-processing-time
greedy, within 4/3 of the best); a tree larger than a rank's even share (the batch's tokens /
ranks) is first split into subtrees of at most that share (:func:`arbor.train.packing.split_tree`:
each part trains its nodes once, with its ancestors as context, which the part's rank
forwards again). AREAL-DTA balances its prefix trees over GPUs the same way, by the work
they compute (Yuan et al. 2026, arXiv 2602.00482).

Packing the trees first and dealing out whole packs, as before, balanced packs: a batch of
fewer packs than ranks left ranks idle, and one large pack made its rank the step's straggler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from arbor.train.packing import Advantages, PackedBatch, pack_trees, split_tree
from arbor.tree import RolloutTree


@dataclass
class RankShare:
    """One rank's part of a batch: what :func:`arbor.train.packing.pack_trees` trains there."""

    train_only: list[set[int] | None]  # per tree of the batch: node ids to train (None: all, empty: none)
    tokens: int  # the tokens those parts hold, context included (the estimate balanced)


def tree_tokens(tree: RolloutTree) -> int:
    """Unique tokens of ``tree``: its prompt and every node's tokens once."""
    return len(tree.prompt_ids) + sum(len(n.token_ids) for n in tree.nodes() if n.parent is not None)


def balance_trees(trees: Sequence[RolloutTree], world_size: int) -> list[RankShare]:
    """Each rank's share of ``trees``, balanced by tokens (largest first to the least loaded rank).

    Deterministic: every rank (or the driver) computing it gets the same shares.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be ≥ 1, got {world_size}")
    costs = [tree_tokens(t) for t in trees]
    share = math.ceil(sum(costs) / world_size)
    items: list[tuple[int, int, set[int] | None]] = []  # (tokens, tree, nodes or None: all of it)
    for t, (tree, cost) in enumerate(zip(trees, costs)):
        if world_size == 1 or cost <= share:
            items.append((cost, t, None))
            continue
        # A part must hold at least one root-to-leaf path (split_tree trains each node somewhere).
        longest = max(len(tree.prompt_ids) + leaf.end for leaf in tree.leaves())
        for context, trained in split_tree(tree, max(share, longest)):
            tokens = len(tree.prompt_ids) + sum(len(n.token_ids) for n in context + trained)
            items.append((tokens, t, {n.id for n in trained}))
    shares = [RankShare([set() for _ in trees], 0) for _ in range(world_size)]
    for tokens, t, nodes in sorted(items, key=lambda item: (-item[0], item[1])):
        rank = min(shares, key=lambda s: s.tokens)  # the first of the least loaded
        current = rank.train_only[t]
        rank.train_only[t] = None if nodes is None else (current or set()) | nodes
        rank.tokens += tokens
    return shares


def rank_packs(
    trees: Sequence[RolloutTree], advantages: Advantages | None, world_size: int, **pack_kw: Any
) -> tuple[list[list[PackedBatch]], list[int]]:
    """Per rank the packs of its share (:func:`balance_trees`; ``pack_kw`` go to ``pack_trees``),
    and the tokens each rank's packs forward. Tree indices in the packs (``origin``) are the
    batch's, so results map back to ``trees`` whichever rank computed them."""
    per_rank = [pack_trees(trees, advantages, train_only=share.train_only, **pack_kw)
                for share in balance_trees(trees, world_size)]
    return per_rank, [sum(p.num_tokens for p in packs) for packs in per_rank]


def rank_imbalance(tokens: Sequence[float]) -> float:
    """The busiest rank's tokens over the ranks' mean (1: even; ``train/rank_imbalance``).

    >>> rank_imbalance([300, 100])
    1.5
    """
    mean = sum(tokens) / max(len(tokens), 1)
    return max(tokens) / mean if mean > 0 else 1.0
