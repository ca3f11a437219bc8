"""How arbor calls environments (:mod:`arbor.rollout.episodes`): every call time-limited, the
instances open at once counted and capped.

    calls = EnvCalls(timeout_s=60, max_live=0)
    env = await calls.open(tree, source.make)          # a new instance (waits for a slot)
    step = await calls.call(tree, env, "step", history)  # EnvTimeout past timeout_s
    await calls.close(tree, env)                       # never raises: a failure is counted

A plain method runs in a daemon thread of its own, so slow tools of different branches overlap
and a hung one only costs its thread (:func:`arbor.rollout.agent_thread.in_daemon_thread`); an
``async def`` method is awaited on the sampling loop and cancelled at the limit. An instance whose
call timed out is abandoned: it is closed when that call returns (a thread cannot be killed).

``live`` counts the instances built and not yet closed (``env/live``: 0 once a step's sampling is
over, unless an abandoned call still runs). With ``max_live`` (``rollout.max_live_envs``) a new
instance waits for a slot; meanwhile idle instances registered as rebuildable (``replay`` forks
rebuild any state from the recorded steps) are closed first. When every tree that is sampling
waits for a slot and none can free one, waiting would never end: :class:`LiveEnvsError`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from arbor.errors import RunStopped
from arbor.rollout.agent_thread import in_daemon_thread
from arbor.rollout.environments import AgentEnv

log = logging.getLogger(__name__)


class EnvTimeout(Exception):
    """An environment call ran past ``rollout.env_timeout_s``. ``running``: a plain method's call
    runs on in its thread (whatever it returns is cleaned up when it does); False: an ``async``
    call, cancelled."""

    def __init__(self, running: bool) -> None:
        super().__init__("timed out")
        self.running = running


class LiveEnvsError(RunStopped):
    """Every tree waits for an environment slot that nothing can free (``rollout.max_live_envs``)."""


@dataclass
class _Tree:
    waiting: int = 0  # instances this tree waits to open
    calling: int = 0  # calls of this tree in progress (they end, and may free or need a slot)
    live: int = 0  # its instances built and not closed


class EnvCalls:
    """Time-limited environment calls of one sampling run, and its live instances."""

    def __init__(self, timeout_s: float, max_live: int = 0) -> None:
        self.timeout_s, self.max_live = timeout_s, max_live
        self.live = 0  # instances built (or being built) and not closed
        self.close_failures = 0  # close() calls that raised or timed out
        self._lock = threading.Lock()  # ``live`` also drops in abandoned calls' threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Condition | None = None
        self._trees: dict[Hashable, _Tree] = {}
        self._idle: dict[int, tuple[Any, Hashable, Callable[[], None]]] = {}  # id(env) → (env, tree, forget)

    # -- trees and slots -----------------------------------------------------------------

    def enter(self, tree: Hashable) -> None:
        """``tree`` samples now (its waits count towards the deadlock check)."""
        self._trees[tree] = _Tree()

    def leave(self, tree: Hashable) -> int:
        """``tree`` is done; returns its instances still open (abandoned calls that run on)."""
        state = self._trees.pop(tree, None)
        self._notify()
        return 0 if state is None else state.live

    def idle(self, env: Any, tree: Hashable, forget: Callable[[], None]) -> None:
        """``env`` is idle and can be rebuilt: with a cap, it may be closed for a slot; ``forget()``
        tells its owner first."""
        self._idle[id(env)] = (env, tree, forget)

    def claim(self, env: Any) -> None:
        """``env`` is in use again (not closed for a slot)."""
        self._idle.pop(id(env), None)

    async def open(self, tree: Hashable, make: Callable[[], Any]) -> Any:
        """A new instance from ``make()``, once a slot is free; :class:`EnvTimeout` past the limit
        (an instance built after it is closed then)."""
        await self._slot(tree)
        if _agents_own(make):  # an AgentEnv (or its copy): arbor's adapter, nothing to wait for
            return make()
        try:
            return await self._run(tree, make, (), on_late=lambda env: self._close_late(tree, env))
        except EnvTimeout as timeout:
            if not timeout.running:
                self._closed(tree)
            raise
        except BaseException:
            self._closed(tree)
            raise

    async def _slot(self, tree: Hashable) -> None:
        changed = self._condition()
        state = self._trees.setdefault(tree, _Tree())
        async with changed:
            state.waiting += 1
            try:
                while self.max_live and self.live >= self.max_live:
                    if self._idle:
                        env, owner, forget = self._idle.pop(next(iter(self._idle)))
                        forget()
                        await self.close(owner, env)
                    elif all(t.waiting and not t.calling for t in self._trees.values()):
                        raise LiveEnvsError(
                            f"rollout.max_live_envs={self.max_live}: every tree being sampled waits for an "
                            f"environment instance while the {self.live} open ones are all still needed (a "
                            "'copy' tree keeps one per environment state, a 'none' or 'copy' branch its own "
                            "until its episode ends); raise rollout.max_live_envs"
                        )
                    else:
                        await changed.wait()
                with self._lock:
                    self.live += 1
                    state.live += 1
            finally:
                state.waiting -= 1

    # -- calls ---------------------------------------------------------------------------

    async def call(self, tree: Hashable, env: Any, method: str, *args: Any) -> Any:
        """``env.method(*args)`` within the limit; :class:`EnvTimeout` past it, ``env`` then
        abandoned (closed when the call returns, or now when it was cancelled). Exceptions of the
        method propagate."""
        fn = getattr(env, method)
        if isinstance(env, AgentEnv) and method != "step":  # arbor's own adapter: nothing to wait for
            return fn(*args)
        closing = method == "close"
        late = (lambda _: self._closed(tree)) if closing else (lambda _: self._close_late(tree, env))
        try:
            return await self._run(tree, fn, args, on_late=late)
        except EnvTimeout as timeout:
            if not timeout.running and not closing:
                await self.close(tree, env)
            elif not timeout.running:
                self._closed(tree)
            raise

    async def close(self, tree: Hashable, env: Any) -> None:
        """``env.close()`` if it has one, then its slot is free; a failure is warned about and
        counted, never raised: closing goes on for every other instance."""
        self.claim(env)
        if not callable(getattr(env, "close", None)):
            self._closed(tree)
            return
        try:
            await self.call(tree, env, "close")
        except EnvTimeout:
            self.close_failures += 1
            log.warning("%s.close() ran past rollout.env_timeout_s=%gs", type(env).__name__, self.timeout_s)
            return  # the slot is freed when (if) it returns
        except Exception as e:
            self.close_failures += 1
            log.warning("%s.close() raised %s: %s", type(env).__name__, type(e).__name__, e)
        self._closed(tree)

    async def _run(self, tree: Hashable, fn: Callable[..., Any], args: tuple, on_late: Callable[[Any], None]) -> Any:
        """``fn(*args)`` within the limit: a coroutine function on this loop, else in a daemon thread.
        A thread's call that times out runs on; ``on_late(result)`` gets its result when it returns
        (None if it raised)."""
        state = self._trees.get(tree) or _Tree()  # a tree that left already (closing late) is not watched
        state.calling += 1
        try:
            if inspect.iscoroutinefunction(fn):
                try:
                    return await asyncio.wait_for(fn(*args), self.timeout_s)
                except asyncio.TimeoutError:
                    raise EnvTimeout(running=False) from None
            late = _Late()
            future = in_daemon_thread(late.wrap(fn, on_late), *args)
            try:
                return await asyncio.wait_for(future, self.timeout_s)
            except asyncio.TimeoutError:
                if late.abandon():  # it returned just as the limit passed: take its outcome
                    return late.outcome()
                raise EnvTimeout(running=True) from None
        finally:
            state.calling -= 1
            self._notify()

    def _close_late(self, tree: Hashable, env: Any) -> None:
        """Close an abandoned instance (in the thread whose call just returned), then free its slot."""
        if env is not None:
            close = getattr(env, "close", None)
            try:
                if callable(close) and not isinstance(env, AgentEnv):
                    result = close()
                    if inspect.isawaitable(result):
                        asyncio.run(_awaited(result))
            except Exception as e:
                log.warning("%s.close() after a timed-out call raised %s: %s", type(env).__name__, type(e).__name__, e)
        self._closed(tree)

    def release(self, tree: Hashable) -> None:
        """Free the slot :meth:`open` took for something that is not a new instance (a ``copy()``
        that returned its source, which stays open and is closed as itself)."""
        self._closed(tree)

    def _closed(self, tree: Hashable) -> None:
        with self._lock:
            self.live -= 1
            state = self._trees.get(tree)
            if state is not None:
                state.live -= 1
        self._notify()

    # -- waking waiters (also from other threads) ------------------------------------------

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._loop = asyncio.get_running_loop()
            self._changed = asyncio.Condition()
        return self._changed

    def _notify(self) -> None:
        """Wake the waiters for a slot (they re-check); callable from any thread, the loop's own
        included (the wake runs on its next turn either way)."""
        loop = self._loop
        if not self.max_live or loop is None:  # no cap (nobody waits), or nothing waited yet
            return
        try:
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._wake()))
        except RuntimeError:  # the loop closed: nobody waits
            pass

    async def _wake(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()


class _Late:
    """A thread's call that may be abandoned: whichever side comes second handles the outcome."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = self._abandoned = False
        self._result: Any = None
        self._error: BaseException | None = None

    def wrap(self, fn: Callable[..., Any], on_late: Callable[[Any], None]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            try:
                self._result = fn(*args)
                return self._result
            except BaseException as e:
                self._error = e
                raise
            finally:
                with self._lock:
                    self._done = True
                    late = self._abandoned
                if late:
                    on_late(self._result)

        return run

    def abandon(self) -> bool:
        """Mark the call abandoned; True when it had already returned (see :meth:`outcome`)."""
        with self._lock:
            self._abandoned = not self._done
            return self._done

    def outcome(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._result


def _agents_own(make: Callable[[], Any]) -> bool:
    """Whether ``make`` builds an :class:`AgentEnv` (the class, a partial of it, or a copy method)."""
    target: Any = make.func if isinstance(make, functools.partial) else make
    return target is AgentEnv or isinstance(getattr(target, "__self__", None), AgentEnv)


async def _awaited(result: Any) -> None:
    await result
