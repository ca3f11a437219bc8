"""Run checkpoints: the learner's state (every rank) plus the driver's, resumable exactly.

    <output_dir>/checkpoints/step-000010/learner/...   DeepSpeed (or torch) state per rank
    <output_dir>/checkpoints/step-000010/driver.json   step, data cursor, LR schedule horizon
    <output_dir>/checkpoints/step-000010/rng.pt        the driver's RNG states
    <output_dir>/checkpoints/latest                    "step-000010", written last

A checkpoint is complete only once ``latest`` names it (written after everything else,
atomically), so a run killed while saving resumes from the previous one. A new run refuses
a directory that holds another one (:func:`check_output_dir`); ``run.resume`` picks ``latest``; the learner reloads its state and pushes the weights to the engines,
the problem stream continues at its cursor, and the RNGs are restored. The metrics are
not in the checkpoint: ``metrics.jsonl`` is appended to (:func:`arbor.run.metrics.read_metrics`
keeps the last record of a step a resumed run redid). ``run.keep_checkpoints`` bounds how
many complete checkpoints stay on disk.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from arbor.errors import RunStopped

LATEST = "latest"
log = logging.getLogger(__name__)


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoint_root(output_dir) / f"step-{step:06d}"


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def write_driver_state(directory: Path, state: dict[str, Any]) -> None:
    """``driver.json`` (plain values) and ``rng.pt`` (RNG states) of the driver."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "driver.json").write_text(json.dumps(state, indent=1))
    torch.save(rng_state(), directory / "rng.pt")


def mark_latest(output_dir: str | Path, step: int, keep: int = 2) -> list[Path]:
    """Point ``latest`` at ``step`` (atomic rename), then drop all but the newest ``keep``.
    Returns the old checkpoints that could not be removed (each warned about, naming it):
    the run goes on, but the disk fills, so the caller counts them."""
    root = checkpoint_root(output_dir)
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(step_dir(output_dir, step).name)
    os.replace(tmp, root / LATEST)
    done = sorted(p for p in root.glob("step-*") if p.is_dir())
    failed = []
    for old in done[:-keep]:
        try:
            shutil.rmtree(old)
        except OSError as e:
            log.warning("checkpoint clean-up: could not remove %s (%s: %s); it stays on disk "
                        "(run.keep_checkpoints=%d)", old, type(e).__name__, e, keep)
            failed.append(old)
    return failed


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    pointer = checkpoint_root(output_dir) / LATEST
    if not pointer.exists():
        return None
    path = checkpoint_root(output_dir) / pointer.read_text().strip()
    if not (path / "driver.json").exists():
        raise FileNotFoundError(f"{pointer} names {path.name}, which has no driver.json")
    return path


# What a run writes once it has done something (a step, or the step-0 eval): a directory
# holding either is another run's, even before its first checkpoint.
RUN_TRACES = ("metrics.jsonl", "checkpoints")


def check_output_dir(output_dir: str | Path, resume: bool, command: str) -> Path | None:
    """The checkpoint a run in ``output_dir`` continues from (None: it starts at step 1).

    Called before the run writes anything: without ``resume``, a directory that holds
    another run (a checkpoint, or the traces of one that wrote none) is refused with a
    :class:`~arbor.errors.RunStopped` saying how to continue it or start over, so a second run never appends
    to the first one's ``metrics.jsonl``. ``command`` names the command in the message.
    """
    out = Path(output_dir)
    latest = latest_checkpoint(out)
    if resume:
        return latest
    start_over = f"delete {out} or choose another run.output_dir to start over"
    if latest is not None:
        raise RunStopped(f"{out} already holds a run (checkpoint {latest.name}): continue it "
                         f"with run.resume=true (a larger run.steps extends it), or {start_over}")
    traces = [name for name in RUN_TRACES if (out / name).exists()]
    if traces:
        raise RunStopped(f"{out} already holds a run that wrote no checkpoint "
                         f"({', '.join(traces)}): {start_over}; run.resume=true starts it again at step 1 "
                         "in the same directory (its metrics.jsonl is appended to)")
    return None


def schedule_horizon(directory: Path, steps: int) -> int:
    """The ``run.steps`` the checkpointed run's learning-rate schedule was built for.

    A resumed run keeps it, so a larger ``run.steps`` extends the run without reshaping a
    decaying schedule. ``steps``: the value to use for checkpoints written before it was saved.
    """
    state = json.loads((directory / "driver.json").read_text())
    return int(state.get("schedule_steps", steps))


def resume_hint(output_dir: str | Path) -> str:
    """What a run that stops on a fault tells its user: where it can continue from."""
    latest = latest_checkpoint(output_dir)
    if latest is None:
        return "No checkpoint was written yet."
    return f"The last checkpoint is {latest}: continue with run.resume=true."


def read_driver_state(directory: Path) -> dict[str, Any]:
    """The driver state of a checkpoint; restores the driver's RNGs as a side effect."""
    state = json.loads((directory / "driver.json").read_text())
    set_rng_state(torch.load(directory / "rng.pt", weights_only=False))
    return state
