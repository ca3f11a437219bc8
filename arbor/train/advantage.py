"""Advantage estimators over rollout trees (docs/algorithms.md). Pure functions.

Every estimator takes a batch of trees whose leaves carry rewards and returns, per
tree, one float per leaf in ``tree.leaves()`` order (TEMPO: one float per response
token of each leaf's path). Each leaf's value applies to every trainable token on its
root-to-leaf path. A group is one tree: all leaves of one prompt.

    # one shared segment [2], then two leaves: R = 1 and R = 0
    trees = [RolloutTree.from_sequences([1], [[2, 3], [2, 4]], [1.0, 0.0], segment_tokens=1)]
    grpo_advantages(trees)    # [[0.7071, -0.7071]]  (R − 0.5) / (std_ddof1 0.7071 + 1e-6)
    treepo_advantages(trees)  # [[0.5, -0.5]]  depth 0 (root): R − 0.5; depth 1 ([2]): R − 0.5
    whiten(trees, [[0.5, -0.5]])  # [[0.866, -0.866]]  over 2 + 2 linearised tokens, ddof 1

The trainer calls :func:`compute_advantages`, which picks the estimator by name and
whitens over the batch's tokens (REINFORCE++ style, the TreePO reference's default).
No torch, Ray, DeepSpeed or config imports: plain Python floats, callable anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from arbor.tree import Node, RolloutTree

LeafAdvantages = list[list[float]]  # per tree, per leaf (tree.leaves() order)
TokenAdvantages = list[list[list[float]]]  # per tree, per leaf, per response token (leaf.end)

EPS = 1e-6  # added to the group std (GRPO, TEMPO)
WHITEN_EPS = 1e-8  # added to the variance when whitening, as verl's masked_whiten
ESTIMATORS = ("grpo", "treepo", "reinforce_pp", "tempo", "treerl")


# -- helpers ----------------------------------------------------------------------------


def _rewards(tree: RolloutTree) -> list[float]:
    """Leaf rewards in ``tree.leaves()`` order; a missing reward is an error, never 0."""
    leaves = tree.leaves()
    if not leaves:
        raise ValueError(f"problem {tree.problem_id}: the tree has no leaves")
    out = []
    for leaf in leaves:
        if leaf.reward is None:
            raise ValueError(f"problem {tree.problem_id}: leaf node {leaf.id} has no reward")
        out.append(float(leaf.reward))
    return out


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: Sequence[float]) -> float:
    """Sample standard deviation (ddof = 1, as verl and TRL); 0 for a single value."""
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _subtree_stats(
    tree: RolloutTree, rewards: list[float]
) -> tuple[dict[int, float], dict[int, int]]:
    """Mean leaf reward and leaf count under each node with leaves (root included), by id."""
    total: dict[int, float] = {}
    count: dict[int, int] = {}
    for leaf, reward in zip(tree.leaves(), rewards):
        node: Node | None = leaf
        while node is not None:
            total[node.id] = total.get(node.id, 0.0) + reward
            count[node.id] = count.get(node.id, 0) + 1
            node = node.parent
    return {k: total[k] / count[k] for k in total}, count


def _weighted_whiten(values: list[float], weights: list[int]) -> list[float]:
    """(v − μ) / sqrt(σ² + 1e-8); μ, σ² weighted, σ² with Bessel's correction over Σw."""
    n = sum(weights)
    if n < 2:
        raise ValueError(f"whitening needs at least 2 trainable tokens, got {n}")
    mean = sum(w * v for v, w in zip(values, weights)) / n
    var = sum(w * (v - mean) ** 2 for v, w in zip(values, weights)) / (n - 1)
    inv_std = 1.0 / math.sqrt(var + WHITEN_EPS)
    # Zero-weight entries (fully masked leaves/tokens) are shifted and scaled too.
    return [(v - mean) * inv_std for v in values]


def _check_leaf_shapes(trees: Sequence[RolloutTree], advantages: Sequence[Sequence]) -> None:
    if len(advantages) != len(trees):
        raise ValueError(f"{len(advantages)} advantage lists for {len(trees)} trees")
    for tree, adv in zip(trees, advantages):
        leaves = len(tree.leaves())
        if len(adv) != leaves:
            raise ValueError(
                f"problem {tree.problem_id}: {len(adv)} advantages for {leaves} leaves"
            )


# -- estimators ---------------------------------------------------------------------------


