"""Run checkpoints: `latest` is written last, run.keep_checkpoints bounds what stays, the
learning-rate horizon travels with the driver state."""

import pytest

from arbor.errors import RunStopped
from arbor.run import checkpoint


def test_keep_bounds_the_checkpoints_on_disk_and_latest_names_the_newest(tmp_path):
    for step in range(1, 6):
        checkpoint.write_driver_state(checkpoint.step_dir(tmp_path, step), {"step": step, "schedule_steps": 5})
        checkpoint.mark_latest(tmp_path, step, keep=3)
    kept = sorted(p.name for p in checkpoint.checkpoint_root(tmp_path).glob("step-*"))
    assert kept == ["step-000003", "step-000004", "step-000005"]
    latest = checkpoint.latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step-000005"
    assert checkpoint.read_driver_state(latest)["step"] == 5


def test_schedule_horizon_is_the_first_runs_steps(tmp_path):
    new = checkpoint.step_dir(tmp_path, 1)
    checkpoint.write_driver_state(new, {"step": 1, "schedule_steps": 10})
    assert checkpoint.schedule_horizon(new, steps=30) == 10  # resumed with run.steps=30: kept
    old = checkpoint.step_dir(tmp_path, 2)
    checkpoint.write_driver_state(old, {"step": 2})  # written before the horizon was saved
    assert checkpoint.schedule_horizon(old, steps=30) == 30


def test_a_checkpoint_that_cannot_be_removed_is_warned_about_and_returned(tmp_path, caplog):
    """An old checkpoint that is a link to another disk (rmtree refuses links): the warning
    names it, mark_latest returns it for the run's count, and the newer ones are unharmed."""
    elsewhere = tmp_path / "other-disk" / "step-000001"
    checkpoint.write_driver_state(elsewhere, {"step": 1, "schedule_steps": 3})
    root = checkpoint.checkpoint_root(tmp_path / "run")
    root.mkdir(parents=True)
    (root / "step-000001").symlink_to(elsewhere)
    for step in (2, 3):
        checkpoint.write_driver_state(checkpoint.step_dir(tmp_path / "run", step), {"step": step, "schedule_steps": 3})
    with caplog.at_level("WARNING", logger="arbor.run.checkpoint"):
        failed = checkpoint.mark_latest(tmp_path / "run", 3, keep=2)
    assert failed == [root / "step-000001"]
    assert f"checkpoint clean-up: could not remove {root / 'step-000001'}" in caplog.text
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000001", "step-000002", "step-000003"]
    assert checkpoint.mark_latest(tmp_path / "run", 3, keep=3) == []  # nothing to remove: nothing failed


def _files(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_used_output_directory_is_refused_unless_resumed(tmp_path):
    """A checkpoint, or the metrics of a run that stopped before its first one: another
    run's. Without run.resume the message says how to continue or start over."""
    assert checkpoint.check_output_dir(tmp_path / "new", resume=False, command="train") is None
    (tmp_path / "logs").mkdir()  # a run that failed at start-up (or `arbor eval`) left only these
    (tmp_path / "config.yaml").write_text("run: {}\n")
    assert checkpoint.check_output_dir(tmp_path, resume=False, command="train") is None
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunStopped, match=rf"{tmp_path} already holds a run that wrote no checkpoint "
                                         rf"\(metrics.jsonl\): delete {tmp_path} or choose another run.output_dir"):
        checkpoint.check_output_dir(tmp_path, resume=False, command="sft")
    assert checkpoint.check_output_dir(tmp_path, resume=True, command="train") is None  # starts again at step 1
    checkpoint.write_driver_state(checkpoint.step_dir(tmp_path, 4), {"step": 4})
    checkpoint.mark_latest(tmp_path, 4)
    with pytest.raises(RunStopped, match=r"already holds a run \(checkpoint step-000004\): continue it with "
                                         r"run.resume=true .*, or delete"):
        checkpoint.check_output_dir(tmp_path, resume=False, command="train")
    assert checkpoint.check_output_dir(tmp_path, resume=True, command="train") == checkpoint.step_dir(tmp_path, 4)


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_second_run_is_refused_before_it_writes_anything(tmp_path, command):
    """`arbor train` / `arbor sft` into the directory of a run that stopped before its first
    checkpoint: refused, and every file there is as it was (no config.yaml rewritten, no
    metrics appended, no TensorBoard file)."""
    from arbor.config_load import load_config

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("the first run's\n")
    (out / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.4}\n')
    before = _files(out)
    # learner.backend torch: sft sets no distributed variables in this process
    cfg = load_config(None, [f"run.output_dir={out}", "model.path=/nonexistent/model", "learner.backend=torch"])
    with pytest.raises(RunStopped, match="already holds a run that wrote no checkpoint"):
        if command == "train":
            from arbor.run.context import start_run

            with start_run(cfg):
                pass
        else:
            from arbor.run.sft import run_sft

            run_sft(cfg)
    assert _files(out) == before
