"""Agents for tests/test_serve.py, written as users write them: plain OpenAI clients, no turnrl imports."""

from __future__ import annotations

import json

import openai

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}


def forgetful_run(base_url: str, api_key: str, sample: dict) -> None:
    """Synchronous client; after the tool call it drops the history and asks afresh (a diverging call).
    Returns no reward: the configured reward function scores the episode."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": sample["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR]).choices[0].message
    expression = json.loads(first.tool_calls[0].function.arguments)["expression"]
    left, right = expression.split("*")  # the scripted model only multiplies
    result = int(left) * int(right)
    client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": f"The calculator said {result}. What is the answer?"}])


async def stalling_run(base_url: str, api_key: str, sample: dict) -> float:
    """One call, then it hangs (a stuck tool): the rollout's trajectory timeout must end it."""
    import asyncio

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": sample["prompt"]}])
    await asyncio.sleep(30)
    return 1.0
