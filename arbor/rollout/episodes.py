"""Multi-turn episodes in a rollout tree: an environment (or a stateless agent, as an
:class:`~arbor.rollout.environments.AgentEnv`) answers each finished model turn, and every
branch owns its own environment instance.

    episodes = TreeEpisodes(setup, calls, cfg, stats, decode, stop_ids, index=0)
    prompt = await episodes.reset(problem, seed)      # the tree's prompt: the env's reset messages
    n = await episodes.prepare(tree, node, n)         # an instance for each copy of the next request
    episodes.hand_over(node, children)                # ... one to each child it sampled
    tip = await episodes.after_turn(tree, node)       # the env's answer to the model turn ending at
                                                      # node, appended (loss mask 0); None: it ended
    await episodes.end(tree, node)                    # an episode ended at node: reward, close
    await episodes.close(tree)                        # the rest; branches that must not train, dropped

The sampler (:mod:`arbor.rollout.sampler`) owns the tree and the requests; this module owns the
conversation (the history an environment reads, the ids its messages append) and the instances.
How a branch gets its own instance (:mod:`arbor.rollout.env_forks`) depends on the environment's
``fork``; an instance is only ever stepped by the one branch that owns it, so a branch never sees
another branch's side effects.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from arbor.config import DataConfig, RolloutConfig
from arbor.errors import ConfigError, EpisodeFailure, RewardFailureError
from arbor.rollout.agents import Agent, Message, Render, continuation_ids, episode_prompt
from arbor.rollout.budget import request_seed
from arbor.rollout.env_calls import EnvCalls, EnvTimeout, LiveEnvsError
from arbor.rollout.env_forks import Forks, check_messages
from arbor.rollout.environments import EnvSource, Step, agent_source, fork_mode
from arbor.rollout.sample_stats import SampleStats
from arbor.tree import Node, RolloutTree

AGENT_TIMEOUT = "agent_timeout"  # agent.step ran past rollout.agent_timeout_s
ENV_TIMEOUT = "env_timeout"  # an environment call ran past rollout.env_timeout_s
TOO_LONG = "message_too_long"  # an environment's messages did not fit the response budget
FAILED = "failed"  # the branch's environment or agent failed: dropped (arbor.errors)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeSetup:
    """What sampling multi-turn episodes needs besides the engine."""

    source: EnvSource  # rollout.env's instances (or rollout.agent's, as AgentEnv)
    render: Render  # an environment's messages after a model turn -> the ids appended
    # The reset messages (and the environment's tools) -> the tree's prompt ids (system prompt,
    # chat template, length check); None: sample_trees' prompts are the prompts (the reset
    # messages only start the history).
    prompt: Callable[..., list[int]] | None = None
    # No reward functions: an episode whose environment gives no reward (a timed-out call)
    # cannot be scored and is dropped; a reward() of None is then an error.
    needs_reward: bool = False
    # A reset whose prompt is longer stops sampling, naming the problem (data.max_prompt_tokens;
    # start-up cannot check an environment's prompts); 0: no limit.
    max_prompt_tokens: int = 0


def run_episodes(source: EnvSource, tokenizer: Any, data_cfg: DataConfig, needs_reward: bool) -> EpisodeSetup:
    """A run's episodes (``arbor train``, ``arbor eval``): the reset messages chat-templated as the
    prompt (:func:`~arbor.rollout.agents.episode_prompt`), later messages as continuation ids."""
    return EpisodeSetup(source, functools.partial(continuation_ids, tokenizer),
                        functools.partial(episode_prompt, tokenizer, data_cfg=data_cfg), needs_reward,
                        data_cfg.max_prompt_tokens)


def episode_setup(
    agent: Agent | None, render: Render | None, env: EpisodeSetup | None, decode: Callable[[list[int]], str] | None,
    no_prompts: bool,
) -> EpisodeSetup | None:
    """The episodes :func:`~arbor.rollout.sampler.sample_trees` was asked for: ``env``, or an
    ``agent`` with its ``render`` as a stateless environment; a ValueError when pieces are missing."""
    if agent is not None:
        if env is not None:
            raise ValueError("sampling takes an agent or an environment, not both")
        if render is None or decode is None:
            raise ValueError("sampling with an agent needs render (messages -> ids) and decode")
        env = EpisodeSetup(agent_source(agent), render)
    if env is not None and decode is None:
        raise ValueError("sampling with an environment needs decode")
    if no_prompts and (env is None or env.prompt is None):
        raise ValueError("sampling needs prompts, unless an environment's reset gives them (EpisodeSetup.prompt)")
    return env


def reset_seed(seed: int, tree_index: int) -> int:
    """The ``seed`` of a tree's environment ``reset``: the same for every instance of the tree (a
    replay must rebuild the same episode), reproducible from the step's seed, shared with no request."""
    return request_seed(seed, tree_index, node_id=-1, fork_index=0)


