"""The `arbor` command: help, config validation, exit codes (run as a real subprocess)."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def arbor(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "arbor", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_help_lists_subcommands():
    out = arbor("--help")
    assert out.returncode == 0
    for command in ("train", "sft", "eval", "serve", "view", "config"):
        assert command in out.stdout


def test_typo_exits_nonzero_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs/math.yaml").read_text().replace("clip_high:", "clip_hihg:"))
    out = arbor("train", str(bad))
    assert out.returncode != 0
    assert "clip_hihg" in out.stderr
    out = arbor("train", "configs/math.yaml", "loss.clip_hihg=0.3")
    assert out.returncode != 0 and "clip_hihg" in out.stderr


def test_good_config_prints_resolved_form():
    out = arbor("config", "configs/math.yaml", "loss.clip_high=0.3")
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["loss"]["clip_high"] == 0.3
    assert resolved["rollout"]["segment_tokens"] == 512
    assert resolved["learner"]["zero_stage"] == 3
    # What the deepspeed launcher appends is accepted (ranks read LOCAL_RANK); other flags are not.
    out = arbor("config", "configs/math.yaml", "--dry-run", "--local_rank=1")
    assert out.returncode == 0, out.stderr
    out = arbor("sft", "configs/math.yaml", "--dry-run", "--verbose")
    assert out.returncode == 2 and "--verbose" in out.stderr


def test_dry_run_passes_the_quickstart_with_one_verdict_line():
    out = arbor("train", "configs/quickstart.yaml", "--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1].startswith("arbor train --dry-run: READY: ") and "nothing was started" in lines[-1]
    checks = lines[:-1]
    assert all(line.startswith("ok    ") for line in checks), checks
    for key in ("reward.functions", "data.train_path: data/arith/train.jsonl: 426 problems",
                "data.eval_path", "learner.device: cpu", "engine.kind: embedded", "model context"):
        assert any(key in line for line in checks), (key, checks)


@pytest.mark.skipif(torch_cuda(), reason="checks the refusal on a machine without CUDA")
def test_dry_run_reports_what_cannot_run_here(tmp_path):
    out_dir = tmp_path / "run"
    out = arbor("train", "configs/quickstart.yaml", "--dry-run", "learner.device=cuda", "engine.kind=sglang",
                f"engine.python={tmp_path / 'no-such-python'}", f"data.train_path={tmp_path / 'missing.jsonl'}",
                "data.max_prompt_tokens=600", f"run.output_dir={out_dir}")
    assert out.returncode == 2
    lines = out.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAIL  ")]
    assert lines[-1] == "arbor train --dry-run: NOT READY: 4 of 6 checks failed (FAIL above); nothing was started"
    assert any(f"data.train_path: {tmp_path / 'missing.jsonl'}: no such file" in line for line in failed), failed
    assert any("learner.device is cuda, but no CUDA device is visible" in line for line in failed), failed
    assert any("engine.python" in line and "cannot import sglang" in line for line in failed), failed
    assert any("data.max_prompt_tokens + rollout.max_depth × rollout.segment_tokens" in line for line in failed), failed
    assert not out_dir.exists()  # a dry run writes nothing


def test_data_errors_are_one_line_naming_the_key(tmp_path):
    missing = tmp_path / "missing.jsonl"
    out = arbor("train", "configs/quickstart.yaml", f"data.train_path={missing}", f"run.output_dir={tmp_path / 'run'}")
    assert out.returncode == 2
    assert out.stderr.strip() == f"arbor train: config error: data.train_path: {missing}: no such file or directory"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "1+1?", "answer": "2"}\n{"id": "b", "question": "x"}\n')
    out = arbor("train", "configs/quickstart.yaml", "--dry-run", f"data.train_path={bad}")
    assert out.returncode == 2
    assert f"FAIL  {bad}:2 (problem 'b'): row has no 'prompt' column (data.prompt_key)" in out.stdout
    out = arbor("eval", "configs/quickstart.yaml", "--dry-run", "data.eval_path=null", "run.eval_every=0")
    assert out.returncode == 2 and "FAIL  eval.path: arbor eval has no set to evaluate" in out.stdout


def test_a_generated_set_passes_the_start_up_file_check():
    """`data.train_path: reasoning_gym:NAME` names no file: the check before Ray starts lets it
    through (the set is generated and checked when it loads); a missing file still stops."""
    from arbor.config_load import load_config
    from arbor.errors import ConfigError
    from arbor.run.startup import check_problem_files

    cfg = load_config(REPO / "configs" / "env_reasoning_gym.yaml")
    assert cfg.data.train_path.startswith("reasoning_gym:")
    check_problem_files(cfg, "train")
    with pytest.raises(ConfigError, match="data.train_path: nowhere.jsonl: no such file"):
        check_problem_files(load_config(REPO / "configs" / "env_reasoning_gym.yaml", ["data.train_path=nowhere.jsonl"]),
                            "train")


def test_bad_reward_function_name_fails_naming_the_key():
    out = arbor("config", "configs/math.yaml", "reward.functions=[{fn: rewards/math.py:boxd_accuracy}]")
    assert out.returncode == 2
    assert "reward.functions[0].fn" in out.stderr and "boxd_accuracy" in out.stderr


def test_reward_specs_resolve_from_another_directory(tmp_path):
    # Relative specs are looked up beside the config file too, not only in the cwd.
    out = arbor("config", str(REPO / "configs/math.yaml"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr


def test_bad_agent_fails_at_start_naming_the_key(tmp_path):
    out = arbor("train", "configs/quickstart.yaml", "--dry-run", "rollout.agent=agents/single_turn.py:Nope")
    assert out.returncode == 2 and "FAIL  rollout.agent" in out.stdout and "Nope" in out.stdout
    out = arbor("train", "configs/quickstart.yaml", "rollout.agent=agents/single_turn.py:Nope")
    assert out.returncode == 2 and "rollout.agent" in out.stderr and "Nope" in out.stderr
    out = arbor("config", "configs/quickstart.yaml", "rollout.agent=agents/single_turn.py:SingleTurn")
    assert out.returncode == 0, out.stderr


def test_dry_run_says_which_environment_it_checked_and_the_ledger_needs_no_prompt_column():
    """envs/ledger.py, the docs' environment, writes its own prompt and gives the reward: its
    problems (ids only) load without a prompt or answer column, and --dry-run names what it built."""
    out = arbor("train", "configs/quickstart.yaml", "--dry-run", "rollout.env=envs/ledger.py:Ledger",
                "reward.functions=[]", "data.train_path=data/env/ledger.jsonl", "data.eval_path=null", "run.eval_every=0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok    rollout.env: envs/ledger.py:Ledger: builds, has reset() and step(), forks by copy, gives a reward" \
        in out.stdout
    assert "ok    reward.functions: none (the environment gives the reward)" in out.stdout
    assert "ok    data.train_path: data/env/ledger.jsonl: 256 problems" in out.stdout
    # With a reward function the answer column is needed: the ids-only rows fail, naming it.
    out = arbor("train", "configs/quickstart.yaml", "--dry-run", "rollout.env=envs/ledger.py:Ledger",
                "data.train_path=data/env/ledger.jsonl", "data.eval_path=null", "run.eval_every=0")
    assert out.returncode == 2 and "row has no 'answer' column (data.answer_key)" in out.stdout, out.stdout
    # Without an environment both are needed, named in one message.
    out = arbor("train", "configs/quickstart.yaml", "--dry-run", "data.train_path=data/env/ledger.jsonl",
                "data.eval_path=null", "run.eval_every=0")
    assert "row has no 'prompt' column (data.prompt_key) and no 'answer' column (data.answer_key)" in out.stdout, out.stdout
