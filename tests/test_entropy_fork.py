"""Entropy forking (rollout.fork_at: entropy, TreeRL's EPTree) worked out by hand.

A scripted engine answers each prefix with fixed tokens, log-probs and entropies, so every
fork point, split and budget decision can be checked; tests/test_sampler_engine.py runs the
same policy against `arbor serve` with exact entropies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

from arbor.config import Config, RolloutConfig
from arbor.config_load import validate
from arbor.engines.types import GenerateOutput, GenerateRequest
from arbor.engines.wire import entropy_from_top_logprobs, parse_output
from arbor.errors import ConfigError
from arbor.rollout.entropy_fork import (
    entropy_forks,
    fork_candidates,
    split_for_fork,
    top_fork_points,
)
from arbor.rollout.sampler import sample_trees
from arbor.tree import RolloutTree

PROMPT = [1, 2, 3]
EOS = 0
# response prefix → one (tokens, log-probs, entropies, finish reason) per fork j of a request
Script = dict[tuple[int, ...], list[tuple[list[int], list[float], list[float] | None, str]]]


class ScriptedEngine:
    """Answers a request from ``script[response prefix]``; keeps every request it got."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        self.requests.append(request)
        prefix = tuple(request.input_ids[len(PROMPT):])
        outs = []
        for ids, logprobs, entropies, reason in self.script[prefix][: request.sampling.n]:
            assert len(ids) <= request.sampling.max_new_tokens
            outs.append(GenerateOutput(ids, logprobs, reason, len(request.input_ids), 0, "v1",
                                       entropies if request.sampling.return_entropy else None))
        assert len(outs) == request.sampling.n, f"the script has too few answers for {prefix}"
        return outs


def cfg(**kw) -> RolloutConfig:
    base = dict(fork_at="entropy", width=4, branch=2, entropy_init=1, entropy_forks=1, segment_tokens=4, max_depth=2)
    return RolloutConfig(**{**base, **kw})


def sample(script: Script, config: RolloutConfig):
    engine = ScriptedEngine(script)
    trees, stats = asyncio.run(sample_trees(engine, [{"id": "p"}], [PROMPT], config, eos_token_ids=[EOS], seed=0))
    return trees[0], stats[0], engine.requests


# One initial path, then forks at its -log p peaks (scores = -logprobs).
SCRIPT: Script = {
    (): [([10, 11, 12, EOS], [-0.1, -2.0, -0.5, -0.1], [0.3, 0.1, 0.2, 0.0], "stop")],
    (10,): [([20, 21, EOS], [-0.3, -3.0, -0.1], None, "stop"), ([22, EOS], [-0.2, -0.1], None, "stop")],
    (10, 20): [([30, EOS], [-0.4, -0.1], None, "stop")],
    (10, 11): [([40, EOS], [-0.4, -0.1], None, "stop")] * 2,
    (10, 11, 12): [([50, EOS], [-0.4, -0.1], None, "stop")] * 2,
}


