"""Advantage estimators over rollout trees (ALGORITHMS.md §2). Pure functions.

Every estimator takes a batch of trees whose leaves carry rewards and returns, per
tree, one float per leaf in ``tree.leaves()`` order (TEMPO: one float per response
token of each leaf's path). Each leaf's value applies to every trainable token on its
root-to-leaf path.

    trees = [RolloutTree.from_sequences([1], [[2, 3], [2, 4]], rewards=[1.0, 0.0], segment_tokens=1)]
    grpo_advantages(trees)      # [[0.7071..., -0.7071...]]   (R - mean) / (std_ddof1 + 1e-6)
    treepo_advantages(trees)    # [[0.5, -0.5]]   depth 0: R - 0.5; depth 1 node is shared by both

No torch, Ray, DeepSpeed or config imports: these are called from the driver and tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

from arbor.tree import Node, RolloutTree

LeafAdvantages = list[list[float]]  # per tree, per leaf
TokenAdvantages = list[list[list[float]]]  # per tree, per leaf, per response token

EPS = 1e-6


def _rewards(tree: RolloutTree) -> list[float]:
    leaves = tree.leaves()
    if not leaves:
        raise ValueError(f"tree of problem {_problem_id(tree)} has no leaves")
    out = []
    for leaf in leaves:
        if leaf.reward is None:
            raise ValueError(f"problem {_problem_id(tree)}: leaf node {leaf.id} has no reward")
        out.append(float(leaf.reward))
    return out


def _problem_id(tree: RolloutTree) -> str:
    problem = tree.problem or {}
    return repr(problem.get("id", "<no id>"))


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: Sequence[float]) -> float:
    """Sample standard deviation (ddof = 1, as verl and TRL); 0 for a single value."""
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _subtree_stats(tree: RolloutTree) -> tuple[dict[int, float], dict[int, int]]:
    """Mean leaf reward and leaf count under every node (root included), by node id."""
    total: dict[int, float] = {}
    count: dict[int, int] = {}
    for leaf, reward in zip(tree.leaves(), _rewards(tree)):
        node: Node | None = leaf
        while node is not None:
            total[node.id] = total.get(node.id, 0.0) + reward
            count[node.id] = count.get(node.id, 0) + 1
            node = node.parent
    return {k: total[k] / count[k] for k in total}, count


def grpo_advantages(trees: Sequence[RolloutTree], std_normalize: bool = True) -> LeafAdvantages:
    """A_i = (R_i − mean_G R) / (std_G R + 1e-6); ``std_normalize=False`` is Dr.GRPO's R_i − mean."""
    out = []
    for tree in trees:
        rewards = _rewards(tree)
        mean = _mean(rewards)
        scale = _std(rewards) + EPS if std_normalize else 1.0
        out.append([(r - mean) / scale for r in rewards])
    return out


def treepo_advantages(
    trees: Sequence[RolloutTree], aggregate: Literal["mean", "size_weighted"] = "mean"
) -> LeafAdvantages:
    """TreePO subgroup advantages (paper Eq. 5 ``mean``, reference code Eq. 6 ``size_weighted``).

    For leaf i and each sampling depth j < depth(i), G_j(i) is the set of leaves under
    i's ancestor at depth j (j = 0: the root, all leaves). Subgroups of one leaf below
    the root carry no comparison and are skipped. s_ij = R_i − mean over G_j(i).
    No normalisation here: the driver whitens over tokens afterwards (the default).
    """
    if aggregate not in ("mean", "size_weighted"):
        raise ValueError(f"aggregate must be 'mean' or 'size_weighted', got {aggregate!r}")
    out = []
    for tree in trees:
        mean, count = _subtree_stats(tree)
        advantages = []
        for leaf, reward in zip(tree.leaves(), _rewards(tree)):
            num = den = 0.0
            # Ancestors at depths 0 .. depth-1: the leaf's own node is excluded.
            ancestor = leaf.parent
            while ancestor is not None:
                size = count[ancestor.id]
                if size > 1 or ancestor.parent is None:
                    deviation = reward - mean[ancestor.id]
                    weight = 1.0 if aggregate == "mean" else float(size)
                    num += weight * deviation
                    den += weight
                ancestor = ancestor.parent
            advantages.append(num / den)
        out.append(advantages)
    return out


