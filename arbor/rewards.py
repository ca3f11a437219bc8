"""Reward functions and the process pool that runs them with hard timeouts.

A reward function is plain Python, ``fn(problem: dict, completion: str) -> float``, named
``module:attr`` (or ``path/file.py:attr``) in the config; several combine with weights:

    result = score_batch("rewards/math.py:boxed_accuracy", [(problem, completion)], timeout_s=5, workers=2)
    result.scores, result.timeouts

    with RewardPool([RewardTerm("rewards/math.py:boxed_accuracy", 1.0)], workers=2, timeout_s=5) as pool:
        for step in ...:
            result = pool.score(items)          # workers stay alive across steps

Why processes: math-verify bounds its work with SIGALRM, which only works in a main
thread, and some checks (a 10⁸-digit factorial inside sympy) run in C where no signal
gets through. Each check runs in a worker's main thread; the parent kills a worker whose
check runs past ``timeout_s``, scores that check 0, counts it, and starts a replacement.
A reward function that raises stops the batch with :class:`RewardError` naming the
problem id; the scores computed so far travel with the error.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol, runtime_checkable

from arbor.errors import ConfigError
from arbor.plugins import default_search_dirs, load_object

Item = tuple[dict, str]  # (problem row, completion text)
_SHOW = 200  # characters of a completion or message shown in errors and logs


@runtime_checkable
class RewardFn(Protocol):
    def __call__(self, problem: dict, completion: str) -> float: ...


@dataclass(frozen=True)
class RewardTerm:
    fn: str  # module:attr or path/to/file.py:attr
    weight: float = 1.0


@dataclass
class ScoreResult:
    scores: list[float]  # Σ weight · fn(problem, completion), in input order; 0 on timeout
    timeouts: int  # checks killed after timeout_s
    term_scores: dict[str, list[float]] = field(default_factory=dict)  # fn spec -> raw scores
    timed_out: list[int] = field(default_factory=list)  # indices of the killed checks
    seconds: float = 0.0


class RewardError(RuntimeError):
    """A reward function raised or returned a non-number. ``partial`` holds what was scored."""

    def __init__(self, message: str, problem_id: Any, partial: dict[int, float]) -> None:
        super().__init__(message)
        self.problem_id = problem_id
        self.partial_scores = partial  # item index -> combined score, for items already done


def clip_text(text: str, limit: int = _SHOW) -> str:
    """A short, loggable view of a possibly megabyte-long string."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[: limit // 2]!r}…[{len(text) - limit} chars]…{text[-limit // 2 :]!r}"


def as_terms(spec: str | RewardTerm | Sequence[RewardTerm | str]) -> list[RewardTerm]:
    if isinstance(spec, (str, RewardTerm)):
        spec = [spec]
    return [RewardTerm(s) if isinstance(s, str) else s for s in spec]


def load_reward_terms(
    terms: Sequence[RewardTerm],
    key_prefix: str = "reward.functions",
    search_dirs: Sequence[str] = (),
) -> list[Callable[[dict, str], float]]:
    """Resolve every spec once and check it is a callable; errors name the config key."""
    if not terms:
        raise ConfigError(f"{key_prefix}: at least one reward function is needed")
    fns = []
    for i, term in enumerate(terms):
        key = f"{key_prefix}[{i}].fn"
        fn = load_object(term.fn, key, search_dirs)
        if not isinstance(fn, RewardFn):
            raise ConfigError(f"{key}: {term.fn!r} is not callable (got {type(fn).__name__})")
        if not isinstance(term.weight, (int, float)) or not math.isfinite(term.weight):
            raise ConfigError(f"{key_prefix}[{i}].weight: must be a finite number")
        fns.append(fn)
    return fns


# -- the worker process ------------------------------------------------------------------


