"""TreePO sampler with an agent: multi-turn episodes at the token level.

A token-level agent (tool turns of fixed ids, decode = ids joined by spaces) and the
scripted engine of tests/test_sampler.py pin the response budget, tool turns, the history
the agent sees, timeouts and path scores across tool turns; tests/test_agent_sampling.py
runs the same paths with a real chat template.
"""

from __future__ import annotations

import logging

import pytest
from test_sampler import EOS, PROMPT, ScriptedEngine, cfg_of, fresh, paths_per_round, run

from arbor.tree import RolloutTree

TOOL = 900  # tool-turn ids are TOOL, TOOL + 1, ...


class TokenAgent:
    """Tool turns of ``tool_len`` ids after the first ``turns`` model turns; records histories.
    ``hold``: an event the first step waits on (to run past the agent timeout)."""

    def __init__(self, turns: int, tool_len: int, error: bool = False, hold=None) -> None:
        self.turns, self.tool_len, self.error, self.hold = turns, tool_len, error, hold
        self.histories: list[list[dict]] = []
        self.problems: list = []  # what start and step were given

    def start(self, problem):
        self.problems.append(problem)
        return [{"role": "user", "content": "q"}]

    def step(self, problem, history):
        if self.hold is not None:
            self.hold.wait(10)
        self.problems.append(problem)
        self.histories.append(history)
        if sum(m["role"] == "tool" for m in history) >= self.turns:
            return None
        return [{"role": "tool", "content": f"out{len(self.histories)}", "error": self.error}]

    def render(self, messages):
        return [TOOL + k for k in range(self.tool_len)] * len(messages)


def run_episode(agent: TokenAgent, turns: list[tuple[list[int], str]], **cfg):
    """One path (width 1): model turn k is ``turns[k]``; a "length" turn fills max_new_tokens."""
    script = iter(turns)

    def model(request, j, depth):
        ids, reason = next(script)
        return (fresh(request, j) if reason == "length" else ids), reason

    engine = ScriptedEngine(4, model)
    trees, stats = run(engine, cfg_of(width=1, branch=1, **cfg), eos_token_ids=[EOS], agent=agent,
                       render=agent.render, decode=lambda ids: " ".join(map(str, ids)))
    return trees[0], stats[0], [r.sampling.max_new_tokens for r in engine.calls]


def test_a_tool_turn_leaving_less_than_a_segment_caps_the_next_one() -> None:
    # Budget 4 · 3 = 12. Turn 1: [11, 12, EOS] (3 ids); the tool adds 6 → 9, room 3 < 4:
    # the next segment asks for 3 tokens, not 4, and the episode ends at exactly 12.
    agent = TokenAgent(turns=1, tool_len=6)
    tree, stats, asked = run_episode(agent, [([11, 12, EOS], "stop"), ([], "length")], max_depth=3)
    (leaf,) = tree.leaves()
    assert asked == [4, 3]
    assert leaf.end == 12 and leaf.finish_reason == "max_length"
    model, tool, last = tree.path(leaf)
    assert tool.token_ids == [TOOL + k for k in range(6)] and tool.loss_mask == [0] * 6
    assert tool.logprobs == [0.0] * 6 and tool.finish_reason is None
    assert stats.tool_turns == 1 and stats.tool_errors == 0 and stats.finish_reasons == {"max_length": 1}


