"""A custom rollout loop (set `rollout.rollout_function_path: examples.custom_rollout.rollout`).

It replaces the built-in loop (no over-sampling, dynamic sampling or partial rollout): draw the
groups, generate every sample with the configured `generate()` under the concurrency limit, score
each group, return them all (a timed-out sample stays in its group as `aborted`). A starting point
for loops that need a different schedule, e.g. environments that decide per step which prompts
to continue.
"""

from __future__ import annotations

import asyncio

from slimrl.rollout.client import RequestTimedOut
from slimrl.rollout.data_source import DataSource
from slimrl.rollout.generate import RolloutContext, sampling_params_for
from slimrl.rollout.rewards import compute_rewards
from slimrl.rollout.rollout import load_generate_fn
from slimrl.sample import Sample, Status


async def rollout(ctx: RolloutContext, data_source: DataSource, evaluation: bool) -> list[list[Sample]]:
    config = ctx.config
    if evaluation:  # every prompt of the eval set once
        groups = data_source.get_groups(len(data_source.records), n_samples=config.eval.n_samples_per_prompt)
    else:
        groups = data_source.get_groups(config.rollout.rollout_batch_size)
    generate = load_generate_fn(config)
    params = sampling_params_for(config, evaluation)
    limit = asyncio.Semaphore(config.rollout.max_concurrency)

    async def one(sample: Sample) -> Sample:
        async with limit:
            try:
                result = await generate(
                    ctx, sample, {**params, "sampling_seed": config.run.seed + sample.index}
                )
            except RequestTimedOut:  # rollout.request_timeout_s passed: keep it as an aborted sample
                sample.status = Status.ABORTED
                return sample
        assert isinstance(result, Sample), "this loop expects one Sample per generate() call"
        return result

    async def group_of(group: list[Sample]) -> list[Sample]:
        done = list(await asyncio.gather(*(one(s) for s in group)))
        await compute_rewards(config, done)
        return done

    return list(await asyncio.gather(*(group_of(g) for g in groups)))
