"""Scripted engines and agents for the multi-turn tests (sampler, eval, trainer).

``Recheck`` is also loaded by spec (``tests/agent_fixtures.py:Recheck``) in `arbor train`
and `arbor eval` runs on the quickstart model.
"""

from __future__ import annotations

import asyncio
import random
import threading

from arbor.engines.types import GenerateOutput, GenerateRequest

TOOL_TURNS = 2  # ScriptedAgent's tool turns per episode: 3 model turns
PROBLEMS = [{"id": f"p{i}", "prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(2)]


class ScriptedEngine:
    """Model turn t (t tool turns so far) writes code for t < 2, then a boxed answer; the
    numbers come from the request seed, so branches differ. Needs a ChatML tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.outputs: list[list[int]] = []
        self.requests: list[GenerateRequest] = []
        self.generate_calls = 0  # what the trainer's phases read of an engine client

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        await asyncio.sleep(0)
        self.requests.append(request)
        turn = self.tokenizer.decode(request.input_ids).count("<|im_start|>tool")
        eos, prompt_tokens = self.tokenizer.eos_token_id, len(request.input_ids)
        outs = []
        for j in range(request.sampling.n):
            k = random.Random(request.sampling.seed + j).randrange(100)
            code = f"```python\nprint({k}+{turn})\n```"
            text = code if turn < TOOL_TURNS else f"so \\boxed{{{k}}}"
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [eos]
            self.outputs.append(ids)
            outs.append(GenerateOutput(ids, [-0.5] * len(ids), "stop", prompt_tokens, 0, "v1"))
        return outs

    async def flush_cache(self) -> None:  # the trainer's eval phase flushes after sampling
        pass

    async def close(self) -> None:  # the trainer's phases close the client after each run
        pass


class ScriptedAgent:
    """A tool message echoing the model's code after each of the first TOOL_TURNS turns."""

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


HANG_S = 30.0  # how long HangingAgent's step hangs unless released


class HangingAgent(ScriptedAgent):
    """ScriptedAgent, except that its first step on problem ``p1`` hangs until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def step(self, problem, history):
        if problem["id"] == "p1" and not any(m["role"] == "tool" for m in history):
            self.release.wait(HANG_S)
        return super().step(problem, history)


class Recheck:
    """After the first answer, a tool message (marked an error) asks to check it; the
    second answer ends the episode."""

    def start(self, problem):
        return [{"role": "user", "content": problem["prompt"] + " Put the answer in \\boxed{}."}]

    def step(self, problem, history):
        if any(m["role"] == "tool" for m in history):
            return None
        return [{"role": "tool", "content": "checked", "error": True}]
