"""Toy prompt sets with verifiable answers, for testing the RL loop on tiny models.

Lines have the same shape as real data sets, `{"prompt", "label", "metadata": {"task", ...}}`,
so the loader and reward path under test are the production ones. Measured with a bare GRPO loop on
the tiny Qwen3-MoE: only `mod_sum` (one answer token) learns from random initialisation in a few
hundred steps; `add`, `reverse` and `chain`-style multi-step tasks need a supervised warm-up first.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimrl.errors import SlimError
from slimrl.utils.fs import atomic_write_text

Sample = tuple[str | list[dict[str, Any]], str, dict[str, Any]]
"""(prompt, label, task-specific metadata)."""

ANSWER_STOPS: tuple[str, ...] = ("\n", "<|im_end|>", "<|endoftext|>")
"""The answer ends at the first newline or end-of-text token, whatever the model writes after it."""


def extract_answer(response_text: str) -> str:
    """The response up to its first stop marker, stripped of surrounding whitespace."""
    end = min((i for i in (response_text.find(stop) for stop in ANSWER_STOPS) if i >= 0), default=None)
    return response_text[:end].strip()


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    generator: Callable[[random.Random], Sample]
    tools: list[dict[str, Any]] | None = None
    """OpenAI function tools written into every record (`data.tools_key`), for chat templates."""

    def generate(self, rng: random.Random) -> Sample:
        prompt, label, metadata = self.generator(rng)
        return prompt, label, {"task": self.name, **metadata}

    def score(self, response_text: str, label: str) -> float:
        """1.0 for an exact answer, else 0.0: a binary, verifiable reward."""
        return 1.0 if extract_answer(response_text) == label else 0.0


def _mod_sum(rng: random.Random) -> Sample:
    # Single-digit operands: 100 prompts, each answered by one token, so a random policy scores
    # 1 in 10 and GRPO gets signal from the first step.
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"{a}+{b}=", str((a + b) % 10), {"a": a, "b": b}


def _add(rng: random.Random) -> Sample:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}=", str(a + b), {"a": a, "b": b}


def _reverse(rng: random.Random) -> Sample:
    digits = "".join(str(rng.randint(0, 9)) for _ in range(3))
    return f"rev {digits}=", digits[::-1], {"digits": digits}


def _chain(rng: random.Random, steps: int = 2) -> Sample:
    """`a op b op c=` with + or -, every partial result kept in 0..9 so the answer is one digit."""
    value = rng.randint(0, 9)
    text, operands, ops = str(value), [value], []
    for _ in range(steps):
        op = rng.choice("+-")
        operand = rng.randint(0, 9 - value) if op == "+" else rng.randint(0, value)
        value = value + operand if op == "+" else value - operand
        text += f"{op}{operand}"
        operands.append(operand)
        ops.append(op)
    return f"{text}=", str(value), {"operands": operands, "ops": "".join(ops)}


CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Work out the arithmetic in the user's question.",
        "parameters": {"type": "object", "properties": {}},
    },
}
"""The tool of `examples/calculator_agent.py`, as the agent declares it (a test holds them equal):
the tool_sum_sft conversations must render the system turn the agent's calls render. It takes no
arguments (it reads the question from the agent's task) because the tiny model learns to copy
numbers into a call only after hundreds of SFT steps (docs/plan.md, session 25)."""


def _tool_sum(rng: random.Random) -> Sample:
    # Two-digit operands: the answer's digit is (a mod 10 + b mod 10) mod 10, the demo's task, which
    # the tiny model learns only in hundreds of RL steps; the calculator's result ends with it.
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}=", str((a + b) % 10), {"a": a, "b": b}


def _tool_sum_sft(rng: random.Random) -> Sample:
    """A whole conversation in OpenAI's message format, for a warm start that teaches the formats
    and not the choice: half the time the assistant calls the calculator (whose result the agent
    reports), half the time it answers a random digit itself. Only the assistant turn is trained."""
    prompt, label, metadata = _tool_sum(rng)
    user = {"role": "user", "content": prompt}
    if rng.random() < 0.5:
        call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
        return [user, {"role": "assistant", "content": "", "tool_calls": [call]}], label, metadata
    return [user, {"role": "assistant", "content": str(rng.randint(0, 9))}], label, metadata


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task("mod_sum", "a+b= with a, b in 0..9; answer (a+b) mod 10 (one digit)", _mod_sum),
        Task("add", "a+b= with a, b in 0..99; answer the full sum", _add),
        Task("reverse", "rev ddd= ; answer the three digits reversed", _reverse),
        Task("chain", "a+b-c= style two-step chain, partial results in 0..9; answer one digit", _chain),
        Task(
            "tool_sum",
            "a+b= with a, b in 10..99; answer (a+b) mod 10, which an agent's calculator tool gives",
            _tool_sum,
        ),
        Task(
            "tool_sum_sft",
            "tool_sum conversations for an SFT warm start: a calculator call or a random digit, half each",
            _tool_sum_sft,
            tools=[CALCULATOR_TOOL],
        ),
    )
}


def get_task(name: str) -> Task:
    task = TASKS.get(name)
    if task is None:
        raise SlimError(f"unknown toy task `{name}` (valid: {', '.join(TASKS)})")
    return task


def generate_samples(task: str, num_samples: int, seed: int = 0) -> list[dict[str, Any]]:
    """`num_samples` records of `task`, a pure function of (task, num_samples, seed)."""
    spec = get_task(task)
    if num_samples < 1:
        raise SlimError(f"make-data --num {num_samples}: must be >= 1")
    rng = random.Random(seed)
    records = []
    for _ in range(num_samples):
        prompt, label, metadata = spec.generate(rng)
        record = {"prompt": prompt, "label": label, "metadata": metadata}
        records.append(record if spec.tools is None else {**record, "tools": spec.tools})
    return records


def make_data(task: str, out: str | Path, *, num_samples: int = 1000, seed: int = 0) -> Path:
    """Write `num_samples` JSONL lines of `task` to `out` atomically (replacing an existing file)."""
    out = Path(out)
    if out.is_dir():
        raise SlimError(f"make-data --out {out}: is a directory; give a .jsonl file path")
    records = generate_samples(task, num_samples, seed)
    return atomic_write_text(out, "".join(json.dumps(record) + "\n" for record in records))
