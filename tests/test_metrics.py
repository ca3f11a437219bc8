"""MetricsLog: every step in metrics.jsonl, the console every run.log_every steps."""

import io

from arbor.config import RunConfig
from arbor.run.metrics import MetricsLog, read_metrics


def test_console_every_log_every_steps_jsonl_every_step(tmp_path):
    console = io.StringIO()
    log = MetricsLog(RunConfig(output_dir=str(tmp_path), log_every=2, loggers=[]), total_steps=5, stream=console)
    for step in range(0, 6):
        log.write(step, {"reward/mean": step / 10})
    log.close()
    shown = [line.split()[1] for line in console.getvalue().replace("\r", "").splitlines() if line.startswith("step")]
    assert shown == ["0/5", "2/5", "4/5", "5/5"]  # step 0 (the start), every 2nd, and the last
    assert [m["step"] for m in read_metrics(tmp_path)] == [0, 1, 2, 3, 4, 5]
    assert read_metrics(tmp_path)[3]["reward/mean"] == 0.3
