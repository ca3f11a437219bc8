"""The reward pool: order, weights, hard timeouts, errors naming the problem and the key.

The reward functions live in tests/reward_fixtures.py and run in spawned workers.
"""

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from arbor.config_load import load_config
from arbor.errors import ConfigError
from arbor.rollout.rewards import (
    RewardError,
    RewardPool,
    RewardTerm,
    clip_text,
    in_reward_worker,
    load_reward_terms,
    reward_pool,
    score_batch,
)

HERE = str(Path(__file__).parent)
FIX = "reward_fixtures.py"


def problem(i, **extra):
    return {"id": f"p{i}", "prompt": "q", "answer": "1", **extra}


def test_scores_in_order_with_weights_and_per_term_scores():
    items = [(problem(i), "x" * i) for i in range(7)]
    terms = [RewardTerm(f"{FIX}:length", 2.0), RewardTerm(f"{FIX}:one", 0.5)]
    result = score_batch(terms, items, timeout_s=10, workers=2, search_dirs=[HERE])
    # item i: 2.0 · len("x"·i) + 0.5 · 1
    assert result.scores == [2.0 * i + 0.5 for i in range(7)]
    assert result.term_scores == {f"{FIX}:length": [float(i) for i in range(7)],
                                  f"{FIX}:one": [1.0] * 7}
    assert result.timeouts == 0 and result.timed_out == [] and result.crashed == []
    assert len(result.check_seconds) == 7 and all(0 <= s < 10 for s in result.check_seconds)


def test_reward_pool_is_built_from_the_reward_section():
    cfg = load_config(None, [f"reward.functions=[{{fn: '{FIX}:length', weight: 2.0}}, {{fn: '{FIX}:one', weight: 0.5}}]",
                             "reward.workers=1", "reward.timeout_s=9"])
    with reward_pool(cfg.reward, [HERE]) as pool:
        assert pool.terms == [RewardTerm(f"{FIX}:length", 2.0), RewardTerm(f"{FIX}:one", 0.5)]
        assert (len(pool._workers), pool.timeout_s) == (1, 9)
        assert pool.score([(problem(0), "xyz")]).scores == [2.0 * 3 + 0.5]


def test_empty_batch():
    result = score_batch(f"{FIX}:one", [], timeout_s=1, workers=1, search_dirs=[HERE])
    assert result.scores == [] and result.timeouts == 0


def test_a_pool_without_function_terms_starts_no_worker_and_scores_zeros():
    # Served terms only (a judge, a classifier, an http server): no worker process; their
    # scores are added to these zeros, and no check took any time.
    with RewardPool([], workers=2) as pool:
        assert pool._workers == []
        result = pool.score([(problem(i), "c") for i in range(3)])
    assert (result.scores, result.term_scores, result.timed_out, result.crashed) == ([0.0] * 3, {}, [], [])
    assert (result.check_seconds, result.seconds, result.timeouts) == ([0.0] * 3, 0.0, 0)


def test_score_batch_gives_each_check_its_time_limit():
    # A 3 s check against score_batch's 0.5 s limit (not the pool's default 5 s): timed out, 0.
    result = score_batch(f"{FIX}:sleepy", [(problem(0, sleep=3), "c")], timeout_s=0.5, workers=1, search_dirs=[HERE])
    assert result.timed_out == [0] and result.scores == [0.0]


def test_timeout_kills_replaces_and_counts():
    # Items 1 and 3 sleep far past the 1 s timeout; the others are instant and still score.
    items = [(problem(i, sleep=60 if i in (1, 3) else 0), "c") for i in range(6)]
    with RewardPool(f"{FIX}:sleepy", workers=2, timeout_s=1.0, search_dirs=[HERE]) as pool:
        first_pids = {w.process.pid for w in pool._workers}
        progress = []
        result = pool.score(items, on_progress=lambda done, total: progress.append((done, total)))
        assert progress[-1] == (6, 6)  # timed-out checks are done too
        assert result.scores == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
        assert result.timeouts == 2 and result.timed_out == [1, 3]
        assert result.check_seconds[1] >= 1.0 and result.check_seconds[3] >= 1.0
        assert result.seconds < 30  # bounded: nobody waited for the 60 s sleeps
        assert first_pids.isdisjoint({w.process.pid for w in pool._workers})  # both replaced
        # The replacements serve the next batch; their start-up is not charged as a timeout.
        again = pool.score([(problem(9), "c")] * 3)
        assert again.scores == [1.0, 1.0, 1.0] and again.timeouts == 0


