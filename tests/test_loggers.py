"""run.loggers: TensorBoard, W&B (offline) and MLflow (a file store in tmp) each get every
step's metrics and the resolved config, read back from what each one wrote; a resumed run
logs into the same W&B and MLflow runs; a failing logger is counted, not fatal."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from ci_rule import unavailable

from arbor.config import RunConfig, config_to_dict
from arbor.config_load import load_config
from arbor.errors import ConfigError, RunStopped
from arbor.run.loggers import IDS_FILE, flat, mlflow_name
from arbor.run.metrics import MetricsLog, read_metrics

STEPS = [  # what three steps write; eval/pass@4 has a character MLflow refuses
    {"reward/mean": 0.25, "eval/pass@4": 0.5},
    {"reward/mean": 0.5, "train/loss": -0.125},
    {"reward/mean": 0.75, "train/loss": 0.0625},
]
CONFIG = config_to_dict(load_config(None, ["run.name=loggers-test", "run.steps=2"]))


@pytest.fixture
def trackers(tmp_path, monkeypatch):
    """W&B offline and MLflow on a file store, both in tmp; skipped (failed under CI) without them."""
    for package in ("wandb", "mlflow"):
        if importlib.util.find_spec(package) is None:
            unavailable(f"run.loggers' {package} needs its package: pip install -e '.[{package}]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "arbor-tests")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses file stores without it
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "arbor-tests")
    return tmp_path


def write_steps(out: Path, steps: dict[int, dict[str, float]], total: int) -> dict[str, float]:
    log = MetricsLog(RunConfig(output_dir=str(out), name="loggers-test", loggers=["tensorboard", "wandb", "mlflow"]),
                     total_steps=total, stream=open("/dev/null", "w"), config=CONFIG)  # noqa: SIM115
    last: dict[str, float] = {}
    for step, metrics in steps.items():
        last = log.write(step, metrics)
    log.close()
    return last


def wandb_records(out: Path) -> list:
    """Every record of the offline runs' transaction logs (run-*.wandb): LevelDB's log format
    (32 KiB blocks of records: crc32, length, type; type 1 a whole record, 2/3/4 its first,
    middle and last piece) after W&B's 7-byte header, each record a wandb_internal Record."""
    from wandb.proto import wandb_internal_pb2

    records = []
    for path in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, pieces = path.read_bytes(), 7, []
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:  # a block's tail too short for a header is padding
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0:  # zeros: the rest of the block is padding
                pos += left
                continue
            pieces.append(data[pos + 7:pos + 7 + length])
            pos += 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(b"".join(pieces))
                records.append(record)
                pieces = []
    return records


def wandb_logged(out: Path) -> tuple[set[str], dict[int, dict[str, float]], dict]:
    """(run ids, {step: metrics}, the run's config) from the offline runs in ``out``."""
    ids, steps, config = set(), {}, {}
    for record in wandb_records(out):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            ids.add(record.run.run_id)
            config |= {u.key or ".".join(u.nested_key): json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "history":
            row = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            row = {key: value for key, value in row.items() if not key.startswith("_")}  # W&B's own _step, ...
            steps[int(row.pop("step"))] = row
    return ids, steps, config


def mlflow_run(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("arbor-tests").experiment_id])
    return client, run


def tensorboard_logged(out: Path) -> tuple[dict[int, dict[str, float]], str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    steps: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            steps.setdefault(event.step, {})[tag] = event.value
    (text,) = events.Tensors("config/text_summary")
    return steps, text.tensor_proto.string_val[0].decode()


def test_each_logger_gets_the_same_metrics_and_the_config(trackers):
    out = trackers / "run"
    write_steps(out, dict(enumerate(STEPS)), total=2)
    jsonl = {int(m.pop("step")): m for m in read_metrics(out)}
    assert jsonl[0]["eval/pass@4"] == 0.5 and jsonl[2]["run/logger_errors"] == 0
    assert set(jsonl[1]) == {"reward/mean", "train/loss", "time/step_s", "run/logger_errors"}

    # The loggers get a step before its run/logger_errors is known (a logger's failure counts there).
    logged = {step: {k: v for k, v in m.items() if k != "run/logger_errors"} for step, m in jsonl.items()}
    tb_steps, tb_config = tensorboard_logged(out)
    assert tb_steps == logged  # binary fractions: exact in TensorBoard's float32
    assert "name: loggers-test" in tb_config and "steps: 2" in tb_config

    ids, wandb_steps, wandb_config = wandb_logged(out)
    assert len(ids) == 1 and json.loads((out / IDS_FILE).read_text())["wandb"] in ids
    assert wandb_steps == logged
    assert wandb_config["run"]["name"] == "loggers-test" and wandb_config["rollout"] == CONFIG["rollout"]

    client, run = mlflow_run(f"file:{trackers / 'mlruns'}")
    assert run.info.run_id == json.loads((out / IDS_FILE).read_text())["mlflow"]
    assert run.info.run_name == "loggers-test" and run.info.status == "FINISHED"
    for key in ("reward/mean", "train/loss", "eval/pass@4", "time/step_s"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, mlflow_name(key))}
        assert history == {step: m[key] for step, m in logged.items() if key in m}, key
    assert run.data.params == {k: v for k, v in flat(CONFIG)}
    assert run.data.params["run.steps"] == "2" and run.data.params["engine.urls"] == "[]"
    assert client.download_artifacts(run.info.run_id, "config.yaml", str(trackers)) and \
        "name: loggers-test" in (trackers / "config.yaml").read_text()