def _worker_main(conn: Connection, terms: list[RewardTerm], search_dirs: list[str]) -> None:
    """Load the reward functions, say ready, then score items until told to stop."""
    try:
        fns = load_reward_terms(terms, search_dirs=search_dirs)
    except ConfigError as e:
        conn.send(("load_error", str(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        index, problem, completion = message
        values = []
        for term, fn in zip(terms, fns):
            try:
                value = fn(problem, completion)
            except Exception as e:  # reported to the parent, which stops the batch
                tb = traceback.format_exc(limit=4)
                conn.send(("error", index, f"{term.fn} raised {type(e).__name__}: {str(e)[:_SHOW]}\n{tb[-1500:]}"))
                break
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                conn.send(("error", index, f"{term.fn} returned {clip_text(repr(value))}, not a finite number"))
                break
            values.append(float(value))
        else:
            conn.send(("ok", index, values))


@dataclass
class _Worker:
    process: Any  # multiprocessing.Process (spawn context)
    conn: Connection
    ready: bool = False
    task: int | None = None  # index of the item being scored
    started: float = 0.0  # when that item was sent


class RewardPool:
    """Worker processes that score (problem, completion) pairs with a hard timeout each."""

    def __init__(
        self,
        terms: str | Sequence[RewardTerm | str],
        workers: int = 2,
        timeout_s: float = 5.0,
        search_dirs: Sequence[str] = (),
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be ≥ 1, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.terms = as_terms(terms)
        self.search_dirs = list(search_dirs) or default_search_dirs()
        load_reward_terms(self.terms, search_dirs=self.search_dirs)  # fail fast, in the parent
        self.timeout_s = timeout_s
        # spawn: never fork a parent that holds torch threads, Ray or CUDA state.
        self._ctx = mp.get_context("spawn")
        self._workers = [self._start_worker() for _ in range(workers)]

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main, args=(child, self.terms, self.search_dirs), daemon=True
        )
        process.start()
        child.close()
        return _Worker(process, parent)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()
        new = self._start_worker()
        self._workers[self._workers.index(worker)] = new
        return new

    def score(self, items: Sequence[Item], on_progress: Callable[[int, int], None] | None = None) -> ScoreResult:
        """Score ``items`` in order; checks past ``timeout_s`` score 0 and are counted."""
        t0 = time.monotonic()
        values: dict[int, list[float]] = {}
        timed_out: list[int] = []
        pending = list(range(len(items)))
        pending.reverse()  # pop() from the end hands out items in order
        while len(values) + len(timed_out) < len(items):
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    w.task = pending.pop()
                    problem, completion = items[w.task]
                    w.conn.send((w.task, problem, completion))
                    w.started = time.monotonic()
            busy = [w for w in self._workers if w.task is not None]
            now = time.monotonic()
            deadline = min((w.started + self.timeout_s for w in busy), default=now + 1.0)
            ready_conns = wait([w.conn for w in self._workers], timeout=max(0.0, deadline - now))
            for w in list(self._workers):
                if w.conn in ready_conns:
                    self._receive(w, items, values, timed_out)
                elif w.task is not None and time.monotonic() - w.started > self.timeout_s:
                    timed_out.append(w.task)
                    self._replace(w)
            if on_progress is not None:
                on_progress(len(values) + len(timed_out), len(items))
        return self._result(values, timed_out, len(items), time.monotonic() - t0)

    def _receive(self, w: _Worker, items: Sequence[Item], values: dict, timed_out: list) -> _Worker:
        try:
            kind, *payload = w.conn.recv()
        except (EOFError, OSError):
            # The worker died (out of memory, os._exit in user code): count it like a timeout
            # if it was busy, and start a fresh one.
            if w.task is not None:
                timed_out.append(w.task)
            return self._replace(w)
        if kind == "ready":
            w.ready = True
        elif kind == "ok":
            index, term_values = payload
            values[index] = term_values
            w.task = None
        elif kind == "load_error":
            raise ConfigError(payload[0])
        else:  # "error": stop the batch, name the problem, keep what was scored
            index, message = payload
            problem_id = items[index][0].get("id", f"<item {index}>")
            partial = {i: self._combine(v) for i, v in values.items()}
            # Other busy workers hold checks we no longer want: restart them.
            for other in [x for x in self._workers if x.task is not None and x is not w]:
                self._replace(other)
            w.task = None
            raise RewardError(
                f"reward function failed on problem id {problem_id!r} "
                f"(completion {clip_text(items[index][1], 80)}): {message}",
                problem_id,
                partial,
            )
        return w

    def _combine(self, term_values: list[float]) -> float:
        return sum(t.weight * v for t, v in zip(self.terms, term_values))

    def _result(self, values: dict[int, list[float]], timed_out: list[int], n: int, seconds: float) -> ScoreResult:
        zero = [0.0] * len(self.terms)
        rows = [values.get(i, zero) for i in range(n)]
        term_scores: dict[str, list[float]] = {}
        for k, term in enumerate(self.terms):
            term_scores.setdefault(term.fn, [0.0] * n)
            for i, row in enumerate(rows):
                term_scores[term.fn][i] += row[k]
        return ScoreResult(
            scores=[self._combine(row) for row in rows],
            timeouts=len(timed_out),
            term_scores=term_scores,
            timed_out=sorted(timed_out),
            seconds=seconds,
        )

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for w in self._workers:
            w.process.join(timeout=2)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=2)
            w.conn.close()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def score_batch(
    spec: str | Sequence[RewardTerm | str],
    items: list[tuple[dict, str]],
    timeout_s: float,
    workers: int,
    search_dirs: Sequence[str] = (),
) -> ScoreResult:
    """Score ``items`` once with a fresh pool (the trainer keeps a :class:`RewardPool`)."""
    with RewardPool(spec, workers=workers, timeout_s=timeout_s, search_dirs=search_dirs) as pool:
        return pool.score(items)
