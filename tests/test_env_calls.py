"""EnvCalls on its own: time limits, the live count (per run and per tree), slots under
``rollout.max_live_envs``, closes that fail, and calls abandoned at the limit that return later.

The sampling tests (tests/test_env_forks.py) reach these paths through whole trees; here each is
driven directly, with instances that block on an event the test releases, so the moment a call
returns is the test's choice, not the scheduler's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from arbor.rollout import env_calls
from arbor.rollout.agent_thread import in_daemon_thread
from arbor.rollout.env_calls import EnvCalls, EnvTimeout, LiveEnvsError, _Late
from arbor.rollout.environments import AgentEnv

LIMIT = 0.05  # the call limit of these tests: the blocked calls wait for an event, not for time


class Box:
    """An environment whose methods block until ``gate`` is set (when one is given) and count
    their calls; ``fail`` makes close() raise."""

    def __init__(self, gate: threading.Event | None = None, fail: bool = False) -> None:
        self.gate, self.fail = gate, fail
        self.steps = self.closes = 0
        self.threads: list[threading.Thread] = []

    def step(self, history: list) -> str:
        self.threads.append(threading.current_thread())
        if self.gate is not None:
            self.gate.wait(10)
        self.steps += 1
        return "stepped"

    def close(self) -> None:
        self.closes += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise ValueError("lid stuck")


class Bare:
    """An environment without close(); its step blocks until ``gate`` is set."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def step(self, history: list) -> str:
        self.gate.wait(10)
        return "late"


class AsyncBox:
    """An async environment whose step (and, with ``hang_close``, close) never ends in time."""

    def __init__(self, hang_close: bool = False) -> None:
        self.hang_close = hang_close
        self.closes = 0

    async def step(self, history: list) -> str:
        await asyncio.sleep(10)
        return "never"

    async def close(self) -> None:
        self.closes += 1
        if self.hang_close:
            await asyncio.sleep(10)


def run(test: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(test(), 20))


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait (up to 5 s) for something an abandoned call's thread does when it returns."""
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def test_instances_are_counted_open_and_closed_per_run_and_per_tree() -> None:
    async def go() -> None:
        calls = EnvCalls(LIMIT)  # no cap by default: three instances open at once
        calls.enter("a")
        envs = [await calls.open("a", Box) for _ in range(3)]
        other = await calls.open("b", Box)  # a tree never entered is counted too
        assert calls.live == 4
        await calls.close("a", envs[0])
        assert calls.live == 3 and envs[0].closes == 1
        assert calls.leave("a") == 2  # its instances still open
        assert calls.leave("b") == 1 and calls.leave("nobody") == 0
        await calls.close("b", other)
        assert calls.live == 2

    run(go)


def test_a_call_returns_the_method_s_result_and_a_plain_method_runs_in_a_thread_of_its_own() -> None:
    async def go() -> None:
        calls = EnvCalls(LIMIT)
        env = await calls.open("a", Box)
        assert await calls.call("a", env, "step", []) == "stepped"
        assert env.threads[0] is not threading.current_thread() and env.threads[0].daemon

    run(go)


def test_arbor_s_own_agent_env_is_made_and_reset_on_the_loop_but_stepped_in_a_thread(monkeypatch) -> None:
    seen: list[threading.Thread] = []
    threaded: list[str] = []  # what EnvCalls hands to a thread of its own

    def in_thread(fn, *args):
        threaded.append(getattr(fn, "__name__", type(fn).__name__))
        return in_daemon_thread(fn, *args)

    monkeypatch.setattr(env_calls, "in_daemon_thread", in_thread)

    class Agent:
        def start(self, problem: dict) -> list:
            seen.append(threading.current_thread())
            return [{"role": "user", "content": "go"}]

        def step(self, problem: dict, history: list) -> list:
            seen.append(threading.current_thread())
            return []

    async def go() -> None:
        calls = EnvCalls(LIMIT)
        for make in (functools.partial(AgentEnv, Agent()), AgentEnv(Agent()).copy):
            env = await calls.open("a", make)
            assert isinstance(env, AgentEnv)
        assert calls.live == 2 and threaded == []  # counted like any instance, built inline
        await calls.call("a", env, "reset", {"id": 1}, 0)
        await calls.call("a", env, "step", [])
        assert seen[0] is threading.current_thread()  # reset: inline
        assert seen[1] is not threading.current_thread()  # step: the agent's own code, time-limited
        assert threaded == ["run"]
        await calls.close("a", env)
        assert calls.live == 1

    run(go)


