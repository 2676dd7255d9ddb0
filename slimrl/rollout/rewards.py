"""Rewards for finished samples: built-in rule-based scorers, a remote reward model, user hooks.

`compute_rewards` fills `Sample.reward` from `config.rollout`:

* `custom_rm_path` set: the user hook, per sample `async def rm(config, sample) -> float | dict`,
  or with `group_rm` per prompt group `async def rm(config, samples) -> list[float | dict]`;
* otherwise `reward_type`: `toy` (exact answer of the toy task in `metadata["task"]`), `math`
  (boxed answer or final number against the label), `remote` (POST to `remote_rm_url`), `none`
  (rewards were set elsewhere, e.g. by a custom generate function; missing ones become 0.0).

A reward may be a dict of named parts (`{"score": 1.0, "format": 0.2}`) so they can be logged
separately; the trainer optimises only `"score"` (see `scalar_reward`).
"""

from __future__ import annotations

import asyncio
import json
import math
import numbers
import re
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from slimrl.config.schema import SlimConfig
from slimrl.data.toy_tasks import TASKS, get_task
from slimrl.errors import ConfigError, SlimError
from slimrl.rollout.hooks import load_hook
from slimrl.sample import Sample

Reward = float | dict[str, float]

REWARD_KEY = "score"
"""The entry of a dict reward that the trainer optimises."""

# ---------------------------------------------------------------------------------------------
# Answer extraction and normalisation


# A number not glued to a preceding digit or dot: optional sign, digits with optional thousands
# separators (1,234), optional decimals, optional `/denominator`. `5-3` yields 3, not -3.
_NUMBER = re.compile(r"(?<![\d.])-?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:/\d+)?")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL = re.compile(r"-?\d*\.\d+")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_LATEX_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_LATEX_SPACES = ("\\!", "\\,", "\\;", "\\:")
_BOX = "\\boxed"


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces kept); None if absent or left unclosed.

    An unclosed last box means the response was cut mid-answer: an earlier box is not used
    because the model may have revised it.
    """
    start = text.rfind(_BOX + "{")
    if start < 0:
        return None
    depth = 0
    open_at = start + len(_BOX)
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None


def extract_final_number(text: str) -> str | None:
    """The last number in `text` with thousands separators removed ("1,234" -> "1234"), or None.

    LaTeX fractions count as one number (`\\frac{3}{4}` -> "3/4"), not as their last digit.
    """
    matches = _NUMBER.findall(_LATEX_FRAC.sub(r"\1/\2", text))
    return matches[-1].replace(",", "") if matches else None


def normalize_answer(answer: str) -> str:
    """Canonical text of an answer so "$2.50$." and "2.5" compare equal."""
    s = str(answer).replace("$", "")
    for space in _LATEX_SPACES:
        s = s.replace(space, "")
    s = _LATEX_FRAC.sub(r"\1/\2", s)
    s = "".join(s.split()).rstrip(".").removeprefix("+")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if _DECIMAL.fullmatch(s):
        s = s.rstrip("0").rstrip(".") or "0"
    return "0" if s in ("-0", "-") else s


def _to_number(s: str) -> float | None:
    """A normalised answer as a float (plain number or `a/b`), None when it is not one."""
    parts = s.split("/")
    if len(parts) > 2 or not all(_PLAIN_NUMBER.fullmatch(p) for p in parts):
        return None
    if len(parts) == 1:
        return float(parts[0])
    denominator = float(parts[1])
    return float(parts[0]) / denominator if denominator else None


def answers_match(predicted: str, label: str) -> bool:
    """Equal after normalisation, or numerically equal within 1e-6 relative tolerance."""
    predicted, label = normalize_answer(predicted), normalize_answer(label)
    if predicted == label:
        return True
    a, b = _to_number(predicted), _to_number(label)
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6)


# ---------------------------------------------------------------------------------------------
# Built-in scorers


def math_reward(response: str, label: Any) -> float:
    """1.0 when the boxed answer (or, with no box at all, the final number) matches the label."""
    if label is None:
        return 0.0
    predicted = extract_boxed(response)
    if predicted is None and _BOX not in response:
        predicted = extract_final_number(response)
    return 1.0 if predicted is not None and answers_match(predicted, str(label)) else 0.0


def toy_reward(response: str, label: Any, task: str | None) -> float:
    """The toy task's own scorer when `task` is known, else exact match of the first line."""
    if task in TASKS:
        return get_task(task).score(response, str(label))
    lines = response.strip().splitlines()
    first_line = lines[0].strip() if lines else ""
    return 1.0 if first_line == str(label).strip() else 0.0


