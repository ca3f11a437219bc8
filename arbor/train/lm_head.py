"""Token log-probabilities and entropies through the LM head, in float32, in token chunks.

A policy loss needs, per trained token, log p(token) and the entropy of the next-token
distribution at temperature T: both come from ``softmax(logits / T)``. Two rules hold
wherever a probability is formed here:

- **float32 or wider.** Logits are cast up before the division by T and the softmax; a
  bf16 model's log-probs would otherwise be quantised (steps of 0.0625 near −10), which
  turns importance ratios into percent-level noise.
- **Bounded memory.** ``[tokens, vocab]`` logits of a 32k-token pack and a 152k
  vocabulary are ~20 GB per float32 copy, and autograd keeps about three. With
  ``chunk_tokens`` > 0 the head runs ``chunk_tokens`` rows at a time inside one autograd
  function that keeps no logits: the backward recomputes one chunk's logits at a time
  (one extra head matmul) and forms the exact gradient from them (the technique of
  Liger's fused linear cross-entropy, here for log-probs and entropy whose upstream
  gradients are only known in the backward).

The chunked head runs *inside* the LM head module's own call (a forward pre-hook hands
it one row, a forward hook swaps the output for the scores), so DeepSpeed ZeRO-3 gathers
the head's weight for the forward and again before the backward exactly as for a plain
head, and every rank issues the same collectives whatever its number of chunks.

    with chunked_head(head, targets, temperature=0.7, chunk_tokens=1024):
        scores = model(..., logits_to_keep=rows).logits[0]    # [M, 2]: log p, entropy
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

# Config attributes of models that transform the head's output (Gemma 2's soft cap, Cohere's
# logit scale, Granite's scaling): their logits are not head(hidden), so the chunked path
# would be silently wrong for them; they use whole logits.
_POST_HEAD_ATTRIBUTES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def chunkable_head(model: PreTrainedModel) -> torch.nn.Linear | None:
    """The model's output layer when logits are exactly ``head(final hidden state)``, else None."""
    model = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return None
    config = model.config
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _POST_HEAD_ATTRIBUTES):
        return None
    return head


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype probabilities are formed in: float32, or wider when the model is wider."""
    return torch.promote_types(dtype, torch.float32)


def logprobs_and_entropy(
    logits: torch.Tensor,  # [M, V] any float dtype
    targets: torch.Tensor,  # [M] int64
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy of softmax(logits / T), both [M], float32 or wider.

    >>> logprobs_and_entropy(torch.zeros(1, 4), torch.tensor([2]))  # uniform over 4
    (tensor([-1.3863]), tensor([1.3863]))
    """
    check_temperature(temperature)
    logits = logits.to(score_dtype(logits.dtype))
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def check_temperature(temperature: float) -> None:
    """Log-probs of softmax(logits / T) exist for T > 0 only (T = 0 is greedy sampling)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probabilities, got {temperature}")


def _scaled_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """[c, V] logits / T in the score dtype (the head's matmul in the model's dtype, as a plain head)."""
    logits = F.linear(hidden, weight, bias).to(score_dtype(hidden.dtype))
    return logits.div_(temperature) if temperature != 1.0 else logits


class _ChunkedHeadScores(torch.autograd.Function):
    """(log p(target), entropy) of softmax(head(hidden) / T), chunk by chunk, exact gradients.

    Saves hidden, the weight and two floats per row (log-sum-exp, entropy); no [M, V].
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # [M, H]
        weight: torch.Tensor,  # [V, H]
        bias: torch.Tensor | None,  # [V]
        targets: torch.Tensor,  # [M] int64
        temperature: float,
        chunk_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = hidden.shape[0]
        dtype = score_dtype(hidden.dtype)
        logp = torch.empty(rows, dtype=dtype, device=hidden.device)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        for s in range(0, rows, chunk_tokens):
            e = min(s + chunk_tokens, rows)
            logp_all = _scaled_logits(hidden[s:e], weight, bias, temperature)
            lse[s:e] = torch.logsumexp(logp_all, dim=-1)
            logp_all.sub_(lse[s:e, None])  # in place: two [c, V] buffers at most
            logp[s:e] = logp_all.gather(-1, targets[s:e, None])[:, 0]
            entropy[s:e] = -logp_all.exp().mul_(logp_all).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, grad_entropy: torch.Tensor) -> tuple:
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk_tokens = ctx.temperature, ctx.chunk_tokens
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        # Any: each is a tensor exactly when its need_* flag is set (the loop checks the flag).
        grad_hidden: Any = torch.empty_like(hidden) if need_hidden else None
        # Chunks' weight gradients are summed in the score dtype, then cast once.
        grad_weight: Any = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_weight else None
        grad_bias: Any = torch.zeros(bias.shape, dtype=lse.dtype, device=bias.device) if need_bias else None
        for s in range(0, hidden.shape[0], chunk_tokens):
            e = min(s + chunk_tokens, hidden.shape[0])
            g_logp, g_ent = grad_logp[s:e, None].to(lse.dtype), grad_entropy[s:e, None].to(lse.dtype)
            logp_all = _scaled_logits(hidden[s:e], weight, bias, temperature).sub_(lse[s:e, None])
            probs = logp_all.exp()
            # d log p_t / dz_k = [k = t] − p_k;  dH / dz_k = −p_k (log p_k + H)  (z = logits / T)
            grad = probs.mul_(logp_all.add_(entropy[s:e, None]).mul_(g_ent).add_(g_logp)).neg_()
            grad.scatter_add_(-1, targets[s:e, None], g_logp)
            if temperature != 1.0:
                grad.div_(temperature)
            grad_logits = grad.to(weight.dtype)
            if need_hidden:
                grad_hidden[s:e] = grad_logits @ weight
            if need_weight and grad_weight.dtype == grad_logits.dtype:
                grad_weight.addmm_(grad_logits.T, hidden[s:e])  # in place: no [V, H] temporary
            elif need_weight:
                grad_weight += grad_logits.T @ hidden[s:e]
            if need_bias:
                grad_bias += grad.sum(0)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if need_weight else None,
            grad_bias.to(bias.dtype) if need_bias else None,
            None, None, None,
        )


