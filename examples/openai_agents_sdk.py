"""The task of `examples/openai_agent.py` written with the OpenAI Agents SDK (`openai-agents`), trained
unchanged: set `rollout.agent_function_path: examples.openai_agents_sdk.run_agent` (docs/agentic.md).

The SDK runs its own loop (ask the model, run the tools it calls, send their results back, stop at
an answer); slimrl only gives it a `base_url` and key per run, through the SDK's chat-completions
model. Every completion the SDK asks for is recorded token for token and becomes training data.
Tracing is off: nothing leaves the machine.
"""

from __future__ import annotations

import re
from typing import Any

from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunContextWrapper,
    Runner,
    set_tracing_disabled,
)
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

from examples.openai_agent import MAX_TOKENS, MAX_TURNS, TOOLS, run_tool

set_tracing_disabled(True)
_INTEGER = re.compile(r"-?\d+")


async def _add(context: RunContextWrapper[Any], arguments: str) -> str:
    context.context["tool_calls"] += 1
    return run_tool("add", arguments)


ADD = FunctionTool(
    name="add",
    description=TOOLS[0]["function"]["description"],
    params_json_schema=TOOLS[0]["function"]["parameters"],
    on_invoke_tool=_add,
    strict_json_schema=False,
)
"""The same tool as the plain-SDK example, with the same JSON schema."""


async def run_agent(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, float]:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    agent = Agent(
        name="adder",
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        model_settings=ModelSettings(max_tokens=MAX_TOKENS),
        tools=[ADD],
    )
    counts = {"tool_calls": 0}
    try:
        result = await Runner.run(agent, str(task["prompt"]), context=counts, max_turns=MAX_TURNS)
        answer = str(result.final_output or "")
    except MaxTurnsExceeded:
        answer = ""
    finally:
        await client.close()
    numbers = _INTEGER.findall(answer)
    correct = bool(numbers) and numbers[-1] == str(task["label"]).strip()
    return {"score": float(correct), "tool_calls": float(counts["tool_calls"])}
