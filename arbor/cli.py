"""The ``arbor`` command.

    arbor train configs/math.yaml [section.key=value ...]   # RL with tree rollouts
    arbor config configs/math.yaml loss.clip_high=0.3       # validate, print the resolved config
    arbor train configs/math.yaml --dry-run                 # check what can be checked here, start nothing
    arbor serve --model PATH [--host H] [--port P]          # embedded engine, SGLang's native API
    arbor export RUN/hf --merge OUT                         # a LoRA adapter merged into its base

Every command that takes a config validates it (and its overrides) before any work
starts; a bad key, or a data file that is missing or malformed, exits with status 2 and one
line naming the key. ``train``, ``eval`` and ``sft`` then share one start-up
(:func:`arbor.run.startup.start_command`), whose rules on the settled config (the model's
context, this machine) exit the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import logging
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from arbor.config import Config, dump_config
from arbor.config_load import load_config
from arbor.dataset_files import DataError
from arbor.errors import ConfigError, RunStopped
from arbor.plugins import default_search_dirs

# Subcommand -> (module, function, one-line help, takes a config). Modules are imported
# only when their command runs, so `arbor --help` stays fast and light.
COMMANDS: dict[str, tuple[str, str, str, bool]] = {
    "train": ("arbor.run.trainer", "main", "run RL post-training (TreePO tree rollouts)", True),
    "sft": ("arbor.run.sft", "main", "supervised fine-tuning on conversations or trees", True),
    "eval": ("arbor.run.evaluate", "main", "pass@k / maj@k of a model on a jsonl set", True),
    "config": ("arbor.cli", "print_config", "validate a config and print its resolved form", True),
    "serve": ("arbor.engines.embedded.server", "main", "serve the embedded engine behind SGLang's API", False),
    "export": ("arbor.run.export", "main", "merge a LoRA run's adapter into its base model", False),
    "view": ("arbor.viewer", "main", "render a saved rollout tree as a self-contained HTML page", False),
}


def check_extensions(cfg: Config) -> None:
    """Resolve the config's extension points once, so a bad name fails before any work."""
    from arbor.rollout.rewards import (  # imports math-verify: only here
        RewardTerm,
        load_reward_terms,
    )

    terms = [RewardTerm(t.fn, t.weight) for t in cfg.reward.functions]
    if terms:  # none: the environment gives the reward (require_reward below)
        load_reward_terms(terms, search_dirs=default_search_dirs(cfg.source))
    if cfg.rollout.agent is not None or cfg.rollout.env is not None:
        from arbor.rollout.environments import require_reward, rollout_env

        require_reward(rollout_env(cfg.rollout, default_search_dirs(cfg.source)), cfg.reward)
    if cfg.rollout.program is not None:
        from arbor.rollout.programs import load_program

        load_program(cfg.rollout, default_search_dirs(cfg.source))


def print_config(cfg: Config) -> int:
    print(dump_config(cfg), end="")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="arbor",
        description="RL post-training for LLMs whose rollouts are trees.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, _, help_text, takes_config) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, add_help=takes_config)
        if takes_config:
            p.add_argument("config", help="YAML config file")
            p.add_argument("overrides", nargs="*", metavar="section.key=value")
            p.add_argument(
                "--dry-run",
                action="store_true",
                help="check the config and what can be checked here (extensions, data files, device, "
                "engine kind, model context), print a verdict and stop (arbor config: the resolved form)",
            )
    return parser