def test_forks_at_the_highest_scored_tokens_until_width():
    tree, stats, requests = sample(SCRIPT, cfg())
    # Round 0: one whole path [10 11 12 EOS] (budget 2 x 4 = 8 tokens); scores -logp 0.1 2.0 0.5 0.1.
    # Round 1: top-1 is token 11 (offset 1): the node splits into [10] | [11 12 EOS] and [10] gets
    # branch = 2 copies, each re-sampling offset 1 onward: [20 21 EOS] and [22 EOS] (3 leaves).
    # Round 2: 1 leaf missing. Candidates: [10] 0.1, [12 EOS] 0.5 0.1 (11 starts a branch now),
    # [21 EOS] 3.0 0.1, [EOS] 0.1: token 21 (offset 2) wins, [20 21 EOS] splits into [20] | [21 EOS]
    # and gets the one copy left: [30 EOS].
    assert [r.input_ids[len(PROMPT):] for r in requests] == [[], [10], [10, 20]]
    assert [r.sampling.n for r in requests] == [1, 2, 1]
    assert [r.sampling.max_new_tokens for r in requests] == [8, 7, 6]  # the rest of the response budget
    assert [tree.response_ids(leaf) for leaf in tree.leaves()] == [
        [10, 11, 12, EOS], [10, 20, 21, EOS], [10, 22, EOS], [10, 20, 30, EOS]]
    assert [leaf.token_ids for leaf in tree.leaves()] == [[11, 12, EOS], [21, EOS], [22, EOS], [30, EOS]]
    # Shared prefixes are shared nodes; log-probs were split along with the tokens.
    (top,) = tree.root.children
    assert top.token_ids == [10] and top.logprobs == [-0.1] and len(top.children) == 3
    assert tree.response_logprobs(tree.leaves()[1]) == [-0.1, -0.3, -3.0, -0.1]
    assert stats.leaves == 4 and stats.forks == 2 and stats.rounds == 3 and stats.requests == 3
    assert stats.finish_reasons == {"stop": 4} and stats.shortfall_reason is None


def test_distribution_scores_come_from_the_engine():
    # The same answers ranked by the distribution's entropy: token 10 (0.3) leads, offset 0 of a
    # root child, so the copies hang from the root (fresh paths), not from a split.
    script = dict(SCRIPT)
    script[()] = SCRIPT[()] + [([10, 11, 12, EOS], [-0.1, -2.0, -0.5, -0.1], [0.3, 0.1, 0.2, 0.0], "stop")] * 2
    tree, stats, requests = sample(script, cfg(fork_entropy="distribution", width=3))
    assert all(r.sampling.return_entropy for r in requests)
    assert [r.input_ids[len(PROMPT):] for r in requests] == [[], []]
    assert [r.sampling.n for r in requests] == [1, 2]
    assert len(tree.root.children) == 3 and stats.leaves == 3


def test_distribution_scores_without_engine_entropies_fail_naming_the_key():
    script = {(): [([10, EOS], [-0.1, -0.1], None, "stop")]}
    with pytest.raises(RuntimeError, match="rollout.fork_entropy"):
        sample(script, cfg(fork_entropy="distribution"))


def test_each_initial_path_gets_its_own_top_n():
    # M = 2 paths, N = 1: path b's best token (0.2) is forked although path a's second best (1.0)
    # scores higher: fork points are chosen per initial path (EPTree's per-tree top-N).
    script: Script = {
        (): [([10, 11, 12, EOS], [-0.1, -3.0, -1.0, -0.1], None, "stop"),
             ([60, 61, EOS], [-0.1, -0.2, -0.1], None, "stop")],
        (10,): [([70, EOS], [-0.1, -0.1], None, "stop")] * 2,
        (60,): [([80, EOS], [-0.1, -0.1], None, "stop")] * 2,
    }
    tree, stats, requests = sample(script, cfg(entropy_init=2, width=6))
    assert [r.input_ids[len(PROMPT):] for r in requests] == [[], [10], [60]]
    assert stats.leaves == 6 and stats.forks == 2


def test_no_fork_point_left_falls_back_to_the_root_or_records_a_shortfall():
    # An aborted empty answer has no token to fork at: the missing leaves come from the prompt.
    script: Script = {(): [([], [], None, "abort")] + [([10, EOS], [-0.1, -0.1], None, "stop")] * 2}
    tree, stats, requests = sample(script, cfg(width=3))
    assert [r.sampling.n for r in requests] == [1, 2] and stats.root_restarts == 1 and stats.leaves == 3
    tree, stats, _ = sample(script, cfg(width=3, fallback=False))
    assert stats.leaves == 1 and stats.shortfall_reason == "no token left to fork at and rollout.fallback is disabled"


