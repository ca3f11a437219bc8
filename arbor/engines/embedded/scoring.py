"""Input-token log-probs of a prefill-only request: how a teacher scores tokens it did not sample.

SGLang's ``/generate`` with ``"return_logprob": true``, ``"logprob_start_len": k`` and
``max_new_tokens: 0`` returns ``meta_info.input_token_logprobs``: one ``[logprob, id, text]``
entry per input token from position k on, the first one's logprob ``None`` (its logit row is
position k's, which predicts the next token), so entry ``i ≥ 1`` is
``log p(ids[k + i] | ids[:k + i])``. SGLang reuses the radix cache only up to position k (the
rows from k on must be computed); this module does the same, computes the rest and caches the
whole prompt, so a child scored after its parent (``k = len(parent's prefix) - 1``) computes
only its own tokens and the one before them.

    logprobs, cached = input_logprobs(engine, [5, 6, 7, 8], logprob_start_len=1, temperature=1.0)
    # logprobs == [None, log p(7 | 5 6), log p(8 | 5 6 7)]

The log-probs are of ``softmax(logits / temperature)`` (temperature 0: greedy, scored at 1, as
the engine's sampled log-probs), so a teacher's and a student's agree on what they measure.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from arbor.engines.embedded.decode_batch import make_cache
from arbor.engines.embedded.jobs import EngineStats
from arbor.engines.embedded.radix_cache import RadixKVCache, stack_kv


class ScoringEngine(Protocol):
    """What scoring reads of :class:`~arbor.engines.embedded.engine.LocalEngine`."""

    model: Any  # a transformers causal LM
    cache: RadixKVCache
    stats: EngineStats
    device: torch.device


@torch.no_grad()
def input_logprobs(
    engine: ScoringEngine, prompt: list[int], logprob_start_len: int, temperature: float
) -> tuple[list[float | None], int]:
    """SGLang's ``input_token_logprobs`` values for ``prompt[logprob_start_len:]`` and the
    tokens found cached. Call it holding the engine (its weights and cache must not change)."""
    if not 0 <= logprob_start_len < len(prompt):
        raise ValueError(f"logprob_start_len must be in [0, {len(prompt)}) for a prompt of {len(prompt)} "
                         f"tokens, got {logprob_start_len}")
    hit = engine.cache.match(prompt)
    cached = min(hit.length, logprob_start_len)  # the rows from logprob_start_len on are computed
    prefix = hit.upto(cached)
    past_keys: list[torch.Tensor] = []
    past_values: list[torch.Tensor] = []
    if prefix.parts:  # per layer [1, H, T, D]
        past_keys, past_values = (list(half) for half in prefix.kv[:, :, None])
    rest = torch.tensor([prompt[cached:]], device=engine.device)
    positions = torch.arange(cached, len(prompt), device=engine.device).unsqueeze(0)
    out = engine.model(input_ids=rest, position_ids=positions,
                       past_key_values=make_cache(past_keys, past_values), use_cache=True)
    layers = out.past_key_values.layers
    engine.cache.insert(prompt, stack_kv([layer.keys[0] for layer in layers], [layer.values[0] for layer in layers]))
    engine.stats.prefill_tokens += len(prompt) - cached
    engine.stats.cached_tokens += cached
    engine.stats.requests += 1
    # Row j of the logits (position cached + j) predicts token cached + j + 1.
    scored = torch.arange(logprob_start_len + 1, len(prompt), device=engine.device)
    rows = out.logits[0, scored - 1 - cached].float() / (temperature if temperature > 0 else 1.0)
    ids = torch.tensor(prompt, device=engine.device)[scored]
    values = torch.log_softmax(rows, dim=-1).gather(1, ids[:, None])[:, 0]
    return [None, *values.tolist()], cached