def grpo_advantages(trees: Sequence[RolloutTree], std_normalize: bool = True) -> LeafAdvantages:
    """A_i = (R_i − mean_G R) / (std_G R + 1e-6), std with ddof = 1.

    ``std_normalize=False`` gives Dr.GRPO's R_i − mean_G R. A group of one leaf, or of
    equal rewards, gets 0 for every leaf (the std is 0, the numerator too).
    """
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
    """TreePO subgroup advantages: paper Eq. 5 (``mean``) or Eq. 6 (``size_weighted``).

    For leaf i at sampling depth D_i and each j = 0 .. D_i − 1, G_j(i) is the set of
    leaves under i's ancestor at depth j (j = 0: the root, all leaves of the prompt).
    s_ij = R_i − mean over G_j(i). ``mean``: A_i = average of the s_ij;
    ``size_weighted``: Σ_j |G_j| s_ij / Σ_j |G_j|. A subgroup of one leaf below the
    root compares the leaf with itself (s = 0) and is skipped, so a tree without
    branching gives R_i − mean_G R. Depth is ``node.depth``: a chain of single-child
    segments counts one depth per segment. No normalisation here (the paper's division
    by the std of the s_ij is left out); the trainer whitens over tokens afterwards.
    """
    if aggregate not in ("mean", "size_weighted"):
        raise ValueError(f"aggregate must be 'mean' or 'size_weighted', got {aggregate!r}")
    out = []
    for tree in trees:
        rewards = _rewards(tree)
        mean, count = _subtree_stats(tree, rewards)
        advantages = []
        for leaf, reward in zip(tree.leaves(), rewards):
            num = den = 0.0
            # Ancestors at depths D_i − 1 .. 0: the leaf's own node is not a subgroup.
            ancestor = leaf.parent
            while ancestor is not None:
                size = count[ancestor.id]
                if size > 1 or ancestor.parent is None:
                    weight = 1.0 if aggregate == "mean" else float(size)
                    num += weight * (reward - mean[ancestor.id])
                    den += weight
                ancestor = ancestor.parent
            advantages.append(num / den)  # den ≥ 1: the root group always counts
        out.append(advantages)
    return out


def reinforce_pp_advantages(trees: Sequence[RolloutTree]) -> LeafAdvantages:
    """REINFORCE++-baseline: R_i − group mean, then whitened over the batch's tokens."""
    return whiten(trees, grpo_advantages(trees, std_normalize=False))


def tempo_advantages(trees: Sequence[RolloutTree], eps: float = EPS) -> TokenAdvantages:
    """TEMPO: GRPO plus branch-gated TD corrections, one value per response token.

    V(node) = mean reward of the leaves under it (V(root) = the group mean). The first
    token of a node whose parent has ≥ 2 children gets
    GRPO A_i + (V(node) − V(parent)) / (std_G R + eps); every other token gets GRPO A_i.
    Under a single-child parent the leaf sets coincide, V(node) = V(parent), so the gate
    changes nothing there: it only skips a zero. Shapes: per tree, per leaf, ``leaf.end``
    floats (the whole root-to-leaf response, shared tokens included).
    """
    grpo = grpo_advantages(trees)
    out = []
    for tree, base in zip(trees, grpo):
        rewards = _rewards(tree)
        scale = _std(rewards) + eps
        value, _ = _subtree_stats(tree, rewards)
        per_leaf = []
        for leaf, a in zip(tree.leaves(), base):
            tokens: list[float] = []
            for node in tree.path(leaf):
                values = [a] * len(node.token_ids)
                parent = node.parent
                # The TD term sits on the token where the paths of siblings part.
                if values and parent is not None and len(parent.children) >= 2:
                    values[0] += (value[node.id] - value[parent.id]) / scale
                tokens.extend(values)
            per_leaf.append(tokens)
        out.append(per_leaf)
    return out


def treerl_advantages(trees: Sequence[RolloutTree]) -> TokenAdvantages:
    """TreeRL's process supervision (Hou et al., ACL 2025, §3.2), one value per response token.

    V(s) = mean reward of the leaves under node s (V(root) = the group mean). Every token of
    node s gets R(s) = (GA(s) + LA(s)) / sqrt(|L(s)|), the global advantage GA = V(s) − V(root)
    plus the local one LA = V(s) − V(parent(s)), over the square root of the leaves under s
    (so a prefix shared by many leaves, trained once per leaf, does not outweigh their own
    steps; the reference's ``weighted_value_style: sqrt``). It differs from TreePO's subgroup
    advantage, which gives a whole path one value: here a shared step is judged by the leaves
    under it, a leaf's own tokens by their outcome against their siblings'. No std scaling
    here; the trainer whitens per token afterwards. Shapes: per tree, per leaf, ``leaf.end``.
    """
    out = []
    for tree in trees:
        rewards = _rewards(tree)
        value, count = _subtree_stats(tree, rewards)
        root = value[tree.root.id]
        per_leaf = []
        for leaf in tree.leaves():
            tokens: list[float] = []
            for node in tree.path(leaf):
                v = value[node.id]
                assert node.parent is not None  # tree.path(leaf) starts below the root
                step = ((v - root) + (v - value[node.parent.id])) / math.sqrt(count[node.id])
                tokens.extend([step] * len(node.token_ids))
            per_leaf.append(tokens)
        out.append(per_leaf)
    return out


