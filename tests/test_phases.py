"""rollout_metrics and throughput_metrics: a step's reward, tree, rollout-cost and speed metrics from hand-made trees."""

import pytest

from arbor.rollout.sample_stats import SampleStats
from arbor.run.phases import Batch, rollout_metrics, throughput_metrics, working_seconds
from arbor.tree import RolloutTree


def tree(rewards: list[float]) -> RolloutTree:
    t = RolloutTree([1, 2], problem={"id": "p"})
    stem = t.add_segment(t.root, [3, 4], logprobs=[-1.0, -1.0])
    for r in rewards:
        leaf = t.add_segment(stem, [5], logprobs=[-1.0])
        leaf.finish_reason, leaf.reward = "stop", r
    return t


def test_rollout_metrics_by_hand():
    a, b = tree([1.0, 0.0]), tree([0.0, 0.0])
    stats = [SampleStats(leaves=2, rounds=3, fallbacks=2, root_restarts=0, tokens_generated=4),
             SampleStats(leaves=2, rounds=5, fallbacks=0, root_restarts=1, tokens_generated=4)]
    batch = Batch(trees=[a], sampled=[a, b], stats=stats, correct=[True, False, False, False], rounds=2,
                  requests=9)
    m = rollout_metrics(batch)
    assert m["reward/mean"] == pytest.approx(0.25)
    assert m["reward/accuracy"] == pytest.approx(0.25)
    assert m["rollout/trees"] == 2 and m["rollout/trees_trained"] == 1 and m["rollout/refill_rounds"] == 1
    assert m["rollout/fallbacks"] == 2 and m["rollout/root_restarts"] == 1
    assert m["rollout/rounds_per_tree"] == pytest.approx(4.0)
    assert m["rollout/tokens_generated"] == 8
    assert m["rollout/requests"] == 9
    assert m["response/length_mean"] == pytest.approx(3.0)  # 2 + 1 response tokens per leaf
    # Each tree: 2 leaves of 5 tokens linearised (10) over 6 unique (prompt 2, stem 2, 1 + 1).
    assert m["tree/sharing_ratio"] == pytest.approx(10 / 6)


def test_throughput_counts_the_steps_own_phases_not_the_eval():
    a, b = tree([1.0, 0.0]), tree([0.0, 0.0])
    batch = Batch(trees=[a], sampled=[a, b], stats=[SampleStats(tokens_generated=30), SampleStats(tokens_generated=10)])
    phases = {"rollout": 3.0, "reward": 0.5, "train": 4.0, "sync": 0.5}
    plain = throughput_metrics(batch, phases)
    assert plain == {"throughput/trajectories_per_s": 4 / 8.0, "throughput/tokens_per_s": 40 / 8.0}
    # A step that also evaluated (20 s of other problems) trained just as fast.
    assert working_seconds(phases | {"eval": 20.0}) == 8.0
    assert throughput_metrics(batch, phases | {"eval": 20.0}) == plain
