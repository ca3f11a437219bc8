"""How the sampler's rounds reach the engine: one batched call per round of all trees.

    batcher = RoundBatcher(client, across_trees=True)
    outputs = await batcher.generate(requests)   # from each tree's own round loop

Every tree runs its own round loop (:mod:`arbor.rollout.sampler`), and each round is a
list of requests, one per active path. Sent per tree, a step of 32 trees x ~4 rounds is
~130 ``/generate`` calls; the engine decodes them together anyway (continuous batching),
so what the extra calls buy is only HTTP and scheduling overhead. ``across_trees``
coalesces the rounds that trees submit in the same turn of the event loop into one
call: the results of one call wake every tree that shared it in the same turn, each
builds its next round without awaiting anything else and submits it, and the flush,
scheduled by the first of them, runs after all of them (``loop.call_soon`` is FIFO). So
trees that stay in step share every call; a tree that awaits something else (an agent's
tool, a resampled stale segment) simply joins a later call.

Requests keep their own seeds, sampling settings and affinity keys, so each path samples
what it would alone (the embedded engine draws each row from its own seeded generator,
however rows are batched). Calls are split by server first (``engine.server_for``, the
client's rendezvous hash of the tree's affinity key): trees pinned to a fast server never
wait for a slow one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable

from arbor.engines.types import GenerateOutput, GenerateRequest, RolloutEngine
from arbor.errors import RunStopped

# Partial rollouts: rounds of sending overtaken requests again before giving up. Each round
# waits for a whole generation, and only a weight update landing during every one of them
# overtakes it again: more rounds than this means updates outpace generation for good.
MAX_RESAMPLE_ROUNDS = 8


class ResampleLimitError(RunStopped):
    """Segments of a tree were overtaken by weight updates ``MAX_RESAMPLE_ROUNDS`` times in a row."""


_Waiting = tuple[list[GenerateRequest], "asyncio.Future[list[list[GenerateOutput]]]"]


class RoundBatcher:
    """Sends rounds to ``engine``: each as its own call, or coalesced ``across_trees``."""

    def __init__(self, engine: RolloutEngine, *, across_trees: bool = True) -> None:
        self.engine, self.across_trees = engine, across_trees
        self._waiting: list[_Waiting] = []
        self._sending: set[asyncio.Future[None]] = set()  # the loop keeps only weak references

    async def generate(self, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
        """Outputs of ``requests`` in order (``request.sampling.n`` each)."""
        if not self.across_trees:
            return await self._send(requests)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[list[GenerateOutput]]] = loop.create_future()
        if not self._waiting:
            loop.call_soon(self._flush)
        self._waiting.append((requests, future))
        return await future

    async def generate_fresh(
        self, requests: list[GenerateRequest], is_stale: Callable[[str], bool], problem_id: str
    ) -> tuple[list[list[GenerateOutput]], int]:
        """Outputs of ``requests``, none sampled by weights a weight update overtook in flight
        (partial rollouts), and how many outputs were sampled again: every such request is sent
        again (its path goes on from its parent under the new weights) until none is;
        :class:`ResampleLimitError` after ``MAX_RESAMPLE_ROUNDS`` rounds still overtaken."""
        results = await self.generate(requests)
        resampled = 0
        for round_ in range(MAX_RESAMPLE_ROUNDS + 1):
            stale = [i for i, outs in enumerate(results) if any(is_stale(o.weight_version) for o in outs)]
            if not stale:
                return results, resampled
            if round_ == MAX_RESAMPLE_ROUNDS:
                break
            resampled += sum(requests[i].sampling.n for i in stale)
            again = await self.generate([requests[i] for i in stale])
            for i, outs in zip(stale, again):
                results[i] = outs
        versions = sorted({o.weight_version for i in stale for o in results[i]})
        raise ResampleLimitError(
            f"problem {problem_id}: {len(stale)} request(s) still overtaken by a weight update after "
            f"{MAX_RESAMPLE_ROUNDS} resample rounds (last sampled by weight version(s) {versions}): the weights "
            "change faster than a segment is generated (engine.partial_rollouts)"
        )

    def _flush(self) -> None:
        """One call per server for every round submitted since the last flush."""
        waiting, self._waiting = self._waiting, []
        by_server: dict[Hashable, list[_Waiting]] = {}
        for item in waiting:
            by_server.setdefault(self._server(item[0]), []).append(item)
        for group in by_server.values():
            task = asyncio.ensure_future(self._answer(group))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    def _server(self, requests: list[GenerateRequest]) -> Hashable:
        """The server a round goes to (a tree's requests share one affinity key)."""
        server_for = getattr(self.engine, "server_for", None)
        key = requests[0].affinity_key if requests else None
        if server_for is None or key is None:
            return None
        return server_for(key)

    async def _answer(self, group: list[_Waiting]) -> None:
        requests = [r for round_, _ in group for r in round_]
        try:
            results = await self._send(requests)
        except BaseException as exc:  # every tree that shared the call sees the failure
            for _, future in group:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        start = 0
        for round_, future in group:
            if not future.done():  # a tree cancelled while waiting (another tree raised)
                future.set_result(results[start : start + len(round_)])
            start += len(round_)

    async def _send(self, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
        """Through the engine's batch call when it has one (the HTTP client sends it as one
        ``/generate`` per server), else one call per request, concurrently."""
        many = getattr(self.engine, "generate_many", None)
        if many is not None:
            return await many(requests)
        return list(await asyncio.gather(*(self.engine.generate(r) for r in requests)))
