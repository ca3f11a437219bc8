"""Depth-first tree execution (``learner.tree_execution: dfs``): one root-to-leaf path in memory.

    walk = DfsWalk(model, pack, select, group_tokens=2048, token_loss=objective_of_groups)
    for _ in walk.ops(): pass                 # forward and backward, group by group, depth first
    logp, entropy = dfs_token_logprobs(model, pack, select)    # the same forwards, no graph

AREAL-DTA (Yuan et al. 2026, "AREAL-DTA: Dynamic Tree Attention for Efficient Reinforcement
Learning of Large Language Models", arXiv 2602.00482) trains on a rollout tree by walking it
depth first in the forward and the backward pass, holding one root-to-leaf path at a time.
Here, on a tree pack (:mod:`arbor.train.packing`):

- The pack's tokens split into **chains**: maximal runs in which each token is the only child
  of the one before (a radix tree's edges). Sibling chains (children of one chain) form
  **groups** of at most ``group_tokens`` padded tokens, forwarded as one right-padded batch.
- A group's forward gets its ancestors' keys and values as the KV cache (transformers'
  ``DynamicCache``, the path generation takes): its queries attend to the whole path above
  and to themselves causally, exactly the tree rule. Each member's own keys and values are
  then copied into **leaf tensors that require grad**: the cache its descendants read.
- The walk recurses into the child groups. Each descendant's backward accumulates into
  those leaves' ``.grad``: ∂L/∂K and ∂L/∂V of the cached keys and values, summed over every
  descendant. Then the group's backward: its own loss plus Σ ⟨K, ∂L/∂K⟩ + ⟨V, ∂L/∂V⟩ over
  its members — the chain rule through the cache, so the gradients are the packed (and
  the linear) ones exactly.

Memory is the activations of the groups on one path plus their caches, not the pack's.
A trained token is scored in the group whose forward computes the logits that predict it
(the last token of a parent chain predicts each child's first token). The loss is a sum over
tokens, so ``token_loss`` is called group by group on its scored tokens and the parts add
up to the pack's loss (:class:`arbor.train.packed_loss.PolicyObjective`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from arbor.train.lm_head import chunkable_head, chunked_head, logprobs_and_entropy, score_dtype
from arbor.train.packing import PackedBatch

R = TypeVar("R")
# transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name warns
# on every call until 5.40); 5.20-5.23 know only the old one.
CACHE_KEYWORD = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"
# (tokens [M] packed indices, log p [M], entropy [M], the reference's log p [M] or None)
#   -> (the loss of these tokens, a record of it)
TokenLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, R]]


# The pack budget of depth-first execution: whole trees, never split. A walk holds one path
# whatever its pack's size; a tree split over packs would only forward its ancestors again.
WHOLE_TREES = 1 << 62


def pack_budget(tree_execution: str, pack_tokens: int) -> int:
    """The token budget of one pack: ``learner.pack_tokens`` (packed), whole trees (dfs)."""
    return WHOLE_TREES if tree_execution == "dfs" else pack_tokens


@dataclass
class Group:
    """Chains forwarded together, one right-padded batch row each: children of one group's
    chains (siblings or cousins) whose paths are equally long."""

    members: list[int]  # chain indices, one batch row each
    past: int  # tokens on each member's path above it: the position of their first token
    width: int  # the longest member: the batch's row length
    children: list[int] = field(default_factory=list)  # child groups, member by member (walk order)
    keep: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [K] row offsets
    rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [M] member·K + index in keep
    scored: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [M] indices into select


@dataclass
class WalkPlan:
    """A pack cut into chains and sibling groups, and where each scored token's logits come from."""

    chains: list[tuple[int, int]]  # [start, end) packed range of each chain
    ancestors: list[list[int]]  # per chain: the chains on its path above it, root first
    groups: list[Group]
    roots: list[int]  # groups without a past (tree roots), in walk order
    parents: set[int]  # chains with child chains: their keys and values are cached for them

    def ops(self) -> str:
        """The walk's model calls in order: F (a group's forward), B (its backward)."""
        out: list[str] = []

        def visit(g: int) -> None:
            out.append("F")
            for child in self.groups[g].children:
                visit(child)
            out.append("B")

        for g in self.roots:
            visit(g)
        return "".join(out)

    def forward_tokens(self) -> int:
        """Tokens the walk forwards, padding included (the packed forward's is ``pack.num_tokens``)."""
        return sum(len(g.members) * g.width for g in self.groups)


