"""The gym shape for agentic RL: an `Environment` (reset / step) and the built-in agent that drives
it through the same OpenAI endpoint as any other agent (docs/agentic.md).

    class Guess:                                    # any class with these two methods
        def reset(self, task: dict) -> str | list[dict]: ...       # the first observation
        def step(self, action: str) -> Step: ...                   # what the model said -> Step

    run_agent = environment_agent(Guess, max_turns=4)   # rollout.agent_function_path: mymod.run_agent

Each agent run builds a fresh environment (`make_env()`: one per sample, so a group's runs share
nothing), asks the model through the endpoint, hands the reply's text to `step`, and sends the
observation back as the next user turn (or as the chat messages it is) until the environment says
`done` or `max_turns` replies were made. The run's reward is the sum of the steps' rewards
(`score`), logged with the number of turns, whether the environment finished, and the last step's
numeric `info`. Both methods may be coroutines. Everything else is an agent's: the trajectory is
recorded token for token, the observations are loss mask 0, a raising environment is a failed
sample with its reason.

Decision: an environment is not a hook kind of its own but the argument of an agent factory, so
every rule for agents (the config checks, the timeout, failed samples) holds for it unchanged, and
the user's module states both the environment and its turn limit in one line.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from slimrl.rollout.agent.runner import finite_number

Observation = str | list[dict[str, Any]]
"""A user message's text, or chat messages (e.g. a system turn and a user turn)."""


@dataclass(frozen=True)
class Step:
    """What the environment answers to one action."""

    observation: Observation | None = None
    """The next turn's input (ignored when `done`)."""
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Numbers here (of the last step) are logged with the reward."""


class Environment(Protocol):
    def reset(self, task: dict[str, Any]) -> Observation | Awaitable[Observation]:
        """Start an episode on the data row `task` (`prompt`, `label`, `metadata`)."""
        ...

    def step(self, action: str) -> Step | Awaitable[Step]:
        """The model's reply (its text) -> the next observation, the reward and whether it is over."""
        ...


AgentFn = Callable[[str, str, dict[str, Any]], Awaitable[dict[str, float]]]


def environment_agent(make_env: Callable[[], Environment], max_turns: int = 8) -> AgentFn:
    """An agent (`rollout.agent_function_path`) that plays `make_env()`'s episode with the model."""
    if not callable(make_env):
        raise TypeError(f"environment_agent: make_env must be a class or factory, got {make_env!r}")
    if not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"environment_agent: max_turns must be an integer >= 1, got {max_turns!r}")

    async def run_agent(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, float]:
        return await play(make_env(), base_url, api_key, task, max_turns)

    run_agent.__qualname__ = f"environment_agent({getattr(make_env, '__qualname__', make_env)!s})"
    return run_agent


async def play(env: Environment, base_url: str, api_key: str, task: dict[str, Any], max_turns: int):
    """One episode: the model acts through the endpoint at `base_url`; the reward and its parts."""
    from openai import AsyncOpenAI  # the agent client the issue names; installed beside SGLang

    messages = messages_of(await _maybe_await(env.reset(task)), "reset")
    total, turns, last = 0.0, 0, Step()
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        while turns < max_turns and not last.done:
            reply = await client.chat.completions.create(model="policy", messages=messages)
            action = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": action})
            turns += 1
            last = step_of(await _maybe_await(env.step(action)))
            total += last.reward
            if not last.done and last.observation is not None:
                messages += messages_of(last.observation, "step")
    numbers = {k: float(v) for k, v in last.info.items() if _is_number(v) and k not in ("score", "turns")}
    return {"score": total, "turns": float(turns), "done": float(last.done), **numbers}


def messages_of(observation: Any, method: str) -> list[dict[str, Any]]:
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, list) and all(isinstance(m, dict) and "role" in m for m in observation):
        return list(observation)
    raise TypeError(
        f"the environment's {method}() gave {type(observation).__name__}; an observation is a str "
        f"or a list of chat messages (dicts with a role)"
    )


def step_of(value: Any) -> Step:
    """A `Step`, or gym's `(observation, reward, done)` tuple; the reward a finite number."""
    if isinstance(value, tuple) and len(value) == 3:
        value = Step(observation=value[0], reward=value[1], done=bool(value[2]))
    if not isinstance(value, Step):
        raise TypeError(
            f"the environment's step() gave {type(value).__name__}; expected a slimrl Step or "
            f"(observation, reward, done)"
        )
    if not finite_number(value.reward):
        raise TypeError(f"the environment's step() gave reward {value.reward!r}; expected a finite number")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
