"""Asynchronous RL's pieces: the staleness bound, version tags, partial rollouts on a real
engine, and the decoupled loss on paths whose segments came from two weight versions."""

from __future__ import annotations

import pytest
import torch
from tiny_model import build_tiny_model_dir

from arbor.config import RolloutConfig
from arbor.engines.embedded.engine import LocalEngine
from arbor.engines.types import GenerateOutput, GenerateRequest
from arbor.rollout.batching import MAX_RESAMPLE_ROUNDS, ResampleLimitError
from arbor.rollout.sampler import sample_trees_sync
from arbor.run.async_rollouts import drop_stale, updates_since, version_number
from arbor.train.logprobs import padded_token_logprobs
from arbor.train.packed_loss import pack_loss, padded_token_fields
from arbor.train.packing import loss_denominator, pack_trees
from arbor.tree import RolloutTree

PROMPT = [17, 42, 99, 5, 63, 120, 7, 88]
CFG = RolloutConfig(width=4, branch=2, segment_tokens=4, max_depth=3)


def tree_with_versions(*versions: str) -> RolloutTree:
    """A chain of one-token segments sampled under ``versions`` (root first)."""
    tree, node = RolloutTree([1, 2]), None
    for i, version in enumerate(versions):
        node = tree.add_segment(node or tree.root, [10 + i], [-0.5])
        node.weight_version = version
    return tree


def test_version_labels_are_the_steps_that_pushed_them():
    assert version_number("default") == 0 and version_number(None) == 0 and version_number("7") == 7
    with pytest.raises(ValueError, match="weight version 'v2' is not a step number.*max_staleness"):
        version_number("v2")


def test_a_tree_is_as_old_as_its_oldest_segment_and_trees_past_the_bound_are_dropped():
    pushed = [1, 2, 3]  # weights of steps 1, 2, 3 were pushed; step 4 trains now
    fresh, mixed, old = tree_with_versions("3"), tree_with_versions("3", "2"), tree_with_versions("1", "3")
    assert [updates_since(t, pushed) for t in (fresh, mixed, old)] == [0, 1, 2]
    assert updates_since(tree_with_versions("default"), []) == 0  # a fresh run's engines
    kept, ages = drop_stale([fresh, mixed, old], pushed, max_staleness=1)
    assert kept == [fresh, mixed] and ages == [0, 1]  # `old` (2 updates) is dropped
    assert drop_stale([old], pushed, max_staleness=2) == ([old], [2])
    # Steps without an update (nothing to learn) push nothing: labels 1 and 3 are one update apart.
    assert updates_since(tree_with_versions("1"), [1, 3]) == 1


def test_environment_turns_carry_no_version_and_do_not_age_a_tree():
    # A multi-turn tree: model turn (step 3's weights), an environment turn (no version: the
    # environment wrote it), another model turn. Read as version 0, the environment's node made
    # every such tree 3 updates old, and an asynchronous run dropped all of them.
    tree = tree_with_versions("3")
    model_turn = next(tree.nodes())
    env_turn = tree.add_segment(model_turn, [20, 21], [0.0, 0.0], [0, 0])
    tree.add_segment(env_turn, [22], [-0.1]).weight_version = "3"
    assert env_turn.weight_version is None
    assert updates_since(tree, [1, 2, 3]) == 0
    assert drop_stale([tree], [1, 2, 3], max_staleness=1) == ([tree], [0])
    # The sampled nodes still decide: an older model turn ages the tree as before.
    model_turn.weight_version = "1"
    assert updates_since(tree, [1, 2, 3]) == 2
    # A tree with no sampled node at all (an environment's reset only) is not old.
    only_env = RolloutTree([1])
    only_env.add_segment(only_env.root, [5], [0.0], [0])
    assert updates_since(only_env, [1, 2, 3]) == 0


def test_mixed_version_tags_round_trip_through_json():
    tree = tree_with_versions("default", "4", "5")
    again = RolloutTree.from_json(tree.to_json())
    assert [n.weight_version for n in again.nodes()] == ["default", "4", "5"]


class UpdateAfterFirstRound:
    """A real engine whose weights change while the first round's segments are in flight
    (they come back sampled by the old ones): what an asynchronous run's push does.
    ``updates``: the first that many calls are each overtaken by a push (versions 1, 2, ...)."""

    def __init__(self, engine: LocalEngine, updates: int = 1) -> None:
        self.engine, self.calls, self.updates = engine, 0, updates
        self.start = {k: v.clone() for k, v in engine.model.state_dict().items()}

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        outs = await self.engine.generate(request)
        self.calls += 1
        if self.calls <= self.updates:
            new_state = {k: v + 0.05 * self.calls for k, v in self.start.items()}
            self.engine.load_weights(new_state, str(self.calls))
        return outs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("async") / "model", seed=0)


