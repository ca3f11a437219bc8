"""What every command that starts engines does first, and where its start-up time goes.

    cfg = settled(cfg)                      # engine.kind and engine.api_key, decided once
    tokenizer, eos_token_ids = load_tokenizer(cfg.model)

Start-up time, as named phases timed from the clock's origin:

    clock = StartupClock()
    with clock.phase("tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(path)
    clock.begin("engines"); clock.begin("learners")    # phases that overlap
    ...; clock.end("learners"); clock.end("engines")
    clock.seconds()   # {"tokenizer": 0.4, "engines": 6.1, "learners": 5.2}
    clock.summary()   # "started in 9.8 s: tokenizer 0.4, engines 6.1 | learners 5.2, ..."

``arbor train`` prints the summary once everything is up; ``scripts/profile_startup.py``
reads the same phases (and the time before them) to print a ``RESULT`` line.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from arbor.config import Config, ModelConfig
from arbor.errors import ConfigError


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


def check_device(cfg: Config) -> None:
    """:class:`ConfigError` naming ``learner.device`` when it asks for CUDA on a machine without it."""
    if cfg.learner.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(f"learner.device is cuda, but no CUDA device is visible here (torch {torch.__version__}, "
                          f"{build}); set learner.device: cpu or auto")


def settled(cfg: Config) -> Config:
    """``cfg`` as this run starts it, after :func:`check_device`: ``engine.kind: auto`` resolved to the kind this machine
    runs (:func:`~arbor.engines.launch.resolve_kind`: SGLang needs ``engine.python`` to import it)
    and ``engine.api_key`` settled
    (:func:`~arbor.engines.auth.run_api_key`: the configured key, else
    ``$ARBOR_ENGINE_API_KEY``, else a fresh one for engines arbor starts).

    Decided once, here, before anything starts: the engine and learner actors, the clients
    and the launcher all read ``cfg.engine`` and never decide again. ``cfg`` is not changed.
    """
    from arbor.engines.auth import run_api_key
    from arbor.engines.launch import resolve_kind

    check_device(cfg)
    kind = resolve_kind(cfg.engine.kind, device=engine_device(cfg), python=cfg.engine.python)
    key = run_api_key(cfg.engine.api_key, launch=kind != "external")
    return replace(cfg, engine=replace(cfg.engine, kind=kind, api_key=key))  # type: ignore[arg-type]  # kind: one of KINDS


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
