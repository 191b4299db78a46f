"""The calculator agent of agent.py, written with the OpenAI Agents SDK (`pip install openai-agents`).

Unaware of turnrl: the SDK's model gets an `openai.AsyncOpenAI` client on the session's base_url. By default
the SDK's model speaks the Responses API (`POST .../responses`); `run(..., chat_completions=True)` uses its
chat-completions model instead, and `run_streamed` streams the run. All three are recorded token-exactly.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import openai
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

sys.path.insert(0, str(Path(__file__).parent))
from agent import MAX_STEPS, SYSTEM  # noqa: E402
from agent import calculator as evaluate  # noqa: E402

set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI's platform


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / ** and parentheses.

    Args:
        expression: e.g. (3 + 4) * 6
    """
    return evaluate(expression)


def build_agent(base_url: str, api_key: str, chat_completions: bool = False) -> Agent:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model_class = OpenAIChatCompletionsModel if chat_completions else OpenAIResponsesModel
    return Agent(name="calculator", instructions=SYSTEM, tools=[calculator],
                 model=model_class(model="policy", openai_client=client),
                 model_settings=ModelSettings(max_tokens=128))


def _reward(final_output: object, answer: object) -> float:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", str(final_output))
    return float(bool(numbers) and float(numbers[-1]) == float(answer))


# The SDK raises when a reply is cut by max_tokens (a Responses `incomplete` status) or the agent runs out of
# turns; for training, both are a failed attempt (reward 0), not a crash: the calls made so far are recorded.
FAILED_ATTEMPT = (MaxTurnsExceeded, ModelBehaviorError)


async def run(base_url: str, api_key: str, sample: dict, chat_completions: bool = False) -> float:
    """Responses API by default (the SDK's default model)."""
    try:
        result = await Runner.run(build_agent(base_url, api_key, chat_completions), sample["prompt"],
                                  max_turns=MAX_STEPS)
    except FAILED_ATTEMPT:
        return 0.0
    return _reward(result.final_output, sample["answer"])


async def run_chat_completions(base_url: str, api_key: str, sample: dict) -> float:
    return await run(base_url, api_key, sample, chat_completions=True)


async def run_streamed(base_url: str, api_key: str, sample: dict) -> float:
    result = Runner.run_streamed(build_agent(base_url, api_key), sample["prompt"], max_turns=MAX_STEPS)
    try:
        async for _event in result.stream_events():  # a UI would render the text deltas here
            pass
    except FAILED_ATTEMPT:
        return 0.0
    return _reward(result.final_output, sample["answer"])