# -- whitening and filtering ----------------------------------------------------------------


def whiten(trees: Sequence[RolloutTree], advantages: LeafAdvantages) -> LeafAdvantages:
    """Token-weighted whitening of per-leaf values over the batch's linearised tokens.

    Leaf i weighs T_i = ``tree.num_trainable(leaf)``: trainable tokens on its whole path,
    shared ones counted once per leaf, as if every leaf were its own sequence. So this
    equals verl's ``masked_whiten`` over the linear batch: μ = Σ T_i A_i / Σ T_i,
    σ² = Σ T_i (A_i − μ)² / (Σ T_i − 1), A' = (A − μ) / sqrt(σ² + 1e-8). Across all trees
    together, not per tree. A leaf with T_i = 0 has no weight but is shifted and scaled
    too. Needs ≥ 2 trainable tokens in the batch. Returns the same nested shape.
    """
    _check_leaf_shapes(trees, advantages)
    weights = [tree.num_trainable(leaf) for tree in trees for leaf in tree.leaves()]
    flat = _weighted_whiten([float(a) for adv in advantages for a in adv], weights)
    out, k = [], 0
    for adv in advantages:
        out.append(flat[k : k + len(adv)])
        k += len(adv)
    return out


def whiten_token_values(
    trees: Sequence[RolloutTree], advantages: TokenAdvantages
) -> TokenAdvantages:
    """:func:`whiten` for per-token values (TEMPO): every trainable token of every leaf's
    path weighs 1 (loss mask 0 weighs 0). For values constant along each path it equals
    :func:`whiten`. Shapes: per tree, per leaf, ``leaf.end`` floats, in and out.
    """
    _check_leaf_shapes(trees, advantages)
    values: list[float] = []
    weights: list[int] = []
    for tree, adv in zip(trees, advantages):
        for leaf, tokens in zip(tree.leaves(), adv):
            if len(tokens) != leaf.end:
                raise ValueError(
                    f"problem {tree.problem_id}: leaf node {leaf.id} has {leaf.end} "
                    f"response tokens but {len(tokens)} advantages"
                )
            values.extend(float(a) for a in tokens)
            weights.extend(tree.response_loss_mask(leaf))
    flat = _weighted_whiten(values, weights)
    out, k = [], 0
    for adv in advantages:
        per_leaf = []
        for tokens in adv:
            per_leaf.append(flat[k : k + len(tokens)])
            k += len(tokens)
        out.append(per_leaf)
    return out


def dynamic_sampling_filter(trees: Sequence[RolloutTree]) -> list[RolloutTree]:
    """DAPO dynamic sampling: keep, in order, the trees whose leaf rewards differ.

    A tree whose leaves all score the same gives every leaf a zero group-relative
    advantage: no learning signal, only cost. Trees with fewer than two leaves are
    dropped for the same reason. Whole prompts only: sub-groups are never dropped (the
    TreePO paper shows that hurts). A leaf without a reward raises, naming the problem.
    """
    kept = []
    for tree in trees:
        rewards = _rewards(tree)
        if len(rewards) >= 2 and max(rewards) > min(rewards):
            kept.append(tree)
    return kept


# -- the trainer's entry point ----------------------------------------------------------------


def compute_advantages(
    trees: Sequence[RolloutTree],
    estimator: str,
    *,
    treepo_aggregate: Literal["mean", "size_weighted"] = "mean",
    std_normalize: bool = True,
    whiten_tokens: bool = True,
) -> LeafAdvantages | TokenAdvantages:
    """The estimator named ``estimator`` (one of :data:`ESTIMATORS`), then whitening.

    ``treepo_aggregate`` applies to "treepo", ``std_normalize`` to "grpo".
    ``whiten_tokens`` whitens over the batch's linearised trainable tokens afterwards;
    "reinforce_pp" is whitened by definition and is never whitened twice. "tempo"
    and "treerl" return per-token values (:data:`TokenAdvantages`, whitened per token); the others
    per-leaf values (:data:`LeafAdvantages`). ``arbor.train.packing`` accepts both shapes.
    """
    if estimator == "grpo":
        leaf_adv = grpo_advantages(trees, std_normalize=std_normalize)
    elif estimator == "treepo":
        leaf_adv = treepo_advantages(trees, aggregate=treepo_aggregate)
    elif estimator == "reinforce_pp":
        return reinforce_pp_advantages(trees)
    elif estimator in ("tempo", "treerl"):
        token_adv = tempo_advantages(trees) if estimator == "tempo" else treerl_advantages(trees)
        return whiten_token_values(trees, token_adv) if whiten_tokens else token_adv
    else:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; allowed: {', '.join(ESTIMATORS)}"
        )
    return whiten(trees, leaf_adv) if whiten_tokens else leaf_adv
