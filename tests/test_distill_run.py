"""`arbor train configs/distill.yaml` end to end on CPU: the teacher is an `arbor serve` of its
own placed by Ray, scores every step's trees node by node (fewer tokens than leaf by leaf), and
its per-token term trains the student; synchronous, asynchronous, and with LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest

from arbor.config_load import load_config
from arbor.run.trainer import train

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("overrides", [
    [],
    ["algorithm.max_staleness=1"],
    ["model.lora_rank=4", "optim.lr=2e-3", "algorithm.distill.reward_weight=1.0", "algorithm.distill.kind=k3",
     "algorithm.dynamic_sampling=false"],
], ids=["synchronous", "asynchronous", "lora-mixed-k3"])
def test_distill_yaml_runs_and_scores_each_prefix_once(tmp_path, monkeypatch, overrides):
    monkeypatch.chdir(REPO)
    cfg = load_config(REPO / "configs" / "distill.yaml", [
        "run.steps=2", "data.prompts_per_step=4", "run.eval_every=0", "run.save_trees_every=0",
        f"run.output_dir={tmp_path / 'out'}", "reward.workers=1", *overrides])
    history = train(cfg)
    assert len(history) == 2
    for metrics in history:
        assert 0 < metrics["distill/teacher_tokens"] < metrics["distill/linearised_tokens"]
        assert metrics["distill/teacher_s"] > 0 and metrics["distill/reverse_kl"] == metrics["distill/reverse_kl"]
        assert metrics["rollout/trees_trained"] == 4  # pure distillation (or no filter): every tree trains
    if "algorithm.distill.kind=k3" in overrides:
        assert history[-1]["distill/k3"] >= 0
