"""An agent program on the OpenAI Agents SDK (``openai-agents``): a calculator tool, then two
follow-up questions in the same conversation.

    rollout:
      program: agents/openai_agents_sdk.py:program

The SDK calls ``/v1/responses`` and sends traces to OpenAI by default: this program switches it
to chat completions and turns tracing off (both process-wide), and hands the SDK the run's
client (``ctx.openai_client()``), so every call reaches arbor's endpoint for this run
(docs/agent-programs.md). Its messages go back as the SDK rebuilds them; arbor matches them
to what it returned by content and tool calls, so the ids trained are the ids sampled.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_default_openai_api,
    set_tracing_disabled,
)
from arbor import ProgramContext

set_default_openai_api("chat_completions")
set_tracing_disabled(True)

# The calculator of the openai example beside this file (agents/openai_tool.py).
_spec = importlib.util.spec_from_file_location("openai_tool", Path(__file__).with_name("openai_tool.py"))
assert _spec is not None and _spec.loader is not None
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)
_calculate = _example.calculate


@function_tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * /."""
    return _calculate(expression)


FOLLOW_UPS = ["Check that with the calculator.", "Are you sure? Answer again."]


async def program(problem: dict, ctx: ProgramContext) -> float | None:
    model = OpenAIChatCompletionsModel(model=ctx.model, openai_client=ctx.openai_client())
    agent = Agent(name="calculator", instructions="Answer arithmetic questions; the calculator can help.",
                  tools=[calculate], model=model, model_settings=ModelSettings(max_tokens=96))
    conversation: Any = problem["prompt"]
    for follow_up in [*FOLLOW_UPS, None]:  # three turns of the conversation, each a Runner.run
        result = await Runner.run(agent, conversation, max_turns=4)
        if follow_up is None:
            break
        conversation = [*result.to_input_list(), {"role": "user", "content": follow_up}]
    return None
