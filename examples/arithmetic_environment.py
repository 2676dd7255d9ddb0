"""An environment in the gym shape, trained through the built-in environment agent (set
`rollout.agent_function_path: examples.arithmetic_environment.run_agent`; docs/agentic.md).

The episode: the task's question; the model answers; a wrong answer gets feedback and another try,
up to three replies. Reward 1 for the first correct answer, nothing otherwise. The model never sees
a `Sample` and neither does this file: `environment_agent` plays the episode through slimrl's
OpenAI endpoint, so every reply is trained on token for token as sampled, the feedback turns with
loss mask 0.
"""

from __future__ import annotations

import re
from typing import Any

from slimrl.rollout.agent.environment import Step, environment_agent

_INTEGER = re.compile(r"-?\d+")


class Arithmetic:
    def reset(self, task: dict[str, Any]) -> str:
        self.label = str(task["label"]).strip()
        self.tries = 0
        return str(task["prompt"])

    def step(self, action: str) -> Step:
        self.tries += 1
        numbers = _INTEGER.findall(action)
        if numbers and numbers[-1] == self.label:
            return Step(reward=1.0, done=True, info={"tries": self.tries})
        return Step("Not quite. Reply with the number only.", info={"tries": self.tries})


run_agent = environment_agent(Arithmetic, max_turns=3)
