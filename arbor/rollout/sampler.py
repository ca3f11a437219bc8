"""TreePO segment-wise tree sampling (docs/algorithms.md) over any :class:`RolloutEngine`.

    trees, stats = await sample_trees(client, problems, prompts, cfg.rollout,
                                      eos_token_ids=[tok.eos_token_id], seed=step)
    trees[0].leaves()            # cfg.rollout.width leaves whenever the budget allows
    stats[0].shortfall_reason    # None, or why that tree has fewer

Each tree runs its own loop of rounds (trees run concurrently, so a slow tree never
holds up another); a round has one request per active path, with ``n`` = the copies
that path forks into, so the server's radix cache computes the shared prefix once. All
requests of a tree carry ``affinity_key = "tree-<index>"`` so they reach one server.
The rounds that trees submit together go out as one batched call per server
(:mod:`arbor.rollout.batching`; ``across_trees=False``: one call per round of a tree).

What it does, against paper Algorithm 1 and the reference code (github
multimodal-art-projection/TreePO at b86ce51, ``vllm_rollout_spmd.py``, cited "spmd:LINE";
``generate_sequences_tree_deepth_first_vanilla_mode`` with ``recipe/treepo/run_treepo_train.sh``):
- The root is forked ``branch`` times before the first segment (Alg. 1 line 2; spmd:626),
  so paths per round go b, b², … up to ``width``. ``rollout.root_fork`` changes that:
  ``k`` copies (``1``: one root path, every leaf sharing its first segment — the most
  prefix sharing, which the paper does not use), or
  ``[lo, hi]``: ``randint(lo, hi)`` per tree (the paper's "More Init Divergence", 2 to 8;
  spmd:606-615; the reference's own script never passes it: fsdp_workers.py:711,
  spmd:539-540, docs/algorithms.md).
- Every ended path (finished or failed) is a leaf and counts towards ``width``; the
  budget of every path that ended in a round is transferred to the survivors (spmd:844-850).
- ``branch_assignment: logprob`` scores a path by its last segment's mean token log-prob
  (``branch_logprob: last_segment``, the paper's §4.4 "log probabilities of their last
  segment"; spmd:920-926) or by the whole path's sum (``path``; spmd:884-888). The
  last segment is the default: it is what the paper describes, and unlike a path sum it
  does not favour the shorter paths a fallback mixes in.
- A path is **finished** ("stop") when the engine stopped on EOS / a stop token. With an
  ``is_final_answer`` predicate, paths whose response holds a final answer are the
  first fallback sources. **Failed** paths end with "repetition" (the segment
  repeats itself: some ``repetition_window``-long substring of its decoded text occurs
  ``repetition_count`` times, or token n-grams when no ``decode`` is given),
  "max_length" (``max_depth · segment_tokens`` response tokens), "max_depth", or
  "abort" (the engine aborted the request). A branch whose agent or environment failed
  (raised, a bad value, past its time limit) is dropped and recorded (:mod:`arbor.errors`).
- Fallback, only when a tree has no active path and fewer than ``width`` leaves (paper
  §2.2; spmd:949-955), spends the whole remaining budget ``width − leaves`` in one round:
  every finished ("stop") trajectory, answered ones first then in random order, is cut at
  a random node boundary on its path (the root or an internal node, never the leaf:
  segment aligned) and restarted with ``branch`` copies until the budget is spent
  (spmd:1043-1084); cuts at the same node are one request. When no trajectory is
  well-formed, the root restarts with ``branch`` copies (spmd:1033-1041), so a tree
  always ends with exactly ``width`` leaves. ``fallback: false`` stops there instead,
  with a shortfall (the reference's ``no_fallback``, spmd:945-947).
- ``fork_at: entropy`` grows the tree with TreeRL's EPTree instead (whole answers forked at
  their highest-entropy tokens, :mod:`arbor.rollout.entropy_fork`), with the same early stops;
  with an environment a whole answer is a whole episode (model and environment turns), and a
  fork point is a token of a model turn. Points whose copies start at one node (the first tokens
  of sibling answers) are one request from it.
- With an environment (:mod:`arbor.rollout.episodes`) every request's copies get their own
  instance first (:mod:`arbor.rollout.env_forks`); one whose ``fork`` is ``none`` keeps a path
  at one copy once it has stepped, the copies it loses going to the paths that may fork.
- ``mode: independent`` (the GRPO baseline) is one round: one request ``n = width`` with
  the whole response budget ``max_depth · segment_tokens`` — the fastest way an engine can
  sample independent answers, so tree-vs-independent benchmarks are conservative.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from arbor.config import RolloutConfig
from arbor.engines.types import GenerateOutput, GenerateRequest, RolloutEngine, SamplingParams
from arbor.rollout.agents import Agent, Message
from arbor.rollout.batching import RoundBatcher
from arbor.rollout.budget import (
    assign_branches,
    cap_copies,
    fallback_copies,
    is_repetitive,
    next_total,
    request_seed,
    root_copies,
    segment_score,
)
from arbor.rollout.entropy_fork import Scores, entropy_forks, split_for_fork, token_scores
from arbor.rollout.env_calls import EnvCalls
from arbor.rollout.episodes import (
    EpisodeSetup,
    EpisodeStartError,
    TreeEpisodes,
    episode_setup,
    reset_seed,
)
from arbor.rollout.sample_stats import SampleStats
from arbor.tree import Node, RolloutTree

FINISHED = "stop"  # the only well-formed ending; everything else is an early stop

@dataclass
class _Path:
    node: Node  # the last segment of the path (the root before its first segment)
    logprob: float  # Σ behaviour logprobs along the path (branch_logprob: path)
    last_logprob: float = 0.0  # mean logprob of its last sampled segment (last_segment)


async def sample_trees(
    engine: RolloutEngine,
    problems: Sequence[dict | None],
    prompts: Sequence[Sequence[int]] | None,
    cfg: RolloutConfig,
    *,
    eos_token_ids: Sequence[int] = (),
    seed: int = 0,
    is_final_answer: Callable[[list[int]], bool] | None = None,
    decode: Callable[[list[int]], str] | None = None,
    on_progress: Callable[[int, RolloutTree, SampleStats], None] | None = None,
    agent: Agent | None = None,
    render: Callable[[list[Message]], list[int]] | None = None,
    env: EpisodeSetup | None = None,
    is_stale: Callable[[str], bool] | None = None,
    across_trees: bool = True,
) -> tuple[list[RolloutTree], list[SampleStats]]:
    """One tree per prompt, sampled concurrently; returns ``(trees, stats)`` in prompt order.

    ``across_trees``: the rounds trees submit together share one engine call (the default:
    fewest calls); False: each round of each tree is its own call. The trees are the same.

    ``is_stale(weight_version)`` (partial rollouts, ``engine.partial_rollouts``): whether a
    segment that comes back sampled by that version was overtaken by a weight update while
    in flight; such a request is sent again from the same parent (its path's last finished
    segment) under the new weights, and counted in ``stats.resampled``. None: every segment
    is kept, tagged with the version that sampled it.

    ``eos_token_ids`` are sent as stop tokens (SGLang also stops on the model's own EOS).
    ``is_final_answer(response_ids)`` says whether a response holds a final answer;
    ``decode(ids) -> str`` makes the repetition rule work on text. ``on_progress(i,
    tree, stats)`` is called as each tree completes.

    Multi-turn episodes: with an ``env`` (:class:`~arbor.rollout.episodes.EpisodeSetup`), each
    tree's prompt is its environment's ``reset`` messages (``env.prompt``; ``prompts`` may then be
    None), and a model turn that ends on a stop token is a decision point: the branch's own
    instance's ``step(history)`` either ends the episode or gives messages whose ids,
    ``env.render(messages)``, are appended as a node with ``loss_mask = 0``; the path then goes on
    and may fork there like at any segment boundary. ``decode`` is required. An ``agent`` (and
    its ``render``) is the same, as a stateless environment; ``prompts`` then come from its
    ``start``. Calls are given ``cfg.env_timeout_s`` (an agent's step ``cfg.agent_timeout_s``).
    """
    env = episode_setup(agent, render, env, decode, prompts is None)
    if prompts is not None and len(problems) != len(prompts):
        raise ValueError(f"{len(problems)} problems but {len(prompts)} prompts")
    if cfg.mode not in ("tree", "independent"):
        raise ValueError(f"rollout.mode must be 'tree' or 'independent', got {cfg.mode!r}")

    batcher = RoundBatcher(engine, across_trees=across_trees)
    timeout = cfg.agent_timeout_s if env is not None and env.source.is_agent else cfg.env_timeout_s
    calls = EnvCalls(timeout, cfg.max_live_envs)

    async def one(index: int) -> tuple[RolloutTree, SampleStats]:
        stats = SampleStats()
        episodes = None if env is None else TreeEpisodes(env, calls, cfg, stats, decode, eos_token_ids, index)
        sampler = _TreeSampler(batcher, cfg, index, list(eos_token_ids), seed, is_final_answer, decode, episodes,
                               is_stale, stats)
        tree = None
        try:
            try:
                prompt = None if episodes is None else await episodes.reset(problems[index], reset_seed(seed, index))
            except EpisodeStartError as e:  # its environment could not start: a tree with no leaves
                stats.failures.append(e.failure)
                stats.unstarted += 1
                tree = RolloutTree([], problems[index])
            else:
                tree = RolloutTree(list(prompts[index]) if prompt is None else prompt, problems[index])  # type: ignore[index]
                await sampler.run(tree)
        finally:
            if episodes is not None:  # every instance is closed, also after an error
                await episodes.close(tree)
        sampler.done(tree)
        if on_progress is not None:
            on_progress(index, tree, stats)
        return tree, stats

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(problems))]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        # The other trees stop too, closing their environments, before the error goes up.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return [t for t, _ in results], [s for _, s in results]


def sample_trees_sync(*args, **kwargs) -> tuple[list[RolloutTree], list[SampleStats]]:
    """:func:`sample_trees` from synchronous code (starts its own event loop)."""
    return asyncio.run(sample_trees(*args, **kwargs))


class _TreeSampler:
    """The round loop of one tree (paper Algorithm 1)."""

    def __init__(
        self,
        batcher: RoundBatcher,
        cfg: RolloutConfig,
        index: int,
        stop_ids: list[int],
        seed: int,
        is_final_answer: Callable[[list[int]], bool] | None,
        decode: Callable[[list[int]], str] | None,
        episodes: TreeEpisodes | None = None,
        is_stale: Callable[[str], bool] | None = None,
        stats: SampleStats | None = None,
    ) -> None:
        self.batcher, self.cfg, self.index = batcher, cfg, index
        self.is_stale = is_stale
        self.stop_ids, self.seed = stop_ids, seed
        self.is_final_answer, self.decode = is_final_answer, decode
        self.stats = SampleStats() if stats is None else stats
        self.episodes = episodes  # multi-turn episodes: the environment of every branch
        self.forks_sent: dict[int, int] = {}  # node id → requests already sent from it
        # Fallback choices: one stream per tree so trees stay independent of each other.
        self.rng = random.Random(f"{seed}/{index}/fallback")
        self.answered: set[int] = set()  # leaf ids whose response holds a final answer

    async def run(self, tree: RolloutTree) -> None:
        cfg, width = self.cfg, self.cfg.width
        if cfg.mode == "independent":
            # One request n = width; with an environment, each episode then goes on alone.
            active, counts = [_Path(tree.root, 0.0)], [width]
            while active:
                active, _ = await self._round(tree, active, counts, cfg.max_response_tokens)
                counts = [1] * len(active)
            return
        if cfg.fork_at == "entropy":  # TreeRL's EPTree: whole paths, forked at high-entropy tokens
            await self._entropy_rounds(tree)
            return
        rng = random.Random(f"{self.seed}/{self.index}/init")
        # Capped at width: a RolloutConfig built in code skips validate's check.
        copies = min(width, root_copies(cfg.root_fork, branch=cfg.branch, rng=rng))
        active, counts = [_Path(tree.root, 0.0)], [copies]
        ended = 0  # ended paths (leaves); the active paths' tips are leaves too, for now
        while True:
            sent = self.stats.requests
            active, newly = await self._round(tree, active, counts, cfg.segment_tokens)
            ended += newly
            if self.stats.requests == sent:  # no copy got an environment: nothing more can start
                break
            if not active:
                if ended >= width:
                    break
                restart = self._fallback(tree, width - ended)
                if restart is None:
                    break
                active, counts = restart  # the fallback sets its own copies
                continue
            total = next_total(
                active=len(active),
                finished=ended,
                newly_finished=newly,
                width=width,
                branch=cfg.branch,
            )
            last = cfg.branch_logprob == "last_segment"
            counts = assign_branches(
                total,
                [p.last_logprob if last else p.logprob for p in active],
                mode=cfg.branch_assignment,
                temperature=cfg.branch_temperature,
                favor=cfg.branch_favor,
            )
            if self.episodes is not None:  # fork: none past the first step: one copy, the rest elsewhere
                counts = cap_copies(counts, [self.episodes.may_fork(p.node) for p in active])

    async def _round(
        self, tree: RolloutTree, active: list[_Path], counts: list[int], max_new: int
    ) -> tuple[list[_Path], int]:
        """Run one segment for every path (``counts[i]`` copies of path i).

        Returns the paths that continue and how many ended this round.
        """
        if self.episodes is not None:  # an environment instance for every copy (fewer if a fork failed)
            counts = await self._prepare(tree, [p.node for p in active], counts)
            active, counts = [p for p, n in zip(active, counts) if n], [n for n in counts if n]
        requests = [self._request(tree, path.node, n, max_new) for path, n in zip(active, counts)]
        results = await self._generate(tree, requests)
        self.stats.rounds += 1
        self.stats.requests += len(requests)
        survivors: list[_Path] = []
        over: list[Node] = []  # paths that ended this round
        turns: list[_Path] = []  # finished model turns: decision points of an environment
        # Children are added in request order so node ids (and seeds) are reproducible.
        for path, request, outputs in zip(active, requests, results):
            if len(outputs) != request.sampling.n:
                raise RuntimeError(
                    f"engine returned {len(outputs)} outputs for a request of n={request.sampling.n}"
                )
            nodes = [self._add(tree, path.node, out) for out in outputs]
            if self.episodes is not None:
                self.episodes.hand_over(path.node, nodes)
            for node, out in zip(nodes, outputs):
                grown = _Path(node, path.logprob + sum(out.logprobs), segment_score(out.logprobs))
                if node.finish_reason in (None, "length"):
                    survivors.append(grown)
                elif self.episodes is not None and node.finish_reason == FINISHED:
                    turns.append(grown)
                else:
                    over.append(node)
        going_on = await self._settle(tree, over, turns)
        return survivors + going_on, len(over) + len(turns) - len(going_on)

    async def _prepare(self, tree: RolloutTree, parents: list[Node], counts: list[int]) -> list[int]:
        """Environment instances for ``counts[i]`` copies from ``parents[i]``; the copies each got."""
        assert self.episodes is not None
        return list(await asyncio.gather(*(self.episodes.prepare(tree, p, n) for p, n in zip(parents, counts))))

    async def _settle(self, tree: RolloutTree, over: list[Node], turns: list[_Path]) -> list[_Path]:
        """Episodes that ended at ``over`` read their rewards; each finished model turn of ``turns``
        gets its environment's answer. Returns the paths that go on after an environment turn."""
        if self.episodes is None:
            return []
        episodes = self.episodes
        await asyncio.gather(*(episodes.end(tree, node) for node in over))
        tips = await asyncio.gather(*(episodes.after_turn(tree, t.node) for t in turns))
        # An environment turn is not sampled: the path keeps its model turn's scores.
        return [_Path(tip, t.logprob, t.last_logprob) for t, tip in zip(turns, tips) if tip is not None]

    def _request(self, tree: RolloutTree, parent: Node, n: int, max_new: int, entropy: bool = False) -> GenerateRequest:
        """``n`` continuations of the path ending at ``parent``, at most ``max_new`` tokens each
        (and never past the response budget), seeded by the parent and how often it was forked."""
        cfg = self.cfg
        fork = self.forks_sent.get(parent.id, 0)
        self.forks_sent[parent.id] = fork + 1
        sampling = SamplingParams(
            max_new_tokens=min(max_new, cfg.max_response_tokens - parent.end),
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            n=n,
            stop_token_ids=list(self.stop_ids),
            seed=request_seed(self.seed, self.index, parent.id, fork),
            return_entropy=entropy,
        )
        return GenerateRequest(tree.prompt_ids + _response_upto(tree, parent), sampling, f"tree-{self.index}")

    async def _entropy_rounds(self, tree: RolloutTree) -> None:
        """EPTree: ``entropy_init`` whole paths, then copies forked where
        :func:`~arbor.rollout.entropy_fork.entropy_forks` says, until ``width`` leaves."""
        cfg, width = self.cfg, self.cfg.width
        scores: Scores = {}
        may_fork = None if self.episodes is None else self.episodes.may_fork
        await self._whole_paths(tree, [(tree.root, min(cfg.entropy_init, width))], scores)
        while (leaves := len(tree.leaves())) < width:
            forks = entropy_forks(tree, scores, per_group=cfg.entropy_forks, remaining=width - leaves,
                                  branch=cfg.branch, may_fork=may_fork)
            if forks:
                # Points at the first tokens of sibling answers share a parent: one request, one set of instances.
                copies_at: dict[Node, int] = {}
                for point, copies in forks:
                    parent = split_for_fork(tree, point, scores)
                    copies_at[parent] = copies_at.get(parent, 0) + copies
                starts = list(copies_at.items())
                self.stats.forks += len(forks)
            elif cfg.fallback:
                # No token left to fork at: fresh paths from the prompt, as TreePO restarts the root.
                self.stats.root_restarts += 1
                starts = [(tree.root, min(cfg.branch, width - leaves))]
            else:
                self.stats.shortfall_reason = "no token left to fork at and rollout.fallback is disabled"
                return
            sent = self.stats.requests
            await self._whole_paths(tree, starts, scores)
            if self.stats.requests == sent and not forks:  # not even a fresh start got an environment
                return

    async def _whole_paths(self, tree: RolloutTree, starts: list[tuple[Node, int]], scores: Scores) -> None:
        """``copies`` continuations of each ``(parent, copies)`` to the end of the answer (with an
        environment: of the episode, one model turn per request), each model token scored for
        forking (``rollout.fork_entropy``); children in request order."""
        want = self.cfg.fork_entropy == "distribution"
        while starts:
            if self.episodes is not None:
                counts = await self._prepare(tree, [p for p, _ in starts], [n for _, n in starts])
                starts = [(p, n) for (p, _), n in zip(starts, counts) if n]
            requests = [self._request(tree, parent, n, self.cfg.max_response_tokens, want) for parent, n in starts]
            results = await self._generate(tree, requests)
            self.stats.rounds += 1
            self.stats.requests += len(requests)
            over: list[Node] = []
            turns: list[_Path] = []
            for (parent, n), outputs in zip(starts, results):
                if len(outputs) != n:
                    raise RuntimeError(f"engine returned {len(outputs)} outputs for a request of n={n}")
                nodes = [self._add(tree, parent, out) for out in outputs]
                for node, out in zip(nodes, outputs):
                    if node.finish_reason in (None, "length"):
                        # Cut short of the budget without a stop token (the engine's context limit).
                        node.finish_reason = "max_length"
                    scores[node.id] = token_scores(out, self.cfg.fork_entropy)
                    finished = self.episodes is not None and node.finish_reason == FINISHED
                    (turns.append(_Path(node, 0.0)) if finished else over.append(node))
                if self.episodes is not None:
                    self.episodes.hand_over(parent, nodes)
            starts = [(p.node, 1) for p in await self._settle(tree, over, turns)]

    async def _generate(self, tree: RolloutTree, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
        """A round's outputs; with partial rollouts, none sampled by weights overtaken in flight."""
        if self.is_stale is None:
            return await self.batcher.generate(requests)
        results, resampled = await self.batcher.generate_fresh(requests, self.is_stale, tree.problem_id)
        self.stats.resampled += resampled
        return results

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
        elif cfg.mode == "tree" and cfg.fork_at == "segment" and node.depth >= cfg.max_depth:
            reason = "max_depth"
        elif not out.output_ids:
            # An empty non-stop segment would loop forever; the engine hit its context limit.
            reason = "max_length"
        else:
            reason = out.finish_reason  # "length": the path continues
        node.finish_reason = reason
        return node

    def _fallback(self, tree: RolloutTree, wanted: int) -> tuple[list[_Path], list[int]] | None:
        """The next round's paths and copies when no path is active and ``wanted`` leaves
        are missing: cuts of finished trajectories, else the root; None (records why)."""
        cfg = self.cfg
        if not cfg.fallback:
            self.stats.shortfall_reason = "no active path left and fallback is disabled"
            return None
        finished = [leaf for leaf in tree.leaves() if leaf.finish_reason == FINISHED]
        answered = [leaf for leaf in finished if leaf.id in self.answered]
        others = [leaf for leaf in finished if leaf.id not in self.answered]
        # Random order, as the reference shuffles its sources (spmd:1009-1014); answered ones
        # first, so they are the ones cut when the budget is smaller than branch · sources.
        self.rng.shuffle(answered)
        self.rng.shuffle(others)
        sources = answered + others
        if not sources:
            # Every path failed (repetition, length, ...): restart from the root so the tree
            # still reaches width (spmd:1033-1041), instead of a tree with no signal.
            self.stats.root_restarts += 1
            return [_Path(tree.root, 0.0)], [min(cfg.branch, wanted)]
        plan = fallback_copies(sources=len(sources), remaining=wanted, branch=cfg.branch)
        cuts: dict[Node, int] = {}  # cut node → copies; sources cut at one node share a request
        for leaf, copies in zip(sources, plan):
            # Boundaries: the root and every internal node above the leaf (token aligned) where
            # a branch may start (an environment with fork: none: only before its first step),
            cuts_at = [tree.root] + tree.path(leaf)[:-1]
            if self.episodes is not None:  # ... never between a finished model turn and its environment's answer
                cuts_at = [tree.root] + [n for n in cuts_at[1:] if self.episodes.may_fork(n) and n.finish_reason != FINISHED]
            cut = self.rng.choice(cuts_at)
            cuts[cut] = cuts.get(cut, 0) + copies
        self.stats.fallbacks += len(plan)
        return [self._path_at(tree, cut) for cut in cuts], list(cuts.values())

    def _path_at(self, tree: RolloutTree, node: Node) -> _Path:
        """A path ending at ``node`` with its scores: the logprob sum, and the mean of its
        last sampled segment (tool turns are not sampled: the model turn before counts)."""
        path = tree.path(node) if node.parent is not None else []
        sampled = [n for n in path if self.episodes is None or not self.episodes.is_turn(n)]
        last = segment_score(sampled[-1].logprobs or []) if sampled else 0.0
        return _Path(node, sum(sum(n.logprobs or []) for n in path), last)

    def done(self, tree: RolloutTree) -> SampleStats:
        """The tree's leaf count, finish reasons and shortfall, once it is complete."""
        leaves = tree.leaves()
        self.stats.count_leaves(leaves)
        s = self.stats
        if len(leaves) < self.cfg.width and s.shortfall_reason is None and (s.env_dropped or s.env_errors
                                                                             or s.failures):
            s.shortfall_reason = (f"environment failures stopped branches ({s.env_dropped} dropped, {s.env_errors} "
                                  f"errors, {s.env_timeouts} timeouts, {len(s.failures)} failures: env/errors, "
                                  "env/timeouts, failures/*)")
        if len(leaves) < self.cfg.width and self.stats.shortfall_reason is None:
            self.stats.shortfall_reason = f"the engine ended every path early ({self.stats.finish_summary()})"
        return self.stats


def _response_upto(tree: RolloutTree, node: Node) -> list[int]:
    return tree.response_ids(node) if node.parent is not None else []