def scalar_reward(reward: Reward | None) -> float:
    """The number the trainer optimises: the reward itself, or its `"score"` entry for a dict."""
    if isinstance(reward, dict):
        if REWARD_KEY not in reward:
            raise SlimError(
                f"reward dict has no `{REWARD_KEY}` key (keys: {', '.join(map(str, reward)) or 'none'}); "
                f"the trainer optimises reward[{REWARD_KEY!r}]"
            )
        reward = reward[REWARD_KEY]
    if not isinstance(reward, numbers.Real):
        raise SlimError(f"reward {reward!r} is not a number (was the sample scored?)")
    return float(reward)


# ---------------------------------------------------------------------------------------------
# Remote reward model


class RemoteRewardClient:
    """Scores samples with an HTTP reward model.

    Protocol: POST `{"samples": [{"prompt", "response", "label", "metadata"}, ...]}`, answer
    `{"rewards": [float, ...]}` in the same order. Connection errors, timeouts and 5xx are retried
    with exponential backoff (the RM may be restarting or overloaded); a 4xx or a malformed answer
    is a bug on one side and fails at once.
    """

    def __init__(self, url: str, timeout_s: float = 30.0, max_retries: int = 3, backoff_s: float = 0.5):
        self.url = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s

    async def score(self, samples: list[Sample]) -> list[float]:
        if not samples:
            return []
        body = self._encode(samples)
        last_error = ""
        # One session per call: it is bound to the running event loop, and callers may use several.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as session:
            for attempt in range(self.max_retries + 1):
                if attempt:
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    status, text = await self._post(session, body)
                except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
                    last_error = self._describe(exc)
                    continue
                if status >= 500:
                    last_error = f"HTTP {status}: {_snippet(text)}"
                    continue
                if status >= 300:
                    raise SlimError(f"remote reward model {self.url}: HTTP {status}: {_snippet(text)}")
                return self._decode(text, len(samples))
        attempts = self.max_retries + 1
        raise SlimError(
            f"remote reward model {self.url}: failed {attempts} attempts, last error: {last_error}"
        )

    async def _post(self, session: aiohttp.ClientSession, body: bytes) -> tuple[int, str]:
        headers = {"Content-Type": "application/json"}
        async with session.post(self.url, data=body, headers=headers) as response:
            return response.status, (await response.read()).decode("utf-8", errors="replace")

    def _encode(self, samples: list[Sample]) -> bytes:
        items = [
            {"prompt": s.prompt, "response": s.response, "label": s.label, "metadata": s.metadata}
            for s in samples
        ]
        try:
            return json.dumps({"samples": items}).encode()
        except (TypeError, ValueError) as exc:
            raise SlimError(
                f"remote reward model {self.url}: samples are not JSON-serialisable: {exc}"
            ) from exc

    def _decode(self, text: str, expected: int) -> list[float]:
        try:
            rewards = json.loads(text)["rewards"]
        except (json.JSONDecodeError, TypeError, KeyError):
            raise SlimError(
                f'remote reward model {self.url}: expected {{"rewards": [...]}}, got {_snippet(text)}'
            ) from None
        valid = isinstance(rewards, list) and all(_is_number(r) for r in rewards)
        if not valid or len(rewards) != expected:
            raise SlimError(
                f"remote reward model {self.url}: expected {expected} numeric rewards, got {_snippet(text)}"
            )
        return [float(r) for r in rewards]

    def _describe(self, exc: BaseException) -> str:
        if isinstance(exc, TimeoutError):
            return f"timed out after {self.timeout_s}s"
        return f"{type(exc).__name__}: {_snippet(str(exc))}"


