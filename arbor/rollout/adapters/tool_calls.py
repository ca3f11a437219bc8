"""Tool calls as a model writes them, and tools as chat templates take them.

    calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    calls[0].name, calls[0].arguments          # "add", {"a": 1}
    function_tool("add", "Adds.", {"type": "object", "properties": {...}})
    # {"type": "function", "function": {"name": "add", "description": "Adds.", "parameters": {...}}}

arbor samples token ids itself, so no inference server parses tool calls out of them: the
environment reads them from the model's text. The format is the Hermes one that Qwen2.5,
Qwen3 and Hermes chat templates teach (and SGLang's ``qwen25`` / vLLM's ``hermes`` parsers
read): a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>``, one block per call. Tools are described to the model in the OpenAI
function format that ``tokenizer.apply_chat_template(messages, tools=...)`` renders.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote; ``error`` says why it cannot be made (then name/arguments are empty)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block of ``text``, in
    order; a block that is not such an object becomes a call with ``error`` set (the model
    is told, as a failed tool call, rather than the block being dropped silently)."""
    calls = []
    for block in _CALL.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not JSON ({e.msg} at character {e.pos}): {block.strip()[:200]}"))
            continue
        name = call.get("name") if isinstance(call, dict) else None
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            calls.append(ToolCall("", {}, 'a tool call must be {"name": "...", "arguments": {...}}, '
                                          f"got {block.strip()[:200]}"))
            continue
        calls.append(ToolCall(name, arguments))
    return calls


def function_tool(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool in the OpenAI function format chat templates render (``tools=[...]``)."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
