"""Environments in sampled trees: every branch owns its own instance, under each fork mode.

The scripted engine of tests/test_sampler.py writes every model turn as 2 seeded tokens and EOS;
the environments of tests/env_fixtures.py note each turn they are shown (a side effect) and
answer with all their notes, rendered so the text can be read back from the tree. A branch that
saw another branch's step would show a turn of that branch in its notes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
from env_fixtures import (
    TOOL,
    AsyncNotebook,
    Clock,
    CopyNotebook,
    Dice,
    NoForkNotebook,
    Notebook,
    Registry,
    SeededDice,
    SlowOnce,
    Together,
    decode_turn,
    render,
)
from test_sampler import EOS, PROMPT, ScriptedEngine, cfg_of, fresh

from arbor import Env, Step
from arbor.rollout.env_calls import LiveEnvsError
from arbor.rollout.environments import EnvSource, gives_reward
from arbor.rollout.episodes import EpisodeSetup
from arbor.rollout.sampler import sample_trees
from arbor.tree import Node, RolloutTree


def turn(request, j, depth):
    return fresh(request, j, 2) + [EOS], "stop"


def later_turns_score_higher(request, j, depth):
    """-log p 3 for every token after an environment turn, 0.1 before: EPTree forks inside later turns."""
    return -3.0 if TOOL in request.input_ids else -0.1


def sample(cls, problems=1, logprob=None, script=turn, **cfg):
    Registry.reset()
    source = EnvSource(cls, "rollout.env", cls.__name__, gives_reward(cls()))
    Registry.reset()
    engine = ScriptedEngine(8, script, logprob)
    setup = EpisodeSetup(source, render, prompt=lambda messages, tools=None: list(PROMPT))
    config = cfg_of(**{"width": 8, "segment_tokens": 8, "max_depth": 12, **cfg})
    trees, stats = asyncio.run(sample_trees(engine, [{"id": i} for i in range(problems)], None, config,
                                            eos_token_ids=[EOS], decode=lambda ids: " ".join(map(str, ids)),
                                            env=setup, seed=5))
    return trees, stats


def is_env_turn(node: Node) -> bool:
    return bool(node.loss_mask) and not any(node.loss_mask)


def check_isolation(tree: RolloutTree, noisy: bool = False) -> None:
    """Every environment turn holds exactly the model turns of its own path; every leaf's reward
    counts the steps of its own path."""
    for node in [*tree.nodes()]:
        turns, ids = [], []
        for n in tree.path(node):
            if is_env_turn(n):
                turns.append(" ".join(map(str, ids[:-1])))  # a turn's EOS is not in its message
                ids = []
            else:
                ids += n.token_ids
        if is_env_turn(node):
            text = decode_turn(node.token_ids)
            assert (text.split(" rolled ")[0] if noisy else text) == "|".join(turns), (node, text, turns)
        if node.is_leaf and node.env_reward is not None:
            assert node.env_reward == len(turns) + (node.finish_reason == "stop")


def test_the_same_seed_resets_every_instance_of_a_tree():
    from arbor.rollout.episodes import reset_seed

    trees, _ = sample(Notebook, problems=2)  # the step's seed is 5
    seeds = {(o.notes[0] if o.notes else None, o.seed) for o in Registry.opened}
    # one reset seed per tree, shared by its replays, from the step's seed
    assert {seed for _, seed in seeds} == {reset_seed(5, 0), reset_seed(5, 1)}


@pytest.mark.parametrize("cls", [Notebook, CopyNotebook, NoForkNotebook])
def test_siblings_never_see_each_others_side_effects(cls):
    trees, stats = sample(cls, problems=2)
    for tree, s in zip(trees, stats):
        assert len(tree.leaves()) == 8 and s.shortfall_reason is None and s.env_errors == 0
        check_isolation(tree)
        assert all(leaf.finish_reason == "stop" and leaf.env_reward == 3.0 for leaf in tree.leaves())
        assert s.env_episodes == 8 and s.env_episode_steps == 24 and s.env_live == 0
        mode = cls.fork
        assert s.env_forks[mode] > 0 and set(s.env_forks) == {mode}
        assert (s.env_replayed_steps > 0) == (mode == "replay")
        forked_after_a_step = [n for n in tree.nodes() if len(n.children) > 1 and any(
            is_env_turn(a) for a in tree.path(n))]
        # fork: none keeps a path at one copy once it has stepped; the others fork after tool turns.
        assert (not forked_after_a_step) == (mode == "none")
    # Every instance made was closed: none leaks.
    assert Registry.opened and {id(e) for e in Registry.opened} == {id(e) for e in Registry.closed}
    assert len(Registry.closed) == len(Registry.opened)


def test_a_replay_with_hidden_randomness_diverges_and_its_branch_is_never_trained_on(caplog):
    caplog.set_level(logging.INFO)  # per-branch lines go to the run's arbor.log, not the console
    trees, stats = sample(SeededDice)  # randomness from reset's seed: replays agree
    assert stats[0].env_errors == 0 and stats[0].env_replayed_steps > 0 and stats[0].env_dropped == 0
    trees, stats = sample(Dice)  # the global RNG: every replayed step rolls another number
    (tree,), (s,) = trees, stats
    # A fork replays when its branch first needs the environment (its first step, or its end):
    # forks before the first step replay nothing and agree; later ones diverge and are dropped.
    assert s.env_errors > 0 and s.env_dropped == s.env_errors and s.env_forks.get("replay", 0) > 0
    assert s.env_diverged == s.env_errors and not s.failures  # divergence is counted, not a code failure
    assert len(tree.leaves()) == 8 - s.env_dropped and s.shortfall_reason.startswith("environment failures")
    check_isolation(tree, noisy=True)  # what is left is every branch's own
    assert "problem 0: replaying the environment for a new branch diverged at turn 1: step returned" in caplog.text
    assert "Hidden non-determinism (a global RNG, a clock?)" in caplog.text
    assert all(leaf.env_reward is not None for leaf in tree.leaves())  # only the branches that were replayed right
    assert {id(e) for e in Registry.opened} == {id(e) for e in Registry.closed}


def test_a_reset_that_reads_the_clock_cannot_fork_at_all(caplog):
    caplog.set_level(logging.INFO)
    (tree,), (s,) = sample(Clock, width=4)
    assert len(tree.leaves()) == 1 and s.env_dropped == 3 and "diverged at turn 0: reset returned" in caplog.text
    assert s.shortfall_reason.startswith("environment failures stopped branches")


def test_a_timed_out_step_drops_its_branch_and_its_siblings_go_on(caplog):
    caplog.set_level(logging.INFO)
    SlowOnce.hung, SlowOnce.release = set(), threading.Event()
    try:
        (tree,), (s,) = sample(SlowOnce, mode="independent", width=3, env_timeout_s=0.3)
        reasons = sorted(leaf.finish_reason for leaf in tree.leaves())
        assert reasons == ["stop", "stop"] and s.env_timeouts == 1 and s.env_dropped == 1
        assert [(f.kind, f.problem_id, f.turn) for f in s.failures] == [("env_timeout", "0", 1)]
        assert s.env_live == 1  # the abandoned instance is closed when its step returns
        assert "problem 0, turn 1: env_timeout: env.step ran past rollout.env_timeout_s=0.3s" in caplog.text
        assert all(leaf.env_reward == 3.0 for leaf in tree.leaves())  # the siblings finished and were scored
    finally:
        SlowOnce.release.set()
    deadline = time.monotonic() + 10
    while len(Registry.closed) < len(Registry.opened) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(Registry.closed) == len(Registry.opened)  # close() is always called, also after a timeout


def test_without_reward_functions_a_timed_out_episode_is_dropped():
    SlowOnce.hung, SlowOnce.release = set(), threading.Event()
    try:
        Registry.reset()
        source = EnvSource(SlowOnce, "rollout.env", "SlowOnce", True)
        setup = EpisodeSetup(source, render, prompt=lambda messages, tools=None: list(PROMPT), needs_reward=True)
        trees, stats = asyncio.run(sample_trees(
            ScriptedEngine(8, turn), [{"id": 0}], None, cfg_of(mode="independent", width=3, segment_tokens=8,
                                                              max_depth=12, env_timeout_s=0.3),
            eos_token_ids=[EOS], decode=str, env=setup))
    finally:
        SlowOnce.release.set()
    assert len(trees[0].leaves()) == 2 and stats[0].env_dropped == 1 and stats[0].env_timeouts == 1


def test_plain_steps_of_different_branches_run_at_the_same_time():
    Together.barrier = threading.Barrier(2)  # a step returns only when the other branch's runs too
    (tree,), (s,) = sample(Together, mode="independent", width=2)
    assert [leaf.env_reward for leaf in tree.leaves()] == [3.0, 3.0]


def test_async_methods_are_awaited_and_overlap():
    AsyncNotebook.waiting, AsyncNotebook.all_in = 0, None
    (tree,), (s,) = sample(AsyncNotebook, width=4)
    check_isolation(tree)
    assert len(tree.leaves()) == 4 and all(leaf.env_reward == 3.0 for leaf in tree.leaves())
    assert s.env_forks["copy"] > 0 and len(Registry.closed) == len(Registry.opened)


def test_max_live_envs_caps_the_instances_open_at_once():
    peak = [0]

    class Counted(Notebook):
        """Refuses to be used once closed: an instance closed for a slot must be rebuilt, not reused."""

        def __init__(self) -> None:
            super().__init__()
            self.closed = False
            peak[0] = max(peak[0], len(Registry.opened) - len(Registry.closed))

        def step(self, history):
            assert not self.closed, "stepped after close()"
            return super().step(history)

        def reward(self):
            assert not self.closed, "reward after close()"
            return super().reward()

        def close(self):
            self.closed = True
            super().close()

    trees, stats = sample(Counted, problems=3, width=4, max_live_envs=2)
    assert peak[0] <= 2 and all(len(t.leaves()) == 4 for t in trees)
    assert not [f for s in stats for f in s.failures]
    assert sum(sum(s.env_forks.values()) for s in stats) + 3 == len(Registry.opened)  # every rebuild is a fork
    for tree in trees:
        check_isolation(tree)
    assert len(Registry.closed) == len(Registry.opened)
    # A copy-forked tree keeps a copy of every state: a cap below what one tree needs cannot be met.
    with pytest.raises(LiveEnvsError, match=r"rollout.max_live_envs=1: every tree being sampled waits"):
        sample(CopyNotebook, width=4, max_live_envs=1)
    assert len(Registry.closed) == len(Registry.opened)  # what was open is closed before the error goes up


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "no_fallback"])
@pytest.mark.parametrize("cls", [Notebook, CopyNotebook, NoForkNotebook])
def test_entropy_forks_inside_later_turns_get_the_environment_of_that_turn(cls, fallback):
    (tree,), (s,) = sample(cls, width=6, fork_at="entropy", entropy_init=2, entropy_forks=1,
                           logprob=later_turns_score_higher, fallback=fallback)
    assert len(tree.leaves()) == 6 and s.env_errors == 0 and s.forks > 0
    check_isolation(tree)
    inside = [n for n in tree.nodes() if len(n.children) > 1 and any(is_env_turn(a) for a in tree.path(n))]
    if cls.fork == "none":
        assert not inside  # only forks before the first step (the first model turn, or the root)
    else:
        # Forks after an environment turn: at a token of a later model turn (copies are model turns).
        assert inside and all(not is_env_turn(c) for n in inside for c in n.children)
        assert all(leaf.env_reward == 3.0 for leaf in tree.leaves())
    assert len(Registry.closed) == len(Registry.opened)


@pytest.mark.parametrize("cls", [Notebook, CopyNotebook, NoForkNotebook])
def test_entropy_forks_at_the_first_tokens_of_sibling_answers_fork_from_their_parent_once(cls):
    # Every token scores the same, so each initial answer's fork point is its first token: both
    # points fork from the root. They are one start there (copy mode once crashed preparing the
    # root's instances twice: "2 copies sampled from node 0 for 0 instances").
    (tree,), (s,) = sample(cls, width=6, fork_at="entropy", entropy_init=2, entropy_forks=1)
    assert len(tree.leaves()) == 6 and len(tree.root.children) == 6 and s.forks == 2
    assert s.env_errors == 0 and not s.failures and s.env_live == 0
    check_isolation(tree)
    assert len(Registry.closed) == len(Registry.opened)


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "no_fallback"])
def test_entropy_forking_whose_copies_all_fail_ends_the_tree_naming_why(fallback, monkeypatch):
    # No copy can be made: no path starts, so there is no token to fork at; the root restart (with
    # rollout.fallback) gets no instance either, and the tree ends there (no loop).
    monkeypatch.setattr(_Copies, "how", "copy_raises")
    tree, s, _ = sample_with(_Copies, fork_at="entropy", entropy_init=2, entropy_forks=1, fallback=fallback)
    assert tree.leaves() == [] and s.requests == 0 and s.root_restarts == int(fallback)
    assert len(s.failures) == s.unstarted == (4 if fallback else 2)
    assert s.shortfall_reason == ("environment failures stopped branches (0 dropped, 0 errors, 0 timeouts, 4 failures: "
                                  "env/errors, env/timeouts, failures/*)" if fallback else
                                  "no token left to fork at and rollout.fallback is disabled")
    assert len(Registry.closed) == len(Registry.opened) == 1


def test_an_environment_that_raises_drops_its_branches_naming_the_problem_and_every_instance_is_closed():
    from env_fixtures import Broken

    trees, stats = sample(Broken, problems=2, width=4)
    failures = [f for s in stats for f in s.failures]
    # Each branch whose step raised is dropped and recorded with the problem, the turn and the
    # environment's own message; nothing raised is trained on.
    assert failures and {f.describe() for f in failures} == {
        f"problem {i}, turn 2: env_error: step raised KeyError: 'no such account'" for i in (0, 1)}
    assert sum(s.env_dropped for s in stats) + sum(len(t.leaves()) for t in trees) >= len(failures)
    assert all(leaf.finish_reason != "failed" for t in trees for leaf in t.leaves())
    assert Registry.opened and len(Registry.closed) == len(Registry.opened)  # also the other trees'


@pytest.mark.parametrize("fork_at", ["segment", "entropy"])
def test_forks_that_never_step_an_environment_without_a_reward_build_no_instance(fork_at):
    class Unrewarded(Notebook):
        reward = Env.reward  # gives none

    def rambles(request, j, depth):  # never ends a turn: every path runs to the response budget
        return fresh(request, j), "length"

    entropy = dict(entropy_init=2, entropy_forks=1) if fork_at == "entropy" else {}
    (tree,), (s,) = sample(Unrewarded, script=rambles, max_depth=3, fork_at=fork_at, **entropy)
    assert len(tree.leaves()) == 8 and all(leaf.finish_reason == "max_length" for leaf in tree.leaves())
    assert len(Registry.opened) == 1 and s.env_forks == {} and s.env_episodes == 8  # only the tree's reset instance
    assert Registry.closed == Registry.opened


class _NeverAsked:
    """An agent whose episodes never start (its environment fails first): only its presence counts."""

    def start(self, problem):
        raise AssertionError("not reached")

    def step(self, problem, history):
        raise AssertionError("not reached")


class _Start(Notebook):
    """A Notebook whose start goes wrong at ``stage`` (set by the test)."""

    stage = ""
    release = threading.Event()

    def __init__(self) -> None:
        if self.stage == "build":
            raise RuntimeError("no table")
        if self.stage == "build_hang":
            _Start.release.wait(10)
        super().__init__()

    def reset(self, problem, seed):
        if self.stage == "reset":
            raise RuntimeError("no deck")
        if self.stage == "reset_hang":
            _Start.release.wait(10)
        if self.stage == "messages":
            return "hello"
        messages = super().reset(problem, seed)
        if self.stage == "tools":
            self.tools = "search"
        if self.stage == "tool_names":
            self.tools = ["search"]
        return messages


@pytest.mark.parametrize("agent", [False, True], ids=["env", "agent"])
@pytest.mark.parametrize("stage,kind,message", [
    ("build", "error", "building raised RuntimeError: no table"),
    ("build_hang", "timeout", "building ran past rollout.{who}_timeout_s"),
    ("reset", "error", "reset raised RuntimeError: no deck"),
    ("reset_hang", "timeout", "reset ran past rollout.{who}_timeout_s: the tree has no prompt"),
    ("messages", "error", "problem 0: an {whom} must give a list of chat messages (dicts), got str"),
    ("tools", "error", "reset left tools='search': it must be a list of tool dicts"),
    ("tool_names", "error", 'reset left tools=[\'search\']: it must be a list of tool dicts ({{"type": "function", '
                            '"function": {{"name", "description", "parameters"}}}})'),
])
def test_a_tree_whose_environment_cannot_start_is_dropped_naming_why(agent, stage, kind, message, caplog):
    """Building or resetting the tree's first instance fails: the tree has no leaves, the failure is
    the agent's when an agent drives the episodes (``agent_error``/``agent_timeout``, no turn), else
    the environment's (turn 0), with what went wrong; the one instance built is closed."""
    caplog.set_level(logging.INFO)
    _Start.stage, _Start.release = "", threading.Event()
    Registry.reset()
    source = EnvSource(_Start, "rollout.agent" if agent else "rollout.env", "_Start", True,
                       agent=_NeverAsked() if agent else None)
    _Start.stage = stage
    setup = EpisodeSetup(source, render, prompt=lambda messages, tools=None: list(PROMPT))
    config = cfg_of(width=4, segment_tokens=8, max_depth=4, env_timeout_s=0.3, agent_timeout_s=0.3)
    try:
        (tree,), (s,) = asyncio.run(sample_trees(ScriptedEngine(8, turn), [{"id": 0}], None, config,
                                                 eos_token_ids=[EOS], decode=lambda ids: " ".join(map(str, ids)),
                                                 env=setup, seed=5))
    finally:
        _Start.release.set()
    who = "agent" if agent else "env"
    assert tree.leaves() == [] and s.unstarted == 1 and tree.problem == {"id": 0}  # a tree with no leaves, named
    assert s.env_live == (kind == "timeout")  # only a call past its limit still holds an instance
    (failure,) = s.failures
    assert (failure.kind, failure.problem_id, failure.turn) == (f"{who}_{kind}", "0", None if agent else 0)
    assert failure.message.startswith(message.format(who=who, whom="agent" if agent else "environment")), failure
    assert f"{failure.describe()}: the tree is dropped" in [r.getMessage() for r in caplog.records]
    built = 0 if stage == "build" else 1  # a build past the limit finishes later and is closed then
    deadline = time.monotonic() + 10
    while min(len(Registry.closed), len(Registry.opened)) < built and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(Registry.closed) == len(Registry.opened) == built


