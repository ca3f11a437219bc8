"""Records exchanged with rollout engines, in token ids (never text).

They mirror SGLang's native ``/generate`` API (docs/engines.md): the HTTP client turns
a :class:`GenerateRequest` into ``{"input_ids", "sampling_params", "return_logprob"}``
and the response's ``output_ids`` / ``meta_info`` into :class:`GenerateOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = no top-k (SGLang's convention)
    n: int = 1  # continuations of the same prefix; the radix cache computes the prefix once
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # per-request sampling seed (reproducible trees)
    # Ask for each output token's entropy (GenerateOutput.entropies): exact from the embedded
    # engine, estimated from the top TOP_LOGPROBS_NUM log-probs on SGLang (arbor.engines.wire).
    return_entropy: bool = False


@dataclass
class GenerateRequest:
    input_ids: list[int]  # prompt + every token generated so far on this path
    sampling: SamplingParams
    # Requests with the same key go to the same server so its radix cache hits
    # (e.g. one key per rollout tree). None: any server.
    affinity_key: str | None = None
    # The LoRA adapter to sample from (SGLang's lora_path), one the engine has loaded; None:
    # the base weights. A run names the adapter of the weights it last pushed.
    adapter: str | None = None


@dataclass
class GenerateOutput:
    output_ids: list[int]  # new tokens only
    logprobs: list[float]  # behaviour log-probability of each output token
    finish_reason: str  # "stop" (EOS / stop token) | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the radix cache
    weight_version: str  # the engine's weights when it sampled this
    # Entropy (nats) of the distribution each output token was drawn from (softmax(logits / T),
    # before top-k / top-p), one per output token; None unless SamplingParams.return_entropy.
    entropies: list[float] | None = None


class RolloutEngine(Protocol):
    """What the sampler needs from an engine: one request in, ``n`` outputs back."""

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]: ...


@dataclass
class ScoreRequest:
    """A prefill-only request for the log-probs of tokens the engine did not sample (a teacher
    scoring a student's tokens): ``input_ids[start:]`` each given what precedes it."""

    input_ids: list[int]  # the context, then the tokens to score
    start: int  # index of the first token scored (≥ 1: a token needs a context)
    temperature: float = 1.0  # log-probs of softmax(logits / temperature)
    affinity_key: str | None = None  # as GenerateRequest's: one server holds a tree's prefixes


@dataclass
class ScoreOutput:
    logprobs: list[float]  # log p(input_ids[i] | input_ids[:i]) for i = start .. len - 1
    prompt_tokens: int  # len(input_ids)
    cached_tokens: int  # served from the radix cache: prompt_tokens - cached_tokens were computed
