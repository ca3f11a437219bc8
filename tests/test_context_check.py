"""Start-up checks against the model: the longest request must fit the model's
context, and prompts longer than data.max_prompt_tokens are skipped and counted, never cut."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from arbor.config import DataConfig
from arbor.config_load import check_context_length, load_config
from arbor.data import DataError
from arbor.errors import ConfigError
from arbor.rollout.agents import fitting_problems
from arbor.run.startup import check_model_context

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def test_budget_beyond_the_context_names_the_keys():
    cfg = load_config(QUICKSTART, ["rollout.max_depth=1000"])
    with pytest.raises(ConfigError) as e:
        check_context_length(cfg, 256, "max_position_embeddings of tiny")
    assert str(e.value) == (
        "data.max_prompt_tokens + rollout.max_depth × rollout.segment_tokens = 64 + 1000 × 8 = 8064 tokens, "
        "more than the model's context of 256 tokens (max_position_embeddings of tiny); lower "
        "rollout.max_depth or rollout.segment_tokens or data.max_prompt_tokens"
    )
    # 64 + 3 × 8 = 88 tokens: exactly at the limit still fits.
    check_context_length(load_config(QUICKSTART), 88, "x")
    with pytest.raises(ConfigError, match="= 89 tokens, more than the model's context of 88"):
        check_context_length(load_config(QUICKSTART, ["data.max_prompt_tokens=65"]), 88, "x")


def test_eval_budgets():
    # arbor train evaluates every run.eval_every steps with eval.max_response_tokens when set.
    cfg = load_config(QUICKSTART, ["eval.max_response_tokens=300"])
    with pytest.raises(ConfigError, match=r"data.max_prompt_tokens \+ eval.max_response_tokens = 64 \+ 300 = 364"):
        check_context_length(cfg, 256, "x")
    check_context_length(load_config(QUICKSTART, ["eval.max_response_tokens=300", "run.eval_every=0"]), 256, "x")
    # arbor eval: only the eval budget counts, the rollout's when eval.max_response_tokens is null.
    check_context_length(load_config(QUICKSTART, ["rollout.max_depth=1000", "eval.max_response_tokens=8"]), 256, "x", "eval")
    with pytest.raises(ConfigError, match=r"rollout.max_depth × rollout.segment_tokens \(eval.max_response_tokens is null\)"):
        check_context_length(load_config(QUICKSTART, ["rollout.max_depth=1000"]), 256, "x", "eval")


def test_the_model_config_and_sglang_context_length_flag(monkeypatch):
    monkeypatch.chdir(REPO)
    check_model_context(load_config(QUICKSTART), "train")  # 88 tokens in tiny-arith's 256
    check_model_context(load_config(REPO / "configs" / "agent_math.yaml"), "train")
    with pytest.raises(ConfigError, match=r"context of 256 tokens \(max_position_embeddings of models/tiny-arith\)"):
        check_model_context(load_config(QUICKSTART, ["rollout.max_depth=1000"]), "train")
    # A server started with --context-length serves that context, whatever the model's config says.
    flag = load_config(QUICKSTART, ["engine.kind=auto", "engine.extra_args=[--context-length, '80']"])
    with pytest.raises(ConfigError, match=r"= 88 tokens, more than the model's context of 80 tokens \(--context-length in engine.extra_args\)"):
        check_model_context(flag, "train")
    check_model_context(load_config(QUICKSTART, ["engine.kind=auto", "engine.extra_args=[--context-length=4096]",
                                                 "rollout.max_depth=100"]), "train")
    with pytest.raises(ConfigError, match="model.path: cannot read the config of"):
        check_model_context(load_config(QUICKSTART, ["model.path=/nonexistent/model"]), "train")


def test_arbor_train_refuses_a_depth_far_beyond_the_tiny_models_context(tmp_path):
    # Its own output_dir: after the README's quickstart, runs/quickstart holds a run, which
    # would be refused first.
    out = subprocess.run([sys.executable, "-m", "arbor", "train", "configs/quickstart.yaml", "rollout.max_depth=1000",
                          f"run.output_dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert ("arbor train: config error: data.max_prompt_tokens + rollout.max_depth × rollout.segment_tokens "
            "= 64 + 1000 × 8 = 8064 tokens, more than the model's context of 256 tokens") in out.stderr


class CharTokenizer:
    """One token per character, no chat template: enough to measure prompts."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def test_long_prompts_are_skipped_and_named_never_cut(caplog):
    problems = [{"id": f"p{i}", "prompt": "x" * n, "answer": "1"} for i, n in enumerate([3, 12, 5, 30])]
    cfg = DataConfig(prompt_suffix="!", max_prompt_tokens=6)
    with caplog.at_level(logging.WARNING, logger="arbor.rollout.agents"):
        kept, skipped = fitting_problems(problems, None, CharTokenizer(), cfg, False, "data.train_path")
    assert [p["id"] for p in kept] == ["p0", "p2"]  # 3+1 and 5+1 tokens: the suffix counts
    assert kept[1] is problems[2]  # untouched, not cut
    assert skipped == ["p1", "p3"]
    (record,) = caplog.records
    assert record.getMessage() == ("data.train_path: skipped 2 of 4 problems whose prompt is longer than "
                                   "data.max_prompt_tokens=6: p1 (13 tokens), p3 (31 tokens)")
    with pytest.raises(DataError, match=r"data.eval_path: every prompt is longer than data.max_prompt_tokens=2 \(the shortest has 4 tokens\)"):
        fitting_problems(problems, None, CharTokenizer(), DataConfig(prompt_suffix="!", max_prompt_tokens=2),
                         False, "data.eval_path")