class _Wrong(Notebook):
    """A Notebook whose first step, or the reward after it, goes wrong as ``mode`` says (set by
    the test); otherwise its episodes end after one step, or run past the budget (``long_*``)."""

    mode = ""
    release = threading.Event()

    def step(self, history):
        mode = self.mode
        if mode == "step_raises":
            raise RuntimeError("no such account")
        if mode == "step_hangs":
            _Wrong.release.wait(10)
        if mode == "not_a_step":
            return [{"role": "tool", "content": "x"}]
        if mode == "bad_messages":
            return Step("hello", done=False)
        if mode == "no_messages":
            return Step([], done=False)
        if mode.startswith("long"):  # 201 ids: more than the 96-token response budget holds
            self.notes.append("x")
            return Step([{"role": "tool", "content": "x" * 200}], done=False)
        return Step(super().step(history).messages, done=True)

    def reward(self):
        mode = self.mode
        if mode == "reward_raises":
            raise RuntimeError("no ledger")
        if mode == "reward_hangs":
            _Wrong.release.wait(10)
        if mode in ("reward_nan", "reward_bool"):
            return {"reward_nan": float("nan"), "reward_bool": True}[mode]
        if mode in ("reward_none", "long_unrewarded"):
            return None
        return super().reward()


def sample_with(cls, problems=({"id": 0},), prompt=True, max_prompt_tokens=0, script=turn, needs_reward=False,
                agent=False, **cfg):
    """One tree of ``cls``'s episodes (driven by an agent's stand-in with ``agent``); ``prompt`` False:
    the reset messages only start the history. Returns the tree, its stats and the tools each prompt got."""
    Registry.reset()
    seen_tools = []

    def prompt_of(messages, tools=None):
        seen_tools.append(tools)
        return list(PROMPT)

    source = EnvSource(cls, "rollout.agent" if agent else "rollout.env", cls.__name__, gives_reward(cls()),
                       agent=_NeverAsked() if agent else None)
    setup = EpisodeSetup(source, render, prompt=prompt_of if prompt else None, needs_reward=needs_reward,
                         max_prompt_tokens=max_prompt_tokens)
    Registry.reset()
    config = cfg_of(**{"width": 4, "segment_tokens": 8, "max_depth": 12, **cfg})
    (tree,), (s,) = asyncio.run(sample_trees(ScriptedEngine(8, script), list(problems), [list(PROMPT)], config,
                                             eos_token_ids=[EOS], decode=lambda ids: " ".join(map(str, ids)),
                                             env=setup, seed=5))
    return tree, s, seen_tools


