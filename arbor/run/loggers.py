"""Where a run's metrics go beside ``metrics.jsonl``: ``run.loggers`` (TensorBoard, W&B, MLflow).

    loggers = open_loggers(["tensorboard", "wandb"], Path("runs/x"), "x", config_to_dict(cfg))
    for logger in loggers:
        logger.log(step, {"reward/mean": 0.4})      # every step, the metrics metrics.jsonl gets
    for logger in loggers:
        logger.close(complete=True)                 # complete: the run reached its last step

Each logger receives every step's metrics and, when it opens, the resolved config:

- ``tensorboard``: event files in ``<output_dir>/tensorboard``; the config as the text
  summary ``config``.
- ``wandb``: a W&B run in project ``$WANDB_PROJECT`` (default ``arbor``) named ``run.name``,
  its files under ``<output_dir>/wandb`` (``WANDB_MODE=offline`` and W&B's other variables
  apply); the config is the run's config; the x axis is the metric ``step`` (W&B's own step
  only grows, and a resumed run repeats the interrupted step).
- ``mlflow``: an MLflow run in experiment ``$MLFLOW_EXPERIMENT_NAME`` (default ``arbor``) of
  the tracking store ``$MLFLOW_TRACKING_URI`` (MLflow's own setting), named ``run.name``; the
  config as parameters (dotted keys) and as the artifact ``config.yaml``. MLflow refuses ``@``
  in names: ``eval/pass@4`` is logged as ``eval/pass_at_4``.

A resumed run (``run.resume``) logs into the same W&B and MLflow runs: their ids are kept in
``<output_dir>/loggers.json``. W&B and MLflow are optional extras (``pip install
'arbor[wandb]'``, ``'arbor[mlflow]'``).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from arbor.errors import RunStopped

IDS_FILE = "loggers.json"  # the W&B and MLflow run ids, for a resumed run


class Logger(Protocol):
    name: str

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self, complete: bool) -> None: ...


def open_loggers(names: Sequence[str], output_dir: Path, run_name: str, config: dict[str, Any]) -> list[Logger]:
    """The loggers ``names`` (``run.loggers``) for a run writing to ``output_dir``."""
    ids_path = output_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.exists() else {}
    loggers: list[Logger] = []
    try:
        for name in names:
            if name == "tensorboard":
                loggers.append(TensorBoardLogger(output_dir, config))
            elif name == "wandb":
                loggers.append(WandbLogger(output_dir, run_name, config, ids))
            elif name == "mlflow":
                loggers.append(MlflowLogger(run_name, config, ids))
            else:  # validate() allows only the three
                raise ValueError(f"run.loggers: unknown logger {name!r}")
    except BaseException:
        for logger in loggers:
            logger.close(complete=False)
        raise
    if ids:
        ids_path.write_text(json.dumps(ids, indent=1) + "\n")
    return loggers


def config_text(config: dict[str, Any]) -> str:
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


class TensorBoardLogger:
    name = "tensorboard"

    def __init__(self, output_dir: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(output_dir / "tensorboard"))
        if config:  # indented: TensorBoard renders the text as Markdown, this as a code block
            self.writer.add_text("config", "".join(f"    {line}\n" for line in config_text(config).splitlines()))
            self.writer.flush()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, complete: bool) -> None:
        self.writer.close()


class WandbLogger:
    name = "wandb"

    def __init__(self, output_dir: Path, run_name: str, config: dict[str, Any], ids: dict[str, Any]) -> None:
        import wandb

        previous = ids.get("wandb")
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "arbor", name=run_name, dir=str(output_dir),
                config=config, id=previous, resume="allow",  # id None: a new run, W&B names it
                allow_val_change=True,  # a resumed run may change run.steps
            )
        except Exception as e:  # no key (wandb login), no network: stops the run before it starts
            raise RunStopped(f"run.loggers: wandb could not start a run: {type(e).__name__}: {e}\n"
                             "Log in (`wandb login`, WANDB_API_KEY) or set WANDB_MODE=offline") from None
        ids["wandb"] = self.run.id
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({**metrics, "step": step})

    def close(self, complete: bool) -> None:
        self.run.finish(exit_code=0 if complete else 1)


# MLflow's rule for metric and parameter names (mlflow.utils.validation on Linux).
_MLFLOW_REFUSED = re.compile(r"[^/\w.\- :]")


def mlflow_name(key: str) -> str:
    """``eval/pass@4`` -> ``eval/pass_at_4``; any other refused character -> ``_``."""
    return _MLFLOW_REFUSED.sub("_", key.replace("@", "_at_"))


def flat(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """``{"run": {"steps": 3, "name": "x"}}`` -> ``("run.steps", "3")``, ``("run.name", "x")``;
    other values as JSON (``null``, ``true``, lists as one value)."""
    for key, value in config.items():
        if isinstance(value, Mapping):
            yield from flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value if isinstance(value, str) else json.dumps(value)


class MlflowLogger:
    name = "mlflow"
    PARAM_CHARS = 6000  # MLflow's longest parameter value
    BATCH = 100  # MLflow's most parameters per log_batch

    def __init__(self, run_name: str, config: dict[str, Any], ids: dict[str, Any]) -> None:
        import mlflow
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = mlflow.get_tracking_uri()  # $MLFLOW_TRACKING_URI, else MLflow's default
        try:
            self.client = MlflowClient(uri)
            previous = ids.get("mlflow")
            if previous is None:
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "arbor"
                experiment = self.client.get_experiment_by_name(name)
                experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
                self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            else:  # a resumed run: its parameters stay the first run's (MLflow keeps them fixed)
                self.run_id = self.client.get_run(previous).info.run_id
                self.client.update_run(self.run_id, status="RUNNING")
        except Exception as e:  # stops the run before it starts, saying what to set
            raise RunStopped(
                f"run.loggers: mlflow cannot use the tracking store {uri}: {e}\n"
                "Set MLFLOW_TRACKING_URI: a tracking server (http://HOST:5000), or a local store the "
                "installed MLflow supports (sqlite:///mlflow.db needs `pip install mlflow`)"
            ) from None
        ids["mlflow"] = self.run_id
        if previous is None:
            params = [Param(mlflow_name(k), v[: self.PARAM_CHARS]) for k, v in flat(config)]
            for i in range(0, len(params), self.BATCH):
                self.client.log_batch(self.run_id, params=params[i : i + self.BATCH])
        self.client.log_text(self.run_id, config_text(config), "config.yaml")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_name(k), float(v), now, step)
                                                    for k, v in metrics.items()])

    def close(self, complete: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if complete else "FAILED")
