"""The records the embedded engine's scheduler keeps: a request's :class:`Job` (its future
and forks), a :class:`Row` being decoded, the engine's counters (:class:`EngineStats`),
and :class:`EngineReleased`, what a request meets while the engine's memory is released."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from arbor.engines.types import GenerateOutput, GenerateRequest


class EngineReleased(RuntimeError):
    """The engine's memory was released; resume it before generating."""


@dataclass
class EngineStats:
    prefill_tokens: int = 0  # prompt tokens computed (not served from the cache)
    cached_tokens: int = 0  # prompt tokens served from the cache
    decode_tokens: int = 0  # tokens fed through the model during decoding
    requests: int = 0
    decode_steps: int = 0  # batched decode forwards
    row_steps: int = 0  # rows summed over decode steps


@dataclass
class Job:
    request: GenerateRequest
    future: Future  # resolves to list[GenerateOutput], one per fork
    outputs: list[GenerateOutput | None] = field(default_factory=list)
    remaining: int = 0  # forks still decoding


@dataclass
class Row:
    """One continuation being decoded."""

    job: Job
    fork: int
    generator: torch.Generator
    cached_tokens: int
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)  # only with sampling.return_entropy
    finish_reason: str | None = None

    @property
    def prompt(self) -> list[int]:
        return self.job.request.input_ids


def fail_jobs(jobs: list[Job], exc: BaseException) -> None:
    for job in jobs:
        if not job.future.done():
            job.future.set_exception(exc)
