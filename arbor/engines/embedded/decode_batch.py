"""Pieces of the embedded engine's decode loop: the rows' KV buffers, the one-token forward
over them, and token sampling.

Rows of different lengths decode together. Their KV lives in preallocated per-layer
buffers ``[rows, H_kv, capacity, D]``: row ``b`` holds positions ``[0, lengths[b])``
(right-padded), a step writes each row's new key and value at its own length, in place,
and attends over ``[0, max length]`` with a per-row length mask. Nothing is concatenated
per step, and a row joining (continuous batching) or leaving (finished) copies only its
own KV. The buffers grow (rarely, geometrically) and are reused from batch to batch.

    batch = DecodeBatch(device)
    batch.add([kv])                    # one row: its KV [2, L, H_kv, T, D]
    decoder = make_decoder(model)
    logits = decoder(batch, tokens)    # tokens [B] -> logits [B, V]; lengths grow by 1

``make_decoder`` runs Llama-family models (Llama, Qwen2, Qwen3: pre-norm, rotary, GQA,
full attention) straight from their modules, so a step is a few dozen tensor ops; any
other causal LM runs its own ``forward`` over a ``DynamicCache`` view of the buffers
(correct, but it copies the KV each step as ``DynamicCache`` concatenates).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F


class DecodeBatch:
    """Per-layer KV of the rows being decoded, in buffers written in place."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._empty()

    def _empty(self) -> None:
        device = self.device
        # Keys and values of every layer in one buffer [2, L, row capacity, H_kv, token
        # capacity, D], so a row joins, leaves or is cached with one copy; ``keys[l]`` and
        # ``values[l]`` are its per-layer views [row capacity, H_kv, token capacity, D].
        self.kv: torch.Tensor | None = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []  # KV length of each row = position of its next token
        self._lengths = torch.zeros(0, dtype=torch.long, device=device)  # [row capacity]
        self._rows = torch.zeros(0, dtype=torch.long, device=device)  # arange(row capacity)

    @property
    def size(self) -> int:
        return len(self.lengths)

    def length_tensor(self) -> torch.Tensor:
        """``lengths`` as a tensor ``[B]`` (a view, valid until the batch changes)."""
        return self._lengths[: self.size]

    def row_index(self) -> torch.Tensor:
        """``arange(B)`` on the batch's device (a view)."""
        return self._rows[: self.size]

    def add(self, rows_kv: list[torch.Tensor]) -> None:
        """Append rows given as their KV ``[2, L, H_kv, T_i, D]`` (keys, then values)."""
        if not rows_kv:
            return
        lengths = [kv.shape[3] for kv in rows_kv]
        first = self.size
        self._reserve(first + len(rows_kv), max(lengths) + 1, rows_kv[0])
        assert self.kv is not None
        for b, kv, length in zip(range(first, first + len(rows_kv)), rows_kv, lengths):
            self.kv[:, :, b, :, :length] = kv
        self.lengths += lengths
        self._lengths[first : self.size] = torch.tensor(lengths, device=self.device)

    def reserve_step(self) -> int:
        """Make room for one more token in every row; returns the attended width
        (the longest row's length + 1)."""
        assert self.kv is not None
        width = max(self.lengths) + 1
        self._reserve(self.size, width, self.kv[:, :, 0])
        return width

    def advance(self) -> None:
        """Every row's KV grew by the token just written."""
        self.lengths = [length + 1 for length in self.lengths]
        self._lengths[: self.size] += 1

    def row_kv(self, b: int) -> torch.Tensor:
        """Row ``b``'s KV ``[2, L, H_kv, T_b, D]`` (a view into the buffer)."""
        assert self.kv is not None
        return self.kv[:, :, b, :, : self.lengths[b]]

    def remove(self, done: list[int]) -> list[int]:
        """Drop rows ``done``; returns the old index of each remaining row, in its new
        order. The last rows move into the holes, so only they are copied."""
        if not done:
            return list(range(self.size))
        gone = set(done)
        keep = self.size - len(gone)
        holes = sorted(b for b in gone if b < keep)
        movers = [b for b in range(keep, self.size) if b not in gone]  # as many as holes
        order = list(range(keep))
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        if movers:
            assert self.kv is not None
            width = max(self.lengths[b] for b in movers)
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            view = self.kv[:, :, :, :, :width]
            view.index_copy_(2, dst, view.index_select(2, src))
        self.lengths = [self.lengths[b] for b in order]
        if self.lengths:
            self._lengths[:keep] = torch.tensor(self.lengths, device=self.device)
        return order

    def release(self) -> None:
        """Free the buffers (the batch must be empty)."""
        assert not self.lengths, "release with rows still decoding"
        self._empty()

    def _reserve(self, rows: int, tokens: int, like: torch.Tensor) -> None:
        """Grow the buffer to hold ``rows`` rows of ``tokens`` tokens (``like``: a row's
        KV ``[2, L, H_kv, T, D]`` whose layer count, head count, head size and dtype it
        takes)."""
        old = self.kv
        old_rows, old_tokens = (old.shape[2], old.shape[4]) if old is not None else (0, 0)
        if old is not None and rows <= old_rows and tokens <= old_tokens:
            return
        # Geometric growth of the dimension that ran out: a long batch re-allocates
        # O(log) times, not at every step, and more rows never widen the token axis.
        new_rows = old_rows if rows <= old_rows else max(rows, 2 * old_rows, 4)
        new_tokens = (
            old_tokens
            if tokens <= old_tokens
            else _round_up(max(tokens, old_tokens + old_tokens // 2), 64)
        )
        two, layers, heads, _, head_dim = like.shape
        self.kv = like.new_zeros((two, layers, new_rows, heads, new_tokens, head_dim))
        if old is not None and self.size:
            width = max(self.lengths)
            self.kv[:, :, : self.size, :, :width] = old[:, :, : self.size, :, :width]
        self.keys, self.values = list(self.kv[0]), list(self.kv[1])
        lengths = torch.zeros(new_rows, dtype=torch.long, device=self.device)
        lengths[: self.size] = self._lengths[: self.size]
        self._lengths = lengths
        self._rows = torch.arange(new_rows, device=self.device)


def make_decoder(model: torch.nn.Module) -> LlamaDecoder | HFDecoder:
    """The fastest correct one-token forward for ``model``: :class:`LlamaDecoder` when its
    layout is supported, else :class:`HFDecoder`."""
    return LlamaDecoder(model) if LlamaDecoder.supports(model) else HFDecoder(model)


class LlamaDecoder:
    """One decode step of a Llama-family model (Llama, Qwen2, Qwen3), run from its modules
    over a :class:`DecodeBatch`: the same math as the model's eager forward (RMSNorm,
    rotary, GQA attention with softmax in float32, MLP), minus the per-step masks, cache
    objects and module plumbing that dominate a small model's step."""

    model_types = ("llama", "qwen2", "qwen3")

    def __init__(self, model: torch.nn.Module) -> None:
        # Modules are read at every call: weight loads and .to() stay live. Typed Any: HF's
        # submodules are found by name (model.model.layers[i].self_attn), not by type.
        self.model: Any = cast(Any, model)
        config = self.model.config
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_dim: int = self.model.model.layers[0].self_attn.head_dim

    @classmethod
    def supports(cls, model: torch.nn.Module) -> bool:
        """Llama-family layout with full attention in every layer (no sliding window)
        and one attention scale."""
        base = getattr(model, "model", None)
        if getattr(model.config, "model_type", None) not in cls.model_types or base is None:
            return False
        if not all(
            hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")
        ):
            return False
        for layer in base.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None or getattr(attn, "sliding_window", None) is not None:
                return False
            if not all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
                return False
        # One score scale for all layers: it is folded into the queries' rotary once a step.
        scales = {getattr(layer.self_attn, "scaling", None) for layer in base.layers}
        return hasattr(model, "lm_head") and len(scales) == 1 and None not in scales

    @torch.no_grad()
    def __call__(self, batch: DecodeBatch, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` ``[B]`` (one per row) at each row's length; returns the logits
        ``[B, V]`` and grows every row's KV by one."""
        base = self.model.model
        width = batch.reserve_step()
        lengths, rows = batch.length_tensor(), batch.row_index()
        hidden = base.embed_tokens(tokens)  # [B, E]
        cos, sin = base.rotary_emb(hidden, lengths[:, None])  # [B, 1, D]: the row's position
        # Rotary as x * cos + roll(x, D/2) * (-sin | sin): rotate_half in one op.
        half = self.head_dim // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        scale = base.layers[0].self_attn.scaling
        cos_q, sin_q = cos * scale, sin * scale  # the score scale, applied once to q
        # Row b attends to its own positions 0..lengths[b] (the last one is the new token).
        hidden_cols = torch.arange(width, device=tokens.device) > lengths[:, None]  # [B, W]
        bias = torch.zeros(hidden_cols.shape, dtype=hidden.dtype, device=tokens.device)
        bias = bias.masked_fill_(hidden_cols, float("-inf"))[:, None, None, :]  # [B, 1, 1, W]
        for layer, keys, values in zip(base.layers, batch.keys, batch.values):
            attn = layer.self_attn
            h = _rms_norm(layer.input_layernorm, hidden)
            q = _linear(attn.q_proj, h).view(-1, self.num_heads, self.head_dim)
            k = _linear(attn.k_proj, h).view(-1, self.num_kv_heads, self.head_dim)
            v = _linear(attn.v_proj, h).view(-1, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before rotary
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = torch.addcmul(q * cos_q, q.roll(half, -1), sin_q)  # [B, H, D], scaled
            keys[rows, :, lengths] = torch.addcmul(k * cos, k.roll(half, -1), sin)
            values[rows, :, lengths] = v
            out = _attend(
                q.view(-1, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim),
                keys[: len(rows), :, :width],
                values[: len(rows), :, :width],
                bias,
            )
            hidden = hidden + _linear(attn.o_proj, out.reshape(len(rows), -1))
            hidden = hidden + layer.mlp(_rms_norm(layer.post_attention_layernorm, hidden))
        batch.advance()
        return self.model.lm_head(_rms_norm(base.norm, hidden))


class HFDecoder:
    """One decode step through the model's own ``forward`` (any causal LM): a
    ``DynamicCache`` over the batch's KV (which copies it) and a padding mask, then the
    new token's KV is written back into the batch."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def __call__(self, batch: DecodeBatch, tokens: torch.Tensor) -> torch.Tensor:
        """As :meth:`LlamaDecoder.__call__`."""
        width = batch.reserve_step() - 1  # columns of past KV; the new token comes after
        lengths, rows = batch.length_tensor(), batch.row_index()
        past = make_cache(
            [k[: len(rows), :, :width] for k in batch.keys],
            [v[: len(rows), :, :width] for v in batch.values],
        )
        real = torch.arange(width, device=tokens.device) < lengths[:, None]  # [B, W]
        mask = torch.cat([real, real.new_ones(len(rows), 1)], dim=1).long()  # [B, W + 1]
        out = self.model(
            input_ids=tokens[:, None],
            position_ids=lengths[:, None],
            attention_mask=mask,
            past_key_values=past,
            use_cache=True,
        )
        for layer, keys, values in zip(out.past_key_values.layers, batch.keys, batch.values):
            keys[rows, :, lengths] = layer.keys[:, :, width]
            values[rows, :, lengths] = layer.values[:, :, width]
        batch.advance()
        return out.logits[:, -1]


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Grouped-query attention of one new token per row.

    q ``[B, H_kv, G, D]``, already scaled (query head ``j * G + g`` reads KV head ``j``, as
    ``repeat_kv``),
    keys/values ``[B, H_kv, W, D]``, bias ``[B, 1, 1, W]`` (0 or -inf); returns
    ``[B, H_kv, G, D]``. Softmax in float32, as the eager attention.
    """
    scores = torch.matmul(q, keys.transpose(-1, -2)).add_(bias)  # [B, H_kv, G, W]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for a Llama-style RMSNorm; one fused op in float32."""
    if x.dtype == torch.float32 and hasattr(norm, "variance_epsilon"):
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm(x)  # the module's own upcasting for half precision


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def sample_rows(
    logits: torch.Tensor,
    temperature: list[float],
    top_p: list[float],
    top_k: list[int],
    generators: list[torch.Generator],
) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` ``[B, V]``; returns (tokens, logprobs), each ``[B]``.

    SGLang's order: logits / temperature, then top-k and top-p on the sorted
    probabilities (top-p mass measured before top-k), renormalised. Each row draws one
    uniform number from its own generator and inverts its CDF, so a row's tokens depend
    only on its seed, never on the batch around it. The logprob is under the
    temperature-scaled distribution before top-k / top-p (SGLang's default);
    temperature 0 is greedy with the logprob at T = 1.
    """
    rows, vocab = logits.shape
    device = logits.device
    temps = torch.tensor(temperature, dtype=logits.dtype, device=device)
    greedy = temps == 0
    logprobs = torch.log_softmax(logits / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
    probs = logprobs.exp()
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)
    ps = torch.tensor(top_p, dtype=probs.dtype, device=device)
    if bool((ks < vocab).any() or (ps < 1).any()):
        probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        ranks = torch.arange(vocab, device=device)[None, :]
        # The top token always stays (mass before it is 0 < top_p, rank 0 < k).
        probs = probs.masked_fill((mass_before >= ps[:, None]) | (ranks >= ks[:, None]), 0.0)
    else:
        order = None
    cdf = torch.cumsum(probs, dim=-1)
    uniform = torch.cat([torch.rand(1, generator=g, device=device) for g in generators])
    index = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
    index = index.clamp(max=vocab - 1)
    tokens = index if order is None else order.gather(1, index)
    tokens = torch.where(greedy[:, None], logits.argmax(dim=-1, keepdim=True), tokens)
    chosen = logprobs.gather(1, tokens)
    return tokens[:, 0].tolist(), chosen[:, 0].tolist()


def token_entropies(logits: torch.Tensor, temperature: list[float]) -> list[float]:
    """Entropy in nats of each row's sampling distribution ``softmax(logits / T)`` (``[B, V]``
    logits; T = 0, greedy, is measured at T = 1 like its logprob): the distribution
    :func:`sample_rows` reports log-probs under, before top-k / top-p.

    Uniform logits over 4 tokens give ``log 4 = 1.386``; a one-hot (``[0, -inf, ...]``) gives 0.
    """
    temps = torch.tensor(temperature, dtype=logits.dtype, device=logits.device)
    logprobs = torch.log_softmax(logits / torch.where(temps == 0, 1.0, temps)[:, None], dim=-1)
    # p·log p with p = 0 is 0 (not nan): -inf logits give exp(-inf) · -inf = 0 · -inf.
    terms = torch.where(logprobs.isfinite(), logprobs.exp() * logprobs, torch.zeros_like(logprobs))
    return (-terms.sum(dim=-1)).tolist()


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator
) -> tuple[int, float]:
    """:func:`sample_rows` for one row of logits ``[V]``."""
    tokens, logprobs = sample_rows(logits[None], [temperature], [top_p], [top_k], [generator])
    return tokens[0], logprobs[0]


def make_cache(keys: list[torch.Tensor], values: list[torch.Tensor]):
    """A transformers ``DynamicCache`` over per-layer ``[B, H_kv, T, D]`` (empty if none)."""
    from transformers import DynamicCache

    if not keys:
        return DynamicCache()
    return DynamicCache(ddp_cache_data=list(zip(keys, values)))