def test_agent_messages_that_do_not_fit_the_budget_drop_the_branch(caplog) -> None:
    # rollout.env_overflow: drop. Turn 1 ends at 4 of 12; a 10-id tool turn does not fit the 8
    # left: not cut, but the branch is counted, logged and never trained on (dropped).
    caplog.set_level(logging.INFO)
    agent = TokenAgent(turns=1, tool_len=10, error=True)
    tree, stats, asked = run_episode(agent, [([11, 12, 13, EOS], "stop")], max_depth=3, env_overflow="drop")
    assert tree.leaves() == [] and tree.num_nodes == 0 and asked == [4]
    assert stats.env_errors == 1 and stats.env_dropped == 1 and stats.tool_turns == 0 and not stats.failures
    assert stats.shortfall_reason.startswith("environment failures stopped branches (1 dropped")
    assert ("problem 0: the agent's messages of turn 1 are 10 tokens, but the episode has 8 left of its response "
            "budget (rollout.segment_tokens × rollout.max_depth = 12): dropped (rollout.env_overflow)") in caplog.text
    # Messages that fill the room exactly leave the model no token to answer with: the same.
    agent = TokenAgent(turns=1, tool_len=8)
    tree, stats, _ = run_episode(agent, [([11, 12, 13, EOS], "stop")], max_depth=3, env_overflow="drop")
    assert tree.leaves() == [] and stats.env_errors == 1
    # A model turn that ends exactly at the budget leaves no room: an agent that goes on is cut off too.
    agent = TokenAgent(turns=1, tool_len=2)
    tree, stats, _ = run_episode(agent, [([11, 12, 13, EOS], "stop")], max_depth=1, env_overflow="drop")
    assert tree.leaves() == [] and stats.env_errors == 1 and len(agent.histories) == 1
    # ... while an agent that ends the episode there is fine.
    agent = TokenAgent(turns=0, tool_len=2)
    tree, stats, _ = run_episode(agent, [([11, 12, 13, EOS], "stop")], max_depth=1, env_overflow="drop")
    (leaf,) = tree.leaves()
    assert leaf.end == 4 and leaf.finish_reason == "stop" and stats.env_errors == 0


def test_agent_messages_that_do_not_fit_the_budget_end_the_episode_unfinished() -> None:
    # rollout.env_overflow: unfinished (the default): the same episode ends at its model turn, kept
    # (finish reason message_too_long) and counted; the message is never appended.
    agent = TokenAgent(turns=1, tool_len=10)
    tree, stats, asked = run_episode(agent, [([11, 12, 13, EOS], "stop")], max_depth=3)
    (leaf,) = tree.leaves()
    assert leaf.token_ids == [11, 12, 13, EOS] and leaf.finish_reason == "message_too_long" and asked == [4]
    assert stats.overflow_ended == 1 and stats.env_dropped == stats.env_errors == 0 and stats.tool_turns == 0


def test_the_agent_sees_decoded_turns_without_their_stop_token() -> None:
    agent = TokenAgent(turns=2, tool_len=1)
    turns = [([11, 12, EOS], "stop"), ([21, EOS], "stop"), ([31, 32, EOS], "stop")]
    tree, stats, _ = run_episode(agent, turns, max_depth=8)
    assert agent.histories[-1] == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "11 12"},
        {"role": "tool", "content": "out1", "error": False},
        {"role": "assistant", "content": "21"},
        {"role": "tool", "content": "out2", "error": False},
        {"role": "assistant", "content": "31 32"},
    ]
    # start once per tree (the episode's reset: its history starts from it), step once per model turn
    assert agent.problems == [{"id": 0}] * 4
    (leaf,) = tree.leaves()
    assert leaf.finish_reason == "stop" and leaf.end == 3 + 1 + 2 + 1 + 3
    assert stats.tool_turns == 2 and tree.response_loss_mask(leaf) == [1, 1, 1, 0, 1, 1, 0, 1, 1, 1]


def test_an_agent_step_past_its_timeout_drops_the_episode(caplog) -> None:
    import threading

    caplog.set_level(logging.INFO)
    hold = threading.Event()
    agent = TokenAgent(turns=1, tool_len=2, hold=hold)
    engine = ScriptedEngine(4, lambda request, j, depth: ([11, EOS], "stop"))
    try:
        trees, stats = run(engine, cfg_of(mode="independent", width=2, agent_timeout_s=0.2),
                           prompts=[PROMPT], eos_token_ids=[EOS], agent=agent, render=agent.render,
                           decode=str)
        # The abandoned steps still run, in daemon threads: a hung tool never keeps the process alive.
        held = [t for t in threading.enumerate() if t.name.startswith("agent-step-")]
        assert len(held) == 2 and all(t.daemon for t in held)
    finally:
        hold.set()
    assert trees[0].leaves() == [] and stats[0].env_dropped == 2  # a timeout is a failure: dropped
    assert stats[0].agent_timeouts == 2 and stats[0].tool_turns == 0
    assert [f.describe() for f in stats[0].failures] == [
        "problem 0: agent_timeout: agent.step ran past rollout.agent_timeout_s=0.2s (the call is left running "
        "in its thread)"] * 2
    assert "problem 0: agent_timeout: agent.step ran past rollout.agent_timeout_s=0.2s" in caplog.text