def _snippet(text: str, limit: int = 200) -> str:
    """Text squeezed onto one line and cut, for one-line error messages."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value)


# ---------------------------------------------------------------------------------------------
# Dispatch

_BUILTIN: dict[str, Callable[[Sample], float]] = {
    "toy": lambda s: toy_reward(s.response, s.label, s.metadata.get("task")),
    "math": lambda s: math_reward(s.response, s.label),
}


async def compute_rewards(config: SlimConfig, samples: list[Sample]) -> None:
    """Set `reward` on every sample, in place (see the module docstring for the sources)."""
    rollout = config.rollout
    if rollout.agent_function_path:  # the agent's return value, set with its samples (rollout/agent/)
        return
    if rollout.custom_rm_path:
        await _custom_rewards(config, samples)
    elif rollout.reward_type in _BUILTIN:
        scorer = _BUILTIN[rollout.reward_type]
        for sample in samples:
            sample.reward = scorer(sample)
    elif rollout.reward_type == "remote":
        if not rollout.remote_rm_url:
            raise ConfigError("rollout.reward_type is `remote` but rollout.remote_rm_url is not set")
        rewards = await RemoteRewardClient(rollout.remote_rm_url).score(samples)
        for sample, reward in zip(samples, rewards, strict=True):
            sample.reward = reward
    elif rollout.reward_type == "none":
        for sample in samples:
            if sample.reward is None:
                sample.reward = 0.0
    else:
        valid = ", ".join([*_BUILTIN, "remote", "none"])
        raise ConfigError(f"rollout.reward_type `{rollout.reward_type}` is not one of: {valid}")


async def _custom_rewards(config: SlimConfig, samples: list[Sample]) -> None:
    rollout = config.rollout
    path = rollout.custom_rm_path
    hook = load_hook(config, "reward")
    assert path is not None and hook is not None
    # Bounded like generation: a hook that calls a service must not open one request per sample at once.
    limit = asyncio.Semaphore(rollout.max_concurrency)

    async def bounded(awaitable: Awaitable[Any]) -> Any:
        async with limit:
            return await awaitable

    if rollout.group_rm:
        groups = _groups(samples)
        results = await asyncio.gather(*(bounded(hook(config, group)) for group in groups))
        for group, result in zip(groups, results, strict=True):
            _assign_group(path, group, result)
    else:
        results = await asyncio.gather(*(bounded(hook(config, sample)) for sample in samples))
        for sample, result in zip(samples, results, strict=True):
            sample.reward = _checked(path, result)


def _groups(samples: list[Sample]) -> list[list[Sample]]:
    """Samples split by `group_index`, groups in order of first appearance."""
    by_index: dict[int, list[Sample]] = {}
    for sample in samples:
        by_index.setdefault(sample.group_index, []).append(sample)
    return list(by_index.values())


def _assign_group(path: str, group: list[Sample], result: Any) -> None:
    if not isinstance(result, list | tuple) or len(result) != len(group):
        got = f"{len(result)} values" if isinstance(result, list | tuple) else type(result).__name__
        raise SlimError(
            f"custom reward hook {path} (group_rm): must return a list of {len(group)} rewards "
            f"for group {group[0].group_index}, got {got}"
        )
    for sample, value in zip(group, result, strict=True):
        sample.reward = _checked(path, value)


def _checked(path: str, value: Any) -> Reward:
    """A hook's reward, verified now so a bad one names the hook instead of failing in the trainer."""
    if isinstance(value, dict):
        try:
            if not _is_number(scalar_reward(value)):
                raise SlimError(f"reward[{REWARD_KEY!r}] is not finite")
        except SlimError as exc:
            raise SlimError(f"custom reward hook {path}: returned {_snippet(repr(value))}: {exc}") from None
        return value
    if not _is_number(value):
        raise SlimError(
            f"custom reward hook {path}: returned {_snippet(repr(value))} ({type(value).__name__}); "
            "expected a finite float/int or a dict with a `score` entry"
        )
    return float(value)
