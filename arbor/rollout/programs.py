"""Agent programs: any program that calls an OpenAI-compatible API trains with arbor
(docs/agent-programs.md).

    # agents/openai_tool.py
    async def program(problem, ctx):
        client = ctx.openai_client()                   # openai.AsyncOpenAI bound to this episode
        reply = await client.chat.completions.create(model=ctx.model, messages=[...], tools=[...])
        ...
        return None                                    # or a reward; None: reward.functions score it

    program = load_program(cfg.rollout, search_dirs)   # rollout.program or rollout.program_command
    trees, stats = await sample_program_trees(engine, problems, cfg.rollout, program=program,
                                              tokenizer=tok, stop_ids=[tok.eos_token_id], seed=step)

Each problem is one tree and each of its ``rollout.width`` leaves one run of the program. The
runs call an :class:`~arbor.engines.openai_endpoint.OpenAIEndpoint` on loopback (a per-run key,
one base URL per run); :mod:`arbor.rollout.program_tree` turns their calls into tree nodes
(sampled ids trained, everything else context) and forks runs by replay. A run that raises,
exits non-zero, answers a bad reward, runs past ``rollout.program_timeout_s`` (or idles between
calls past ``rollout.env_timeout_s``) or diverges from its recording is dropped, counted in
``program/errors``, ``program/timeouts`` or ``program/diverged``. An engine failure stops the step.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import os
import ssl
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arbor.config import Config, RolloutConfig
from arbor.engines.openai_endpoint import OpenAIEndpoint
from arbor.engines.types import RolloutEngine
from arbor.errors import ConfigError
from arbor.plugins import load_object
from arbor.rollout.agent_thread import in_daemon_thread
from arbor.rollout.commands import command_argv
from arbor.rollout.episodes import reset_seed
from arbor.rollout.program_render import ChatRender
from arbor.rollout.program_tree import ProgramCalls, ProgramTree, Run
from arbor.rollout.sample_stats import SampleStats
from arbor.tree import RolloutTree

_TICK_S = 0.5  # how often a run's time limits are checked, at most


@dataclass(frozen=True)
class ProgramSource:
    """What a run runs: a function (``rollout.program``) or a command (``rollout.program_command``)."""

    key: str  # the config key that named it
    function: Callable[..., Any] | None = None
    command: tuple[str, ...] = ()

    @property
    def is_async(self) -> bool:
        return self.function is not None and inspect.iscoroutinefunction(self.function)


@dataclass(frozen=True)
class ProgramContext:
    """What a program run is given besides the problem."""

    base_url: str  # the endpoint for this run, ending in /v1
    api_key: str
    model: str  # the name the endpoint answers to (any name is served)
    seed: int  # shared by a problem's runs in a step: seed every source of randomness with it
    is_async: bool = True  # openai_client's kind: AsyncOpenAI for an async def program

    def openai_client(self, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` (``async def`` programs) or ``openai.OpenAI`` bound to this run
        (no retries: a refused request is an answer, not a network error)."""
        import openai

        kind, http = ((openai.AsyncOpenAI, openai.DefaultAsyncHttpxClient) if self.is_async
                      else (openai.OpenAI, openai.DefaultHttpxClient))
        settings: dict[str, Any] = {"base_url": self.base_url, "api_key": self.api_key, "max_retries": 0}
        if "http_client" not in kwargs:
            # One TLS context for every run's client: a client of its own builds one by loading the
            # CA bundle (~20 ms, more than the calls of a short run; the endpoint is plain HTTP).
            settings["http_client"] = http(verify=_tls_context())
        return kind(**(settings | kwargs))


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def load_program(rollout_cfg: RolloutConfig, search_dirs: Sequence[str] = ()) -> ProgramSource | None:
    """``rollout.program`` (a function, checked callable) or ``rollout.program_command``; None: neither."""
    if rollout_cfg.program is not None:
        fn = load_object(rollout_cfg.program, "rollout.program", search_dirs)
        if not callable(fn) or isinstance(fn, type):
            raise ConfigError(f"rollout.program: {rollout_cfg.program!r} must name a function program(problem, ctx) "
                              f"-> float | None (plain or async def), got a {type(fn).__name__}")
        return ProgramSource("rollout.program", function=fn)
    if rollout_cfg.program_command:
        argv = command_argv(rollout_cfg.program_command)  # a bare python3: the interpreter arbor runs in
        return ProgramSource("rollout.program_command", command=tuple(argv))
    return None


