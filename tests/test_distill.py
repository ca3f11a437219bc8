"""On-policy distillation: the per-token advantage (hand-worked numbers), the teacher's tree
scoring on a real embedded engine (each node once, ancestors cached; the same log-probs as
scoring every leaf alone), and the config's rules."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
from tiny_model import build_tiny_model_dir

from arbor.config import Config, DistillConfig, TeacherConfig
from arbor.config_load import validate
from arbor.engines.client import SGLangClient
from arbor.engines.embedded.engine import LocalEngine
from arbor.engines.embedded.server import ServerThread
from arbor.engines.types import ScoreRequest
from arbor.errors import ConfigError
from arbor.rollout.teacher_scoring import linearised_tokens, score_trees
from arbor.run.phases import batch_advantages
from arbor.run.teacher_settle import check_same_tokenizer, settled_distill
from arbor.train.distill import distill_advantages, mean_divergence, token_divergence
from arbor.tree import RolloutTree


def two_leaf_tree() -> RolloutTree:
    """Prompt [1, 2]; a shared node [10] then leaves [11] (R 1) and [12, 13] (R 0)."""
    tree = RolloutTree([1, 2], {"id": "p"})
    shared = tree.add_segment(tree.root, [10], logprobs=[-1.0])
    a = tree.add_segment(shared, [11], logprobs=[-2.0])
    b = tree.add_segment(shared, [12, 13], logprobs=[-0.5, -3.0], loss_mask=[1, 0])
    shared.teacher_logprobs, a.teacher_logprobs, b.teacher_logprobs = [-1.5], [-1.0], [-0.5, -9.0]
    a.reward, b.reward = 1.0, 0.0
    return tree


def test_divergence_per_token_reverse_kl_and_k3():
    tree = two_leaf_tree()
    a, b = tree.leaves()
    # log π_behav − log π_teacher: shared 0.5; leaf a −1.0; leaf b 0.0, and 0 on its masked token
    assert token_divergence(tree, a, "reverse_kl") == [0.5, -1.0]
    assert token_divergence(tree, b, "reverse_kl") == [0.5, 0.0, 0.0]
    # k3 = (r − 1) − log r, r = exp(teacher − behaviour): for 0.5, e^-0.5 − 1 + 0.5 = 0.1065
    assert token_divergence(tree, a, "k3") == pytest.approx([math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0])
    # mean over linearised trained tokens: (0.5 − 1.0) + (0.5 + 0) over 2 + 2 tokens
    assert mean_divergence([tree], "reverse_kl") == pytest.approx(0.0)


def test_advantage_mixes_the_whitened_reward_and_the_unwhitened_term():
    tree = two_leaf_tree()
    pure = distill_advantages([tree], None, reward_weight=0.0, coef=2.0, kind="reverse_kl")
    assert pure == [[[-1.0, 2.0], [-1.0, 0.0, 0.0]]]
    mixed = distill_advantages([tree], [[1.0, [0.5, 0.5, 0.5]]], reward_weight=0.5, coef=1.0, kind="reverse_kl")
    assert mixed == [[[0.5 - 0.5, 0.5 + 1.0], [0.25 - 0.5, 0.25, 0.25]]]
    with pytest.raises(ValueError, match="reward advantages"):
        distill_advantages([tree], None, reward_weight=1.0, coef=1.0, kind="reverse_kl")
    tree.leaves()[0].teacher_logprobs = None
    with pytest.raises(ValueError, match="teacher log-probs"):
        distill_advantages([tree], None, reward_weight=0.0, coef=1.0, kind="reverse_kl")


def test_batch_advantages_with_distillation_counts_a_shared_token_once_per_leaf():
    """The packed loss sums the leaves through a token: the shared token's term enters twice."""
    from arbor.train.packing import pack_trees

    tree = two_leaf_tree()
    algorithm = Config().algorithm
    algorithm = replace(algorithm, distill=DistillConfig(teacher=TeacherConfig(model="t"), coef=1.0))
    advantages = batch_advantages([tree], algorithm)
    assert advantages == [[[-0.5, 1.0], [-0.5, 0.0, 0.0]]]
    (pack,) = pack_trees([tree], advantages, pack_tokens=64)
    shared = pack.input_ids.tolist().index(10)
    assert float(pack.adv_neg[shared]) == pytest.approx(-1.0)  # −0.5 from each of the two leaves


@pytest.fixture(scope="module")
def teacher_url(tmp_path_factory):
    model = build_tiny_model_dir(tmp_path_factory.mktemp("teacher") / "m", seed=3)
    engine = LocalEngine(model)
    with ServerThread(engine) as url:
        yield url, engine
    engine.shutdown()


def branching_tree(seed: int) -> RolloutTree:
    """A prompt of 6 tokens, 2 children of 3 tokens, each with 2 leaves of 2 tokens."""
    tree = RolloutTree([5 + seed, 6, 7, 8, 9, 10], {"id": f"p{seed}"})
    for i in range(2):
        mid = tree.add_segment(tree.root, [20 + i, 21, 22], logprobs=[-1.0] * 3)
        for j in range(2):
            tree.add_segment(mid, [30 + j, 31 + seed], logprobs=[-1.0] * 2)
    return tree


