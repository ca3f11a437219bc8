"""An agent program on LangGraph with ``langchain-openai``: a model node bound to a
calculator tool, a tool node, and follow-up questions, as one graph.

    rollout:
      program: agents/langgraph_tool.py:program

``ChatOpenAI`` is pointed at the run's endpoint (``ctx.base_url``, ``ctx.api_key``); LangGraph
keeps the conversation and sends it back each call, with the model's messages as LangChain
rebuilt them (arguments re-serialised): arbor matches them to what it returned, so the ids
trained are the ids sampled (docs/agent-programs.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AnyMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode

from arbor import ProgramContext

# The calculator of the openai example beside this file (agents/openai_tool.py).
_spec = importlib.util.spec_from_file_location("openai_tool", Path(__file__).with_name("openai_tool.py"))
assert _spec is not None and _spec.loader is not None
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)
_calculate = _example.calculate
FOLLOW_UPS = ["Check that with the calculator.", "Are you sure? Answer again."]


@tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * /."""
    return _calculate(expression)


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    answers: int  # model turns that ended without a tool call


def graph(llm: Any) -> Any:
    """model -> tools -> model ...; an answer without a tool call gets a follow-up, three answers end it."""
    bound = llm.bind_tools([calculate])

    async def model(state: State) -> dict:
        reply = await bound.ainvoke(state["messages"])
        return {"messages": [reply], "answers": state["answers"] + (0 if reply.tool_calls else 1)}

    def follow_up(state: State) -> dict:
        return {"messages": [HumanMessage(FOLLOW_UPS[state["answers"] - 1])]}

    def route(state: State) -> str:
        if state["messages"][-1].tool_calls:
            return "tools"
        return END if state["answers"] >= 1 + len(FOLLOW_UPS) else "follow_up"

    builder = StateGraph(State)
    builder.add_node("model", model)
    builder.add_node("tools", ToolNode([calculate]))
    builder.add_node("follow_up", follow_up)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", route, ["tools", "follow_up", END])
    builder.add_edge("tools", "model")
    builder.add_edge("follow_up", "model")
    return builder.compile()


async def program(problem: dict, ctx: ProgramContext) -> float | None:
    llm = ChatOpenAI(model=ctx.model, base_url=ctx.base_url, api_key=ctx.api_key, max_tokens=96, max_retries=0)
    await graph(llm).ainvoke({"messages": [HumanMessage(problem["prompt"])], "answers": 0},
                             {"recursion_limit": 20})
    return None
