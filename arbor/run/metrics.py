"""Step metrics: a ``metrics.jsonl`` line per step, ``run.loggers`` (TensorBoard, W&B, MLflow:
:mod:`arbor.run.loggers`), the console display.

    log = MetricsLog(cfg.run, total_steps=cfg.run.steps, config=config_to_dict(cfg))
    with log.phase("rollout"):                      # per-phase seconds -> time/rollout_s
        ...
    log.write(step, {"reward/mean": 0.4, ...})     # loggers + jsonl + console line
    log.close()

Metric names are ``group/name``; docs/metrics.md says what each one means.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from arbor.config import RunConfig
from arbor.run.loggers import Logger, open_loggers

_log = logging.getLogger(__name__)

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
    def __init__(self, run_cfg: RunConfig, total_steps: int, stream: TextIO | None = None,
                 config: dict[str, Any] | None = None) -> None:
        """``config``: the resolved config (:func:`arbor.config.config_to_dict`) each logger records."""
        self.dir = Path(run_cfg.output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.total = total_steps
        self.log_every = run_cfg.log_every
        self.stream = stream or sys.stdout
        self.phases: dict[str, float] = {}
        self.last_step = -1
        self.logger_errors = 0  # steps a logger failed to record, so far (run/logger_errors)
        self.loggers: list[Logger] = open_loggers(run_cfg.loggers, self.dir, run_cfg.name, config or {})
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

    def note(self, step: int, text: str) -> None:
        """A line on the console about ``step`` (what it dropped, that it trained nothing), shown
        whatever ``run.log_every`` is, and kept in the run's ``arbor.log``."""
        self.status("")
        self.stream.write(f"\rstep {step}/{self.total}  note: {text}\n")
        self.stream.flush()
        _log.info("step %d: %s", step, text)

    def write(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Record one step (``step`` counts from 1); returns the metrics with the phase times.

        Every step goes to ``metrics.jsonl`` and ``run.loggers`` (resume and analysis need
        them all); the console shows every ``run.log_every``-th step, step 0 and the last. A
        logger that fails (a tracking server down) does not stop the run: the error is printed
        naming the logger and counted in ``run/logger_errors``.
        """
        metrics = dict(metrics)
        for name, seconds in self.phases.items():
            metrics[f"time/{name}_s"] = seconds
        metrics["time/step_s"] = sum(self.phases.values())
        self.phases = {}
        for logger in self.loggers:
            try:
                logger.log(step, metrics)
            except Exception as e:  # warned and counted: metrics.jsonl still holds the step
                self.logger_errors += 1
                print(f"arbor: run.loggers {logger.name}: step {step} not logged: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
        if self.loggers:
            metrics["run/logger_errors"] = float(self.logger_errors)
        self.last_step = step
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        self.status("")
        if step % self.log_every == 0 or step == self.total:
            shown = "  ".join(fmt.format(metrics[k]) for k, fmt in CONSOLE if k in metrics)
            self.stream.write(f"\rstep {step}/{self.total}  {shown}\n")
            self.stream.flush()
        return metrics

    def close(self) -> None:
        """Close the loggers (a run that stopped before its last step is marked failed where a
        logger has the notion: W&B's exit code, MLflow's run status) and ``metrics.jsonl``."""
        for logger in self.loggers:
            try:
                logger.close(complete=self.last_step == self.total)
            except Exception as e:  # the others still close; the steps are in metrics.jsonl
                print(f"arbor: run.loggers {logger.name}: could not close: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
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
