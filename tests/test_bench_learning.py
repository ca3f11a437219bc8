"""scripts/bench_learning.py: its figures by hand, and a smoke run of both arms through the real trainer."""

import csv
import math
import re
import subprocess
import sys

from script_loader import REPO, load_script


def _script():
    return load_script("bench_learning")


def test_time_to_accuracy_interpolates_between_evals():
    script = _script()
    points = [(0, 0.0, 0, 0.2), (4, 10.0, 0, 0.3), (8, 20.0, 0, 0.5)]
    assert script.time_to_accuracy(points, 0.2) == 0.0  # already there at the start
    assert script.time_to_accuracy(points, 0.3) == 10.0
    assert script.time_to_accuracy(points, 0.4) == 15.0  # halfway from 0.3 (10 s) to 0.5 (20 s)
    assert script.time_to_accuracy(points, 0.6) == math.inf


def test_seed_figures_take_the_lower_final_accuracy_as_the_target():
    script = _script()
    tree = script.Curve("tree", 0, [(0, 0.0, 0, 0.2), (5, 10.0, 0, 0.4), (10, 20.0, 0, 0.5)], steps=10, train_s=20.0)
    grpo = script.Curve("grpo", 0, [(0, 0.0, 0, 0.2), (4, 10.0, 0, 0.3), (8, 20.0, 0, 0.4)], steps=8, train_s=20.0)
    figures = script.seed_figures(tree, grpo)
    # Target 0.4 (GRPO's final): GRPO at 20 s, the tree at 10 s; steps of 2.5 s vs 2.0 s.
    assert figures["target"] == 0.4 and figures["time_to_acc_ratio"] == 2.0
    assert figures["step_speedup"] == 1.25
    assert (figures["final_acc_tree"], figures["final_acc_grpo"]) == (0.5, 0.4)
    # Neither arm rose above the start: no time to compare.
    flat = script.Curve("grpo", 0, [(0, 0.0, 0, 0.2), (8, 20.0, 0, 0.2)], steps=8, train_s=20.0)
    assert math.isnan(script.seed_figures(tree, flat)["time_to_acc_ratio"])