def test_raise_names_problem_id_and_keeps_partial_scores():
    items = [(problem(0), "ok"), (problem(1), "ok"), (problem(2), "bad"), (problem(3), "ok")]
    with RewardPool(f"{FIX}:raises_on_bad", workers=1, timeout_s=10, search_dirs=[HERE]) as pool:
        with pytest.raises(RewardError) as err:
            pool.score(items)
        assert "problem id 'p2'" in str(err.value)
        assert "reward_fixtures.py:raises_on_bad raised ValueError: 'cannot score this: bad'" in str(err.value)
        assert err.value.problem_id == "p2"
        assert err.value.partial_scores == {0: 1.0, 1: 1.0}
        # The pool stays usable after a failed batch.
        assert pool.score([(problem(5), "ok")]).scores == [1.0]


def test_raise_restarts_busy_workers_and_keeps_what_they_finished():
    # Workers A and B get p0 and p1 (slow), worker C gets p2 (fails at once): p0 and p1 are
    # cut short, not waited for, not even a second each.
    items = [(problem(0, sleep=60), "ok"), (problem(1, sleep=60), "ok"), (problem(2), "bad")]
    with RewardPool(f"{FIX}:raises_on_bad", workers=3, timeout_s=30, search_dirs=[HERE]) as pool:
        while not all(w.ready for w in pool._workers):  # all up: item k goes to worker k
            pool.score([(problem(9), "ok")])
        t0 = time.monotonic()
        with pytest.raises(RewardError) as err:
            pool.score(items)
        assert time.monotonic() - t0 < 1.5
        assert err.value.problem_id == "p2" and err.value.partial_scores == {}
        assert pool.score([(problem(5), "ok")] * 3).scores == [1.0] * 3


def test_error_message_clips_a_megabyte_completion():
    completion = "bad" + "x" * 1_000_000
    with pytest.raises(RewardError) as err:
        score_batch(f"{FIX}:raises_on_bad", [(problem(0), completion)], timeout_s=10, workers=1,
                    search_dirs=[HERE])
    message = str(err.value)
    assert len(message) < 3000
    # The completion is shown as its first and last 40 characters (1_000_003 − 80 cut).
    assert (f"(completion {'bad' + 'x' * 37!r}…[999923 chars]…{'x' * 40!r}): "
            "reward_fixtures.py:raises_on_bad raised ValueError: ") in message


@pytest.mark.parametrize("fn, shown", [("nan", "nan"), ("text", "'1.0'")])
def test_non_number_score_is_an_error(fn, shown):
    with pytest.raises(RewardError, match=f"problem id 'p0'.*returned .*{shown}.*not a finite number"):
        score_batch(f"{FIX}:{fn}", [(problem(0), "c")], timeout_s=10, workers=1, search_dirs=[HERE])


def test_dead_worker_scores_zero_counts_as_crash_and_is_replaced():
    items = [(problem(0), "ok"), (problem(1), "die"), (problem(2), "ok")]
    progress = []
    with RewardPool(f"{FIX}:dies", workers=1, timeout_s=10, search_dirs=[HERE]) as pool:
        result = pool.score(items, on_progress=lambda done, total: progress.append(done))
    assert result.scores == [1.0, 0.0, 1.0] and result.crashed == [1] and result.timeouts == 0
    assert progress[-1] == 3 and progress == sorted(progress)  # the crashed check is done too
    assert 0 <= result.check_seconds[1] < 10  # until it died, not a clock reading