def test_an_agent_message_whose_error_is_not_a_bool_drops_the_branch_naming_the_problem() -> None:
    agent = TokenAgent(turns=1, tool_len=2, error="yes")  # type: ignore[arg-type]
    tree, stats, _ = run_episode(agent, [([11, EOS], "stop"), ([12, EOS], "stop")])
    assert tree.leaves() == [] and stats.env_dropped == 1
    assert [f.describe() for f in stats.failures] == [
        "problem 0: agent_error: problem 0: an agent message's 'error' must be true or false (a failed tool "
        "call), got 'yes'"]


def test_an_agent_needs_render_and_decode() -> None:
    agent = TokenAgent(turns=1, tool_len=1)
    with pytest.raises(ValueError, match=r"^sampling with an agent needs render \(messages -> ids\) and decode$"):
        run(ScriptedEngine(4), cfg_of(), agent=agent, render=agent.render)
    with pytest.raises(ValueError, match="^rollout.mode must be 'tree' or 'independent', got 'beam'$"):
        run(ScriptedEngine(4), cfg_of(mode="beam"))
    with pytest.raises(ValueError, match="needs render"):
        run(ScriptedEngine(4), cfg_of(), agent=agent, decode=str)



def test_tool_errors_add_up_and_a_tool_turn_must_leave_the_model_a_token() -> None:
    agent = TokenAgent(turns=2, tool_len=1, error=True)
    _, stats, _ = run_episode(agent, [([11, EOS], "stop")] * 3, max_depth=8)
    assert stats.tool_errors == 2 and stats.tool_turns == 2
    # The model turn ends 2 short of the budget (4 · 1): a 1-id tool turn fits, the model gets 1 token.
    agent = TokenAgent(turns=1, tool_len=1)
    tree, stats, asked = run_episode(agent, [([11, EOS], "stop"), ([], "length")], max_depth=1)
    (leaf,) = tree.leaves()
    assert asked == [4, 1] and leaf.end == 4 and leaf.finish_reason == "max_length" and stats.env_errors == 0


def test_paths_after_tool_turns_keep_their_model_turn_scores() -> None:
    # Tree mode, logprob assignment: two root copies end their first turns with mean
    # log-probs −1 and −9 and get a tool turn each; the tool turns are not sampled, so the
    # next split uses −1 and −9: softmax([−0.5, −4.5]) → [3, 1] of 4 paths.
    agent = TokenAgent(turns=1, tool_len=1)

    def script(request, j, depth):
        return ([11, EOS], "stop") if TOOL not in request.input_ids else (fresh(request, j), "length")

    def logprob(request, j, depth):
        return (-1.0 if j == 0 else -9.0) if TOOL not in request.input_ids else -0.5

    engine = ScriptedEngine(4, script, logprob)
    run(engine, cfg_of(width=8, max_depth=3, branch_assignment="logprob"), eos_token_ids=[EOS],
        agent=agent, render=agent.render, decode=str)
    assert [r.sampling.n for r in engine.rounds[1]] == [3, 1]


def test_episodes_ended_by_the_agent_count_toward_the_width() -> None:
    # Tree mode, w = 4, b = 2, an agent that never calls a tool: round 1's 2 turns end their
    # episodes (2 of 4); the fallback restarts b = 2 copies from the root, then 4 of 4.
    agent = TokenAgent(turns=0, tool_len=1)
    engine = ScriptedEngine(4, lambda request, j, depth: ([11, EOS], "stop"))
    trees, stats = run(engine, cfg_of(width=4, max_depth=2), eos_token_ids=[EOS], agent=agent,
                       render=agent.render, decode=str)
    assert paths_per_round(engine) == [2, 2] and len(trees[0].leaves()) == 4
    assert len(agent.histories) == 4 and stats[0].tool_turns == 0


