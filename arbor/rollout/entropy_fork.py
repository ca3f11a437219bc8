"""Entropy forking (``rollout.fork_at: entropy``): TreeRL's EPTree as a fork policy.

    forks = entropy_forks(tree, scores, per_group=2, remaining=4, branch=2)
    for point, copies in forks:                  # the sampler splits and sends the requests
        parent = split_for_fork(tree, point, scores)

A fork policy is a plain function of the tree and the engine's per-token scores that says
where to fork and how many copies; :mod:`arbor.rollout.sampler` owns every request (it
samples the initial paths, splits nodes, sends the copies and records their scores).

TreeRL (Hou et al., ACL 2025, arXiv 2506.11902, §3.1 "EPTree"; reference code github.com/THUDM/TreeRL
at f0edbea, ``openrlhf/trainer/ppo_utils/entropy_chain_local_manager.py``, cited "eptree:LINE",
and ``tree_node.py``, "node:LINE"). What it does, and where it departs:

- **M initial paths.** ``rollout.entropy_init`` whole answers are sampled from the prompt in one
  request (eptree:189-220), each up to the response budget (``max_depth · segment_tokens``).
- **Fork at the top-N entropy tokens.** Each round, for each initial path's subtree, the
  ``rollout.entropy_forks`` tokens with the highest score are fork points (eptree:228-285).
  The score is ``rollout.fork_entropy``: ``sampled``, ``−log p`` of the token drawn, what
  the reference ranks by (node:194, "negative log probability as entropy"), free from any
  engine; or ``distribution``, the entropy of the distribution the token was drawn from
  (exact in the embedded engine, estimated from top-k log-probs on SGLang).
- **T copies each.** A fork point at token t re-samples t onward, ``rollout.branch`` (EPTree's
  T) times: the prefix is the path's tokens before t (``get_prefix_ids(split_idx)``,
  node:160-168; eptree:294-298), and each copy runs to the end of the answer. In the
  RolloutTree the node holding t is split there (:meth:`RolloutTree.split`) and the copies are
  children of its upper part, so the tree is an ordinary one (prefixes shared, nodes at token
  boundaries). A token that already starts a branch (the first token of any node below the
  root) is never a fork point again (node:94-96 masks a branch's first token).
- **L rounds → until width.** The reference runs a fixed L rounds and then keeps
  ``num_traces`` of the ``M · (1 + L·N·T)`` leaves. Here the rounds run until the tree has
  ``rollout.width`` leaves, and the last round's copies are cut to what is left: the fork
  points in descending score order get ``branch`` copies each until the budget is spent
  (:func:`arbor.rollout.budget.fallback_copies`). So L is implied by the width:
  ``⌈(width − M) / (M·N·T)⌉`` rounds when every subtree offers N fork points, and no leaf
  sampled is thrown away.
- **Early stops and fallback** are the segment sampler's: a path ends on a stop token, on
  repetition, at the response budget or when the engine aborts; every ended path is a leaf and
  may be forked from. If no fork point is left (every token already starts a branch), the
  missing leaves are sampled from the prompt (``branch`` at a time), as TreePO's fallback
  restarts the root; ``rollout.fallback: false`` records a shortfall instead.
- Left out: the reference's masks of tokens after "answer"/"conclusion" strings (node:107-114,
  task-specific) and its optional token-id "diverse sampling" (eptree:461-508).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from arbor.engines.types import GenerateOutput
from arbor.rollout.budget import fallback_copies
from arbor.tree import Node, RolloutTree

Scores = dict[int, list[float]]  # node id → one fork score per token of the node


@dataclass(frozen=True)
class ForkPoint:
    """Token ``offset`` (within the response) on the path through ``node``, scored ``score``."""

    score: float
    node: Node  # the node that held the token when it was scored (it may be split since)
    offset: int


def entropy_forks(
    tree: RolloutTree, scores: Scores, *, per_group: int, remaining: int, branch: int,
    may_fork: Callable[[Node], bool] | None = None,
) -> list[tuple[ForkPoint, int]]:
    """Where to fork next: ``(point, copies)`` for the ``per_group`` highest-scored tokens of
    each initial path's subtree, best first, ``branch`` copies each until ``remaining`` leaves
    are spent (the last point may get fewer). Empty: no token is left to fork at.

    An initial path's subtree is everything under one child of the root (an initial path, a
    root restart, or copies forked at a root child's first token). ``may_fork(node)``: whether a
    branch may start inside ``node`` (an environment with ``fork: none``: before its first step).
    """
    group_of = {node.id: _initial_path(node).id for node in tree.nodes()}
    candidates = fork_candidates(tree, scores)
    if may_fork is not None:
        candidates = [c for c in candidates if may_fork(c[1])]
    points = top_fork_points(candidates, per_group, group_of)
    copies = fallback_copies(sources=len(points), remaining=remaining, branch=branch)
    return list(zip(points, copies))


def _initial_path(node: Node) -> Node:
    """The root's child ``node`` descends from."""
    while node.parent is not None and node.parent.parent is not None:
        node = node.parent
    return node


