"""The teacher of on-policy distillation: its own engines, started and placed like the policy's.

    cfg = settled_distill(cfg, device)             # arbor.run.teacher_settle: at start-up (startup.settled)
    teacher = Teacher(cfg, placement, log_dir, output_token)    # Ray actors on the teacher's bundles
    teacher.wait_started()                         # healthy; tokenizer and temperature checked
    metrics = teacher.score(batch.trees, cfg.rollout.temperature)   # distill/* of the step

The teacher is an ``arbor serve`` (or SGLang) server holding the teacher's weights, never a
model inside the learner: each engine is an :class:`~arbor.run.engine_group.EngineWorker` on a
bundle of the run's placement group (:class:`~arbor.run.orchestration.Placement`), started from
the run's config with ``engine`` and ``model.path`` swapped for the teacher's
(:func:`teacher_config`). ``kind: external`` adopts servers already running at ``urls``. The
teacher's weights never change, so its radix cache stays valid across steps.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

from arbor.config import Config
from arbor.engines.connect import closing, engine_client
from arbor.engines.errors import EngineError
from arbor.errors import ConfigError
from arbor.rollout.teacher_scoring import score_trees
from arbor.run.engine_group import EngineGroup
from arbor.run.recovery import EngineFailedError
from arbor.run.teacher_settle import TEACHER_KEY
from arbor.train.distill import mean_divergence
from arbor.tree import RolloutTree

T = TypeVar("T")


def teacher_config(cfg: Config) -> Config:
    """The run's config as the teacher's engines read it: ``engine`` (kind, urls, number) and
    ``model.path`` the teacher's; no adapter, one GPU per engine, no extra server flags."""
    t = cfg.algorithm.distill.teacher
    model_path = t.model or cfg.model.path
    if os.path.exists(model_path):  # every node reads it at the same absolute path
        model_path = os.path.abspath(model_path)
    engine = replace(cfg.engine, kind=t.kind, urls=list(t.urls), num_engines=t.num_engines, tp_size=1,
                     extra_args=[], partial_rollouts=False)
    model = replace(cfg.model, path=model_path, lora_rank=0, ref_path=None)
    return replace(cfg, engine=engine, model=model)


class Teacher:
    """The run's teacher engines (an :class:`EngineGroup` on the teacher's bundles) and their client."""

    def __init__(self, cfg: Config, placement: Any, log_dir: str, output_token: str | None = None) -> None:
        self.cfg = teacher_config(cfg)
        self.log_dir = os.path.join(log_dir, "teacher")
        self.group = EngineGroup(self.cfg, placement, self.log_dir, wait=False,
                                 output_token=output_token, place=placement.teacher_options)
        self.starting = self.group.starting
        self.urls: list[str] = []

    def wait_started(self) -> None:
        """Wait until every teacher server is healthy. An external teacher must be arbor's server
        when ``rollout.temperature`` ≠ 1 (SGLang scores input tokens at 1)."""
        self.group.wait_started()
        self.urls = list(self.group.urls)
        if self.cfg.engine.kind == "external" and self.cfg.rollout.temperature != 1.0:
            infos = self._run(lambda client: client.server_info())
            if any(info.get("engine") != "arbor" for info in infos):
                raise ConfigError(f"{TEACHER_KEY}.urls: a teacher other than arbor serve (SGLang) scores at "
                                  f"temperature 1, but rollout.temperature is {self.cfg.rollout.temperature}")

    def _client(self) -> Any:
        return engine_client(self.cfg.engine, self.urls)

    def _run(self, call: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
        """``call(client)`` on a fresh client of the teacher's engines, from synchronous code."""
        client = self._client()
        return asyncio.run(closing(client, call(client)))

    def score(self, trees: list[RolloutTree], temperature: float, kind: str = "reverse_kl") -> dict[str, float]:
        """Teacher log-probs onto every node of ``trees`` (:func:`score_trees`) and the step's
        ``distill/*`` metrics: tokens the teacher computed against the linearised count, the
        mean per-token reverse KL (and k3), seconds."""
        started = time.perf_counter()
        try:
            stats = self._run(lambda client: score_trees(client, trees, temperature))
        except EngineError as e:  # not restarted (its weights never change, but its place may be gone)
            raise EngineFailedError(f"the teacher's engine failed while scoring ({TEACHER_KEY}): {e}; its log is "
                                    f"under {self.log_dir}") from e
        metrics = {
            "distill/teacher_tokens": float(stats.computed_tokens),
            "distill/linearised_tokens": float(stats.linearised_tokens),
            "distill/teacher_token_ratio": stats.computed_tokens / max(stats.linearised_tokens, 1),
            "distill/teacher_requests": float(stats.requests),
            "distill/reverse_kl": mean_divergence(trees, "reverse_kl"),
            "distill/teacher_s": time.perf_counter() - started,
        }
        if kind == "k3":
            metrics["distill/k3"] = mean_divergence(trees, "k3")
        return metrics

    def shutdown(self) -> None:
        self.group.shutdown()
