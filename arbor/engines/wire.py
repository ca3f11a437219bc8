"""SGLang's native ``/generate`` JSON, both ways: what :class:`~arbor.engines.client.SGLangClient`
sends for a :class:`GenerateRequest` and how it reads the answer; and the rank layout the
weight-update group's requests carry (:func:`rank_layout`).

    generate_payload(GenerateRequest([1, 2, 3], SamplingParams(8, seed=5)))
    # {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, ..., "sampling_seed": 5},
    #  "return_logprob": True}
    parse_output({"output_ids": [4], "meta_info": {"output_token_logprobs": [[-0.5, 4, None]], ...}})

Generation leaves ``logprob_start_len`` at its default: asking for prompt logprobs limits prefix
reuse to that position. Scoring (:func:`score_payload`) asks for it at the first scored token's
context, so only the scored tokens and the one before them are computed.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

from arbor.engines.types import (
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
    ScoreOutput,
    ScoreRequest,
)


def generate_payload(request: GenerateRequest, send_seeds: bool = True) -> dict[str, Any]:
    """The ``/generate`` body SGLang expects for one request."""
    payload: dict[str, Any] = {
        "input_ids": list(request.input_ids),
        "sampling_params": sampling_payload(request.sampling, send_seeds),
        "return_logprob": True,
    }
    if request.sampling.return_entropy:
        payload["top_logprobs_num"] = TOP_LOGPROBS_NUM
    if request.adapter is not None:
        payload["lora_path"] = request.adapter
    return payload


# Log-probs per output token asked of SGLang when a request wants entropies: the entropy is
# estimated from them (entropy_from_top_logprobs). 20 keeps the reply ~20x the size of a
# logprob-only one; the mass beyond the top 20 is small where it matters (peaked tokens).
TOP_LOGPROBS_NUM = 20


def entropy_top_k(sp: SamplingParams) -> int:
    """``top_logprobs_num`` for one request: :data:`TOP_LOGPROBS_NUM` when it wants entropies."""
    return TOP_LOGPROBS_NUM if sp.return_entropy else 0


def entropy_from_top_logprobs(logprobs: list[float]) -> float:
    """Entropy (nats) estimated from the ``k`` largest log-probs of a distribution.

    ``−Σ p_i log p_i`` over the top k, plus the rest of the mass ``r = 1 − Σ p_i`` counted as
    one outcome (``−r log r``): a lower bound, short of the exact entropy by at most
    ``r · log(V − k)`` (the tail spread evenly over the other V − k tokens).
    ``entropy_from_top_logprobs([log 0.5, log 0.25]) == 0.5 log 2 + 0.25 log 4 + 0.25 log 4 = 1.0397``.
    """
    probs = [math.exp(lp) for lp in logprobs if lp > -math.inf]
    rest = max(0.0, 1.0 - sum(probs))
    return -sum(p * math.log(p) for p in probs if p > 0) - (rest * math.log(rest) if rest > 0 else 0.0)


def sampling_payload(sp: SamplingParams, send_seeds: bool = True) -> dict[str, Any]:
    """SGLang's ``sampling_params`` object for ``sp`` (its seed only with ``send_seeds``)."""
    params: dict[str, Any] = {
        "max_new_tokens": sp.max_new_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "n": sp.n,
    }
    if sp.stop_token_ids:
        params["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.seed is not None and send_seeds:
        params["sampling_seed"] = sp.seed
    return params


def fork_items(request: GenerateRequest) -> list[GenerateRequest]:
    """``request`` as ``n`` single-fork requests (fork ``j`` seeded ``seed + j``)."""
    sp = request.sampling
    if sp.n == 1:
        return [request]
    return [
        replace(request, sampling=replace(sp, n=1, seed=None if sp.seed is None else sp.seed + fork))
        for fork in range(sp.n)
    ]


def parse_output(item: dict[str, Any]) -> GenerateOutput:
    """One ``/generate`` result object -> :class:`GenerateOutput`."""
    meta = item.get("meta_info", {})
    token_logprobs = meta.get("output_token_logprobs") or []
    output_ids = item.get("output_ids")
    if output_ids is None:  # older servers: the ids only inside the logprob triples
        output_ids = [entry[1] for entry in token_logprobs]
    finish = meta.get("finish_reason")
    reason = finish.get("type", "abort") if isinstance(finish, dict) else (finish or "abort")
    logprobs = [float(entry[0]) for entry in token_logprobs]
    if len(logprobs) != len(output_ids):
        raise ValueError(f"{len(output_ids)} output ids but {len(logprobs)} logprobs")
    # SGLang's weight_version is the server's at the reply; a request that ran across an
    # update lists its spans ({"version", "start", "end"}, oldest first): the output is as old
    # as its first token's weights (what partial rollouts must tell apart).
    spans = meta.get("weight_versions") or [{"version": meta.get("weight_version", "default")}]
    return GenerateOutput(
        output_ids=list(output_ids),
        logprobs=logprobs,
        finish_reason=reason,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        weight_version=str(spans[0]["version"] if isinstance(spans[0], dict) else spans[0][0]),
        entropies=_entropies(meta, len(output_ids)),
    )


def _entropies(meta: dict[str, Any], tokens: int) -> list[float] | None:
    """Per-token entropies of a reply: exact from arbor's server (``output_token_entropy``),
    estimated from SGLang's ``output_top_logprobs`` (``[[logprob, id, text], ...]`` per token);
    None when the request did not ask (``top_logprobs_num`` 0)."""
    if meta.get("output_token_entropy") is not None:
        values = [float(h) for h in meta["output_token_entropy"]]
    elif meta.get("output_top_logprobs"):
        values = [entropy_from_top_logprobs([float(e[0]) for e in top or []]) for top in meta["output_top_logprobs"]]
    else:
        return None
    if len(values) != tokens:
        raise ValueError(f"{tokens} output ids but {len(values)} per-token entropies")
    return values


def score_payload(requests: list[ScoreRequest]) -> dict[str, Any]:
    """SGLang's batch ``/generate`` body scoring ``requests``: prefill only, input log-probs from
    ``start - 1`` (the row there predicts the first scored token; SGLang's first entry is None).

    >>> score_payload([ScoreRequest([1, 2, 3], start=2, temperature=0.7)])["logprob_start_len"]
    [1]
    """
    for r in requests:
        if not 1 <= r.start <= len(r.input_ids):
            raise ValueError(f"ScoreRequest.start must be in [1, {len(r.input_ids)}], got {r.start}")
    return {
        "input_ids": [list(r.input_ids) for r in requests],
        "sampling_params": [{"max_new_tokens": 0, "temperature": r.temperature} for r in requests],
        "return_logprob": True,
        "logprob_start_len": [r.start - 1 for r in requests],
    }


def parse_score(item: dict[str, Any], request: ScoreRequest) -> ScoreOutput:
    """One reply to :func:`score_payload` -> :class:`ScoreOutput` (the leading None dropped)."""
    meta = item.get("meta_info", {})
    entries = meta.get("input_token_logprobs") or []
    wanted = len(request.input_ids) - request.start
    if len(entries) != wanted + 1:
        raise ValueError(f"asked the log-probs of {wanted} input tokens, got {len(entries)} entries "
                         f"(SGLang gives one more: the first, None)")
    return ScoreOutput(logprobs=[float(e[0]) for e in entries[1:]], prompt_tokens=int(meta.get("prompt_tokens", 0)),
                       cached_tokens=int(meta.get("cached_tokens", 0)))


def error_message(text: str) -> str:
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text[:1000]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return text[:1000]


def rank_layout(tp_sizes: list[int]) -> tuple[int, list[int]]:
    """(world_size, rank_offset of each engine) of a weight-update group: the learner is rank 0,
    then every TP rank of every engine (:mod:`arbor.engines.distributed` builds the group).

    >>> rank_layout([2, 1, 4])
    (8, [1, 3, 4])
    """
    if not tp_sizes or any(size < 1 for size in tp_sizes):
        raise ValueError(f"every engine needs tp_size >= 1, got {tp_sizes}")
    offsets, next_rank = [], 1
    for size in tp_sizes:
        offsets.append(next_rank)
        next_rank += size
    return next_rank, offsets
