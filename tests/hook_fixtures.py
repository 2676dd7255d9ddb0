"""Hook functions loaded by dotted path in tests (`hook_fixtures.<name>`): good ones and broken ones."""

from __future__ import annotations

from typing import Any

NOT_CALLABLE = 42


def sync_two(config: Any, sample: Any) -> float:
    return 1.0


def one_param(config: Any) -> float:
    return 1.0


def var_args(*args: Any) -> float:
    return 1.0


def with_default(config: Any, sample: Any, scale: float = 1.0) -> float:
    return scale


def needs_keyword(config: Any, sample: Any, *, tokenizer: Any) -> float:
    return 1.0


class Scorer:
    @staticmethod
    def score(config: Any, sample: Any) -> float:
        return 1.0


class AsyncCallable:
    async def __call__(self, config: Any, sample: Any) -> float:
        return 1.0


async_callable = AsyncCallable()


# --- custom reward hooks (rollout.custom_rm_path) ------------------------------------------------


async def length_rm(config: Any, sample: Any) -> float:
    """Reward = response length: distinct per sample, so the test sees each one went to its sample."""
    return len(sample.response)


async def dict_rm(config: Any, sample: Any) -> dict[str, float]:
    return {"score": 1.0 if sample.response == sample.label else 0.0, "format": 0.5}


async def dict_without_score_rm(config: Any, sample: Any) -> dict[str, float]:
    return {"format": 0.5}


async def string_rm(config: Any, sample: Any) -> str:
    return "1.0"


async def nan_rm(config: Any, sample: Any) -> float:
    return float("nan")


async def rank_in_group_rm(config: Any, samples: list[Any]) -> list[float]:
    """Group reward: 1.0 for the longest response of the group, 0.0 for the others."""
    longest = max(len(s.response) for s in samples)
    return [1.0 if len(s.response) == longest else 0.0 for s in samples]


async def short_group_rm(config: Any, samples: list[Any]) -> list[float]:
    return [1.0] * (len(samples) - 1)


def sync_rm(config: Any, sample: Any) -> float:
    return 1.0


async def gated_generate(ctx: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """The built-in generate, held at rollout 2 until `<run dir>/gate` exists (announced by
    `<run dir>/waiting`): a test can then act while that rollout is certainly in flight."""
    import asyncio
    from pathlib import Path

    from slimrl.rollout.generate import generate

    run_dir = Path(ctx.config.run.runs_dir) / ctx.config.run.name
    if ctx.rollout_id == 2:
        (run_dir / "waiting").touch()
        while not (run_dir / "gate").exists():
            await asyncio.sleep(0.05)
    return await generate(ctx, sample, sampling_params)