class TreeEpisodes:
    """One tree's episodes: its environment instances, their steps and the turns they append."""

    def __init__(
        self,
        setup: EpisodeSetup,
        calls: EnvCalls,
        cfg: RolloutConfig,
        stats: SampleStats,
        decode: Callable[[list[int]], str] | None,
        stop_ids: Sequence[int],
        index: int,
    ) -> None:
        assert decode is not None  # episode_setup checks it
        self.setup, self.calls, self.cfg, self.stats = setup, calls, cfg, stats
        self.decode, self.stop_ids, self.key = decode, list(stop_ids), f"tree-{index}"
        self.agent = setup.source.is_agent
        self.messages: dict[int, list[Message]] = {}  # environment-turn node id -> its messages
        # Forks at past states: TreePO's fallback cuts finished paths, EPTree forks inside turns.
        past = cfg.fork_at == "entropy" or (cfg.mode == "tree" and cfg.fallback)
        self.forks = Forks(setup.source, calls, self.key, stats, self.messages, snapshots=past)
        self.dropped: list[Node] = []  # leaves never trained on (closed out of the tree at the end)
        self.problem: dict = {}
        self.start: list[Message] = []  # the reset messages: the history's start
        self.seed = 0

    # -- the tree's start and end ----------------------------------------------------------

    async def reset(self, problem: dict | None, seed: int) -> list[int] | None:
        """Build the tree's first instance and reset it with ``(problem, seed)`` (every replay uses
        the same seed); returns the prompt ids (None without ``setup.prompt``)."""
        if problem is None:
            raise ValueError(f"{self.setup.source.key} needs the problems (got None for {self.key})")
        self.problem, self.seed = problem, seed
        self.calls.enter(self.key)
        kind = "agent" if self.agent else "env"
        try:
            env = await self.calls.open(self.key, self.setup.source.make)
        except EnvTimeout:
            raise self._start_failed(f"{kind}_timeout", "building ran past " + self.timeout_key) from None
        except (ConfigError, LiveEnvsError):
            raise
        except Exception as e:
            raise self._start_failed(f"{kind}_error", f"building raised {type(e).__name__}: {e}") from e
        try:
            mode = fork_mode(env, self.setup.source.key)  # a factory may build other classes than the probe's
            messages = await self.calls.call(self.key, env, "reset", problem, seed)
            self.start = check_messages(messages, self._where(0), self.agent, allow_empty=self.setup.prompt is None)
        except EnvTimeout:
            raise self._start_failed(f"{kind}_timeout", f"reset ran past {self.timeout_key}: the tree has no "
                                     "prompt") from None
        except (ConfigError, LiveEnvsError):
            await self.calls.close(self.key, env)
            raise
        except Exception as e:
            await self.calls.close(self.key, env)
            what = str(e) if isinstance(e, TypeError) else f"reset raised {type(e).__name__}: {e}"
            raise self._start_failed(f"{kind}_error", what) from e
        self.forks.begin(mode, env, problem, seed, self.start)
        if self.setup.prompt is None:
            return None
        prompt = self.setup.prompt(self.start, tools=self._tools(env))
        if self.setup.max_prompt_tokens and len(prompt) > self.setup.max_prompt_tokens:
            raise self._start_failed(f"{kind}_error", f"reset gave a prompt of {len(prompt)} tokens, more than "
                                     f"data.max_prompt_tokens={self.setup.max_prompt_tokens} (an environment's "
                                     "prompts are only known when its episode starts)")
        return prompt

    def _start_failed(self, kind: str, what: str) -> EpisodeStartError:
        failure = self._failure(kind, 0, what)
        log.info("%s: the tree is dropped", failure.describe())
        return EpisodeStartError(failure)

    def _tools(self, env: Any) -> list[dict] | None:
        """The environment's optional ``tools`` after ``reset`` (OpenAI function format, rendered in
        the prompt the chat template's way: the adapters to MCP servers and verifiers' ToolEnv set it)."""
        tools = getattr(env, "tools", None)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise self._start_failed("agent_error" if self.agent else "env_error", f"reset left tools={tools!r:.120}: "
                                     'it must be a list of tool dicts ({"type": "function", "function": {"name", '
                                     '"description", "parameters"}})')
        return tools or None

    async def close(self, tree: RolloutTree | None) -> None:
        """Close every instance left; drop the branches that must never be trained on."""
        await self.forks.close_all()
        self.stats.env_live += self.calls.leave(self.key)
        dropped = [leaf for leaf in self.dropped if leaf.is_leaf]
        if dropped and tree is not None:
            tree.drop_leaves(dropped)
            self.stats.env_dropped += len(dropped)

    # -- forks ------------------------------------------------------------------------------

    def may_fork(self, node: Node) -> bool:
        """Whether a new branch may start at ``node`` (``fork: none``: only before the first step)."""
        return self.forks.may_fork(node)

    async def prepare(self, tree: RolloutTree, node: Node, n: int) -> int:
        """Instances for ``n`` copies sampled from ``node``; returns how many may be sampled (fewer
        when a ``copy()`` timed out: that branch does not start)."""
        return await self.forks.prepare(tree, node, n)

    def hand_over(self, node: Node, children: list[Node]) -> None:
        """The copies prepared at ``node`` were sampled as ``children`` (in order): one instance each."""
        self.forks.hand_over(node, children)

    def is_turn(self, node: Node) -> bool:
        """Whether ``node`` holds an environment turn (not sampled by the model)."""
        return node.id in self.messages

    # -- steps --------------------------------------------------------------------------------

    async def after_turn(self, tree: RolloutTree, node: Node) -> Node | None:
        """Step the branch's environment after the model turn ending at ``node``; returns the
        environment-turn node the episode goes on from, or None when it ended at ``node``."""
        env = await self.forks.instance(tree, node)
        if env is None:  # the replay that built it (a fork, or a rebuild after its slot was taken) diverged
            self._drop(node)
            return None
        turn = self.turns_before(tree, node) + 1
        history = self.history(tree, node)
        try:
            step = await self.calls.call(self.key, env, "step", history)
        except EnvTimeout:
            self._timed_out(node, "step", turn)
            return None
        except Exception as e:
            await self._failed(node, env, turn, f"step raised {type(e).__name__}: {e}")
            return None
        if not isinstance(step, Step):
            await self._failed(node, env, turn, f"step returned a {type(step).__name__}, not "
                               "arbor.Step(messages, done)")
            return None
        try:
            messages = check_messages(step.messages, self._where(turn), self.agent, allow_empty=True)
        except TypeError as e:
            await self._failed(node, env, turn, str(e))
            return None
        if step.done or (self.agent and not messages):
            await self._finish(node, env, turn)
            return None
        if not messages:
            await self._failed(node, env, turn, "step returned Step([], done=False): a step that goes on "
                               "must give the model something to answer")
            return None
        ids = self.setup.render(messages)
        room = self.cfg.max_response_tokens - node.end
        if len(ids) >= room:
            # The response budget is spent. rollout.env_overflow: unfinished ends the episode here
            # with the environment's reward (0 if none): dropping it would train only on the
            # episodes short enough to fit. drop removes the branch (a cut message is not what the
            # environment said, so it is never appended). Either way counted; the step's summary
            # line says how many (one line a step, not one per problem).
            node.finish_reason = TOO_LONG
            log.info("problem %s: the %s's messages of turn %d are %d tokens, but the episode has %d left of its "
                     "response budget (rollout.segment_tokens × rollout.max_depth = %d): %s (rollout.env_overflow)",
                     self._problem_id, "agent" if self.agent else "environment", turn, len(ids), max(room, 0),
                     self.cfg.max_response_tokens, "ended" if self.cfg.env_overflow == "unfinished" else "dropped")
            if self.cfg.env_overflow == "unfinished":
                self.stats.overflow_ended += 1
                await self._finish(node, env, turn, overflow=True)
                return None
            self.stats.env_errors += 1
            self.stats.dropped_too_long += 1
            await self.calls.close(self.key, env)
            self._drop(node)
            return None
        # Never trained (mask 0); logprob 0 stands in for "not sampled" so paths stay uniform.
        tip = tree.add_segment(node, ids, [0.0] * len(ids), [0] * len(ids))
        self.messages[tip.id] = messages
        self.stats.tool_turns += 1
        self.stats.tool_errors += sum(1 for m in messages if m.get("error") is True)
        if not await self.forks.stepped(tip, env, history, step):
            # The copy kept of this state failed (counted there): the branch is dropped.
            tip.finish_reason = FAILED
            await self.calls.close(self.key, env)
            self._drop(tip)
            return None
        return tip

    async def end(self, tree: RolloutTree, node: Node) -> None:
        """The episode ended at ``node`` without a step (length, repetition, abort): its reward."""
        if not self.setup.source.gives_reward and node.id not in self.forks.owned:
            # A fork that never needed its instance: no reward to read, nothing to build just to close.
            self.stats.env_episodes += 1
            self.stats.env_episode_steps += self.turns_before(tree, node)
            return
        env = await self.forks.instance(tree, node)
        if env is None:
            self._drop(node)
            return
        await self._finish(node, env, self.turns_before(tree, node))

    async def _finish(self, node: Node, env: Any, steps: int, overflow: bool = False) -> None:
        """Read the episode's reward (once), then close its instance. ``overflow``: it ended because
        the next message did not fit; an environment without a reward scores it 0."""
        reward = None
        if self.setup.source.gives_reward:
            try:
                reward = await self.calls.call(self.key, env, "reward")
            except EnvTimeout:
                self._timed_out(node, "reward", steps, keep_reason=True)
                return
            except Exception as e:
                await self._failed(node, env, steps, f"reward raised {type(e).__name__}: {e}")
                return
            if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                                       or not math.isfinite(reward)):
                await self._failed(node, env, steps, f"reward returned {reward!r}, not a finite number or None")
                return
        if reward is None and self.setup.needs_reward:
            if not overflow:
                await self._failed(node, env, steps, "reward returned None and reward.functions is empty: the "
                                   "episode has no reward (never silently 0); return a number or add a reward function")
                return
            reward = 0.0  # cut by the budget before the environment judged it: it did not succeed
        node.env_reward = None if reward is None else float(reward)
        self.stats.env_episodes += 1
        self.stats.env_episode_steps += steps
        await self.calls.close(self.key, env)

    # -- the conversation ---------------------------------------------------------------------

    def history(self, tree: RolloutTree, node: Node) -> list[Message]:
        """The episode so far as messages: the reset's, model turns decoded, environment turns."""
        history: list[Message] = [dict(m) for m in self.start]  # type: ignore[misc]
        turn: list[int] = []
        for n in tree.path(node):
            if n.id in self.messages:
                history.append(self._assistant(turn))
                history += [dict(m) for m in self.messages[n.id]]  # type: ignore[misc]
                turn = []
            else:
                turn += n.token_ids
        history.append(self._assistant(turn))
        return history

    def turns_before(self, tree: RolloutTree, node: Node) -> int:
        """Environment turns on the path to ``node``."""
        return sum(1 for n in tree.path(node) if n.id in self.messages)

    def _assistant(self, turn: list[int]) -> Message:
        """A model turn as a message; its stop token belongs to the template, not the content."""
        if turn and turn[-1] in self.stop_ids:
            turn = turn[:-1]
        return {"role": "assistant", "content": self.decode(turn)}

    # -- failures -------------------------------------------------------------------------------

    @property
    def timeout_key(self) -> str:
        return "rollout.agent_timeout_s" if self.agent else "rollout.env_timeout_s"

    @property
    def _problem_id(self) -> str:
        return repr(self.problem.get("id", "<no id>"))

    def _where(self, turn: int) -> str:
        return f"problem {self._problem_id}" + (f", turn {turn}" if turn and not self.agent else "")

    def _failure(self, kind: str, turn: int, what: str) -> EpisodeFailure:
        return EpisodeFailure(kind, self._problem_id, None if self.agent else turn, what)

    async def _failed(self, node: Node, env: Any, turn: int, what: str) -> None:
        """The branch's environment (or agent) failed at ``turn``: recorded (``failures/env_error`` or
        ``agent_error``), its instance closed, the branch dropped; its siblings go on."""
        failure = self._failure("agent_error" if self.agent else "env_error", turn, what)
        self.stats.failures.append(failure)
        log.info("%s: the branch is dropped", failure.describe())
        node.finish_reason = FAILED
        await self.calls.close(self.key, env)
        self._drop(node)

    def _timed_out(self, node: Node, method: str, turn: int, keep_reason: bool = False) -> None:
        """A call past its limit drops the branch at ``node`` ("agent_timeout"/"env_timeout"),
        counted; its siblings go on. Its instance is closed when the call returns."""
        if not keep_reason:
            node.finish_reason = AGENT_TIMEOUT if self.agent else ENV_TIMEOUT
        if self.agent:
            self.stats.agent_timeouts += 1
            failure = self._failure("agent_timeout", turn, f"agent.{method} ran past rollout.agent_timeout_s="
                                    f"{self.cfg.agent_timeout_s:g}s (the call is left running in its thread)")
        else:
            self.stats.env_timeouts += 1
            failure = self._failure("env_timeout", turn, f"env.{method} ran past rollout.env_timeout_s="
                                    f"{self.cfg.env_timeout_s:g}s")
        self.stats.failures.append(failure)
        log.info("%s: the branch is dropped, its siblings go on", failure.describe())
        self._drop(node)

    def _drop(self, node: Node) -> None:
        self.dropped.append(node)


