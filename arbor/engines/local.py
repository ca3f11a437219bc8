"""Embedded rollout engine: a transformers causal LM with a radix KV cache, CPU or CUDA.

    engine = LocalEngine("path/to/model")          # float32 on CPU by default
    outs = await engine.generate(GenerateRequest([1, 2, 3], SamplingParams(8, n=4, seed=0)))

How a batch of requests runs (one scheduler thread, "waves"):
1. every request waiting when a wave starts joins it (the sampler sends a round at once);
2. each request is prefilled alone: its longest cached prefix comes from the radix
   cache, only the rest is computed (at least the last token, for its logits), and the
   whole prompt is committed to the cache — so forks and later children hit;
3. a request with ``n = k`` becomes k rows sharing that one prefill;
4. all rows decode together, one token per step, left-padded to a common KV length with a
   per-row attention mask and explicit position ids; finished rows leave the batch and
   their sequence (prompt + output, minus the last token, whose KV was never computed)
   enters the cache.

Sampling matches SGLang's defaults: logits / temperature, then top-k, then top-p, drawn
with a per-row ``torch.Generator`` (seed ``s + j`` for fork j of a request with seed s), so
the same seed gives the same tokens however requests are batched. The returned logprob
of a sampled token is ``log_softmax(logits / temperature)`` at that token — SGLang's
default (before top-k/top-p renormalisation; temperature 0 = greedy, logprob at T = 1).
At temperature 1 this is the model's own log-probability, which the learner recomputes.

``weight_version`` starts at ``"default"`` (as SGLang's) and becomes the given string on
each weight update, or a counter ``"1"``, ``"2"``, ... when none is given.
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from arbor.engines.radix_cache import RadixKVCache
from arbor.engines.types import GenerateOutput, GenerateRequest


class EngineReleased(RuntimeError):
    """The engine's memory was released; resume it before generating."""


@dataclass
class EngineStats:
    prefill_tokens: int = 0  # prompt tokens computed (not served from the cache)
    cached_tokens: int = 0  # prompt tokens served from the cache
    decode_tokens: int = 0  # tokens fed through the model during decoding
    requests: int = 0


@dataclass
class _Job:
    request: GenerateRequest
    future: Future  # resolves to list[GenerateOutput]


@dataclass
class _Row:
    """One continuation being decoded."""

    job_index: int
    fork: int
    generator: torch.Generator
    prompt: list[int]
    cached_tokens: int
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


