"""Rollout trees: one prompt, many sampled answers that share prefixes.

A node is one sampled **segment** (TreePO) or one agent turn; the root holds no tokens
(the prompt lives on the tree). Leaves are the ends of trajectories and carry rewards.

    tree = RolloutTree(prompt_ids=[1, 2, 3], problem={"id": "p0", "answer": "4"})
    a = tree.add_segment(tree.root, [10, 11], logprobs=[-0.1, -0.2])
    b1 = tree.add_segment(a, [12, 2])          # fork: two children of `a`
    b2 = tree.add_segment(a, [13, 2])
    b1.reward, b2.reward = 1.0, 0.0
    tree.leaves()                               # [b1, b2]
    tree.response_ids(b2)                       # [10, 11, 13, 2]

Invariants the rest of arbor relies on:
- ``node.depth`` counts segments (or turns) from the root, not tokens: TreePO subgroups
  are defined over sampling depths.
- Leaves are the nodes without children, in creation order. A leaf is never extended:
  ``from_sequences`` gives every response at least one token of its own, so identical
  responses remain distinct leaves.
- ``node.logprobs`` are the behaviour policy's (the engine's) log-probabilities of the
  node's tokens; ``node.loss_mask`` is None when every token is trainable, else one
  0/1 per token (0 for tool output and templates the model did not generate).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any


class Node:
    """One segment of a rollout tree. Create nodes with :meth:`RolloutTree.add_segment`."""

    __slots__ = (
        "id",
        "parent",
        "children",
        "depth",
        "start",
        "token_ids",
        "logprobs",
        "learner_logprobs",
        "teacher_logprobs",
        "loss_mask",
        "reward",
        "env_reward",
        "finish_reason",
        "weight_version",
    )

    def __init__(
        self,
        node_id: int,
        parent: Node | None,
        token_ids: list[int],
        logprobs: list[float] | None,
        loss_mask: list[int] | None,
    ) -> None:
        self.id = node_id  # creation index within the tree; the root is 0
        self.parent = parent
        self.children: list[Node] = []
        self.depth: int = 0 if parent is None else parent.depth + 1
        # Offset of this node's first token within the response (prompt excluded).
        self.start: int = 0 if parent is None else parent.start + len(parent.token_ids)
        self.token_ids: list[int] = token_ids
        self.logprobs = logprobs
        # π_old: the learner's log-probs of these tokens before the update, set by the
        # trainer when loss.rollout_correction needs them (arbor.train.rollout_correction).
        self.learner_logprobs: list[float] | None = None
        # log π_teacher of these tokens at the sampling temperature, set when a run distils
        # (arbor.rollout.teacher_scoring); None otherwise.
        self.teacher_logprobs: list[float] | None = None
        self.loss_mask = loss_mask
        self.reward: float | None = None
        # A leaf's environment reward (rollout.env's reward(), read when its episode ended);
        # None: no environment, or it gave none. ``reward`` adds it, weighted (reward.env_weight).
        self.env_reward: float | None = None
        self.finish_reason: str | None = None
        self.weight_version: str | None = None  # engine weights that sampled it

    @property
    def end(self) -> int:
        """Offset just past this node's last token within the response."""
        return self.start + len(self.token_ids)

    @property
    def is_leaf(self) -> bool:
        return not self.children and self.parent is not None

    def num_trainable(self) -> int:
        """Tokens of this node that the loss trains (loss mask 1)."""
        if self.loss_mask is None:
            return len(self.token_ids)
        return int(sum(self.loss_mask))

    def __repr__(self) -> str:
        return (
            f"Node(id={self.id}, depth={self.depth}, tokens={len(self.token_ids)}, "
            f"children={len(self.children)}, reward={self.reward})"
        )


@dataclass(frozen=True)
class TreeStats:
    """Token accounting of a tree. ``linearised`` counts every leaf's path separately."""

    leaves: int
    nodes: int  # excluding the root
    max_depth: int
    prompt_tokens: int
    unique_response_tokens: int  # each response token once
    linearised_response_tokens: int  # Σ over leaves of the response path length
    unique_tokens: int  # prompt once + unique response tokens
    linearised_tokens: int  # Σ over leaves of (prompt + response path length)

    @property
    def sharing_ratio(self) -> float:
        """linearised / unique tokens, prompt included: the ideal speed-up of tree training (≥ 1)."""
        return self.linearised_tokens / max(self.unique_tokens, 1)

    @property
    def response_sharing_ratio(self) -> float:
        """linearised / unique response tokens: how much generation the shared prefixes saved."""
        return self.linearised_response_tokens / max(self.unique_response_tokens, 1)