def head_logprobs(
    hidden: torch.Tensor,  # [M, H] final hidden states (after the last norm)
    head: torch.nn.Linear,
    targets: torch.Tensor,  # [M] int64 next tokens
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and entropy per row, ([M], [M]), without materialising [M, V] logits.

    ``chunk_tokens`` ≤ 0 computes whole logits (the reference, through autograd).
    """
    check_temperature(temperature)
    if chunk_tokens <= 0:
        return logprobs_and_entropy(head(hidden), targets, temperature)
    return _ChunkedHeadScores.apply(hidden, head.weight, head.bias, targets, temperature, chunk_tokens)


@contextmanager
def chunked_head(
    head: torch.nn.Linear,
    targets: torch.Tensor,  # [M] int64: the tokens the M kept rows predict
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    rows: torch.Tensor | None = None,  # [M] int64 flat rows of a batched input, or None
) -> Iterator[None]:
    """While active, ``head`` called on [1, M, H] returns [1, M, 2] scores (log p, entropy).

    The pre-hook hands the head's own matmul a single row (so the model's forward never
    forms [M, V] logits); the forward hook, registered to run before any other (ZeRO-3's
    release of the gathered weight among them), computes the chunked scores from the
    real hidden states with the weight as it is during the module's call.

    ``rows``: the head is called on a batch [B, K, H] (sibling rows of a depth-first walk,
    :mod:`arbor.train.dfs`) and scores the rows ``rows`` of its [B·K] positions, in that order.
    """
    check_temperature(temperature)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be ≥ 1, got {chunk_tokens}")
    stash: list[torch.Tensor] = []

    def shrink_input(module: torch.nn.Module, args: tuple) -> tuple:
        (hidden,) = args
        stash.append(hidden if rows is None else hidden.reshape(1, -1, hidden.shape[-1])[:, rows])
        return (hidden[:, :1],)

    def scores_as_output(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        hidden = stash.pop()
        if hidden.shape[0] != 1 or hidden.shape[1] != targets.shape[0]:
            raise ValueError(f"chunked head: hidden {tuple(hidden.shape)} for {targets.shape[0]} targets")
        # chunk_tokens ≥ 1: head_logprobs does not call head(...), which would re-enter these hooks.
        logp, entropy = head_logprobs(hidden[0], head, targets, temperature=temperature, chunk_tokens=chunk_tokens)
        return torch.stack([logp, entropy], dim=-1)[None]

    handles = [
        head.register_forward_pre_hook(shrink_input),
        head.register_forward_hook(scores_as_output, prepend=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
