"""An agent written against the OpenAI API, trained unchanged (set `rollout.agent_function_path:
examples.openai_agent.run_agent`; docs/agentic.md).

It is plain OpenAI-SDK code: it asks the model, runs the tools the model calls (an `add` tool here),
sends their results back, and stops when the model answers without calling one. slimrl gives it a
`base_url` and key per run; every completion it asks for is recorded token for token and becomes
training data, the tool results with loss mask 0. Its return value is the reward: a dict whose
`score` is trained on (its other numbers are logged with it).
"""

from __future__ import annotations

import json
import re
from typing import Any

from openai import AsyncOpenAI

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
MAX_TURNS = 4
MAX_TOKENS = 96
"""Per model call: a tool call of the tiny models' format takes about 75 tokens (one per character)."""
_INTEGER = re.compile(r"-?\d+")


def add(a: int, b: int) -> int:
    return a + b


def run_tool(name: str, arguments: str) -> str:
    """A tool call's result as the text the model reads; a bad call is an error message, not a crash."""
    try:
        args = json.loads(arguments)
        if name != "add":
            return f"error: no tool {name}"
        return str(add(int(args["a"]), int(args["b"])))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def first_messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": str(task["prompt"])}]


async def run_agent(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, float]:
    async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        messages = first_messages(task)
        tool_calls = 0
        answer = ""
        for _ in range(MAX_TURNS):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                answer = message.content or ""
                break
            for call in message.tool_calls:
                result = run_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                tool_calls += 1
    numbers = _INTEGER.findall(answer)
    correct = bool(numbers) and numbers[-1] == str(task["label"]).strip()
    return {"score": float(correct), "tool_calls": float(tool_calls)}