def test_without_partial_rollouts_in_flight_segments_keep_the_old_version(model_dir):
    engine = LocalEngine(model_dir)
    try:
        (tree,), (stats,) = sample_trees_sync(UpdateAfterFirstRound(engine), [None], [PROMPT], CFG, seed=0)
    finally:
        engine.shutdown()
    by_depth = {n.depth: n.weight_version for n in tree.nodes()}
    assert by_depth[1] == "default" and by_depth.get(2) == "1"  # one path, two versions
    assert stats.resampled == 0


def test_partial_rollouts_sample_overtaken_segments_again_under_the_new_weights(model_dir):
    engine = LocalEngine(model_dir)
    try:
        (tree,), (stats,) = sample_trees_sync(
            UpdateAfterFirstRound(engine), [None], [PROMPT], CFG, seed=0,
            is_stale=lambda version: version_number(version) < version_number(engine.weight_version),
        )
    finally:
        engine.shutdown()
    assert {n.weight_version for n in tree.nodes()} == {"1"}
    assert stats.resampled == CFG.branch  # the root's two forks came back stale, once
    assert len(tree.leaves()) == CFG.width


def test_partial_rollouts_count_every_time_a_segment_is_overtaken(model_dir):
    # Two pushes in a row: the root's forks come back stale, and their resample too.
    engine = LocalEngine(model_dir)
    try:
        (tree,), (stats,) = sample_trees_sync(
            UpdateAfterFirstRound(engine, updates=2), [None], [PROMPT], CFG, seed=0,
            is_stale=lambda version: version_number(version) < version_number(engine.weight_version),
        )
    finally:
        engine.shutdown()
    assert {n.weight_version for n in tree.nodes()} == {"2"}
    assert stats.resampled == 2 * CFG.branch



def test_resampling_gives_up_with_a_named_error_when_every_round_is_overtaken(model_dir):
    """Weights pushed during every generation: after MAX_RESAMPLE_ROUNDS resends the
    sampler stops with an error naming the problem, rather than looping for ever."""
    engine = LocalEngine(model_dir)
    racing = UpdateAfterFirstRound(engine, updates=10 * MAX_RESAMPLE_ROUNDS)
    try:
        with pytest.raises(ResampleLimitError, match=rf"problem 7: 1 request\(s\) still overtaken by a weight "
                                                     rf"update after {MAX_RESAMPLE_ROUNDS} resample rounds"):
            sample_trees_sync(racing, [{"id": 7}], [PROMPT], CFG, seed=0,
                              is_stale=lambda version: version_number(version) < version_number(engine.weight_version))
    finally:
        engine.shutdown()
    assert racing.calls == MAX_RESAMPLE_ROUNDS + 1  # the first send and each resend, then no more

def test_the_decoupled_loss_weights_each_token_by_its_own_sampler(model_dir):
    """Paths mixing two versions: the packed loss equals −Σ min(π/π_behav, C)·A / denominator,
    π_behav per token (u = 1: the proximal policy is the one being trained)."""
    from transformers import AutoModelForCausalLM

    engine = LocalEngine(model_dir)
    try:
        (tree,), _ = sample_trees_sync(UpdateAfterFirstRound(engine), [None], [PROMPT], CFG, seed=0)
    finally:
        engine.shutdown()
    assert len({n.weight_version for n in tree.nodes()}) == 2
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)  # the old weights
    advantages = [[1.0, -0.5, 2.0, -1.0][: len(tree.leaves())]]
    denominator = loss_denominator([tree], "token")
    loss = sum(pack_loss(model, pack, denominator, behaviour_cap=1.5)[0]
               for pack in pack_trees([tree], advantages, normalize="token"))
    logp, _, _ = padded_token_logprobs(model, [tree])
    f = padded_token_fields([tree], advantages, "token")
    mask, old = torch.tensor(f["mask"], dtype=torch.bool), torch.tensor(f["old"], dtype=torch.float64)
    adv = torch.tensor(f["pos"], dtype=torch.float64) + torch.tensor(f["neg"], dtype=torch.float64)
    weight = torch.exp(logp.detach() - old).clamp(max=1.5)
    expected = -(weight * adv)[mask].sum() / denominator
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-9)
    # The sampled tokens of the second version came from other weights: their weights are not 1.
    assert (weight[mask] - 1).abs().max() > 1e-3


def test_the_quickstart_as_shipped_trains_every_step_with_the_producer_ahead(tmp_path):
    """`arbor train configs/quickstart.yaml` (asynchronous, max_staleness 1; DeepSpeed, Ray, the
    embedded engine) for 4 steps on 8 problems a step: every step from the second trains trees
    sampled one update before (the producer overlapped), and the command says nothing dropped."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from async_checks import check_async_trained

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "quickstart"
    done = subprocess.run([sys.executable, "-m", "arbor", "train", "configs/quickstart.yaml", "run.steps=4",
                           "data.prompts_per_step=8", "run.eval_every=0", "run.save_every=0", f"run.output_dir={out}"],
                          cwd=repo, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    check_async_trained(history, max_staleness=1)
    assert "note:" not in done.stdout  # no step dropped or failed anything
    assert (out / "arbor.log").exists()