def test_trees_are_scored_node_by_node_as_every_leaf_alone_would_be(teacher_url):
    url, engine = teacher_url
    trees = [branching_tree(0), branching_tree(1)]

    async def main():
        async with SGLangClient(url) as client:
            await client.flush_cache()
            stats = await score_trees(client, trees, temperature=0.8)
            await client.flush_cache()
            alone = await client.score_many([ScoreRequest(t.prompt_ids + t.response_ids(leaf), start=len(t.prompt_ids),
                                                          temperature=0.8) for t in trees for leaf in t.leaves()])
            return stats, alone

    stats, alone = asyncio.run(main())
    leaves = [(t, leaf) for t in trees for leaf in t.leaves()]
    for (tree, leaf), out in zip(leaves, alone):
        scored = [lp for node in tree.path(leaf) for lp in node.teacher_logprobs]
        assert scored == pytest.approx(out.logprobs, abs=1e-5)
    # per tree: the prompt once (6), each node's tokens + the one before them: 2 × (3 + 1) + 4 × (2 + 1)
    assert stats.computed_tokens == 2 * (6 + 8 + 12)
    assert stats.linearised_tokens == linearised_tokens(trees) == 2 * 4 * (6 + 5)
    assert stats.waves == 3 and stats.requests == 2 * (1 + 2 + 4)


def test_config_rules_and_settling(tmp_path):
    cfg = Config()
    with pytest.raises(ConfigError, match="algorithm.distill.teacher"):
        validate(replace(cfg, algorithm=replace(cfg.algorithm, distill=DistillConfig(
            teacher=TeacherConfig(model="a", urls=["http://x"], kind="external")))))
    with pytest.raises(ConfigError, match="algorithm.distill.teacher.kind"):
        validate(replace(cfg, algorithm=replace(cfg.algorithm, distill=DistillConfig(
            teacher=TeacherConfig(urls=["http://x"])))))
    with pytest.raises(ConfigError, match="algorithm.distill.coef"):
        validate(replace(cfg, algorithm=replace(cfg.algorithm, distill=DistillConfig(coef=-1.0))))
    student = build_tiny_model_dir(tmp_path / "s", seed=0)
    distill = DistillConfig(teacher=TeacherConfig(model=str(build_tiny_model_dir(tmp_path / "t", seed=1))))
    cfg = replace(cfg, model=replace(cfg.model, path=str(student)), engine=replace(cfg.engine, kind="embedded"),
                  algorithm=replace(cfg.algorithm, distill=distill))
    settled = settled_distill(cfg, "cpu")
    assert settled.algorithm.distill.teacher.kind == "embedded" and not settled.algorithm.dynamic_sampling
    mixed = replace(cfg, algorithm=replace(cfg.algorithm, distill=replace(distill, reward_weight=1.0)))
    assert settled_distill(mixed, "cpu").algorithm.dynamic_sampling


def test_a_tokenizer_mismatch_names_both_models(tmp_path):
    from transformers import AutoTokenizer

    student = build_tiny_model_dir(tmp_path / "s", seed=0)
    other = tmp_path / "other"
    tok = AutoTokenizer.from_pretrained(student)
    tok.add_tokens(["<extra-token>"])
    build_tiny_model_dir(other, seed=0)
    tok.save_pretrained(other)
    check_same_tokenizer(str(student), str(student))
    with pytest.raises(ConfigError, match=f"teacher {other}.*model.path {student}"):
        check_same_tokenizer(str(student), str(other))


def test_a_teacher_that_stops_answering_stops_the_run_naming_it(tmp_path):
    """An external teacher (an arbor serve in a thread): scores, then, once it is gone, the step
    stops with EngineFailedError naming the teacher (what `arbor train` reports and exits on)."""
    from types import SimpleNamespace

    from arbor.run.recovery import EngineFailedError
    from arbor.run.teacher import Teacher

    model = build_tiny_model_dir(tmp_path / "t", seed=2)
    engine = LocalEngine(model)
    server = ServerThread(engine)
    url = server.__enter__()
    cfg = Config()
    cfg = replace(cfg, engine=replace(cfg.engine, kind="embedded", max_retries=0), algorithm=replace(
        cfg.algorithm, distill=DistillConfig(teacher=TeacherConfig(kind="external", urls=[url]))))
    teacher = Teacher(cfg, SimpleNamespace(teacher_options=None, engine_options=None), str(tmp_path / "logs"))
    teacher.wait_started()
    tree = branching_tree(0)
    metrics = teacher.score([tree], temperature=1.0)
    assert metrics["distill/teacher_tokens"] < metrics["distill/linearised_tokens"]
    assert all(node.teacher_logprobs is not None for node in tree.nodes() if node.parent is not None)
    server.__exit__(None, None, None)
    engine.shutdown()
    with pytest.raises(EngineFailedError, match="algorithm.distill.teacher"):
        teacher.score([branching_tree(1)], temperature=1.0)
    teacher.shutdown()
