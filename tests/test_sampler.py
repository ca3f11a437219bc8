"""TreePO sampler: budget arithmetic, branch assignment, early stops, fallback, modes.

A scripted engine (below) stands in for the server so every branching decision can be
worked out by hand; tests/test_sampler_engine.py runs the sampler against `arbor serve`.
"The paper" is TreePO ("TreePO: Bridging the Gap of Policy Optimization and Efficacy and
Inference Efficiency with Heuristic Tree-based Modeling", 2025); "spmd:LINE" is the reference code,
github.com/multimodal-art-projection/TreePO at b86ce51,
verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py
(generate_sequences_tree_deepth_first_vanilla_mode).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable

import pytest

from arbor.config import RolloutConfig
from arbor.engines.types import GenerateOutput, GenerateRequest
from arbor.rollout.budget import (
    assign_branches,
    cap_copies,
    fallback_copies,
    is_repetitive,
    largest_remainder,
    next_total,
    request_seed,
    root_copies,
    segment_score,
)
from arbor.rollout.sampler import sample_trees
from arbor.tree import RolloutTree

PROMPT = [1, 2, 3]
EOS = 0

# script(request, fork_index, depth_of_new_segment) -> (token ids, finish reason)
Script = Callable[[GenerateRequest, int, int], tuple[list[int], str]]
# logprob(request, fork_index, depth_of_new_segment) -> every token's logprob
Logprob = Callable[[GenerateRequest, int, int], float]


class ScriptedEngine:
    """Deterministic engine: tokens from ``Random(seed + fork)``, endings from a script.

    ``rounds`` keeps each batch the sampler sends (one per round of one tree)."""

    def __init__(
        self, segment: int, script: Script | None = None, logprob: Logprob | None = None
    ) -> None:
        self.segment, self.script, self.logprob = segment, script, logprob
        self.calls: list[GenerateRequest] = []
        self.rounds: list[list[GenerateRequest]] = []

    async def generate_many(self, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
        self.rounds.append(list(requests))
        return list(await asyncio.gather(*(self.generate(r) for r in requests)))

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
            lp = -0.5 if self.logprob is None else self.logprob(request, j, depth)
            outs.append(
                GenerateOutput(
                    output_ids=ids,
                    logprobs=[lp] * len(ids),
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
    """Σ n over the requests of each round (of a one-tree run)."""
    return [sum(r.sampling.n for r in batch) for batch in engine.rounds]


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


def test_root_copies_and_fallback_copies_by_hand() -> None:
    rng = random.Random(0)
    assert root_copies(None, branch=2, rng=rng) == 2  # paper Alg. 1 line 2; spmd:626
    assert root_copies(1, branch=2, rng=rng) == 1
    assert root_copies([2, 8], branch=2, rng=random.Random(0)) == 8  # randint(2, 8)
    # b copies per source until the budget is spent (spmd:1075-1084).
    assert fallback_copies(sources=3, remaining=5, branch=2) == [2, 2, 1]
    assert fallback_copies(sources=4, remaining=3, branch=2) == [2, 1]
    assert fallback_copies(sources=1, remaining=6, branch=2) == [2]
    assert fallback_copies(sources=2, remaining=0, branch=2) == []
    assert segment_score([-1.0, -3.0]) == -2.0 and segment_score([]) == 0.0


def test_paths_that_may_not_fork_keep_one_copy_and_give_the_rest_away() -> None:
    # An environment with fork: none that has stepped: its path gets 1, the 2 + 1 extra go round
    # robin to the paths that may fork; with none that may, they are lost.
    assert cap_copies([3, 2, 1], [False, True, True]) == [1, 3, 2]
    assert cap_copies([4, 1, 1], [False, False, True]) == [1, 1, 4]
    assert cap_copies([2, 2], [True, True]) == [2, 2]
    assert cap_copies([1, 3], [True, True]) == [1, 3]  # paths that may fork keep their own counts
    assert cap_copies([3, 1], [False, False]) == [1, 1]


def test_request_seeds_differ_per_fork() -> None:
    seeds = {
        request_seed(0, t, node, fork) for t in range(3) for node in range(20) for fork in range(3)
    }
    assert len(seeds) == 180 and all(0 <= s < (1 << 31) - 64 for s in seeds)
    assert request_seed(1, 0, 0, 0) != request_seed(0, 0, 0, 0)


# -- the loop ---------------------------------------------------------------------------


def test_root_forks_branch_copies_then_doubles_to_width() -> None:
    # Paper Algorithm 1 line 2 (P ← BRANCHING(P) before the first INFERENCE) and spmd:626
    # (each prompt repeated fixed_step_width times): b, b², … paths from the first round.
    engine = ScriptedEngine(segment=4)
    trees, stats = run(engine, cfg_of(max_depth=7))
    assert paths_per_round(engine) == [2, 4, 8, 16, 16, 16, 16]
    # Forks of one node are one request with n = copies.
    assert [r.sampling.n for r in engine.calls[:3]] == [2, 2, 2]
    tree, s = trees[0], stats[0]
    assert len(tree.root.children) == 2
    assert len(tree.leaves()) == 16 and s.leaves == 16 and s.shortfall_reason is None
    assert {leaf.depth for leaf in tree.leaves()} == {7}
    # Full segments to the last depth: the response hit max_depth · segment_tokens.
    assert {leaf.finish_reason for leaf in tree.leaves()} == {"max_length"}
    assert all(n.weight_version == "v7" and n.logprobs == [-0.5] * 4 for n in tree.nodes())
    assert all(r.affinity_key == "tree-0" for r in engine.calls)
    assert not any(r.sampling.return_entropy for r in engine.calls)  # only entropy forking asks for them
    assert s.requests == len(engine.calls) and s.rounds == 7
    assert s.tokens_generated == sum(len(n.token_ids) for n in tree.nodes())
    engine = ScriptedEngine(segment=4)
    run(engine, cfg_of(branch=4, max_depth=3))
    assert paths_per_round(engine) == [4, 16, 16]


def test_root_fork_one_is_a_single_root_path() -> None:
    # rollout.root_fork: 1 keeps one root path: every leaf shares its first
    # segment, one more round to reach the width.
    engine = ScriptedEngine(segment=4)
    trees, _ = run(engine, cfg_of(max_depth=7, root_fork=1))
    assert paths_per_round(engine) == [1, 2, 4, 8, 16, 16, 16]
    assert len(trees[0].root.children) == 1 and len(trees[0].leaves()) == 16


def test_root_fork_range_draws_per_tree() -> None:
    # The paper's "More Init Divergence" (§3 Tree Setting: 2 to 8 at random; spmd:606-615).
    seen = set()
    for seed in range(12):
        engine = ScriptedEngine(segment=4)
        trees, _ = run(engine, cfg_of(root_fork=[2, 5], max_depth=6), seed=seed)
        seen.add(engine.calls[0].sampling.n)
        assert len(trees[0].leaves()) == 16
    assert seen <= {2, 3, 4, 5} and len(seen) > 1


def test_budget_of_finished_paths_moves_to_survivors() -> None:
    def script(request, j, depth):
        if depth == 2 and j == 0:  # round 2: one of each pair of forks finishes
            return fresh(request, j, 2) + [EOS], "stop"
        return fresh(request, j), "length"

    engine = ScriptedEngine(4, script)
    trees, stats = run(engine, cfg_of(max_depth=6))
    # Round 2: 4 paths, 2 finish → total = min(16 − 2, 2·2 + 2·2) = 8 over 2 survivors
    # (spmd:844-850); round 4: min(14, 16) = 14; then 14 until the depth limit.
    assert paths_per_round(engine) == [2, 4, 8, 14, 14, 14]
    assert [r.sampling.n for r in engine.rounds[2]] == [4, 4]
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
    # Each of the root's 2 children forks 2 ways in round 2; every path ends there.
    assert reasons == ["max_depth", "max_depth", "repetition", "repetition"]
    assert stats[0].shortfall_reason is None and stats[0].rounds == 2


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
    assert [leaf.finish_reason for leaf in trees[0].leaves()] == ["repetition", "repetition"]


def test_exact_width_restarts_from_the_root_when_every_path_fails() -> None:
    # No finished path is eligible (the paper §2.2: only answered / EOS paths are fallback
    # candidates): the reference restarts from the root (spmd:1033-1041) with
    # fixed_step_width copies, or what is left of the width (spmd:1060-1084), to width.
    def fail_at_once(request, j, depth):
        return [9, 9, 9, 9], "length"

    cfg = cfg_of(width=16, max_depth=3, repetition_window=1, repetition_count=4)
    engine = ScriptedEngine(4, fail_at_once)
    trees, stats = run(engine, cfg)
    tree, s = trees[0], stats[0]
    assert paths_per_round(engine) == [2] * 8
    assert len(tree.leaves()) == 16 and s.shortfall_reason is None
    assert all(leaf.parent is tree.root for leaf in tree.leaves())
    assert s.finish_reasons == {"repetition": 16} and s.root_restarts == 7 and s.fallbacks == 0

    first = request_seed(0, 0, 0, 0)  # the round-1 request from the root

    def fail_first_round(request, j, depth):
        if request.sampling.seed == first:
            return [9, 9, 9, 9], "length"
        return fresh(request, j), "length"

    engine = ScriptedEngine(4, fail_first_round)
    trees, stats = run(engine, cfg_of(max_depth=5, repetition_window=1, repetition_count=4))
    # Both first paths fail; the root restarts with b = 2 and the tree grows to the width:
    # next_total(active=2, finished=2, newly=0) = 4, then 8, then min(16 − 2, 16) = 14.
    assert paths_per_round(engine) == [2, 2, 4, 8, 14, 14]
    assert stats[0].finish_reasons == {"repetition": 2, "max_length": 14}
    assert stats[0].root_restarts == 1 and len(trees[0].leaves()) == 16


def test_fallback_spends_the_remaining_budget_in_one_round() -> None:
    # The reference cuts every eligible source and gives each fixed_step_width copies
    # until the remaining width is spent, in one round (spmd:1043-1084). Here every answer
    # ends in its first segment, so the only boundary is the root: cuts of one node are
    # one request.
    def stop_at_once(request, j, depth):
        return [EOS], "stop"

    engine = ScriptedEngine(4, stop_at_once)
    trees, stats = run(engine, cfg_of(width=16))
    # Round 1: 2 answers, 14 wanted, 2 sources x 2 copies = 4; round 2: 6 answers, 10 wanted,
    # 6 sources: 2 each for 5 of them = 10. (One source per round took 9 rounds.)
    assert paths_per_round(engine) == [2, 4, 10]
    assert [len(batch) for batch in engine.rounds] == [1, 1, 1]
    assert stats[0].fallbacks == 2 + 5 and stats[0].root_restarts == 0
    assert len(trees[0].leaves()) == 16 and stats[0].rounds == 3


def test_fallback_cuts_only_well_formed_paths_at_boundaries() -> None:
    def script(request, j, depth):
        ids = [100 + j] + fresh(request, j, 3)
        if depth == 3:
            # Paths through a depth-2 node starting with 100 finish; the others fail
            # (repetition).
            first = request.input_ids[len(PROMPT) + 4]
            return (
                [100, 0] if first == 100 else [9, 9, 9, 9]
            ), "stop" if first == 100 else "length"
        return ids, "length"

    cfg = cfg_of(width=16, max_depth=3, segment_tokens=4, repetition_window=1, repetition_count=4)
    engine = ScriptedEngine(4, script)
    trees, stats = run(engine, cfg)
    tree, s = trees[0], stats[0]
    assert len(tree.leaves()) == 16 and s.shortfall_reason is None
    # Round 3 ends all 8 paths: 4 finished, 4 failed. Round 4 is one fallback that spends
    # the 8 missing leaves over the 4 finished sources, 2 copies each, at their own cuts.
    assert paths_per_round(engine)[:4] == [2, 4, 8, 8]
    assert s.fallbacks >= 4
    for node in tree.nodes():
        if node.children:  # a finished path is never extended
            assert node.finish_reason == "length"
    # The failing depth-2 nodes of the first rounds are never fallback cuts: each keeps
    # exactly the 2 children round 3 gave it.
    for first in tree.root.children[:2]:  # round 1's
        (failing,) = [n for n in first.children[:2] if n.token_ids[0] == 101]
        assert len(failing.children) == 2
    # Every fallback request restarted from the root or an internal node (token aligned).
    ends = {n.end for n in tree.nodes() if n.children} | {0}
    assert all(len(r.input_ids) - len(PROMPT) in ends for r in engine.calls)


def test_fallback_disabled_reports_shortfall() -> None:
    # The reference's fallback_policy "no_fallback" (spmd:945-947).
    def stop_at_once(request, j, depth):
        return [EOS], "stop"

    trees, stats = run(ScriptedEngine(4, stop_at_once), cfg_of(width=4, fallback=False))
    assert len(trees[0].leaves()) == 2
    assert stats[0].shortfall_reason == "no active path left and fallback is disabled"


def test_fallback_takes_final_answers_first() -> None:
    def script(request, j, depth):
        if depth == 1:
            return [100 + j] + fresh(request, j, 3), "length"
        # Depth 2 stops everywhere; only paths under the root's first child answer (50).
        under_first = request.input_ids[len(PROMPT)] == 100
        return ([50, EOS] if under_first else [60, EOS]), "stop"

    for seed in range(24):
        trees, stats = run(
            ScriptedEngine(4, script),
            cfg_of(width=6, max_depth=2),
            is_final_answer=lambda ids: 50 in ids,
            seed=seed,
        )
        tree = trees[0]
        assert len(tree.leaves()) == 6 and stats[0].fallbacks == 1
        # Round 2 ends 4 paths (2 answered, 2 not); the 2 missing leaves are 2 copies of
        # one source, and an answered one is first: the unanswered branch is never cut.
        unanswered = tree.root.children[1]
        assert unanswered.token_ids[0] == 101 and len(unanswered.children) == 2
        assert not any(n.children for n in unanswered.children)


def test_logprob_assignment_scores_the_last_segment_or_the_path() -> None:
    # The paper's §4.4 assigns the budget by "the log probabilities of their last segment"
    # (the reference's node_logprob_weighted_div: the last node's mean, spmd:920-926);
    # `path` is the whole path's sum (logprob_weighted_div, spmd:884-888).
    def script(request, j, depth):
        return [100 + j], "length"  # one-token segments: the first tells the subtree

    def logprob(request, j, depth):
        in_a = depth == 1 and j == 0 or depth > 1 and request.input_ids[len(PROMPT)] == 100
        return {1: -0.5 if in_a else -6.0, 2: -3.0 if in_a else -1.0}.get(depth, -1.0)

    def round3(branch_logprob):
        cfg = cfg_of(
            segment_tokens=1,
            max_depth=3,
            branch_assignment="logprob",
            branch_logprob=branch_logprob,
        )
        engine = ScriptedEngine(1, script, logprob)
        run(engine, cfg)
        return [r.sampling.n for r in engine.rounds[2]]

    # Round 2: 4 paths over A (-0.5) and B (-6.0): softmax([-0.25, -3.0]) = [0.94, 0.06],
    # 2 extra → [3, 1]. Round 3: 8 paths over A's 3 children and B's one child, 4 extra:
    # last segment: softmax([-1.5, -1.5, -1.5, -0.5]) = [0.175, 0.175, 0.175, 0.475]
    #   → quotas [0.70, 0.70, 0.70, 1.90] → extra [1, 1, 0, 2] → [2, 2, 1, 3];
    # path sums [-3.5, -3.5, -3.5, -7.0] / 2: weights [0.315, 0.315, 0.315, 0.055]
    #   → quotas [1.26, 1.26, 1.26, 0.22] → extra [2, 1, 1, 0] → [3, 2, 2, 1].
    assert round3("last_segment") == [2, 2, 1, 3]
    assert round3("path") == [3, 2, 2, 1]


def test_independent_mode_is_one_request_of_width() -> None:
    engine = ScriptedEngine(segment=32)
    trees, stats = run(engine, cfg_of(mode="independent", segment_tokens=4, max_depth=8))
    assert len(engine.calls) == 1
    assert engine.calls[0].sampling.n == 16 and engine.calls[0].sampling.max_new_tokens == 32
    leaves = trees[0].leaves()
    assert len(leaves) == 16 and all(leaf.parent is trees[0].root for leaf in leaves)
    assert stats[0].finish_reasons == {"max_length": 16}


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


# -- budget helpers: edges pinned by scripts/mutation.py rollout.budget -----------------------


def test_budget_helper_edges() -> None:
    # Remainders, not quota sizes, pick who rounds up: floors [2, 0, 0], fractions (0.2, 0.6, 0.2).
    assert largest_remainder([2.2, 0.6, 0.2], 3) == [2, 1, 0]
    # Log-probs far from 0 (a long path's sum): the max is subtracted before exp, no overflow.
    # favor="low": softmax([1000, 1001]) = [0.269, 0.731]; 2 extra → [0.54, 1.46] → [1, 1].
    assert assign_branches(4, [-1000.0, -1001.0], mode="logprob", temperature=1.0, favor="low") == [2, 2]
    with pytest.raises(ValueError, match="branch_favor must be 'high' or 'low', got 'mid'"):
        assign_branches(4, [0.0, 0.0], mode="logprob", favor="mid")
    # Shorter than one window: never repetitive (and no empty count to take a max of).
    assert not is_repetitive([1, 2], window=3, count=1)
    assert is_repetitive([1, 2, 3], window=3, count=1)


def test_request_seeds_are_stable_across_versions() -> None:
    # A run resumed with a newer arbor must draw the same seeds: blake2b (8-byte digest,
    # little-endian) of "seed/tree/node/fork" modulo 2**31 − 64.
    assert request_seed(0, 0, 0, 0) == 1874085680
    assert request_seed(7, 3, 12, 1) == 1063933157


# -- requests, progress and the synchronous entry point (scripts/mutation.py rollout.sampler) --------


def test_requests_carry_the_sampling_settings_and_the_problem_reaches_the_tree() -> None:
    from arbor.rollout.sampler import sample_trees_sync

    engine = ScriptedEngine(4)
    seen = []
    cfg = cfg_of(width=2, max_depth=1, temperature=0.7, top_p=0.9, top_k=20)
    trees, stats = sample_trees_sync(engine, [{"id": "a"}, {"id": "b"}], [PROMPT, [4, 5]], cfg,
                                     eos_token_ids=[EOS, 7], seed=5,
                                     on_progress=lambda i, tree, s: seen.append((i, tree, s)))
    assert [t.problem for t in trees] == [{"id": "a"}, {"id": "b"}]
    assert sorted(i for i, _, _ in seen) == [0, 1]
    assert all(trees[i] is tree and stats[i] is s for i, tree, s in seen)
    for request in engine.calls:
        p = request.sampling
        assert (p.temperature, p.top_p, p.top_k, p.stop_token_ids) == (0.7, 0.9, 20, [EOS, 7])
        assert p.n == 2 and p.max_new_tokens == 4


def test_a_node_forked_again_gets_the_next_fork_seed() -> None:
    # Every path fails in round 1, so the root is sent again: fork 0, then fork 1, 2, ...
    def fail_at_once(request, j, depth):
        return [9, 9, 9, 9], "length"

    engine = ScriptedEngine(4, fail_at_once)
    run(engine, cfg_of(width=4, max_depth=3, repetition_window=1, repetition_count=4), seed=2)
    assert [r.sampling.seed for r in engine.calls] == [request_seed(2, 0, 0, k) for k in range(2)]


def test_an_engine_that_returns_too_few_outputs_is_an_error() -> None:
    class Short(ScriptedEngine):
        async def generate(self, request):
            return (await super().generate(request))[:1]

    with pytest.raises(RuntimeError, match="engine returned 1 outputs for a request of n=2"):
        run(Short(4), cfg_of(width=2))


def test_finish_reasons_listed_for_a_shortfall() -> None:
    from arbor.rollout.sample_stats import SampleStats

    assert SampleStats(finish_reasons={"stop": 2, "length": 1, "?": 2}).finish_summary() == "?: 2, length: 1, stop: 2"
    assert SampleStats().finish_summary() == "no leaves"


def test_branch_temperature_and_favor_reach_the_assignment() -> None:
    # Round 1: two root copies with last-segment means −1 and −9. Round 2 splits 4 paths:
    # T = 2: softmax([−0.5, −4.5]) = [0.982, 0.018] → 2 extra → [3, 1]; favor low → [1, 3];
    # T = 100: softmax([−0.01, −0.09]) ≈ [0.52, 0.48] → quotas [1.04, 0.96] → [2, 2].
    def logprob(request, j, depth):
        return (-1.0 if j == 0 else -9.0) if depth == 1 else -0.5

    for kw, split in ((dict(), [3, 1]), (dict(branch_favor="low"), [1, 3]),
                      (dict(branch_temperature=100.0), [2, 2])):
        engine = ScriptedEngine(4, logprob=logprob)
        run(engine, cfg_of(width=8, max_depth=3, branch_assignment="logprob", **kw))
        assert [r.sampling.n for r in engine.rounds[1]] == split, kw


def test_root_fork_range_is_drawn_from_the_seed() -> None:
    # random.Random("SEED/0/init").randint(2, 8) for seeds 0, 1, 2.
    for seed, copies in ((0, 5), (1, 3), (2, 8)):
        engine = ScriptedEngine(4)
        run(engine, cfg_of(root_fork=[2, 8], max_depth=4), seed=seed)
        assert engine.calls[0].sampling.n == copies


def test_abort_and_empty_segments_end_their_paths() -> None:
    def script(request, j, depth):
        return ([5], "abort") if j == 0 else ([], "length")

    engine = ScriptedEngine(4, script)
    trees, stats = run(engine, cfg_of(width=3, root_fork=3, max_depth=4, fallback=False))
    assert [leaf.finish_reason for leaf in trees[0].leaves()] == ["abort", "max_length", "max_length"]
    # Token accounting: one request of 3 prompt tokens, n = 3; outputs 2 and 3 were cached.
    assert (stats[0].prompt_tokens, stats[0].cached_tokens, stats[0].tokens_generated) == (9, 6, 1)
    assert stats[0].tokens_computed == 4
    # An abort is an abort even where the depth limit would also end the path.
    trees, _ = run(ScriptedEngine(4, lambda request, j, depth: ([5], "abort")),
                   cfg_of(width=2, max_depth=1, fallback=False))
    assert [leaf.finish_reason for leaf in trees[0].leaves()] == ["abort", "abort"]


def test_repetition_is_judged_on_the_decoded_text_not_the_ids() -> None:
    # Distinct ids that decode to "aaaa": repetitive as text (window 2, 3 times), not as ids.
    def script(request, j, depth):
        return [10 + j * 4 + k for k in range(4)], "length"

    cfg = cfg_of(width=2, max_depth=3, repetition_window=2, repetition_count=3, fallback=False)
    trees, _ = run(ScriptedEngine(4, script), cfg, decode=lambda ids: "a" * len(ids))
    assert [leaf.finish_reason for leaf in trees[0].leaves()] == ["repetition", "repetition"]


def test_fallback_cuts_at_inner_boundaries_too() -> None:
    # Every path answers at depth 2 (w = 8: 4 answers, 4 missing): each fallback source is
    # cut at the root or at its depth-1 node, at random. Over a few seeds both happen.
    def script(request, j, depth):
        return ((fresh(request, j), "length") if len(request.input_ids) == len(PROMPT)
                else ([11, EOS], "stop"))

    cut_lengths = set()
    for seed in range(4):
        engine = ScriptedEngine(4, script)
        run(engine, cfg_of(width=8, max_depth=3), eos_token_ids=[EOS], seed=seed)
        cut_lengths |= {len(r.input_ids) for r in engine.rounds[2]}
    assert cut_lengths == {len(PROMPT), len(PROMPT) + 4}


def test_fallback_choices_follow_the_seed() -> None:
    def script(request, j, depth):
        return ((fresh(request, j), "length") if len(request.input_ids) == len(PROMPT)
                else ([11, EOS], "stop"))

    def cuts(seed):
        engine = ScriptedEngine(4, script)
        run(engine, cfg_of(width=16, max_depth=3), eos_token_ids=[EOS], seed=seed)
        return [r.input_ids for batch in engine.rounds[2:] for r in batch]

    assert cuts(1) == cuts(1)


def test_an_engine_without_a_batch_call_gets_one_call_per_request() -> None:
    class OneByOne:
        def __init__(self) -> None:
            self.inner = ScriptedEngine(4)

        async def generate(self, request):
            return await self.inner.generate(request)

    single, batched = OneByOne(), ScriptedEngine(4)
    trees_single, _ = run(single, cfg_of(width=4, max_depth=3))
    trees_batched, _ = run(batched, cfg_of(width=4, max_depth=3))
    assert [leaf.token_ids for leaf in trees_single[0].leaves()] == [
        leaf.token_ids for leaf in trees_batched[0].leaves()]
    assert len(single.inner.calls) == len(batched.calls) and single.inner.rounds == []


def test_trees_share_one_engine_call_per_round_by_default() -> None:
    """``across_trees`` (default True): the rounds of concurrent trees go to the engine together;
    False: each tree's round is a call of its own. The trees are the same."""
    keys = []
    for across in (None, False):
        engine = ScriptedEngine(segment=4)
        kw = {} if across is None else {"across_trees": across}
        trees, _ = run(engine, cfg_of(width=4, max_depth=3), prompts=[PROMPT, PROMPT], **kw)
        keys.append([sorted({r.affinity_key for r in batch}) for batch in engine.rounds])
        assert [len(t.leaves()) for t in trees] == [4, 4]
    assert keys[0] and all(k == ["tree-0", "tree-1"] for k in keys[0])
    assert len(keys[1]) == 2 * len(keys[0]) and all(len(k) == 1 for k in keys[1])