def sample_wrong(mode, agent, caplog, **cfg):
    caplog.set_level(logging.INFO)
    _Wrong.mode, _Wrong.release = mode, threading.Event()
    try:
        tree, s, _ = sample_with(_Wrong, agent=agent, needs_reward=mode in ("reward_none", "long_unrewarded"),
                                 env_timeout_s=0.3, agent_timeout_s=0.3, **cfg)
    finally:
        _Wrong.release.set()
    return tree, s


def instances_all_closed(opened: int | None = 4) -> bool:
    """Whether every instance opened (``opened`` of them, unless None) is closed, once any call past
    its limit has returned (it closes its instance then)."""
    deadline = time.monotonic() + 10
    while len(Registry.closed) < len(Registry.opened) and time.monotonic() < deadline:
        time.sleep(0.05)
    return ((opened is None or len(Registry.opened) == opened)
            and sorted(map(id, Registry.closed)) == sorted(map(id, Registry.opened)))


@pytest.mark.parametrize("agent", [False, True], ids=["env", "agent"])
@pytest.mark.parametrize("mode,kind,message", [
    ("step_raises", "error", "step raised RuntimeError: no such account"),
    ("step_hangs", "timeout", "{who}.step ran past rollout.{who}_timeout_s=0.3s"),
    ("not_a_step", "error", "step returned a list, not arbor.Step(messages, done)"),
    ("bad_messages", "error", "{where}: an {whom} must give a list of chat messages (dicts), got str"),
    ("no_messages", "error", "step returned Step([], done=False): a step that goes on must give the model "
                             "something to answer"),
    ("reward_raises", "error", "reward raised RuntimeError: no ledger"),
    ("reward_hangs", "timeout", "{who}.reward ran past rollout.{who}_timeout_s=0.3s"),
    ("reward_nan", "error", "reward returned nan, not a finite number or None"),
    ("reward_bool", "error", "reward returned True, not a finite number or None"),
    ("reward_none", "error", "reward returned None and reward.functions is empty: the episode has no reward "
                             "(never silently 0); return a number or add a reward function"),
])
def test_a_step_or_reward_that_goes_wrong_drops_its_branch_naming_why(agent, mode, kind, message, caplog):
    """After the model's first turn every branch's step (or the reward read when it ends) goes
    wrong: each branch is dropped (the tree keeps no leaf), each failure names the problem, the
    turn (an environment's; an agent's has none), whose it was and what went wrong, and every
    instance is closed."""
    tree, s = sample_wrong(mode, agent, caplog)
    if agent and mode == "no_messages":  # an agent that says nothing more has ended its episode
        assert [leaf.env_reward for leaf in tree.leaves()] == [0.0] * 4 and not s.failures  # no notes taken
        assert instances_all_closed()
        return
    who, turn_ = ("agent", None) if agent else ("env", 1)
    where = "problem 0" if agent else "problem 0, turn 1"
    text = message.format(who=who, whom="agent" if agent else "environment", where=where)
    if agent and kind == "timeout":
        text += " (the call is left running in its thread)"
    assert tree.leaves() == [] and s.env_dropped == 4 and s.env_episodes == 0
    assert [(f.kind, f.problem_id, f.turn, f.message) for f in s.failures] == [(f"{who}_{kind}", "0", turn_, text)] * 4
    assert (s.agent_timeouts, s.env_timeouts) == ((4 * (kind == "timeout"), 0) if agent else (0, 4 * (kind == "timeout")))
    assert s.env_live == (4 if kind == "timeout" else 0)  # a call past its limit still holds its instance
    dropped = "the branch is dropped" + (", its siblings go on" if kind == "timeout" else "")
    assert f"{where}: {who}_{kind}: {text}: {dropped}" in [r.getMessage() for r in caplog.records]
    assert instances_all_closed()


