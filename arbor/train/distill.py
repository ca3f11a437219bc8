"""On-policy distillation as a per-token advantage (docs/distillation.md). Pure functions.

The student samples, the teacher scores the student's tokens (``node.teacher_logprobs``), and
each trained token t on leaf ℓ's path gets

    A(ℓ, t) = reward_weight · A_reward(ℓ, t) − coef · d(t)

where A_reward is the configured estimator's advantage after whitening and d(t) the
per-token divergence, unwhitened: ``reverse_kl`` d = log π_behav(t) − log π_teacher(t) (the
sampled-token estimate of KL(π_student ‖ π_teacher), as slime's ``--use-opd`` and TRL's
on-policy distillation use it), ``k3`` d = (r − 1) − log r with r = π_teacher(t) / π_behav(t)
(non-negative, lower variance). Both log-probs are at the sampling temperature. The values
are per leaf and per response token, so a token shared by k leaves enters the loss k times,
as in the linearised batch (:mod:`arbor.train.packing` sums the leaves through each token).

    # one leaf, two tokens: behaviour log-probs [-1, -2], teacher's [-1.5, -1]
    token_divergence(tree, leaf, "reverse_kl")  # [0.5, -1.0]
    distill_advantages([tree], None, reward_weight=0, coef=1, kind="reverse_kl")  # [[[-0.5, 1.0]]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from arbor.tree import Node, RolloutTree

Kind = Literal["reverse_kl", "k3"]
TokenValues = list[list[list[float]]]  # per tree, per leaf, per response token (leaf.end)


def token_divergence(tree: RolloutTree, leaf: Node, kind: Kind) -> list[float]:
    """d(t) for each response token of ``leaf``'s path (``leaf.end`` values); 0 where a token
    is not trained (loss mask 0: tool output, templates) or has no behaviour log-prob."""
    out: list[float] = []
    for node in tree.path(leaf):
        n = len(node.token_ids)
        mask = node.loss_mask or [1] * n
        if node.logprobs is None:
            out.extend([0.0] * n)
            continue
        if node.teacher_logprobs is None or len(node.teacher_logprobs) != n:
            raise ValueError(f"problem {tree.problem_id}: node {node.id} has {n} tokens but "
                             f"{'no' if node.teacher_logprobs is None else len(node.teacher_logprobs)} teacher log-probs")
        for behaviour, teacher, trained in zip(node.logprobs, node.teacher_logprobs, mask):
            log_ratio = behaviour - teacher  # log π_behav − log π_teacher
            if not trained:
                out.append(0.0)
            elif kind == "reverse_kl":
                out.append(log_ratio)
            else:  # k3 with r = π_teacher / π_behav = exp(−log_ratio)
                out.append(math.expm1(-log_ratio) + log_ratio)
    return out


def distill_advantages(
    trees: Sequence[RolloutTree],
    reward_advantages: Sequence[Sequence[float | Sequence[float]]] | None,
    *,
    reward_weight: float,
    coef: float,
    kind: Kind,
) -> TokenValues:
    """Per tree, per leaf, per response token: ``reward_weight``·A_reward − ``coef``·d(t).

    ``reward_advantages``: the estimator's whitened values, per leaf (a float) or per token (a
    list of ``leaf.end``), as :func:`arbor.train.advantage.compute_advantages` returns them;
    None with ``reward_weight`` 0 (pure distillation: the task reward is not used).
    """
    if reward_advantages is None and reward_weight:
        raise ValueError("reward_weight > 0 needs the reward advantages")
    out: TokenValues = []
    for i, tree in enumerate(trees):
        per_leaf = []
        for j, leaf in enumerate(tree.leaves()):
            divergence = token_divergence(tree, leaf, kind)
            reward: float | Sequence[float] = 0.0 if reward_advantages is None else reward_advantages[i][j]
            rewards = [float(reward)] * leaf.end if isinstance(reward, (int, float)) else [float(a) for a in reward]
            per_leaf.append([reward_weight * a - coef * d for a, d in zip(rewards, divergence)])
        out.append(per_leaf)
    return out


def mean_divergence(trees: Sequence[RolloutTree], kind: Kind) -> float:
    """d(t) averaged over the batch's linearised trained tokens (``distill/reverse_kl`` with
    ``reverse_kl``): every leaf's path counts, shared tokens once per leaf."""
    total, count = 0.0, 0
    for tree in trees:
        for leaf in tree.leaves():
            total += sum(token_divergence(tree, leaf, kind))
            count += tree.num_trainable(leaf)
    return total / max(count, 1)