def test_segfaulting_worker_is_a_crash_not_an_error():
    items = [(problem(0), "segv"), (problem(1), "ok")]
    result = score_batch(f"{FIX}:segfaults", items, timeout_s=10, workers=1, search_dirs=[HERE])
    assert result.scores == [0.0, 1.0] and result.crashed == [0] and result.timeouts == 0


def test_worker_killed_from_outside_is_counted_and_named():
    """A worker SIGKILLed by pid mid-check (the OOM killer, an operator): crashed, scored 0."""
    items = [(problem(0, sleep=30), "slow"), (problem(1), "ok")]

    def kill_busy_worker() -> None:
        # Once the worker holds the check (it is handed only to a started worker): a kill
        # timed by the clock could land during start-up on a loaded machine, which is a
        # start-up death, not a crash.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            busy = [w for w in pool._workers if w.task is not None]
            if busy:
                os.kill(busy[0].process.pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_busy_worker)
    with RewardPool(f"{FIX}:sleepy", workers=1, timeout_s=20, search_dirs=[HERE]) as pool:
        killer.start()
        result = pool.score(items)
        killer.join()
        assert pool.score([(problem(2), "again")]).scores == [1.0]  # the replacement works
    assert result.crashed == [0] and result.timeouts == 0 and result.scores == [0.0, 1.0]


def test_recorded_errors_are_kept_and_the_other_items_scored():
    # A run scores with record_errors: the failing item is kept in result.errors (scored 0 here,
    # its branch dropped by the run) and the rest of the batch is scored, not abandoned.
    items = [(problem(0), "bad answer"), (problem(1), "fine"), (problem(2), "bad again")]
    progress = []
    with RewardPool(f"{FIX}:raises_on_bad", workers=1, timeout_s=10, search_dirs=[HERE]) as pool:
        result = pool.score(items, on_progress=lambda done, total: progress.append((done, total)), record_errors=True)
    assert result.scores == [0.0, 1.0, 0.0] and sorted(result.errors) == [0, 2]
    assert progress[-1] == (3, 3) and progress == sorted(progress)  # an error is done too
    assert "raises_on_bad raised ValueError: 'cannot score this: bad answer'" in result.errors[0]
    assert result.check_seconds[0] == result.check_seconds[2] == 0.0 < result.check_seconds[1]  # no score, no time


def test_a_worker_killed_while_starting_is_replaced(monkeypatch):
    """Killed during its imports (found by scripts/soak.py): one death is not a broken module."""
    monkeypatch.setenv("ARBOR_TEST_SLOW_IMPORT", "2")  # the first worker is surely still importing
    with RewardPool(f"{FIX}:one", workers=1, timeout_s=5, search_dirs=[HERE]) as pool:
        (starting,) = [c for c in multiprocessing.active_children() if c.name == "arbor-reward-worker"]
        os.kill(starting.pid, signal.SIGKILL)
        monkeypatch.delenv("ARBOR_TEST_SLOW_IMPORT")  # its replacement starts at once
        assert pool.score([(problem(0), "c")]).scores == [1.0]


def test_worker_dying_at_start_up_is_an_error_not_a_loop(monkeypatch):
    monkeypatch.setenv("ARBOR_TEST_DIE_AT_IMPORT", "1")
    with RewardPool(f"{FIX}:one", workers=1, timeout_s=5, search_dirs=[HERE]) as pool:
        with pytest.raises(RuntimeError, match="died during start-up 3 times in a row.*exit code 7"):
            pool.score([(problem(0), "c")])


@pytest.mark.parametrize(
    "terms, message",
    [
        ([f"{FIX}:one", f"{FIX}:missing"],
         "reward.functions[1].fn: module 'reward_fixtures.py' has no attribute 'missing'"),
        ([f"{FIX}:not_callable"],
         "reward.functions[0].fn: 'reward_fixtures.py:not_callable' is not callable (got int)"),
        (["no_module_here:fn"], "reward.functions[0].fn: cannot import module 'no_module_here'"),
        (["no_colon"], "reward.functions[0].fn: expected 'module:attr'"),
        ([f"{FIX}:one", f"{FIX}:length", f"{FIX}:one"],
         "reward.functions[2].fn: 'reward_fixtures.py:one' already is reward.functions[0]; add the weights"),
        ([RewardTerm(f"{FIX}:one", float("nan"))], "reward.functions[0].weight: must be a finite"),
    ],
)
def test_bad_spec_is_config_error_naming_key(terms, message):
    with pytest.raises(ConfigError) as err:
        RewardPool(terms, workers=1, timeout_s=1, search_dirs=[HERE])
    assert message in str(err.value)


