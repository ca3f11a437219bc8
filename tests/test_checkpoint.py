"""Run checkpoints: `latest` is written last, run.keep_checkpoints bounds what stays, the
learning-rate horizon travels with the driver state."""

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
