"""The TreePO sampler against a real `arbor serve` subprocess (tiny random Qwen2 model).

Checks what only a real engine can show: width leaves, forks served from the radix
cache, same seed → same tree, and node logprobs equal to a teacher-forced recompute.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch
from tiny_model import build_tiny_model_dir

from arbor.config import RolloutConfig
from arbor.engines.client import SGLangClient
from arbor.engines.launch import launch_engines
from arbor.engines.types import GenerateOutput, GenerateRequest
from arbor.rollout.sampler import sample_trees
from arbor.tree import RolloutTree

PROMPTS = [[17, 42, 99, 5, 63, 120, 7, 88], [31, 200, 11, 54, 76, 150, 9, 33, 12]]
CFG = RolloutConfig(width=4, branch=2, segment_tokens=4, max_depth=4)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampler")
    model = build_tiny_model_dir(root / "model", seed=0)
    with launch_engines(
        "embedded", model_path=str(model), log_dir=root / "logs", startup_timeout_s=120
    ) as handle:
        yield handle.urls[0], model


class Recorder:
    """Wraps an engine and keeps every (request, outputs) pair."""

    def __init__(self, engine: SGLangClient) -> None:
        self.engine = engine
        self.log: list[tuple[GenerateRequest, list[GenerateOutput]]] = []

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        outs = await self.engine.generate(request)
        self.log.append((request, outs))
        return outs


def sample(url: str, seed: int, cfg: RolloutConfig = CFG):
    async def main():
        async with SGLangClient([url], max_retries=1) as client:
            await client.flush_cache()
            recorder = Recorder(client)
            trees, stats = await sample_trees(
                recorder, [{"id": "a"}, {"id": "b"}], PROMPTS, cfg, eos_token_ids=[0], seed=seed
            )
            return trees, stats, recorder.log

    return asyncio.run(main())


def dump(trees: list[RolloutTree]) -> str:
    return json.dumps(
        [
            [(n.id, n.parent.id, n.token_ids, n.finish_reason, n.weight_version) for n in t.nodes()]
            for t in trees
        ]
    )


def test_trees_have_width_leaves_and_forks_hit_the_cache(server):
    trees, stats, log = sample(server[0], seed=0)
    for tree, s in zip(trees, stats):
        assert len(tree.leaves()) == CFG.width, s.shortfall_reason
        assert s.shortfall_reason is None and s.leaves == CFG.width
        assert all(n.logprobs is not None and n.weight_version for n in tree.nodes())
        for node in tree.nodes():  # internal nodes continued; leaves say why they ended
            assert (node.finish_reason == "length") == bool(node.children)
    forks = [(r, outs) for r, outs in log if r.sampling.n > 1]
    assert forks, "a width-4, branch-2 tree must fork"
    for request, outs in log:
        cached = [o.cached_tokens for o in outs]
        if len(request.input_ids) > len(PROMPTS[1]):
            # A child request (prefix + parent output) recomputes at most its last token.
            assert all(c >= len(request.input_ids) - 1 for c in cached), cached
        # Forks of one node share the prefix: only the first may prefill it.
        assert all(c >= len(request.input_ids) - 1 for c in cached[1:]), cached
    assert sum(s.cached_tokens for s in stats) > 0


def test_same_seed_same_tree(server):
    first, _, _ = sample(server[0], seed=5)
    again, _, _ = sample(server[0], seed=5)
    other, _, _ = sample(server[0], seed=6)
    assert dump(first) == dump(again)
    assert dump(first) != dump(other)
    for a, b in zip(first, again):
        for x, y in zip(a.nodes(), b.nodes()):
            assert all(math.isclose(p, q, abs_tol=1e-5) for p, q in zip(x.logprobs, y.logprobs))


def test_node_logprobs_equal_teacher_forced_recompute(server):
    from transformers import AutoModelForCausalLM

    trees, _, _ = sample(server[0], seed=1)
    model = AutoModelForCausalLM.from_pretrained(server[1], dtype=torch.float32).eval()
    tree = trees[0]
    for leaf in tree.leaves():
        ids = tree.full_ids(leaf)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        prompt = len(tree.prompt_ids)
        response = torch.tensor(ids[prompt:])
        expected = logp[prompt - 1 :].gather(1, response[:, None])[:, 0]
        got = torch.tensor(tree.response_logprobs(leaf))
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def test_independent_mode_against_server(server):
    cfg = RolloutConfig(mode="independent", width=4, segment_tokens=4, max_depth=3)
    trees, stats, log = sample(server[0], seed=0, cfg=cfg)
    assert [r.sampling.n for r, _ in log] == [4, 4]
    for tree in trees:
        assert len(tree.leaves()) == 4 and all(leaf.depth == 1 for leaf in tree.leaves())
        assert all(len(leaf.token_ids) <= 12 for leaf in tree.leaves())


def test_batched_rounds_sample_the_same_trees_in_fewer_requests(server):
    """One call per request, one per round of a tree, one per round of all trees: the
    same seeded trees (tokens exactly, logprobs to float noise), ever fewer /generate calls."""
    prompts = [PROMPTS[i % 2][: 5 + i] for i in range(4)]
    problems = [{"id": str(i)} for i in range(4)]

    def run(mode: str) -> tuple[list[RolloutTree], int]:
        async def main():
            async with SGLangClient([server[0]], max_retries=1) as client:
                await client.flush_cache()
                engine = Recorder(client) if mode == "unbatched" else client
                before = client.generate_calls
                trees, _ = await sample_trees(engine, problems, prompts, CFG, eos_token_ids=[0], seed=3,
                                              across_trees=mode == "across_trees")
                return trees, client.generate_calls - before
        return asyncio.run(main())

    single, single_calls = run("unbatched")
    per_tree, per_tree_calls = run("per_tree")
    across, across_calls = run("across_trees")
    assert dump(single) == dump(per_tree) == dump(across)
    for trees in (per_tree, across):
        for a, b in zip(single, trees):
            for x, y in zip(a.nodes(), b.nodes()):
                assert all(math.isclose(p, q, abs_tol=1e-5) for p, q in zip(x.logprobs, y.logprobs))
    paths = sum(len(list(t.nodes())) - 1 for t in single)  # every node but the roots was sampled once...
    assert single_calls <= paths  # ...and forks of one path shared a request
    rounds = max(len({n.depth for n in t.nodes()}) - 1 for t in single)  # rounds of the deepest tree
    assert across_calls < per_tree_calls < single_calls  # here 5 < 20 < 41
    # Across trees: one call per round (trees in step), plus the root prompts committed
    # before their forks; a fallback round may fall out of step once.
    assert across_calls <= 2 * rounds + 1, (across_calls, rounds)


def test_entropy_forking_against_server_with_exact_entropies(server):
    # fork_at entropy, scored by the engine's exact entropies over HTTP: width leaves of whole
    # answers, nodes split inside sampled text, and every path's log-probs still the model's.
    from transformers import AutoModelForCausalLM

    cfg = RolloutConfig(fork_at="entropy", fork_entropy="distribution", width=5, branch=2, entropy_init=2,
                        entropy_forks=1, segment_tokens=6, max_depth=2)
    trees, stats, log = sample(server[0], seed=3, cfg=cfg)
    assert all(r.sampling.return_entropy and len(o.entropies) == len(o.output_ids) for r, outs in log for o in outs)
    assert [r.sampling.n for r, _ in log[:1]] == [2]  # M = 2 whole paths first
    model = AutoModelForCausalLM.from_pretrained(server[1], dtype=torch.float32).eval()
    for tree, st in zip(trees, stats):
        assert len(tree.leaves()) == 5 and st.leaves == 5 and st.forks >= 1 and st.shortfall_reason is None
        assert all(leaf.end <= 12 for leaf in tree.leaves())  # the response budget, forks included
        for leaf in tree.leaves():
            ids = tree.full_ids(leaf)
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
            prompt = len(tree.prompt_ids)
            expected = logp[prompt - 1 :].gather(1, torch.tensor(ids[prompt:])[:, None])[:, 0]
            assert torch.allclose(torch.tensor(tree.response_logprobs(leaf)), expected, atol=1e-4)