def test_a_pool_without_functions_scores_zeros_without_workers():
    """reward.functions empty (an environment gives the reward): nothing to run, every item 0."""
    with RewardPool([], workers=2, timeout_s=1, search_dirs=[HERE]) as pool:
        result = pool.score([(problem(0), "a"), (problem(1), "b")])
        assert pool._workers == []
    assert result.scores == [0.0, 0.0] and result.term_scores == {} and result.timeouts == 0
    with pytest.raises(ConfigError, match="reward.functions: at least one"):
        load_reward_terms([], search_dirs=[HERE])


def test_load_reward_terms_resolves_in_process_with_key_prefix():
    fns = load_reward_terms([RewardTerm(f"{FIX}:length", 3.0)], search_dirs=[HERE])
    assert fns[0]({}, "abcd") == 4.0
    with pytest.raises(ConfigError, match=r"^eval\.reward\[0\]\.fn: "):
        load_reward_terms([RewardTerm(f"{FIX}:nope")], key_prefix="eval.reward", search_dirs=[HERE])


def test_closed_pool_refuses_work():
    pool = RewardPool(f"{FIX}:one", workers=1, timeout_s=1, search_dirs=[HERE])
    pool.close()
    pool.close()  # a second close is harmless
    with pytest.raises(RuntimeError, match="^RewardPool is closed$"):
        pool.score([(problem(0), "c")])


def test_clip_text_bounds_megabyte_strings():
    shown = clip_text("a" * 1_000_000)
    assert len(shown) < 300 and "999800 chars" in shown
    assert clip_text("short") == "'short'"


def test_unpicklable_problem_names_it_and_leaves_the_pool_usable():
    from multiprocessing.reduction import ForkingPickler

    bad = problem(0, handle=lambda: None)
    with pytest.raises(Exception) as pickling:  # what the pipe's pickler says about it
        ForkingPickler.dumps((0, bad, "c"))
    with RewardPool(f"{FIX}:one", workers=1, timeout_s=5, search_dirs=[HERE]) as pool:
        pool.score([(problem(9), "c")])  # the worker is up
        (worker,) = pool._workers
        with pytest.raises(TypeError) as err:
            pool.score([(bad, "c")])
        assert str(err.value) == (f"cannot send problem id 'p0' to a reward worker: "
                                  f"{pickling.type.__name__}: {clip_text(str(pickling.value))}")
        assert pool.score([(problem(1), "c")]).scores == [1.0]
        # Nothing reached the worker: it stays (no restart, no start-up paid again).
        assert pool._workers[0].process.pid == worker.process.pid


def test_interrupted_batch_does_not_leak_into_the_next():
    # The progress callback raising (as Ctrl-C would) while the only worker is in a 60 s
    # check; the next batch must not wait for that check nor count it.
    with RewardPool(f"{FIX}:sleepy", workers=1, timeout_s=30, search_dirs=[HERE]) as pool:

        def interrupt(done, total):
            if any(w.task is not None for w in pool._workers):
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            pool.score([(problem(0, sleep=60), "c")], on_progress=interrupt)
        result = pool.score([(problem(2), "c")] * 3)
        assert result.scores == [1.0] * 3 and result.timeouts == 0 and result.seconds < 20


def test_in_reward_worker_is_true_only_in_workers():
    result = score_batch(f"{FIX}:in_worker", [(problem(0), "c")], timeout_s=5, workers=1,
                         search_dirs=[HERE])
    assert result.scores == [1.0] and not in_reward_worker()


# -- behaviours pinned by mutation testing (scripts/mutation.py rollout.rewards) ----------------------