class EpisodeStartError(Exception):
    """A tree's environment could not start its episode (building or ``reset`` failed): the tree is
    dropped and its :class:`~arbor.errors.EpisodeFailure` counted (the sampler catches this)."""

    def __init__(self, failure: EpisodeFailure) -> None:
        super().__init__(failure.describe())
        self.failure = failure


class EpisodesDroppedError(RewardFailureError):
    """Every episode of a step was dropped (an environment's messages over the response budget,
    diverged replays, unscored timeouts): nothing is left to score or train on."""


def check_some_kept(stats: Sequence[SampleStats], rollout_cfg: RolloutConfig, where: str, purpose: str) -> None:
    """:class:`EpisodesDroppedError` naming the response budget's keys when sampling kept no
    episode because every one was dropped (``where``: the step or the eval; ``purpose``: what
    nothing is left for)."""
    dropped = sum(s.env_dropped for s in stats)
    if not dropped:
        return
    too_long = sum(s.dropped_too_long for s in stats)
    rest = f"; {dropped - too_long} by diverged replays or unscored timeouts" if dropped > too_long else ""
    raise EpisodesDroppedError(
        f"{where}: all {dropped} episodes were dropped, {too_long} of them because an agent's or "
        f"environment's messages did not fit the response budget (rollout.segment_tokens × rollout.max_depth "
        f"= {rollout_cfg.segment_tokens} × {rollout_cfg.max_depth} = {rollout_cfg.max_response_tokens} tokens; "
        f"their messages count against it){rest} (env/errors, env/timeouts): nothing is left to {purpose}"
    )