@pytest.mark.parametrize("agent", [False, True], ids=["env", "agent"])
@pytest.mark.parametrize("mode,overflow", [("long", "unfinished"), ("long_unrewarded", "unfinished"), ("long", "drop")])
def test_messages_past_the_response_budget_end_or_drop_the_episode(agent, mode, overflow, caplog):
    """rollout.env_overflow: unfinished ends each episode at the turn whose messages do not fit, with
    the environment's reward (0 when it gives none and no reward function could); drop removes the
    branch. Either way counted, logged naming whose messages they were, and the instance closed."""
    tree, s = sample_wrong(mode, agent, caplog, env_overflow=overflow)
    whose = "agent" if agent else "environment"
    if mode == "long" and overflow == "drop":  # a model turn that fills the budget leaves 0 tokens
        sample_wrong(mode, agent, caplog, env_overflow=overflow, segment_tokens=3, max_depth=1)
        assert (f"problem 0: the {whose}'s messages of turn 1 are 201 tokens, but the episode has 0 left of its "
                "response budget (rollout.segment_tokens × rollout.max_depth = 3): dropped") in caplog.text
    assert (f"problem 0: the {whose}'s messages of turn 1 are 201 tokens, but the episode has 93 left of its "
            f"response budget (rollout.segment_tokens × rollout.max_depth = 96): "
            f"{'ended' if overflow == 'unfinished' else 'dropped'} (rollout.env_overflow)") in caplog.text
    if overflow == "unfinished":
        reward = 0.0 if mode == "long_unrewarded" else 1.0
        assert [(leaf.finish_reason, leaf.env_reward) for leaf in tree.leaves()] == [("message_too_long", reward)] * 4
        assert (s.overflow_ended, s.env_episodes, s.env_dropped, s.dropped_too_long, s.failures) == (4, 4, 0, 0, [])
    else:
        assert tree.leaves() == [] and (s.overflow_ended, s.env_dropped, s.dropped_too_long, s.env_errors) == (0, 4, 4, 4)
    assert s.env_live == 0 and instances_all_closed()


