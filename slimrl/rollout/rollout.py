"""The default rollout: draw prompt groups, generate `n_samples_per_prompt` responses each with
bounded concurrency, score them, keep groups that pass the dynamic-sampling filter until the batch
is full, then abort what is still running (partial groups go back to the buffer with
`rollout.partial_rollout`). A custom loop (`rollout.rollout_function_path`) replaces all of this:

    async def rollout(ctx: RolloutContext, data_source: DataSource, evaluation: bool) -> list[list[Sample]]
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from slimrl.errors import SlimError
from slimrl.rollout.client import NoEngineAvailable, RequestTimedOut
from slimrl.rollout.data_source import DataSource, Group
from slimrl.rollout.generate import RolloutContext, generate, sampling_params_for
from slimrl.rollout.rewards import compute_rewards, scalar_reward
from slimrl.sample import Sample, Status
from slimrl.utils.hooks import load_function

logger = logging.getLogger(__name__)
MAX_DRAWS_PER_TARGET = 50  # dynamic sampling gives up after drawing this many groups per wanted group


@dataclass
class RolloutResult:
    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)


def _generate_fn(ctx: RolloutContext):
    path = ctx.config.rollout.custom_generate_function_path
    if path is None:
        return generate
    return load_function(
        path,
        key="rollout.custom_generate_function_path",
        required_params=("ctx", "sample", "sampling_params"),
        must_be_async=True,
    )


def _filter_fn(ctx: RolloutContext):
    path = ctx.config.rollout.dynamic_sampling_filter_path
    if path is None:
        return None
    return load_function(
        path, key="rollout.dynamic_sampling_filter_path", required_params=("config", "group")
    )


def _group_finished(group: Group) -> bool:
    return all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in group)


class _GroupRunner:
    """Generates and scores groups; one instance per rollout (its rid prefix scopes aborts)."""

    def __init__(self, ctx: RolloutContext, evaluation: bool) -> None:
        self.ctx = ctx
        self.generate = _generate_fn(ctx)
        self.params = sampling_params_for(ctx.config, evaluation)
        self.semaphore = asyncio.Semaphore(ctx.config.rollout.max_concurrency)
        self.rid_prefix = f"r{uuid.uuid4().hex[:8]}-"
        self.timeouts = 0
        self.failures = 0

    async def _one(self, sample: Sample) -> list[Sample]:
        async with self.semaphore:
            sample.metadata["rid"] = f"{self.rid_prefix}{sample.index}-{sample.response_length}"
            params = {**self.params, "sampling_seed": self.ctx.config.run.seed * 1_000_003 + sample.index}
            try:
                result = await self.generate(self.ctx, sample, params)
            except RequestTimedOut:
                self.timeouts += 1
                sample.status = Status.ABORTED
                return [sample]
            except NoEngineAvailable as exc:
                self.failures += 1
                logger.warning("sample %d failed: %s", sample.index, exc)
                sample.status = Status.FAILED
                return [sample]
        samples = result if isinstance(result, list) else [result]
        if not all(isinstance(s, Sample) for s in samples):
            raise SlimError(
                "rollout.custom_generate_function_path: generate() must return a Sample or list[Sample]"
            )
        return samples

    async def run_group(self, group: Group) -> Group:
        results = await asyncio.gather(*(self._one(s) for s in group))
        done = [s for part in results for s in part]
        if _group_finished(done):
            await compute_rewards(self.ctx.config, done)
        return done


async def run_rollout(ctx: RolloutContext, source: DataSource, evaluation: bool = False) -> RolloutResult:
    start = time.perf_counter()
    custom = ctx.config.rollout.rollout_function_path
    if custom is not None:
        loop = load_function(
            custom,
            key="rollout.rollout_function_path",
            required_params=("ctx", "data_source", "evaluation"),
            must_be_async=True,
        )
        groups = await loop(ctx, source, evaluation)
        return RolloutResult(groups, rollout_metrics(groups, time.perf_counter() - start, {}))
    if evaluation:
        return await _run_eval(ctx, source, start)
    return await _run_train_rollout(ctx, source, start)


async def _run_train_rollout(ctx: RolloutContext, source: DataSource, start: float) -> RolloutResult:
    config = ctx.config.rollout
    target = config.rollout_batch_size
    refill = config.over_sampling_batch_size or target
    runner = _GroupRunner(ctx, evaluation=False)
    keep = _filter_fn(ctx)
    kept: list[Group] = []
    counts = {"dropped_groups": 0, "unfinished_groups": 0, "buffered_groups": 0}
    pending: set[asyncio.Task] = set()
    drawn = 0
    while len(kept) < target:
        if not pending:
            if drawn >= MAX_DRAWS_PER_TARGET * target:
                raise SlimError(
                    f"dynamic sampling kept {len(kept)} of {target} groups after drawing {drawn}; "
                    f"rollout.dynamic_sampling_filter_path rejects (almost) everything"
                )
            for group in source.get_groups(refill):
                pending.add(asyncio.create_task(runner.run_group(group)))
            drawn += refill
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            group = task.result()
            if not _group_finished(group):
                counts["unfinished_groups"] += 1
                continue
            if keep is not None and not _passes(keep, ctx, group):
                counts["dropped_groups"] += 1
                continue
            if len(kept) < target:
                kept.append(group)
    if pending:  # the batch is full: stop what is still generating
        await ctx.client.abort(runner.rid_prefix)
        leftovers = await asyncio.gather(*pending)
        if config.partial_rollout:
            unfinished = [g for g in leftovers if not _group_finished(g)]
            for group in unfinished:
                for sample in group:
                    sample.status = Status.PENDING
            source.add_to_buffer(unfinished)
            counts["buffered_groups"] = len(unfinished)
    counts["timeouts"], counts["failed_samples"] = runner.timeouts, runner.failures
    return RolloutResult(kept, rollout_metrics(kept, time.perf_counter() - start, counts))


def _passes(keep, ctx: RolloutContext, group: Group) -> bool:
    verdict = keep(ctx.config, group)
    return bool(verdict[0] if isinstance(verdict, tuple) else verdict)


async def _run_eval(ctx: RolloutContext, source: DataSource, start: float) -> RolloutResult:
    runner = _GroupRunner(ctx, evaluation=True)
    groups = source.get_groups(len(source.records))
    results = await asyncio.gather(*(runner.run_group(g) for g in groups))
    return RolloutResult(list(results), rollout_metrics(list(results), time.perf_counter() - start, {}))


def rollout_metrics(groups: list[Group], seconds: float, counts: dict[str, Any]) -> dict[str, float]:
    samples = [s for g in groups for s in g]
    rewards = [scalar_reward(s.reward) for s in samples if s.reward is not None]
    lengths = [s.response_length for s in samples]
    tokens = sum(lengths)
    zero_std = sum(
        1 for g in groups if len({scalar_reward(s.reward) for s in g if s.reward is not None}) <= 1
    )
    metrics: dict[str, float] = {
        "raw_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "response_length": tokens / len(samples) if samples else 0.0,
        "response_length_max": float(max(lengths, default=0)),
        "truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / max(len(samples), 1),
        "zero_std_group_ratio": zero_std / max(len(groups), 1),
        "samples": float(len(samples)),
        "generated_tokens": float(tokens),
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "seconds": seconds,
    }
    metrics.update({k: float(v) for k, v in counts.items()})
    return metrics
