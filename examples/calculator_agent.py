"""The agent of the tool-use task that learns (`configs/tiny_moe_tool_grpo_cpu.yaml`; docs/agentic.md,
"A task that learns"). Plain OpenAI-SDK code, trained unchanged.

It asks the model once, offering a `calculator` tool. When the model calls it, the run stops on that
tool and the tool's result is the answer (what the OpenAI Agents SDK calls
`tool_use_behavior="stop_on_first_tool"`); otherwise the model's own text is. The tool reads the
question from the task, so the call takes no arguments. Reward 1 when the answer's last digit is
the label, (a+b) mod 10: a guess is right 1 time in 10, the calculator every time, so RL learns to
call it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from openai import AsyncOpenAI

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Work out the arithmetic in the user's question.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
MAX_TOKENS = 80
"""A call of the calculator in the tiny models' tool format is 65 tokens (one per character, and
`<|im_end|>`)."""
_SUM = re.compile(r"\s*(\d+)\s*\+\s*(\d+)\s*=?\s*")

Tool = Callable[[dict[str, Any]], str]


def calculator(task: dict[str, Any]) -> str:
    """The sum the task's `a+b=` question asks for."""
    match = _SUM.fullmatch(str(task["prompt"]))
    return str(int(match[1]) + int(match[2])) if match else "error: not a sum"


async def play(base_url: str, api_key: str, task: dict[str, Any], tool: Tool) -> dict[str, float]:
    """One call; the answer is `tool(task)` when the model calls the tool, else its text."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        reply = await client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": str(task["prompt"])}],
            tools=TOOLS,
            max_tokens=MAX_TOKENS,
        )
    message = reply.choices[0].message
    called = any(call.function.name == "calculator" for call in message.tool_calls or [])
    answer = tool(task) if called else (message.content or "").strip()
    correct = answer[-1:] == str(task["label"]).strip()
    return {"score": float(correct), "called_tool": float(called)}


async def run_agent(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, float]:
    return await play(base_url, api_key, task, calculator)


def useless_calculator(task: dict[str, Any]) -> str:
    """The control's tool: the same reply format with no information in it (a random digit)."""
    return str(random.randrange(10))


async def run_agent_with_control(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, float]:
    """The control run of docs/agentic.md's curve: on the tasks whose first number is odd the
    calculator answers a random digit. The model cannot tell those tasks apart, so it calls the
    tool there as often; if the rise came from calling rather than from what the tool says, their
    reward would rise too. The two halves' scores are logged as `rollout/reward/tool_score` and
    `rollout/reward/control_score`."""
    control = int(task["metadata"]["a"]) % 2 == 1
    scores = await play(base_url, api_key, task, useless_calculator if control else calculator)
    return {**scores, "control_score" if control else "tool_score": scores["score"]}
