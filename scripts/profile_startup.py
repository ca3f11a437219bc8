"""Where ``arbor train`` spends its start-up: seconds per phase, process start to the first rollout request.

    python scripts/profile_startup.py                                 # configs/quickstart.yaml, 3 runs
    python scripts/profile_startup.py --config configs/cot.yaml --runs 1 run.eval_every=0

Each run is a fresh process that does what ``arbor train CONFIG`` does before its first
step (the config and its checks, importing the trainer, :func:`arbor.run.context.start_run`)
and then sends one rollout request (a prompt of the training set, 1 new token), timing

- ``python``: the interpreter's start, process start to this script's first line;
- ``imports``: ``arbor.cli`` and ``arbor.run.trainer`` (torch, transformers, Ray, ...);
- ``config``: loading the config, resolving rewards/agents;
- the phases ``start_run`` times itself (``settle``: the settled config's rules, the model's
  context among them; ``tokenizer``, ``data``, ``metrics``, ``rewards``,
  ``ray``, ``placement``, ``engines``, ``learners``; engines and learners may overlap;
  ``ray`` is what remains of Ray's start, begun in the background right after the config);
- ``first_request``: the first ``/generate`` round trip.

``startup_s`` is process start to the moment the first request is sent. The run's output
goes to a temporary directory. With ``--imports`` each of torch, transformers, deepspeed,
ray and arbor.run.trainer is also imported alone in a fresh ``python -X importtime`` process.
The last line is ``RESULT startup_s=... <phase>_s=...`` (medians over the runs).
"""

from __future__ import annotations

import time

SCRIPT_START = time.perf_counter()  # before any other import: they are part of what is timed

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
IMPORTED_ALONE = ("torch", "transformers", "deepspeed", "ray", "arbor.run.trainer")


def process_start() -> float:
    """This process's start as a ``time.perf_counter()`` value (Linux: /proc; else this script's start)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # seconds after boot (field 22 of stat)
        return SCRIPT_START - (time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return SCRIPT_START


def profile_once(config: str, overrides: list[str]) -> dict[str, float]:
    """One start-up in this process, as ``arbor train`` runs it; seconds per phase."""
    from arbor.run.startup import StartupClock

    clock = StartupClock(origin=process_start())
    clock.spans["python"] = (0.0, SCRIPT_START - clock.origin)
    with clock.phase("imports"):
        from arbor.cli import check_extensions
        from arbor.config_load import load_config
        from arbor.run.context import start_run
        from arbor.run.orchestration import start_ray_early
    with clock.phase("config"):
        cfg = load_config(config, overrides)
        start_ray_early(cfg)  # as `arbor train` does: Ray starts while the rest runs
        check_extensions(cfg)
    with clock.phase("imports_trainer"):
        import arbor.run.trainer  # noqa: F401  (what `arbor train` imports before it starts)
        from arbor.engines.types import GenerateRequest, SamplingParams

    with start_run(cfg, clock) as ctx:
        prompts = ctx.sampling.prompts(ctx.stream.next_batch(1))
        # With an environment the prompt is its reset's: any one token asks the engine the same.
        prompt = prompts[0] if prompts is not None else [0]
        startup = clock.now()
        with clock.phase("first_request"):
            ctx.run_async(ctx.client.generate(GenerateRequest(prompt, SamplingParams(max_new_tokens=1))))
    return {"startup": startup, **clock.seconds()}


def import_seconds(module: str) -> float:
    """Cumulative ``python -X importtime`` seconds of ``module`` imported alone in a fresh process."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                            capture_output=True, text=True, check=True, cwd=ROOT)
    for line in result.stderr.splitlines():  # "import time: self [us] | cumulative | name"
        parts = line.split("|")
        if len(parts) == 3 and parts[2].strip() == module:
            return int(parts[1]) / 1e6
    raise RuntimeError(f"python -X importtime printed no line for {module}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes; the RESULT line has the medians")
    parser.add_argument("--imports", action="store_true", help="also time each heavy import alone")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args()
    if args.child:
        print("PHASES " + json.dumps(profile_once(args.config, args.overrides)), flush=True)
        return 0
    runs: list[dict[str, float]] = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="arbor-startup-") as out:
            command = [sys.executable, __file__, "--child", "--config", args.config, *args.overrides,
                       f"run.output_dir={out}"]
            result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        phases = [line for line in result.stdout.splitlines() if line.startswith("PHASES ")]
        if result.returncode != 0 or not phases:
            sys.stderr.write(result.stdout[-3000:] + result.stderr[-5000:])
            raise SystemExit(f"run {i + 1} failed with exit code {result.returncode}")
        runs.append(json.loads(phases[-1][len("PHASES "):]))
        print(f"run {i + 1}: " + "  ".join(f"{k} {v:.2f}" for k, v in runs[-1].items()), flush=True)
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    total = median["startup"]
    print("\nphase            seconds  share of start-up")
    for name, seconds in median.items():
        if name != "startup":
            print(f"{name:<16} {seconds:7.2f}  {seconds / total:6.1%}")
    print(f"{'startup':<16} {total:7.2f}  (process start to the first request; overlapping phases add up to more)")
    if args.imports:
        imports = {m: import_seconds(m) for m in IMPORTED_ALONE}
        print("\nimported alone: " + "  ".join(f"{m} {s:.2f} s" for m, s in imports.items()))
        median |= {"import_" + m.replace(".", "_"): s for m, s in imports.items()}
    print("RESULT " + " ".join(f"{k}_s={v:.2f}" for k, v in median.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
