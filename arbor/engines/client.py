"""Async client for SGLang's native HTTP API, in token ids (also serves `arbor serve`).

    async with SGLangClient(["http://127.0.0.1:30000"]) as client:
        outs = await client.generate(GenerateRequest(prompt_ids, SamplingParams(64, n=4, seed=0)))
        outs[0].output_ids, outs[0].logprobs, outs[0].cached_tokens, outs[0].weight_version

- ``/generate`` gets ``{"input_ids", "sampling_params", "return_logprob": true}``
  (:mod:`arbor.engines.wire` writes and reads SGLang's JSON).
- Several servers: requests with the same ``affinity_key`` (one per rollout tree) always
  go to the same server (rendezvous hashing: adding a server moves only the keys it wins),
  so that server's radix cache holds the tree; requests without a key go round-robin.
- Connection errors, timeouts and 5xx are retried with exponential backoff; a 4xx raises
  :class:`arbor.engines.errors.EngineError` at once with the server's message (retrying cannot fix it).
- ``generate_many`` sends a round as one batch per server, forks as seeded items; a
  multi-fork prompt the server has not cached yet is first committed with
  ``max_new_tokens: 0``, so its forks share one prefill (:class:`arbor.engines.prefix_cache.CachedPrefixes`).
- A call whose retries are spent raises an ``unreachable`` :class:`~arbor.engines.errors.EngineError`
  naming the server; the client restarts nothing (a run's :mod:`arbor.run.recovery` decides that).
- :func:`arbor.engines.connect.engine_client` builds the client a run's config describes (timeouts, retries, key).
- Control calls (weights, cache, memory, health) go to every server; weight pushes run in
  SGLang's sessions (``/begin_weight_update`` ... ``/end_weight_update``), with generation
  paused around them (``/pause_generation`` in ``retract`` mode): SGLang flushes its cache
  only when no request runs, and its running requests resume with their KV recomputed.
- ``/flush_cache``, which SGLang refuses (400) while requests are pending, is retried until
  ``flush_timeout_s``.
- ``send_seeds=False``: no ``sampling_seed`` (SGLang honours seeds only with
  ``--enable-deterministic-inference``, and then samples with a Triton kernel, GPU only).
- ``GenerateRequest.adapter``: the LoRA adapter the request samples from, sent as SGLang's
  ``lora_path`` (one name for a batch, or one per prompt); None: the base weights.
- Every request carries ``Authorization: Bearer <api_key>`` (default:
  ``$ARBOR_ENGINE_API_KEY``; none when unset), the key the run gave its engines.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import time
from collections.abc import Awaitable
from typing import Any

import aiohttp

from arbor.engines.auth import API_KEY_ENV
from arbor.engines.errors import EngineError, Retryable, check_reply, with_retries
from arbor.engines.prefix_cache import CachedPrefixes
from arbor.engines.types import GenerateOutput, GenerateRequest, ScoreOutput, ScoreRequest
from arbor.engines.wire import (
    entropy_top_k,
    error_message,
    fork_items,
    generate_payload,
    parse_output,
    parse_score,
    rank_layout,
    sampling_payload,
    score_payload,
)


class SGLangClient:
    """Implements :class:`~arbor.engines.types.RolloutEngine` over one or more servers."""

    def __init__(
        self,
        urls: list[str] | str,
        *,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_concurrency: int = 1024,
        api_key: str | None = None,
        send_seeds: bool = True,
        flush_timeout_s: float = 120.0,
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("SGLangClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_concurrency = max_concurrency
        self.send_seeds, self.flush_timeout_s = send_seeds, flush_timeout_s
        self._round_robin = itertools.cycle(range(len(self.urls)))
        # Both belong to one event loop; a client used from a new loop (e.g. a second
        # asyncio.run) makes new ones.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self.prefixes = CachedPrefixes()
        # /generate calls sent (a batch is one; retries are not counted): rollout/requests.
        self.generate_calls = 0
        self.api_key = api_key or os.environ.get(API_KEY_ENV)
        self._headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def over(self, urls: list[str]) -> SGLangClient:
        """A client with these settings (timeouts, retries, key) over other servers, e.g. one of them."""
        return SGLangClient(urls, timeout_s=self.timeout_s, max_retries=self.max_retries, backoff_s=self.backoff_s,
                            max_concurrency=self.max_concurrency, api_key=self.api_key, send_seeds=self.send_seeds,
                            flush_timeout_s=self.flush_timeout_s)

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- generation -------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        """``request.sampling.n`` continuations (a list even for ``n = 1``)."""
        url = self.server_for(request.affinity_key)
        body = await self._call(url, "POST", "/generate", generate_payload(request, self.send_seeds))
        items = body if isinstance(body, list) else [body]
        if len(items) != request.sampling.n:
            raise EngineError(f"asked n={request.sampling.n}, got {len(items)} outputs", url=url)
        return [parse_output(item) for item in items]

    async def generate_many(self, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
        """All requests at once, results in order: one batched ``/generate`` per server.

        SGLang's batch form (lists of ``input_ids`` and ``sampling_params``, one result
        per item) requires one ``n`` for the whole batch, so a request for ``n`` forks
        becomes ``n`` items of ``n = 1`` with seeds ``seed, seed + 1, ...`` (what the
        embedded engine gives fork ``j`` of one request; on SGLang it also keeps the
        forks of a seeded request distinct). One call per round of a tree instead of
        one per path: the server admits the round together and the HTTP work shrinks.

        Forks of a prompt the server's cache does not hold yet (a root round, the
        independent baseline, after a flush) would each prefill it: under SGLang's default
        ``fcfs`` schedule requests of one batch do not share an uncached prefix. Such
        prompts are committed first with ``max_new_tokens: 0`` (as SGLang's own parallel
        sampling does), so the forks find them cached.
        """
        by_server: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            by_server.setdefault(self.server_for(request.affinity_key), []).append(i)
        results: list[list[GenerateOutput]] = [[] for _ in requests]

        async def batch(url: str, indices: list[int]) -> None:
            await self._commit_prefixes(url, [requests[i] for i in indices])
            items = [item for i in indices for item in fork_items(requests[i])]
            payload: dict[str, Any] = {
                "input_ids": [list(item.input_ids) for item in items],
                "sampling_params": [sampling_payload(item.sampling, self.send_seeds) for item in items],
                "return_logprob": True,
            }
            if any(item.sampling.return_entropy for item in items):
                payload["top_logprobs_num"] = [entropy_top_k(item.sampling) for item in items]
            payload |= adapter_field(items)
            body = await self._call(url, "POST", "/generate", payload)
            if not isinstance(body, list) or len(body) != len(items):
                got = len(body) if isinstance(body, list) else 1
                raise EngineError(f"sent a batch of {len(items)} prompts, got {got} outputs", url=url)
            outputs = iter(parse_output(item) for item in body)
            for i in indices:
                results[i] = [next(outputs) for _ in range(requests[i].sampling.n)]
                for out in results[i]:
                    self.prefixes.add(url, [*requests[i].input_ids, *out.output_ids], out.weight_version)

        await asyncio.gather(*(batch(url, indices) for url, indices in by_server.items()))
        return results

    async def score_many(self, requests: list[ScoreRequest]) -> list[ScoreOutput]:
        """Input-token log-probs of each request (prefill only; :func:`arbor.engines.wire.score_payload`),
        results in order: one batched ``/generate`` per server. A request whose context another
        scored before (its parent node) finds it in the server's radix cache: send parents in an
        earlier call than their children."""
        by_server: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            by_server.setdefault(self.server_for(request.affinity_key), []).append(i)
        results: list[ScoreOutput | None] = [None] * len(requests)

        async def batch(url: str, indices: list[int]) -> None:
            body = await self._call(url, "POST", "/generate", score_payload([requests[i] for i in indices]))
            replies = body if isinstance(body, list) else [body]
            if len(replies) != len(indices):
                raise EngineError(f"sent {len(indices)} prompts to score, got {len(replies)} replies", url=url)
            for i, reply in zip(indices, replies):
                results[i] = parse_score(reply, requests[i])

        await asyncio.gather(*(batch(url, indices) for url, indices in by_server.items()))
        return [r for r in results if r is not None]

    async def _commit_prefixes(self, url: str, requests: list[GenerateRequest]) -> None:
        """Put the uncached prompts of multi-fork ``requests`` into ``url``'s cache."""
        uncached: dict[tuple[str | None, tuple[int, ...]], GenerateRequest] = {}
        for request in requests:
            if request.sampling.n > 1 and not self.prefixes.holds(url, list(request.input_ids)):
                uncached.setdefault((request.adapter, tuple(request.input_ids)), request)
        if not uncached:
            return
        prompts = list(uncached.values())
        payload = {"input_ids": [list(r.input_ids) for r in prompts], "sampling_params": {"max_new_tokens": 0}}
        body = await self._call(url, "POST", "/generate", payload | adapter_field(prompts))
        replies = body if isinstance(body, list) else [body]
        for request, reply in zip(prompts, replies):
            self.prefixes.add(url, list(request.input_ids), parse_output(reply).weight_version)

    def server_for(self, affinity_key: str | None) -> str:
        """The server a request goes to: rendezvous hash of the key, else round-robin."""
        if affinity_key is None or len(self.urls) == 1:
            return self.urls[next(self._round_robin)]

        def score(url: str) -> bytes:
            return hashlib.blake2b(f"{affinity_key}|{url}".encode(), digest_size=8).digest()

        return max(self.urls, key=score)

    # -- control calls (every server) -------------------------------------------------

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None
    ) -> list[Any]:
        payload: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        self.prefixes.forget()
        return await self._all("POST", "/update_weights_from_disk", payload, check_success=True)

    async def load_lora_adapter(self, name: str, path: str) -> list[Any]:
        """Every server loads the peft adapter directory ``path`` as ``name`` (SGLang needs
        ``--enable-lora``); requests naming ``name`` then use it."""
        self.prefixes.forget()
        return await self._all("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path},
                               check_success=True)

    async def unload_lora_adapter(self, name: str) -> list[Any]:
        return await self._all("POST", "/unload_lora_adapter", {"lora_name": name}, check_success=True)

    async def update_weight_version(self, version: str) -> list[Any]:
        """Every server reports ``version`` from now on (in-flight requests keep running)."""
        return await self._all("POST", "/update_weight_version",
                               {"new_version": version, "abort_all_requests": False}, check_success=True)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        *,
        tp_sizes: list[int] | None = None,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> list[Any]:
        """Every TP rank of server i joins as rank ``rank_offset_i + tp_rank`` (the learner is
        rank 0): world_size = 1 + Σ tp_size, rank_offset_i = 1 + Σ_{j<i} tp_size_j.

        Blocks on the servers until the learner opens its side of the group too: run the
        learner's ``open_group(..., rank=0)`` concurrently with this call.
        """
        world_size, offsets = rank_layout(tp_sizes or [1] * len(self.urls))
        if len(offsets) != len(self.urls):
            raise ValueError(f"{len(offsets)} tp_sizes for {len(self.urls)} servers")
        calls = [
            self._call(
                url,
                "POST",
                "/init_weights_update_group",
                {
                    "master_address": master_address,
                    "master_port": master_port,
                    "rank_offset": offset,
                    "world_size": world_size,
                    "group_name": group_name,
                    "backend": backend,
                },
                retries=0,
            )
            for url, offset in zip(self.urls, offsets)
        ]
        return [check_reply(r, url) for r, url in zip(await asyncio.gather(*calls), self.urls)]

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = "weight_update_group",
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> list[Any]:
        """Servers receive the tensors the learner then broadcasts (run both concurrently);
        ``load_format: "flattened_bucket"``: all of them as one flat broadcast."""
        payload: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if flush_cache:
            self.prefixes.forget()
        # Never retried: a half-received broadcast cannot be replayed.
        return await self._all(
            "POST", "/update_weights_from_distributed", payload, check_success=True, retries=0
        )

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._all(
            "POST", "/destroy_weights_update_group", {"group_name": group_name}, check_success=True
        )

    async def begin_weight_update(self) -> list[str]:
        """Open a weight-update session on every server (SGLang >= 0.5.22 refuses updates
        outside one); the URLs where one opened (an older server answers 404: skipped)."""

        return await self._where_routed("/begin_weight_update", {}, check=True)

    async def end_weight_update(self, urls: list[str]) -> None:
        """Close the sessions :meth:`begin_weight_update` opened on ``urls``."""
        replies = await asyncio.gather(
            *(self._call(url, "POST", "/end_weight_update", {}, retries=0) for url in urls)
        )
        for reply, url in zip(replies, urls):
            check_reply(reply, url)

    async def flush_cache(self) -> None:
        """Flush every server's cache; SGLang answers 400 while requests are pending (also
        for a moment after the last response): asked again until ``flush_timeout_s``."""
        self.prefixes.forget()

        async def flush(url: str) -> None:
            deadline = time.monotonic() + self.flush_timeout_s
            for tries in itertools.count():
                try:
                    await self._call(url, "POST", "/flush_cache", {})
                    return
                except EngineError as exc:
                    if exc.status != 400 or time.monotonic() > deadline:
                        raise
                await asyncio.sleep(min(1.0, 0.05 * 2**tries))

        await asyncio.gather(*map(flush, self.urls))

    async def pause_generation(self) -> list[str]:
        """Pause generation on every server that can (SGLang, ``retract`` mode: running requests
        go back to its queue, to resume after :meth:`continue_generation` with their KV
        recomputed), so that a weight update may flush the cache; the URLs paused (a server
        without the route, e.g. ``arbor serve``, answers 404 and drains on its own)."""

        return await self._where_routed("/pause_generation", {"mode": "retract"}, check=False)

    async def _where_routed(self, path: str, body: dict[str, Any], check: bool) -> list[str]:
        """POST ``body`` to ``path`` on every server once; the URLs that have the route (a 404
        is a server without it, skipped; any other error raises)."""

        async def post(url: str) -> str | None:
            try:
                reply = await self._call(url, "POST", path, body, retries=0)
            except EngineError as exc:
                if exc.status != 404:
                    raise
                return None
            if check:
                check_reply(reply, url)
            return url

        return [url for url in await asyncio.gather(*map(post, self.urls)) if url is not None]

    async def continue_generation(self, urls: list[str]) -> None:
        """Resume what :meth:`pause_generation` paused on ``urls``."""
        await asyncio.gather(*(self._call(url, "POST", "/continue_generation", {}) for url in urls))

    async def release_memory_occupation(self) -> None:
        self.prefixes.forget()  # SGLang flushes its cache when it releases the KV memory
        await self._all("POST", "/release_memory_occupation", {})

    async def resume_memory_occupation(self) -> None:
        await self._all("POST", "/resume_memory_occupation", {})

    async def model_info(self) -> list[dict[str, Any]]:
        """``/model_info`` of each server (``/get_model_info`` on older SGLang)."""
        return await self._get_renamed("/model_info", "/get_model_info")

    async def server_info(self) -> list[dict[str, Any]]:
        """``/server_info`` of each server (``/get_server_info`` on older SGLang): its
        launch arguments (``tp_size``, ``dp_size``, ...) and ``version``."""
        return await self._get_renamed("/server_info", "/get_server_info")

    async def _get_renamed(self, path: str, older_path: str) -> list[Any]:
        """GET ``path`` on every server, ``older_path`` where the server answers 404."""
        try:
            return await self._all("GET", path, None)
        except EngineError as exc:
            if exc.status != 404:
                raise
            return await self._all("GET", older_path, None)

    async def get_weight_version(self) -> list[str]:
        """Each server's weight version (``/get_weight_version``, else ``/model_info``'s)."""
        try:
            replies = await self._all("GET", "/get_weight_version", None)
        except EngineError as exc:
            if exc.status != 404:
                raise
            replies = await self.model_info()
        return [str(r["weight_version"]) for r in replies]

    async def health(self) -> bool:
        """True when every server answers ``/health`` with 200 (no retries)."""
        try:
            await self._all("GET", "/health", None, retries=0)
        except (EngineError, aiohttp.ClientError, asyncio.TimeoutError):
            return False
        return True

    async def wait_healthy(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"servers {self.urls} not healthy after {timeout_s:.0f} s")
            await asyncio.sleep(poll_s)

    # -- transport --------------------------------------------------------------------

    async def _all(
        self,
        method: str,
        path: str,
        payload: Any,
        *,
        check_success: bool = False,
        retries: int | None = None,
    ) -> list[Any]:
        calls = [self._call(url, method, path, payload, retries=retries) for url in self.urls]
        results = await asyncio.gather(*calls)
        if check_success:
            results = [check_reply(r, url) for r, url in zip(results, self.urls)]
        return list(results)

    async def _call(
        self, url: str, method: str, path: str, payload: Any, *, retries: int | None = None
    ) -> Any:
        """One HTTP call with retries; returns the decoded JSON (or text) body."""
        retries = self.max_retries if retries is None else retries
        self.generate_calls += path == "/generate"
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._session = loop, None
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        assert self._semaphore is not None

        def attempt() -> Awaitable[Any]:
            return self._once(url, method, path, payload)  # url: the recovered server's, after recovery

        async with self._semaphore:
            return await with_retries(attempt, retries, self.backoff_s, url + path, server=url)

    async def _once(self, url: str, method: str, path: str, payload: Any) -> Any:
        if self._session is None or self._session.closed:
            # aiohttp's default pool holds 100 connections; a request holds one for its
            # whole generation, so a round with more paths than that would run in waves
            # (the rest waiting a whole segment for a free connection). The semaphore is
            # the only bound.
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(limit=self.max_concurrency),
                headers=self._headers,
            )
        async with self._session.request(method, url + path, json=payload) as response:
            text = await response.text()
            if response.status >= 500:
                raise Retryable(f"HTTP {response.status}: {text[:500]}")
            if response.status in (401, 403):
                raise EngineError(
                    f"{error_message(text)}: the engine requires a bearer key; give the client the "
                    f"run's key (engine.api_key or ${API_KEY_ENV})", url=url + path, status=response.status,
                )
            if response.status >= 400:
                raise EngineError(error_message(text), url=url + path, status=response.status, server=url)
            if response.content_type == "application/json":
                return await response.json()
            return text


def adapter_field(requests: list[GenerateRequest]) -> dict[str, Any]:
    """The ``lora_path`` of a batch: one name when every request names the same adapter (none
    when that is the base weights), else one per prompt (SGLang takes either)."""
    names = [r.adapter for r in requests]
    if len(set(names)) == 1:
        return {} if names[0] is None else {"lora_path": names[0]}
    return {"lora_path": names}