def plan_walk(pack: PackedBatch, select: torch.Tensor, group_tokens: int) -> WalkPlan:
    """Chains, groups (≤ ``group_tokens`` padded tokens, at least one chain each) and the rows
    that score the trained tokens ``select`` ([M] packed indices)."""
    if group_tokens < 1:
        raise ValueError(f"learner.dfs_group_tokens must be ≥ 1, got {group_tokens}")
    parent = pack.parent.tolist()
    n = len(parent)
    kids = [0] * n
    for p in parent:
        if p >= 0:
            kids[p] += 1
    # A chain starts at a tree's first token, after a jump in packed order, or below a branch.
    starts = [i for i in range(n) if parent[i] < 0 or parent[i] != i - 1 or kids[i - 1] > 1]
    chains = list(zip(starts, starts[1:] + [n]))
    chain_of = [0] * n
    for c, (s, e) in enumerate(chains):
        chain_of[s:e] = [c] * (e - s)
    ancestors: list[list[int]] = []
    below: dict[int, list[int]] = {}  # parent chain (-1: none) -> child chains
    for c, (s, _) in enumerate(chains):
        up = chain_of[parent[s]] if parent[s] >= 0 else -1  # a parent chain precedes its children
        ancestors.append(ancestors[up] + [up] if up >= 0 else [])
        below.setdefault(up, []).append(c)
    groups: list[Group] = []
    where: dict[int, tuple[int, int]] = {}  # chain -> (group, member index)

    def make_groups(above: list[int]) -> list[int]:
        # The child chains of the chains ``above`` (one group's members; [-1]: the roots). Those
        # whose paths are as long batch together, cousins too: each row gets its own path's
        # cache. Longest first, so a batch's rows are of similar length (little padding).
        by_past: dict[int, list[int]] = {}
        for c in (c for up in above for c in below.get(up, [])):
            by_past.setdefault(int(pack.position_ids[chains[c][0]]), []).append(c)
        made: list[int] = []
        for past, members in sorted(by_past.items()):
            for c in sorted(members, key=lambda c: -(chains[c][1] - chains[c][0])):
                last = groups[made[-1]] if made else None
                if last is not None and last.past == past and (len(last.members) + 1) * last.width <= group_tokens:
                    where[c] = (made[-1], len(last.members))
                    last.members.append(c)
                    continue
                where[c] = (len(groups), 0)
                made.append(len(groups))
                groups.append(Group(members=[c], past=past, width=chains[c][1] - chains[c][0]))
        for g in made:
            groups[g].children = make_groups(groups[g].members)
        return made

    roots = make_groups([-1])
    _score_rows(groups, chains, chain_of, where, parent, select)
    return WalkPlan(chains=chains, ancestors=ancestors, groups=groups, roots=roots,
                    parents={c for c in below if c >= 0})


def _score_rows(groups: list[Group], chains: list[tuple[int, int]], chain_of: list[int],
                where: dict[int, tuple[int, int]], parent: list[int], select: torch.Tensor) -> None:
    """Each group's kept row offsets, and per scored token its flat row there."""
    wanted: dict[int, list[tuple[int, int, int]]] = {}  # group -> (member, offset, index into select)
    for k, token in enumerate(select.tolist()):
        row = parent[token]
        if row < 0:
            raise ValueError(f"packed token {token} is scored but starts a sequence (nothing predicts it)")
        c = chain_of[row]
        g, member = where[c]
        wanted.setdefault(g, []).append((member, row - chains[c][0], k))
    for g, entries in wanted.items():
        keep = sorted({offset for _, offset, _ in entries})
        index = {offset: i for i, offset in enumerate(keep)}
        groups[g].keep = torch.tensor(keep, dtype=torch.long)
        groups[g].rows = torch.tensor([m * len(keep) + index[o] for m, o, _ in entries], dtype=torch.long)
        groups[g].scored = torch.tensor([k for _, _, k in entries], dtype=torch.long)


@dataclass
class _Forward:
    """What a group's backward needs from its forward."""

    loss: torch.Tensor | None  # [] the group's share of the loss (with graph)
    owned: list[tuple[int, list[torch.Tensor]]]  # (chain, its own keys then values per layer, with graph)
    anchor: torch.Tensor | None  # [] 0 · logits: puts every parameter in the backward (lockstep)