def whiten(trees: Sequence[RolloutTree], advantages: LeafAdvantages) -> LeafAdvantages:
    """Token-weighted whitening over the batch's linearised trainable tokens.

    Leaf i weighs T_i = trainable tokens on its whole path (shared tokens count once per
    leaf, as if each leaf were its own sequence). Variance with Bessel's correction over
    the token count, as verl's ``masked_whiten``: A' = (A − μ) / sqrt(σ² + 1e-8).
    """
    if len(advantages) != len(trees):
        raise ValueError(f"{len(advantages)} advantage lists for {len(trees)} trees")
    weights = []
    for tree, adv in zip(trees, advantages, strict=True):
        leaves = tree.leaves()
        if len(adv) != len(leaves):
            raise ValueError(
                f"problem {_problem_id(tree)}: {len(adv)} advantages for {len(leaves)} leaves"
            )
        weights.append([tree.num_trainable(leaf) for leaf in leaves])
    n = sum(sum(w) for w in weights)
    if n < 2:
        raise ValueError(f"whitening needs at least 2 trainable tokens, got {n}")
    mean = sum(a * w for adv, ws in zip(advantages, weights) for a, w in zip(adv, ws)) / n
    var = sum(w * (a - mean) ** 2 for adv, ws in zip(advantages, weights) for a, w in zip(adv, ws))
    inv_std = 1.0 / math.sqrt(var / (n - 1) + 1e-8)
    return [[(a - mean) * inv_std for a in adv] for adv in advantages]


def reinforce_pp_advantages(trees: Sequence[RolloutTree]) -> LeafAdvantages:
    """REINFORCE++-baseline: R_i − group mean, then whitened over the batch's tokens."""
    return whiten(trees, grpo_advantages(trees, std_normalize=False))


def dynamic_sampling_filter(trees: Sequence[RolloutTree]) -> list[RolloutTree]:
    """DAPO dynamic sampling: keep the trees whose leaf rewards differ (in order).

    A tree whose leaves all score the same (or with fewer than two leaves) gives every
    leaf a zero group-relative advantage: no learning signal, only cost.
    """
    kept = []
    for tree in trees:
        rewards = _rewards(tree)
        if len(rewards) >= 2 and max(rewards) > min(rewards):
            kept.append(tree)
    return kept


def tempo_advantages(trees: Sequence[RolloutTree], eps: float = EPS) -> TokenAdvantages:
    """TEMPO: GRPO plus branch-gated TD corrections, one value per response token.

    V(node) = mean reward of the leaves under it (V(root) = the group mean). The first
    token of a node whose parent has ≥ 2 children gets GRPO A_i + (V(node) − V(parent)) /
    (std_G R + eps); every other token gets GRPO A_i. (Under a single-child parent the
    leaf sets coincide, V(node) = V(parent), so the gate changes nothing there.)
    """
    grpo = grpo_advantages(trees)
    out = []
    for tree, base in zip(trees, grpo, strict=True):
        scale = _std(_rewards(tree)) + eps
        value, _ = _subtree_stats(tree)  # V(node): mean reward of the leaves under it
        per_leaf = []
        for leaf, a in zip(tree.leaves(), base, strict=True):
            tokens: list[float] = []
            for node in tree.path(leaf):
                values = [a] * len(node.token_ids)
                parent = node.parent
                if values and parent is not None and len(parent.children) >= 2:
                    values[0] += (value[node.id] - value[parent.id]) / scale
                tokens.extend(values)
            per_leaf.append(tokens)
        out.append(per_leaf)
    return out


ESTIMATORS: dict[str, Callable[..., LeafAdvantages]] = {
    "grpo": grpo_advantages,
    "treepo": treepo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}
