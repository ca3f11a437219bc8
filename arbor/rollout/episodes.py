"""Multi-turn episodes in a rollout tree: what follows each finished model turn.

    turns = AgentTurns(agent, render, decode, stop_ids, cfg, stats)
    messages = await turns.step(tree, node)       # the agent's answer to the turn ending at node
    tool = turns.add(tree, node, messages)        # appended as untrained ids (loss mask 0)

The sampler (:mod:`arbor.rollout.sampler`) owns the tree and the requests; this module owns
the conversation: the history an agent reads (its start, each model turn decoded, each
tool turn as the agent gave it) and the ids its messages append (``render``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from arbor.config import RolloutConfig
from arbor.rollout.agent_thread import in_daemon_thread
from arbor.rollout.agents import Agent, Message
from arbor.rollout.sample_stats import SampleStats
from arbor.tree import Node, RolloutTree

AGENT_TIMEOUT = "agent_timeout"  # agent.step ran past rollout.agent_timeout_s

log = logging.getLogger(__name__)


class AgentTurns:
    """One tree's agent turns: the agent's steps (in threads, time-limited) and their nodes."""

    def __init__(
        self,
        agent: Agent,
        render: Callable[[list[Message]], list[int]],
        decode: Callable[[list[int]], str],
        stop_ids: list[int],
        cfg: RolloutConfig,
        stats: SampleStats,
    ) -> None:
        self.agent, self.render, self.decode, self.stop_ids = agent, render, decode, stop_ids
        self.cfg, self.stats = cfg, stats
        self.messages: dict[int, list[Message]] = {}  # tool node id → the agent's messages

    def is_tool(self, node: Node) -> bool:
        """Whether ``node`` holds an agent turn (not sampled by the model)."""
        return node.id in self.messages

    async def step(self, tree: RolloutTree, node: Node) -> list[Message] | None:
        """``agent.step`` after the model turn ending at ``node``, given ``agent_timeout_s``.

        Past the limit the episode ends at ``node`` ("agent_timeout", counted and warned
        about) and the step's thread is abandoned (see :func:`arbor.rollout.agent_thread.in_daemon_thread`).
        """
        history = self.history(tree, node)
        step = in_daemon_thread(self.agent.step, tree.problem, history)
        try:
            return await asyncio.wait_for(step, self.cfg.agent_timeout_s)
        except asyncio.TimeoutError:
            node.finish_reason = AGENT_TIMEOUT
            self.stats.agent_timeouts += 1
            log.warning(
                "problem %s: agent.step ran past rollout.agent_timeout_s=%gs; its episode ends "
                "there (%s) and the call is left running in its thread",
                tree.problem_id,
                self.cfg.agent_timeout_s,
                AGENT_TIMEOUT,
            )
            return None

    def add(self, tree: RolloutTree, node: Node, messages: list[Message]) -> Node | None:
        """Append the agent's messages after a model turn, as untrained template ids
        (None: the model turn used up the response budget, the episode ends there)."""
        room = self.cfg.max_response_tokens - node.end
        if room <= 0:
            return None
        # A tool may print far more than the episode has room for (a long traceback): the
        # turn is cut at the response budget, so no path outgrows max_response_tokens (and
        # the model's context); the episode then ends there ("max_length").
        for m in messages:
            if not isinstance(m.get("error", False), bool):
                raise TypeError(f"problem {tree.problem_id}: an agent message's 'error' must be true or false "
                                f"(a failed tool call), got {m['error']!r}")
        ids = self.render(messages)[:room]
        # Never trained (mask 0); logprob 0 stands in for "not sampled" so paths stay uniform.
        tool = tree.add_segment(node, ids, [0.0] * len(ids), [0] * len(ids))
        self.messages[tool.id] = list(messages)
        self.stats.tool_turns += 1
        self.stats.tool_errors += sum(1 for m in messages if m.get("error") is True)
        tool.finish_reason = "max_length" if tool.end >= self.cfg.max_response_tokens else None
        return tool

    def history(self, tree: RolloutTree, node: Node) -> list[Message]:
        """The episode so far as messages: the agent's start, model turns decoded, tool turns."""
        assert tree.problem is not None  # an agent's episodes have problems
        history = list(self.agent.start(tree.problem))
        turn: list[int] = []
        for n in tree.path(node):
            if n.id in self.messages:
                history.append(self._assistant(turn))
                history += self.messages[n.id]
                turn = []
            else:
                turn += n.token_ids
        history.append(self._assistant(turn))
        return history

    def _assistant(self, turn: list[int]) -> Message:
        """A model turn as a message; its stop token belongs to the template, not the content."""
        if turn and turn[-1] in self.stop_ids:
            turn = turn[:-1]
        return {"role": "assistant", "content": self.decode(turn)}
