"""Reward functions and the process pool that runs them with hard timeouts.

A reward function is plain Python, ``fn(problem: dict, completion: str) -> float``, named
``module:attr`` (or ``path/file.py:attr``) in the config; several combine with weights
into ``Σ weight · fn(problem, completion)``:

    result = score_batch("rewards/math.py:boxed_accuracy", [(problem, completion)],
                         timeout_s=5, workers=2)
    result.scores, result.timeouts

    terms = [RewardTerm("rewards/math.py:boxed_accuracy"),
             RewardTerm("rewards/math.py:boxed_format", 0.1)]
    with RewardPool(terms, workers=2, timeout_s=5) as pool:   # reward_pool(cfg.reward): a run's
        result = pool.score(items)                             # items: [(problem, completion)]
        result.term_scores["rewards/math.py:boxed_format"]     # raw per-term scores, to log

Why processes: math-verify bounds its work with SIGALRM, which only works in a main
thread, and some work (a huge integer power in C) cannot be interrupted by a signal at
all. Each item's check (all terms on one completion) runs in a worker's main thread; the
parent kills (SIGKILL) a worker whose check runs past ``timeout_s``, scores that item 0,
counts it in ``result.timeouts`` and starts a replacement. Workers are *spawned*, never
forked: the parent may hold torch threads, Ray or CUDA state and gigabytes of memory.
A worker resolves the specs itself, once, before it says it is ready; start-up is never
charged to a check's timeout.

A reward function that raises, or returns something other than a finite number, stops
the batch with :class:`RewardError` naming the problem id; the combined scores computed
so far travel with it as ``err.partial_scores`` ({item index: score}). A run scores with
``record_errors=True`` instead: the failure is kept in ``result.errors`` and the other items
are scored, and the run drops that branch (one failure policy, :mod:`arbor.errors`).
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from arbor.errors import ConfigError
from arbor.errors import (
    RewardFailureError as RewardFailureError,  # its home before arbor.errors: importable here still
)
from arbor.plugins import default_search_dirs, load_object

if TYPE_CHECKING:
    from arbor.config import RewardConfig

Item = tuple[dict, str]  # (problem row, completion text)
_SHOW = 200  # characters of a completion or message shown in errors
_LOG_LINE = 500  # characters of one log record from a worker
_STARTUP_DEATHS = 3  # workers in a row that die before they are ready: the module kills them, stop


@runtime_checkable
class RewardFn(Protocol):
    def __call__(self, problem: dict, completion: str) -> float: ...


@dataclass(frozen=True)
class RewardTerm:
    fn: str  # module:attr or path/to/file.py:attr
    weight: float = 1.0


@dataclass
class ScoreResult:
    scores: list[float]  # Σ weight · fn(problem, completion), in input order; 0 if killed
    timeouts: int  # items whose check ran past timeout_s and was killed
    term_scores: dict[str, list[float]] = field(default_factory=dict)  # spec -> raw scores
    timed_out: list[int] = field(default_factory=list)  # indices of the killed checks
    crashed: list[int] = field(default_factory=list)  # indices whose worker died mid-check
    check_seconds: list[float] = field(default_factory=list)  # per item, in the worker
    seconds: float = 0.0  # wall time of the whole batch
    # score(record_errors=True): index -> what the failing reward function said (scored 0 here;
    # the run drops those branches, arbor.errors).
    errors: dict[int, str] = field(default_factory=dict)
    served_failures: int = 0  # served terms' calls or items that failed, scored their failure_value


class RewardError(RuntimeError):
    """A reward function raised or returned a non-number on one problem.

    ``problem_id`` names it; ``partial_scores`` maps item index -> combined score for the
    items scored before the batch stopped (killed checks are absent, not 0).
    """

    def __init__(self, message: str, problem_id: Any, partial_scores: dict[int, float]) -> None:
        super().__init__(message)
        self.problem_id = problem_id
        self.partial_scores = partial_scores


def clip_text(text: str, limit: int = _SHOW) -> str:
    """A short, loggable repr of a possibly megabyte-long string: head…[n chars]…tail."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[: limit // 2]!r}…[{len(text) - limit} chars]…{text[-limit // 2 :]!r}"


