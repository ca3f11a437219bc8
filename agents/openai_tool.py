"""An agent program written with the ``openai`` client: a calculator tool and three calls.

    rollout:
      program: agents/openai_tool.py:program

arbor runs it once per leaf of each problem's tree (docs/agent-programs.md): ``ctx.openai_client()``
is an ``openai.AsyncOpenAI`` bound to the run, ``ctx.seed`` seeds every random choice (a forked
run replays the calls before its fork and must send the same requests). The messages the model
returned are sent back unchanged, so arbor trains on exactly the ids it sampled. Returning None
lets ``reward.functions`` score the conversation; a number would be the reward.
"""

from __future__ import annotations

import ast
import json
import operator
import random
from typing import Any

from arbor import ProgramContext

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression of integers with + - * /.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
# Follow-ups when the model answers without calling the tool, one picked per run from ctx.seed.
_CHECKS = ["Check that with the calculator.", "Are you sure? Answer again."]


def calculate(expression: str) -> str:
    """The value of an integer expression (no names, no calls), or the error as text."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(result) if float(result).is_integer() else result)


async def program(problem: dict, ctx: ProgramContext) -> float | None:
    rng = random.Random(ctx.seed)  # every random choice from the run's seed: replays make the same
    messages: list[dict[str, Any]] = [{"role": "user", "content": problem["prompt"]}]
    async with ctx.openai_client() as client:  # an openai.AsyncOpenAI bound to this run
        for turn in range(3):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages, tools=[CALCULATOR],
                                                         max_tokens=96)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))  # back unchanged: token-exact
            for call in message.tool_calls or []:
                arguments = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": calculate(str(arguments.get("expression", "")))})
            if not message.tool_calls and turn < 2:
                messages.append({"role": "user", "content": rng.choice(_CHECKS)})
    return None