def test_a_prompt_longer_than_data_max_prompt_tokens_drops_the_tree_naming_both():
    tree, s, _ = sample_with(Notebook, max_prompt_tokens=len(PROMPT))  # exactly at the limit: kept
    assert len(tree.leaves()) == 4 and not s.failures
    tree, s, _ = sample_with(Notebook, max_prompt_tokens=len(PROMPT) - 1)
    assert tree.leaves() == [] and s.unstarted == 1
    assert [(f.kind, f.turn, f.message) for f in s.failures] == [(
        "env_error", 0, f"reset gave a prompt of {len(PROMPT)} tokens, more than data.max_prompt_tokens="
        f"{len(PROMPT) - 1} (an environment's prompts are only known when its episode starts)")]
    assert len(Registry.closed) == len(Registry.opened) == 1


def test_the_environment_s_tools_reach_the_prompt():
    class Tooled(Notebook):
        def reset(self, problem, seed):
            self.tools = [{"type": "function", "function": {"name": "search"}}]
            return super().reset(problem, seed)

    _, _, seen = sample_with(Tooled)
    assert seen == [[{"type": "function", "function": {"name": "search"}}]]
    _, _, seen = sample_with(Notebook)
    assert seen == [None]


def test_reset_messages_may_be_empty_only_when_the_prompts_are_given():
    class Silent(Notebook):
        def reset(self, problem, seed):
            super().reset(problem, seed)
            return []

    tree, s, _ = sample_with(Silent, prompt=False)  # sample_trees' prompt; the history starts empty
    assert len(tree.leaves()) == 4 and not s.failures
    tree, s, _ = sample_with(Silent)
    assert tree.leaves() == [] and [f.message for f in s.failures] == [
        "problem 0: an environment gave no messages to start the episode with"]