def _is_finite_number(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def as_terms(spec: str | RewardTerm | Sequence[RewardTerm | str]) -> list[RewardTerm]:
    """A spec string, one term or a list of either -> a list of terms (strings weigh 1)."""
    if isinstance(spec, (str, RewardTerm)):
        spec = [spec]
    return [RewardTerm(s) if isinstance(s, str) else s for s in spec]


def load_reward_terms(
    terms: Sequence[RewardTerm],
    key_prefix: str = "reward.functions",
    search_dirs: Sequence[str] = (),
) -> list[RewardFn]:
    """Resolve every spec once and check it; a :class:`ConfigError` names the key.

    ``reward.functions[1].fn: module 'rewards.math' has no attribute 'boxd'``
    """
    if not terms:
        raise ConfigError(f"{key_prefix}: at least one reward function is needed")
    fns: list[RewardFn] = []
    seen: dict[str, int] = {}
    for i, term in enumerate(terms):
        weight = term.weight
        if not _is_finite_number(weight):
            raise ConfigError(f"{key_prefix}[{i}].weight: must be a finite number, got {weight!r}")
        key = f"{key_prefix}[{i}].fn"
        if term.fn in seen:
            # Per-term scores are reported by spec: a repeat would be ambiguous.
            raise ConfigError(
                f"{key}: {term.fn!r} already is {key_prefix}[{seen[term.fn]}]; add the weights"
            )
        seen[term.fn] = i
        fn = load_object(term.fn, key, search_dirs)
        if not isinstance(fn, RewardFn):
            raise ConfigError(f"{key}: {term.fn!r} is not callable (got {type(fn).__name__})")
        fns.append(fn)
    return fns


# -- the worker process ------------------------------------------------------------------

_IN_WORKER = False


def in_reward_worker() -> bool:
    """True inside a pool worker: reward modules may warm caches at import (before the
    worker says ready) without slowing the parent, which imports them only to check."""
    return _IN_WORKER


class _ClippedFormatter(logging.Formatter):
    """Checkers log their whole input on a timeout (megabyte lines): keep the head."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        return line if len(line) <= _LOG_LINE else f"{line[:_LOG_LINE]}… [{len(line)} chars]"


def _worker_main(conn: Connection, terms: list[RewardTerm], search_dirs: list[str]) -> None:
    """Load the reward functions, say ready, then score items until told to stop.

    Messages in: ``(index, problem, completion)`` or None (stop). Out: ``("ready",)``,
    ``("load_error", message)``, ``("ok", index, [value per term], seconds)``,
    ``("error", index, message)``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ClippedFormatter("[reward worker] %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    global _IN_WORKER
    _IN_WORKER = True
    try:
        fns = load_reward_terms(terms, search_dirs=search_dirs)
    except ConfigError as e:
        conn.send(("load_error", str(e)))
        return
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent went away
            return
        if message is None:
            return
        index, problem, completion = message
        conn.send(_check(index, problem, completion, terms, fns))


def _check(index: int, problem: dict, completion: str, terms: list[RewardTerm], fns: list) -> tuple:
    t0 = time.perf_counter()
    values = []
    for term, fn in zip(terms, fns):
        try:
            value = fn(problem, completion)
        except Exception as e:  # reported to the parent, which stops the batch
            # The innermost frames say where; the message is clipped (it may quote the input).
            frames = traceback.format_list(traceback.extract_tb(e.__traceback__)[-3:])
            return ("error", index, f"{term.fn} raised {type(e).__name__}: "
                    f"{clip_text(str(e))}\n{''.join(frames)[-1500:]}")
        if not _is_finite_number(value):
            shown = clip_text(repr(value))
            return ("error", index, f"{term.fn} returned {shown}, not a finite number")
        values.append(float(value))
    return ("ok", index, values, time.perf_counter() - t0)


# -- the pool ------------------------------------------------------------------------------


@dataclass
class _Worker:
    process: Any  # multiprocessing.Process from the spawn context
    conn: Connection
    spawned: float  # time.monotonic() at start, to bound start-up
    ready: bool = False
    task: int | None = None  # index of the item being scored
    sent: float = 0.0  # time.monotonic() when that item was handed over


class RewardPool:
    """Persistent worker processes that score (problem, completion) pairs, each check
    bounded by ``timeout_s``. Use as a context manager, or call :meth:`close`."""

    def __init__(
        self,
        terms: str | RewardTerm | Sequence[RewardTerm | str],
        workers: int = 2,
        timeout_s: float = 5.0,
        search_dirs: Sequence[str] = (),
        start_timeout_s: float = 120.0,
        served: Sequence[tuple[int, Any]] = (),
    ) -> None:
        self.served = list(served)  # (place in reward.functions, a judge/classifier/http term): served_rewards
        if workers < 1:
            raise ValueError(f"workers must be ≥ 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.terms = as_terms(terms)
        self.search_dirs = list(search_dirs) or default_search_dirs()
        if self.terms:  # none: an environment gives the reward, every item scores 0 here
            load_reward_terms(self.terms, search_dirs=self.search_dirs)  # fail fast, in the parent
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("spawn")
        self._startup_deaths = 0  # workers that died while starting since one was last ready
        self._workers = [self._start_worker() for _ in range(workers if self.terms else 0)]
        # One batch at a time: asynchronous runs score rollouts in a producer thread while
        # the trainer's thread scores evals (algorithm.max_staleness ≥ 1).
        self._busy = threading.Lock()

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main, args=(child, self.terms, self.search_dirs),
            name="arbor-reward-worker", daemon=True,
        )
        process.start()
        child.close()
        return _Worker(process, parent, spawned=time.monotonic())

    def _replace(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()
        self._workers[self._workers.index(worker)] = self._start_worker()

    @property
    def scoring(self) -> bool:
        """Whether a batch is being scored now (a fault soak kills workers then)."""
        return self._busy.locked()

    def score(
        self, items: Sequence[Item], on_progress: Callable[[int, int], None] | None = None,
        record_errors: bool = False,
    ) -> ScoreResult:
        """Score ``items`` (in order in the result); killed checks score 0 and are counted.

        ``on_progress(done, total)`` is called as results come in. A reward function that fails
        on an item raises :class:`RewardError`, or with ``record_errors`` is recorded in
        ``result.errors`` (the item scores 0 there) while the other items are scored: a run
        drops such branches and counts them (one failure policy, :mod:`arbor.errors`).
        """
        with self._busy:
            result = self._score(items, on_progress, record_errors)
            if not self.served:
                return result
            from arbor.rollout.served_rewards import add_served

            return add_served(result, items, self.served)

    def _score(
        self, items: Sequence[Item], on_progress: Callable[[int, int], None] | None, record_errors: bool,
    ) -> ScoreResult:
        if not self.terms:
            return self._result([[] for _ in items], [], [], [0.0] * len(items), 0.0)
        if not self._workers:
            raise RuntimeError("RewardPool is closed")
        for w in list(self._workers):
            if w.task is not None:  # left busy by a batch that was interrupted (Ctrl-C)
                self._replace(w)
        t0 = time.monotonic()
        done: dict[int, tuple[list[float], float]] = {}  # index -> (term values, seconds)
        timed_out: list[int] = []
        crashed: list[int] = []
        killed_after: dict[int, float] = {}  # index -> seconds until its worker was killed or died
        errors: dict[int, str] | None = {} if record_errors else None  # None: the first one raises
        pending = list(reversed(range(len(items))))  # pop() hands items out in order
        while len(done) + len(timed_out) + len(crashed) + len(errors or ()) < len(items):
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    w.task = pending.pop()
                    self._send(w, items)
                    # After the send: pickling a megabyte completion is not the check's time.
                    w.sent = time.monotonic()
            ready_conns = wait([w.conn for w in self._workers], timeout=self._next_deadline())
            for w in list(self._workers):
                if w.conn in ready_conns:
                    self._receive(w, items, done, crashed, killed_after, errors)
                elif w.task is not None and time.monotonic() - w.sent > self.timeout_s:
                    timed_out.append(w.task)
                    killed_after[w.task] = time.monotonic() - w.sent
                    self._replace(w)
                elif not w.ready and time.monotonic() - w.spawned > self.start_timeout_s:
                    raise RuntimeError(
                        f"a reward worker did not start within {self.start_timeout_s} s"
                    )
            if on_progress is not None:
                on_progress(len(done) + len(timed_out) + len(crashed) + len(errors or ()), len(items))
        seconds = [done[i][1] if i in done else killed_after.get(i, 0.0) for i in range(len(items))]
        result = self._result([done[i][0] if i in done else None for i in range(len(items))],
                              sorted(timed_out), sorted(crashed), seconds, time.monotonic() - t0)
        result.errors = dict(sorted((errors or {}).items()))
        return result

    def _send(self, w: _Worker, items: Sequence[Item]) -> None:
        assert w.task is not None
        problem, completion = items[w.task]
        try:
            w.conn.send((w.task, problem, completion))
        except OSError:
            pass  # the worker died: wait() sees its pipe close and counts the item as crashed
        except Exception as e:  # pickling failed, before anything reached the pipe
            w.task = None
            raise TypeError(
                f"cannot send problem id {problem.get('id')!r} to a reward worker: "
                f"{type(e).__name__}: {clip_text(str(e))}"
            ) from e

    def _next_deadline(self) -> float:
        """Seconds until the earliest running check times out (≤ 1 s, to watch start-ups)."""
        now = time.monotonic()
        deadlines = [w.sent + self.timeout_s - now for w in self._workers if w.task is not None]
        return max(0.0, min([1.0, *deadlines]))

    def _receive(
        self, w: _Worker, items: Sequence[Item], done: dict, crashed: list[int], killed_after: dict,
        errors: dict[int, str] | None = None,
    ) -> None:
        try:
            kind, *payload = w.conn.recv()
        except (EOFError, OSError):
            if not w.ready:
                # Killed while importing (the OOM killer, an operator) is worth another worker;
                # a module that kills every worker at import would loop: stop after a few.
                w.process.join(timeout=5)
                self._startup_deaths += 1
                if self._startup_deaths >= _STARTUP_DEATHS:
                    raise RuntimeError(
                        f"a reward worker died during start-up {self._startup_deaths} times in a row "
                        f"(last exit code {w.process.exitcode})"
                    ) from None
                self._replace(w)
                return
            # Died mid-check (killed for memory, os._exit in user code): the item scores 0
            # and is counted, like a timeout; a fresh worker takes over.
            if w.task is not None:
                crashed.append(w.task)
                killed_after[w.task] = time.monotonic() - w.sent
            self._replace(w)
            return
        if kind == "ready":
            w.ready = True
            self._startup_deaths = 0
        elif kind == "load_error":
            raise ConfigError(payload[0])
        elif kind == "ok":
            index, values, seconds = payload
            done[index] = (values, seconds)
            w.task = None
        else:  # "error": recorded, or stop the batch, name the problem, keep what was scored
            index, message = payload
            w.task = None
            if errors is not None:
                errors[index] = message
                return
            self._collect_finished(done)
            problem_id = items[index][0].get("id", f"<item {index}>")
            raise RewardError(
                f"reward function failed on problem id {problem_id!r} "
                f"(completion {clip_text(items[index][1], 80)}): {message}",
                problem_id,
                {i: self._combine(values) for i, (values, _) in sorted(done.items())},
            )

    def _collect_finished(self, done: dict) -> None:
        """Before a batch stops: keep results already sent, restart workers still busy."""
        for w in list(self._workers):
            if w.task is None:
                continue
            try:
                message = w.conn.recv() if w.conn.poll(0) else None
            except (EOFError, OSError):
                message = None
            if message is not None and message[0] in ("ok", "error"):
                if message[0] == "ok":  # a second failure is not reported: the first one is
                    done[message[1]] = (message[2], message[3])
                w.task = None
                continue
            self._replace(w)  # still running a check we no longer want

    def _combine(self, values: list[float]) -> float:
        return sum(term.weight * v for term, v in zip(self.terms, values))

    def _result(
        self, rows: list[list[float] | None], timed_out: list[int], crashed: list[int],
        check_seconds: list[float], seconds: float,
    ) -> ScoreResult:
        zeros = [0.0] * len(self.terms)
        filled = [row if row is not None else zeros for row in rows]
        return ScoreResult(
            scores=[self._combine(row) for row in filled],
            timeouts=len(timed_out),
            term_scores={t.fn: [row[k] for row in filled] for k, t in enumerate(self.terms)},
            timed_out=timed_out,
            crashed=crashed,
            check_seconds=check_seconds,
            seconds=seconds,
        )

    def close(self) -> None:
        """Stop the workers (a busy one is killed after 2 s) and a judge's engine."""
        for _, term in self.served:
            term.close()
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:  # already gone
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


def reward_pool(reward_cfg: RewardConfig, search_dirs: Sequence[str] = ()) -> RewardPool:
    """The pool a run's ``reward:`` section describes (its functions, workers, timeout);
    ``search_dirs``: where relative specs resolve (:func:`~arbor.plugins.default_search_dirs`
    of the config file)."""
    from arbor.rollout.served_rewards import served_terms

    terms = [RewardTerm(t.fn, t.weight) for t in reward_cfg.functions if t.kind == "function"]
    return RewardPool(terms, workers=reward_cfg.workers, timeout_s=reward_cfg.timeout_s, search_dirs=search_dirs,
                      served=served_terms(reward_cfg))


def score_batch(
    spec: str | RewardTerm | Sequence[RewardTerm | str],
    items: list[tuple[dict, str]],
    timeout_s: float,
    workers: int,
    search_dirs: Sequence[str] = (),
) -> ScoreResult:
    """Score ``items`` once with a fresh pool (the trainer keeps a :class:`RewardPool`)."""
    with RewardPool(spec, workers=workers, timeout_s=timeout_s, search_dirs=search_dirs) as pool:
        return pool.score(items)
