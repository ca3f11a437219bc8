"""Entropy forking (``rollout.fork_at: entropy``): TreeRL's EPTree over any rollout engine.

    forker = EntropyForker(cfg, index=0, seed=step, stop_ids=[eos], stats=SampleStats(),
                           forks_sent={}, add=add_node, generate=generate)
    await forker.run(tree)      # tree.leaves(): cfg.width whole answers whenever the budget allows

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from arbor.config import RolloutConfig
from arbor.engines.types import GenerateOutput, GenerateRequest, SamplingParams
from arbor.rollout.budget import fallback_copies, request_seed
from arbor.tree import Node, RolloutTree

# A round's outputs for a tree's requests (the tree names the problem in errors).
Generate = Callable[[RolloutTree, list[GenerateRequest]], Awaitable[list[list[GenerateOutput]]]]
AddNode = Callable[[RolloutTree, Node, GenerateOutput], Node]


@dataclass(frozen=True)
class ForkPoint:
    """Token ``offset`` (within the response) on the path through ``node``, scored ``score``."""

    score: float
    node: Node  # the node that held the token when it was scored (it may be split since)
    offset: int


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


def fork_candidates(tree: RolloutTree, scores: dict[int, list[float]]) -> list[tuple[float, Node, int]]:
    """Every token that may start a new branch: all tokens of all nodes, except the first token
    of a node below the root's children (it already starts a branch, or a split's lower part)."""
    out = []
    for node in tree.nodes():
        first = 0 if node.parent is tree.root else 1
        out += [(scores[node.id][i], node, i) for i in range(first, len(node.token_ids))]
    return out


class EntropyForker:
    """The rounds of one tree: M whole paths, then forks at their top-N tokens until width."""

    def __init__(
        self,
        cfg: RolloutConfig,
        *,
        index: int,
        seed: int,
        stop_ids: list[int],
        stats,  # arbor.rollout.sample_stats.SampleStats
        forks_sent: dict[int, int],
        add: AddNode,
        generate: Generate,
    ) -> None:
        self.cfg, self.index, self.seed, self.stop_ids = cfg, index, seed, stop_ids
        self.stats, self.forks_sent, self.add, self.generate = stats, forks_sent, add, generate
        self.scores: dict[int, list[float]] = {}  # node id → one fork score per token
        self.group_of: dict[int, int] = {}  # node id → the initial path (or root restart) it grew from
        self.groups = 0

    async def run(self, tree: RolloutTree) -> None:
        cfg, width = self.cfg, self.cfg.width
        await self._sample(tree, [(tree.root, min(cfg.entropy_init, width))])
        while (leaves := len(tree.leaves())) < width:
            candidates = fork_candidates(tree, self.scores)
            points = top_fork_points(candidates, cfg.entropy_forks, self.group_of)
            copies = fallback_copies(sources=len(points), remaining=width - leaves, branch=cfg.branch)
            if copies:
                parents = [self._fork_parent(tree, p) for p in points[: len(copies)]]
                self.stats.forks += len(copies)
            elif cfg.fallback:
                # No token left to fork at: fresh paths from the prompt, as TreePO restarts the root.
                self.stats.root_restarts += 1
                parents, copies = [tree.root], [min(cfg.branch, width - leaves)]
            else:
                self.stats.shortfall_reason = "no token left to fork at and rollout.fallback is disabled"
                return
            await self._sample(tree, list(zip(parents, copies)))

    def _fork_parent(self, tree: RolloutTree, point: ForkPoint) -> Node:
        """The node new branches at ``point`` hang from: the holder of the token is split before
        it (or, at a node's first token, the node's parent); splits of this round may have moved
        the token into an upper part, which is found walking up from the scored node."""
        node = point.node
        while node.start > point.offset:
            assert node.parent is not None  # the root starts at 0, before every offset
            node = node.parent
        k = point.offset - node.start
        if k == 0:
            assert node.parent is not None  # a scored node is never the root
            return node.parent
        upper = tree.split(node, k)
        self.scores[upper.id], self.scores[node.id] = self.scores[node.id][:k], self.scores[node.id][k:]
        self.group_of[upper.id] = self.group_of[node.id]
        return upper

    async def _sample(self, tree: RolloutTree, forks: list[tuple[Node, int]]) -> None:
        """One request per ``(parent, copies)``, each copy a whole continuation to the end of the
        answer; children are added in request order (node ids and seeds reproduce)."""
        cfg = self.cfg
        want_entropy = cfg.fork_entropy == "distribution"
        requests = []
        for parent, n in forks:
            fork = self.forks_sent.get(parent.id, 0)
            self.forks_sent[parent.id] = fork + 1
            sampling = SamplingParams(
                max_new_tokens=cfg.max_response_tokens - parent.end,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                n=n,
                stop_token_ids=list(self.stop_ids),
                seed=request_seed(self.seed, self.index, parent.id, fork),
                return_entropy=want_entropy,
            )
            prefix = tree.response_ids(parent) if parent.parent is not None else []
            requests.append(GenerateRequest(tree.prompt_ids + prefix, sampling, f"tree-{self.index}"))
        results = await self.generate(tree, requests)
        self.stats.rounds += 1
        self.stats.requests += len(requests)
        for (parent, n), outputs in zip(forks, results):
            if len(outputs) != n:
                raise RuntimeError(f"engine returned {len(outputs)} outputs for a request of n={n}")
            for out in outputs:
                node = self.add(tree, parent, out)
                if node.finish_reason in (None, "length"):
                    # Cut short of the budget without a stop token (the engine's context limit).
                    node.finish_reason = "max_length"
                self.scores[node.id] = self._scores(out)
                if parent.parent is None:
                    self.group_of[node.id] = self.groups
                    self.groups += 1
                else:
                    self.group_of[node.id] = self.group_of[parent.id]

    def _scores(self, out: GenerateOutput) -> list[float]:
        if self.cfg.fork_entropy == "sampled":
            return [-lp for lp in out.logprobs]
        if out.entropies is None or len(out.entropies) != len(out.output_ids):
            raise RuntimeError(
                "rollout.fork_entropy is 'distribution' but the engine returned no per-token entropy "
                "for an output; use rollout.fork_entropy: sampled, or an engine that returns them"
            )
        return list(out.entropies)
