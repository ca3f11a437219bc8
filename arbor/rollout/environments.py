"""Environments: agents with state, side effects and rewards of their own (docs/environments.md).

    class Ledger:                                    # no base class needed
        fork = "copy"                                # or "replay" (the default), or "none"
        def reset(self, problem, seed): return [{"role": "user", "content": problem["prompt"]}]
        def step(self, history): return Step([{"role": "tool", "content": "ok"}], done=False)
        def reward(self): return 1.0                 # read once when the episode ends; None: none
        def copy(self): return copy.deepcopy(self)   # fork == "copy" only
        def close(self): ...                         # always called, also after errors and timeouts

    source = load_env("envs/ledger.py:Ledger", search_dirs=["."])   # checked once, at start-up
    env = source.make()                                             # one instance per episode

``rollout.env`` names a class (built with ``rollout.env_args``) or a factory; every branch of a
rollout tree owns its own instance (:mod:`arbor.rollout.episodes` forks them by ``fork``: a
``copy``, a ``replay`` of the recorded steps on a fresh instance, or ``none``: no fork after the
first ``step``). Methods may be plain or ``async def``. A stateless agent (``rollout.agent``,
:mod:`arbor.rollout.agents`) runs through the same path as an :class:`AgentEnv`.
"""

from __future__ import annotations

import asyncio
import copy as copy_module
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from arbor.config import RewardConfig, RolloutConfig
from arbor.errors import ConfigError
from arbor.plugins import load_object
from arbor.rollout.agents import Agent, Message, rollout_agent

Fork = Literal["copy", "replay", "none"]
FORK_MODES: tuple[Fork, ...] = ("copy", "replay", "none")


@dataclass
class Step:
    """What an environment answers after a model turn: messages appended as the next turn
    (chat-templated, loss mask 0), or ``done=True``: the episode ends there (the messages of a
    final step are not appended: no model turn follows them)."""

    messages: list[Message]
    done: bool = False


class Env(Protocol):
    """The environment protocol. Any object with ``reset`` and ``step`` is one (checked once
    at start-up); subclassing ``Env`` inherits the defaults below (``fork = "replay"``, no
    reward, ``copy`` a deepcopy, a ``close`` that does nothing)."""

    # How a branch gets its own instance when the tree forks: "copy" (self.copy()), "replay"
    # (a fresh instance, reset with the same problem and seed, the recorded steps replayed and
    # each observation checked), "none" (the episode forks only before its first step).
    fork: ClassVar[Literal["copy", "replay", "none"]] = "replay"

    def reset(self, problem: dict, seed: int) -> list[Message]:
        """The episode's first messages (the tree's prompt); ``seed`` is the same for a replay."""
        ...

    def step(self, history: list[Message]) -> Step:
        """After each finished model turn; ``history`` is the whole conversation, ending with it."""
        ...

    def reward(self) -> float | None:
        """The episode's reward, read once when it ends; None: this environment gives none."""
        return None

    def copy(self) -> Env:
        """An independent instance in the same state (``fork == "copy"``), random state included."""
        return copy_module.deepcopy(self)

    def close(self) -> None:
        """Release what the instance holds; always called, also after errors and timeouts."""
        return None


class AgentEnv:
    """A stateless agent as an environment: ``reset`` is ``agent.start(problem)``, ``step`` is
    ``agent.step(problem, history)`` (None or no messages: done). It never needs a real fork:
    ``copy`` shares the agent."""

    fork: ClassVar[Fork] = "copy"

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.problem: dict = {}

    def reset(self, problem: dict, seed: int) -> list[Message]:
        self.problem = problem
        return self.agent.start(problem)

    def step(self, history: list[Message]) -> Step:
        messages = self.agent.step(self.problem, history)
        return Step(list(messages or []), done=not messages)

    def reward(self) -> float | None:
        return None

    def copy(self) -> AgentEnv:
        twin = AgentEnv(self.agent)
        twin.problem = self.problem
        return twin

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class EnvSource:
    """Where a run's environment instances come from: ``make()`` builds a fresh one."""

    make: Callable[[], Any]  # a new instance (one per episode, and one per forked branch)
    key: str  # the config key that named it: "rollout.env", or "rollout.agent" (an AgentEnv)
    spec: str  # what the key says (module:attr)
    gives_reward: bool  # the instances define reward() (not the default "none")
    agent: Agent | None = None  # rollout.agent's agent, whose AgentEnv instances these are

    @property
    def is_agent(self) -> bool:
        return self.agent is not None


def fork_mode(env: Any, key: str) -> Fork:
    """An instance's ``fork`` attribute (default "replay"); a ConfigError names ``key`` otherwise."""
    mode = getattr(env, "fork", "replay")
    if mode not in FORK_MODES:
        raise ConfigError(f"{key}: {type(env).__name__}.fork must be one of {', '.join(FORK_MODES)}, got {mode!r}")
    return mode


