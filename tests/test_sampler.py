"""TreePO sampler: budget arithmetic, branch assignment, early stops, fallback, modes.

A scripted engine (below) stands in for the server so every branching decision can be
worked out by hand; tests/test_sampler_engine.py runs the sampler against `arbor serve`.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable

import pytest

from arbor.config import RolloutConfig
from arbor.engines.types import GenerateOutput, GenerateRequest
from arbor.sampler import sample_trees
from arbor.sampler_budget import (
    assign_branches,
    is_repetitive,
    largest_remainder,
    next_total,
    request_seed,
)
from arbor.tree import RolloutTree

PROMPT = [1, 2, 3]
EOS = 0

# script(request, fork_index, depth_of_new_segment) -> (token ids, finish reason)
Script = Callable[[GenerateRequest, int, int], tuple[list[int], str]]


class ScriptedEngine:
    """Deterministic engine: tokens from ``Random(seed + fork)``, endings from a script."""

    def __init__(self, segment: int, script: Script | None = None) -> None:
        self.segment, self.script = segment, script
        self.calls: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        self.calls.append(request)
        await asyncio.sleep(0)  # let other trees' requests interleave, as a server would
        depth = (len(request.input_ids) - len(PROMPT)) // self.segment + 1
        outs = []
        for j in range(request.sampling.n):
            if self.script is not None:
                ids, reason = self.script(request, j, depth)
            else:
                rng = random.Random(request.sampling.seed + j)
                ids = [rng.randrange(10, 300) for _ in range(request.sampling.max_new_tokens)]
                reason = "length"
            outs.append(
                GenerateOutput(
                    output_ids=ids,
                    logprobs=[-0.5] * len(ids),
                    finish_reason=reason,
                    prompt_tokens=len(request.input_ids),
                    cached_tokens=0 if j == 0 else len(request.input_ids),
                    weight_version="v7",
                )
            )
        return outs


def fresh(request: GenerateRequest, j: int, n: int | None = None) -> list[int]:
    rng = random.Random(request.sampling.seed + j)
    return [rng.randrange(10, 300) for _ in range(n or request.sampling.max_new_tokens)]


def run(engine, cfg: RolloutConfig, prompts=None, **kw) -> tuple[list[RolloutTree], list]:
    prompts = prompts or [PROMPT]
    return asyncio.run(
        sample_trees(engine, [{"id": i} for i in range(len(prompts))], prompts, cfg, **kw)
    )


def cfg_of(**kw) -> RolloutConfig:
    base = dict(width=16, branch=2, segment_tokens=4, max_depth=8)
    base.update(kw)
    return RolloutConfig(**base)


def paths_per_round(engine: ScriptedEngine) -> list[int]:
    """Σ n over the requests of each round (rounds are delimited by response length)."""
    per: dict[int, int] = {}
    for r in engine.calls:
        per[len(r.input_ids)] = per.get(len(r.input_ids), 0) + r.sampling.n
    return [per[k] for k in sorted(per)]


# -- pure budget helpers ----------------------------------------------------------------


def test_next_total_by_hand() -> None:
    # w=16, b=2, nothing ending: 1 → 2 → 4 → 8 → 16 → 16.
    totals, active = [], 1
    for _ in range(5):
        active = next_total(active=active, finished=0, newly_finished=0, width=16, branch=2)
        totals.append(active)
    assert totals == [2, 4, 8, 16, 16]
    # 2 of 4 paths just finished: their budget goes to the 2 survivors: 2·2 + 2·2 = 8.
    assert next_total(active=2, finished=2, newly_finished=2, width=16, branch=2) == 8
    # Capped by the leaves still wanted (16 − 10 = 6), but never below the active paths.
    assert next_total(active=4, finished=10, newly_finished=3, width=16, branch=2) == 6
    assert next_total(active=5, finished=11, newly_finished=0, width=16, branch=2) == 5


def test_largest_remainder_and_assignment_by_hand() -> None:
    assert largest_remainder([1.5, 1.5, 1.0], 4) == [2, 1, 1]  # tie → lower index
    assert assign_branches(5, [0.0, 0.0]) == [3, 2]
    assert assign_branches(3, [0.0, 0.0, 0.0]) == [1, 1, 1]
    # softmax([-0.5, -1.5]) = [0.731, 0.269]; 4 extra → quotas [2.92, 1.08] → [3, 1].
    assert assign_branches(6, [-1.0, -3.0], mode="logprob", temperature=2.0) == [4, 2]
    assert assign_branches(6, [-1.0, -3.0], mode="logprob", favor="low") == [2, 4]
    # Three paths, 7 extra: softmax([0, -2, -4]/2) = [0.665, 0.245, 0.090]
    # → quotas [4.66, 1.71, 0.63] → floors [4, 1, 0], the 2 left go to the largest
    # remainders 0.71 and 0.66 → extra [5, 2, 0] → [6, 3, 1].
    assert assign_branches(10, [0.0, -2.0, -4.0], mode="logprob") == [6, 3, 1]
    with pytest.raises(ValueError, match="below the 3 active"):
        assign_branches(2, [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="branch_assignment"):
        assign_branches(4, [0.0], mode="uniform")


def test_repetition_rule() -> None:
    assert is_repetitive([5, 6, 7] * 4, window=3, count=4)
    assert not is_repetitive([5, 6, 7] * 3, window=3, count=4)
    assert is_repetitive("ab" * 40, window=32, count=8)  # overlapping occurrences count
    assert not is_repetitive("the quick brown fox jumps over the lazy dog " * 2, 32, 8)


def test_request_seeds_differ_per_fork() -> None:
    seeds = {
        request_seed(0, t, node, fork) for t in range(3) for node in range(20) for fork in range(3)
    }
    assert len(seeds) == 180 and all(0 <= s < (1 << 31) - 64 for s in seeds)
    assert request_seed(1, 0, 0, 0) != request_seed(0, 0, 0, 0)


# -- the loop ---------------------------------------------------------------------------


def test_rounds_double_to_width_and_end_with_width_leaves() -> None:
    engine = ScriptedEngine(segment=4)
    trees, stats = run(engine, cfg_of(max_depth=7))
    assert paths_per_round(engine) == [1, 2, 4, 8, 16, 16, 16]
    # Forks of one node are one request with n = copies.
    assert [r.sampling.n for r in engine.calls[:3]] == [1, 2, 2]
    tree, s = trees[0], stats[0]
    assert len(tree.leaves()) == 16 and s.leaves == 16 and s.shortfall_reason is None
    assert {leaf.depth for leaf in tree.leaves()} == {7}
    # Full segments to the last depth: the response hit max_depth · segment_tokens.
    assert {leaf.finish_reason for leaf in tree.leaves()} == {"max_length"}
    assert all(n.weight_version == "v7" and n.logprobs == [-0.5] * 4 for n in tree.nodes())
    assert all(r.affinity_key == "tree-0" for r in engine.calls)
    assert s.requests == len(engine.calls) and s.rounds == 7
    assert s.tokens_generated == sum(len(n.token_ids) for n in tree.nodes())


def test_budget_of_finished_paths_moves_to_survivors() -> None:
    def script(request, j, depth):
        if depth == 3 and j == 0:  # round 3: one of each pair of forks finishes
            return fresh(request, j, 2) + [EOS], "stop"
        return fresh(request, j), "length"

    engine = ScriptedEngine(4, script)
    trees, stats = run(engine, cfg_of(max_depth=6))
    # Round 3: 4 paths, 2 finish → total = min(16 − 2, 2·2 + 2·2) = 8 over 2 survivors;
    # round 5: min(14, 16) = 14; then 14 until the depth limit.
    assert paths_per_round(engine) == [1, 2, 4, 8, 14, 14]
    assert [r.sampling.n for r in engine.calls if len(r.input_ids) == 3 + 12] == [4, 4]
    leaves = trees[0].leaves()
    assert len(leaves) == 16 and stats[0].finish_reasons == {"stop": 2, "max_length": 14}


def test_early_stops_repetition_depth_length() -> None:
    def script(request, j, depth):
        if depth == 2 and j == 1:
            return [7, 8] * 4, "length"  # the 2-gram (7, 8) four times
        if depth == 2:
            return fresh(request, j, 3), "length"  # short segment: depth ends it, not length
        return fresh(request, j), "length"

    cfg = cfg_of(width=4, max_depth=2, segment_tokens=8, repetition_window=2, repetition_count=4)
    trees, stats = run(ScriptedEngine(8, script), cfg)
    reasons = sorted(leaf.finish_reason for leaf in trees[0].leaves())
    # Round 2 forks the root's child 2 ways; no budget can come back after depth 2.
    assert reasons == ["max_depth", "repetition"]
    assert stats[0].shortfall_reason is not None and "well-formed" in stats[0].shortfall_reason


def test_repetition_on_decoded_text() -> None:
    def script(request, j, depth):
        return [65 + (i % 2) for i in range(8)], "length"  # "ABABABAB"

    cfg = cfg_of(
        width=2,
        max_depth=3,
        segment_tokens=8,
        repetition_window=4,
        repetition_count=3,
        fallback=False,
    )
    trees, _ = run(ScriptedEngine(8, script), cfg, decode=lambda ids: "".join(map(chr, ids)))
    assert [leaf.finish_reason for leaf in trees[0].leaves()] == ["repetition"]


def test_fallback_cuts_only_well_formed_paths_at_boundaries() -> None:
    marks: dict[int, int] = {}

    def script(request, j, depth):
        ids = [100 + j] + fresh(request, j, 3)
        if depth == 3:
            # Paths through the first depth-2 fork finish; the others fail (repetition).
            first = request.input_ids[len(PROMPT) + 4]
            return (
                [100, 0] if first == 100 else [9, 9, 9, 9]
            ), "stop" if first == 100 else "length"
        return ids, "length"

    cfg = cfg_of(width=16, max_depth=3, segment_tokens=4, repetition_window=1, repetition_count=4)
    engine = ScriptedEngine(4, script)
    trees, stats = run(engine, cfg)
    tree, s = trees[0], stats[0]
    assert len(tree.leaves()) == 16 and s.fallbacks > 0 and s.shortfall_reason is None
    for node in tree.nodes():
        marks[node.id] = node.token_ids[0]
        if node.children:  # a finished path is never extended
            assert node.finish_reason == "length"
    # The failing depth-2 node of the first rounds is never a fallback cut: it keeps
    # exactly the 2 children round 3 gave it.
    first_round2 = [n for n in tree.root.children[0].children if n.token_ids[0] == 101]
    assert len(first_round2[0].children) == 2
    # Every fallback request restarted from the root or an internal node (token aligned).
    ends = {n.end for n in tree.nodes() if n.children} | {0}
    assert all(len(r.input_ids) - len(PROMPT) in ends for r in engine.calls)


def test_fallback_disabled_and_no_well_formed_path_report_shortfall() -> None:
    def stop_at_once(request, j, depth):
        return [EOS], "stop"

    trees, stats = run(ScriptedEngine(4, stop_at_once), cfg_of(width=4, fallback=False))
    assert len(trees[0].leaves()) == 1
    assert stats[0].shortfall_reason == "no active path left and fallback is disabled"
    trees, stats = run(ScriptedEngine(4, stop_at_once), cfg_of(width=4))
    # Fallback from the only boundary there is (the root) fills the width.
    assert len(trees[0].leaves()) == 4 and stats[0].fallbacks == 2
    assert all(leaf.parent is trees[0].root for leaf in trees[0].leaves())


def test_fallback_prefers_final_answers() -> None:
    def script(request, j, depth):
        if depth < 3:
            return [100 + j] + fresh(request, j, 3), "length"
        # Depth 3 stops everywhere; only paths under the first depth-2 fork answer (50).
        under_first = request.input_ids[len(PROMPT) + 4] == 100
        return ([50, EOS] if under_first else [60, EOS]), "stop"

    for seed in range(24):
        trees, stats = run(
            ScriptedEngine(4, script),
            cfg_of(width=8, max_depth=3),
            is_final_answer=lambda ids: 50 in ids,
            seed=seed,
        )
        tree = trees[0]
        assert len(tree.leaves()) == 8 and stats[0].fallbacks >= 1
        first_fork = tree.root.children[0]
        unanswered = min(
            (n for n in first_fork.children if n.token_ids[0] == 101), key=lambda n: n.id
        )
        # Fallback cuts come only from answered paths: the round-2 branch whose paths did
        # not answer keeps the 2 children of round 3 and nothing more.
        assert len(unanswered.children) == 2


def test_independent_mode_is_one_request_of_width() -> None:
    engine = ScriptedEngine(segment=32)
    trees, stats = run(engine, cfg_of(mode="independent", segment_tokens=4, max_depth=8))
    assert len(engine.calls) == 1
    assert engine.calls[0].sampling.n == 16 and engine.calls[0].sampling.max_new_tokens == 32
    leaves = trees[0].leaves()
    assert len(leaves) == 16 and all(leaf.parent is trees[0].root for leaf in leaves)
    assert stats[0].finish_reasons == {"max_length": 16}


def test_init_divergence_forks_the_root() -> None:
    seen = set()
    for seed in range(12):
        engine = ScriptedEngine(segment=4)
        trees, _ = run(engine, cfg_of(init_divergence=5, max_depth=6), seed=seed)
        seen.add(engine.calls[0].sampling.n)
        assert len(trees[0].leaves()) == 16
    assert seen <= {2, 3, 4, 5} and len(seen) > 1


def test_same_seed_same_trees_many_prompts() -> None:
    def script(request, j, depth):
        rng = random.Random(request.sampling.seed + j)
        ids = [rng.randrange(10, 300) for _ in range(rng.randrange(1, 5))]
        return (ids + [EOS], "stop") if rng.random() < 0.3 else (ids, "length")

    cfg = cfg_of(width=8, max_depth=5, branch_assignment="logprob")
    prompts = [PROMPT, [4, 5, 6, 7]]

    def dump(seed):
        trees, stats = run(ScriptedEngine(4, script), cfg, prompts=prompts, seed=seed)
        assert [len(t.leaves()) for t in trees] == [8, 8], [s.shortfall_reason for s in stats]
        return json.dumps(
            [[(n.id, n.parent.id, n.token_ids, n.finish_reason) for n in t.nodes()] for t in trees]
        )

    assert dump(3) == dump(3)
    assert dump(3) != dump(4)


def test_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="2 problems but 1 prompts"):
        asyncio.run(sample_trees(ScriptedEngine(4), [{}, {}], [PROMPT], cfg_of()))
