"""Agent programs' calls recorded as rollout trees, forked by replay (docs/agent-programs.md).

    calls = ProgramCalls(engine, render, cfg, decode, stop_ids, seed, tool_parser)
    tree = calls.add_tree(index, problem, launch)     # launch(run): start a program run
    run = tree.first_run()                            # the endpoint serves it as run.episode
    ...                                               # the program calls; forks launch new runs
    tree.finish(run, reward) / tree.fail(run, kind)   # each run's end
    tree.close()                                      # the RolloutTree: failed runs dropped

One run of a program is one root-to-leaf path. A call whose prompt ids extend the run's path
appends the new ids (tool results, the template's turn markers) as a node of loss mask 0 and
samples the answer segment by segment (``rollout.segment_tokens``) under it: those ids are
trained, with the engine's log-probs. A call that does not extend the path is served and
recorded, never trained on (``offpath_calls``).

Forks: at every segment boundary of a call (its start included) a run may fork — ``root_fork``
copies at the root, ``branch`` elsewhere, up to ``width`` runs (``rollout.mode: independent``, the
GRPO baseline: ``width`` runs from the root, none forked later). A fork inside call k+1 is a new
run of the program whose calls 1..k are answered from its parent's recording and whose call
k+1, when its prompt ids equal the parent's, goes on from the fork point with the ids sampled
so far. A request that differs from the recording (an unseeded RNG, a clock, outside state)
is divergence: the run is dropped, never trained on, counted with its problem and call.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from arbor.config import RolloutConfig
from arbor.engines.openai_endpoint import ChatRequest, CompletionRequest, EndpointError, Reply
from arbor.engines.types import GenerateOutput, GenerateRequest, RolloutEngine, SamplingParams
from arbor.errors import EpisodeFailure
from arbor.rollout.budget import request_seed, root_copies
from arbor.rollout.program_render import ChatRender, message_key, parse_reply
from arbor.rollout.sample_stats import SampleStats
from arbor.tree import Node, RolloutTree

log = logging.getLogger(__name__)


@dataclass
class CallRecord:
    """One answered call, as a replay answers it again."""

    prompt_ids: list[int]  # the request rendered (what a replayed request must equal)
    end: Node | None  # the last node of its answer; None: an off-path call
    reply: Reply
    output_ids: list[int]
    key: str | None  # message_key of the returned assistant message (chat calls)


@dataclass
class Fork:
    """Where a forked run leaves its parent: inside call ``call`` (0-based), at ``node``."""

    call: int
    node: Node
    prompt_ids: list[int]  # the parent's request of that call
    start: Node  # the node the call's answer starts under
    prefix: list[int]  # the answer's ids from start down to node


@dataclass
class Run:
    """One run of the program: its calls and where it is in the tree."""

    index: int
    episode: str  # the endpoint's path for it
    replay: list[CallRecord]  # calls answered from the parent's recording
    fork: Fork | None  # None: the tree's first run
    tip: Node | None = None  # the path's last node (None until its first call)
    calls: list[CallRecord] = field(default_factory=list)
    own: set[int] = field(default_factory=set)  # id() of the nodes it added
    sampled: dict[str, list[int]] = field(default_factory=dict)  # message_key -> sampled ids
    retokenized: set[int] = field(default_factory=set)  # history positions counted
    open: bool = True  # calls are served
    diverged: str | None = None  # why its replay diverged
    exhausted: bool = False  # a call was refused: the response budget is spent
    in_call: bool = False
    level: int = 0  # segment boundaries passed on its path (its forks' budget, as TreePO's depth)
    last_active: float = 0.0  # time.monotonic() of its last call's start or end
    engine_error: BaseException | None = None  # the engine failed a call: the step stops


class ProgramCalls:
    """The endpoint's :class:`~arbor.engines.openai_endpoint.CallHandler` over a sampling call's trees."""

    def __init__(self, engine: RolloutEngine, render: ChatRender, cfg: RolloutConfig,
                 decode: Callable[[list[int]], str], tokenizer: Any, stop_ids: Sequence[int], seed: int,
                 clock: Callable[[], float]) -> None:
        self.engine, self.render, self.cfg, self.decode = engine, render, cfg, decode
        self.tokenizer, self.stop_ids, self.seed, self.clock = tokenizer, list(stop_ids), seed, clock
        self.runs: dict[str, tuple[ProgramTree, Run]] = {}

    def add_tree(self, index: int, problem: dict, stats: SampleStats, launch: Callable[[Run], None]) -> ProgramTree:
        return ProgramTree(self, index, problem, stats, launch)

    def knows(self, episode: str) -> bool:
        return episode in self.runs

    async def chat(self, episode: str, request: ChatRequest) -> Reply:
        tree, run = self.runs[episode]
        try:
            ids, retokenized = self.render.prompt_ids(request.messages, request.tools, run.sampled)
        except (TypeError, ValueError) as e:
            raise EndpointError(f"cannot render the messages with the model's chat template: {e}") from None
        fresh = [i for i in retokenized if i not in run.retokenized]
        run.retokenized.update(fresh)
        tree.stats.program_retokenized += len(fresh)
        return await tree.call(run, ids, request.max_tokens, request.stop, request.ignored, chat=True)

    async def completion(self, episode: str, request: CompletionRequest) -> Reply:
        tree, run = self.runs[episode]
        prompt = request.prompt
        if isinstance(prompt, str):
            prompt = self._completion_ids(run, prompt)
        return await tree.call(run, list(prompt), request.max_tokens, request.stop, request.ignored, chat=False)

    def _completion_ids(self, run: Run, text: str) -> list[int]:
        """A text prompt's ids: one that extends the run's last call (prompt + answer as text)
        extends its ids with the rest tokenised, so the sampled ids are kept."""
        if run.calls:
            last = run.calls[-1]
            ids = [*last.prompt_ids, *last.output_ids]
            before = self.tokenizer.decode(ids)
            if text.startswith(before):
                return ids + self.tokenizer.encode(text[len(before):], add_special_tokens=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))


class ProgramTree:
    """One problem's runs and the tree they make."""

    def __init__(self, calls: ProgramCalls, index: int, problem: dict, stats: SampleStats,
                 launch: Callable[[Run], None]) -> None:
        self.calls, self.cfg, self.index, self.problem, self.stats = calls, calls.cfg, index, problem, stats
        self.launch = launch
        self.tree: RolloutTree | None = None  # made at the first call (its prompt is the tree's)
        self.runs: list[Run] = []
        self.forked: set[int] = set()  # node ids a fork was decided at (once per node)
        self.sent: dict[int, int] = {}  # node id -> requests sampled from it (their seeds)
        # A fork point's runs sample their next segments in one request (n = the runs), so the
        # engine computes the shared prefix once, as TreePO's sampler does: node id -> the batch.
        self.groups: dict[int, _Group] = {}
        self.dropped: list[Node] = []
        self.key = f"tree-{index}"

    @property
    def problem_id(self) -> Any:
        return self.problem.get("id")

    def new_run(self, replay: list[CallRecord], fork: Fork | None) -> Run:
        # The path names the run; its random tail keeps a stray call of an earlier step's run out.
        run = Run(len(self.runs), f"t{self.index}-r{len(self.runs)}-{secrets.token_hex(4)}", replay, fork)
        run.last_active = self.calls.clock()
        self.runs.append(run)
        self.calls.runs[run.episode] = (self, run)
        return run

    # -- calls --------------------------------------------------------------------------------

    async def call(self, run: Run, prompt_ids: list[int], max_tokens: int | None, stop: list[str],
                   ignored: list[str], chat: bool) -> Reply:
        if not run.open:
            raise EndpointError("this run has ended (timed out, failed or diverged): its calls are no longer served")
        self.stats.program_calls += 1
        self.stats.program_ignored_params += len(ignored)
        run.in_call, run.last_active = True, self.calls.clock()
        try:
            return await self._call(run, prompt_ids, max_tokens, stop, chat)
        except EndpointError:
            raise
        except Exception as e:  # the engine failed: the step stops with it once the run ends
            run.engine_error = e
            raise EndpointError(f"the engine failed this call: {type(e).__name__}: {e}", status=503) from e
        finally:
            run.in_call, run.last_active = False, self.calls.clock()

    async def _call(self, run: Run, prompt_ids: list[int], max_tokens: int | None, stop: list[str],
                    chat: bool) -> Reply:
        k = len(run.calls)
        if k < len(run.replay):  # answered from the parent's recording
            record = run.replay[k]
            if prompt_ids != record.prompt_ids:
                self._diverge(run, k, "its request differs from the recorded one", prompt_ids, record.prompt_ids)
            self.stats.program_replayed_calls += 1
            self._answered(run, record)
            return record.reply
        if run.fork is not None and k == run.fork.call:
            fork = run.fork
            if prompt_ids != fork.prompt_ids:
                self._diverge(run, k, "its request differs from the parent's", prompt_ids, fork.prompt_ids)
            return await self._sample(run, prompt_ids, fork.start, fork.node, fork.prefix, max_tokens, stop, chat)
        if self.tree is None:
            self.tree = RolloutTree(prompt_ids, self.problem)
            run.tip = self.tree.root
            return await self._sample(run, prompt_ids, self.tree.root, self.tree.root, [], max_tokens, stop, chat)
        assert run.tip is not None
        path = [*self.tree.prompt_ids, *self._response(run.tip)]
        if prompt_ids[: len(path)] != path:
            return await self._offpath(run, prompt_ids, max_tokens, stop, chat)
        start = run.tip
        extra = prompt_ids[len(path):]
        if extra:
            if len(extra) >= self.cfg.max_response_tokens - start.end:
                run.exhausted = True
                raise EndpointError(f"the conversation has grown past the episode's response budget "
                                    f"(rollout.segment_tokens × rollout.max_depth = {self.cfg.max_response_tokens} "
                                    "tokens; messages count against it): the run cannot go on")
            start = self._add(run, start, extra, None, None)
        return await self._sample(run, prompt_ids, start, start, [], max_tokens, stop, chat)

    async def _sample(self, run: Run, prompt_ids: list[int], start: Node, tip: Node, prefix: list[int],
                      max_tokens: int | None, stop: list[str], chat: bool) -> Reply:
        """The call's answer under ``start``, segment by segment from ``tip`` (a fork: its fork
        point, ``prefix`` the ids sampled from start down to it); the run may fork at each boundary."""
        assert self.tree is not None
        room = self.cfg.max_response_tokens - start.end
        limit = room if max_tokens is None else min(max_tokens, room)
        if limit - len(prefix) <= 0:
            run.exhausted = True
            raise EndpointError(f"the episode's response budget (rollout.segment_tokens × rollout.max_depth = "
                                f"{self.cfg.max_response_tokens} tokens) is spent: the run cannot go on")
        output, finish = list(prefix), "length"
        while len(output) < limit:
            max_new = min(self.cfg.segment_tokens, limit - len(output))
            self._maybe_fork(run, tip, len(run.calls), prompt_ids, start, output, max_new)
            out = await self._generate(tip, max_new)
            ids, logprobs, finish = _cut_at_stop(out, stop, self.calls.decode, output)
            tip = self._add(run, tip, ids, logprobs, out.weight_version)
            output += ids
            if finish == "stop" or not ids:
                break
        tip.finish_reason = "stop" if finish == "stop" else ("max_length" if tip.end >= self.cfg.max_response_tokens
                                                             else "length")
        return self._record(run, prompt_ids, tip, output, "stop" if finish == "stop" else "length", stop, chat)

    async def _generate(self, parent: Node, max_new: int) -> GenerateOutput:
        """The next segment under ``parent``: at a fork point, this run's share of the one request
        sampled for all the runs starting there (a run asking for another length samples alone)."""
        group = self.groups.get(parent.id)
        if group is not None and group.max_new == max_new and group.taken < group.size:
            mine, group.taken = group.taken, group.taken + 1
            if group.outputs is None:
                group.outputs = asyncio.ensure_future(self._request(parent, max_new, group.size))
            out = (await asyncio.shield(group.outputs))[mine]
        else:
            [out] = await self._request(parent, max_new, 1)
        self.stats.tokens_generated += len(out.output_ids)
        self.stats.prompt_tokens += out.prompt_tokens
        self.stats.cached_tokens += out.cached_tokens
        return out

    async def _request(self, parent: Node, max_new: int, n: int) -> list[GenerateOutput]:
        assert self.tree is not None
        fork = self.sent.get(parent.id, 0)
        self.sent[parent.id] = fork + 1
        cfg = self.cfg
        sampling = SamplingParams(max_new_tokens=max_new, temperature=cfg.temperature, top_p=cfg.top_p,
                                  top_k=cfg.top_k, n=n, stop_token_ids=list(self.calls.stop_ids),
                                  seed=request_seed(self.calls.seed, self.index, parent.id, fork))
        outputs = await self.calls.engine.generate(GenerateRequest(
            [*self.tree.prompt_ids, *self._response(parent)], sampling, self.key))
        self.stats.requests += 1
        return outputs

    async def _offpath(self, run: Run, prompt_ids: list[int], max_tokens: int | None, stop: list[str],
                       chat: bool) -> Reply:
        """A call that does not extend the run's path: served, recorded for replays, never trained."""
        self.stats.program_offpath_calls += 1
        limit = self.cfg.max_response_tokens if max_tokens is None else min(max_tokens, self.cfg.max_response_tokens)
        sampling = SamplingParams(max_new_tokens=limit, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                  top_k=self.cfg.top_k, stop_token_ids=list(self.calls.stop_ids),
                                  seed=request_seed(self.calls.seed, self.index, -2 - len(run.calls), run.index))
        out = (await self.calls.engine.generate(GenerateRequest(prompt_ids, sampling, self.key)))[0]
        self.stats.requests += 1
        ids, _, finish = _cut_at_stop(out, stop, self.calls.decode, [])
        return self._record(run, prompt_ids, None, ids, finish, stop, chat)

    def _record(self, run: Run, prompt_ids: list[int], end: Node | None, output: list[int], finish: str,
                stop: list[str], chat: bool) -> Reply:
        text = self.calls.decode(output)
        if finish == "stop" and stop:  # OpenAI's answers end before a stop string
            text = text[: min([text.index(s) for s in stop if s in text], default=len(text))]
        content, tool_calls = parse_reply(text, output, self.cfg.tool_parser) if chat else (text, [])
        reply = Reply(content, tool_calls, "tool_calls" if tool_calls and finish == "stop" else finish,
                      len(prompt_ids), len(output))
        record = CallRecord(prompt_ids, end, reply, output,
                            message_key(content or None, tool_calls) if chat else None)
        self._answered(run, record)
        return reply

    def _answered(self, run: Run, record: CallRecord) -> None:
        run.calls.append(record)
        if record.end is not None:
            run.tip = record.end
            if record.key is not None:
                run.sampled.setdefault(record.key, record.output_ids)

    # -- forks ----------------------------------------------------------------------------------

    def _maybe_fork(self, run: Run, node: Node, call: int, prompt_ids: list[int], start: Node,
                    output: list[int], max_new: int) -> None:
        """At a segment boundary (``node``) of call ``call``: start the forks the budget allows; the
        run and its forks sample their next ``max_new`` tokens in one request."""
        if node.parent is not None:
            run.level += 1
        if node.id in self.forked:  # a fork's first boundary is its parent's fork point
            return
        self.forked.add(node.id)
        cfg = self.cfg
        rng = random.Random(f"{self.calls.seed}/{self.index}/init")
        if cfg.mode == "independent":  # GRPO's group: every run starts at the root, none forks later
            roots, branch = cfg.width, 1
        else:
            roots, branch = min(cfg.width, root_copies(cfg.root_fork, branch=cfg.branch, rng=rng)), cfg.branch
        # As TreePO's rounds: root_fork copies at the root, branch copies at each later boundary,
        # while the runs started stay within roots · branch^level (and width).
        cap = min(cfg.width, roots * branch ** run.level)
        copies = min(roots if node.parent is None else branch, cap - len(self.runs) + 1) - 1
        if copies > 0:  # the run's next segment and its forks' first ones: one request
            self.groups[node.id] = _Group(copies + 1, max_new)
        for _ in range(max(copies, 0)):
            child = self.new_run(run.calls[:call], Fork(call, node, list(prompt_ids), start, list(output)))
            child.level = run.level
            self.launch(child)

    def _diverge(self, run: Run, call: int, what: str, got: list[int], want: list[int]) -> None:
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        run.diverged = (f"call {call + 1}: {what} (from token {at} of {len(want)}; got "
                        f"{self.calls.decode(got[at:at + 24])!r}, recorded {self.calls.decode(want[at:at + 24])!r})")
        run.open = False
        raise EndpointError(f"replay diverged at {run.diverged}: seed every source of randomness from ctx.seed "
                            "(ARBOR_SEED), and read no clock or outside state into requests")

    # -- the end --------------------------------------------------------------------------------

    def finish(self, run: Run, reward: float | None) -> Node | None:
        """The run returned: its tip is a leaf carrying ``reward`` (as an environment's)."""
        run.open = False
        if run.fork is not None and len(run.calls) <= run.fork.call:
            run.diverged = (f"it ended after {len(run.calls)} calls, but its parent made call {run.fork.call + 1}, "
                            "where the fork is")
            self.fail(run, "diverged")
            return None
        tip = run.tip
        if tip is None or id(tip) not in run.own or not tip.is_leaf:
            self.fail(run, "error", "it made no call that sampled an answer of its own")
            return None
        tip.env_reward = reward
        return tip

    def fail(self, run: Run, kind: str, why: str = "") -> None:
        """The run failed (``error``, ``timeout``, ``diverged``): its branch is dropped, counted."""
        run.open = False
        # One line each in the run's arbor.log; the step's console line sums them up.
        if kind == "diverged":
            self.stats.program_diverged += 1
            log.info("problem %r: run %d of the program diverged from its recording at %s; it is dropped "
                     "(program/diverged)", self.problem_id, run.index, run.diverged)
        else:  # a failure of user code (arbor.errors): counted toward reward.max_failure_fraction
            if kind == "timeout":
                self.stats.program_timeouts += 1
            else:
                self.stats.program_errors += 1
            failure = EpisodeFailure(f"program_{'timeout' if kind == 'timeout' else 'error'}", repr(self.problem_id),
                                     len(run.calls) or None, f"run {run.index}: {why}")
            self.stats.failures.append(failure)
            log.info("%s; the run is dropped", failure.describe())
        if run.tip is not None and id(run.tip) in run.own and run.tip.is_leaf:
            run.tip.finish_reason = f"program_{kind}"
            self.dropped.append(run.tip)
        else:
            self.stats.unstarted += 1  # no branch of its own to drop: counted as an episode all the same

    def close(self) -> RolloutTree | None:
        """The tree once every run ended: failed runs' branches removed (never trained on)."""
        for run in self.runs:
            self.calls.runs.pop(run.episode, None)
        if self.tree is not None and self.dropped:
            self.tree.drop_leaves([leaf for leaf in self.dropped if leaf.is_leaf])
            self.stats.env_dropped += len(self.dropped)
        return self.tree

    # -- the tree -------------------------------------------------------------------------------

    def _add(self, run: Run, parent: Node, ids: list[int], logprobs: list[float] | None,
             weight_version: str | None) -> Node:
        assert self.tree is not None
        if logprobs is None:  # context: not sampled, never trained (logprob 0 keeps paths uniform)
            node = self.tree.add_segment(parent, ids, [0.0] * len(ids), [0] * len(ids))
        else:
            node = self.tree.add_segment(parent, ids, logprobs)
            node.weight_version = weight_version
        run.own.add(id(node))
        return node

    def _response(self, node: Node) -> list[int]:
        assert self.tree is not None
        return self.tree.response_ids(node) if node.parent is not None else []


@dataclass
class _Group:
    """One request's outputs shared by the runs sampling from a fork point, in arrival order."""

    size: int  # the runs starting there: the request's n
    max_new: int  # the segment length they ask for (a run asking for another samples alone)
    taken: int = 0
    outputs: asyncio.Future | None = None


def _cut_at_stop(out: GenerateOutput, stop: list[str], decode: Callable[[list[int]], str],
                 before: list[int]) -> tuple[list[int], list[float], str]:
    """The segment up to the first token that completes a ``stop`` string (the request's
    ``stop``), finish "stop"; else as sampled. The ids are cut, not the text alone, so what
    the program reads is what the tree trains on."""
    ids, logprobs = list(out.output_ids), list(out.logprobs)
    finish = "stop" if out.finish_reason == "stop" else "length"
    if not stop or not any(s in decode([*before, *ids]) for s in stop):
        return ids, logprobs, finish
    for n in range(1, len(ids) + 1):
        if any(s in decode([*before, *ids[:n]]) for s in stop):
            return ids[:n], logprobs[:n], "stop"
    return ids, logprobs, finish