class RolloutTree:
    """The rollouts of one prompt, as a tree of segments."""

    def __init__(self, prompt_ids: list[int], problem: dict | None = None) -> None:
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.problem = problem
        self._nodes: list[Node] = []
        self.root = self._new_node(None, [], None, None)

    @property
    def problem_id(self) -> str:
        """The problem's id as shown in error messages (``'<no id>'`` when unknown)."""
        return repr((self.problem or {}).get("id", "<no id>"))

    # -- building ---------------------------------------------------------------------

    def _new_node(
        self,
        parent: Node | None,
        token_ids: Sequence[int],
        logprobs: Sequence[float] | None,
        loss_mask: Sequence[int] | None,
    ) -> Node:
        token_ids = [int(t) for t in token_ids]
        if logprobs is not None:
            logprobs = [float(x) for x in logprobs]
            if len(logprobs) != len(token_ids):
                raise ValueError(
                    f"logprobs has {len(logprobs)} entries for {len(token_ids)} tokens"
                )
        if loss_mask is not None:
            loss_mask = [int(m) for m in loss_mask]
            if len(loss_mask) != len(token_ids):
                raise ValueError(
                    f"loss_mask has {len(loss_mask)} entries for {len(token_ids)} tokens"
                )
            if any(m not in (0, 1) for m in loss_mask):
                raise ValueError("loss_mask entries must be 0 or 1")
        node = Node(len(self._nodes), parent, token_ids, logprobs, loss_mask)
        self._nodes.append(node)
        if parent is not None:
            parent.children.append(node)
        return node

    def add_segment(
        self,
        parent: Node,
        token_ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        loss_mask: Sequence[int] | None = None,
    ) -> Node:
        """Append one sampled segment under ``parent`` and return its node."""
        if parent.id >= len(self._nodes) or self._nodes[parent.id] is not parent:
            raise ValueError("parent does not belong to this tree")
        return self._new_node(parent, token_ids, logprobs, loss_mask)

    def split(self, node: Node, n: int) -> Node:
        """Split ``node`` after its first ``n`` tokens (``0 < n < len(node.token_ids)``) and
        return the new upper node, so a path can fork inside a sampled segment.

        The lower part keeps the original Node object (its id, reward, finish reason and leaf
        order); the upper one is a new node (the next id) with the same weight version.
        ``tree.split(a, 1)`` on ``a = [10, 11]``: ``[10] -> [11]``, ``[10]`` returned.
        """
        if node.id >= len(self._nodes) or self._nodes[node.id] is not node or node.parent is None:
            raise ValueError("split: the node is not a non-root node of this tree")
        if not 0 < n < len(node.token_ids):
            raise ValueError(f"split: node {node.id} has {len(node.token_ids)} tokens, cannot split after {n}")
        upper = self._split(node, n)
        upper.weight_version = node.weight_version
        return upper

    def drop_leaves(self, leaves: Sequence[Node]) -> int:
        """Remove the trajectories ending at ``leaves``: each leaf and the ancestors no other
        leaf passes through (a branch that must never be trained on). Node ids are renumbered
        in creation order, so call it once the tree is complete. Returns the nodes removed.

        ``a → [b1, b2]``, dropping ``b2``: ``a → [b1]``; dropping both: the tree is empty.
        """
        gone: set[int] = set()
        for leaf in leaves:
            if leaf.id >= len(self._nodes) or self._nodes[leaf.id] is not leaf or not leaf.is_leaf:
                raise ValueError(f"drop_leaves: node {leaf.id} is not a leaf of this tree")
            node = leaf
            while node.parent is not None and not node.children:
                node.parent.children.remove(node)
                gone.add(node.id)
                node = node.parent
        self._nodes = [n for n in self._nodes if n.id not in gone]
        for new_id, node in enumerate(self._nodes):
            node.id = new_id
        return len(gone)

    # -- traversal ----------------------------------------------------------------------

    def nodes(self) -> Iterator[Node]:
        """All nodes except the root, in DFS pre-order (children in creation order)."""
        stack = list(reversed(self.root.children))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def leaves(self) -> list[Node]:
        """Trajectory ends, in creation order."""
        return [n for n in self._nodes if n.is_leaf]

    @property
    def num_nodes(self) -> int:
        """Nodes excluding the root."""
        return len(self._nodes) - 1

    def path(self, node: Node) -> list[Node]:
        """Nodes from the root's child down to ``node`` (the root excluded)."""
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def response_ids(self, leaf: Node) -> list[int]:
        """The response tokens of the trajectory ending at ``leaf`` (prompt excluded)."""
        return [t for n in self.path(leaf) for t in n.token_ids]

    def full_ids(self, leaf: Node) -> list[int]:
        """Prompt followed by the response of ``leaf``."""
        return self.prompt_ids + self.response_ids(leaf)

    def response_logprobs(self, leaf: Node) -> list[float]:
        """Behaviour log-probabilities along the path; raises if a node has none."""
        out: list[float] = []
        for n in self.path(leaf):
            if n.logprobs is None:
                raise ValueError(f"node {n.id} has no logprobs")
            out.extend(n.logprobs)
        return out

    def response_loss_mask(self, leaf: Node) -> list[int]:
        """0/1 per response token of the path (1 = trained)."""
        out: list[int] = []
        for n in self.path(leaf):
            out.extend([1] * len(n.token_ids) if n.loss_mask is None else n.loss_mask)
        return out

    def num_trainable(self, leaf: Node) -> int:
        """Trainable tokens on the path of ``leaf`` (T_i of the loss, docs/algorithms.md)."""
        return sum(n.num_trainable() for n in self.path(leaf))

    def leaf_counts(self) -> dict[int, int]:
        """Number of leaves under each node (root included), by node id."""
        counts = dict.fromkeys(range(len(self._nodes)), 0)
        for leaf in self.leaves():
            node: Node | None = leaf
            while node is not None:
                counts[node.id] += 1
                node = node.parent
        return counts

    # -- statistics ----------------------------------------------------------------------

    def stats(self) -> TreeStats:
        leaves = self.leaves()
        prompt = len(self.prompt_ids)
        unique = sum(len(n.token_ids) for n in self._nodes)
        linear = sum(leaf.end for leaf in leaves)
        return TreeStats(
            leaves=len(leaves),
            nodes=self.num_nodes,
            max_depth=max((n.depth for n in self._nodes), default=0),
            prompt_tokens=prompt,
            unique_response_tokens=unique,
            linearised_response_tokens=linear,
            unique_tokens=prompt + unique,
            linearised_tokens=linear + prompt * len(leaves),
        )

    # -- construction from flat sequences ----------------------------------------------

    @classmethod
    def from_sequences(
        cls,
        prompt_ids: list[int],
        responses: Sequence[Sequence[int]],
        rewards: Sequence[float] | None = None,
        segment_tokens: int | None = None,
        logprobs: Sequence[Sequence[float]] | None = None,
        problem: dict | None = None,
    ) -> RolloutTree:
        """Build a tree from independent responses to one prompt (prefix-to-tree).

        With ``segment_tokens=l`` nodes are whole segments of ``l`` tokens (the last may
        be shorter): depth = segment index, as in TreePO sampling. Without it nodes split
        only where responses diverge (a radix tree). Leaves come out in the order of
        ``responses``; each response keeps at least its last segment (or, radix, its last
        token) as a leaf of its own, so identical responses stay distinct leaves.

        Where two responses share a token prefix but were given different ``logprobs``
        for it, the first response's values are kept.
        """
        if rewards is not None and len(rewards) != len(responses):
            raise ValueError(f"{len(rewards)} rewards for {len(responses)} responses")
        if logprobs is not None and len(logprobs) != len(responses):
            raise ValueError(f"{len(logprobs)} logprob lists for {len(responses)} responses")
        if segment_tokens is not None and segment_tokens < 1:
            raise ValueError(f"segment_tokens must be ≥ 1, got {segment_tokens}")
        tree = cls(prompt_ids, problem)
        for i, response in enumerate(responses):
            response = [int(t) for t in response]
            lps = None if logprobs is None else [float(x) for x in logprobs[i]]
            if lps is not None and len(lps) != len(response):
                raise ValueError(f"response {i}: {len(lps)} logprobs for {len(response)} tokens")
            if segment_tokens is None:
                leaf = tree._insert_radix(response, lps)
            else:
                leaf = tree._insert_segments(response, lps, segment_tokens)
            if rewards is not None:
                leaf.reward = float(rewards[i])
        return tree

    def _insert_segments(self, response: list[int], lps: list[float] | None, seg: int) -> Node:
        # Share whole segments with existing non-leaf nodes; the last segment is always new.
        node = self.root
        bounds = list(range(0, len(response), seg)) or [0]
        for k, start in enumerate(bounds):
            piece = response[start : start + seg]
            piece_lp = None if lps is None else lps[start : start + seg]
            if k < len(bounds) - 1:
                match = next(
                    (c for c in node.children if c.children and c.token_ids == piece), None
                )
                if match is not None:
                    node = match
                    continue
            node = self._new_node(node, piece, piece_lp, None)
        return node

    def _insert_radix(self, response: list[int], lps: list[float] | None) -> Node:
        # Walk down while tokens match, never consuming the response's last token, so the
        # response ends in a leaf of its own. A node matched only in part is split.
        node, pos = self.root, 0
        limit = len(response) - 1
        while pos < limit:
            # Several children may start with the same token (a leaf that cannot be
            # extended, e.g. [5] beside [5, 6, 7]): follow the one that matches longest,
            # preferring one matched in full (no split needed).
            child, best = None, (0, False)
            for c in node.children:
                m = self._radix_match(c, response, pos, limit)
                if m > 0 and (m, m == len(c.token_ids)) > best:
                    child, best = c, (m, m == len(c.token_ids))
            if child is None:
                break
            n = best[0]
            if n < len(child.token_ids):
                node = self._split(child, n)
                pos += n
                break
            node, pos = child, pos + n
        rest_lp = None if lps is None else lps[pos:]
        return self._new_node(node, response[pos:], rest_lp, None)

    @staticmethod
    def _radix_match(child: Node, response: list[int], pos: int, limit: int) -> int:
        """Tokens of ``child`` that ``response[pos:limit]`` may share with it."""
        # A leaf keeps at least one token of its own, so it stays a leaf.
        room = len(child.token_ids) - (1 if child.is_leaf else 0)
        n = 0
        while n < room and pos + n < limit and child.token_ids[n] == response[pos + n]:
            n += 1
        return n

    def _split(self, node: Node, n: int) -> Node:
        """Split ``node`` after its first ``n`` tokens; return the new upper node.

        The lower part keeps the original Node object (its id, reward and leaf order).
        """
        parent = node.parent
        assert parent is not None and 0 < n < len(node.token_ids)
        upper = Node(
            len(self._nodes),
            parent,
            node.token_ids[:n],
            None if node.logprobs is None else node.logprobs[:n],
            None if node.loss_mask is None else node.loss_mask[:n],
        )
        self._nodes.append(upper)
        parent.children[parent.children.index(node)] = upper
        upper.children.append(node)
        node.parent = upper
        node.token_ids = node.token_ids[n:]
        node.logprobs = None if node.logprobs is None else node.logprobs[n:]
        node.loss_mask = None if node.loss_mask is None else node.loss_mask[n:]
        node.start = upper.end
        for sub in self._subtree(node):
            sub.depth += 1
        return upper

    def _subtree(self, node: Node) -> Iterator[Node]:
        stack = [node]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children)

    # -- serialisation ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; nodes listed by id, each naming its parent's id."""
        return {
            "prompt_ids": self.prompt_ids,
            "problem": self.problem,
            "nodes": [
                {
                    "id": n.id,
                    "parent": None if n.parent is None else n.parent.id,
                    "token_ids": n.token_ids,
                    "logprobs": n.logprobs,
                    "loss_mask": n.loss_mask,
                    "reward": n.reward,
                    "env_reward": n.env_reward,
                    "finish_reason": n.finish_reason,
                    "weight_version": n.weight_version,
                }
                for n in self.nodes()  # DFS pre-order: keeps sibling order
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutTree:
        tree = cls(data["prompt_ids"], data.get("problem"))
        by_id: dict[int, Node] = {0: tree.root}
        # Nodes come in DFS pre-order, so parents precede children and sibling order holds.
        for d in data["nodes"]:
            if d["parent"] not in by_id:
                raise ValueError(f"tree JSON: node {d['id']} comes before its parent {d['parent']}")
            node = tree._new_node(by_id[d["parent"]], d["token_ids"], d["logprobs"], d["loss_mask"])
            node.reward = d["reward"]
            node.env_reward = d.get("env_reward")
            node.finish_reason = d["finish_reason"]
            node.weight_version = d.get("weight_version")
            by_id[d["id"]] = node
        # Restore the original ids, hence creation order and leaf order.
        tree._nodes = [by_id[i] for i in sorted(by_id)]
        for new_id, node in enumerate(tree._nodes):
            node.id = new_id
        return tree

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> RolloutTree:
        return cls.from_dict(json.loads(text))

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"RolloutTree(prompt={s.prompt_tokens} tokens, leaves={s.leaves}, nodes={s.nodes}, "
            f"sharing_ratio={s.sharing_ratio:.2f})"
        )
