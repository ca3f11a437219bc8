"""A teacher scores rollout trees as trees: every node's tokens once, its ancestors' prefix cached.

On-policy distillation needs log π_teacher of every token the student sampled. Scored leaf by
leaf, a tree's shared prefixes would be prefilled once per leaf (the linearised count: Σ over
leaves of prompt + path). Here the nodes go to the teacher's engine in waves by depth, each
node as a prefill-only request for the log-probs of its own tokens
(:class:`~arbor.engines.types.ScoreRequest`): a node's context (prompt + ancestors' tokens) was
scored in an earlier wave, so the engine's radix cache holds it, and the node computes its own
tokens plus the one before them (the row predicting its first token). A prompt with several
children is committed first (wave 0), so they share its prefill.

    stats = await score_trees(client, trees, temperature=1.0)   # sets node.teacher_logprobs
    stats.computed_tokens, stats.linearised_tokens               # e.g. 410 vs 1,630

All of a tree's requests carry one affinity key: with several teacher engines, one engine's
cache holds the tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from arbor.engines.types import ScoreOutput, ScoreRequest
from arbor.tree import Node, RolloutTree


class Scorer(Protocol):
    """What scoring needs of an engine client (:class:`~arbor.engines.client.SGLangClient`)."""

    async def score_many(self, requests: list[ScoreRequest]) -> list[ScoreOutput]: ...


@dataclass
class TeacherStats:
    computed_tokens: int  # tokens the teacher's engines computed (prompt_tokens − cached_tokens, summed)
    linearised_tokens: int  # what scoring every leaf's whole sequence alone would compute
    requests: int  # score requests sent (one per node, one per committed prompt)
    waves: int  # sequential rounds of requests (the deepest leaf's depth, + 1 for prompt commits)


def linearised_tokens(trees: list[RolloutTree]) -> int:
    """Σ over leaves of (prompt + root-to-leaf response): each leaf scored as its own sequence."""
    return sum(len(tree.prompt_ids) + leaf.end for tree in trees for leaf in tree.leaves())


async def score_trees(client: Scorer, trees: list[RolloutTree], temperature: float) -> TeacherStats:
    """Set ``node.teacher_logprobs`` (log π_teacher of each of the node's tokens, at
    ``temperature``) on every non-root node of ``trees``; returns what it cost."""
    keys = [f"teacher-tree-{i}" for i in range(len(trees))]
    commits = [ScoreRequest(tree.prompt_ids, start=len(tree.prompt_ids), temperature=temperature, affinity_key=key)
               for tree, key in zip(trees, keys) if len(tree.root.children) > 1]
    computed, requests, waves = 0, 0, 0
    if commits:
        computed += sum(o.prompt_tokens - o.cached_tokens for o in await client.score_many(commits))
        requests, waves = len(commits), 1
    frontier: list[tuple[Node, list[int], str]] = [
        (child, tree.prompt_ids, key) for tree, key in zip(trees, keys) for child in tree.root.children]
    while frontier:
        wanted = [(node, context, key) for node, context, key in frontier if node.token_ids]
        outputs = await client.score_many([ScoreRequest(context + node.token_ids, start=len(context),
                                                        temperature=temperature, affinity_key=key)
                                           for node, context, key in wanted])
        for (node, _, _), out in zip(wanted, outputs):
            node.teacher_logprobs = out.logprobs
            computed += out.prompt_tokens - out.cached_tokens
        for node, _, _ in frontier:
            if not node.token_ids:  # nothing to score (an empty segment): its children still are
                node.teacher_logprobs = []
        requests, waves = requests + len(wanted), waves + 1
        frontier = [(child, context + node.token_ids, key) for node, context, key in frontier
                    for child in node.children]
    return TeacherStats(computed, linearised_tokens(trees), requests, waves)