def test_a_resumed_run_logs_into_the_same_runs_and_a_stopped_one_is_marked(trackers):
    out = trackers / "run"
    write_steps(out, {0: STEPS[0], 1: STEPS[1]}, total=3)  # stopped after step 1 of 3
    client, run = mlflow_run(f"file:{trackers / 'mlruns'}")
    assert run.info.status == "FAILED"
    write_steps(out, {2: STEPS[2], 3: STEPS[1]}, total=3)  # resumed: steps 2 and 3
    client, resumed = mlflow_run(f"file:{trackers / 'mlruns'}")  # still one run
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == [0, 1, 2, 3]
    ids, wandb_steps, _ = wandb_logged(out)
    assert len(ids) == 1 and sorted(wandb_steps) == [0, 1, 2, 3]


def test_a_failing_logger_is_warned_about_and_counted(trackers, capsys):
    """The MLflow store vanishes mid-run (a server gone): the run goes on, metrics.jsonl has
    every step, each lost step is printed naming the logger and counted."""
    import shutil

    out = trackers / "run"
    log = MetricsLog(RunConfig(output_dir=str(out), loggers=["mlflow"]), total_steps=3, config=CONFIG)
    log.write(1, STEPS[0])
    shutil.rmtree(trackers / "mlruns")
    log.write(2, STEPS[1])
    log.write(3, STEPS[2])
    log.close()  # closing the run fails too: warned
    assert [m["run/logger_errors"] for m in read_metrics(out)] == [0, 1, 2]
    err = capsys.readouterr().err
    assert "arbor: run.loggers mlflow: step 2 not logged: Exception:" in err and "mlruns' does not exist" in err
    assert "arbor: run.loggers mlflow: step 3 not logged" in err and "mlflow: could not close" in err


def test_mlflow_names_and_flat_params():
    assert mlflow_name("eval/pass@4") == "eval/pass_at_4" and mlflow_name("reward/mean") == "reward/mean"
    assert mlflow_name("a+b/c d:e.f-g") == "a_b/c d:e.f-g"
    assert dict(flat({"run": {"steps": 3, "name": "x"}, "reward": {"functions": [{"fn": "m:f"}]}})) == {
        "run.steps": "3", "run.name": "x", "reward.functions": '[{"fn": "m:f"}]'}


def test_config_rules(monkeypatch):
    assert load_config(None).run.loggers == ["tensorboard"]
    assert load_config(None, ["run.loggers=[]"]).run.loggers == []
    with pytest.raises(ConfigError, match=r"run.tensorboard=false'.*: run.tensorboard was replaced by run.loggers"):
        load_config(None, ["run.tensorboard=false"])
    with pytest.raises(ConfigError, match="run.loggers.* must be one of 'tensorboard', 'wandb', 'mlflow'; got 'neptune'"):
        load_config(None, ["run.loggers=[neptune]"])
    with pytest.raises(ConfigError, match="run.loggers names a logger twice"):
        load_config(None, ["run.loggers=[tensorboard, tensorboard]"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"run.loggers wandb needs its package: pip install 'arbor\[wandb\]'"):
        load_config(None, ["run.loggers=[tensorboard, wandb]"])


def test_arbor_sft_logs_to_every_logger(trackers, tmp_path, monkeypatch):
    """The wiring from the config: `arbor sft` (a plain-torch learner, 2 steps) with all three."""
    from arbor.run.sft import main

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)  # configs/sft.yaml's paths are the repository's
    out = tmp_path / "sft"
    cfg = load_config(repo / "configs" / "sft.yaml", [
        "learner.backend=torch", "learner.zero_stage=0", "sft.max_steps=2", f"run.output_dir={out}",
        "run.loggers=[tensorboard, wandb, mlflow]"])
    assert main(cfg) == 0
    losses = {int(m["step"]): m["sft/loss"] for m in read_metrics(out)}
    assert sorted(losses) == [1, 2]
    assert {s: m["sft/loss"] for s, m in tensorboard_logged(out)[0].items()} == pytest.approx(losses)  # float32
    _, wandb_steps, wandb_config = wandb_logged(out)
    assert {s: m["sft/loss"] for s, m in wandb_steps.items()} == losses
    assert wandb_config["sft"]["train_path"] == "data/arith-tool/sft.jsonl"
    client, run = mlflow_run(f"file:{trackers / 'mlruns'}")
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "sft/loss")} == losses
    assert run.data.params["learner.backend"] == "torch" and run.info.status == "FINISHED"


def test_a_tracking_store_mlflow_cannot_open_stops_the_start_saying_what_to_set(trackers, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuch://tracker")
    with pytest.raises(RunStopped, match=r"run.loggers: mlflow cannot use the tracking store nosuch://tracker: "
                                         r"(.|\n)*Set MLFLOW_TRACKING_URI"):
        MetricsLog(RunConfig(output_dir=str(trackers / "run"), loggers=["tensorboard", "mlflow"]), total_steps=1)
    assert not (trackers / "run" / "metrics.jsonl").exists()


def test_wandb_without_a_key_stops_the_start_saying_what_to_do(trackers):
    """In a fresh process (W&B keeps its settings per process: the other tests' offline mode)."""
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env |= {"HOME": str(trackers), "PYTHONPATH": os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])}  # no ~/.netrc
    code = ("from arbor.config import RunConfig; from arbor.run.metrics import MetricsLog; "
            f"MetricsLog(RunConfig(output_dir={str(trackers / 'run')!r}, loggers=['wandb']), total_steps=1)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "RunStopped: run.loggers: wandb could not start a run: UsageError" in done.stderr
    assert "WANDB_MODE=offline" in done.stderr and not (trackers / "run" / "metrics.jsonl").exists()
