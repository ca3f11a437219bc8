"""Where an agent's ``step`` runs: :func:`in_daemon_thread`, a new daemon thread per call,
awaited as a future of the running loop (the sampler bounds it by ``rollout.agent_timeout_s``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


def in_daemon_thread(fn: Callable[..., Any], *args: object) -> asyncio.Future[Any]:
    """``fn(*args)`` in a new daemon thread, as a future of the running loop.

    Not ``asyncio.to_thread``: a thread cannot be killed, and a hung agent step would hold
    a worker of the loop's default executor, which ``asyncio.run`` joins before it returns
    (blocking the next step) and the interpreter joins at exit. A daemon thread is simply
    abandoned when its caller stops waiting: it runs on, holding whatever it holds (a tool
    subprocess, memory), until it returns or the process exits. One thread per call, so
    a timed-out step costs a thread, never a slot that later steps would queue behind (the
    time limit counts the step alone); agents bound their own tools (``arbor.rollout.tools``).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled by the timeout: nobody waits for it any more
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as e:  # re-raised in the loop, where the caller awaits it
            error = e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop has closed: the sampling that asked has returned
            pass

    threading.Thread(target=run, name=f"agent-step-{id(future):x}", daemon=True).start()
    return future
