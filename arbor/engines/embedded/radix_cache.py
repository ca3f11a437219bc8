"""Radix (token-trie) KV cache for the embedded engine.

Each trie edge holds a run of token ids and the keys and values the model computed for
exactly those tokens in every layer, as one tensor ``[2, L, H_kv, T, D]`` (keys, then
values): copying a prefix in or out is one tensor op, not two per layer. A prompt's
longest cached prefix is found by walking the trie; its KV is the concatenation of the
edges' slices along the path, so a request whose prefix is cached computes only the rest
(SGLang's radix cache, in miniature).

    cache = RadixKVCache(max_tokens=100_000)
    cache.insert([5, 6, 7], stack_kv(keys, values))   # keys[l]: [H_kv, 3, D]
    hit = cache.match([5, 6, 9])               # hit.length == 2, hit.kv: [2, L, H_kv, 2, D]

A hit holds the prefix KV as the edges' slices (views; ``hit.kv`` concatenates them,
``hit.upto(n)`` cuts them without copying). Holding a view never pins the trie: edges'
tensors are never written after insertion (insert clones, a split slices, eviction only
unlinks), so every node is evictable at any time and eviction needs no reference
counts. The bound counts cached tokens (one token = its K and V in
every layer); least-recently-used leaves are evicted first.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

TOKENS = 3  # the token axis of a KV tensor [2, L, H_kv, T, D]


def stack_kv(keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer keys and values ``[H_kv, T, D]`` as one tensor ``[2, L, H_kv, T, D]``."""
    return torch.stack([torch.stack(keys), torch.stack(values)])


@dataclass
class _Node:
    tokens: tuple[int, ...]  # the edge's token ids, [T]
    kv: torch.Tensor | None  # [2, L, H_kv, T, D]; None at the root
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)  # first token -> child
    last_used: int = 0


@dataclass
class PrefixHit:
    length: int  # number of leading prompt tokens found in the cache
    parts: list[torch.Tensor]  # the edges' [2, L, H_kv, t_i, D] (Σ t_i = length)

    @property
    def kv(self) -> torch.Tensor:
        """``[2, L, H_kv, length, D]`` (a fresh tensor when the hit spans several edges)."""
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts, dim=TOKENS)

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer ``[H_kv, length, D]`` (empty for an empty hit)."""
        return list(self.kv[0]) if self.parts else []

    @property
    def values(self) -> list[torch.Tensor]:
        return list(self.kv[1]) if self.parts else []

    def upto(self, length: int) -> PrefixHit:
        """The hit's first ``length`` tokens (views)."""
        if length > self.length:
            raise ValueError(f"the hit covers {self.length} tokens, asked for {length}")
        parts = []
        for part in self.parts:
            if length <= 0:
                break
            parts.append(part[:, :, :, :length])
            length -= part.shape[TOKENS]
        return PrefixHit(sum(p.shape[TOKENS] for p in parts), parts)


class RadixKVCache:
    """Token trie of cached prefixes with per-layer K/V and LRU eviction."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._clock = itertools.count(1)
        self.flush()

    def flush(self) -> None:
        """Drop every cached prefix (after new weights the old KV is wrong)."""
        self._root = _Node(tokens=(), kv=None, parent=None)
        self.num_tokens = 0

    def match(self, tokens: list[int]) -> PrefixHit:
        """Longest cached prefix of ``tokens``; marks the path as recently used."""
        node, pos = self._root, 0
        parts: list[torch.Tensor] = []
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            common = _common_length(child.tokens, tokens, pos)
            child.last_used = now
            assert child.kv is not None
            parts.append(child.kv if common == len(child.tokens) else child.kv[:, :, :, :common])
            pos += common
            if common < len(child.tokens):
                break
            node = child
        return PrefixHit(pos, parts)

    def insert(self, tokens: list[int], kv: torch.Tensor) -> None:
        """Cache ``tokens`` with their KV ``[2, L, H_kv, len(tokens), D]``, then evict."""
        if not tokens or self.max_tokens == 0:
            return
        if kv.shape[TOKENS] != len(tokens):
            raise ValueError(f"KV covers {kv.shape[TOKENS]} tokens, got {len(tokens)} token ids")
        node, pos = self._root, 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                # Clone: a slice would keep the whole batch's KV tensor alive.
                leaf = _Node(
                    tokens=tuple(tokens[pos:]),
                    kv=kv[:, :, :, pos:].clone(),
                    parent=node,
                    last_used=now,
                )
                node.children[tokens[pos]] = leaf
                self.num_tokens += len(leaf.tokens)
                break
            common = _common_length(child.tokens, tokens, pos)
            if common < len(child.tokens):
                child = self._split(child, common)
            child.last_used = now
            node, pos = child, pos + common
        self._evict()

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s edge after ``at`` tokens; returns the new upper node."""
        assert node.parent is not None
        assert node.kv is not None
        upper = _Node(
            tokens=node.tokens[:at],
            kv=node.kv[:, :, :, :at],
            parent=node.parent,
            last_used=node.last_used,
        )
        node.parent.children[node.tokens[0]] = upper
        node.tokens = node.tokens[at:]
        node.kv = node.kv[:, :, :, at:]
        node.parent = upper
        upper.children[node.tokens[0]] = node
        return upper

    def _evict(self) -> None:
        while self.num_tokens > self.max_tokens:
            leaves = [n for n in self._nodes() if not n.children]
            victim = min(leaves, key=lambda n: n.last_used)
            assert victim.parent is not None
            del victim.parent.children[victim.tokens[0]]
            self.num_tokens -= len(victim.tokens)

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _common_length(edge: tuple[int, ...], tokens: list[int], start: int) -> int:
    n = min(len(edge), len(tokens) - start)
    if edge[:n] == tuple(tokens[start : start + n]):  # the usual case, compared in C
        return n
    i = 0
    while i < n and edge[i] == tokens[start + i]:
        i += 1
    return i