def test_an_instance_that_cannot_be_made_frees_its_slot_in_the_run_and_in_its_tree() -> None:
    def broken() -> Any:
        raise RuntimeError("no such env")

    async def go() -> None:
        calls = EnvCalls(LIMIT, max_live=1)
        assert calls.leave("a") == 0  # a tree may leave before any instance was asked for
        calls.enter("a")
        with pytest.raises(RuntimeError, match="no such env"):
            await calls.open("a", broken)
        assert calls.live == 0 and calls.leave("a") == 0
        await calls.open("b", Box)  # the only slot is free again
        assert calls.live == 1

    run(go)


def test_an_instance_built_after_its_limit_is_closed_when_it_arrives() -> None:
    gate = threading.Event()
    built: list[Box] = []

    def slow() -> Box:
        gate.wait(10)
        built.append(Box())
        return built[-1]

    async def go() -> None:
        calls = EnvCalls(LIMIT)
        calls.enter("a")
        with pytest.raises(EnvTimeout) as timeout:
            await calls.open("a", slow)
        assert timeout.value.running is True and str(timeout.value) == "timed out"
        assert calls.live == 1  # still being built
        gate.set()
        await until(lambda: calls.live == 0, "the late instance closed")
        assert built[0].closes == 1 and calls.leave("a") == 0

    run(go)


