"""The `arbor` command: help, config validation, exit codes (run as a real subprocess)."""

import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def arbor(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "arbor", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


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
    out = arbor("train", "configs/math.yaml", "--dry-run", "loss.clip_high=0.3")
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["loss"]["clip_high"] == 0.3
    assert resolved["rollout"]["segment_tokens"] == 512
    out = arbor("config", "configs/math.yaml")
    assert out.returncode == 0 and yaml.safe_load(out.stdout)["learner"]["zero_stage"] == 3
    # What the deepspeed launcher appends is accepted (ranks read LOCAL_RANK); other flags are not.
    out = arbor("sft", "configs/math.yaml", "--dry-run", "--local_rank=1")
    assert out.returncode == 0, out.stderr
    out = arbor("sft", "configs/math.yaml", "--dry-run", "--verbose")
    assert out.returncode == 2 and "--verbose" in out.stderr


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
    assert out.returncode == 2 and "rollout.agent" in out.stderr and "Nope" in out.stderr
    out = arbor("config", "configs/quickstart.yaml", "rollout.agent=agents/single_turn.py:SingleTurn")
    assert out.returncode == 0, out.stderr
