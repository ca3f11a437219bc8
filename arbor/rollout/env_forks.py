"""Forking environments: every branch of a rollout tree owns its own instance (docs/environments.md).

The state a new branch starts from is its node's **state node**: the nearest environment turn
above it, or the root (model tokens never change an environment). How it gets an instance in
that state is the environment's ``fork``:

- ``copy``: ``env.copy()`` of an instance in that state, made when the copies are requested.
  Forks at a past state (a TreePO fallback cut, an entropy fork inside an earlier turn) copy a
  pristine copy kept of every state of the tree (the root's and each environment turn's) until
  the tree is sampled.
- ``replay``: a fresh instance, ``reset`` with the same problem and seed, then the steps recorded
  on the path replayed, each returned ``Step`` compared with the recorded one; built when the
  branch first needs it (its first step, or its end for the reward), so a tree holds few
  instances and any idle one can be closed for a slot (``rollout.max_live_envs``) and rebuilt.
  A replay that diverges (hidden non-determinism: a global RNG, a clock) or raises stops that
  branch: warned about with the problem id and the turn, counted (``env/errors``), dropped from
  the tree (never trained on).
- ``none``: a fresh instance reset the same way, for branches that start before the first step
  only (the sampler gives a path one copy once its episode has stepped).

    forks = Forks(source, calls, key, stats, turns, snapshots=True)
    forks.begin("copy", env, problem, seed, start)   # the tree's reset instance
    n = await forks.prepare(tree, node, n)            # instances for n copies from node
    forks.hand_over(node, children)                   # one to each child sampled
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from arbor.errors import EpisodeFailure
from arbor.rollout.agents import Message
from arbor.rollout.env_calls import EnvCalls, EnvTimeout, LiveEnvsError
from arbor.rollout.environments import EnvSource, Fork, Step
from arbor.rollout.sample_stats import SampleStats
from arbor.tree import Node, RolloutTree

log = logging.getLogger(__name__)
_SHOW = 160  # characters of a diverged observation shown in a warning


class EnvCallError(RuntimeError):
    """Kept for code that caught it: environments that fail no longer raise it. A failing call now
    drops its branch and is counted (:class:`arbor.errors.EpisodeFailure`); too many failures in a
    step stop the run (:class:`arbor.errors.RewardFailureError`)."""


def check_messages(value: Any, where: str, agent: bool, allow_empty: bool) -> list[Message]:
    """``value`` as chat messages (a list of ``{"role", "content"}`` dicts, ``error`` a bool), else a
    TypeError saying ``where`` (``problem 'p3', turn 2``)."""
    who = "an agent" if agent else "an environment"
    if not isinstance(value, list) or not all(isinstance(m, Mapping) for m in value):
        raise TypeError(f"{where}: {who} must give a list of chat messages (dicts), got {type(value).__name__}")
    if not value and not allow_empty:
        raise TypeError(f"{where}: {who} gave no messages to start the episode with")
    for m in value:
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"{where}: {who} message needs a 'role' and a 'content' string, got {_clip(m)}")
        if not isinstance(m.get("error", False), bool):
            raise TypeError(f"{where}: {who} message's 'error' must be true or false (a failed tool call), "
                            f"got {m['error']!r}")
    return list(value)


class Forks:
    """One tree's environment instances: who owns which, and how a new branch gets one."""

    def __init__(
        self, source: EnvSource, calls: EnvCalls, key: str, stats: SampleStats, turns: Mapping[int, Any],
        *, snapshots: bool,
    ) -> None:
        self.source, self.calls, self.key, self.stats = source, calls, key, stats
        self.turns = turns  # environment-turn node ids (the episodes' messages by node)
        self.keep_states = snapshots  # copy mode: keep every state for forks at past states
        # A stateless agent's instances (AgentEnv) are alike in every state: one kept copy serves
        # every fork, and none of them is a real fork (env/forks).
        self.stateless = source.is_agent
        self.mode: Fork = "replay"
        self.owned: dict[int, Any] = {}  # node id -> the instance of the branch whose tip it is
        self.pending: dict[int, list[Any]] = {}  # node id -> instances prepared for its next copies
        self.snapshots: dict[int, Any] = {}  # state node id -> a pristine instance (copy mode)
        self.recorded: dict[int, tuple[list[Message], Step]] = {}  # turn node id -> (history, step)
        self.problem: dict = {}
        self.seed = 0
        self.start: list[Message] = []

    def begin(self, mode: Fork, env: Any, problem: dict, seed: int, start: list[Message]) -> None:
        """The tree's first instance, just reset with ``(problem, seed)`` to ``start``."""
        self.mode, self.problem, self.seed, self.start = mode, problem, seed, start
        self.keep_states = self.keep_states and mode == "copy"
        if self.keep_states:
            self.snapshots[0] = env  # the root (node id 0)
        else:
            self.owned[0] = env
            if mode != "copy":
                self.calls.idle(env, self.key, lambda: self.owned.pop(0, None))

    def state(self, node: Node) -> Node:
        """The node whose environment state ``node`` is in: the nearest environment turn above (or the root)."""
        while node.parent is not None and node.id not in self.turns:
            node = node.parent
        return node

    def may_fork(self, node: Node) -> bool:
        return self.mode != "none" or self.state(node).parent is None

    # -- handing instances to branches ------------------------------------------------------

    async def prepare(self, tree: RolloutTree, node: Node, n: int) -> int:
        """Instances for ``n`` copies sampled from ``node``; returns how many copies may be sampled.
        ``copy`` copies now (the branch's own instance is stepped later); ``replay`` and ``none``
        build an instance when the branch first needs one (:meth:`instance`), so instances stay
        few and any idle one can be closed for a slot and rebuilt."""
        have = self._take(node.id)
        if self.mode != "copy":
            if self.mode == "none" and n > 1 and self.state(node).parent is not None:
                raise RuntimeError(f"{self.key}: {n} copies of a path whose environment ('fork: none') "
                                   "has stepped: the sampler gives such paths one copy")
            self.pending[node.id] = have
            return n
        state = self.state(node)
        source = self.snapshots.get(0 if self.stateless else state.id, have[0] if have else None)
        if source is None:
            raise RuntimeError(f"no instance of the environment in the state of node {state.id} to copy")
        made = [await self._copy(source) for _ in range(n - len(have))]  # one source: one call at a time
        have += [env for env in made if env is not None]
        self.stats.unstarted += sum(env is None for env in made)  # counted as failures by _copy
        if not self.stateless:
            self.stats.env_forks["copy"] = self.stats.env_forks.get("copy", 0) + sum(e is not None for e in made)
        self.pending[node.id] = have
        return len(have)

    def hand_over(self, node: Node, children: list[Node]) -> None:
        envs = self.pending.pop(node.id, [])
        if len(envs) > len(children) or (self.mode == "copy" and len(envs) != len(children)):
            raise RuntimeError(f"{len(children)} copies sampled from node {node.id} for {len(envs)} instances")
        for child, env in zip(children, envs):
            self._own(child, env)

    async def instance(self, tree: RolloutTree, node: Node) -> Any | None:
        """The instance of the branch whose tip is ``node``; a branch without one yet (a fork, or
        one whose instance was closed for a slot) gets one by replay (``none``: a fresh reset);
        None when that replay diverged (the branch is then dropped: never trained on)."""
        if node.id in self.owned:
            return self._take(node.id)[0]
        state = self.state(node)
        if self.mode == "copy" or (self.mode == "none" and state.parent is not None):
            raise RuntimeError(f"node {node.id} of problem {self.problem.get('id')!r} has no environment instance")
        env = await self._replay(tree, state)
        if env is not None:
            self.stats.env_forks[self.mode] = self.stats.env_forks.get(self.mode, 0) + 1
        return env

    async def stepped(self, tip: Node, env: Any, history: list[Message], step: Step) -> bool:
        """``env`` answered ``step`` to ``history`` and its turn is node ``tip``: record it (for
        replays), keep a copy of the state (copy mode), and the branch goes on with ``env``.
        False: that copy timed out (``env`` stays with the caller)."""
        self.recorded[tip.id] = (history, step)
        if self.keep_states and not self.stateless:
            snapshot = await self._copy(env)
            if snapshot is None:
                return False
            self.snapshots[tip.id] = snapshot
        self._own(tip, env)
        return True

    async def close_all(self) -> None:
        """Close every instance the tree still holds (also after an error)."""
        envs = [*self.owned.values(), *(e for es in self.pending.values() for e in es), *self.snapshots.values()]
        self.owned, self.pending, self.snapshots = {}, {}, {}
        await asyncio.gather(*(self.calls.close(self.key, env) for env in envs))

    def _own(self, node: Node, env: Any) -> None:
        self.owned[node.id] = env
        if self.mode == "replay" or (self.mode == "none" and self.state(node).parent is None):
            # Idle until its branch needs it; a replay (or a reset) rebuilds it if closed for a slot.
            self.calls.idle(env, self.key, lambda: self.owned.pop(node.id, None))

    def _take(self, node_id: int) -> list[Any]:
        env = self.owned.pop(node_id, None)
        if env is None:
            return []
        self.calls.claim(env)
        return [env]

    # -- making instances ----------------------------------------------------------------------

    async def _copy(self, source: Any) -> Any | None:
        """``source.copy()`` as a new instance; None when it timed out (counted)."""
        try:
            env = await self.calls.open(self.key, source.copy)
        except EnvTimeout:
            self._timeout("copy")
            return None
        except LiveEnvsError:
            raise
        except Exception as e:
            self._failed(f"copy raised {type(e).__name__}: {e}")
            return None
        if env is source:
            self.calls.release(self.key)
            self._failed(f"{type(source).__name__}.copy() returned the instance itself: branches would share its "
                         "state (return an independent copy)")
            return None
        return env

    async def _replay(self, tree: RolloutTree, state: Node) -> Any | None:
        """A fresh instance reset and stepped along the recorded turns down to ``state``; None when
        it diverged, raised or timed out (warned about and counted: that branch never starts)."""
        steps = [self.recorded[n.id] for n in tree.path(state) if n.id in self.recorded]
        try:
            env = await self.calls.open(self.key, self.source.make)
        except EnvTimeout:
            self._timeout("building")
            return None
        turn = 0
        try:
            messages = await self.calls.call(self.key, env, "reset", self.problem, self.seed)
            if messages != self.start:
                await self._diverged(env, 0, f"reset returned {_clip(messages)} where the tree's prompt came "
                                             f"from {_clip(self.start)}")
                return None
            for turn, (history, recorded) in enumerate(steps, 1):
                step = await self.calls.call(self.key, env, "step", [dict(m) for m in history])
                self.stats.env_replayed_steps += 1
                if step != recorded:
                    await self._diverged(env, turn, f"step returned {_clip(step)} where the recorded episode "
                                                    f"had {_clip(recorded)}")
                    return None
        except EnvTimeout:
            self._timeout("reset" if turn == 0 else "step")
            return None
        except Exception as e:
            await self._diverged(env, turn, f"{'reset' if turn == 0 else 'step'} raised {type(e).__name__}: "
                                            f"{e} (it did not when recorded)")
            return None
        return env

    async def _diverged(self, env: Any, turn: int, what: str) -> None:
        self.stats.env_errors += 1
        self.stats.env_diverged += 1
        log.info("problem %r: replaying the environment for a new branch diverged at turn %d: %s. Hidden "
                    "non-determinism (a global RNG, a clock?) makes replays differ; the branch is dropped "
                    "before it samples (env/errors). Seed every source of randomness from reset's seed, or "
                    "fork by 'copy'", self.problem.get("id"), turn, what)
        await self.calls.close(self.key, env)

    def _timeout(self, what: str) -> None:
        self.stats.env_timeouts += 1
        kind = "agent_timeout" if self.stateless else "env_timeout"
        self._record(EpisodeFailure(kind, repr(self.problem.get("id", "<no id>")), None,
                                    f"{what} for a new branch ran past its time limit"))

    def _failed(self, what: str) -> None:
        kind = "agent_error" if self.stateless else "env_error"
        self._record(EpisodeFailure(kind, repr(self.problem.get("id", "<no id>")), None, what))

    def _record(self, failure: EpisodeFailure) -> None:
        """A branch whose instance could not be made: it does not start (a copy) or is dropped (a replay)."""
        self.stats.failures.append(failure)
        log.info("%s: that branch is dropped or not started", failure.describe())


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOW else f"{text[: _SHOW // 2]}…{text[-_SHOW // 2:]}"