def test_an_instance_with_a_bad_fork_mode_stops_sampling_naming_the_key_and_is_closed():
    from arbor.errors import ConfigError

    class Sideways(Notebook):
        fork = "sideways"

    # A factory may build other classes than start-up's probe: each instance is checked.
    setup = EpisodeSetup(EnvSource(Sideways, "rollout.env", "factory", True), render,
                         prompt=lambda messages, tools=None: list(PROMPT))
    Registry.reset()
    with pytest.raises(ConfigError, match=r"^rollout\.env: Sideways\.fork must be one of copy, replay, none, "
                                          r"got 'sideways'$"):
        asyncio.run(sample_trees(ScriptedEngine(8, turn), [{"id": 0}], None, cfg_of(width=4, segment_tokens=8),
                                 eos_token_ids=[EOS], decode=str, env=setup, seed=5))
    assert len(Registry.opened) == 1 and Registry.closed == Registry.opened


def test_episodes_need_their_problems():
    with pytest.raises(ValueError, match=r"^rollout\.env needs the problems \(got None for tree-0\)$"):
        sample_with(Notebook, problems=[None])


def test_episodes_that_end_at_the_budget_read_each_branch_s_reward_and_count_its_steps():
    # The first model turn ends (the environment steps), every later one runs to the budget:
    # each leaf ends without a step of its own. A rewarding environment's reward is read on the
    # leaf's own instance (forks built for it by replay); one without a reward counts the steps.
    def then_rambles(request, j, depth):
        return (fresh(request, j), "length") if TOOL in request.input_ids else (fresh(request, j, 2) + [EOS], "stop")

    tree, s, _ = sample_with(Notebook, script=then_rambles, max_depth=4)
    assert [leaf.finish_reason for leaf in tree.leaves()] == ["max_depth"] * 4
    assert [leaf.env_reward for leaf in tree.leaves()] == [1.0] * 4  # one note: the step of its own path
    assert (s.env_episodes, s.env_episode_steps) == (4, 4)
    # Forks: the root's second branch (a reset, no step replayed) and one under each first turn (1 step).
    assert s.env_forks == {"replay": 3} and s.env_replayed_steps == 2

    _Replica.how, _Replica.first_history = "step_differs", None  # forks whose replay diverges are dropped
    tree, s, _ = sample_with(_Replica, script=then_rambles, max_depth=4)
    assert s.env_diverged > 0 and len(tree.leaves()) + s.env_dropped == 4 == s.env_episodes + s.env_dropped
    assert [leaf.env_reward for leaf in tree.leaves()] == [1.0] * len(tree.leaves())

    class Unrewarded(Notebook):
        reward = Env.reward

    tree, s, _ = sample_with(Unrewarded, script=then_rambles, max_depth=4)
    assert [leaf.env_reward for leaf in tree.leaves()] == [None] * 4
    assert (s.env_episodes, s.env_episode_steps) == (4, 4)


def test_a_step_that_kept_no_episode_names_the_budget_and_what_else_dropped_them():
    from arbor.config import RolloutConfig
    from arbor.rollout.episodes import EpisodesDroppedError, check_some_kept
    from arbor.rollout.sample_stats import SampleStats

    cfg = RolloutConfig(segment_tokens=8, max_depth=12)
    check_some_kept([SampleStats()], cfg, "step 3", "train on")  # nothing dropped: nothing to say
    budget = ("environment's messages did not fit the response budget (rollout.segment_tokens × rollout.max_depth "
              "= 8 × 12 = 96 tokens; their messages count against it)")
    with pytest.raises(EpisodesDroppedError) as e:
        check_some_kept([SampleStats(env_dropped=2, dropped_too_long=2)], cfg, "step 3", "train on")
    assert str(e.value) == (f"step 3: all 2 episodes were dropped, 2 of them because an agent's or {budget} "
                            "(env/errors, env/timeouts): nothing is left to train on")
    with pytest.raises(EpisodesDroppedError) as e:
        check_some_kept([SampleStats(env_dropped=3, dropped_too_long=1), SampleStats(env_dropped=2)], cfg, "eval",
                        "score")
    assert str(e.value) == (f"eval: all 5 episodes were dropped, 1 of them because an agent's or {budget}; 4 by "
                            "diverged replays or unscored timeouts (env/errors, env/timeouts): nothing is left to score")


