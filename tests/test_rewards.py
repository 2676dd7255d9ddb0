"""Rewards: answer extraction on tricky text, built-in scorers, custom hooks, and the remote RM
client against a real aiohttp server on 127.0.0.1 that scripts its answers and counts requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from slimrl.config.schema import SlimConfig
from slimrl.errors import ConfigError, SlimError
from slimrl.rollout.rewards import (
    RemoteRewardClient,
    compute_rewards,
    extract_boxed,
    extract_final_number,
    math_reward,
    normalize_answer,
    scalar_reward,
    toy_reward,
)
from slimrl.sample import Sample

# --- extraction and normalisation ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{\frac{3}{4}}.", r"\frac{3}{4}"),
        (r"first \boxed{1}, then \boxed{2}", "2"),
        (r"\boxed{\{a, {b}\}} done", r"\{a, {b}\}"),
        (r"\boxed{x^{2}+\sqrt{y_{1}}}", r"x^{2}+\sqrt{y_{1}}"),
        (r"earlier \boxed{3}, finally \boxed{4", None),  # cut mid-answer: the revised box is lost
        ("no box here 42", None),
        (r"\boxed{}", ""),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 1,234.", "1234"),
        ("from 2 to 1,234,567 people", "1234567"),
        ("it drops to -3.50", "-3.50"),
        ("3/4 of them, i.e. 3/4", "3/4"),
        ("we take -7/8", "-7/8"),
        (r"so it is $\frac{3}{4}$ in total", "3/4"),
        ("5-3", "3"),  # a subtraction, not a negative number
        ("x = -2, then 7.5.", "7.5"),
        ("value .5", ".5"),
        ("1,2345", "2345"),  # not a thousands separator
        ("no digits at all", None),
    ],
)
def test_extract_final_number(text: str, expected: str | None) -> None:
    assert extract_final_number(text) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (" $2.50$. ", "2.5"),
        ("2.0", "2"),
        ("+7", "7"),
        ("100", "100"),  # trailing zeros of integers stay
        ("-0.0", "0"),
        ("1,234", "1234"),
        (r"\frac{3}{4}", "3/4"),
        (r"-\dfrac{1}{2}", "-1/2"),
        ("x + 1", "x+1"),
        ("1\\,000", "1000"),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        (r"so $\boxed{\frac{3}{4}}$", "0.75", 1.0),
        (r"so $\boxed{\frac{3}{4}}$", "3/4", 1.0),
        (r"\boxed{0.75}", r"\frac{3}{4}", 1.0),
        ("The answer is 1,234.", "1234", 1.0),
        ("The answer is 1,234.", 1234, 1.0),  # non-string labels
        (r"The answer is $\frac{3}{4}$.", "0.75", 1.0),
        ("it ends at -3.50", "-3.5", 1.0),
        (r"\boxed{2} no wait \boxed{5}. Checking 2 again", "5", 1.0),  # the box wins over the last number
        (r"\boxed{2} no wait \boxed{5}", "2", 0.0),
        (r"\boxed{0.3333333}", "1/3", 1.0),  # within 1e-6 relative
        (r"\boxed{0.333}", "1/3", 0.0),
        (r"\boxed{x + 1}", "x+1", 1.0),
        (r"\boxed{7", "7", 0.0),  # an unclosed box is not answered by the number inside it
        ("nothing numeric", "3", 0.0),
        (r"\boxed{3}", None, 0.0),
    ],
)
def test_math_reward(response: str, label: Any, reward: float) -> None:
    assert math_reward(response, label) == reward


def test_toy_reward() -> None:
    assert toy_reward(" 7\n8+1=9", "7", "mod_sum") == 1.0
    assert toy_reward("17", "7", "mod_sum") == 0.0
    assert toy_reward("  42  \nmore text", "42", None) == 1.0
    assert toy_reward("  42  \nmore text", 42, "not_a_task") == 1.0
    assert toy_reward("", "42", None) == 0.0


def test_scalar_reward() -> None:
    assert scalar_reward(1) == 1.0
    assert scalar_reward({"score": 0.5, "format": 0.2}) == 0.5
    with pytest.raises(SlimError, match=r"reward dict has no `score` key \(keys: format\)"):
        scalar_reward({"format": 1.0})
    with pytest.raises(SlimError, match="is not a number"):
        scalar_reward(None)


# --- remote reward model -------------------------------------------------------------------------

Action = Callable[[dict[str, Any]], Awaitable[web.StreamResponse]]


def status(code: int) -> Action:
    async def act(body: dict[str, Any]) -> web.StreamResponse:
        return web.Response(status=code, text=f"scripted {code}")

    return act


def rewards_of(fn: Callable[[dict[str, Any]], list[float]]) -> Action:
    async def act(body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"rewards": fn(body)})

    return act


def raw(text: str) -> Action:
    async def act(body: dict[str, Any]) -> web.StreamResponse:
        return web.Response(text=text, content_type="application/json")

    return act


def sleep(seconds: float) -> Action:
    async def act(body: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(seconds)
        return web.json_response({"rewards": [0.0] * len(body["samples"])})

    return act


def lengths(body: dict[str, Any]) -> list[float]:
    return [float(len(s["response"])) for s in body["samples"]]


@dataclass
class ScriptedRM:
    """Answers request k with script[k] (the last action repeats); records every request body."""

    script: list[Action]
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        return await self.script[min(len(self.bodies), len(self.script)) - 1](body)


@asynccontextmanager
async def scripted_rm(*script: Action) -> AsyncIterator[ScriptedRM]:
    rm = ScriptedRM(list(script))
    app = web.Application()
    app.router.add_post("/score", rm.handle)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    rm.url = f"http://{host}:{port}/score"
    try:
        yield rm
    finally:
        await runner.cleanup()


def _samples(*responses: str) -> list[Sample]:
    return [
        Sample(index=i, prompt=f"p{i}", response=r, label=str(i), metadata={"task": "t"})
        for i, r in enumerate(responses)
    ]


def test_remote_retries_a_503_then_succeeds() -> None:
    async def run() -> tuple[list[float], ScriptedRM]:
        async with scripted_rm(status(503), rewards_of(lengths)) as rm:
            client = RemoteRewardClient(rm.url, timeout_s=5.0, max_retries=3, backoff_s=0.01)
            return await client.score(_samples("ab", "abcd")), rm

    rewards, rm = asyncio.run(run())
    assert rewards == [2.0, 4.0]
    assert len(rm.bodies) == 2
    assert rm.bodies[1] == {
        "samples": [
            {"prompt": "p0", "response": "ab", "label": "0", "metadata": {"task": "t"}},
            {"prompt": "p1", "response": "abcd", "label": "1", "metadata": {"task": "t"}},
        ]
    }


def test_remote_timeout_exhausts_retries() -> None:
    async def run() -> tuple[str, int]:
        async with scripted_rm(sleep(2.0)) as rm:
            client = RemoteRewardClient(rm.url, timeout_s=0.2, max_retries=2, backoff_s=0.01)
            with pytest.raises(SlimError) as info:
                await client.score(_samples("x"))
            return str(info.value), len(rm.bodies)

    message, requests = asyncio.run(run())
    assert requests == 3
    assert message.endswith("failed 3 attempts, last error: timed out after 0.2s")
    assert "/score" in message and "\n" not in message


def test_remote_persistent_5xx_reports_last_error() -> None:
    async def run() -> tuple[str, int]:
        async with scripted_rm(status(503), status(502)) as rm:
            client = RemoteRewardClient(rm.url, max_retries=1, backoff_s=0.01)
            with pytest.raises(SlimError) as info:
                await client.score(_samples("x"))
            return str(info.value), len(rm.bodies)

    message, requests = asyncio.run(run())
    assert requests == 2
    assert message.endswith("failed 2 attempts, last error: HTTP 502: scripted 502")


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        (status(400), "HTTP 400: scripted 400"),
        (raw("not json"), 'expected {"rewards": [...]}, got not json'),
        (raw('{"scores": [1.0]}'), 'expected {"rewards": [...]}'),
        (raw('{"rewards": [1.0]}'), 'expected 2 numeric rewards, got {"rewards": [1.0]}'),
        (raw('{"rewards": [1.0, "high"]}'), "expected 2 numeric rewards"),
    ],
)
def test_remote_client_errors_are_not_retried(action: Action, expected: str) -> None:
    async def run() -> tuple[str, ScriptedRM]:
        async with scripted_rm(action, rewards_of(lengths)) as rm:
            client = RemoteRewardClient(rm.url, max_retries=3, backoff_s=0.01)
            with pytest.raises(SlimError) as info:
                await client.score(_samples("a", "b"))
            return str(info.value), rm

    message, rm = asyncio.run(run())
    assert len(rm.bodies) == 1
    assert message.startswith(f"remote reward model {rm.url}: ")
    assert expected in message


def test_remote_connection_refused() -> None:
    async def run() -> str:
        async with scripted_rm(status(200)) as rm:
            url = rm.url  # the server is gone after this block: its port refuses connections
        with pytest.raises(SlimError) as info:
            await RemoteRewardClient(url, max_retries=1, backoff_s=0.01).score(_samples("a"))
        return str(info.value)

    message = asyncio.run(run())
    assert "failed 2 attempts, last error: ClientConnectorError" in message
    assert "\n" not in message


# --- compute_rewards -----------------------------------------------------------------------------


def _config(**rollout: Any) -> SlimConfig:
    config = SlimConfig()
    for name, value in rollout.items():
        setattr(config.rollout, name, value)
    return config


def test_builtin_toy_and_math() -> None:
    samples = [
        Sample(response="7\n", label="7", metadata={"task": "mod_sum"}),
        Sample(response="8", label="7", metadata={"task": "mod_sum"}),
        Sample(response=" hello \nworld", label="hello"),  # no task: first-line exact match
    ]
    asyncio.run(compute_rewards(_config(reward_type="toy"), samples))
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]

    samples = [Sample(response=r"\boxed{\frac{1}{2}}", label="0.5"), Sample(response="so 3", label="4")]
    asyncio.run(compute_rewards(_config(reward_type="math"), samples))
    assert [s.reward for s in samples] == [1.0, 0.0]


def test_reward_type_none_keeps_preset_rewards() -> None:
    samples = [Sample(reward=0.7), Sample()]
    asyncio.run(compute_rewards(_config(reward_type="none"), samples))
    assert [s.reward for s in samples] == [0.7, 0.0]


def test_reward_type_remote() -> None:
    async def run() -> tuple[list[Sample], int]:
        async with scripted_rm(rewards_of(lengths)) as rm:
            samples = _samples("abc", "")
            await compute_rewards(_config(reward_type="remote", remote_rm_url=rm.url), samples)
            return samples, len(rm.bodies)

    samples, requests = asyncio.run(run())
    assert [s.reward for s in samples] == [3.0, 0.0]
    assert requests == 1
    with pytest.raises(ConfigError, match=r"rollout\.remote_rm_url is not set"):
        asyncio.run(compute_rewards(_config(reward_type="remote"), _samples("a")))


def test_custom_rm_per_sample() -> None:
    samples = _samples("a", "abc")
    config = _config(custom_rm_path="hook_fixtures.length_rm", reward_type="math")
    asyncio.run(compute_rewards(config, samples))
    assert [s.reward for s in samples] == [1.0, 3.0]

    samples = [Sample(response="yes", label="yes"), Sample(response="no", label="yes")]
    asyncio.run(compute_rewards(_config(custom_rm_path="hook_fixtures.dict_rm"), samples))
    assert [s.reward for s in samples] == [{"score": 1.0, "format": 0.5}, {"score": 0.0, "format": 0.5}]
    assert [scalar_reward(s.reward) for s in samples] == [1.0, 0.0]


def test_custom_group_rm() -> None:
    samples = [
        Sample(group_index=0, response="a"),
        Sample(group_index=1, response="bbb"),
        Sample(group_index=0, response="aa"),
        Sample(group_index=1, response="b"),
    ]
    config = _config(custom_rm_path="hook_fixtures.rank_in_group_rm", group_rm=True)
    asyncio.run(compute_rewards(config, samples))
    assert [s.reward for s in samples] == [0.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("hook", "group_rm", "expected"),
    [
        ("string_rm", False, "custom reward hook hook_fixtures.string_rm: returned '1.0' (str)"),
        ("nan_rm", False, "custom reward hook hook_fixtures.nan_rm: returned nan (float)"),
        ("dict_without_score_rm", False, "dict_without_score_rm: returned {'format': 0.5}: reward dict"),
        ("short_group_rm", True, "must return a list of 2 rewards for group 0, got 1 values"),
    ],
)
def test_custom_rm_bad_returns(hook: str, group_rm: bool, expected: str) -> None:
    config = _config(custom_rm_path=f"hook_fixtures.{hook}", group_rm=group_rm)
    with pytest.raises(SlimError) as info:
        asyncio.run(compute_rewards(config, [Sample(response="a"), Sample(response="b")]))
    assert expected in str(info.value)


def test_custom_rm_must_be_async() -> None:
    with pytest.raises(
        ConfigError, match=r"^rollout.custom_rm_path=hook_fixtures.sync_rm: must be an `async"
    ):
        asyncio.run(compute_rewards(_config(custom_rm_path="hook_fixtures.sync_rm"), _samples("a")))


def test_remote_body_must_be_json() -> None:
    """Labels JSON cannot carry fail before any request is sent, naming the URL."""
    with pytest.raises(SlimError, match=r"^remote reward model http://127.0.0.1:9/score: .*not JSON"):
        asyncio.run(RemoteRewardClient("http://127.0.0.1:9/score").score([Sample(label={1, 2})]))
