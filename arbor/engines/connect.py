"""Ways to hold an :class:`arbor.engines.client.SGLangClient`: :func:`engine_client` (the
client a run's config describes), :func:`closing` (await a call, then close the client's
session) and :func:`run_sync` (a call from synchronous code, with a fresh client and loop)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from arbor.engines.client import SGLangClient

if TYPE_CHECKING:
    from arbor.config import EngineConfig

T = TypeVar("T")


def engine_client(engine_cfg: EngineConfig, urls: list[str]) -> SGLangClient:
    """The client for a run's engines: ``engine.request_timeout_s``, ``engine.max_retries``
    and the run's key (``engine.api_key``, settled at start-up: :func:`arbor.run.startup.settled`).
    Per-request seeds go only to servers that honour them: SGLang uses them only with
    ``--enable-deterministic-inference`` (``engine.deterministic``)."""
    send_seeds = engine_cfg.deterministic or engine_cfg.kind != "sglang"
    return SGLangClient(urls, timeout_s=engine_cfg.request_timeout_s, max_retries=engine_cfg.max_retries,
                        api_key=engine_cfg.api_key, send_seeds=send_seeds)


async def closing(client: Any, coroutine: Coroutine[Any, Any, T]) -> T:
    """Await ``coroutine``, then close ``client``'s HTTP session (it belongs to this event
    loop): ``asyncio.run(closing(client, client.flush_cache()))`` from synchronous code."""
    try:
        return await coroutine
    finally:
        await client.close()


def run_sync(
    make_call: Callable[[SGLangClient], Awaitable[T]], urls: list[str] | str, **kw: Any
) -> T:
    """Scripts: ``run_sync(lambda c: c.generate(req), urls)`` with a fresh client and loop."""

    async def main() -> T:
        async with SGLangClient(urls, **kw) as client:
            return await make_call(client)

    return asyncio.run(main())
