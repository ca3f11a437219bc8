"""Pure helpers of the TreePO sampler: root fork, branching budget, branch assignment,
fallback budget, early stops.

Hand-checkable numbers (docs/algorithms.md, w = 16, b = 2, nothing finishing early):

    root_copies(None, branch=2, rng=random.Random(0))                        # 2
    next_total(active=2, finished=0, newly_finished=0, width=16, branch=2)   # 4
    next_total(active=8, finished=0, newly_finished=0, width=16, branch=2)   # 16
    assign_branches(5, [0.0, 0.0])                                           # [3, 2]
    fallback_copies(sources=3, remaining=5, branch=2)                        # [2, 2, 1]
    cap_copies([3, 2, 1], [False, True, True])                               # [1, 3, 2]

The TreePO reference cited here is github.com/multimodal-art-projection/TreePO at
b86ce51 ("release of treepo v0.1"; its HEAD f055523 only edits the README),
``verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py`` ("spmd:LINE").
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter
from collections.abc import Sequence


def root_copies(root_fork: int | Sequence[int] | None, *, branch: int, rng: random.Random) -> int:
    """Copies of the root sent before the first segment (``rollout.root_fork``).

    ``None``: ``branch`` copies, as paper Algorithm 1 line 2 (``P ← BRANCHING(P)``) and the
    reference (each prompt repeated ``fixed_step_width`` times, spmd:626); an int: that
    many; ``[lo, hi]``: ``rng.randint(lo, hi)`` (the paper's "More Init Divergence", §3
    "Tree Setting": 2 to 8; the reference's ``random_first_div_min/max``, spmd:606-615).
    ``root_copies([2, 8], branch=2, rng=random.Random(0))`` is 8.
    """
    if root_fork is None:
        return branch
    if isinstance(root_fork, int):
        return root_fork
    low, high = root_fork
    return rng.randint(low, high)


def next_total(*, active: int, finished: int, newly_finished: int, width: int, branch: int) -> int:
    """Paths to run next round: ``max(active, min(w − finished, b·active + b·newly_finished))``.

    ``finished`` counts every ended path (a leaf), ``newly_finished`` those that ended in
    the round just run: their budget ``b`` each is transferred to the survivors.
    """
    return max(active, min(width - finished, branch * active + branch * newly_finished))


def fallback_copies(*, sources: int, remaining: int, branch: int) -> list[int]:
    """Copies restarted from each fallback source, in order: ``branch`` each until the
    ``remaining`` budget (``w − ended``) is spent, the last one taking what is left.

    The reference gives every eligible source ``fixed_step_width`` copies in one round,
    decrementing the remaining width budget (spmd:1043-1084); sources past the budget get
    none (they are left out of the result), and a budget larger than ``branch · sources``
    is not spent this round: the next rounds' budget transfer spends it.
    ``fallback_copies(sources=4, remaining=3, branch=2) == [2, 1]``;
    ``fallback_copies(sources=1, remaining=6, branch=2) == [2]``.
    """
    copies = []
    for _ in range(sources):
        if remaining <= 0:
            break
        copies.append(min(branch, remaining))
        remaining -= copies[-1]
    return copies


def cap_copies(counts: Sequence[int], forkable: Sequence[bool]) -> list[int]:
    """Copies per path when some paths may not fork (an environment with ``fork: none`` that has
    stepped): those get 1, and the copies they lose go to the paths that may fork, one each in
    path order, round after round, so the total (the width budget) is kept where any path may fork.
    ``cap_copies([3, 2, 1], [False, True, True]) == [1, 3, 2]``; with none forkable the extra copies
    are lost: ``cap_copies([3, 1], [False, False]) == [1, 1]``.
    """
    capped = [n if ok else min(n, 1) for n, ok in zip(counts, forkable)]
    extra = sum(counts) - sum(capped)
    takers = [i for i, ok in enumerate(forkable) if ok]
    for k in range(extra if takers else 0):
        capped[takers[k % len(takers)]] += 1
    return capped


def segment_score(logprobs: Sequence[float]) -> float:
    """Mean token log-prob of one segment (0.0 for an empty one): the paper's "log
    probabilities of their last segment" (§4.4) as the reference scores it, the mean over
    the last node's tokens (``node_logprob_weighted_div``, spmd:920-926), so segments of
    different lengths compare fairly. ``segment_score([-1.0, -3.0]) == -2.0``."""
    return sum(logprobs) / len(logprobs) if logprobs else 0.0


def largest_remainder(quotas: Sequence[float], total: int) -> list[int]:
    """Integers summing to ``total`` that round ``quotas`` (which sum to ``total``).

    Floors first, then one more to the largest fractional parts; ties go to the lower
    index so the result is deterministic. ``largest_remainder([1.5, 1.5, 1.0], 4) == [2, 1, 1]``.
    """
    floors = [math.floor(q + 1e-9) for q in quotas]
    left = total - sum(floors)
    order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - floors[i]), i))
    for i in order[:left]:
        floors[i] += 1
    return floors


def assign_branches(
    total: int,
    path_logprobs: Sequence[float],
    *,
    mode: str = "even",
    temperature: float = 2.0,
    favor: str = "high",
) -> list[int]:
    """Split ``total`` next-round paths over the active paths, at least 1 each.

    ``path_logprobs`` are the paths' scores (``rollout.branch_logprob``: the last
    segment's mean token log-prob, or the whole path's sum). ``even``
    spreads the ``total − n`` extra copies uniformly; ``logprob`` by
    ``softmax(±logprob / temperature)`` (``+`` for ``favor="high"``), with
    largest-remainder rounding. Example: ``assign_branches(6, [-1.0, -3.0],
    mode="logprob", temperature=2.0)``: weights ``softmax([-0.5, -1.5]) = [0.731, 0.269]``,
    4 extra → quotas ``[2.92, 1.08]`` → extra ``[3, 1]`` → ``[4, 2]``.
    """
    n = len(path_logprobs)
    if n == 0:
        return []
    if total < n:
        raise ValueError(f"total {total} is below the {n} active paths (each needs ≥ 1)")
    extra = total - n
    if mode == "even":
        weights = [1.0 / n] * n
    elif mode == "logprob":
        sign = 1.0 if favor == "high" else -1.0
        if favor not in ("high", "low"):
            raise ValueError(f"branch_favor must be 'high' or 'low', got {favor!r}")
        scores = [sign * lp / temperature for lp in path_logprobs]
        top = max(scores)  # subtract the max so exp never overflows
        exps = [math.exp(s - top) for s in scores]
        weights = [e / sum(exps) for e in exps]
    else:
        raise ValueError(f"branch_assignment must be 'even' or 'logprob', got {mode!r}")
    return [1 + k for k in largest_remainder([w * extra for w in weights], extra)]


def is_repetitive(items: Sequence, window: int, count: int) -> bool:
    """Some ``window``-long run of ``items`` occurs ≥ ``count`` times (overlaps count).

    The TreePO reference applies it to a segment's text with 32 characters and 8
    occurrences; ``items`` is that text (a ``str``) or, without a tokenizer, token ids.
    """
    if len(items) < window + count - 1:
        return False
    seen = Counter(tuple(items[i : i + window]) for i in range(len(items) - window + 1))
    return max(seen.values()) >= count


def request_seed(seed: int, tree_index: int, node_id: int, fork_index: int) -> int:
    """A reproducible per-request seed in ``[0, 2**31 − 64)``.

    ``fork_index`` counts the requests already sent from the same node (a node may be
    forked again by a fallback), so no two requests of a tree share a seed. Engines give
    output j of an ``n``-request the seed ``s + j``; the range leaves room for that.
    """
    key = f"{seed}/{tree_index}/{node_id}/{fork_index}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") % ((1 << 31) - 64)