def model_name(cfg: Config) -> str:
    """The name a program's endpoint answers to: the last part of ``model.path``."""
    return Path(cfg.model.path).name or "arbor-policy"


class ProgramFailure(Exception):
    """A run's failure, with its kind (``error`` | ``timeout``) for the metric it is counted in."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


async def sample_program_trees(
    engine: RolloutEngine,
    problems: Sequence[dict],
    cfg: RolloutConfig,
    *,
    program: ProgramSource,
    tokenizer: Any,
    stop_ids: Sequence[int],
    seed: int = 0,
    model: str = "arbor-policy",
    needs_reward: bool = False,
    on_progress: Callable[[int, RolloutTree, SampleStats], None] | None = None,
) -> tuple[list[RolloutTree], list[SampleStats]]:
    """One tree per problem from ``cfg.width`` runs of ``program``; ``(trees, stats)`` in order.

    ``needs_reward``: no reward functions, so a run must return a number (None is an error).
    A tree whose every run failed has no leaves (the caller skips it).
    """
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    calls = ProgramCalls(engine, ChatRender(tokenizer, stop_ids), cfg, decode, tokenizer, stop_ids, seed,
                         time.monotonic)
    endpoint = OpenAIEndpoint(calls, model)
    await endpoint.start()
    try:
        async def one(index: int) -> tuple[RolloutTree, SampleStats]:
            stats = SampleStats()
            tree = await _sample_tree(calls, endpoint, program, problems[index], index, stats, seed, needs_reward)
            if on_progress is not None:
                on_progress(index, tree, stats)
            return tree, stats

        results = await asyncio.gather(*(one(i) for i in range(len(problems))))
    finally:
        await endpoint.close()
    return [t for t, _ in results], [s for _, s in results]


# A program's trees: (problems, rollout settings, seed, on_progress) -> the coroutine
# of sample_program_trees (eval and training sample through one).
ProgramSampler = Callable[[list[dict], RolloutConfig, int, Callable[..., None]],
                          Coroutine[Any, Any, tuple[list[RolloutTree], list[SampleStats]]]]


def program_sampler(engine: RolloutEngine, program: ProgramSource, tokenizer: Any, stop_ids: Sequence[int],
                    model: str, needs_reward: bool) -> ProgramSampler:
    """How training and eval sample ``program``'s trees through ``engine``: ``needs_reward``
    when no reward function scores the runs (each must return its reward)."""
    def sample(problems: list[dict], cfg: RolloutConfig, seed: int, on_progress: Callable[..., None]) -> Any:
        return sample_program_trees(engine, problems, cfg, program=program, tokenizer=tokenizer, stop_ids=stop_ids,
                                    seed=seed, model=model, needs_reward=needs_reward, on_progress=on_progress)

    return sample


async def _sample_tree(calls: ProgramCalls, endpoint: OpenAIEndpoint, program: ProgramSource, problem: dict,
                       index: int, stats: SampleStats, seed: int, needs_reward: bool) -> RolloutTree:
    tasks: list[asyncio.Task] = []

    def launch(run: Run) -> None:
        tasks.append(asyncio.ensure_future(_run(tree, run)))

    async def _run(ptree: ProgramTree, run: Run) -> None:
        started = time.monotonic()
        stats.program_runs += 1
        ctx = ProgramContext(endpoint.base_url(run.episode), endpoint.api_key, endpoint.model,
                             reset_seed(seed, index), program.is_async)
        try:
            reward = await _watched(_call_program(program, problem, ctx), run, calls.cfg, calls.clock)
            _check_reward(reward, needs_reward)
        except ProgramFailure as e:
            if run.engine_error is not None:
                raise run.engine_error from None
            if run.diverged is not None:
                ptree.fail(run, "diverged")
            elif run.exhausted and e.kind == "error" and not needs_reward:
                ptree.finish(run, None)  # the budget ended it: scored by the reward functions, as an answer cut short
            else:
                ptree.fail(run, e.kind, str(e))
        else:
            if run.engine_error is not None:  # the program caught it: its answer is not to be trusted
                raise run.engine_error
            ptree.finish(run, reward)
        finally:
            run.open = False
            stats.program_seconds += time.monotonic() - started

    tree = calls.add_tree(index, problem, stats, launch)
    launch(tree.new_run([], None))
    try:
        while not all(t.done() for t in tasks):  # forks add tasks while others run
            await asyncio.gather(*[t for t in tasks if not t.done()])
        for t in tasks:
            t.result()  # an engine failure stops the step
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    sampled = tree.close()
    if sampled is None:  # no run got as far as a call: an empty tree, as when every branch is dropped
        sampled = RolloutTree([], problem)
    stats.count_leaves(sampled.leaves())
    if stats.leaves < calls.cfg.width:
        stats.shortfall_reason = (f"program runs were dropped ({stats.program_errors} errors, {stats.program_timeouts} "
                                  f"timeouts, {stats.program_diverged} diverged: program/*)")
    return sampled


async def _call_program(program: ProgramSource, problem: dict, ctx: ProgramContext) -> Any:
    """The run's reward (what the program returned, or its command's last line said)."""
    if program.function is None:
        return await _run_command(program.command, problem, ctx)
    try:
        if program.is_async:
            return await program.function(dict(problem), ctx)
        # A daemon thread, not the loop's executor: a hung program must not hold the step's end.
        return await in_daemon_thread(program.function, dict(problem), ctx)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise ProgramFailure("error", f"{program.key} raised {type(e).__name__}: {e}") from e


async def _run_command(argv: Sequence[str], problem: dict, ctx: ProgramContext) -> Any:
    env = os.environ | {"OPENAI_BASE_URL": ctx.base_url, "OPENAI_API_KEY": ctx.api_key, "ARBOR_MODEL": ctx.model,
                        "ARBOR_SEED": str(ctx.seed)}
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                    env=env)
    except OSError as e:
        raise ProgramFailure("error", f"rollout.program_command {list(argv)} cannot start: {e}") from e
    try:
        out, err = await proc.communicate(json.dumps(problem).encode())
    finally:
        if proc.returncode is None:  # timed out (cancelled): nothing of it outlives the run
            proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise ProgramFailure("error", f"rollout.program_command exited with status {proc.returncode}: "
                                      f"{' | '.join(tail) or 'no stderr'}")
    lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
    try:
        last = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        last = None
    if not isinstance(last, dict) or "reward" not in last:
        raise ProgramFailure("error", 'rollout.program_command must print {"reward": x} (x a number or null) as '
                                      f"its last line of stdout, got {lines[-1][:200] if lines else 'nothing'!r}")
    return last["reward"]


async def _watched(work: Any, run: Run, cfg: RolloutConfig, clock: Callable[[], float]) -> Any:
    """``work``'s result; a :class:`ProgramFailure` ``timeout`` when the run passes
    ``rollout.program_timeout_s`` in all, or spends longer than ``rollout.env_timeout_s`` of its
    own between calls (cancelled: a thread's program is left to finish, its calls refused)."""
    task = asyncio.ensure_future(work)
    start, tick = clock(), min(_TICK_S, cfg.env_timeout_s / 4, cfg.program_timeout_s / 4)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=tick)
            if done:
                return task.result()
            now = clock()
            if now - start > cfg.program_timeout_s:
                raise ProgramFailure("timeout", f"ran past rollout.program_timeout_s={cfg.program_timeout_s}")
            if not run.in_call and now - run.last_active > cfg.env_timeout_s:
                raise ProgramFailure("timeout", f"spent more than rollout.env_timeout_s={cfg.env_timeout_s} "
                                                f"between calls (after call {len(run.calls)})")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _check_reward(reward: Any, needs_reward: bool) -> None:
    if reward is None:
        if needs_reward:
            raise ProgramFailure("error", "returned no reward (None), and reward.functions is empty")
        return
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ProgramFailure("error", f"returned {reward!r:.80}: a reward must be a finite number or None")


def program_metrics(stats: Sequence[SampleStats]) -> dict[str, float]:
    """``program/*``: calls, replays, token-exactness, failures and seconds per run."""
    runs = sum(s.program_runs for s in stats)
    return {
        "program/runs": float(runs),
        "program/calls": float(sum(s.program_calls for s in stats)),
        "program/replayed_calls": float(sum(s.program_replayed_calls for s in stats)),
        "program/retokenized": float(sum(s.program_retokenized for s in stats)),
        "program/offpath_calls": float(sum(s.program_offpath_calls for s in stats)),
        "program/ignored_params": float(sum(s.program_ignored_params for s in stats)),
        "program/diverged": float(sum(s.program_diverged for s in stats)),
        "program/errors": float(sum(s.program_errors for s in stats)),
        "program/timeouts": float(sum(s.program_timeouts for s in stats)),
        "program/dropped": float(sum(s.env_dropped for s in stats)),  # leaves of failed runs: never trained on
        "program/seconds": sum(s.program_seconds for s in stats) / max(runs, 1),
    }