def top_fork_points(
    candidates: list[tuple[float, Node, int]], per_group: int, group_of: dict[int, int]
) -> list[ForkPoint]:
    """The ``per_group`` highest-scored candidates of each group (an initial path's subtree),
    all of them in descending score order; ties go to the older node, then the earlier token.

    ``candidates`` are ``(score, node, index within node)``; ``group_of[node.id]`` is the group.
    """
    by_group: dict[int, list[tuple[float, int, int, Node]]] = {}
    for score, node, i in candidates:
        by_group.setdefault(group_of[node.id], []).append((-score, node.id, i, node))
    chosen = []
    for group in sorted(by_group):
        chosen += heapq.nsmallest(per_group, by_group[group], key=lambda c: c[:3])
    chosen.sort(key=lambda c: c[:3])
    return [ForkPoint(-neg, node, node.start + i) for neg, _, i, node in chosen]


def fork_candidates(tree: RolloutTree, scores: Scores) -> list[tuple[float, Node, int]]:
    """Every token that may start a new branch: all tokens of the scored nodes (the model's;
    an environment's turns are never fork points), except the first token of a node below
    another scored node (it already starts a branch, or a split's lower part). A model turn's
    first token after the prompt or an environment turn is a candidate: copies there are fresh
    answers to the same context."""
    out = []
    for node in tree.nodes():
        if node.id not in scores:
            continue
        assert node.parent is not None  # nodes() never yields the root
        first = 1 if node.parent.id in scores else 0
        out += [(scores[node.id][i], node, i) for i in range(first, len(node.token_ids))]
    return out


def split_for_fork(tree: RolloutTree, point: ForkPoint, scores: Scores) -> Node:
    """The node new branches at ``point`` hang from: the holder of the token is split before
    it (or, at a node's first token, the node's parent), its scores split alike. Splits made
    for earlier points of the same round may have moved the token into an upper part, which
    is found walking up from the scored node."""
    node = point.node
    while node.start > point.offset:
        assert node.parent is not None  # the root starts at 0, before every offset
        node = node.parent
    k = point.offset - node.start
    if k == 0:
        assert node.parent is not None  # a scored node is never the root
        return node.parent
    upper = tree.split(node, k)
    scores[upper.id], scores[node.id] = scores[node.id][:k], scores[node.id][k:]
    return upper


def token_scores(out: GenerateOutput, fork_entropy: str) -> list[float]:
    """One fork score per output token: ``-log p`` of the token drawn (``sampled``) or the
    engine's entropy of the distribution it was drawn from (``distribution``)."""
    if fork_entropy == "sampled":
        return [-lp for lp in out.logprobs]
    entropies: Sequence[float] | None = out.entropies
    if entropies is None or len(entropies) != len(out.output_ids):
        raise RuntimeError(
            "rollout.fork_entropy is 'distribution' but the engine returned no per-token entropy "
            "for an output; use rollout.fork_entropy: sampled, or an engine that returns them"
        )
    return list(entropies)
