"""A lookup task with one tool, as a verifiers ToolEnv and as a stdio MCP server
(configs/env_verifiers.yaml, configs/env_mcp.yaml).

    python3 envs/lookup_tools.py            # the MCP server (stdio): one tool, lookup(key)
    vf_env = load_environment()             # the verifiers ToolEnv with the same tool

A table of ten keys holds ten values; the question names a key, the model calls
``lookup`` with it and answers ``\\boxed{VALUE}``. The verifiers environment's rubric gives 1
when its last message holds the value; for MCP episodes :func:`boxed_value` is the reward
function (MCP servers give no reward).
"""

from __future__ import annotations

TABLE = {f"k{i}": f"v{(7 * i + 3) % 10}" for i in range(10)}
INSTRUCTION = "Use the lookup tool, then give the value as \\boxed{VALUE}."


def lookup(key: str) -> str:
    """The value stored under a key.

    Args:
        key: the key, k0 to k9
    """
    return TABLE.get(key, f"no key {key!r}")


def questions() -> list[dict]:
    """The task's problems: ``{"id", "prompt", "answer"}``, one per key."""
    return [{"id": key, "prompt": f"What is stored under {key}? {INSTRUCTION}", "answer": value}
            for key, value in TABLE.items()]


def boxed_value(problem: dict, completion: str) -> float:
    """1 when the last ``\\boxed{}`` of the episode is the problem's value."""
    from arbor.rollout.answers import last_boxed

    return float(last_boxed(completion) == problem["answer"])


def load_environment(max_turns: int = 3):
    """The verifiers ToolEnv (verifiers' classic API: ``pip install 'arbor[verifiers]'``)."""
    import verifiers as vf
    from datasets import Dataset

    def found_value(completion, answer) -> float:
        last = [m for m in completion if m.role == "assistant"][-1]
        return float(f"\\boxed{{{answer}}}" in (last.content or ""))

    rows = [{"question": q["prompt"], "answer": q["answer"]} for q in questions()]
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[lookup], max_turns=max_turns,
                      rubric=vf.Rubric(funcs=[found_value]))


def serve() -> None:
    """The MCP server (stdio), on the MCP SDK (``pip install 'arbor[mcp]'``)."""
    from mcp.types import ToolAnnotations

    try:
        from mcp.server.mcpserver import MCPServer  # mcp 2.x

        server = MCPServer("lookup")
    except ImportError:
        from mcp.server.fastmcp import FastMCP  # mcp 1.x (it logs every request at INFO)

        server = FastMCP("lookup", log_level="WARNING")
    server.tool(annotations=ToolAnnotations.model_validate({"readOnlyHint": True}))(lookup)
    server.run("stdio")


if __name__ == "__main__":
    serve()