def test_independent_episodes_go_on_one_request_each() -> None:
    agent = TokenAgent(turns=1, tool_len=1)
    turns = iter([([11, EOS], "stop"), ([12, EOS], "stop")] * 2)
    engine = ScriptedEngine(4, lambda request, j, depth: next(turns))
    trees, stats = run(engine, cfg_of(mode="independent", width=2, max_depth=4), eos_token_ids=[EOS],
                       agent=agent, render=agent.render, decode=str)
    assert [r.sampling.n for r in engine.calls] == [2, 1, 1]
    assert len(trees[0].leaves()) == 2 and stats[0].tool_turns == 2


def test_a_model_turn_over_two_segments_is_one_assistant_message() -> None:
    agent = TokenAgent(turns=1, tool_len=1)
    tree, _, _ = run_episode(agent, [([], "length"), ([21, EOS], "stop"), ([], "stop")], max_depth=8)
    first, second = tree.path(tree.leaves()[0])[:2]
    assert agent.histories[0][-1] == {"role": "assistant", "content": " ".join(map(str, first.token_ids + [21]))}
    # An empty model turn ending on a stop token is an empty message.
    assert agent.histories[1][-1] == {"role": "assistant", "content": ""}


def test_an_agent_step_that_raises_drops_its_branch_with_its_message() -> None:
    class Broken(TokenAgent):
        def step(self, problem, history):
            raise RuntimeError("the tool server is down")

    agent = Broken(turns=1, tool_len=1)
    tree, stats, _ = run_episode(agent, [([11, EOS], "stop")])
    assert tree.leaves() == [] and stats.env_dropped == 1
    assert [f.describe() for f in stats.failures] == [
        "problem 0: agent_error: step raised RuntimeError: the tool server is down"]


def test_path_scores_of_a_fallback_cut_skip_tool_turns() -> None:
    from arbor.rollout.env_calls import EnvCalls
    from arbor.rollout.environments import agent_source
    from arbor.rollout.episodes import EpisodeSetup, TreeEpisodes
    from arbor.rollout.sample_stats import SampleStats
    from arbor.rollout.sampler import _TreeSampler

    setup = EpisodeSetup(agent_source(TokenAgent(turns=1, tool_len=1)), lambda messages: [TOOL])
    episodes = TreeEpisodes(setup, EnvCalls(1.0), cfg_of(), SampleStats(), str, [EOS], index=0)
    sampler = _TreeSampler(ScriptedEngine(4), cfg_of(), 0, [EOS], 0, None, str, episodes)
    tree = RolloutTree(PROMPT)
    a = tree.add_segment(tree.root, [11, 12], [-1.0, -3.0])
    tool = tree.add_segment(a, [TOOL], [0.0], [0])
    episodes.messages[tool.id] = [{"role": "tool", "content": "x"}]
    b = tree.add_segment(tool, [13], [-0.5])
    root_path, a_path, tool_path, b_path = (sampler._path_at(tree, n) for n in (tree.root, a, tool, b))
    assert (root_path.logprob, root_path.last_logprob) == (0.0, 0.0)
    assert (a_path.logprob, a_path.last_logprob) == (-4.0, -2.0)
    assert (tool_path.node, tool_path.logprob, tool_path.last_logprob) == (tool, -4.0, -2.0)  # a's mean
    assert (b_path.logprob, b_path.last_logprob) == (-4.5, -0.5)