def test_a_bool_is_neither_a_score_nor_a_weight():
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].weight: must be a finite number, got True"):
        RewardPool([RewardTerm(f"{FIX}:one", True)], workers=1, timeout_s=1, search_dirs=[HERE])
    with pytest.raises(RewardError, match="problem id 'p0'.*returned 'True', not a finite number"):
        score_batch(f"{FIX}:boolean", [(problem(0), "c")], timeout_s=10, workers=1, search_dirs=[HERE])
    # An int weight and an int score are numbers.
    assert score_batch([RewardTerm(f"{FIX}:length", 2)], [(problem(0), "abc")], timeout_s=10,
                       workers=1, search_dirs=[HERE]).scores == [6.0]


@pytest.mark.parametrize("timeout_s", [0, -1.0])
def test_a_timeout_that_is_not_positive_is_refused(timeout_s):
    with pytest.raises(ValueError, match=f"timeout_s must be > 0, got {timeout_s}"):
        RewardPool(f"{FIX}:one", workers=1, timeout_s=timeout_s, search_dirs=[HERE])
    with pytest.raises(ValueError, match="workers must be ≥ 1, got 0"):
        RewardPool(f"{FIX}:one", workers=0, timeout_s=1, search_dirs=[HERE])


def test_a_check_timeout_counts_from_when_the_check_was_sent():
    # One worker, three 0.8 s checks, 1.5 s each: 2.4 s in all. Counted from the worker's
    # start or from the first check, the later ones would be killed; none is.
    items = [(problem(i, sleep=0.8), "c") for i in range(3)]
    with RewardPool(f"{FIX}:sleepy", workers=1, timeout_s=1.5, search_dirs=[HERE]) as pool:
        result = pool.score(items)
    assert result.scores == [1.0] * 3 and result.timeouts == 0
    assert all(0.8 <= s < 1.5 for s in result.check_seconds) and result.seconds >= 2.4


def test_a_check_is_killed_soon_after_its_timeout_not_at_a_1s_poll():
    # Killed ~0.3 s after sending; a loop that looked only once a second would take ≥ 1 s.
    with RewardPool(f"{FIX}:sleepy", workers=1, timeout_s=0.3, search_dirs=[HERE]) as pool:
        pool.score([(problem(0), "warm")])  # the worker is up: no start-up in the timing
        result = pool.score([(problem(1, sleep=60), "c")])
    assert result.timed_out == [0]
    assert 0.3 <= result.check_seconds[0] < 0.85


def test_results_that_arrive_while_an_error_is_handled_are_kept(tmp_path):
    # Checks wait for a file the test creates only once both workers are busy, and the
    # progress callback holds the loop until both answers are in their pipes: the first
    # worker's error is read first; what the second worker already sent is handled too.
    go = tmp_path / "go"

    def items(*completions):
        return [(problem(i, go=str(go)), c) for i, c in enumerate(completions)]

    with RewardPool(f"{FIX}:waits_for_file", workers=2, timeout_s=30, search_dirs=[HERE]) as pool:
        go.touch()
        while not all(w.ready for w in pool._workers):  # both started: item 0 goes to worker 0
            pool.score(items("ok"))
        go.unlink()

        def hold(done, total):
            if all(w.task is not None for w in pool._workers):
                go.touch()
                assert all(w.conn.poll(20) for w in pool._workers)

        def fail(*completions):
            with pytest.raises(RewardError) as err:
                pool.score(items(*completions), on_progress=hold)
            go.unlink()
            assert err.value.problem_id == "p0"
            return err.value.partial_scores

        # A score already sent is kept.
        assert fail("bad", "ok") == {1: 1.0}
        # A second error is not reported (the first is), and its worker, idle again, stays.
        pids = [w.process.pid for w in pool._workers]
        assert fail("bad", "bad") == {}
        assert [w.process.pid for w in pool._workers] == pids
        # A worker that died meanwhile is replaced.
        assert fail("bad", "die") == {}
        assert pool._workers[1].process.pid != pids[1] and pool._workers[0].process.pid == pids[0]
        go.touch()
        assert pool.score(items("ok", "ok")).scores == [1.0, 1.0]  # no stale answer leaks in


