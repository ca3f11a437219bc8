"""What ``arbor train``, ``arbor eval`` and ``arbor sft`` do first, and where start-up time goes.

    started = start_command(cfg, "train", clock)   # the one start-up of every command
    started.cfg                                    # settled: what the run runs with, every rule checked
    started.tokenizer, started.stop_ids, started.previous

:func:`start_command`, in order: refuses an output directory holding another run (``train``,
``sft``; unless ``run.resume``), settles the config (:func:`settled`: ``engine.kind: auto``
and ``engine.api_key`` decided for commands that start engines, the longest request checked
against the model's context, and every rule of :func:`~arbor.config_load.validate` checked
again on the settled values and this machine), writes the settled config there as
``config.yaml``, and loads the tokenizer and its stop ids.

Start-up time, as named phases timed from the clock's origin:

    clock = StartupClock()
    with clock.phase("tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(path)
    clock.begin("engines"); clock.begin("learners")    # phases that overlap
    ...; clock.end("learners"); clock.end("engines")
    clock.seconds()   # {"tokenizer": 0.4, "engines": 6.1, "learners": 5.2}
    clock.summary()   # "started in 9.8 s: tokenizer 0.4, engines 6.1 | learners 5.2, ..."

``arbor train`` prints the summary once everything is up; ``scripts/profile_startup.py``
reads the same phases (and the time before them) to print a ``RESULT`` line. Nothing here
imports torch or transformers at module level (the engine and learner actors import it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from arbor.config import Config, ModelConfig, save_config
from arbor.config_load import check_context_length, validate
from arbor.errors import ConfigError

Command = Literal["train", "eval", "sft"]


def uses_gpu(cfg: Config) -> bool:
    """Whether the learners run on CUDA (``learner.device``; auto: when a GPU is visible)."""
    if cfg.learner.device == "auto":
        import torch

        return torch.cuda.is_available()
    return cfg.learner.device == "cuda"


def engine_device(cfg: Config) -> str | None:
    """The engines' device: ``cpu`` on a machine whose learner runs without CUDA (SGLang then
    runs its CPU engine), else ``learner.device`` (None: auto)."""
    if not uses_gpu(cfg):
        return "cpu"
    return None if cfg.learner.device == "auto" else cfg.learner.device


@dataclass
class Started:
    """What :func:`start_command` hands a command."""

    cfg: Config  # settled (:func:`settled`): the config the command runs with, as config.yaml holds it
    tokenizer: Any  # the policy's transformers tokenizer
    stop_ids: list[int]  # every id that ends a model turn (arbor.data.stop_token_ids)
    previous: Path | None  # the latest checkpoint in run.output_dir (train, sft: what a resume continues)


def start_command(cfg: Config, command: Command, clock: StartupClock | None = None, *, writes: bool = True) -> Started:
    """The start-up every command shares (see the module docstring); ``writes``: this process
    writes ``config.yaml`` (an SPMD ``arbor sft``: rank 0 alone). Raises ConfigError for a
    rule the settled config breaks, SystemExit for a used output directory."""
    from arbor.run import checkpoint

    clock = clock or StartupClock()
    previous = None
    if command != "eval":  # eval writes its report into any directory, next to a run's
        # First: a directory holding another run is refused before any other work.
        previous = checkpoint.check_output_dir(cfg.run.output_dir, cfg.run.resume, command)
    with clock.phase("settle"):
        cfg = settled(cfg, command)
    if command != "eval" and writes:
        out = Path(cfg.run.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")  # as run: engine.kind decided (the key is never saved)
    with clock.phase("tokenizer"):
        tokenizer, stop_ids = load_tokenizer(cfg.model)
    return Started(cfg, tokenizer, stop_ids, previous)


def check_device(cfg: Config) -> None:
    """:class:`ConfigError` naming ``learner.device`` when it asks for CUDA on a machine without it."""
    if cfg.learner.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(f"learner.device is cuda, but no CUDA device is visible here (torch {torch.__version__}, "
                          f"{build}); set learner.device: cpu or auto")


def settled(cfg: Config, command: Command = "train") -> Config:
    """``cfg`` as ``command`` runs it on this machine, every rule checked; ``cfg`` is not changed.

    For the commands that start engines (``train``, ``eval``): ``engine.kind: auto`` resolved
    to the kind this machine runs (:func:`~arbor.engines.launch.resolve_kind`: SGLang needs
    ``engine.python`` to import it), ``engine.api_key`` settled
    (:func:`~arbor.engines.auth.run_api_key`: the configured key, else
    ``$ARBOR_ENGINE_API_KEY``, else a fresh one for engines arbor starts), and the longest
    request checked against the model's context (:func:`check_model_context`). Then the rules
    of :func:`~arbor.config_load.validate` again, now knowing the kind and whether the learners
    get a GPU. Decided once, here, before anything starts: the engine and learner actors,
    the clients and the launcher all read the settled ``cfg.engine`` and never decide again.
    """
    check_device(cfg)
    if command in ("train", "eval"):
        from arbor.engines.auth import run_api_key
        from arbor.engines.launch import resolve_kind

        kind = resolve_kind(cfg.engine.kind, device=engine_device(cfg), python=cfg.engine.python)
        key = run_api_key(cfg.engine.api_key, launch=kind != "external")
        cfg = replace(cfg, engine=replace(cfg.engine, kind=kind, api_key=key))  # type: ignore[arg-type]  # kind: one of KINDS
        if command == "train" and cfg.algorithm.distill.enabled:
            from arbor.run.teacher_settle import settled_distill

            cfg = settled_distill(cfg, engine_device(cfg))
        check_model_context(cfg, command)
    validate(cfg, lambda key: f"{cfg.source or '<config>'} (settled for this machine)", on_gpu=uses_gpu(cfg))
    return cfg


def check_model_context(cfg: Config, command: Command) -> None:
    """``data.max_prompt_tokens`` + the response budget must fit the model's context
    (:func:`~arbor.config_load.check_context_length`): SGLang's ``--context-length`` when
    ``engine.extra_args`` sets it, else ``max_position_embeddings`` of ``model.path``'s config
    (what SGLang and the embedded engine default to)."""
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


def problem_files(cfg: Config, command: str) -> dict[str, str]:
    """The data files ``arbor COMMAND`` reads, by the config key naming each: ``train`` reads
    ``data.train_path`` and, when it evaluates (``run.eval_every``), ``eval.path`` or else
    ``data.eval_path``; ``eval`` reads the latter (a :class:`ConfigError` when neither is
    set); ``sft`` reads ``sft.train_path``."""
    evals = {"eval.path": cfg.eval.path} if cfg.eval.path else {"data.eval_path": cfg.data.eval_path}
    if command == "sft":
        return {"sft.train_path": cfg.sft.train_path}
    if command == "eval":
        if cfg.eval.path is None and cfg.data.eval_path is None:
            raise ConfigError("eval.path: arbor eval has no set to evaluate: set eval.path or data.eval_path")
        return {k: v for k, v in evals.items() if v is not None}
    files = {"data.train_path": cfg.data.train_path}
    return files | {k: v for k, v in evals.items() if v is not None and cfg.run.eval_every}


def check_problem_files(cfg: Config, command: str) -> None:
    """:class:`ConfigError` naming the key of the first of :func:`problem_files` that does not
    exist (a generated set, ``reasoning_gym:NAME``, is no file: it is checked when it loads)."""
    from arbor.dataset_sources import is_source

    for key, path in problem_files(cfg, command).items():
        if not is_source(path) and not Path(path).exists():
            raise ConfigError(f"{key}: {path}: no such file or directory")


def load_tokenizer(model_cfg: ModelConfig) -> tuple[Any, list[int]]:
    """The policy's tokenizer and every id that ends a model turn (:func:`~arbor.data.stop_token_ids`)."""
    from transformers import AutoTokenizer

    from arbor.data import stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code)
    return tokenizer, stop_token_ids(tokenizer, model_cfg.path, model_cfg.trust_remote_code)


class StartupClock:
    """Start and end offsets (seconds since ``origin``, a ``time.perf_counter()`` value) of phases."""

    def __init__(self, origin: float | None = None) -> None:
        self.origin = time.perf_counter() if origin is None else origin
        self.spans: dict[str, tuple[float, float | None]] = {}  # name -> (start, end or None while running)

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def begin(self, name: str) -> None:
        self.spans[name] = (self.now(), None)

    def end(self, name: str) -> None:
        start, _ = self.spans[name]
        self.spans[name] = (start, self.now())

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def seconds(self) -> dict[str, float]:
        """Duration of each finished phase, in the order they began."""
        return {name: end - start for name, (start, end) in self.spans.items() if end is not None}

    def summary(self) -> str:
        """One line: the total, then each phase; phases that overlap the previous one are joined with ``|``."""
        text = ""
        last_end = 0.0
        for name, (start, end) in self.spans.items():
            if end is None:
                continue
            separator = "" if not text else " | " if start < last_end - 1e-3 else ", "
            text += f"{separator}{name} {end - start:.1f}"
            last_end = max(last_end, end)
        return f"started in {self.now():.1f} s: {text}"
