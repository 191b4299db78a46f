"""A plain OpenAI-client agent with a calculator tool. Nothing in it knows about turnrl.

It runs against any OpenAI-compatible server (OpenAI itself, vLLM, `turnrl serve`); `turnrl train` with
`rollout.agent: openai_agent` calls `run` with the base_url of a recording session (see README.md).
"""

from __future__ import annotations

import ast
import json
import operator
import re

import openai

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 6"}},
            "required": ["expression"],
        },
    },
}]
SYSTEM = "Use the calculator tool for arithmetic, then give the final answer as a number."
MAX_STEPS = 4

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Arithmetic only: the expression is parsed, never eval'd."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    return str(int(result)) if float(result).is_integer() else str(result)


async def run(base_url: str, api_key: str, sample: dict) -> float:
    """Answer the question `sample["prompt"]` with the calculator; reward 1 when the last number equals `sample["answer"]`."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sample["prompt"]}]
    answer = ""
    for _ in range(MAX_STEPS):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            try:
                result = calculator(json.loads(call.function.arguments)["expression"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                result = f"error: bad arguments ({e})"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer)
    return float(bool(numbers) and float(numbers[-1]) == float(sample["answer"]))
