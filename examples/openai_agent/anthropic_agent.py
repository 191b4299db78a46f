"""The calculator agent of agent.py against the Anthropic Messages API (`pip install anthropic`).

Unaware of turnrl: `anthropic.AsyncAnthropic(base_url=...)` is pointed at the server root (the SDK appends
`/v1/messages`). With `turnrl train`, the base_url given to `run` ends in `/v1`; the SDK wants the part before
it, so `run` strips it. `stream=True` streams each reply (`messages.stream`).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import anthropic

sys.path.insert(0, str(Path(__file__).parent))
from agent import MAX_STEPS, SYSTEM, calculator  # noqa: E402

TOOLS = [{
    "name": "calculator",
    "description": "Evaluate an arithmetic expression with + - * / ** and parentheses.",
    "input_schema": {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 6"}},
        "required": ["expression"],
    },
}]


async def _reply(client: anthropic.AsyncAnthropic, messages: list, stream: bool):
    kwargs = {"model": "policy", "max_tokens": 128, "system": SYSTEM, "messages": messages, "tools": TOOLS}
    if not stream:
        return await client.messages.create(**kwargs)
    async with client.messages.stream(**kwargs) as events:
        async for _text in events.text_stream:  # a UI would print the text as it comes
            pass
        return await events.get_final_message()


async def run(base_url: str, api_key: str, sample: dict, stream: bool = False) -> float:
    client = anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    messages: list = [{"role": "user", "content": sample["prompt"]}]
    answer = ""
    for _ in range(MAX_STEPS):
        message = await _reply(client, messages, stream)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        calls = [b for b in message.content if b.type == "tool_use"]
        if not calls:
            answer = "".join(b.text for b in message.content if b.type == "text")
            break
        results = []
        for call in calls:
            expression = call.input.get("expression") if isinstance(call.input, dict) else None
            result = calculator(expression) if isinstance(expression, str) else f"error: bad input {json.dumps(call.input)}"
            results.append({"type": "tool_result", "tool_use_id": call.id, "content": result})
        messages.append({"role": "user", "content": results})
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer)
    return float(bool(numbers) and float(numbers[-1]) == float(sample["answer"]))


async def run_streaming(base_url: str, api_key: str, sample: dict) -> float:
    return await run(base_url, api_key, sample, stream=True)