def test_a_close_that_raises_is_counted_and_warned_about_and_frees_the_slot(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        calls = EnvCalls(LIMIT)
        calls.enter("a")
        envs = [await calls.open("a", functools.partial(Box, fail=True)) for _ in range(2)]
        for env in envs:
            await calls.close("a", env)  # never raises
        assert calls.close_failures == 2 and calls.live == 0 and calls.leave("a") == 0
        assert [env.closes for env in envs] == [1, 1]

    with caplog.at_level(logging.WARNING, logger="arbor.rollout.env_calls"):
        run(go)
    assert [r.getMessage() for r in caplog.records] == ["Box.close() raised ValueError: lid stuck"] * 2


def test_a_close_past_the_limit_is_counted_and_its_slot_freed_when_it_returns(caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()

    async def go() -> None:
        calls = EnvCalls(LIMIT)
        calls.enter("a")
        env = await calls.open("a", functools.partial(Box, gate))
        await calls.close("a", env)
        assert calls.close_failures == 1
        assert calls.live == 1  # close() still runs: its instance still exists
        gate.set()
        await until(lambda: calls.live == 0, "the late close freed the slot")
        assert calls.leave("a") == 0
        assert env.closes == 1  # closed once: the late close is not closed again

    with caplog.at_level(logging.WARNING, logger="arbor.rollout.env_calls"):
        run(go)
    assert [r.getMessage() for r in caplog.records] == ["Box.close() ran past rollout.env_timeout_s=0.05s"]


def test_an_async_close_past_the_limit_is_cancelled_counted_and_its_slot_freed() -> None:
    async def go() -> None:
        calls = EnvCalls(LIMIT)
        calls.enter("a")
        envs = [await calls.open("a", functools.partial(AsyncBox, hang_close=True)) for _ in range(2)]
        for env in envs:
            await calls.close("a", env)
        assert (calls.close_failures, calls.live, [env.closes for env in envs]) == (2, 0, [1, 1])
        assert calls.leave("a") == 0

    run(go)


def test_an_instance_without_close_frees_its_slot_and_is_claimed_back_from_the_idle_ones() -> None:
    forgotten: list[str] = []

    async def go() -> None:
        calls = EnvCalls(LIMIT, max_live=1)
        calls.enter("a")
        bare = await calls.open("a", functools.partial(Bare, threading.Event()))
        calls.idle(bare, "a", lambda: forgotten.append("bare"))
        await calls.close("a", bare)  # no close(): only the slot
        assert calls.live == 0 and calls.leave("a") == 0
        calls.enter("a")
        box = await calls.open("a", Box)
        with pytest.raises(LiveEnvsError):  # the closed instance is no longer idle: nothing frees a slot
            await calls.open("a", Box)
        assert forgotten == [] and box.closes == 0

    run(go)


def test_a_step_past_the_limit_abandons_its_instance_closed_when_the_step_returns(caplog: pytest.LogCaptureFixture) -> None:
    gates = [threading.Event() for _ in range(3)]

    async def go() -> None:
        calls = EnvCalls(LIMIT)
        calls.enter("a")
        box = await calls.open("a", functools.partial(Box, gates[0]))
        bare = await calls.open("a", functools.partial(Bare, gates[1]))
        stuck = await calls.open("a", functools.partial(Box, gates[2], fail=True))
        for env in (box, bare, stuck):
            with pytest.raises(EnvTimeout) as timeout:
                await calls.call("a", env, "step", [])
            assert timeout.value.running is True
        assert calls.live == 3 and box.closes == 0
        for gate in gates:
            gate.set()
        await until(lambda: calls.live == 0, "every abandoned instance closed")
        assert box.closes == 1 and stuck.closes == 1 and calls.leave("a") == 0

    with caplog.at_level(logging.WARNING, logger="arbor.rollout.env_calls"):
        run(go)
    # The one without close() is only counted out; the failing close is warned about.
    assert [r.getMessage() for r in caplog.records] == [
        "Box.close() after a timed-out call raised ValueError: lid stuck"
    ]


def test_an_async_step_past_the_limit_is_cancelled_and_its_instance_closed_now() -> None:
    async def go() -> None:
        calls = EnvCalls(LIMIT)
        calls.enter("a")
        env = await calls.open("a", AsyncBox)
        with pytest.raises(EnvTimeout) as timeout:
            await calls.call("a", env, "step", [])
        assert timeout.value.running is False
        assert (calls.live, env.closes, calls.close_failures) == (0, 1, 0)
        assert calls.leave("a") == 0

    run(go)


def test_a_late_close_in_another_thread_wakes_a_tree_waiting_for_a_slot() -> None:
    gate = threading.Event()

    async def go() -> None:
        calls = EnvCalls(LIMIT, max_live=1)
        calls.enter("a")
        calls.enter("b")
        env = await calls.open("a", functools.partial(Box, gate))
        with pytest.raises(EnvTimeout):
            await calls.call("a", env, "step", [])
        waiter = asyncio.ensure_future(calls.open("b", Box))  # "a" is not waiting: "b" waits
        await asyncio.sleep(0.05)
        assert not waiter.done() and calls.live == 1
        gate.set()  # the step returns in its thread; the instance is closed there, and "b" woken
        await asyncio.wait_for(waiter, 5)
        assert calls.live == 1 and env.closes == 1

    run(go)


def test_the_cap_closes_idle_instances_first_and_stops_when_nothing_can_free_a_slot() -> None:
    forgotten: list[int] = []

    async def go() -> None:
        calls = EnvCalls(LIMIT, max_live=2)
        calls.enter("a")
        first, second = [await calls.open("a", Box) for _ in range(2)]
        calls.idle(first, "a", lambda: forgotten.append(1))
        calls.idle(second, "a", lambda: forgotten.append(2))
        calls.claim(second)  # in use again
        third = await calls.open("a", Box)
        assert forgotten == [1] and first.closes == 1 and second.closes == 0 and calls.live == 2
        with pytest.raises(LiveEnvsError) as stop:
            await calls.open("a", Box)
        assert str(stop.value) == (
            "rollout.max_live_envs=2: every tree being sampled waits for an environment instance while the 2 "
            "open ones are all still needed (a 'copy' tree keeps one per environment state, a 'none' or 'copy' "
            "branch its own until its episode ends); raise rollout.max_live_envs"
        )
        assert calls.live == 2 and third.closes == 0
        assert calls.leave("a") == 2  # the idle instance closed for a slot was "a"'s: counted out of it

    run(go)


def test_a_tree_waiting_while_its_other_call_still_runs_is_not_a_deadlock() -> None:
    gate, first_gate = threading.Event(), threading.Event()

    async def go() -> None:
        calls = EnvCalls(5.0, max_live=1)
        calls.enter("a")
        env = await calls.open("a", Box)
        slow, quick = Box(gate), Box(first_gate)  # two calls of "a" (on stand-ins of its instance)
        first = asyncio.ensure_future(calls.call("a", slow, "step", []))
        second = asyncio.ensure_future(calls.call("a", quick, "step", []))
        await asyncio.sleep(0.02)
        waiting = asyncio.ensure_future(calls.open("a", Box))
        await asyncio.sleep(0.02)
        first_gate.set()  # one call ends; the other still runs and may free the slot
        assert await second == "stepped"
        await asyncio.sleep(0.05)
        assert not waiting.done()  # no LiveEnvsError: a call of "a" still runs
        await calls.close("a", env)  # the slot frees while the other call still runs
        await asyncio.wait_for(waiting, 5)
        gate.set()
        assert await first == "stepped"

    run(go)


def test_an_async_factory_past_the_limit_is_cancelled_and_frees_its_slot_in_its_tree() -> None:
    async def never() -> Box:
        await asyncio.sleep(10)
        return Box()

    async def go() -> None:
        calls = EnvCalls(LIMIT, max_live=1)
        calls.enter("a")
        with pytest.raises(EnvTimeout) as timeout:
            await calls.open("a", never)
        assert timeout.value.running is False
        assert calls.live == 0 and calls.leave("a") == 0

    run(go)


def test_an_async_close_of_an_abandoned_instance_is_run_to_its_end_in_the_returning_thread() -> None:
    gate = threading.Event()

    class Mixed(Box):
        """A plain step, an async close."""

        async def close(self) -> None:  # type: ignore[override]
            await asyncio.sleep(0)
            self.closes += 1

    async def go() -> None:
        calls = EnvCalls(LIMIT)
        env = await calls.open("a", functools.partial(Mixed, gate))
        with pytest.raises(EnvTimeout):
            await calls.call("a", env, "step", [])
        gate.set()
        await until(lambda: calls.live == 0, "the late close")
        assert env.closes == 1

    run(go)


def test_a_tree_waiting_for_two_slots_still_counts_as_waiting_after_it_got_one() -> None:
    gate = threading.Event()

    async def go() -> None:
        calls = EnvCalls(5.0, max_live=1)
        calls.enter("a")
        env = await calls.open("a", Box)
        call = asyncio.ensure_future(calls.call("a", Box(gate), "step", []))  # "a" is busy: no deadlock
        await asyncio.sleep(0.02)
        waits = [asyncio.ensure_future(calls.open("a", Box)) for _ in range(2)]
        await asyncio.sleep(0.02)
        await calls.close("a", env)
        done, pending = await asyncio.wait(waits, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and not done.pop().exception()
        gate.set()  # the call ends: "a" holds its one slot and still waits for another
        assert await call == "stepped"
        with pytest.raises(LiveEnvsError):
            await asyncio.wait_for(pending.pop(), 5)

    run(go)


def test_a_thread_s_outcome_goes_to_whichever_side_comes_second() -> None:
    """_Late: a call that returned (or raised) just as its limit passed is taken by the waiter
    (``abandon()`` True); one abandoned first hands its result, or None after an error, to
    ``on_late``."""
    handed: list[Any] = []

    def boom() -> None:
        raise KeyError("gone")

    late = _Late()
    assert late.wrap(lambda: 7, handed.append)() == 7
    assert late.abandon() is True and late.outcome() == 7 and handed == []
    late = _Late()
    with pytest.raises(KeyError):
        late.wrap(boom, handed.append)()
    assert late.abandon() is True and handed == []
    with pytest.raises(KeyError, match="gone"):
        late.outcome()
    late = _Late()
    assert late.abandon() is False
    assert late.wrap(lambda: 7, handed.append)() == 7
    late = _Late()
    late.abandon()
    with pytest.raises(KeyError):
        late.wrap(boom, handed.append)()
    assert handed == [7, None]
