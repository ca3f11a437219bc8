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


def test_env_metrics_by_hand_and_only_with_episodes():
    a, b = tree([1.0, 0.0]), tree([0.0, 0.0])
    a.leaves()[0].env_reward, a.leaves()[1].env_reward = 1.0, 0.0
    b.leaves()[0].env_reward = 0.5  # b's other leaf: its environment gave no reward
    stats = [SampleStats(env_forks={"replay": 3}, env_replayed_steps=4, env_episodes=2, env_episode_steps=5,
                         env_errors=1, env_dropped=1),
             SampleStats(env_forks={"replay": 1}, env_timeouts=2, env_episodes=2, env_episode_steps=3, env_live=1)]
    batch = Batch(trees=[a], sampled=[a, b], stats=stats, correct=[False] * 4)
    assert not any(k.startswith("env/") for k in rollout_metrics(batch))  # single-turn: no env metrics
    batch.episodes = True
    m = {k: v for k, v in rollout_metrics(batch).items() if k.startswith("env/")}
    assert m == {
        "env/reward_mean": pytest.approx(0.5), "env/steps_per_episode": 2.0, "env/forks": 4.0,
        "env/forks/copy": 0.0, "env/forks/replay": 4.0, "env/forks/none": 0.0, "env/replayed_steps": 4.0,
        "env/timeouts": 2.0, "env/errors": 1.0, "env/dropped": 1.0, "env/live": 1.0,
        "env/overflow_ended": 0.0, "env/diverged": 0.0,
    }


def test_env_rewards_add_to_the_reward_functions_weighted():
    from arbor.rollout.rewards import RewardPool
    from arbor.run.phases import score_trees

    a = tree([0.0, 0.0])
    a.leaves()[0].env_reward, a.leaves()[1].env_reward = 2.0, -1.0
    batch = Batch(trees=[])
    with RewardPool([], workers=1, timeout_s=1) as pool:  # reward.functions: [] — the environment's reward
        correct = score_trees(pool, str, [a], batch, lambda text: None, env_weight=0.5)
    assert [leaf.reward for leaf in a.leaves()] == [1.0, -0.5] and correct == [True, False]


def test_a_step_that_mostly_ends_at_the_budget_warns_once_naming_the_keys(caplog):
    from arbor.config import RolloutConfig
    from arbor.run.phases import warn_budget

    cut, fine = tree([0.0, 0.0, 0.0]), tree([1.0])
    for leaf in cut.leaves():
        leaf.finish_reason = "max_length"
    batch, warned = Batch(trees=[], sampled=[cut, fine]), [False]
    cfg = RolloutConfig(segment_tokens=8, max_depth=3)
    assert rollout_metrics(batch)["response/max_length"] == 0.75
    warn_budget(batch, cfg, 3, warned)
    assert warned == [True]
    assert ("step 3: 75% of the episodes ended at the response budget, rollout.segment_tokens × rollout.max_depth "
            "= 8 × 3 = 24 tokens (agent and environment messages count against it)") in caplog.text
    warn_budget(batch, cfg, 4, warned)
    assert "step 4" not in caplog.text  # once
    caplog.clear()
    warn_budget(Batch(trees=[], sampled=[fine]), cfg, 5, [False])
    assert caplog.text == ""  # a step whose episodes finished says nothing
