"""The ``arbor`` command.

    arbor train configs/math.yaml [section.key=value ...]   # RL with tree rollouts
    arbor config configs/math.yaml loss.clip_high=0.3       # validate, print the resolved config
    arbor serve --model PATH [--host H] [--port P]          # embedded engine, SGLang's native API
    arbor export RUN/hf --merge OUT                         # a LoRA adapter merged into its base

Every command that takes a config validates it (and its overrides) before any work
starts; a bad key exits with status 2 and a message naming it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from arbor.config import Config, dump_config
from arbor.config_load import check_context_length, load_config
from arbor.errors import ConfigError
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


def check_model_context(cfg: Config, command: str) -> None:
    """``data.max_prompt_tokens`` + the response budget must fit the model's context
    (:func:`~arbor.config_load.check_context_length`), read once before any work starts: SGLang's
    ``--context-length`` when ``engine.extra_args`` sets it, else ``max_position_embeddings``
    of ``model.path``'s config (what SGLang and the embedded engine default to)."""
    extra = list(cfg.engine.extra_args)
    for i, arg in enumerate(extra):
        if cfg.engine.kind != "embedded" and arg.startswith("--context-length"):
            value = arg.partition("=")[2] or (extra[i + 1] if i + 1 < len(extra) else "")
            if not value.isdigit():
                raise ConfigError(f"engine.extra_args: --context-length needs a number of tokens, got {value!r}")
            check_context_length(cfg, int(value), "--context-length in engine.extra_args", command)
            return
    from transformers import AutoConfig

    try:
        model_config = AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: cannot read the config of {cfg.model.path!r}: {e}") from None
    context = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    if context is not None:  # a model without the field: the server's own check is all there is
        check_context_length(cfg, int(context), f"max_position_embeddings of {cfg.model.path}", command)


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
                help="validate the config, print its resolved form and stop",
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
        if args.command == "train" and not args.dry_run:
            from arbor.run.orchestration import start_ray_early

            start_ray_early(cfg)  # Ray comes up while the checks, imports and data load run
        check_extensions(cfg)
        if args.command in ("train", "eval") and not args.dry_run:  # --dry-run reads no model
            check_model_context(cfg, args.command)
    except ConfigError as e:
        print(f"arbor {args.command}: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        return print_config(cfg)
    return _resolve(args.command)(cfg)


if __name__ == "__main__":
    sys.exit(main())