def test_fallback_cuts_never_fall_between_a_model_turn_and_its_tool_turn() -> None:
    # root → s (a model turn cut by its segment) → a (its end, "stop") → tool turn → b (the finished
    # leaf): a fallback may restart at the root, at s or after the tool turn, never at a (the agent
    # would not have answered it). Over 40 draws every allowed cut is chosen, and nothing else.
    import random

    from arbor.rollout.env_calls import EnvCalls
    from arbor.rollout.environments import agent_source
    from arbor.rollout.episodes import EpisodeSetup, TreeEpisodes
    from arbor.rollout.sample_stats import SampleStats
    from arbor.rollout.sampler import _TreeSampler

    setup = EpisodeSetup(agent_source(TokenAgent(turns=1, tool_len=1)), lambda messages: [TOOL])
    episodes = TreeEpisodes(setup, EnvCalls(1.0), cfg_of(), SampleStats(), str, [EOS], index=0)
    sampler = _TreeSampler(ScriptedEngine(4), cfg_of(width=4), 0, [EOS], 0, None, str, episodes)
    tree = RolloutTree(PROMPT)
    s = tree.add_segment(tree.root, [11, 12, 13, 14], [-0.5] * 4)
    s.finish_reason = "length"
    a = tree.add_segment(s, [15, EOS], [-0.5] * 2)
    a.finish_reason = "stop"
    tool = tree.add_segment(a, [TOOL], [0.0], [0])
    tree.add_segment(tool, [16, EOS], [-0.5] * 2).finish_reason = "stop"
    chosen = set()
    for k in range(40):
        sampler.rng = random.Random(k)
        paths, copies = sampler._fallback(tree, 2)
        assert copies == [2]  # one source, the whole budget
        chosen |= {p.node for p in paths}
    assert chosen == {tree.root, s, tool}


def test_a_tree_short_of_its_width_says_why() -> None:
    from arbor.errors import EpisodeFailure
    from arbor.rollout.sample_stats import SampleStats
    from arbor.rollout.sampler import _TreeSampler

    def reason(leaves: int, **counts) -> str | None:
        tree = RolloutTree(PROMPT)
        for k in range(leaves):
            tree.add_segment(tree.root, [11 + k, EOS], [-0.5, -0.5]).finish_reason = "stop"
        stats = SampleStats(**counts) if counts else None  # without: the sampler's own
        return _TreeSampler(ScriptedEngine(4), cfg_of(width=4), 0, [EOS], 0, None, None,
                            stats=stats).done(tree).shortfall_reason

    env = "env/errors, env/timeouts, failures/*)"
    failure = EpisodeFailure("env_error", "0", 1, "step raised KeyError: 'x'")
    assert reason(2, env_dropped=1) == f"environment failures stopped branches (1 dropped, 0 errors, 0 timeouts, " \
                                       f"0 failures: {env}"
    assert reason(3, env_errors=1, env_timeouts=2) == ("environment failures stopped branches (0 dropped, 1 errors, "
                                                       f"2 timeouts, 0 failures: {env}")
    assert reason(0, failures=[failure]) == ("environment failures stopped branches (0 dropped, 0 errors, 0 timeouts, "
                                             f"1 failures: {env}")
    assert reason(2) == "the engine ended every path early (stop: 2)"
    assert reason(0) == "the engine ended every path early (no leaves)"
    assert reason(4, env_dropped=2) is None  # the width was reached despite the failures: nothing is missing
    assert reason(4) is None
    assert reason(1, env_dropped=1, shortfall_reason="no active path left and fallback is disabled") == (
        "no active path left and fallback is disabled")  # the first reason found stays


def test_a_daemon_thread_hands_back_what_its_function_raised() -> None:
    """An agent step that raises reaches its caller as that exception, at once (not as a hang
    that only the step's time limit would end)."""
    import asyncio

    from arbor.rollout.agent_thread import in_daemon_thread

    def step(x: int) -> int:
        if x < 0:
            raise ValueError(f"bad input {x}")
        return 2 * x

    async def both() -> int:
        with pytest.raises(ValueError, match="bad input -1"):
            await asyncio.wait_for(in_daemon_thread(step, -1), timeout=5)
        return await asyncio.wait_for(in_daemon_thread(step, 21), timeout=5)

    assert asyncio.run(both()) == 42