def check_env(env: Any, key: str, spec: str) -> None:
    """``env`` has what the protocol needs: ``reset`` and ``step``, a valid ``fork``, ``copy`` when
    it forks by copy; ``reward``/``copy``/``close``, where present, callable."""
    missing = [name for name in ("reset", "step") if not callable(getattr(env, name, None))]
    if missing:
        raise ConfigError(
            f"{key}: {spec!r} builds a {type(env).__name__}, which is not an environment: it has no "
            f"{' and no '.join(missing)} method (an environment needs reset(problem, seed) -> messages "
            "and step(history) -> Step)"
        )
    mode = fork_mode(env, key)
    for name in ("reward", "copy", "close"):
        if hasattr(env, name) and not callable(getattr(env, name)):
            raise ConfigError(f"{key}: {type(env).__name__}.{name} must be a method")
    if mode == "copy" and not callable(getattr(env, "copy", None)):
        raise ConfigError(f"{key}: {type(env).__name__}.fork is 'copy' but it has no copy() method "
                          "(add one, subclass arbor.Env for a deepcopy, or fork by 'replay')")


def gives_reward(env: Any) -> bool:
    """Whether ``env`` defines a reward of its own (not :class:`Env`'s default, which gives none)."""
    method = getattr(type(env), "reward", None)
    return callable(method) and method is not Env.reward and not isinstance(env, AgentEnv)


def load_env(
    spec: str,
    key: str = "rollout.env",
    search_dirs: Sequence[str] = (),
    kwargs: Mapping[str, Any] | None = None,
    kwargs_key: str = "rollout.env_args",
) -> EnvSource:
    """Resolve ``spec`` to a class or factory, build one instance with ``kwargs`` to check it
    against the protocol (and close it), and return the :class:`EnvSource` that builds them."""
    obj = load_object(spec, key, search_dirs)
    if not callable(obj):
        raise ConfigError(f"{key}: {spec!r} must name a class or a factory (one instance per episode), "
                          f"got a {type(obj).__name__}")
    make = functools.partial(obj, **dict(kwargs or {}))
    try:
        probe = make()
    except TypeError as e:
        given = f"with {kwargs_key} {dict(kwargs or {})}" if kwargs else "without arguments"
        raise ConfigError(f"{key}: {spec!r} cannot be built {given}: {e}") from None
    try:
        check_env(probe, key, spec)
        rewarded = gives_reward(probe)
    finally:
        close = getattr(probe, "close", None)
        if callable(close):
            _finish(close())
    return EnvSource(make, key, spec, rewarded)


def agent_source(agent: Agent, spec: str = "<agent>") -> EnvSource:
    """A stateless agent as a source of :class:`AgentEnv` instances (they share the agent)."""
    return EnvSource(functools.partial(AgentEnv, agent), "rollout.agent", spec, gives_reward=False, agent=agent)


def rollout_env(rollout_cfg: RolloutConfig, search_dirs: Sequence[str] = ()) -> EnvSource | None:
    """The environment of a run's episodes: ``rollout.env`` (built with ``rollout.env_args``),
    or ``rollout.agent`` as :class:`AgentEnv` instances; None for single-turn rollouts."""
    if rollout_cfg.env is not None and rollout_cfg.agent is not None:
        raise ConfigError("rollout.env and rollout.agent are both set: an environment replaces the agent "
                          "(a stateless agent is an environment); keep one")
    if rollout_cfg.env is not None:
        return load_env(rollout_cfg.env, "rollout.env", search_dirs, rollout_cfg.env_args)
    agent = rollout_agent(rollout_cfg, search_dirs)
    return None if agent is None else agent_source(agent, rollout_cfg.agent or "<agent>")


def require_reward(source: EnvSource | None, reward_cfg: RewardConfig) -> None:
    """With no ``reward.functions`` the environment must give the reward: a ConfigError at
    start-up names both keys otherwise (a reward is never silently 0)."""
    if reward_cfg.functions:
        return
    if source is None or source.is_agent:
        raise ConfigError("reward.functions is empty and no rollout.env gives a reward: name a reward function")
    if not source.gives_reward:
        raise ConfigError(f"reward.functions is empty but rollout.env {source.spec!r} defines no reward() "
                          "(it gives none): name a reward function or give the environment a reward")
    if reward_cfg.env_weight == 0:
        raise ConfigError("reward.functions is empty and reward.env_weight is 0: every reward would be 0")


def _finish(result: Any) -> None:
    """Await ``result`` when an ``async def`` method returned a coroutine (outside an event loop)."""
    if inspect.isawaitable(result):
        async def wait() -> None:
            await result

        asyncio.run(wait())