def test_what_sampling_episodes_needs_is_named():
    from arbor.config import DataConfig
    from arbor.errors import EpisodeFailure
    from arbor.rollout.episodes import EpisodeStartError, episode_setup, run_episodes

    setup = EpisodeSetup(EnvSource(Notebook, "rollout.env", "Notebook", True), render)
    with pytest.raises(ValueError, match=r"^sampling takes an agent or an environment, not both$"):
        episode_setup(_NeverAsked(), render, setup, str, no_prompts=False)
    with pytest.raises(ValueError, match=r"^sampling with an environment needs decode$"):
        episode_setup(None, None, setup, None, no_prompts=False)
    for env in (None, setup):  # no prompts: only an environment whose reset gives them will do
        with pytest.raises(ValueError, match=r"^sampling needs prompts, unless an environment's reset gives them "
                                             r"\(EpisodeSetup\.prompt\)$"):
            episode_setup(None, None, env, str, no_prompts=True)
    assert episode_setup(None, None, setup, str, no_prompts=False) is setup
    with pytest.raises(ValueError, match=r"^sampling needs prompts, unless an environment's reset gives them"):
        asyncio.run(sample_trees(ScriptedEngine(8), [{"id": 0}], None, cfg_of()))  # neither prompts nor env
    run = run_episodes(setup.source, object(), DataConfig(max_prompt_tokens=77), needs_reward=True)
    assert (run.needs_reward, run.max_prompt_tokens, run.source) == (True, 77, setup.source)
    failure = EpisodeFailure("env_error", "3", 0, "reset raised KeyError: 'x'")
    assert str(EpisodeStartError(failure)) == failure.describe() == "problem 3, turn 0: env_error: reset raised KeyError: 'x'"


def test_a_tree_that_fails_stops_the_others_and_their_instances_are_closed_before_the_error_goes_up():
    # Tree 1's engine call fails while tree 0 waits for its own answer: sample_trees cancels tree 0,
    # waits until its environment is closed, and only then raises tree 1's error.
    class Failing(ScriptedEngine):
        async def generate_many(self, requests):
            if requests[0].affinity_key == "tree-1":
                await tree_0_waits.wait()
                raise RuntimeError("the server went away")
            tree_0_waits.set()
            await asyncio.Event().wait()  # tree 0's answer never comes

    async def main() -> tuple[int, int]:
        with pytest.raises(RuntimeError, match="^the server went away$"):
            await sample_trees(Failing(8, turn), [{"id": 0}, {"id": 1}], None, cfg_of(width=4, segment_tokens=8),
                               eos_token_ids=[EOS], decode=lambda ids: " ".join(map(str, ids)), env=setup, seed=5,
                               across_trees=False)
        return len(Registry.opened), len(Registry.closed)  # as the error reaches the caller

    class SlowClose(Notebook):  # closing takes a while: the error must wait for it
        def close(self) -> None:
            time.sleep(0.2)
            super().close()

    Registry.reset()
    source = EnvSource(SlowClose, "rollout.env", "SlowClose", gives_reward(SlowClose()))
    Registry.reset()
    setup = EpisodeSetup(source, render, prompt=lambda messages, tools=None: list(PROMPT))
    tree_0_waits = asyncio.Event()
    assert asyncio.run(main()) == (2, 2)


def test_the_reset_seed_is_the_tree_s_own_and_no_request_s():
    # The same for every instance of a tree (replays rebuild the same episode), another for each
    # tree and step, and shared with no request of the tree (node ids ≥ 0, forks counted from 0).
    from arbor.rollout.budget import request_seed
    from arbor.rollout.episodes import reset_seed

    seeds = {(s, t): reset_seed(s, t) for s in range(3) for t in range(3)}
    assert len(set(seeds.values())) == 9 and reset_seed(1, 2) == seeds[1, 2]
    for (s, t), seed in seeds.items():
        assert seed not in {request_seed(s, t, node, fork) for node in range(64) for fork in range(4)}


class _Replica(Notebook):
    """A Notebook whose instances after the tree's first (the replays building new branches) go
    wrong as ``how`` says, on their reset or on replaying the first instance's first step."""

    how = ""
    release = threading.Event()
    first_history: list | None = None

    def __init__(self) -> None:
        self.replica, self.steps = bool(Registry.opened), 0
        if self.replica and self.how == "build_hangs":
            _Replica.release.wait(10)
        super().__init__()

    def reset(self, problem, seed):
        messages = super().reset(problem, seed)
        if self.replica and self.how == "reset_raises":
            raise RuntimeError("gone")
        if self.replica and self.how == "reset_hangs":
            _Replica.release.wait(10)
        return [{"role": "user", "content": "another"}] if self.replica and self.how == "reset_differs" else messages

    def step(self, history):
        self.steps += 1
        if not self.replica and self.steps == 1:
            _Replica.first_history = history
        if self.replica and history == _Replica.first_history:
            if self.how == "step_hangs":
                _Replica.release.wait(10)
            if self.how == "step_raises":
                raise RuntimeError("gone")
            if self.how == "step_differs":
                return Step([{"role": "tool", "content": "other"}])
        return super().step(history)


class _Copies(CopyNotebook):
    how = ""

    def copy(self):
        if self.how == "copy_raises":
            raise RuntimeError("no copy")
        if self.how == "copy_self":
            return self
        if self.how == "copy_hangs":
            _Replica.release.wait(10)
        if self.how == "snapshot_raises" and self.notes:  # the copy kept of a state after a step
            raise RuntimeError("no copy")
        return super().copy()


