"""Pieces of the embedded engine's decode loop: the padded KV batch and token sampling.

Rows of different lengths decode together: each row's KV is left-padded to the batch's
width, a ``[B, W]`` attention mask hides the padding, and the caller passes explicit
position ids (the row's true length), so a padded row computes exactly what it would
alone. Rows join (continuous batching) and leave (finished) between steps.
"""

from __future__ import annotations

import torch


class DecodeBatch:
    """Per-layer KV ``[B, H_kv, W, D]`` of the rows being decoded, left-padded to ``W``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.keys: list[torch.Tensor] = []  # per layer [B, H_kv, W, D]
        self.values: list[torch.Tensor] = []  # per layer [B, H_kv, W, D]
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)  # [B, W], 1 = real
        self.pad: list[int] = []  # left padding of each row

    @property
    def size(self) -> int:
        return len(self.pad)

    def add(self, rows_kv: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
        """Append rows given as (keys, values), per layer ``[H_kv, T_i, D]``."""
        if not rows_kv:
            return
        lengths = [keys[0].shape[1] for keys, _ in rows_kv]
        width = max([self.mask.shape[1], *lengths])
        if self.size and width > self.mask.shape[1]:  # widen the batch on the left
            grow = width - self.mask.shape[1]
            self.keys = [_pad_left(k, width, dim=2) for k in self.keys]
            self.values = [_pad_left(v, width, dim=2) for v in self.values]
            self.mask = _pad_left(self.mask, width, dim=1)
            self.pad = [p + grow for p in self.pad]
        num_layers = len(rows_kv[0][0])
        new_keys = [
            torch.stack([_pad_left(keys[layer], width, dim=1) for keys, _ in rows_kv])
            for layer in range(num_layers)
        ]
        new_values = [
            torch.stack([_pad_left(values[layer], width, dim=1) for _, values in rows_kv])
            for layer in range(num_layers)
        ]
        new_mask = torch.zeros(len(rows_kv), width, dtype=torch.long, device=self.device)
        for b, length in enumerate(lengths):
            new_mask[b, width - length :] = 1
        if self.size:
            self.keys = [torch.cat(pair) for pair in zip(self.keys, new_keys)]
            self.values = [torch.cat(pair) for pair in zip(self.values, new_values)]
            self.mask = torch.cat([self.mask, new_mask])
        else:
            self.keys, self.values, self.mask = new_keys, new_values, new_mask
        self.pad += [width - length for length in lengths]

    def past(self):
        """A ``DynamicCache`` over the batch's KV, with the mask extended for one new token.

        Returns (cache, attention_mask ``[B, W + 1]``); call :meth:`absorb` with the
        cache after the forward to keep the appended KV.
        """
        ones = torch.ones(self.size, 1, dtype=self.mask.dtype, device=self.device)
        return make_cache(self.keys, self.values), torch.cat([self.mask, ones], dim=1)

    def absorb(self, cache, mask: torch.Tensor) -> None:
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]
        self.mask = mask

    def row_kv(self, b: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Row ``b``'s unpadded KV, per layer ``[H_kv, T_b, D]`` (views)."""
        return [k[b, :, self.pad[b] :] for k in self.keys], [
            v[b, :, self.pad[b] :] for v in self.values
        ]

    def keep(self, rows: list[int]) -> None:
        """Keep only the given row indices, in that order."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.mask = self.mask.index_select(0, index)
        self.pad = [self.pad[b] for b in rows]
        if rows:  # drop columns that are padding in every remaining row
            trim = min(self.pad)
            if trim:
                self.keys = [k[:, :, trim:] for k in self.keys]
                self.values = [v[:, :, trim:] for v in self.values]
                self.mask = self.mask[:, trim:]
                self.pad = [p - trim for p in self.pad]
        else:
            self.__init__(self.device)


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


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator
) -> tuple[int, float]:
    """:func:`sample_rows` for one row of logits ``[V]``."""
    tokens, logprobs = sample_rows(logits[None], [temperature], [top_p], [top_k], [generator])
    return tokens[0], logprobs[0]


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zero-pad ``tensor`` at the front of ``dim`` up to ``width``."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def make_cache(keys: list[torch.Tensor], values: list[torch.Tensor]):
    """A transformers ``DynamicCache`` over per-layer ``[B, H_kv, T, D]`` (empty if none)."""
    from transformers import DynamicCache

    if not keys:
        return DynamicCache()
    return DynamicCache(ddp_cache_data=list(zip(keys, values)))