def _resolve(command: str) -> Callable[..., int]:
    module_name, func, _, _ = COMMANDS[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise SystemExit(f"arbor {command}: not available in this version ({module_name} is missing)") from None
    return getattr(module, func)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if argv and argv[0] in COMMANDS and not COMMANDS[argv[0]][3]:
        # Commands with their own flags (serve, view) parse their arguments themselves.
        return _resolve(argv[0])(argv[1:])
    # Overrides may come before or after flags (`train c.yaml --dry-run a.b=1`).
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    # The deepspeed launcher appends --local_rank=N; ranks read LOCAL_RANK from the environment.
    extra = [item for item in extra if not item.startswith(("--local_rank=", "--local-rank="))]
    for item in extra:
        if item.startswith("-"):
            parser.error(f"unrecognized argument: {item}")
    args.overrides += extra
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"arbor {args.command}: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        return print_config(cfg) if args.command == "config" else dry_run(cfg, args.command)
    try:
        if args.command in ("train", "eval", "sft"):
            from arbor.run.startup import check_problem_files

            check_problem_files(cfg, args.command)  # a missing file stops the run before Ray starts
        if args.command == "train":
            from arbor.run.orchestration import start_ray_early

            start_ray_early(cfg)  # Ray comes up while the checks, imports and data load run
        check_extensions(cfg)
        with run_log(cfg, args.command) as log_path:
            try:
                return _resolve(args.command)(cfg)
            except RunStopped as e:
                # What no branch survives: one line naming what failed and the fix; the traceback in the log.
                _append_traceback(log_path, e)
                print(f"arbor {args.command}: stopped: {e}\n  (the traceback is in {log_path})", file=sys.stderr)
                return 1
    except (ConfigError, DataError) as e:  # also a rule the command's start-up found on the settled config: one line
        kind = "config" if isinstance(e, ConfigError) else "data"
        print(f"arbor {args.command}: {kind} error: {e}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def run_log(cfg: Config, command: str) -> Iterator[Path | None]:
    """``<run.output_dir>/arbor.log`` for ``train``, ``eval`` and ``sft`` while the command runs:
    every record of arbor's loggers at INFO and above (one line per dropped branch, each failure
    with its problem id), and the traceback of an error that stopped the run. The console keeps
    warnings and errors only, as before. Yields the log's path (None for other commands)."""
    if command not in ("train", "eval", "sft"):
        yield None
        return
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "arbor.log"
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("arbor")
    handlers: list[logging.Handler] = [to_file]
    if not logging.getLogger().handlers:  # no handler of the user's: warnings still reach the console
        to_console = logging.StreamHandler(sys.stderr)
        to_console.setLevel(logging.WARNING)
        handlers.append(to_console)
    level = logger.level
    logger.setLevel(logging.INFO)
    for handler in handlers:
        logger.addHandler(handler)
    try:
        yield path
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
            handler.close()
        logger.setLevel(level)


def _append_traceback(path: Path | None, error: BaseException) -> None:
    if path is None:
        return
    with path.open("a") as f:
        f.write(f"arbor stopped: {type(error).__name__}: {error}\n")
        f.write("".join(traceback.format_exception(error)))


def dry_run(cfg: Config, command: str) -> int:
    """``arbor train|eval|sft CONFIG --dry-run``: run every check that needs no engine, learner or
    Ray (the extensions, the data files and their rows, the device, the engine kind, the model's
    context), print one line per check and a verdict; 0 when all pass, else 2. Starts nothing."""
    from arbor.engines.launch import resolve_kind
    from arbor.run.startup import check_device, check_model_context, engine_device, problem_files

    checks: list[tuple[str, Callable[[], str]]] = [("reward.functions", lambda: _reward_functions(cfg))]
    if cfg.rollout.env is not None or cfg.rollout.agent is not None:
        key = "rollout.env" if cfg.rollout.env is not None else "rollout.agent"
        checks.append((key, lambda: _episodes(cfg)))
    try:
        files = problem_files(cfg, command)
    except ConfigError as e:  # arbor eval without a set
        files = {}
        checks.append(("eval.path", functools.partial(_raise, e)))
    for key, path in files.items():
        checks.append((key, functools.partial(_read_data, cfg, command, key, path)))
    checks.append(("learner.device", _passes(lambda: check_device(cfg), cfg.learner.device)))
    if command != "sft":  # arbor sft starts no engine
        # resolve_kind, as the run's start-up settles it: SGLang must import in engine.python.
        checks.append(("engine.kind", lambda: _engine_kind(
            cfg, resolve_kind(cfg.engine.kind, device=engine_device(cfg), python=cfg.engine.python))))
        checks.append(("model context", _passes(lambda: check_model_context(cfg, "eval" if command == "eval" else "train"),
                                                f"prompts and responses fit the context of {cfg.model.path}")))
    failed = 0
    for name, check in checks:
        try:
            detail = check()
        except (ConfigError, DataError) as e:
            failed += 1
            print(f"FAIL  {' '.join(str(e).split())}")  # the message names the key
        else:
            print(f"ok    {name}: {detail}")
    where = cfg.source or "the defaults"
    if failed:
        print(f"arbor {command} --dry-run: NOT READY: {failed} of {len(checks)} checks failed (FAIL above); "
              "nothing was started")
        return 2
    print(f"arbor {command} --dry-run: READY: {where} passes all {len(checks)} checks on this machine; "
          "nothing was started (`arbor config` prints the resolved config)")
    return 0


def _read_data(cfg: Config, command: str, key: str, path: str) -> str:
    """Every row of a problem file parses (sft: the file exists): what the run would load."""
    from arbor.data import load_problems, used_columns

    if command == "sft":
        from arbor.run.startup import check_problem_files

        check_problem_files(cfg, command)
        return f"{path} exists"
    columns = used_columns(cfg.rollout.env, len(cfg.reward.functions))
    return f"{path}: {len(load_problems(path, cfg.data, key, columns))} problems"


def _reward_functions(cfg: Config) -> str:
    """The reward functions import and match the protocol (``--dry-run``'s line for them)."""
    from arbor.rollout.rewards import RewardTerm, load_reward_terms

    terms = [RewardTerm(t.fn, t.weight) for t in cfg.reward.functions]
    if not terms:
        return "none (the environment gives the reward)"
    load_reward_terms(terms, search_dirs=default_search_dirs(cfg.source))
    return f"{', '.join(t.fn for t in terms)} import and match fn(problem, completion) -> float"


def _episodes(cfg: Config) -> str:
    """The environment (or agent) builds, matches the protocol and gives a reward where one is
    needed: one instance is built with its arguments and closed (``--dry-run``'s line for it)."""
    from arbor.rollout.environments import require_reward, rollout_env

    source = rollout_env(cfg.rollout, default_search_dirs(cfg.source))
    assert source is not None  # one of the keys is set
    require_reward(source, cfg.reward)
    if source.is_agent:
        return f"{source.spec}: the agent builds and has start() and step()"
    probe = source.make()
    try:
        fork = getattr(probe, "fork", "replay")
    finally:
        close = getattr(probe, "close", None)
        if callable(close):
            close()
    reward = "gives a reward" if source.gives_reward else "gives no reward (reward.functions score)"
    return f"{source.spec}: builds, has reset() and step(), forks by {fork}, {reward}"


def _engine_kind(cfg: Config, kind: str) -> str:
    if kind == "external":
        return f"external: {', '.join(cfg.engine.urls)} (not contacted by --dry-run)"
    return kind if kind == cfg.engine.kind else f"{kind} (engine.kind: {cfg.engine.kind} on this machine)"


def _passes(check: Callable[[], None], detail: str) -> Callable[[], str]:
    """``check`` as a dry run's check: it raises, or passes with ``detail``."""

    def run() -> str:
        check()
        return detail
    return run


def _raise(error: Exception) -> str:
    raise error


if __name__ == "__main__":
    sys.exit(main())
