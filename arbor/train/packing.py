"""Tree packing: every shared prefix once, with per-token weights that restore exact gradients.

A tree is serialised in DFS pre-order (prompt first). For packed token ``i``:
``position_ids[i]`` is its position in the original sequence (RoPE needs it),
``parent[i]`` the packed index of the previous token on its path (the logit row that
predicts token ``i``), and ``subtree_end[i]`` the exclusive end of its subtree, so
token q may attend to token k iff ``k <= q < subtree_end[k]`` (docs/algorithms.md).

The linear objective sums every leaf's path separately; packed, a token appears once, so
it carries the sums over the leaves through it: positive and negative advantage mass
(the clipped objective is piecewise linear in A, split by sign) and leaf counts. With
``normalize="sequence"`` each leaf b is weighted 1/T_b (T_b = trainable tokens on its
path), with ``"token"`` by 1; the denominator (Σ T_b or the number of leaves) is global.

    packs = pack_trees(trees, advantages, pack_tokens=8192)
    packs[0].input_ids      # [N] every unique token of the trees in the pack
    denominator = loss_denominator(trees, "token")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Literal, cast

import torch

from arbor.tree import Node, RolloutTree

Normalize = Literal["token", "sequence"]
# Per tree: one float per leaf, or per leaf one float per response token (TEMPO).
Advantages = Sequence[Sequence[float] | Sequence[Sequence[float]]]


@dataclass
class AttentionBlock:
    """Queries [start, end) attend to ``context`` keys plus themselves causally."""

    start: int
    end: int
    context: torch.Tensor  # [C] int64 packed indices of the ancestors of these queries


@dataclass
class PackedBatch:
    """One forward/backward worth of tree tokens (one or more trees or tree parts)."""

    input_ids: torch.Tensor  # [N] int64
    position_ids: torch.Tensor  # [N] int64, position in the original sequence
    parent: torch.Tensor  # [N] int64, packed index of the previous token on the path; -1 at a start
    subtree_end: torch.Tensor  # [N] int64, exclusive end of the token's subtree in packed order
    owned: torch.Tensor  # [N] bool, response token computed for its tree here (not context only)
    trained: torch.Tensor  # [N] bool, owned and loss mask 1: the token enters the loss
    old_logprobs: torch.Tensor  # [N] float64, behaviour logprobs (0 where not trained)
    # [N] float64, π_old: the learner's log-probs before the update (node.learner_logprobs;
    # loss.rollout_correction); 0 where not trained, NaN on trained tokens not recomputed.
    prox_logprobs: torch.Tensor
    leaf_count: torch.Tensor  # [N] float64, leaves whose path holds the token (linearised multiplicity)
    weight: torch.Tensor  # [N] float64, Σ over those leaves of w_b (normalisation × loss weight; SFT's loss)
    adv_pos: torch.Tensor  # [N] float64, Σ_b w_b · c_b · max(A_b,t, 0) (c_b: sequence-level correction, else 1)
    adv_neg: torch.Tensor  # [N] float64, Σ_b w_b · c_b · min(A_b,t, 0)
    n_pos: torch.Tensor  # [N] float64, leaves with A_b,t > 0 (for the clip fraction)
    n_neg: torch.Tensor  # [N] float64, leaves with A_b,t < 0
    blocks: list[AttentionBlock] = field(default_factory=list)  # for block-sparse attention
    # (tree index, node id, offset in node) of every packed token, to map results back.
    origin: list[tuple[int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Every per-token column must line up with input_ids: one missing or extra entry
        # (e.g. from an empty node) silently shifts the log-probs of every later token.
        n = self.num_tokens
        columns = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("blocks", "origin")}
        wrong = {name: len(col) for name, col in columns.items() if len(col) != n}
        if len(self.origin) != n:
            wrong["origin"] = len(self.origin)
        if wrong:
            raise ValueError(f"packed columns disagree with input_ids ({n} tokens): {wrong}")
        if self.blocks and sum(b.end - b.start for b in self.blocks) != n:
            raise ValueError(f"attention blocks cover {sum(b.end - b.start for b in self.blocks)} of {n} tokens")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def attention_cost(self) -> int:
        """Query-key pairs the tree mask allows: the attention work of this pack."""
        return sum((b.end - b.start) * len(b.context) + (b.end - b.start) * (b.end - b.start + 1) // 2 for b in self.blocks)


def leaf_weights(tree: RolloutTree, normalize: Normalize) -> list[float]:
    """w_b per leaf: 1 (token) or 1/T_b (sequence; 0 for a leaf with nothing to train)."""
    if normalize == "token":
        return [1.0] * len(tree.leaves())
    if normalize == "sequence":
        return [1.0 / t if t else 0.0 for t in (tree.num_trainable(leaf) for leaf in tree.leaves())]
    raise ValueError(f"normalize must be 'token' or 'sequence', got {normalize!r}")


def loss_denominator(trees: Sequence[RolloutTree], normalize: Normalize) -> float:
    """Σ_i T_i (token) or the number of leaves with trainable tokens (sequence), over the batch."""
    counts = [tree.num_trainable(leaf) for tree in trees for leaf in tree.leaves()]
    if normalize == "token":
        return float(sum(counts))
    if normalize == "sequence":
        return float(sum(1 for c in counts if c))
    raise ValueError(f"normalize must be 'token' or 'sequence', got {normalize!r}")


# -- the linear baseline ------------------------------------------------------------------------


def linearise_trees(
    trees: Sequence[RolloutTree], advantages: Advantages
) -> tuple[list[RolloutTree], list[list]]:
    """Every leaf as a tree of its own: one chain, the linear (GRPO-style) batch.

    Leaf b of a tree becomes a single-path tree: the same prompt, a copy of each node on
    b's path (token ids, behaviour logprobs, loss mask, finish reason, weight version),
    b's reward on the last, and the same ``problem`` dict (shared, not copied). Segments
    stay separate nodes, so depths and segment boundaries are kept. Advantages follow
    their leaf: per leaf ``a`` -> ``[a]``, per token ``[a_1, ..]`` -> ``[[a_1, ..]]``.
    Output order: tree by tree, leaves in ``tree.leaves()`` order.

        lin_trees, lin_adv = linearise_trees(trees, advantages)   # 1 leaf per tree
        packs = pack_trees(lin_trees, lin_adv)  # one sequence per trajectory, same loss

    Packing these computes every shared prefix once per leaf, exactly what linear
    training does; the loss denominators of both batches are equal.
    """
    if len(advantages) != len(trees):
        raise ValueError(f"{len(advantages)} advantage lists for {len(trees)} trees")
    out_trees: list[RolloutTree] = []
    out_adv: list[list] = []
    for tree, adv in zip(trees, advantages):
        leaves = tree.leaves()
        if len(adv) != len(leaves):
            raise ValueError(f"problem {tree.problem_id}: {len(adv)} advantages for {len(leaves)} leaves")
        for leaf, a in zip(leaves, adv):
            chain = RolloutTree(tree.prompt_ids, tree.problem)
            tip = chain.root
            for node in tree.path(leaf):
                tip = chain.add_segment(tip, node.token_ids, node.logprobs, node.loss_mask)
                tip.finish_reason, tip.weight_version = node.finish_reason, node.weight_version
                tip.learner_logprobs = node.learner_logprobs
            tip.reward = leaf.reward
            out_trees.append(chain)
            out_adv.append([float(a) if isinstance(a, (int, float)) else [float(x) for x in cast(Sequence[float], a)]])
    return out_trees, out_adv


# -- per-node weights over the whole tree ---------------------------------------------------


@dataclass
class _NodeWeights:
    leaf_count: torch.Tensor  # [len] float64
    weight: torch.Tensor  # [len]
    adv_pos: torch.Tensor  # [len]
    adv_neg: torch.Tensor  # [len]
    n_pos: torch.Tensor  # [len]
    n_neg: torch.Tensor  # [len]


def _node_weights(
    tree: RolloutTree, advantages: Sequence, normalize: Normalize, loss_weights: Sequence[float] | None = None,
    correction_weights: Sequence[float] | None = None,
) -> dict[int, _NodeWeights]:
    """Per node, per token: sums over the leaves below it (every token of a node has the same leaves).

    ``correction_weights`` (one per leaf) scale only the leaf's advantage mass: a leaf's
    sequence-level importance weight multiplies its policy objective, not its KL or entropy.
    """
    leaves = tree.leaves()
    if len(advantages) != len(leaves):
        raise ValueError(
            f"problem {tree.problem_id}: {len(advantages)} advantages for {len(leaves)} leaves"
        )
    w = leaf_weights(tree, normalize)
    if loss_weights is not None:
        if len(loss_weights) != len(leaves):
            raise ValueError(f"problem {tree.problem_id}: {len(loss_weights)} loss weights for {len(leaves)} leaves")
        w = [a * b for a, b in zip(w, loss_weights)]
    if correction_weights is not None and len(correction_weights) != len(leaves):
        raise ValueError(f"problem {tree.problem_id}: {len(correction_weights)} correction weights for {len(leaves)} leaves")
    c = correction_weights if correction_weights is not None else [1.0] * len(leaves)
    # Per leaf: its advantage along the response, one value per response token.
    per_token = []
    for leaf, adv in zip(leaves, advantages):
        if isinstance(adv, (int, float)):
            per_token.append(torch.full((leaf.end,), float(adv), dtype=torch.float64))
        else:
            if len(adv) != leaf.end:
                raise ValueError(
                    f"problem {tree.problem_id}: leaf {leaf.id} has {leaf.end} response tokens "
                    f"but {len(adv)} per-token advantages"
                )
            per_token.append(torch.tensor(adv, dtype=torch.float64))
    below: dict[int, list[int]] = {}
    for b, leaf in enumerate(leaves):
        node: Node | None = leaf
        while node is not None and node.parent is not None:
            below.setdefault(node.id, []).append(b)
            node = node.parent
    out = {}
    for node in tree.nodes():
        idx = below.get(node.id, [])
        n = len(node.token_ids)
        if not idx:  # a dangling node without leaves (should not happen): trains nothing
            zero = torch.zeros(n, dtype=torch.float64)
            out[node.id] = _NodeWeights(zero, zero, zero, zero, zero, zero)
            continue
        a = torch.stack([per_token[b][node.start : node.end] for b in idx])  # [leaves, n]
        wb = torch.tensor([w[b] for b in idx], dtype=torch.float64)[:, None]  # [leaves, 1]
        wc = wb * torch.tensor([c[b] for b in idx], dtype=torch.float64)[:, None]  # [leaves, 1]
        out[node.id] = _NodeWeights(
            leaf_count=torch.full((n,), float(len(idx)), dtype=torch.float64),
            weight=wb.expand(-1, n).sum(0),
            adv_pos=(wc * a.clamp(min=0)).sum(0),
            adv_neg=(wc * a.clamp(max=0)).sum(0),
            n_pos=(a > 0).double().sum(0),
            n_neg=(a < 0).double().sum(0),
        )
    return out


# -- partitioning trees larger than the budget -----------------------------------------------


def _subtree_sizes(tree: RolloutTree) -> dict[int, int]:
    size: dict[int, int] = {}
    for node in reversed(list(tree.nodes())):  # children before parents
        size[node.id] = len(node.token_ids) + sum(size[c.id] for c in node.children)
    return size


def split_tree(tree: RolloutTree, budget: int) -> list[tuple[list[Node], list[Node]]]:
    """Split a tree into (context path, trained nodes) units that each fit the budget.

    A subtree that fits with its root path is one unit. Otherwise its root node is
    trained in a unit of its own (it is context for the rest) and its children recurse:
    every token is trained exactly once; ancestors re-enter as untrained context.
    """
    size = _subtree_sizes(tree)
    prompt = len(tree.prompt_ids)
    units: list[tuple[list[Node], list[Node]]] = []

    def visit(node: Node, context: list[Node], context_size: int) -> None:
        if context_size + size[node.id] <= budget:
            units.append((context, _dfs(node)))
            return
        if context_size + len(node.token_ids) > budget:
            _too_long(tree, node, budget)
        units.append((context, [node]))
        for child in node.children:
            visit(child, context + [node], context_size + len(node.token_ids))

    for child in tree.root.children:
        visit(child, [], prompt)
    return units


def _restrict(context: list[Node], trained: list[Node], allowed: set[int]) -> tuple[list[Node], list[Node]]:
    """A unit of :func:`split_tree` that trains only the nodes ``allowed``: the unit's other nodes
    above those become context, the rest is left out."""
    kept = [n for n in trained if n.id in allowed]
    in_unit, needed = {n.id for n in trained}, set()
    for node in kept:
        up = node.parent
        while up is not None and up.id in in_unit and up.id not in allowed and up.id not in needed:
            needed.add(up.id)
            up = up.parent
    return context + [n for n in trained if n.id in needed], kept


def _too_long(tree: RolloutTree, node: Node, budget: int) -> None:
    raise ValueError(
        f"problem {tree.problem_id}: a path of {len(tree.prompt_ids) + node.end} tokens "
        f"(prompt {len(tree.prompt_ids)} + response {node.end}, node {node.id}) does not fit "
        f"pack_tokens={budget}; raise learner.pack_tokens"
    )


def _dfs(node: Node) -> list[Node]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(reversed(n.children))
    return out


# -- serialisation -----------------------------------------------------------------------------


@dataclass
class _Part:
    tree_index: int
    included: dict[int, bool] = field(default_factory=dict)  # node id -> trained here


def pack_trees(
    trees: Sequence[RolloutTree],
    advantages: Advantages | None = None,
    *,
    pack_tokens: int = 16384,
    normalize: Normalize = "token",
    require_logprobs: bool = True,
    loss_weights: Sequence[Sequence[float]] | None = None,
    correction_weights: Sequence[Sequence[float]] | None = None,
    train_only: Sequence[set[int] | None] | None = None,
) -> list[PackedBatch]:
    """Pack ``trees`` into batches of at most ``pack_tokens`` tokens (DFS order, exact weights).

    ``advantages`` per tree per leaf (or per leaf per token); None means 0 (e.g. for
    log-prob computation or SFT). Trees larger than the budget are partitioned; several trees
    (or parts) share a pack. Packs keep the input order of trees. ``require_logprobs``:
    trained tokens must carry behaviour logprobs (not needed for SFT or scoring).
    ``loss_weights`` per tree per leaf (default 1): a factor on the leaf's w_b, so each
    token's ``weight`` is Σ_b w_b · loss_weight_b (SFT's example weights).
    ``correction_weights`` per tree per leaf (default 1): the leaf's sequence-level
    importance weight c_b on its advantage mass only (:mod:`arbor.train.rollout_correction`).
    ``train_only`` per tree: the ids of the nodes to train here (None: all; empty: the tree is
    left out), their ancestors entering as context: one rank's share of a batch
    (:func:`arbor.train.rank_balance.balance_trees`); weights stay those of the whole tree.
    """
    if advantages is None:
        advantages = [[0.0] * len(t.leaves()) for t in trees]
    if len(advantages) != len(trees):
        raise ValueError(f"{len(advantages)} advantage lists for {len(trees)} trees")
    if loss_weights is not None and len(loss_weights) != len(trees):
        raise ValueError(f"{len(loss_weights)} loss weight lists for {len(trees)} trees")
    if correction_weights is not None and len(correction_weights) != len(trees):
        raise ValueError(f"{len(correction_weights)} correction weight lists for {len(trees)} trees")
    if train_only is not None and len(train_only) != len(trees):
        raise ValueError(f"{len(train_only)} train_only sets for {len(trees)} trees")
    parts: list[list[_Part]] = [[]]
    used = 0
    for t, tree in enumerate(trees):
        nodes = {n.id: n for n in tree.nodes()}
        if len(tree.prompt_ids) >= pack_tokens:
            raise ValueError(f"problem {tree.problem_id}: the prompt alone ({len(tree.prompt_ids)} tokens) fills pack_tokens={pack_tokens}")
        current: _Part | None = None
        allowed = train_only[t] if train_only is not None else None
        for context, trained in split_tree(tree, pack_tokens):
            if allowed is not None:
                context, trained = _restrict(context, trained, allowed)
                if not trained:
                    continue
            new_ids = [n.id for n in context + trained]
            if current is not None:
                extra = sum(len(nodes[i].token_ids) for i in new_ids if i not in current.included)
                if used + extra <= pack_tokens:
                    for n in context:
                        current.included.setdefault(n.id, False)
                    for n in trained:
                        current.included[n.id] = True
                    used += extra
                    continue
            cost = len(tree.prompt_ids) + sum(len(nodes[i].token_ids) for i in new_ids)
            if used + cost > pack_tokens and parts[-1]:
                parts.append([])
                used = 0
            current = _Part(t, {n.id: False for n in context} | {n.id: True for n in trained})
            parts[-1].append(current)
            used += cost
    packed = sorted({part.tree_index for pack in parts for part in pack})  # train_only may leave trees out
    weights = {t: _node_weights(trees[t], advantages[t], normalize, loss_weights[t] if loss_weights is not None else None,
                                correction_weights[t] if correction_weights is not None else None) for t in packed}
    return [_serialise(pack, trees, weights, require_logprobs) for pack in parts if pack]


def _serialise(
    pack: list[_Part],
    trees: Sequence[RolloutTree],
    weights: dict[int, dict[int, _NodeWeights]],
    require_logprobs: bool,
) -> PackedBatch:
    """The parts of one pack as its columns (ids, positions, parent, subtree end, ownership,
    loss columns), attention blocks and token origins.

    One function of ~90 lines on purpose: a single DFS pass per part fills every column,
    opens a block wherever a node does not follow its parent's last token and records
    subtree ends, and these share its running state (``last_of``, ``ancestors``, the block
    in progress); helpers would pass that state back and forth. ``scripts/bench_packing.py``
    times it."""
    cols: dict[str, list] = {k: [] for k in ("ids", "pos", "parent", "end", "owned", "trained", "old", "prox")}
    wcols: dict[str, list[torch.Tensor]] = {k: [] for k in _NodeWeights.__dataclass_fields__}
    blocks: list[AttentionBlock] = []
    origin: list[tuple[int, int, int]] = []

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float64)

    for part in pack:
        tree = trees[part.tree_index]
        base = len(cols["ids"])
        prompt = tree.prompt_ids
        p = len(prompt)
        cols["ids"] += prompt
        cols["pos"] += list(range(p))
        cols["parent"] += [base + i - 1 if i else -1 for i in range(p)]
        cols["owned"] += [False] * p
        cols["trained"] += [False] * p
        cols["old"] += [0.0] * p
        cols["prox"] += [0.0] * p
        origin += [(part.tree_index, 0, i) for i in range(p)]
        for k in wcols:
            wcols[k].append(zeros(p))
        ends_at = len(cols["end"])
        cols["end"] += [None] * p  # filled once the part's length is known
        last_of: dict[int, int] = {tree.root.id: base + p - 1}  # node id -> packed index of its last token
        chain_start, chain_context = base, torch.zeros(0, dtype=torch.long)
        ancestors: dict[int, list[int]] = {tree.root.id: list(range(base, base + p))}
        pending_ends: list[tuple[int, int, Node]] = []  # (first index, count, node)
        for node in _dfs(tree.root)[1:]:
            if node.id not in part.included:
                continue
            start = len(cols["ids"])
            n = len(node.token_ids)
            parent_last = last_of[node.parent.id]  # type: ignore[union-attr]
            # A node that does not directly follow its parent's last token starts a new
            # attention block whose context is its ancestors' tokens. An empty node (an
            # aborted or zero-length segment) adds no token and no block: its children
            # attach to its parent's last token.
            if n and parent_last != start - 1:
                blocks.append(AttentionBlock(chain_start, start, chain_context))
                chain_start = start
                chain_context = torch.tensor(ancestors[node.parent.id], dtype=torch.long)  # type: ignore[union-attr]
            cols["ids"] += node.token_ids
            cols["pos"] += [p + node.start + k for k in range(n)]
            cols["parent"] += ([parent_last] + list(range(start, start + n - 1)))[:n]
            owned = part.included[node.id]
            mask = node.loss_mask or [1] * n
            trained = [owned and m == 1 for m in mask]
            cols["owned"] += [owned] * n
            cols["trained"] += trained
            if require_logprobs and any(trained) and node.logprobs is None:
                raise ValueError(f"problem {tree.problem_id}: node {node.id} has trainable tokens but no logprobs")
            cols["old"] += node.logprobs if node.logprobs is not None else [0.0] * n
            cols["prox"] += node.learner_logprobs if node.learner_logprobs is not None else [math.nan] * n
            origin += [(part.tree_index, node.id, k) for k in range(n)]
            nw = weights[part.tree_index][node.id]
            for k in wcols:
                wcols[k].append(getattr(nw, k) if owned else zeros(n))
            cols["end"] += [None] * n
            pending_ends.append((start, n, node))
            last_of[node.id] = start + n - 1 if n else parent_last
            ancestors[node.id] = ancestors[node.parent.id] + list(range(start, start + n))  # type: ignore[union-attr]
        total = len(cols["ids"])
        blocks.append(AttentionBlock(chain_start, total, chain_context))
        # subtree_end: prompt tokens see the whole part; a node's tokens end where its
        # subtree (its included descendants, contiguous in DFS order) ends.
        for i in range(ends_at, ends_at + p):
            cols["end"][i] = total
        end_of: dict[int, int] = {}
        for start, n, node in reversed(pending_ends):
            kids = [end_of[c.id] for c in node.children if c.id in end_of]
            end_of[node.id] = max(kids, default=start + n)
            for i in range(start, start + n):
                cols["end"][i] = end_of[node.id]
    old = torch.tensor(cols["old"], dtype=torch.float64)
    prox = torch.tensor(cols["prox"], dtype=torch.float64)
    trained_mask = torch.tensor(cols["trained"], dtype=torch.bool)
    return PackedBatch(
        input_ids=torch.tensor(cols["ids"], dtype=torch.long),
        position_ids=torch.tensor(cols["pos"], dtype=torch.long),
        parent=torch.tensor(cols["parent"], dtype=torch.long),
        subtree_end=torch.tensor(cols["end"], dtype=torch.long),
        owned=torch.tensor(cols["owned"], dtype=torch.bool),
        trained=trained_mask,
        old_logprobs=torch.where(trained_mask, old, torch.zeros_like(old)),
        prox_logprobs=torch.where(trained_mask, prox, torch.zeros_like(prox)),
        blocks=blocks,
        origin=origin,
        **{k: torch.cat(v) for k, v in wcols.items()},
    )


def assign_to_ranks(packs: Sequence[PackedBatch], world_size: int) -> list[list[int]]:
    """Indices of ``packs`` per data-parallel rank, balanced by cost (tokens + attention pairs).

    Longest-processing-time greedy: deterministic, within 4/3 of the best makespan.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be ≥ 1, got {world_size}")
    cost = [p.num_tokens * 64 + p.attention_cost() for p in packs]  # 64 ≈ per-token MLP vs attention pair
    order = sorted(range(len(packs)), key=lambda i: (-cost[i], i))
    loads = [0.0] * world_size
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        r = min(range(world_size), key=lambda k: (loads[k], k))
        ranks[r].append(i)
        loads[r] += cost[i]
    return [sorted(r) for r in ranks]
