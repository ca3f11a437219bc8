"""Embedded rollout engine: a transformers causal LM with a radix KV cache, CPU or CUDA.

    engine = LocalEngine("path/to/model")          # float32 on CPU by default
    outs = await engine.generate(GenerateRequest([1, 2, 3], SamplingParams(8, n=4, seed=0)))

How requests run (one scheduler thread, continuous batching):
1. between decode steps, every request that arrived joins the running batch;
2. a request's longest cached prefix comes from the radix cache. If it holds all but the
   last token (a fork after a prefix commit, a child sent with its parent's prefix + output),
   its rows join the batch and feed that token next step. Otherwise the rest of the prompt is
   prefilled (prompts that arrived together and found the same prefix as one batch:
   ``prefill.py``), committed to the cache, and each fork's first token sampled from it;
3. a request with ``n = k`` becomes k rows sharing the prefix KV;
4. rows decode together, one token per step, each row's KV in preallocated per-layer buffers
   (``decode_batch.py``; Llama-family models run a lean forward from their modules). A
   finished row leaves the batch, its sequence (minus the last token, whose KV was never
   computed) enters the cache, and its request returns once all its forks are done. Weight
   changes wait for the batch to drain (no new rows join meanwhile).

Sampling matches SGLang's defaults: logits / temperature, then top-k and top-p, drawn by
inverting the CDF at one uniform number per token from the row's own ``torch.Generator``
(seed ``s + j`` for fork j of a request with seed s; random when no seed), so the same
seed gives the same tokens however requests are batched. The returned logprob of a
sampled token is ``log_softmax(logits / temperature)`` at that token — SGLang's default
(before top-k/top-p renormalisation; temperature 0 = greedy, logprob at T = 1). At
temperature 1 this is the model's own log-probability, which the learner recomputes.

``weight_version`` starts at ``"default"`` (as SGLang's) and becomes the given string on each
weight update, or a counter ``"1"``, ``"2"``, ... when none is given.
"""

from __future__ import annotations

import asyncio
import atexit
import math
import queue
import random
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch

from arbor.engines.embedded.decode_batch import (
    DecodeBatch,
    LlamaDecoder,
    make_decoder,
    sample_rows,
    sample_token,
    token_entropies,
)
from arbor.engines.embedded.jobs import EngineReleased, EngineStats, Job, Row, fail_jobs
from arbor.engines.embedded.lora import MergedAdapters
from arbor.engines.embedded.prefill import Prefill
from arbor.engines.embedded.radix_cache import TOKENS, RadixKVCache
from arbor.engines.types import GenerateOutput, GenerateRequest, SamplingParams


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
        max_prefill_tokens: int = 8192,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        # Any: transformers types .to() on a model as if it could return something else.
        self.model: Any = cast(Any, AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype))
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
        # Prompts into the cache: max_prefill_tokens padded tokens at most in one batched forward.
        self.prefill = Prefill(self.model, self.cache, self.stats, self.device, max_prefill_tokens)
        self.adapters = MergedAdapters(self.model)  # LoRA adapters, merged (engines/embedded/lora.py)
        self._decoder = make_decoder(self.model)
        # Batched prefill reads logits as lm_head(final hidden state), which holds for the
        # layouts LlamaDecoder runs; other models (logit scaling, soft-capping, sliding
        # windows) prefill one prompt per forward through their own forward.
        self._batched_prefill = isinstance(self._decoder, LlamaDecoder)
        # The running rows' KV buffers, kept between batches (allocation is not free).
        self._batch = DecodeBatch(self.device)
        self.weight_version = "default"
        self.released = False
        self.max_batch_rows = max_batch_rows
        self._prefill_failures = 0
        self._updates = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # one decode batch or one weight change at a time
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._hold_admission = threading.Event()  # set while a weight change waits
        self._stopping = False
        self._waiters, self._waiters_lock = 0, threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="arbor-engine", daemon=True)
        self._thread.start()
        # A torch thread still alive at interpreter exit aborts the process ("terminate
        # called without an active exception"): stop it first.
        atexit.register(_stop_at_exit, weakref.ref(self))

    # -- public API -------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        """``request.sampling.n`` continuations of ``request.input_ids``."""
        return await asyncio.wrap_future(self.submit(request))

    async def generate_many(self, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
        return list(await asyncio.gather(*(self.generate(r) for r in requests)))

    def submit(self, request: GenerateRequest) -> Future:
        """Queue a request (thread-safe); the future resolves to ``list[GenerateOutput]``."""
        self.validate(request)
        if self._stopping:
            raise RuntimeError("engine is shut down")
        future: Future = Future()
        self._queue.put(Job(request, future))
        return future

    def generate_sync(self, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
        """Blocking variant for scripts and tests: all requests join the same wave(s)."""
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    def score(self, prompt: list[int], logprob_start_len: int, temperature: float) -> tuple[list[float | None], int]:
        """Input-token log-probs of a prefill-only request and its cached tokens (between decode batches)."""
        from arbor.engines.embedded.scoring import input_logprobs
        self.validate(GenerateRequest(prompt, SamplingParams(0, temperature=temperature)))
        with self._exclusive():
            if self.released:
                raise EngineReleased("engine memory is released; call resume first")
            return input_logprobs(self, prompt, logprob_start_len, temperature)

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
        if sp.n > self.max_batch_rows:
            raise ValueError(f"n must be <= {self.max_batch_rows} (max_batch_rows), got {sp.n}")
        if not math.isfinite(sp.temperature) or sp.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {sp.temperature}")
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
        with self._exclusive():
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
            self.adapters.rebase(list(state))  # new base weights; the served adapter stays on top
            if flush:
                self._new_version(weight_version)
            elif weight_version is not None:
                self.weight_version = weight_version

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Merge the peft LoRA adapter at ``path`` as ``name`` (it is served from now on)."""
        with self._exclusive():
            self.adapters.load(name, path)
            self.cache.flush()  # KV of the old weights must not serve the new ones

    def unload_adapter(self, name: str) -> None:
        with self._exclusive():
            served = name == self.adapters.active
            self.adapters.unload(name)
            if served:  # back to the base weights
                self.cache.flush()

    def flush_cache(self) -> None:
        with self._exclusive():
            self.cache.flush()

    def release_memory(self) -> None:
        """Drop the KV cache and, on CUDA, move the weights to host memory."""
        with self._exclusive():
            self.cache.flush()
            self._batch.release()
            if self.device.type == "cuda":
                self.model.to("cpu")
                torch.cuda.empty_cache()
            self.released = True

    def resume_memory(self) -> None:
        with self._exclusive():
            self.model.to(self.device)
            self.released = False

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the engine between batches: new arrivals stop joining the running batch
        (so it drains), then the caller runs alone."""
        with self._waiters_lock:
            self._waiters += 1
            self._hold_admission.set()
        try:
            with self._lock:
                yield
        finally:
            with self._waiters_lock:
                self._waiters -= 1
                if self._waiters == 0:
                    self._hold_admission.clear()

    def shutdown(self) -> None:
        """Stop the scheduler thread after the running batch (idempotent)."""
        self._stopping = True  # refuse new requests from now on
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30)
        # A request that raced past submit's check while the thread stopped.
        late: deque[Job] = deque()
        self._drain_queue(late)
        fail_jobs(list(late), RuntimeError("engine shut down before running this request"))

    def _new_version(self, weight_version: str | None) -> None:
        # Stale KV computed by the old weights would silently corrupt rollouts.
        self.cache.flush()
        self._updates += 1
        self.weight_version = weight_version if weight_version is not None else str(self._updates)

    # -- scheduler --------------------------------------------------------------------

    def _serve(self) -> None:
        """Scheduler thread: prefill arrivals, decode every active row one token per step."""
        pending: deque[Job] = deque()
        while not self._stopping:
            if not pending:
                job = self._queue.get()
                if job is None:
                    break
                pending.append(job)
            with self._lock:
                batch, rows = self._batch, list[Row]()
                try:
                    self._drain_queue(pending)
                    self._admit(pending, batch, rows)
                    while rows:
                        self._step(batch, rows)
                        # Continuous batching: arrivals join at the next step, unless a
                        # weight update waits for the batch to drain.
                        if not self._hold_admission.is_set():
                            self._drain_queue(pending)
                            self._admit(pending, batch, rows)
                except Exception as exc:  # every caller in the batch gets the error
                    fail_jobs([r.job for r in rows], exc)
                    batch.remove(list(range(batch.size)))
        self._stopping = True
        self._drain_queue(pending)
        fail_jobs(list(pending), RuntimeError("engine shut down before running this request"))

    def _drain_queue(self, pending: deque[Job]) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is None:
                self._stopping = True
            else:
                pending.append(job)

    @torch.no_grad()
    def _admit(self, pending: deque[Job], batch: DecodeBatch, rows: list[Row]) -> None:
        """Prefill waiting jobs (up to ``max_batch_rows`` rows) and add their forks."""
        jobs: list[Job] = []
        taken = len(rows)
        while pending and (taken == 0 or taken + pending[0].request.sampling.n <= self.max_batch_rows):
            jobs.append(pending.popleft())
            taken += jobs[-1].request.sampling.n
        if self.released:
            fail_jobs(jobs, EngineReleased("engine memory is released; call resume first"))
            return
        try:
            hits = self.prefill.batched(jobs) if self._batched_prefill else {}
        except Exception as exc:  # the batch's prompts are bad together: each job prefills alone
            hits = {}
            self._prefill_failures += 1
            if self._prefill_failures == 1:
                import logging

                logging.getLogger(__name__).warning("batched prefill failed (%s); prompts prefill one by one", exc)
        new_kv = []
        # The last cached prefix handed out: one round's forks of a path arrive as
        # consecutive requests with equal prompts, and share one concatenation.
        memo: list[tuple[list[int], torch.Tensor]] = []
        for job in jobs:
            try:
                forks = self._start(job, memo, hits.get(id(job)))
            except Exception as exc:  # this job fails alone
                job.future.set_exception(exc)
                continue
            for row, kv in forks:
                if row.finish_reason is None:
                    rows.append(row)
                    new_kv.append(kv)
                else:
                    self._finish(row, kv)
        batch.add(new_kv)

    def _start(self, job: Job, memo: list[tuple[list[int], torch.Tensor]],
               prefilled: tuple[int, torch.Tensor] | None = None):
        """Prefill ``job``'s prompt; returns its forks as (row, KV ``[2, L, H, T, D]``).

        A prompt cached up to its last token (a fork after a prefix commit, a child
        sent with its parent's prefix + output) needs no prefill call: its rows join the
        batch with the cached KV and feed the last prompt token in the next decode step.
        Otherwise the prompt is prefilled once and each fork's first token is sampled
        from the prefill's logits. ``memo`` holds the last cached prefix handed out in
        this admission (see :meth:`_admit`). ``prefilled``: the prompt ran in this
        admission's :meth:`Prefill.batched` (the tokens it found cached, its last logits).
        """
        request = job.request
        sp, prompt = request.sampling, request.input_ids
        self.stats.requests += 1
        hit = self.cache.match(prompt)
        if sp.max_new_tokens == 0:  # a prefix commit: nothing to sample
            if prefilled is not None and hit.length == len(prompt):
                cached = prefilled[0]
            else:
                cached = hit.length if hit.length == len(prompt) else self.prefill.one(prompt, hit)[2]
            job.outputs, job.remaining = [None] * sp.n, sp.n
            for fork in range(sp.n):  # n empty outputs, so callers get the n they asked for
                self._complete(Row(job, fork, torch.Generator(), cached))
            return []
        job.outputs, job.remaining = [None] * sp.n, sp.n
        # torch seeds are 64-bit: fold any integer into range (fork j adds j).
        base_seed = (sp.seed if sp.seed is not None else self._rng.randrange(1 << 62)) % (1 << 63)
        generators = []
        for fork in range(sp.n):
            generators.append(torch.Generator(device=self.device))
            generators[-1].manual_seed(base_seed + fork)
        if prefilled is not None and hit.length == len(prompt):  # ran in this admission's batch
            kv, logits, cached = hit.kv, prefilled[1], prefilled[0]
        elif len(prompt) > 1 and hit.length >= len(prompt) - 1:
            cached = len(prompt) - 1
            self.stats.cached_tokens += cached
            # One concatenation per prompt; its forks (in this request or in the requests
            # just before it) copy it into their rows.
            if memo and memo[0][0] == prompt:
                kv = memo[0][1]
            else:
                kv = hit.upto(cached).kv
                memo[:] = [(prompt, kv)]
            return [(Row(job, fork, g, cached), kv) for fork, g in enumerate(generators)]
        else:
            kv, logits, cached = self.prefill.one(prompt, hit)
        forks = []
        for fork, generator in enumerate(generators):
            # Forks after the first reuse the whole prefill: all their prompt is cached.
            row = Row(job, fork, generator, cached if fork == 0 else len(prompt))
            self._append_sample(row, logits)
            forks.append((row, kv))
        return forks

    @torch.no_grad()
    def _step(self, batch: DecodeBatch, rows: list[Row]) -> None:
        """Feed every row's last token, sample the next; finished rows leave the batch."""
        # A row without output yet feeds its last prompt token (see _start).
        tokens = torch.tensor(
            [r.output[-1] if r.output else r.prompt[-1] for r in rows], device=self.device
        )
        fresh = sum(1 for r in rows if not r.output)
        self.stats.prefill_tokens += fresh
        logits = self._decoder(batch, tokens)
        self.stats.decode_tokens += len(rows) - fresh
        self.stats.decode_steps += 1
        self.stats.row_steps += len(rows)
        params = [r.job.request.sampling for r in rows]
        tokens_out, logprobs_out = sample_rows(
            logits.float(),
            [sp.temperature for sp in params],
            [sp.top_p for sp in params],
            [sp.top_k for sp in params],
            [r.generator for r in rows],
        )
        # A [B, V] pass more, only for steps where a row asked for entropies.
        wanted = any(sp.return_entropy for sp in params)
        entropies = token_entropies(logits.float(), [sp.temperature for sp in params]) if wanted else None
        done = []
        for b, row in enumerate(rows):
            self._record(row, tokens_out[b], logprobs_out[b], None if entropies is None else entropies[b])
            if row.finish_reason is not None:
                self._finish(row, batch.row_kv(b))
                done.append(b)
        if done:
            rows[:] = [rows[b] for b in batch.remove(done)]

    def _finish(self, row: Row, kv: torch.Tensor) -> None:
        """Cache the row's sequence (prompt + output minus the last token, whose KV was
        never computed) so children hit it, and hand its output to the caller."""
        tokens = row.prompt + row.output[:-1]
        if kv.shape[TOKENS] == len(tokens):
            self.cache.insert(tokens, kv)
        self._complete(row)

    def _complete(self, row: Row) -> None:
        job = row.job
        job.outputs[row.fork] = GenerateOutput(
            output_ids=row.output,
            logprobs=row.logprobs,
            entropies=row.entropies if job.request.sampling.return_entropy else None,
            finish_reason=row.finish_reason or "length",
            prompt_tokens=len(row.prompt),
            cached_tokens=row.cached_tokens,
            weight_version=self.weight_version,
        )
        job.remaining -= 1
        if job.remaining == 0:
            job.future.set_result(list(job.outputs))

    def _append_sample(self, row: Row, logits: torch.Tensor) -> None:
        """Sample one token for ``row`` from ``logits`` ``[V]``."""
        sp = row.job.request.sampling
        entropy = token_entropies(logits[None], [sp.temperature])[0] if sp.return_entropy else None
        self._record(row, *sample_token(logits, sp.temperature, sp.top_p, sp.top_k, row.generator), entropy)

    def _record(self, row: Row, token: int, logprob: float, entropy: float | None = None) -> None:
        """Append a sampled token (and its entropy, when asked for) and update the row's finish state."""
        sp = row.job.request.sampling
        row.output.append(token)
        row.logprobs.append(logprob)
        if entropy is not None:
            row.entropies.append(entropy)
        if token in self.eos_token_ids or token in sp.stop_token_ids:
            row.finish_reason = "stop"
        elif len(row.output) >= sp.max_new_tokens:
            row.finish_reason = "length"


def _stop_at_exit(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()
