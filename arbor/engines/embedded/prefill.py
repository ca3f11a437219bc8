"""Prefill for the embedded engine (engine.py): prompts' KV into the radix cache, and the
last-position logits their first tokens are sampled from.

    prefill = Prefill(model, cache, stats, device, max_prefill_tokens=8192)
    kv, logits, cached = prefill.one(prompt, cache.match(prompt))   # one prompt, the model's forward
    ran = prefill.batched(jobs)   # {id(job): (tokens found cached, logits [V])}, batched forwards

``one`` runs any model through its own forward; ``batched`` reads logits as lm_head(final
hidden state), which holds for the layouts ``decode_batch.LlamaDecoder`` runs (the engine
uses it for those only). Both run the part of the prompt the cache does not hold, over the
cached prefix's KV, and count prefilled and cached tokens in ``stats``.
"""

from __future__ import annotations

from typing import Any

import torch

from arbor.engines.embedded.decode_batch import make_cache
from arbor.engines.embedded.jobs import EngineStats, Job
from arbor.engines.embedded.radix_cache import PrefixHit, RadixKVCache, stack_kv


class Prefill:
    """The engine's prompts into its cache; ``max_prefill_tokens`` padded tokens at most in one
    batched forward."""

    def __init__(self, model: Any, cache: RadixKVCache, stats: EngineStats, device: torch.device,
                 max_prefill_tokens: int) -> None:
        self.model, self.cache, self.stats, self.device = model, cache, stats, device
        self.max_prefill_tokens = max_prefill_tokens

    def batched(self, jobs: list[Job]) -> dict[int, tuple[int, torch.Tensor]]:
        """Prefill, in batched forwards, the prompts of ``jobs`` that the cache does not hold
        up to their last token (prefix commits: up to their end), and cache them.

        Returns ``{id(job): (tokens its prompt found cached, last-position logits [V])}`` for
        the jobs whose prompt ran. The prompts of one admission that found the same cached
        prefix run as one right-padded batch over that prefix's KV with a causal mask (a real
        token never sees the padding after it). A prompt equal to another of the admission,
        or inside a longer one, does not run: it finds the cache filled, as it would after
        the other one ran alone.
        """
        # (job id, prompt, the cached prefix it found: at most all but its last token)
        wanted: list[tuple[int, list[int], PrefixHit]] = []
        for job in jobs:
            prompt, sp = job.request.input_ids, job.request.sampling
            commit = sp.max_new_tokens == 0
            if len(prompt) < 2 and not commit:
                continue  # one token: nothing to cache ahead of the first sample
            hit = self.cache.match(prompt)
            if hit.length < len(prompt) - (0 if commit else 1):
                wanted.append((id(job), prompt, hit.upto(min(hit.length, len(prompt) - 1))))
        # cached prefix -> its hit (the KV every chunk runs over, without a second cache
        # walk) and the prompts to run over it
        groups: dict[tuple[int, ...], tuple[PrefixHit, list[list[int]]]] = {}
        owner: dict[tuple[int, ...], int] = {}  # a prompt that runs -> the first job that asked
        for job_id, prompt, hit in sorted(wanted, key=lambda w: -len(w[1])):
            _, group = groups.setdefault(tuple(prompt[: hit.length]), (hit, []))
            if not any(other[: len(prompt)] == prompt for other in group):
                group.append(prompt)
                owner[tuple(prompt)] = job_id
        found = {job_id: hit.length for job_id, _, hit in wanted}
        result: dict[int, tuple[int, torch.Tensor]] = {}
        for prefix, prompts in groups.values():
            prompts.sort(key=len)
            start = 0
            while start < len(prompts):  # chunks of at most max_prefill_tokens padded tokens
                end = start + 1
                while end < len(prompts) and (end + 1 - start) * (len(prompts[end]) - prefix.length) <= self.max_prefill_tokens:
                    end += 1
                logits = self.group(prefix, prompts[start:end])
                for prompt, row in zip(prompts[start:end], logits):
                    job_id = owner[tuple(prompt)]
                    result[job_id] = (found[job_id], row)
                start = end
        return result

    def group(self, prefix: PrefixHit, prompts: list[list[int]]) -> torch.Tensor:
        """Cache the KV of ``prompts`` (each starting with the tokens of the cached ``prefix``);
        their last-position logits ``[B, V]``."""
        cached = prefix.length
        past_keys: list[torch.Tensor] = []
        past_values: list[torch.Tensor] = []
        width = len(prompts)
        if cached:  # per layer [B, H, T, D], one shared copy
            kv = prefix.kv
            past_keys = [k[None].expand(width, -1, -1, -1) for k in kv[0]]
            past_values = [v[None].expand(width, -1, -1, -1) for v in kv[1]]
        longest = max(len(p) for p in prompts) - cached
        rest = torch.zeros((width, longest), dtype=torch.long, device=self.device)
        for i, prompt in enumerate(prompts):
            rest[i, : len(prompt) - cached] = torch.tensor(prompt[cached:])
        positions = torch.arange(cached, cached + longest, device=self.device).expand(width, -1)
        out = self.model.base_model(
            input_ids=rest, position_ids=positions, past_key_values=make_cache(past_keys, past_values), use_cache=True
        )
        last = torch.tensor([len(p) - cached - 1 for p in prompts], device=self.device)
        hidden = out.last_hidden_state[torch.arange(width, device=self.device), last]
        logits = self.model.get_output_embeddings()(hidden).float()
        layers = out.past_key_values.layers
        for i, prompt in enumerate(prompts):
            n = len(prompt)
            self.cache.insert(prompt, stack_kv([layer.keys[i, :, :n] for layer in layers],
                                               [layer.values[i, :, :n] for layer in layers]))
            self.stats.prefill_tokens += n - cached
            self.stats.cached_tokens += cached
        return logits

    def one(self, prompt: list[int], hit: PrefixHit) -> tuple[torch.Tensor, torch.Tensor, int]:
        """KV of ``prompt`` ``[2, L, H, T, D]``, last-position logits ``[V]``, cached count."""
        cached = min(hit.length, len(prompt) - 1)  # the last token is recomputed for its logits
        prefix = hit.upto(cached)
        past_keys: list[torch.Tensor] = []
        past_values: list[torch.Tensor] = []
        if prefix.parts:  # per layer [1, H, T, D]
            past_keys, past_values = (list(half) for half in prefix.kv[:, :, None])
        past = make_cache(past_keys, past_values)
        rest = torch.tensor([prompt[cached:]], device=self.device)
        positions = torch.arange(cached, len(prompt), device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=rest, position_ids=positions, past_key_values=past, use_cache=True
        )
        layers = out.past_key_values.layers
        kv = stack_kv([layer.keys[0] for layer in layers], [layer.values[0] for layer in layers])
        self.cache.insert(prompt, kv)
        self.stats.prefill_tokens += len(prompt) - cached
        self.stats.cached_tokens += cached
        return kv, out.logits[0, -1].float(), cached