def test_smoke_run_trains_the_arms_and_writes_csv_plots_and_result(tmp_path):
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench_learning.py"), "--budget-s", "1", "--seeds", "1", "--evals", "1",
         "--arms", "tree,grpo,entropy_treerl", "--out", str(tmp_path), "--tree-override", "rollout.width=4",
         "data.prompts_per_step=2", "eval.max_problems=4", "algorithm.dynamic_sampling=false",
         "rollout.segment_tokens=8", "rollout.max_depth=2", "eval.max_response_tokens=16",
         "reward.workers=1"],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^RESULT time_to_acc_ratio=\S+ final_acc_tree=[\d.]+ final_acc_grpo=[\d.]+ step_speedup=[\d.]+ "
                     r"time_to_80pct_ratio=\S+ time_to_80pct_ratio_entropy_treerl=\S+ final_acc_entropy_treerl=[\d.]+ "
                     r"auc_tree=[\d.]+ auc_grpo=[\d.]+ auc_entropy_treerl=[\d.]+$", run.stdout, re.M), run.stdout
    assert re.search(r"^SPREAD time_to_acc_ratio=\S+ final_acc_tree=[\d.]+ .* time_to_80pct_ratio=\S+ ", run.stdout, re.M)
    assert re.search(r"^SIGNAL signal_tree=[\d.]+ tokens_per_step_tree=\d+ signal_grpo=[\d.]+ ", run.stdout, re.M)
    sharing = re.search(r"^SHARING cached_ratio_tree=([\d.]+) tokens_per_step_tree=\d+ seconds_per_step_tree=[\d.]+ "
                        r"cached_ratio_grpo=([\d.]+) ", run.stdout, re.M)
    assert sharing and all(0 <= float(r) <= 1 for r in sharing.groups()), run.stdout
    rows = list(csv.DictReader((tmp_path / "curves.csv").open()))
    by_arm = {arm: [r for r in rows if r["arm"] == arm] for arm in ("tree", "grpo", "entropy_treerl")}
    for arm_rows in by_arm.values():
        # The start eval, then at least one after the budget ran out (one step at least).
        assert len(arm_rows) >= 2 and arm_rows[0]["step"] == "0" and int(arm_rows[-1]["step"]) >= 1
        assert float(arm_rows[-1]["train_s"]) >= 1.0 and int(arm_rows[-1]["tokens_computed"]) > 0
    # Every arm starts from the same model, evaluated greedily on the same problems.
    assert by_arm["tree"][0]["greedy_accuracy"] == by_arm["grpo"][0]["greedy_accuracy"]
    steps = list(csv.DictReader((tmp_path / "steps.csv").open()))
    assert {r["arm"] for r in steps} == {"tree", "grpo", "entropy_treerl"}
    assert all(0.0 <= float(r["signal_leaves"]) <= 1.0 and int(r["step_tokens"]) > 0 for r in steps)
    for name in ("accuracy_vs_seconds.png", "accuracy_vs_tokens.png", "signal_vs_step.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Each arm's run used its own sampler, advantage and loss mode.
    tree_cfg = (tmp_path / "tree-seed0" / "config.yaml").read_text()
    grpo_cfg = (tmp_path / "grpo-seed0" / "config.yaml").read_text()
    entropy_cfg = (tmp_path / "entropy_treerl-seed0" / "config.yaml").read_text()
    assert "mode: independent" in grpo_cfg and "advantage: grpo" in grpo_cfg and "mode: linear" in grpo_cfg
    assert "mode: tree" in tree_cfg and "advantage: treepo" in tree_cfg and "fork_at: segment" in tree_cfg
    assert "fork_at: entropy" in entropy_cfg and "advantage: treerl" in entropy_cfg
    # --tree-override reaches the tree arms only (cot.yaml's width is 8).
    assert "width: 4" in tree_cfg and "width: 4" in entropy_cfg and "width: 8" in grpo_cfg


def test_time_to_80pct_ratio_by_hand():
    script = _script()
    # GRPO 0.2 -> 0.6: target 0.2 + 0.8 x 0.4 = 0.52, reached at 10 + (0.52 - 0.4) / 0.2 x 10 = 16 s.
    grpo = script.Curve("grpo", 0, [(0, 0.0, 0, 0.2), (4, 10.0, 0, 0.4), (8, 20.0, 0, 0.6)])
    # A tree arm at 0.6 by 10 s: 0.52 at 0.32 / 0.4 x 10 = 8 s -> ratio 16 / 8 = 2.
    fast = script.Curve("tree", 0, [(0, 0.0, 0, 0.2), (5, 10.0, 0, 0.6), (9, 20.0, 0, 0.5)])
    assert math.isclose(script.time_to_80pct_ratio(fast, grpo), 2.0)
    # Never reaching 0.52 counts 0; GRPO's own ratio is 1; GRPO not improving gives nan.
    slow = script.Curve("tree", 0, [(0, 0.0, 0, 0.2), (5, 20.0, 0, 0.5)])
    assert script.time_to_80pct_ratio(slow, grpo) == 0.0
    assert script.time_to_80pct_ratio(grpo, grpo) == 1.0
    flat = script.Curve("grpo", 0, [(0, 0.0, 0, 0.2), (8, 20.0, 0, 0.2)])
    assert math.isnan(script.time_to_80pct_ratio(fast, flat))
    # The median over seeds skips nan seeds: [0, 2, nan, 3] -> median of [0, 2, 3] = 2.
    assert script.median([0.0, 2.0, math.nan, 3.0]) == 2.0 and script.median([1.0, 3.0]) == 2.0
    assert math.isnan(script.median([math.nan]))


def test_area_under_accuracy_by_hand():
    script = _script()
    # 0.2 -> 0.4 over 10 s (area 3), then 0.4 held to the 20 s budget (area 4): 7 / 20 = 0.35.
    assert math.isclose(script.area_under_accuracy([(0, 0.0, 0, 0.2), (4, 10.0, 0, 0.4)], 20.0), 0.35)
    # An eval past the budget is cut there: 0.2 -> 0.6 over 0..20 s, cut at 10 s (0.4): area 3 / 10.
    assert math.isclose(script.area_under_accuracy([(0, 0.0, 0, 0.2), (9, 20.0, 0, 0.6)], 10.0), 0.3)
    # The arm figures: tokens per step and the share of leaves with a signal, means over steps.
    arm = script.Curve("entropy", 0, [(0, 0.0, 0, 0.2), (2, 10.0, 0, 0.6)], steps=2, train_s=10.0,
                       signals=[0.25, 0.75], step_tokens=[100.0, 300.0])
    grpo = script.Curve("grpo", 0, [(0, 0.0, 0, 0.2), (2, 10.0, 0, 0.6)], steps=2, train_s=10.0)
    figures = script.arm_figures(arm, grpo, 10.0)
    assert figures["signal"] == 0.5 and figures["tokens_per_step"] == 200.0 and figures["seconds_per_step"] == 5.0
    assert math.isclose(figures["auc"], 0.4) and figures["time_to_80pct_ratio"] == 1.0


def test_trailing_means_and_the_training_reward_ratio_by_hand():
    script = _script()
    rewards = [(1.0, 0.1), (2.0, 0.3), (3.0, 0.5), (4.0, 0.9)]
    # Window 2 s: at 2 s the steps ending in (0, 2] -> 0.2; at 3 s (1, 3] -> 0.4; at 4 s (2, 4] -> 0.7.
    assert script.trailing_means(rewards, 2.0) == [(0, 2.0, 0, 0.2), (0, 3.0, 0, 0.4), (0, 4.0, 0, 0.7)]
    assert script.trailing_means(rewards, 5.0) == []  # no step past one window yet
    tree = script.Curve("tree", 0, [(0, 0.0, 0, 0.2), (4, 4.0, 0, 0.5)], rewards=rewards, steps=4, train_s=4.0)
    # GRPO's smoothed reward: 0.2 at 2 s, 0.3 at 4 s, 0.6 at 6 s (one step every 2 s).
    grpo = script.Curve("grpo", 0, [(0, 0.0, 0, 0.2), (3, 6.0, 0, 0.5)],
                        rewards=[(2.0, 0.2), (4.0, 0.3), (6.0, 0.6)], steps=3, train_s=6.0)
    figures = script.seed_figures(tree, grpo, window_s=2.0)
    # Target: the lower final smoothed reward, 0.6 (GRPO), reached by GRPO at 6 s and by the
    # tree at 3 + (0.6 - 0.4) / (0.7 - 0.4) = 3.667 s: ratio 6 / 3.667 = 1.636.
    assert math.isclose(figures["reward_time_ratio"], 6.0 / (3.0 + 0.2 / 0.3))
    # No smoothed point (window longer than either run): no ratio.
    assert math.isnan(script.seed_figures(tree, grpo, window_s=10.0)["reward_time_ratio"])