def test_log_lines_are_clipped_past_the_limit_only():
    from arbor.rollout.rewards import _LOG_LINE, _ClippedFormatter

    formatter = _ClippedFormatter("%(message)s")

    def line(n: int) -> str:
        return formatter.format(logging.LogRecord("math_verify", logging.WARNING, "f.py", 1, "x" * n, None, None))

    assert line(_LOG_LINE) == "x" * _LOG_LINE
    assert line(_LOG_LINE + 1) == "x" * _LOG_LINE + f"… [{_LOG_LINE + 1} chars]"
    assert clip_text("a" * 200) == repr("a" * 200)
    assert clip_text("a" * 100 + "b" * 101) == f"{'a' * 100!r}…[1 chars]…{'b' * 100!r}"


def test_a_check_in_process_returns_values_or_an_error_naming_the_term():
    from arbor.rollout.rewards import _check

    terms = [RewardTerm(f"{FIX}:length", 2.0), RewardTerm(f"{FIX}:raises_on_bad")]
    fns = load_reward_terms(terms, search_dirs=[HERE])
    kind, index, values, seconds = _check(3, problem(3), "abcd", terms, fns)
    assert (kind, index, values) == ("ok", 3, [4.0, 1.0]) and 0 <= seconds < 5  # raw, unweighted
    kind, index, message = _check(4, problem(4), "bad!", terms, fns)
    assert (kind, index) == ("error", 4)
    assert message.startswith("reward_fixtures.py:raises_on_bad raised ValueError: 'cannot score this: bad!'\n")
    assert "reward_fixtures.py" in message.split("\n", 1)[1]  # the innermost frames say where
    bool_terms = [RewardTerm(f"{FIX}:boolean")]
    kind, _, message = _check(0, problem(0), "c", bool_terms, load_reward_terms(bool_terms, search_dirs=[HERE]))
    assert kind == "error" and message == "reward_fixtures.py:boolean returned 'True', not a finite number"
    # Five calls deep: the message shows the innermost three frames, each "  File ..." + source.
    deep = [RewardTerm(f"{FIX}:raises_deep")]
    _, _, message = _check(0, problem(0), "c", deep, load_reward_terms(deep, search_dirs=[HERE]))
    head, frames = message.split("\n", 1)
    assert head == "reward_fixtures.py:raises_deep raised KeyError: \"'deep'\""
    files = [line for line in frames.splitlines() if not line.startswith("    ")]
    assert len(files) == 3 and all(line.startswith("  File ") and line.endswith(", in level") for line in files)


def test_the_worker_protocol_in_process(monkeypatch):
    # The worker's loop, run here in the main thread on a pipe filled beforehand:
    # Ctrl-C ignored, warnings logged clipped to stderr, ready, one answer per item, stop on
    # None; a spec that does not load says why.
    from multiprocessing import Pipe

    import arbor.rollout.rewards as rewards

    monkeypatch.setattr(rewards, "_IN_WORKER", False)
    configured = {}
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: configured.update(kw))  # keep ours
    ctrl_c = signal.getsignal(signal.SIGINT)
    parent, child = Pipe()
    parent.send((0, problem(0), "abc"))
    parent.send((1, problem(1, sleep=0), "x"))
    parent.send(None)
    try:
        rewards._worker_main(child, [RewardTerm(f"{FIX}:length"), RewardTerm(f"{FIX}:sleepy")], [HERE])
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, ctrl_c)
    assert rewards.in_reward_worker()
    assert parent.recv() == ("ready",)
    assert [parent.recv()[:3] for _ in range(2)] == [("ok", 0, [3.0, 1.0]), ("ok", 1, [1.0, 1.0])]
    assert not parent.poll(0)
    (handler,) = configured.pop("handlers")
    assert configured == {"level": logging.WARNING} and handler.stream is sys.stderr
    record = logging.LogRecord("math_verify", logging.WARNING, "f.py", 1, "z" * 1000, None, None)
    assert handler.format(record).startswith("[reward worker] WARNING math_verify: zzz")
    assert handler.format(record).endswith("… [1037 chars]")
    parent, child = Pipe()
    rewards._worker_main(child, [RewardTerm(f"{FIX}:missing")], [HERE])
    kind, message = parent.recv()
    assert kind == "load_error" and "reward.functions[0].fn: module 'reward_fixtures.py' has no attribute 'missing'" in message