def test_root_restarts_add_up_and_never_overshoot_the_width():
    # Both initial paths abort empty: the root restarts with min(branch, leaves missing) copies,
    # 2 then 1 (not 2: the width is 5), each counted, until the width is reached.
    script: Script = {(): [([], [], None, "abort")] * 2}
    tree, stats, requests = sample(script, cfg(width=5, entropy_init=2))
    assert [r.sampling.n for r in requests] == [2, 2, 1]
    assert stats.root_restarts == 2 and stats.forks == 0 and stats.leaves == 5 and stats.shortfall_reason is None


def test_an_answer_cut_short_without_a_stop_token_ends_as_max_length():
    # "length" from the engine ends a whole path too (its context limit): the leaf says max_length.
    tree, stats, _ = sample({(): [([10, 11], [-0.1, -0.2], None, "length")]}, cfg(width=1))
    assert [leaf.finish_reason for leaf in tree.leaves()] == ["max_length"]
    assert stats.finish_reasons == {"max_length": 1}


def test_an_engine_returning_too_few_answers_is_an_error():
    class Short(ScriptedEngine):
        async def generate(self, request):
            return (await super().generate(request))[:1]

    script: Script = {(): [([10, EOS], [-0.1, -0.1], None, "stop")] * 2}
    with pytest.raises(RuntimeError, match=r"^engine returned 1 outputs for a request of n=2$"):
        asyncio.run(sample_trees(Short(script), [{"id": "p"}], [PROMPT], cfg(width=2, entropy_init=2),
                                 eos_token_ids=[EOS]))


def test_partial_rollouts_sample_an_overtaken_whole_path_again():
    # The first answer comes back sampled by weights a push replaced in flight: it is sent again
    # (counted in resampled) and the tree is the one the current weights give.
    class Overtaken(ScriptedEngine):
        async def generate(self, request):
            outs = await super().generate(request)
            version = "v0" if len(self.requests) == 1 else "v1"
            return [dataclasses.replace(out, weight_version=version) for out in outs]

    engine = Overtaken(SCRIPT)
    (tree,), (stats,) = asyncio.run(sample_trees(engine, [{"id": "p"}], [PROMPT], cfg(), eos_token_ids=[EOS],
                                                 is_stale=lambda version: version == "v0"))
    assert [r.input_ids[len(PROMPT):] for r in engine.requests] == [[], [], [10], [10, 20]]
    assert stats.resampled == 1 and {n.weight_version for n in tree.nodes()} == {"v1"}
    assert [tree.response_ids(leaf) for leaf in tree.leaves()] == [
        [10, 11, 12, EOS], [10, 20, 21, EOS], [10, 22, EOS], [10, 20, 30, EOS]]


def test_candidates_skip_tokens_that_already_start_a_branch():
    tree = RolloutTree(PROMPT)
    a = tree.add_segment(tree.root, [10, 11, 12])
    upper = tree.split(a, 1)  # [10] | [11 12]
    b = tree.add_segment(upper, [20, 21])
    scores = {upper.id: [0.5], a.id: [9.0, 0.2], b.id: [9.0, 0.4]}
    candidates = [(s, n.id, i) for s, n, i in fork_candidates(tree, scores)]
    assert candidates == [(0.5, upper.id, 0), (0.2, a.id, 1), (0.4, b.id, 1)]
    groups = dict.fromkeys(scores, 0)
    points = top_fork_points(fork_candidates(tree, scores), 2, groups)
    assert [(p.score, p.offset) for p in points] == [(0.5, 0), (0.4, 2)]


def test_split_keeps_the_lower_node_and_rejects_bad_offsets():
    tree = RolloutTree(PROMPT)
    a = tree.add_segment(tree.root, [10, 11, 12], [-1.0, -2.0, -3.0])
    a.weight_version = "v3"
    upper = tree.split(a, 2)
    assert (upper.token_ids, a.token_ids, a.start, a.depth) == ([10, 11], [12], 2, 2)
    assert (upper.logprobs, a.logprobs, upper.weight_version) == ([-1.0, -2.0], [-3.0], "v3")
    assert tree.leaves() == [a]
    with pytest.raises(ValueError, match="cannot split after 1"):
        tree.split(a, 1)
    with pytest.raises(ValueError, match="not a non-root node"):
        tree.split(tree.root, 1)


