"""TreePO segment-wise tree sampling (ALGORITHMS.md §1) over any :class:`RolloutEngine`.

    trees, stats = await sample_trees(client, problems, prompts, cfg.rollout,
                                      eos_token_ids=[tok.eos_token_id], seed=step)
    trees[0].leaves()            # cfg.rollout.width leaves whenever the budget allows
    stats[0].shortfall_reason    # None, or why that tree has fewer

Each tree runs its own loop of rounds (trees run concurrently, so a slow tree never
holds up another); a round sends one request per active path, with ``n`` = the copies
that path forks into, so the server's radix cache computes the shared prefix once. All
requests of a tree carry ``affinity_key = "tree-<index>"`` so they reach one server.

Decisions (where the paper leaves room):
- The root starts as one path (rounds 1 → 2 → 4 → 8 → 16 at w = 16, b = 2), or as
  ``randint(2, init_divergence)`` copies when ``init_divergence ≥ 2``.
- Every ended path (finished or failed) is a leaf and counts towards ``width``; the
  budget of every path that ended in a round is transferred to the survivors.
- A path is **finished** ("stop") when the engine stopped on EOS / a stop token. With an
  ``is_final_answer`` predicate, paths whose response holds a final answer are the
  preferred fallback sources. **Failed** paths end with "repetition" (the segment
  repeats itself: some ``repetition_window``-long substring of its decoded text occurs
  ``repetition_count`` times, or token n-grams when no ``decode`` is given),
  "max_length" (``max_depth · segment_tokens`` response tokens), "max_depth", or
  "abort" (the engine aborted the request), or "agent_timeout" (an agent's ``step`` ran
  past ``rollout.agent_timeout_s``: the episode ends at that model turn, a warning names
  the problem, and ``stats.agent_timeouts`` counts it; the rest of the batch goes on).
- Fallback (only when a tree has no active path and fewer than ``width`` leaves) cuts a
  finished ("stop") trajectory at a random node boundary on its path — the root or an
  internal node, never the leaf itself — and restarts the loop there as one active path.
- ``mode: independent`` (the GRPO baseline) is one round: one request ``n = width`` with
  the whole response budget ``max_depth · segment_tokens`` — the fastest way an engine can
  sample independent answers, so tree-vs-independent benchmarks are conservative.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from arbor.agents import Agent, Message
from arbor.config import RolloutConfig
from arbor.engines.types import GenerateOutput, GenerateRequest, RolloutEngine, SamplingParams
from arbor.sampler_budget import assign_branches, is_repetitive, next_total, request_seed
from arbor.tree import Node, RolloutTree

FINISHED = "stop"  # the only well-formed ending; everything else is an early stop
AGENT_TIMEOUT = "agent_timeout"  # agent.step ran past rollout.agent_timeout_s

log = logging.getLogger(__name__)


@dataclass
class SampleStats:
    """What sampling one tree cost, and why it has fewer than ``width`` leaves if so."""

    leaves: int = 0
    requests: int = 0
    rounds: int = 0
    tokens_generated: int = 0  # Σ output tokens
    prompt_tokens: int = 0  # Σ over outputs of their input length
    cached_tokens: int = 0  # Σ over outputs of input tokens served from the radix cache
    fallbacks: int = 0
    tool_turns: int = 0  # agent turns appended (multi-turn episodes)
    tool_errors: int = 0  # agent messages marked "error" (a tool timed out, raised, ...)
    agent_timeouts: int = 0  # agent.step calls past rollout.agent_timeout_s (episode ended)
    finish_reasons: dict[str, int] = field(default_factory=dict)  # leaf reason → count
    shortfall_reason: str | None = None

    @property
    def tokens_computed(self) -> int:
        """Prefill + decode tokens the engine actually ran through the model."""
        return self.prompt_tokens - self.cached_tokens + self.tokens_generated


@dataclass
class _Path:
    node: Node  # the last segment of the path (the root before its first segment)
    logprob: float  # Σ behaviour logprobs along the path (branch assignment's score)


async def sample_trees(
    engine: RolloutEngine,
    problems: Sequence[dict | None],
    prompts: Sequence[Sequence[int]],
    cfg: RolloutConfig,
    *,
    eos_token_ids: Sequence[int] = (),
    seed: int = 0,
    is_final_answer: Callable[[list[int]], bool] | None = None,
    decode: Callable[[list[int]], str] | None = None,
    on_progress: Callable[[int, RolloutTree, SampleStats], None] | None = None,
    agent: Agent | None = None,
    render: Callable[[list[Message]], list[int]] | None = None,
) -> tuple[list[RolloutTree], list[SampleStats]]:
    """One tree per prompt, sampled concurrently; returns ``(trees, stats)`` in prompt order.

    ``eos_token_ids`` are sent as stop tokens (SGLang also stops on the model's own EOS).
    ``is_final_answer(response_ids)`` says whether a response holds a final answer;
    ``decode(ids) -> str`` makes the repetition rule work on text. ``on_progress(i,
    tree, stats)`` is called as each tree completes.

    With an ``agent`` (multi-turn episodes), a model turn that ends on a stop token is a
    decision point: ``agent.step(problem, history)`` (run in a thread, so the tool calls
    of different branches run concurrently) either ends the episode (None) or gives
    messages whose ids, ``render(messages)`` (e.g. :func:`arbor.agents.continuation_ids`),
    are appended as a node with ``loss_mask = 0``; the path then continues and may fork
    there like at any segment boundary. The history holds ``agent.start(problem)``, then
    each model turn decoded (``decode`` is required) and each tool turn as given. A step
    is given ``cfg.agent_timeout_s`` seconds; past that its episode ends ("agent_timeout").
    """
    if agent is not None and (render is None or decode is None):
        raise ValueError("sampling with an agent needs render (messages -> ids) and decode")
    if len(problems) != len(prompts):
        raise ValueError(f"{len(problems)} problems but {len(prompts)} prompts")
    if cfg.mode not in ("tree", "independent"):
        raise ValueError(f"rollout.mode must be 'tree' or 'independent', got {cfg.mode!r}")

    async def one(index: int) -> tuple[RolloutTree, SampleStats]:
        sampler = _TreeSampler(
            engine, cfg, index, list(eos_token_ids), seed, is_final_answer, decode, agent, render
        )
        tree = RolloutTree(list(prompts[index]), problems[index])
        stats = await sampler.run(tree)
        if on_progress is not None:
            on_progress(index, tree, stats)
        return tree, stats

    results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return [t for t, _ in results], [s for _, s in results]


def sample_trees_sync(*args, **kwargs) -> tuple[list[RolloutTree], list[SampleStats]]:
    """:func:`sample_trees` from synchronous code (starts its own event loop)."""
    return asyncio.run(sample_trees(*args, **kwargs))


class _TreeSampler:
    """The round loop of one tree (paper Algorithm 1)."""

    def __init__(
        self,
        engine: RolloutEngine,
        cfg: RolloutConfig,
        index: int,
        stop_ids: list[int],
        seed: int,
        is_final_answer: Callable[[list[int]], bool] | None,
        decode: Callable[[list[int]], str] | None,
        agent: Agent | None = None,
        render: Callable[[list[Message]], list[int]] | None = None,
    ) -> None:
        self.engine, self.cfg, self.index = engine, cfg, index
        self.agent, self.render = agent, render
        self.tool_messages: dict[int, list[Message]] = {}  # tool node id → the agent's messages
        self.stop_ids, self.seed = stop_ids, seed
        self.is_final_answer, self.decode = is_final_answer, decode
        self.stats = SampleStats()
        self.forks_sent: dict[int, int] = {}  # node id → requests already sent from it
        # Fallback choices: one stream per tree so trees stay independent of each other.
        self.rng = random.Random(f"{seed}/{index}/fallback")
        self.answered: set[int] = set()  # leaf ids whose response holds a final answer

    async def run(self, tree: RolloutTree) -> SampleStats:
        cfg, width = self.cfg, self.cfg.width
        if cfg.mode == "independent":
            # One request n = width; with an agent, each episode then goes on alone.
            active, counts = [_Path(tree.root, 0.0)], [width]
            while active:
                active, _ = await self._round(tree, active, counts, cfg.max_response_tokens)
                counts = [1] * len(active)
            return self._done(tree)
        copies = 1
        if cfg.init_divergence >= 2:
            rng = random.Random(f"{self.seed}/{self.index}/init")
            copies = min(width, rng.randint(2, cfg.init_divergence))
        active, counts = [_Path(tree.root, 0.0)], [copies]
        finished = 0  # ended paths (leaves); the active paths' tips are leaves too, for now
        while True:
            active, newly = await self._round(tree, active, counts, cfg.segment_tokens)
            finished += newly
            if not active:
                if finished >= width:
                    break
                restart = self._fallback(tree)
                if restart is None:
                    break
                active, newly = [restart], 0
            total = next_total(
                active=len(active),
                finished=finished,
                newly_finished=newly,
                width=width,
                branch=cfg.branch,
            )
            counts = assign_branches(
                total,
                [p.logprob for p in active],
                mode=cfg.branch_assignment,
                temperature=cfg.branch_temperature,
                favor=cfg.branch_favor,
            )
        return self._done(tree)

    async def _round(
        self, tree: RolloutTree, active: list[_Path], counts: list[int], max_new: int
    ) -> tuple[list[_Path], int]:
        """Run one segment for every path (``counts[i]`` copies of path i).

        Returns the paths that continue and how many ended this round.
        """
        cfg = self.cfg
        requests = []
        for path, n in zip(active, counts):
            fork = self.forks_sent.get(path.node.id, 0)
            self.forks_sent[path.node.id] = fork + 1
            sampling = SamplingParams(
                max_new_tokens=min(max_new, cfg.max_response_tokens - path.node.end),
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                n=n,
                stop_token_ids=list(self.stop_ids),
                seed=request_seed(self.seed, self.index, path.node.id, fork),
            )
            input_ids = tree.prompt_ids + _response_upto(tree, path.node)
            requests.append(GenerateRequest(input_ids, sampling, f"tree-{self.index}"))
        results = await _generate_all(self.engine, requests)
        self.stats.rounds += 1
        self.stats.requests += len(requests)
        survivors: list[_Path] = []
        ended = 0
        # Children are added in request order so node ids (and seeds) are reproducible.
        turns: list[tuple[Node, float]] = []  # finished model turns: decision points
        for path, request, outputs in zip(active, requests, results):
            if len(outputs) != request.sampling.n:
                raise RuntimeError(
                    f"engine returned {len(outputs)} outputs for a request of n={request.sampling.n}"
                )
            for out in outputs:
                node = self._add(tree, path.node, out)
                logprob = path.logprob + sum(out.logprobs)
                if node.finish_reason in (None, "length"):
                    survivors.append(_Path(node, logprob))
                elif self.agent is not None and node.finish_reason == FINISHED:
                    turns.append((node, logprob))
                else:
                    ended += 1
        if turns:
            replies = await asyncio.gather(*(self._agent_step(tree, node) for node, _ in turns))
            for (node, logprob), messages in zip(turns, replies):
                tool = self._add_tool_turn(tree, node, messages) if messages else None
                if tool is not None and tool.finish_reason is None:
                    survivors.append(_Path(tool, logprob))
                else:
                    ended += 1
        return survivors, ended

    async def _agent_step(self, tree: RolloutTree, node: Node) -> list[Message] | None:
        """``agent.step`` after the model turn ending at ``node``, given ``agent_timeout_s``.

        Past the limit the episode ends at ``node`` ("agent_timeout", counted and warned
        about) and the step's thread is abandoned (see :func:`_in_daemon_thread`).
        """
        history = self._history(tree, node)
        step = _in_daemon_thread(self.agent.step, tree.problem, history)
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

    def _add_tool_turn(self, tree: RolloutTree, node: Node, messages: list[Message]) -> Node | None:
        """Append the agent's messages after a model turn, as untrained template ids
        (None: the model turn used up the response budget, the episode ends there)."""
        room = self.cfg.max_response_tokens - node.end
        if room <= 0:
            return None
        # A tool may print far more than the episode has room for (a long traceback): the
        # turn is cut at the response budget, so no path outgrows max_response_tokens (and
        # the model's context); the episode then ends there ("max_length").
        ids = self.render(messages)[:room]
        # Never trained (mask 0); logprob 0 stands in for "not sampled" so paths stay uniform.
        tool = tree.add_segment(node, ids, [0.0] * len(ids), [0] * len(ids))
        self.tool_messages[tool.id] = list(messages)
        self.stats.tool_turns += 1
        self.stats.tool_errors += sum(1 for m in messages if m.get("error"))
        tool.finish_reason = "max_length" if tool.end >= self.cfg.max_response_tokens else None
        return tool

    def _history(self, tree: RolloutTree, node: Node) -> list[Message]:
        """The episode so far as messages: the agent's start, model turns decoded, tool turns."""
        history = list(self.agent.start(tree.problem))
        turn: list[int] = []
        for n in tree.path(node):
            if n.id in self.tool_messages:
                history.append(self._assistant(turn))
                history += self.tool_messages[n.id]
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

    def _add(self, tree: RolloutTree, parent: Node, out: GenerateOutput) -> Node:
        """Record one segment and decide whether its path ended (sets ``finish_reason``)."""
        s, cfg = self.stats, self.cfg
        s.tokens_generated += len(out.output_ids)
        s.prompt_tokens += out.prompt_tokens
        s.cached_tokens += out.cached_tokens
        node = tree.add_segment(parent, out.output_ids, out.logprobs)
        node.weight_version = out.weight_version
        segment: Sequence = out.output_ids if self.decode is None else self.decode(out.output_ids)
        if out.finish_reason == "stop":
            reason = FINISHED
            if self.is_final_answer is not None and self.is_final_answer(tree.response_ids(node)):
                self.answered.add(node.id)
        elif out.finish_reason == "abort":
            reason = "abort"
        elif is_repetitive(segment, cfg.repetition_window, cfg.repetition_count):
            reason = "repetition"
        elif node.end >= cfg.max_response_tokens:
            reason = "max_length"
        elif cfg.mode == "tree" and node.depth >= cfg.max_depth:
            reason = "max_depth"
        elif not out.output_ids:
            # An empty non-stop segment would loop forever; the engine hit its context limit.
            reason = "max_length"
        else:
            reason = out.finish_reason  # "length": the path continues
        node.finish_reason = reason
        return node

    def _fallback(self, tree: RolloutTree) -> _Path | None:
        """A restart point cut from a well-formed finished trajectory, or None (records why)."""
        if not self.cfg.fallback:
            self.stats.shortfall_reason = "no active path left and fallback is disabled"
            return None
        finished = [leaf for leaf in tree.leaves() if leaf.finish_reason == FINISHED]
        answered = [leaf for leaf in finished if leaf.id in self.answered]
        sources = answered or finished
        if not sources:
            self.stats.shortfall_reason = (
                "no active path left and no well-formed (EOS-terminated) trajectory to fall "
                "back on: every path ended early (" + _reasons(tree) + ")"
            )
            return None
        leaf = self.rng.choice(sources)
        # Boundaries: the root and every internal node above the leaf (token aligned).
        boundaries = [tree.root] + tree.path(leaf)[:-1]
        cut = self.rng.choice(boundaries)
        self.stats.fallbacks += 1
        logprob = sum(sum(n.logprobs or []) for n in tree.path(cut)) if cut.parent else 0.0
        return _Path(cut, logprob)

    def _done(self, tree: RolloutTree) -> SampleStats:
        leaves = tree.leaves()
        self.stats.leaves = len(leaves)
        reasons: dict[str, int] = {}
        for leaf in leaves:
            reasons[leaf.finish_reason or "?"] = reasons.get(leaf.finish_reason or "?", 0) + 1
        self.stats.finish_reasons = reasons
        if len(leaves) < self.cfg.width and self.stats.shortfall_reason is None:
            self.stats.shortfall_reason = f"the engine ended every path early ({_reasons(tree)})"
        return self.stats


def _in_daemon_thread(fn: Callable[..., Any], *args: object) -> asyncio.Future[Any]:
    """``fn(*args)`` in a new daemon thread, as a future of the running loop.

    Not ``asyncio.to_thread``: a thread cannot be killed, and a hung agent step would hold
    a worker of the loop's default executor, which ``asyncio.run`` joins before it returns
    (blocking the next step) and the interpreter joins at exit. A daemon thread is simply
    abandoned when its caller stops waiting: it runs on, holding whatever it holds (a tool
    subprocess, memory), until it returns or the process exits. One thread per call, so
    a timed-out step costs a thread, never a slot that later steps would queue behind (the
    time limit counts the step alone); agents bound their own tools (``arbor.tools``).
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


def _response_upto(tree: RolloutTree, node: Node) -> list[int]:
    return tree.response_ids(node) if node.parent is not None else []


def _reasons(tree: RolloutTree) -> str:
    counts: dict[str, int] = {}
    for leaf in tree.leaves():
        counts[leaf.finish_reason or "?"] = counts.get(leaf.finish_reason or "?", 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "no leaves"


async def _generate_all(engine: RolloutEngine, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
    """A round's requests, through the engine's batch call when it has one (the HTTP
    client sends the round as one ``/generate``), else one call each, concurrently."""
    many = getattr(engine, "generate_many", None)
    if many is not None:
        return await many(requests)
    return list(await asyncio.gather(*(engine.generate(r) for r in requests)))
