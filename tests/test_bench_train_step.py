"""scripts/bench_train_step.py's ideal step speed-up, by hand."""

import pytest
from test_bench_packing import load_script


def record(bench, rollout, train, reward, computed, forwarded):
    seconds = {"rollout": rollout, "reward": reward, "advantage": 0.0, "pack": 0.5, "train": train}
    return bench.StepRecord(seconds=seconds, cpu=dict.fromkeys(seconds, 0.0), rollout_computed=computed,
                            train_tokens=forwarded, trained_tokens=0, trajectories=16, response_tokens=100,
                            eos_leaves=0, packs=1, reward_mean=0.0)


def test_ideal_scales_rollout_and_training_by_their_token_ratios():
    bench = load_script("bench_train_step")
    # Linear: rollout 4 s for 3,000 tokens, train 6 s for 9,000, reward 1 s, pack 0.5 s: 11.5 s.
    # Tree: 2,000 tokens computed (ratio 1.5), 3,000 forwarded (ratio 3): ideally
    # 4/1.5 + 6/3 + 1 + 0.5 = 6.1667 s, so the ideal speed-up is 11.5 / 6.1667 = 1.865.
    linear = [record(bench, 4.0, 6.0, 1.0, 3000, 9000)]
    tree = [record(bench, 9.0, 9.0, 9.0, 2000, 3000)]  # the tree's own seconds do not enter
    assert bench.ideal_step_speedup(tree, linear) == pytest.approx(11.5 / (4 / 1.5 + 2 + 1 + 0.5))
