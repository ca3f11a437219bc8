"""An agent with a Python tool: the model writes a ```python block, the block runs in
arbor's sandbox (bubblewrap: its own user, a read-only view of Python, time, memory and
process limits, no network, a temporary directory), its output
comes back as a tool message, and the model continues.

    rollout:
      agent: agents/python_tool.py:PythonTool

The episode ends when a model turn has no code block, or after ``max_tool_calls`` calls.
Where bubblewrap cannot run, the agent refuses to start unless ``agent_args:
{allow_unsandboxed: true}`` says that is meant (calls then run as arbor's own user,
counted in ``agent/unsandboxed_tool_calls``); where the network cannot be cut off either,
it also needs ``allow_network: true``. docs/sandbox.md says what the sandbox isolates.
A tool that times out, raises, runs out of memory or prints megabytes gives an error
message (marked ``"error": True`` for the tool-error metric); the rollout goes on.
"""

from __future__ import annotations

import re

from arbor import ToolPool, prompt_messages

CODE = re.compile(r"```python\n(.*?)```", re.DOTALL)
INSTRUCTION = (
    "\nYou may run Python: write a ```python block and its output will be shown to you. "
    "Put the final answer in \\boxed{}."
)


class PythonTool:
    def __init__(self, max_tool_calls: int = 3, timeout_s: float = 5.0, memory_mb: int = 512,
                 max_output_chars: int = 2000, workers: int = 4, allow_network: bool = False,
                 allow_unsandboxed: bool = False, max_processes: int = 64) -> None:
        self.max_tool_calls, self.timeout_s = max_tool_calls, timeout_s
        self.memory_mb, self.max_output_chars = memory_mb, max_output_chars
        self.pool = ToolPool(workers, allow_network=allow_network, allow_unsandboxed=allow_unsandboxed,
                             max_processes=max_processes)

    def start(self, problem: dict) -> list[dict]:
        # The prompt is text or chat messages; the instruction ends its last user message.
        return prompt_messages(problem["prompt"], INSTRUCTION)

    def step(self, problem: dict, history: list[dict]) -> list[dict] | None:
        calls = sum(m["role"] == "tool" for m in history)
        blocks = CODE.findall(history[-1]["content"])
        if not blocks or calls >= self.max_tool_calls:
            return None
        result = self.pool.run_python_sync(
            blocks[-1], timeout_s=self.timeout_s, memory_mb=self.memory_mb,
            max_output_chars=self.max_output_chars,
        )
        message: dict = {"role": "tool", "content": result.observation or "(no output)"}
        if not result.ok:
            message["error"] = True
        return [message]
