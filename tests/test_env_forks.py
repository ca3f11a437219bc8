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

from arbor import Env
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
    trees, _ = sample(Notebook, problems=2)
    seeds = {(o.notes[0] if o.notes else None, o.seed) for o in Registry.opened}
    assert len({seed for _, seed in seeds}) == 2  # one reset seed per tree, shared by its replays


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
        def __init__(self) -> None:
            super().__init__()
            peak[0] = max(peak[0], len(Registry.opened) - len(Registry.closed))

    trees, stats = sample(Counted, problems=3, width=4, max_live_envs=2)
    assert peak[0] <= 2 and all(len(t.leaves()) == 4 for t in trees)
    for tree in trees:
        check_isolation(tree)
    assert len(Registry.closed) == len(Registry.opened)
    # A copy-forked tree keeps a copy of every state: a cap below what one tree needs cannot be met.
    with pytest.raises(LiveEnvsError, match=r"rollout.max_live_envs=1: every tree being sampled waits"):
        sample(CopyNotebook, width=4, max_live_envs=1)
    assert len(Registry.closed) == len(Registry.opened)  # what was open is closed before the error goes up


@pytest.mark.parametrize("cls", [Notebook, CopyNotebook, NoForkNotebook])
def test_entropy_forks_inside_later_turns_get_the_environment_of_that_turn(cls):
    (tree,), (s,) = sample(cls, width=6, fork_at="entropy", entropy_init=2, entropy_forks=1,
                           logprob=later_turns_score_higher)
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


def test_forks_that_never_step_an_environment_without_a_reward_build_no_instance():
    class Unrewarded(Notebook):
        reward = Env.reward  # gives none

    def rambles(request, j, depth):  # never ends a turn: every path runs to the response budget
        return fresh(request, j), "length"

    (tree,), (s,) = sample(Unrewarded, script=rambles, max_depth=3)
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
        return messages


@pytest.mark.parametrize("agent", [False, True], ids=["env", "agent"])
@pytest.mark.parametrize("stage,kind,message", [
    ("build", "error", "building raised RuntimeError: no table"),
    ("build_hang", "timeout", "building ran past rollout.{who}_timeout_s"),
    ("reset", "error", "reset raised RuntimeError: no deck"),
    ("reset_hang", "timeout", "reset ran past rollout.{who}_timeout_s: the tree has no prompt"),
    ("messages", "error", "problem 0: an {whom} must give a list of chat messages (dicts), got str"),
    ("tools", "error", "reset left tools='search': it must be a list of tool dicts"),
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
    assert tree.leaves() == [] and s.unstarted == 1
    (failure,) = s.failures
    assert (failure.kind, failure.problem_id, failure.turn) == (f"{who}_{kind}", "0", None if agent else 0)
    assert failure.message.startswith(message.format(who=who, whom="agent" if agent else "environment")), failure
    assert f"{failure.describe()}: the tree is dropped" in caplog.text
    built = 0 if stage == "build" else 1  # a build past the limit finishes later and is closed then
    deadline = time.monotonic() + 10
    while min(len(Registry.closed), len(Registry.opened)) < built and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(Registry.closed) == len(Registry.opened) == built
