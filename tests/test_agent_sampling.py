"""Multi-turn episodes: a scripted engine and agent, 3 model turns with 2 tool turns, branching.

The tokenizer is the quickstart model's (ChatML): what the sampler appends after each
model turn must be exactly what the chat template renders for the whole conversation.
"""

from __future__ import annotations

import asyncio
import functools
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arbor.agents import continuation_ids
from arbor.config import RolloutConfig
from arbor.engines.types import GenerateOutput, GenerateRequest
from arbor.loss import policy_loss
from arbor.sampler import sample_trees

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-arith"
TOOL_TURNS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL)


class ScriptedEngine:
    """Model turn t (t tool turns so far) writes code for t < 2, then a boxed answer; the
    numbers come from the request seed, so branches differ."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.outputs: list[list[int]] = []

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        await asyncio.sleep(0)
        turn = self.tokenizer.decode(request.input_ids).count("<|im_start|>tool")
        outs = []
        for j in range(request.sampling.n):
            k = random.Random(request.sampling.seed + j).randrange(100)
            text = f"```python\nprint({k}+{turn})\n```" if turn < TOOL_TURNS else f"so \\boxed{{{k}}}"
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            self.outputs.append(ids)
            outs.append(GenerateOutput(ids, [-0.5] * len(ids), "stop", len(request.input_ids), 0, "v1"))
        return outs


class ScriptedAgent:
    def __init__(self) -> None:
        self.histories: list[list[dict]] = []

    def start(self, problem):
        return [{"role": "user", "content": problem["prompt"]}]

    def step(self, problem, history):
        self.histories.append(history)
        done = sum(m["role"] == "tool" for m in history)
        if done >= TOOL_TURNS:
            return None
        return [{"role": "tool", "content": f"ran: {history[-1]['content'][10:18]}"}]


def sample(tokenizer, width=4, mode="tree"):
    agent, engine = ScriptedAgent(), ScriptedEngine(tokenizer)
    problems = [{"id": f"p{i}", "prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(2)]
    prompts = [
        tokenizer.apply_chat_template(agent.start(p), add_generation_prompt=True, tokenize=True)["input_ids"]
        for p in problems
    ]
    cfg = RolloutConfig(mode=mode, width=width, branch=2, segment_tokens=64, max_depth=12)
    trees, stats = asyncio.run(sample_trees(
        engine, problems, prompts, cfg, eos_token_ids=[tokenizer.eos_token_id], seed=3, agent=agent,
        render=functools.partial(continuation_ids, tokenizer), decode=lambda ids: tokenizer.decode(ids),
    ))
    return trees, stats, agent, engine


def test_three_turn_episodes_branch_at_decision_points(tokenizer):
    trees, stats, agent, engine = sample(tokenizer)
    for tree, s in zip(trees, stats):
        leaves = tree.leaves()
        assert len(leaves) == 4 and s.shortfall_reason is None and s.tool_turns >= TOOL_TURNS
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
    for mode in ("tree", "linear"):
        model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float64)
        loss, metrics = policy_loss(model, trees, advantages, mode=mode)
        loss.backward()
        grads[mode] = [p.grad.clone() for p in model.parameters()]
        # Only model tokens are trained: 3 turns per leaf.
        assert metrics["linearised_tokens"] == sum(
            sum(len(n.token_ids) for n in t.path(leaf) if n.loss_mask is None) for t in trees for leaf in t.leaves()
        )
    for a, b in zip(grads["tree"], grads["linear"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_independent_episodes_run_every_turn_without_forking(tokenizer):
    trees, stats, _, _ = sample(tokenizer, mode="independent")
    for tree in trees:
        assert len(tree.root.children) == 4 and len(tree.leaves()) == 4
        for leaf in tree.leaves():
            path = tree.path(leaf)
            assert len(path) == 2 * TOOL_TURNS + 1 and leaf.finish_reason == "stop"
            assert all(len(n.children) == 1 for n in path[:-1])  # episodes never fork