def test_worker_log_records_are_prefixed_clipped_and_warnings_only(capfd):
    # The worker inherits the parent's stderr; a megabyte log line arrives clipped.
    score_batch(f"{FIX}:logs", [(problem(0), "y" * 100_000)], timeout_s=10, workers=1, search_dirs=[HERE])
    err = capfd.readouterr().err
    (line,) = [x for x in err.splitlines() if "math_verify" in x]
    prefix = "[reward worker] WARNING math_verify: "
    assert line == prefix + "y" * (500 - len(prefix)) + f"… [{len(prefix) + 100_000} chars]"
    assert "not shown" not in err


def test_workers_leave_ctrl_c_to_the_parent():
    with RewardPool(f"{FIX}:one", workers=1, timeout_s=5, search_dirs=[HERE]) as pool:
        progress = []
        pool.score([(problem(0), "c")], on_progress=lambda done, total: progress.append((done, total)))
        assert progress[-1] == (1, 1) and all(total == 1 for _, total in progress)
        (worker,) = pool._workers
        os.kill(worker.process.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
        assert pool.score([(problem(1), "c")]).scores == [1.0]
        assert pool._workers[0].process.pid == worker.process.pid  # the same worker, alive


def test_a_worker_that_does_not_start_in_time_is_an_error(monkeypatch):
    monkeypatch.setenv("ARBOR_TEST_SLOW_IMPORT", "5")
    with RewardPool(f"{FIX}:one", workers=1, timeout_s=5, search_dirs=[HERE], start_timeout_s=0.5) as pool:
        with pytest.raises(RuntimeError, match="a reward worker did not start within 0.5 s"):
            pool.score([(problem(0), "c")])


def test_a_spec_that_loads_in_the_parent_but_not_in_a_worker_is_a_config_error():
    with RewardPool(f"{FIX}:parent_only", workers=1, timeout_s=5, search_dirs=[HERE]) as pool:
        with pytest.raises(ConfigError, match="reward.functions\\[0\\].fn: module 'reward_fixtures.py' has no attribute 'parent_only'"):
            pool.score([(problem(0), "c")])


def test_an_error_on_a_row_without_an_id_names_its_place():
    with pytest.raises(RewardError, match="problem id '<item 0>'") as err:
        score_batch(f"{FIX}:raises_on_bad", [({}, "bad")], timeout_s=10, workers=1, search_dirs=[HERE])
    assert err.value.problem_id == "<item 0>"


def test_an_error_keeps_the_last_1500_characters_of_its_frames(tmp_path):
    from arbor.rollout.rewards import _check

    # The innermost three frames are over 600 characters each (long source lines): 1,500 are kept.
    module = tmp_path / "long_frames.py"
    comment = "  # " + "x" * 600
    module.write_text(
        "def deep(problem, completion):\n"
        "    return level(2)\n\n\n"
        "def level(k):\n"
        "    if k == 0:\n"
        f"        raise KeyError('deep'){comment}\n"
        f"    return level(k - 1){comment}\n"
    )
    terms = [RewardTerm(f"{module}:deep")]
    _, _, message = _check(0, problem(0), "c", terms, load_reward_terms(terms))
    head, frames = message.split("\n", 1)
    assert head == f"{module}:deep raised KeyError: \"'deep'\""
    # The head of the outermost of the three is cut; the innermost, where it raised, is whole.
    assert len(frames) == 1500 and f"raise KeyError('deep'){comment}\n" in frames[-800:]


def test_a_pool_without_sizes_has_two_workers_5_s_checks_and_120_s_to_start():
    with RewardPool(f"{FIX}:one", search_dirs=[HERE]) as pool:
        started = [c for c in multiprocessing.active_children() if c.name == "arbor-reward-worker"]
        assert len(started) == 2 and pool.timeout_s == 5.0 and pool.start_timeout_s == 120.0


def test_score_batch_runs_as_many_workers_as_asked(tmp_path):
    # Three checks that each wait for the other two meet only on three workers at once
    # (on two, the first two give up after 20 s and score 2).
    items = [(problem(i, dir=str(tmp_path), n=3, wait=20), str(i)) for i in range(3)]
    result = score_batch(f"{FIX}:meets", items, timeout_s=30, workers=3, search_dirs=[HERE])
    assert result.scores == [3.0, 3.0, 3.0]


def test_start_up_deaths_count_in_a_row_only(monkeypatch, tmp_path):
    # Two deaths at start-up are not yet a broken module (three in a row are), and a worker
    # that got ready starts the count again.
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.setenv("ARBOR_TEST_DEATHS", "2")
    monkeypatch.setenv("ARBOR_TEST_DEATHS_DIR", str(first))
    with RewardPool(f"{FIX}:dies", workers=1, timeout_s=10, search_dirs=[HERE]) as pool:
        assert pool.score([(problem(0), "ok")]).scores == [1.0]
        assert len(list(first.iterdir())) == 2  # two workers died before the third lived
        monkeypatch.setenv("ARBOR_TEST_DEATHS_DIR", str(second))
        # The live worker dies mid-check; its replacement dies twice while starting.
        result = pool.score([(problem(1), "die"), (problem(2), "ok")])
        assert result.scores == [0.0, 1.0] and result.crashed == [0]
        assert len(list(second.iterdir())) == 2


def test_close_gives_a_busy_worker_2_s_then_kills_it():
    pool = RewardPool(f"{FIX}:sleepy", workers=1, timeout_s=30, search_dirs=[HERE])

    def interrupt(done, total):
        if any(w.task is not None for w in pool._workers):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # the worker is left in a 60 s check
        pool.score([(problem(0, sleep=60), "c")], on_progress=interrupt)
    (worker,) = pool._workers
    t0 = time.monotonic()
    pool.close()
    assert 2.0 <= time.monotonic() - t0 < 2.8
    assert worker.process.exitcode == -signal.SIGKILL


def test_the_parent_wakes_once_a_second_while_a_check_runs_and_sleeps_otherwise():
    # A 3 s check: on_progress comes at about 1 s and 2 s (a progress display stays live, a
    # hung start-up is seen within a second) and with the answer, not in a busy loop.
    with RewardPool(f"{FIX}:sleepy", workers=1, timeout_s=10, search_dirs=[HERE]) as pool:
        pool.score([(problem(0), "warm")])
        calls = []
        pool.score([(problem(1, sleep=3), "c")], on_progress=lambda done, total: calls.append(done))
    assert 3 <= len(calls) <= 5 and calls[-1] == 1


def test_a_script_that_does_not_close_its_pool_still_exits():
    # Workers are daemons: at exit the parent ends them; it would otherwise wait forever for
    # workers that wait for its next item.
    script = (
        "from arbor.rollout.rewards import RewardPool\n"
        f"pool = RewardPool({FIX + ':one'!r}, workers=1, timeout_s=5, search_dirs=[{HERE!r}])\n"
        "assert pool.score([({'id': 'p0'}, 'c')]).scores == [1.0]\n"
    )
    import arbor

    # The arbor under test (under scripts/mutation.py: the mutated copy), whatever the cwd.
    env = {**os.environ, "PYTHONPATH": str(Path(arbor.__file__).resolve().parent.parent)}
    done = subprocess.run([sys.executable, "-c", script], timeout=30, capture_output=True,
                          text=True, env=env)
    assert done.returncode == 0, done.stderr
    # The same, seen in this process (where mutmut's map of which tests reach which code looks).
    pool = RewardPool(FIX + ":one", workers=2, timeout_s=5, search_dirs=[HERE])
    try:
        workers = [p for p in multiprocessing.active_children() if p.name == "arbor-reward-worker"]
        assert len(workers) == 2 and all(p.daemon for p in workers)
    finally:
        pool.close()