class LocalEngine:
    """In-process engine implementing :class:`~arbor.engines.types.RolloutEngine`."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_cached_tokens: int = 1 << 20,
        seed: int = 0,
        max_batch_rows: int = 256,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
        self.model.to(self.device).eval()
        config = self.model.config
        self.vocab_size: int = config.vocab_size
        self.max_context: int = getattr(config, "max_position_embeddings", 1 << 30)
        eos = getattr(config, "eos_token_id", None)
        self.eos_token_ids: set[int] = set(
            eos if isinstance(eos, list) else [eos] if eos is not None else []
        )
        self.cache = RadixKVCache(max_cached_tokens)
        self.stats = EngineStats()
        self.weight_version = "default"
        self.released = False
        self.max_batch_rows = max_batch_rows
        self._updates = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # one wave or one weight change at a time
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="arbor-engine", daemon=True)
        self._thread.start()

    # -- public API -------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        """``request.sampling.n`` continuations of ``request.input_ids``."""
        return await asyncio.wrap_future(self.submit(request))

    async def generate_many(self, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
        return list(await asyncio.gather(*(self.generate(r) for r in requests)))

    def submit(self, request: GenerateRequest) -> Future:
        """Queue a request (thread-safe); the future resolves to ``list[GenerateOutput]``."""
        self.validate(request)
        future: Future = Future()
        self._queue.put(_Job(request, future))
        return future

    def generate_sync(self, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
        """Blocking variant for scripts and tests: all requests join the same wave(s)."""
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    def validate(self, request: GenerateRequest) -> None:
        """Raise ``ValueError`` naming the problem for a request the engine cannot run."""
        ids, sp = request.input_ids, request.sampling
        if not ids:
            raise ValueError("input_ids is empty")
        bad = [
            t
            for t in ids
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise ValueError(f"input_ids has ids outside [0, {self.vocab_size}): {bad[:5]}")
        if sp.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {sp.max_new_tokens}")
        if len(ids) + sp.max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt ({len(ids)}) + max_new_tokens ({sp.max_new_tokens}) exceeds the "
                f"model's context of {self.max_context} tokens"
            )
        if sp.n < 1:
            raise ValueError(f"n must be >= 1, got {sp.n}")
        if sp.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {sp.temperature}")
        if not 0 < sp.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {sp.top_p}")
        if sp.top_k == 0 or sp.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {sp.top_k}")

    def load_weights(
        self,
        source: str | Path | dict[str, torch.Tensor],
        weight_version: str | None = None,
        *,
        flush: bool = True,
    ) -> None:
        """New weights from a model directory or a (possibly partial) state dict.

        Flushes the cache and sets ``weight_version`` (given, else the next counter). With
        ``flush=False`` (a bucket of a larger update, as SGLang's ``flush_cache: false``) the
        cache and version stay until the caller's final bucket or ``flush_cache()``.
        """
        if isinstance(source, (str, Path)):
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(str(source), dtype=self.dtype)
            state = loaded.state_dict()
            strict = True
        else:
            state, strict = source, False
        with self._lock:
            params = self.model.state_dict()
            unknown = sorted(set(state) - set(params))
            if unknown:
                raise ValueError(f"unknown parameter names: {unknown[:5]}")
            for name, tensor in state.items():
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ValueError(
                        f"{name}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}"
                    )
            self.model.load_state_dict(state, strict=strict)
            if flush:
                self._new_version(weight_version)
            elif weight_version is not None:
                self.weight_version = weight_version

    def flush_cache(self) -> None:
        with self._lock:
            self.cache.flush()

    def release_memory(self) -> None:
        """Drop the KV cache and, on CUDA, move the weights to host memory."""
        with self._lock:
            self.cache.flush()
            if self.device.type == "cuda":
                self.model.to("cpu")
                torch.cuda.empty_cache()
            self.released = True

    def resume_memory(self) -> None:
        with self._lock:
            self.model.to(self.device)
            self.released = False

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _new_version(self, weight_version: str | None) -> None:
        # Stale KV computed by the old weights would silently corrupt rollouts.
        self.cache.flush()
        self._updates += 1
        self.weight_version = weight_version if weight_version is not None else str(self._updates)

    # -- scheduler --------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            rows = job.request.sampling.n
            # Everything already waiting joins this wave (up to the row budget).
            while rows < self.max_batch_rows:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                jobs.append(nxt)
                rows += nxt.request.sampling.n
            try:
                with self._lock:
                    if self.released:
                        raise EngineReleased("engine memory is released; call resume first")
                    results = self._run_wave([j.request for j in jobs])
            except Exception as exc:  # the error reaches every caller of this wave
                for j in jobs:
                    j.future.set_exception(exc)
                continue
            for j, result in zip(jobs, results):
                j.future.set_result(result)

    @torch.no_grad()
    def _run_wave(self, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
        rows: list[_Row] = []
        row_kv: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # per row [H, T, D]
        results: list[list[GenerateOutput]] = [[] for _ in requests]
        for index, request in enumerate(requests):
            sp = request.sampling
            keys, values, logits, cached = self._prefill(request.input_ids)
            if sp.max_new_tokens == 0:  # a prefix commit: nothing to sample
                results[index] = [
                    self._output(_Row(index, 0, torch.Generator(), request.input_ids, cached))
                ]
                continue
            base_seed = sp.seed if sp.seed is not None else self._rng.randrange(1 << 62)
            for fork in range(sp.n):
                generator = torch.Generator(device=self.device)
                generator.manual_seed(base_seed + fork)
                # Forks after the first reuse the whole prefill: all their prompt is cached.
                row = _Row(
                    index,
                    fork,
                    generator,
                    request.input_ids,
                    cached if fork == 0 else len(request.input_ids),
                )
                self._append_sample(row, logits, request)
                rows.append(row)
                row_kv.append((keys, values))
        self._decode(rows, row_kv, requests)
        for row in rows:
            results[row.job_index].append(self._output(row))
        self.stats.requests += len(requests)
        return results

    def _prefill(self, prompt: list[int]):
        """KV of ``prompt`` (per layer ``[H, T, D]``), last-position logits ``[V]``, cached count."""
        hit = self.cache.match(prompt)
        cached = min(hit.length, len(prompt) - 1)  # the last token is recomputed for its logits
        if cached > 0:
            past = _make_cache(
                [k[:, :cached].unsqueeze(0) for k in hit.keys],
                [v[:, :cached].unsqueeze(0) for v in hit.values],
            )
        else:
            past = _make_cache([], [])
        rest = torch.tensor([prompt[cached:]], device=self.device)
        positions = torch.arange(cached, len(prompt), device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=rest, position_ids=positions, past_key_values=past, use_cache=True
        )
        keys = [layer.keys[0] for layer in out.past_key_values.layers]
        values = [layer.values[0] for layer in out.past_key_values.layers]
        self.cache.insert(prompt, keys, values)
        self.stats.prefill_tokens += len(prompt) - cached
        self.stats.cached_tokens += cached
        return keys, values, out.logits[0, -1].float(), cached

    def _decode(self, rows: list[_Row], row_kv, requests: list[GenerateRequest]) -> None:
        active = [i for i, row in enumerate(rows) if row.finish_reason is None]
        for i, row in enumerate(rows):
            if row.finish_reason is not None:
                self._commit(row, *row_kv[i])
        if not active:
            return
        # Left-pad every row's KV to a common length; the mask hides the padding.
        lengths = [row_kv[i][0][0].shape[1] for i in active]
        width = max(lengths)
        num_layers = len(row_kv[active[0]][0])
        keys = [
            torch.stack([_pad_left(row_kv[i][0][layer], width) for i in active])
            for layer in range(num_layers)
        ]
        values = [
            torch.stack([_pad_left(row_kv[i][1][layer], width) for i in active])
            for layer in range(num_layers)
        ]
        past = _make_cache(keys, values)
        mask = torch.zeros(len(active), width, dtype=torch.long, device=self.device)
        for b, length in enumerate(lengths):
            mask[b, width - length :] = 1
        pad = [width - length for length in lengths]
        while active:
            batch_rows = [rows[i] for i in active]
            tokens = torch.tensor([[r.output[-1]] for r in batch_rows], device=self.device)
            positions = torch.tensor(
                [[len(r.prompt) + len(r.output) - 1] for r in batch_rows], device=self.device
            )
            mask = torch.cat(
                [mask, torch.ones(len(active), 1, dtype=mask.dtype, device=self.device)], dim=1
            )
            out = self.model(
                input_ids=tokens,
                position_ids=positions,
                attention_mask=mask,
                past_key_values=past,
                use_cache=True,
            )
            self.stats.decode_tokens += len(active)
            logits = out.logits[:, -1].float()
            keep = []
            for b, row in enumerate(batch_rows):
                self._append_sample(row, logits[b], requests[row.job_index])
                if row.finish_reason is None:
                    keep.append(b)
                else:  # its KV (prompt + output minus the last token) enters the cache
                    layers = past.layers
                    self._commit(
                        row,
                        [layer.keys[b, :, pad[b] :] for layer in layers],
                        [layer.values[b, :, pad[b] :] for layer in layers],
                    )
            if len(keep) < len(active):
                index = torch.tensor(keep, device=self.device, dtype=torch.long)
                for layer in past.layers:
                    layer.keys = layer.keys.index_select(0, index)
                    layer.values = layer.values.index_select(0, index)
                mask = mask.index_select(0, index)
                active = [active[b] for b in keep]
                pad = [pad[b] for b in keep]

    def _commit(self, row: _Row, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        tokens = row.prompt + row.output[:-1]
        if keys[0].shape[1] == len(tokens):
            self.cache.insert(tokens, keys, values)

    def _append_sample(self, row: _Row, logits: torch.Tensor, request: GenerateRequest) -> None:
        """Sample one token for ``row`` from ``logits`` ``[V]`` and update its finish state."""
        sp = request.sampling
        token, logprob = _sample(logits, sp.temperature, sp.top_p, sp.top_k, row.generator)
        row.output.append(token)
        row.logprobs.append(logprob)
        if token in self.eos_token_ids or token in sp.stop_token_ids:
            row.finish_reason = "stop"
        elif len(row.output) >= sp.max_new_tokens:
            row.finish_reason = "length"

    def _output(self, row: _Row) -> GenerateOutput:
        return GenerateOutput(
            output_ids=row.output,
            logprobs=row.logprobs,
            finish_reason=row.finish_reason or "length",
            prompt_tokens=len(row.prompt),
            cached_tokens=row.cached_tokens,
            weight_version=self.weight_version,
        )


def _sample(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator
) -> tuple[int, float]:
    """One token from ``logits`` ``[V]``; returns (token, log_softmax(logits / T)[token])."""
    if temperature == 0 or top_k == 1:
        scaled = logits if temperature == 0 else logits / temperature
        token = int(torch.argmax(scaled))
        return token, float(torch.log_softmax(scaled, dim=-1)[token])
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    probs = logprobs.exp()
    if top_k > 0 and top_k < probs.numel():
        threshold = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=0) / sorted_probs.sum()
        # Keep the smallest head whose mass reaches top_p (the first token always stays).
        drop_sorted = (cumulative - sorted_probs / sorted_probs.sum()) >= top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop_sorted, 0.0))
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token])


def _pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``[H, T, D]`` -> ``[H, width, D]`` with zeros in front."""
    missing = width - tensor.shape[1]
    if missing == 0:
        return tensor
    zeros = tensor.new_zeros(tensor.shape[0], missing, tensor.shape[2])
    return torch.cat([zeros, tensor], dim=1)


def _make_cache(keys: list[torch.Tensor], values: list[torch.Tensor]):
    """A ``DynamicCache`` holding per-layer ``[B, H, T, D]`` tensors (empty if none)."""
    from transformers import DynamicCache

    if not keys:
        return DynamicCache()
    return DynamicCache(ddp_cache_data=list(zip(keys, values)))
