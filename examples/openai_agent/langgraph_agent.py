"""The same calculator agent as agent.py, written with LangGraph (a ReAct graph: model -> tools -> model).

Also unaware of turnrl: LangChain's ChatOpenAI just gets the session's base_url. Needs
`pip install langgraph langchain-core langchain-openai`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

sys.path.insert(0, str(Path(__file__).parent))
from agent import MAX_STEPS, SYSTEM  # noqa: E402
from agent import calculator as evaluate  # noqa: E402


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / ** and parentheses.

    Args:
        expression: e.g. (3 + 4) * 6
    """
    return evaluate(expression)


def build_graph(llm: ChatOpenAI):
    model = llm.bind_tools([calculator])

    async def call_model(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([calculator]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)  # tool calls -> "tools", else the end
    graph.add_edge("tools", "model")
    return graph.compile()


async def run(base_url: str, api_key: str, sample: dict) -> float:
    llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_retries=0)
    state = await build_graph(llm).ainvoke(
        {"messages": [SystemMessage(SYSTEM), HumanMessage(sample["prompt"])]},
        {"recursion_limit": 2 * MAX_STEPS + 1},
    )
    numbers = re.findall(r"-?\d+(?:\.\d+)?", str(state["messages"][-1].content))
    return float(bool(numbers) and float(numbers[-1]) == float(sample["answer"]))


async def run_streaming(base_url: str, api_key: str, sample: dict) -> float:
    """The same graph with streamed model calls: `astream(stream_mode="messages")` yields the tokens as they come."""
    llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_retries=0, streaming=True)
    inputs = {"messages": [SystemMessage(SYSTEM), HumanMessage(sample["prompt"])]}
    state: dict = {}
    async for mode, chunk in build_graph(llm).astream(inputs, {"recursion_limit": 2 * MAX_STEPS + 1},
                                                      stream_mode=["messages", "values"]):
        if mode == "values":  # the graph's state after each step; the last one is the final state
            state = chunk
    numbers = re.findall(r"-?\d+(?:\.\d+)?", str(state["messages"][-1].content))
    return float(bool(numbers) and float(numbers[-1]) == float(sample["answer"]))
