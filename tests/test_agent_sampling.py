"""Multi-turn episodes: a scripted engine and agent, 3 model turns with 2 tool turns, branching.

The tokenizer is the quickstart model's (ChatML): what the sampler appends after each
model turn must be exactly what the chat template renders for the whole conversation.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from agent_fixtures import HANG_S, PROBLEMS, TOOL_TURNS, HangingAgent, ScriptedAgent, ScriptedEngine
from transformers import AutoModelForCausalLM, AutoTokenizer

from arbor.config import RolloutConfig
from arbor.config_load import load_config
from arbor.errors import ConfigError, EmptyStepsError
from arbor.rollout.agents import continuation_ids
from arbor.rollout.episodes import EpisodesDroppedError
from arbor.rollout.sampler import sample_trees
from arbor.train.packed_loss import policy_loss

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-arith"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL)


def sample(tokenizer, width=4, mode="tree", agent=None, agent_timeout_s=60.0, env_overflow="unfinished"):
    agent, engine = agent or ScriptedAgent(), ScriptedEngine(tokenizer)
    prompts = [
        tokenizer.apply_chat_template(agent.start(p), add_generation_prompt=True, tokenize=True)["input_ids"]
        for p in PROBLEMS
    ]
    cfg = RolloutConfig(
        mode=mode, width=width, branch=2, segment_tokens=64, max_depth=12, agent_timeout_s=agent_timeout_s,
        env_overflow=env_overflow,
    )
    trees, stats = asyncio.run(sample_trees(
        engine, PROBLEMS, prompts, cfg, eos_token_ids=[tokenizer.eos_token_id], seed=3, agent=agent,
        render=functools.partial(continuation_ids, tokenizer), decode=lambda ids: tokenizer.decode(ids),
    ))
    return trees, stats, agent, engine


def test_three_turn_episodes_branch_at_decision_points(tokenizer):
    trees, stats, agent, engine = sample(tokenizer)
    for tree, s in zip(trees, stats):
        leaves = tree.leaves()
        assert len(leaves) == 4 and s.shortfall_reason is None and s.tool_turns >= TOOL_TURNS
        # A stateless agent is an environment that never needs a real fork; nothing is left open.
        assert s.env_forks == {} and s.env_replayed_steps == 0 and s.env_live == 0
        # Forks happen after tool results (decision points), not only at the root.
        assert any(len(n.children) > 1 and n.loss_mask is not None for n in tree.nodes())
        for leaf in leaves:
            path = tree.path(leaf)
            assert leaf.finish_reason == "stop" and len(path) == 2 * TOOL_TURNS + 1  # depth counts turns
            model_turns = [n for n in path if n.loss_mask is None]
            tool_turns = [n for n in path if n.loss_mask is not None]
            # Model turns are exactly what the engine produced; tool turns are untrained.
            assert all(n.token_ids in engine.outputs and n.logprobs is not None for n in model_turns)
            assert all(set(n.loss_mask) == {0} for n in tool_turns)
            assert tree.response_loss_mask(leaf) == [m for n in path for m in (n.loss_mask or [1] * len(n.token_ids))]


def test_appended_ids_equal_the_chat_template_of_the_whole_conversation(tokenizer):
    trees, _, agent, _ = sample(tokenizer)
    finals = [h for h in agent.histories if sum(m["role"] == "tool" for m in h) == TOOL_TURNS]
    assert finals  # the agent saw every completed episode
    for tree in trees:
        for leaf in tree.leaves():
            full = tree.full_ids(leaf)
            history = next(h for h in finals if tokenizer.apply_chat_template(
                h, tokenize=True)["input_ids"][: len(full)] == full)
            rendered = tokenizer.apply_chat_template(history, tokenize=True)["input_ids"]
            # The template closes the last turn with "<|im_end|>\n"; the model stopped at <|im_end|>.
            assert full == rendered[: len(full)] and tokenizer.decode(rendered[len(full):]) == "\n"


def test_tree_equals_linear_gradients_on_agent_trees(tokenizer):
    trees, _, _, _ = sample(tokenizer)
    rng = random.Random(0)
    advantages = [[rng.gauss(0, 1) for _ in t.leaves()] for t in trees]
    grads = {}
    for mode in ("tree", "padded"):
        model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float64)
        loss, metrics = policy_loss(model, trees, advantages, mode=mode)
        loss.backward()
        grads[mode] = [p.grad.clone() for p in model.parameters()]
        # Only model tokens are trained: 3 turns per leaf.
        assert metrics["linearised_tokens"] == sum(
            sum(len(n.token_ids) for n in t.path(leaf) if n.loss_mask is None) for t in trees for leaf in t.leaves()
        )
    for a, b in zip(grads["tree"], grads["padded"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_independent_episodes_run_every_turn_without_forking(tokenizer):
    trees, stats, _, _ = sample(tokenizer, mode="independent")
    for tree in trees:
        assert len(tree.root.children) == 4 and len(tree.leaves()) == 4
        for leaf in tree.leaves():
            path = tree.path(leaf)
            assert len(path) == 2 * TOOL_TURNS + 1 and leaf.finish_reason == "stop"
            assert all(len(n.children) == 1 for n in path[:-1])  # episodes never fork


@pytest.mark.parametrize("mode", ["independent", "tree"])
def test_a_hung_agent_step_drops_its_episode_and_the_batch_goes_on(tokenizer, caplog, monkeypatch, mode):
    """rollout.agent_timeout_s: p1's episodes are dropped at their first model turn (a failure of
    kind agent_timeout, counted, logged with the problem id); p0's run to the end; the batch
    returns long before the hung steps would, and the next sampling call is not held up by their threads."""
    thread_errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: thread_errors.append(args.exc_value))
    agent = HangingAgent()
    try:
        for _ in range(2):  # a second call (the next step) while the first call's threads still hang
            t0 = time.perf_counter()
            with caplog.at_level(logging.INFO, logger="arbor.rollout.episodes"):
                trees, stats, _, _ = sample(tokenizer, mode=mode, agent=agent, agent_timeout_s=0.3)
            assert time.perf_counter() - t0 < 5 < HANG_S
            p0, p1 = trees
            assert stats[0].agent_timeouts == 0 and stats[0].tool_turns >= TOOL_TURNS
            assert stats[0].finish_reasons == {"stop": 4} and not stats[0].failures
            assert all(len(p0.path(leaf)) == 2 * TOOL_TURNS + 1 for leaf in p0.leaves())
            # Every p1 path reaches the hanging first step; none gets past it, and none is kept.
            assert p1.leaves() == [] and stats[1].tool_turns == 0
            # The tree has nothing well-formed to fall back on: it restarts from the root
            # until it has width paths (TreePO reference, vllm_rollout_spmd.py:1033-1041).
            assert stats[1].agent_timeouts == stats[1].env_dropped == 4
            assert [f.kind for f in stats[1].failures] == ["agent_timeout"] * 4
            assert stats[1].root_restarts == (1 if mode == "tree" else 0)
        lines = [r.getMessage() for r in caplog.records if r.name == "arbor.rollout.episodes"]
        assert lines and all("problem 'p1'" in w and "rollout.agent_timeout_s" in w for w in lines)
    finally:
        agent.release.set()
    # Released, the abandoned steps finish quietly: their loops are closed, nothing raises.
    for thread in threading.enumerate():
        if thread.name.startswith("agent-step-"):
            thread.join(10)
    assert not thread_errors


HUNG_FOREVER = """
import asyncio, threading
from arbor.config import RolloutConfig
from arbor.engines.types import GenerateOutput
from arbor.rollout.sampler import sample_trees

