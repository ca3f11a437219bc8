"""Step metrics: TensorBoard scalars, a ``metrics.jsonl`` line per step, the console display.

    log = MetricsLog(cfg.run, total_steps=cfg.run.steps)   # console line every run.log_every steps
    with log.phase("rollout"):                      # per-phase seconds -> time/rollout_s
        ...
    log.write(step, {"reward/mean": 0.4, ...})     # TensorBoard + jsonl + console line
    log.close()

Metric names are ``group/name``; docs/metrics.md says what each one means.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from arbor.config import RunConfig

# Shown on the console after every step, in this order (everything goes to TensorBoard).
CONSOLE = (
    ("reward/mean", "reward {:.3f}"),
    ("reward/accuracy", "acc {:.3f}"),
    ("response/length_mean", "len {:.1f}"),
    ("tree/sharing_ratio", "share {:.2f}"),
    ("eval/accuracy", "eval acc {:.3f}"),
    ("train/loss", "loss {:+.1e}"),
    ("train/grad_norm", "gnorm {:.3f}"),
    ("sync/logprob_gap", "gap {:.1e}"),
    ("time/step_s", "{:.1f} s"),
)


class MetricsLog:
    def __init__(self, run_cfg: RunConfig, total_steps: int, stream: TextIO | None = None) -> None:
        self.dir = Path(run_cfg.output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.total = total_steps
        self.log_every = run_cfg.log_every
        self.stream = stream or sys.stdout
        self.phases: dict[str, float] = {}
        self.writer: Any = None
        if run_cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir / "tensorboard"))
        self.jsonl = (self.dir / "metrics.jsonl").open("a")

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the current step; ``time/<name>_s`` in the next :meth:`write`."""
        t0 = time.perf_counter()
        self.status(f"{name}…")
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    def status(self, text: str) -> None:
        """A transient line on a terminal (progress inside a step)."""
        if self.stream.isatty():
            self.stream.write(f"\r\033[K  {text}")
            self.stream.flush()

    def write(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Record one step (``step`` counts from 1); returns the metrics with the phase times.

        Every step goes to ``metrics.jsonl`` and TensorBoard (resume and analysis need them
        all); the console shows every ``run.log_every``-th step, step 0 and the last.
        """
        metrics = dict(metrics)
        for name, seconds in self.phases.items():
            metrics[f"time/{name}_s"] = seconds
        metrics["time/step_s"] = sum(self.phases.values())
        self.phases = {}
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        self.status("")
        if step % self.log_every == 0 or step == self.total:
            shown = "  ".join(fmt.format(metrics[k]) for k, fmt in CONSOLE if k in metrics)
            self.stream.write(f"\rstep {step}/{self.total}  {shown}\n")
            self.stream.flush()
        return metrics

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.jsonl.close()


def read_metrics(output_dir: str | Path) -> list[dict[str, float]]:
    """Every step's metrics of a run, from ``metrics.jsonl`` (last record per step wins)."""
    by_step: dict[int, dict[str, float]] = {}
    path = Path(output_dir) / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]