class DfsWalk(Generic[R]):
    """One pack's depth-first walk: :meth:`ops` runs it, yielding before each model call.

    ``token_loss`` given: the walk trains (every group's loss and cache gradient go through
    ``backward``, default ``Tensor.backward``; ``scale`` multiplies each loss, not the cache
    gradients, which carry it already); :attr:`records` holds what ``token_loss`` returned per
    group. ``reference`` [len(select)]: the KL reference's log-probs, handed to ``token_loss``
    with each group's tokens. None: forward only, no graph; :attr:`logp` and :attr:`entropy`
    fill in, [len(select)].
    ``anchor_every_backward``: every backward reaches every parameter, with a 0-weighted
    logits term where a group scores nothing — ranks in lockstep issue identical collectives.
    """

    def __init__(
        self,
        model: Any,
        pack: PackedBatch,
        select: torch.Tensor,  # [M] int64 packed indices of the tokens to score
        *,
        group_tokens: int,
        temperature: float = 1.0,
        chunk_tokens: int = 0,
        token_loss: TokenLoss[R] | None = None,
        reference: torch.Tensor | None = None,
        backward: Callable[[torch.Tensor], Any] | None = None,
        scale: float = 1.0,
        anchor_every_backward: bool = False,
    ) -> None:
        hf_model = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
        if token_loss is not None and getattr(hf_model, "is_activation_checkpointing", False):
            raise ValueError("a depth-first walk forwards with a KV cache, which transformers drops in "
                             "checkpointed layers: set model.gradient_checkpointing to false")
        self.model, self.pack, self.select = model, pack, select
        self.plan = plan_walk(pack, select, group_tokens)
        self.temperature, self.chunk_tokens = temperature, chunk_tokens
        self.token_loss, self.reference, self.scale = token_loss, reference, scale
        self.backward_fn = backward or torch.Tensor.backward
        self.anchor = anchor_every_backward and token_loss is not None
        self.device = next(model.parameters()).device
        self.records: list[R] = []
        self.logp = torch.zeros(len(select), dtype=torch.float64)
        self.entropy = torch.zeros(len(select), dtype=torch.float64)
        # chain -> its keys then its values, per layer ([1, H_kv, len, D]): leaves requiring grad
        # (training, kept in float32 or wider so many descendants' gradients add up exactly), or
        # detached (forward only).
        self.cache: dict[int, list[torch.Tensor]] = {}

    @property
    def trains(self) -> bool:
        return self.token_loss is not None

    def calls(self) -> str:
        """The model calls :meth:`ops` announces, in order (only forwards without ``token_loss``)."""
        return self.plan.ops() if self.trains else "F" * len(self.plan.groups)

    def ops(self) -> Iterator[str]:
        """Run the walk; yields "F" before each group's forward and "B" before its backward."""
        for g in self.plan.roots:
            yield from self._visit(g)

    def _visit(self, g: int) -> Iterator[str]:
        yield "F"
        done = self._forward(g)
        for child in self.plan.groups[g].children:
            yield from self._visit(child)
        if self.trains:
            yield "B"
            self._backward(done)
        for c in self.plan.groups[g].members:
            self.cache.pop(c, None)

    def _past(self, group: Group, dtype: torch.dtype) -> DynamicCache:
        """Each member's ancestors' keys and values as one cache: one row per member."""
        if not group.past:
            return DynamicCache()
        paths = [self.plan.ancestors[c] for c in group.members]
        rows = len(paths)
        halves = len(self.cache[paths[0][0]])  # keys of every layer, then values
        siblings = all(path == paths[0] for path in paths)
        data: list[torch.Tensor] = []
        for i in range(halves):
            if siblings:  # one path, viewed per row
                past = torch.cat([self.cache[a][i] for a in paths[0]], dim=2).to(dtype).expand(rows, -1, -1, -1)
            else:  # cousins: a path each
                past = torch.cat([torch.cat([self.cache[a][i] for a in path], dim=2) for path in paths]).to(dtype)
            data.append(past)
        if data[0].shape[2] != group.past:
            raise AssertionError(f"the cache holds {data[0].shape[2]} tokens, the path {group.past}")
        layers = halves // 2
        return DynamicCache(ddp_cache_data=list(zip(data[:layers], data[layers:])))

    def _forward(self, g: int) -> _Forward:
        group, pack = self.plan.groups[g], self.pack
        rows, width = len(group.members), group.width
        ids = torch.zeros(rows, width, dtype=torch.long)  # right padding: causal attention hides it
        for i, c in enumerate(group.members):
            s, e = self.plan.chains[c]
            ids[i, : e - s] = pack.input_ids[s:e]
        positions = (group.past + torch.arange(width)).expand(rows, width)
        targets = pack.input_ids[self.select[group.scored]].to(self.device)
        scored = len(group.scored)
        keep = group.keep if scored else torch.zeros(1, dtype=torch.long)  # one row for the anchor
        dtype = next(self.model.parameters()).dtype
        cache = self._past(group, dtype)  # the forward appends the members' keys and values to it
        with torch.set_grad_enabled(self.trains):
            kw: dict[str, Any] = {"input_ids": ids.to(self.device), "position_ids": positions.to(self.device),
                                  CACHE_KEYWORD: cache, "use_cache": True, "logits_to_keep": keep.to(self.device)}
            head = chunkable_head(self.model) if self.chunk_tokens > 0 and scored else None
            if head is not None:
                with chunked_head(head, targets, temperature=self.temperature, chunk_tokens=self.chunk_tokens,
                                  rows=group.rows.to(self.device)):
                    out = self.model(**kw)
                logp, entropy = out.logits[0, :, 0], out.logits[0, :, 1]
            else:
                out = self.model(**kw)
                logits = out.logits.reshape(-1, out.logits.shape[-1])  # [rows · K, V]
                logp, entropy = logprobs_and_entropy(logits[group.rows.to(self.device)], targets, self.temperature)
            anchor = 0.0 * out.logits.sum() if self.anchor and not scored else None
            owned = self._own_cache(group, cache)
        if not self.trains:
            self.logp[group.scored] = logp.detach().double().cpu()
            self.entropy[group.scored] = entropy.detach().double().cpu()
            return _Forward(None, [], None)
        assert self.token_loss is not None
        loss = None
        if scored:
            ref = None if self.reference is None else self.reference[group.scored]
            loss, record = self.token_loss(self.select[group.scored], logp, entropy, ref)
            self.records.append(record)
        return _Forward(loss, owned, anchor)

    def _own_cache(self, group: Group, cache: DynamicCache) -> list[tuple[int, list[torch.Tensor]]]:
        """Keep each member's own keys and values for its descendants; returns, for the backward,
        those of members with descendants (with their graph)."""
        owned = []
        for i, c in enumerate(group.members):
            s, e = self.plan.chains[c]
            if c not in self.plan.parents:
                continue
            # A DynamicCache's layers hold [rows, H_kv, past + width, D] tensors once forwarded.
            keys = [cast(torch.Tensor, layer.keys) for layer in cast(list[DynamicLayer], cache.layers)]
            values = [cast(torch.Tensor, layer.values) for layer in cast(list[DynamicLayer], cache.layers)]
            kv = [t[i : i + 1, :, group.past : group.past + e - s] for t in keys + values]
            if self.trains:
                self.cache[c] = [t.detach().to(score_dtype(t.dtype)).requires_grad_() for t in kv]
                owned.append((c, kv))
            else:
                self.cache[c] = [t.detach() for t in kv]
        return owned

    def _backward(self, done: _Forward) -> None:
        terms = [] if done.loss is None else [done.loss * self.scale]
        for c, kv in done.owned:
            for own, leaf in zip(kv, self.cache[c]):
                if leaf.grad is not None:  # Σ over descendants of ∂L/∂(this key or value)
                    terms.append(torch.sum(own.to(leaf.grad.dtype) * leaf.grad))
        if done.anchor is not None:
            terms.append(done.anchor)
        if terms:
            total = terms[0]
            for term in terms[1:]:
                total = total + term
            self.backward_fn(total)


def dfs_token_logprobs(
    model: PreTrainedModel,
    pack: PackedBatch,
    select: torch.Tensor,  # [M] int64 packed indices of the tokens to score
    *,
    group_tokens: int = 2048,
    temperature: float = 1.0,
    chunk_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p and entropy at ``select`` from the depth-first walk's forwards, without a graph:
    ([M], [M]) float64 on the CPU (:func:`arbor.train.logprobs.pack_token_logprobs`' values)."""
    walk: DfsWalk[Any] = DfsWalk(model, pack, select, group_tokens=group_tokens, temperature=temperature,
                                 chunk_tokens=chunk_tokens)
    for _ in walk.ops():
        pass
    return walk.logp, walk.entropy