class Engine:
    async def generate(self, request):
        return [GenerateOutput([5, 2], [-0.1, -0.1], "stop", 3, 0, "v0")] * request.sampling.n

class Hung:
    def start(self, problem):
        return [{"role": "user", "content": "?"}]

    def step(self, problem, history):
        threading.Event().wait()  # never returns

cfg = RolloutConfig(mode="independent", width=2, segment_tokens=8, max_depth=1, agent_timeout_s=0.2)
trees, stats = asyncio.run(sample_trees(
    Engine(), [{"id": "h"}], [[1, 2, 3]], cfg, eos_token_ids=[2], agent=Hung(),
    render=lambda messages: [7], decode=str,
))
print(stats[0].finish_reasons, [f.describe() for f in stats[0].failures])
"""


def test_a_hung_agent_thread_does_not_block_process_exit():
    """The step's thread cannot be killed; a daemon thread lets the process exit anyway
    (with the default executor's thread, asyncio.run and the interpreter wait for it forever)."""
    done = subprocess.run([sys.executable, "-c", HUNG_FOREVER], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    # Both episodes were dropped (no leaf), each recorded as an agent timeout naming the problem.
    assert done.stdout.startswith("{} [")
    assert done.stdout.count("problem 'h': agent_timeout: agent.step ran past rollout.agent_timeout_s=0.2s") == 2


def test_agent_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="rollout.agent_timeout_s must be > 0"):
        load_config(None, ["rollout.agent_timeout_s=0"])


class FloodingAgent(ScriptedAgent):
    """ScriptedAgent whose tool messages are far longer than any response budget."""

    def step(self, problem, history):
        reply = super().step(problem, history)
        return None if reply is None else [{"role": "tool", "content": "Traceback line\n" * 400}]


@pytest.mark.parametrize("mode", ["independent", "tree"])
def test_a_tool_turn_over_the_response_budget_drops_its_branch(tokenizer, mode, caplog):
    """rollout.env_overflow: drop. A traceback longer than what is left of the budget is never cut
    into a training sample: the branch is dropped, counted, logged naming the budget's keys."""
    caplog.set_level(logging.INFO)
    trees, stats, agent, _ = sample(tokenizer, mode=mode, agent=FloodingAgent(), env_overflow="drop")
    assert agent.histories  # the model's turns were answered, by messages that cannot fit
    for tree, s in zip(trees, stats):
        assert tree.leaves() == [] and s.tool_turns == 0 and s.overflow_ended == 0
        assert s.env_errors == s.env_dropped == s.dropped_too_long == 4  # every branch (the tree fell back to the root once)
    assert "rollout.segment_tokens × rollout.max_depth = 768): dropped (rollout.env_overflow)" in caplog.text


@pytest.mark.parametrize("mode", ["independent", "tree"])
def test_a_tool_turn_over_the_response_budget_ends_its_episode_unfinished(tokenizer, mode):
    """rollout.env_overflow: unfinished (the default). The episode ends where the message does not
    fit, is kept and scored like any other (the agent gives no reward: the reward functions score
    what the model wrote), so a group is not reduced to the episodes short enough to fit."""
    trees, stats, agent, _ = sample(tokenizer, mode=mode, agent=FloodingAgent())
    for tree, s in zip(trees, stats):
        assert len(tree.leaves()) == 4 and s.env_dropped == s.dropped_too_long == 0 and s.tool_turns == 0
        assert s.overflow_ended == 4 and {leaf.finish_reason for leaf in tree.leaves()} == {"message_too_long"}
        assert not s.failures  # the budget is not a failure of user code


def test_a_step_whose_every_episode_is_dropped_trains_nothing_and_says_why(tokenizer, caplog):
    """Issue 47's run: an agent whose message never fits what the answer leaves of the budget, with
    rollout.env_overflow: drop. Each branch is dropped (counted), the step warns that its episodes
    ended at the budget, and with nothing left it is an empty step (the trainer says so, naming the
    keys, and stops after run.max_empty_steps of them): no error is raised by the step itself."""
    from arbor.data import ProblemStream
    from arbor.rollout.environments import agent_source
    from arbor.rollout.rewards import RewardPool
    from arbor.run import phases
    from arbor.run.async_rollouts import _ThreadLog
    from arbor.run.step_report import EmptySteps, dropped_summary

    cfg = load_config(None, ["rollout.width=4", "rollout.segment_tokens=64", "rollout.max_depth=12",
                             "data.prompts_per_step=2", "algorithm.max_refill_rounds=0", "rollout.env_overflow=drop"])
    sampling = phases.Sampling(ScriptedEngine(tokenizer), tokenizer, agent_source(FloodingAgent()),
                               [tokenizer.eos_token_id], cfg.data, chat_template=True)
    with RewardPool([], workers=1, timeout_s=1) as pool:
        batch = phases.collect_rollouts(sampling, pool, ProblemStream(PROBLEMS, 0, False), _ThreadLog(), cfg, 1)
    assert batch.trees == [] and sum(s.dropped_too_long for s in batch.stats) == 8
    assert "step 1: 100% of the episodes ended at the response budget" in caplog.text
    line = dropped_summary(batch, 0.0, cfg)
    assert line == ("8 branches dropped: the next message did not fit the response budget (rollout.segment_tokens "
                    "× rollout.max_depth = 768 tokens, rollout.env_overflow: drop)")
    empty = EmptySteps(limit=2)
    counts, said = empty.update(batch, line)
    assert counts == {"run/empty_steps": 1.0} and said.startswith("trained nothing: 2 trees sampled, none kept: 8 branches")
    empty.check(1)  # one in a row: goes on
    empty.update(batch, line)
    with pytest.raises(EmptyStepsError, match=r"step 2: 2 steps in a row trained nothing; the last one: 8 branches "
                                              r"dropped.*rollout.env_overflow: drop.*run.max_empty_steps"):
        empty.check(2)


class FloodingOnP0(ScriptedAgent):
    """Floods the budget on problem p0 only."""

    def step(self, problem, history):
        reply = super().step(problem, history)
        if reply is None or problem["id"] != "p0":
            return reply
        return [{"role": "tool", "content": "Traceback line\n" * 400}]


def test_an_eval_whose_episodes_are_dropped_counts_them_or_stops_naming_the_budget(tokenizer):
    """Issue 47's run evaluated first, and crashed on a problem with no answer left (pass@k of
    0 samples). A problem whose every episode was dropped is counted in eval/dropped_problems
    and left out of the accuracy; when every problem's were, the eval stops naming the keys."""
    from arbor.rollout.environments import agent_source
    from arbor.rollout.rewards import RewardPool
    from arbor.run import phases

    cfg = load_config(None, ["eval.samples=2", "eval.temperature=1.0", "rollout.segment_tokens=64",
                             "rollout.max_depth=12"])

    def evaluate(agent):
        sampling = phases.Sampling(ScriptedEngine(tokenizer), tokenizer, agent_source(agent),
                                   [tokenizer.eos_token_id], cfg.data, chat_template=True)
        with RewardPool("rewards/math.py:boxed_accuracy", workers=1, timeout_s=5) as pool:
            return phases.evaluate(sampling, pool, PROBLEMS, cfg.eval, cfg.rollout, 0, lambda text: None)

    cfg.rollout.env_overflow = "drop"
    metrics = evaluate(FloodingOnP0())
    assert metrics["eval/dropped_problems"] == 1.0 and metrics["eval/dropped_problems"] < len(PROBLEMS)
    assert 0.0 <= metrics["eval/accuracy"] <= 1.0  # over p1 alone
    with pytest.raises(EpisodesDroppedError, match=r"eval: all \d+ episodes were dropped, \d+ of them because "
                                                          r".*rollout.segment_tokens × rollout.max_depth = 64 × 12"):
        evaluate(FloodingAgent())