def test_config_checks_name_the_keys():
    config = Config()
    config.rollout.fork_at, config.rollout.width, config.rollout.entropy_init = "entropy", 4, 6
    with pytest.raises(ConfigError, match="rollout.entropy_init"):
        validate(config)
    config.rollout.entropy_init, config.rollout.mode = 2, "independent"
    with pytest.raises(ConfigError, match="rollout.fork_at"):
        validate(config)
    config.rollout.mode, config.rollout.entropy_forks = "tree", 0
    with pytest.raises(ConfigError, match="rollout.entropy_forks"):
        validate(config)


def test_entropy_from_top_logprobs_is_a_lower_bound_counting_the_tail_as_one_outcome():
    # p = 0.5, 0.25 and a tail of 0.25: 0.5 log 2 + 0.25 log 4 + 0.25 log 4 = 1.0397.
    assert entropy_from_top_logprobs([math.log(0.5), math.log(0.25)]) == pytest.approx(1.0397207708)
    # The whole distribution given: exact (uniform over 4 = log 4).
    assert entropy_from_top_logprobs([math.log(0.25)] * 4) == pytest.approx(math.log(4))
    # SGLang's reply: top-k triples per token; arbor's server: exact values.
    meta = {"output_token_logprobs": [[-0.1, 5, None]], "finish_reason": {"type": "stop"},
            "output_top_logprobs": [[[math.log(0.5), 5, None], [math.log(0.5), 6, None]]]}
    assert parse_output({"output_ids": [5], "meta_info": meta}).entropies == [pytest.approx(math.log(2))]
    meta["output_token_entropy"] = [0.25]
    assert parse_output({"output_ids": [5], "meta_info": meta}).entropies == [0.25]
    assert parse_output({"output_ids": [5], "meta_info": {"output_token_logprobs": [[-0.1, 5, None]]}}).entropies is None


def test_the_policy_is_a_function_of_the_tree_and_scores_that_sends_nothing():
    # Two initial paths (root children) and a fork below the first; N = 1 per initial path,
    # 3 leaves left at branch 2: the first point gets 2 copies, the second the last one. The
    # tree is not touched: splitting and requests are the sampler's.
    tree = RolloutTree(PROMPT)
    a = tree.add_segment(tree.root, [10, 11, 12])
    b = tree.add_segment(tree.root, [60, 61])
    upper = tree.split(a, 1)  # [10] | [11 12]
    c = tree.add_segment(upper, [20, 21])  # in a's subtree
    scores = {upper.id: [0.1], a.id: [0.2, 0.3], b.id: [0.05, 0.4], c.id: [9.0, 5.0]}
    before = [(n.id, list(n.token_ids)) for n in tree.nodes()]
    forks = entropy_forks(tree, scores, per_group=1, remaining=3, branch=2)
    assert [(p.node.id, p.offset, p.score, copies) for p, copies in forks] == [(c.id, 2, 5.0, 2), (b.id, 1, 0.4, 1)]
    assert [(n.id, list(n.token_ids)) for n in tree.nodes()] == before
    (only,) = entropy_forks(tree, scores, per_group=1, remaining=1, branch=2)  # the budget cuts the copies
    assert (only[0], only[1]) == (forks[0][0], 1)
    # The sampler then splits where the policy said: c at offset 2 → [20] | [21].
    parent = split_for_fork(tree, forks[0][0], scores)
    assert parent.token_ids == [20] and scores[parent.id] == [9.0] and scores[c.id] == [5.0]