@pytest.mark.parametrize("cls,how,failure,diverged", [
    (_Replica, "build_hangs", "env_timeout: building for a new branch ran past its time limit", None),
    (_Replica, "reset_hangs", "env_timeout: reset for a new branch ran past its time limit", None),
    (_Replica, "step_hangs", "env_timeout: step for a new branch ran past its time limit", None),
    (_Replica, "reset_differs", None, "turn 0: reset returned [{'role': 'user', 'content': 'another'}] where the "
                                      "tree's prompt came from [{'role': 'user', 'content': 'problem 0 seed "),
    (_Replica, "reset_raises", None, "turn 0: reset raised RuntimeError: gone (it did not when recorded)"),
    (_Replica, "step_raises", None, "turn 1: step raised RuntimeError: gone (it did not when recorded)"),
    (_Replica, "step_differs", None, "turn 1: step returned Step(messages=[{'role': 'tool', 'content': 'other'}], "
                                     "done=False) where the recorded episode had Step(messages=[{'role': 'tool'"),
    (_Copies, "copy_raises", "env_error: copy raised RuntimeError: no copy", None),
    (_Copies, "copy_self", "env_error: _Copies.copy() returned the instance itself: branches would share its state "
                           "(return an independent copy)", None),
    (_Copies, "copy_hangs", "env_timeout: copy for a new branch ran past its time limit", None),
    (_Copies, "snapshot_raises", "env_error: copy raised RuntimeError: no copy", None),
])
def test_a_branch_whose_instance_cannot_be_made_does_not_start_naming_why(cls, how, failure, diverged, caplog):
    """A new branch's instance comes from a replay (build, reset, the recorded steps) or a copy;
    when that fails or runs past its limit the branch is dropped or never starts: a failure with
    what went wrong, or a diverged replay (counted, logged with the turn and both values); the
    other branches go on and every instance is closed."""
    caplog.set_level(logging.INFO)
    cls.how, _Replica.release, _Replica.first_history = how, threading.Event(), None
    try:
        tree, s, _ = sample_with(cls, env_timeout_s=0.3)
    finally:
        _Replica.release.set()
    messages = [r.getMessage() for r in caplog.records]
    # Only a call still running past its limit holds an instance when the tree is done.
    assert s.env_live == (len(s.failures) if how.endswith("hangs") else 0)
    if failure is not None:
        assert s.failures and {f.describe() for f in s.failures} == {f"problem 0: {failure}"}
        # A copy that fails leaves its branch unstarted; a failed snapshot after a step drops one.
        assert s.unstarted == (len(s.failures) if how.startswith("copy") else 0)
        assert s.env_timeouts == (len(s.failures) if "timeout" in failure else 0) and s.env_diverged == 0
        assert f"problem 0: {failure}: that branch is dropped or not started" in messages
    else:
        assert not s.failures and s.env_diverged == s.env_errors == s.env_dropped > 0
        lines = [m for m in messages if m.startswith("problem 0: replaying the environment for a new branch "
                                                     f"diverged at {diverged}")]
        assert len(lines) == s.env_diverged
        assert lines[0].endswith("Hidden non-determinism (a global RNG, a clock?) makes replays differ; the branch is "
                                 "dropped before it samples (env/errors). Seed every source of randomness from "
                                 "reset's seed, or fork by 'copy'")
    assert len(tree.leaves()) < 4 and all(leaf.finish_reason != "failed" for leaf in tree.leaves())
    assert instances_all_closed(opened=None)


def test_messages_are_checked_naming_where_and_what():
    from arbor.rollout.env_forks import _SHOW, _clip, check_messages

    where = "problem 'p3', turn 2"
    ok = [{"role": "tool", "content": "4", "error": False}]
    assert check_messages(ok, where, False, allow_empty=False) == ok
    assert check_messages([], where, True, allow_empty=True) == []
    for value, agent, message in [
        ("hi", False, "an environment must give a list of chat messages (dicts), got str"),
        ([1], True, "an agent must give a list of chat messages (dicts), got list"),
        ([], False, "an environment gave no messages to start the episode with"),
        ([{"role": "tool"}], False, "an environment message needs a 'role' and a 'content' string, got {'role': 'tool'}"),
        ([{"content": "4"}], True, "an agent message needs a 'role' and a 'content' string, got {'content': '4'}"),
        ([{"role": "tool", "content": "4", "error": "yes"}], False,
         "an environment message's 'error' must be true or false (a failed tool call), got 'yes'"),
    ]:
        with pytest.raises(TypeError) as e:
            check_messages(value, where, agent, allow_empty=False)
        assert str(e.value) == f"{where}: {message}"
    # Long values are shown by their two ends.
    assert _clip("a" * (_SHOW - 2)) == repr("a" * (_SHOW - 2))  # exactly _SHOW characters with its quotes
    long = "".join(chr(65 + i % 26) for i in range(400))
    assert _clip(long) == repr(long)[:_SHOW // 2] + "…" + repr(long)[-_SHOW // 2:]
    assert len(_clip(long)) == _SHOW + 1


def test_every_replayed_instance_is_counted_as_a_fork():
    (tree,), (s,) = sample(Notebook, width=4)  # each instance after the tree's first was built by a replay
    assert len(tree.leaves()) == 4 and len(Registry.opened) > 2 and s.env_forks == {"replay": len(Registry.opened) - 1}


def test_a_problem_without_an_id_is_named_so():
    class Anonymous(_Copies):
        def reset(self, problem, seed):
            return [{"role": "user", "content": problem["question"]}]

    for how in ("copy_raises", "copy_hangs"):
        _Copies.how, _Replica.release = how, threading.Event()
        try:
            _, s, _ = sample_with(Anonymous, problems=({"question": "?"},), env_timeout_s=0.3)
        finally:
            _Replica.release.set()
        assert s.failures and {(f.problem_id, f.message.split(" ")[0]) for f in s.failures} == {("'<no id>'", "copy")}
