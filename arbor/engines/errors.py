"""How engine calls fail: :class:`EngineError` (a request an engine refused or that kept
failing), the retry loop with exponential backoff that :class:`arbor.engines.client.SGLangClient`
wraps its HTTP calls in, and the check of a control call's ``success`` field."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")


class EngineError(RuntimeError):
    """A request an engine refused (4xx) or that kept failing after retries.

    ``unreachable``: the call kept failing to connect, timing out or answering 5xx until
    its retries were spent (the server at ``server`` is dead or stuck: whether to restart
    it is the caller's decision, e.g. a run's :mod:`arbor.run.recovery`).
    ``server``: the base URL of the server that refused or did not answer (None where unknown).
    """

    def __init__(
        self, message: str, *, url: str, status: int | None = None, server: str | None = None,
        unreachable: bool = False,
    ) -> None:
        super().__init__(f"{url}: {message}" + (f" (HTTP {status})" if status else ""))
        self.url, self.status, self.message = url, status, message
        self.server, self.unreachable = server, unreachable


class Retryable(Exception):
    """A 5xx: worth another try."""


async def with_retries(
    attempt: Callable[[], Awaitable[T]], retries: int, backoff_s: float, where: str, server: str | None = None
) -> T:
    """``attempt()`` until it succeeds, at most ``retries`` more times; then an
    ``unreachable`` :class:`EngineError` naming ``where`` (and ``server``, the base URL)."""
    for tries in itertools.count():
        try:
            return await attempt()
        except (Retryable, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            if tries >= retries:
                reason = str(exc) or type(exc).__name__
                raise EngineError(
                    f"failed after {tries + 1} attempts: {reason}", url=where, server=server, unreachable=True
                ) from exc
            await asyncio.sleep(backoff_s * 2**tries)
    raise AssertionError("unreachable")


def check_reply(result: Any, url: str) -> Any:
    if isinstance(result, dict) and result.get("success") is False:
        # SGLang's LoRA endpoints say why in error_message, the others in message.
        raise EngineError(str(result.get("message") or result.get("error_message") or "request failed"), url=url)
    return result
