"""The default rollout: draw prompt groups, generate `n_samples_per_prompt` responses each with
bounded concurrency, score them, keep groups that pass the dynamic-sampling filter until the batch
is full, then abort what is still running (with `rollout.partial_rollout` the leftover groups go
back to the buffer with their partial tokens and are continued by a later rollout; an agent's runs
are parked instead, their calls held, and resumed by a later rollout: `agent/runner.py`). A custom loop
(`rollout.rollout_function_path`) replaces all of this:

    async def rollout(ctx: RolloutContext, data_source: DataSource, evaluation: bool) -> list[list[Sample]]
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import numbers
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from slimrl.errors import SlimError
from slimrl.rollout.agent.runner import generate as agent_generate
from slimrl.rollout.agent.runner import park_agent_runs
from slimrl.rollout.client import RID_PREFIX, FleetDown, NoEngineAvailable, RequestTimedOut
from slimrl.rollout.data_source import DataSource, Group
from slimrl.rollout.generate import EVALUATING, RolloutContext, apply_response, generate, sampling_params_for
from slimrl.rollout.hooks import check_hooks, load_hook
from slimrl.rollout.rewards import REWARD_KEY, compute_rewards, scalar_reward
from slimrl.rollout.sample_checks import AGENT_KEY, GENERATE_KEY, ROLLOUT_KEY, check_sample, model_vocab_size
from slimrl.sample import Sample, Status
from slimrl.sampled import check_sampled

logger = logging.getLogger(__name__)
MAX_DRAWS_PER_TARGET = 50  # dynamic sampling gives up after drawing this many groups per wanted group
REABORT_INTERVAL_S = 1.0  # a request that raced the first abort is caught by the next one
FINISHED = (Status.COMPLETED, Status.TRUNCATED)


@dataclass
class RolloutResult:
    groups: list[Group]
    """What the trainer trains on (every sample finished)."""
    metrics: dict[str, float] = field(default_factory=dict)
    unfinished: list[Group] = field(default_factory=list)
    """Groups that ended with a failed or aborted sample, not trained on: the sample log keeps them
    (`split` "train/unfinished"), each failed sample with its reason in `metadata["failure"]`."""


def load_generate_fn(config: Any) -> Callable[..., Any]:
    """The generate a rollout calls: the hook `rollout.custom_generate_function_path` names, the
    agent runner with `rollout.agent_function_path` (`rollout/agent/`), or the built-in one (custom
    rollout loops call it too: `examples/custom_rollout.py`)."""
    if config.rollout.agent_function_path is not None:
        return agent_generate
    return load_hook(config, "generate") or generate


def _hook_key(config: Any) -> str:
    if config.rollout.custom_generate_function_path:
        return GENERATE_KEY
    return AGENT_KEY if config.rollout.agent_function_path else "generate"


def _group_finished(group: Group) -> bool:
    return all(s.status in FINISHED for s in group)


class _GroupRunner:
    """Generates and scores groups; one instance per rollout (its rid prefix scopes aborts)."""

    def __init__(self, ctx: RolloutContext, evaluation: bool) -> None:
        self.ctx = ctx
        self.generate = load_generate_fn(ctx.config)
        self.hook = _hook_key(ctx.config)
        self.vocab_size = model_vocab_size(ctx.config.model.hf_checkpoint)
        self.params = sampling_params_for(ctx.config, evaluation)
        self.evaluation = evaluation
        self.training_checks = training_checks(ctx, evaluation)
        self.max_concurrency = ctx.config.rollout.max_concurrency
        self.semaphore = asyncio.Semaphore(self.max_concurrency)
        self.slot_lock = asyncio.Lock()
        """Held while a batch takes its slots one by one: two batches never hold half each."""
        self.batched = ctx.config.rollout.group_requests and self.generate is generate
        self.rid_prefix = f"r{uuid.uuid4().hex[:8]}-"
        self.parks_agents = (
            ctx.config.rollout.partial_rollout and not evaluation and self.generate is agent_generate
        )
        """At the end, the agent runs still going are parked for the next rollout, not aborted."""
        self.stopping = False
        self.timeouts = 0
        self.failures = 0

    async def _one(self, sample: Sample) -> list[Sample]:
        if sample.status in FINISHED:  # a finished sample of a buffered group: nothing to do
            return [sample]
        async with self.semaphore:
            if self.stopping:  # the batch filled up while this sample waited for a slot
                return [sample]
            rid = sample.metadata["rid"] = self._rid(sample)
            RID_PREFIX.set(f"{rid}-")  # this task only: a hook's own requests share the prefix
            EVALUATING.set(self.evaluation)  # this task only: eval samples ask for no routing
            params = self._params(sample)
            try:
                result = await self.generate(self.ctx, sample, params)
            except RequestTimedOut:
                self.timeouts += 1
                sample.status = Status.ABORTED
                return [sample]
            except FleetDown:
                raise  # the whole rollout stops: the driver heals the fleet or stops the run
            except NoEngineAvailable as exc:
                self.failures += 1
                logger.warning("sample %d failed: %s", sample.index, exc)
                sample.status = Status.FAILED
                return [sample]
        samples = result if isinstance(result, list) else [result]
        if not samples or not all(isinstance(s, Sample) for s in samples):
            raise SlimError(
                "rollout.custom_generate_function_path: generate() must return a Sample or a "
                f"non-empty list[Sample], got {type(result).__name__}"
            )
        for one in samples:
            self._check(one)
        self.failures += sum(one.status == Status.FAILED for one in samples)  # a hook's own (an agent's)
        return samples

    def _rid(self, sample: Sample) -> str:
        """Per sample and continuation: a partial sample continued later asks under a new rid."""
        return f"{self.rid_prefix}{sample.index}-{sample.response_length}"

    def _params(self, sample: Sample) -> dict[str, Any]:
        return {**self.params, "sampling_seed": self.ctx.config.run.seed * 1_000_003 + sample.index}

    def _fresh(self, group: Group) -> list[Sample]:
        """The samples of `group` the built-in generate may send as one batch: not started yet, of
        one prompt (`rollout.group_requests`); none when fewer than two."""
        if not self.batched:
            return []
        fresh = [s for s in group if s.status not in FINISHED and not s.tokens and not s.response_length]
        fresh = [s for s in fresh if s.prompt == fresh[0].prompt]
        return fresh if len(fresh) > 1 else []

    @contextlib.asynccontextmanager
    async def _slots(self, n: int) -> AsyncIterator[None]:
        """`n` of the `max_concurrency` request slots (all of them at most), taken together."""
        taken = 0
        try:
            async with self.slot_lock:
                while taken < min(n, self.max_concurrency):
                    await self.semaphore.acquire()
                    taken += 1
            yield
        finally:
            for _ in range(taken):
                self.semaphore.release()

    async def _batch(self, samples: list[Sample]) -> list[Sample]:
        """A group's fresh samples as one batched `/generate`: what `generate()` does per sample
        (same rids, seeds and sampling parameters), in one request to one engine."""
        async with self._slots(len(samples)):
            if self.stopping:
                return samples
            EVALUATING.set(self.evaluation)
            prompt_ids = self.ctx.prompt_ids(samples[0].prompt)
            params = [self._params(s) for s in samples]
            for sample in samples:
                sample.tokens = list(prompt_ids)
                sample.metadata["rid"] = self._rid(sample)
            if params[0]["max_new_tokens"] <= 0:
                for sample in samples:
                    sample.status = Status.TRUNCATED
                return samples
            try:
                responses = await self.ctx.client.generate_batch(
                    input_ids=[s.tokens for s in samples],
                    sampling_params=params,
                    rids=[s.metadata["rid"] for s in samples],
                    return_logprob=True,
                    **self.ctx.routing_request(samples[0]),  # one prompt: the same rows for all
                )
            except RequestTimedOut:
                self.timeouts += len(samples)
                return self._ended(samples, Status.ABORTED)
            except FleetDown:
                raise
            except NoEngineAvailable as exc:
                self.failures += len(samples)
                logger.warning("samples %d-%d failed: %s", samples[0].index, samples[-1].index, exc)
                return self._ended(samples, Status.FAILED)
        for sample, response in zip(samples, responses, strict=True):
            apply_response(sample, response, routing=self.ctx.routing)
            self._check(sample)
        return samples

    def _check(self, sample: Sample) -> None:
        check_sample(sample, self.hook, self.vocab_size, allow_pending=self.stopping, **self.training_checks)
        check_sampled(sample, self.hook)

    @staticmethod
    def _ended(samples: list[Sample], status: Status) -> list[Sample]:
        for sample in samples:
            sample.status = status
        return samples

    async def run_group(self, group: Group) -> Group:
        fresh = self._fresh(group)
        if fresh:
            batched = {id(s) for s in fresh}
            await asyncio.gather(self._batch(fresh), *(self._one(s) for s in group if id(s) not in batched))
            done = list(group)  # the built-in generate returns the sample it was given
        else:
            results = await asyncio.gather(*(self._one(s) for s in group))
            done = [s for part in results for s in part]
        if _group_finished(done):
            await compute_rewards(self.ctx.config, done)
        return done

    async def stop(self, pending: set[asyncio.Task]) -> None:
        """Abort this rollout's requests and wait until every pending group has returned (with its
        agent runs parked, under partial rollout)."""
        self.stopping = True
        while pending:
            if self.parks_agents:  # before the abort: the aborted calls are held, not failed
                park_agent_runs(self.ctx, self.rid_prefix)
            await self.ctx.client.abort(self.rid_prefix)
            _, pending = await asyncio.wait(pending, timeout=REABORT_INTERVAL_S)

    async def cancel(self, pending: Iterable[asyncio.Task]) -> None:
        """On an error: cancel the pending groups and free the engines."""
        self.stopping = True
        pending = list(pending)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.ctx.client.abort(self.rid_prefix)


async def run_rollout(ctx: RolloutContext, source: DataSource, evaluation: bool = False) -> RolloutResult:
    start = time.perf_counter()
    check_hooks(ctx.config)
    custom = load_hook(ctx.config, "rollout")
    if custom is not None:
        token = EVALUATING.set(evaluation)
        try:
            groups = await custom(ctx, source, evaluation)
        finally:
            EVALUATING.reset(token)
        _check_groups(groups)
        vocab_size = model_vocab_size(ctx.config.model.hf_checkpoint)
        checks = training_checks(ctx, evaluation)
        for sample in (s for group in groups for s in group):
            check_sample(sample, ROLLOUT_KEY, vocab_size, **checks)
            check_sampled(sample, ROLLOUT_KEY)
        return RolloutResult(groups, rollout_metrics(groups, time.perf_counter() - start, {}))
    if evaluation:
        return await _run_eval(ctx, source, start)
    return await _run_train_rollout(ctx, source, start)


def training_checks(ctx: RolloutContext, evaluation: bool) -> dict[str, Any]:
    """`check_sample`'s checks that only samples headed for the trainer need: the routing replay
    layout and `train.max_seq_len` (evaluation samples are scored, never trained on)."""
    if evaluation:
        return {}
    return {"routing": ctx.replay_layout, "max_seq_len": ctx.config.train.max_seq_len}


def _check_groups(groups: Any) -> None:
    ok = isinstance(groups, list) and all(
        isinstance(g, list) and all(isinstance(s, Sample) for s in g) for g in groups
    )
    if not ok:
        raise SlimError("rollout.rollout_function_path: the rollout function must return list[list[Sample]]")


async def _run_train_rollout(ctx: RolloutContext, source: DataSource, start: float) -> RolloutResult:
    config = ctx.config.rollout
    target = config.rollout_batch_size
    runner = _GroupRunner(ctx, evaluation=False)
    keep = load_hook(ctx.config, "filter")
    kept: list[Group] = []
    unfinished: list[Group] = []
    surplus: list[Group] = []  # finished after the batch was full in the same wake-up
    counts = {"dropped_groups": 0, "unfinished_groups": 0, "buffered_groups": 0, "drawn_groups": 0,
              "finished_reward_sum": 0.0, "finished_samples": 0}  # fmt: skip
    pending: set[asyncio.Task] = set()
    done: set[asyncio.Task] = set()
    try:
        while len(kept) < target:
            # Draw more as soon as the groups in flight could no longer fill the batch.
            if len(kept) + len(pending) < target and _may_draw(counts, target, len(kept), bool(pending)):
                for group in source.get_groups(config.over_sampling_batch_size or target):
                    pending.add(asyncio.create_task(runner.run_group(group)))
                    counts["drawn_groups"] += 1
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if len(kept) < target:
                    _sort_group(task.result(), keep, ctx, kept, unfinished, counts)
                else:
                    surplus.append(task.result())
    except BaseException:
        await runner.cancel(pending | done)  # and collect the errors of finished groups too
        raise
    await runner.stop(pending)  # the batch is full: stop what is still generating
    leftovers = surplus + [t.result() for t in pending]
    if config.partial_rollout and leftovers:
        counts["buffered_groups"] = _buffer_leftovers(source, leftovers, ctx.rollout_id)
    counts["timeouts"], counts["failed_samples"] = runner.timeouts, runner.failures
    return RolloutResult(kept, rollout_metrics(kept, time.perf_counter() - start, counts), unfinished)


def _may_draw(counts: dict[str, int], target: int, kept: int, waiting: bool) -> bool:
    """False once the draw budget is spent while something is still in flight; an error once it
    is spent with nothing left to wait for."""
    if counts["drawn_groups"] < MAX_DRAWS_PER_TARGET * target:
        return True
    if waiting:
        return False
    raise SlimError(
        f"dynamic sampling kept {kept} of {target} groups after drawing {counts['drawn_groups']}; "
        "rollout.dynamic_sampling_filter_path rejects (almost) everything, or every request fails "
        "(see the timeouts/failed_samples metrics)"
    )


def _sort_group(
    group: Group,
    keep: Callable[..., Any] | None,
    ctx: RolloutContext,
    kept: list[Group],
    unfinished: list[Group],
    counts: dict[str, float],
) -> None:
    """Keep a finished group that passes the filter; set the unfinished ones aside; count both."""
    if not _group_finished(group):
        counts["unfinished_groups"] += 1
        unfinished.append(group)
        return
    rewards = [scalar_reward(s.reward) for s in group if s.reward is not None]
    counts["finished_reward_sum"] += sum(rewards)  # before the filter: what the policy scores
    counts["finished_samples"] += len(rewards)
    if keep is not None and not _passes(keep, ctx, group):
        counts["dropped_groups"] += 1
    else:
        kept.append(group)


def _buffer_leftovers(source: DataSource, leftovers: list[Group], rollout_id: int) -> int:
    """Put the groups still running at the end back in the buffer: aborted samples keep their partial
    tokens and become pending again; finished samples stay as they are and are not regenerated."""
    for group in leftovers:
        for sample in group:
            if sample.status not in FINISHED:
                sample.status = Status.PENDING
            if sample.response_length and "start_rollout_id" not in sample.metadata:
                sample.metadata["start_rollout_id"] = rollout_id
    source.add_to_buffer(leftovers)
    return len(leftovers)


def _passes(keep: Callable[..., Any], ctx: RolloutContext, group: Group) -> bool:
    verdict = keep(ctx.config, group)
    return bool(verdict[0] if isinstance(verdict, tuple) else verdict)


async def _run_eval(ctx: RolloutContext, source: DataSource, start: float) -> RolloutResult:
    """Every prompt of the eval set once, `eval.n_samples_per_prompt` times, with `eval.sampling`."""
    runner = _GroupRunner(ctx, evaluation=True)
    groups = source.get_groups(len(source.records), n_samples=ctx.config.eval.n_samples_per_prompt)
    tasks = [asyncio.create_task(runner.run_group(g)) for g in groups]
    try:
        results = list(await asyncio.gather(*tasks))
    except BaseException:
        await runner.cancel(tasks)
        raise
    counts = {"timeouts": runner.timeouts, "failed_samples": runner.failures}
    return RolloutResult(results, rollout_metrics(results, time.perf_counter() - start, counts))


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
        "aborted_ratio": sum(s.status == Status.ABORTED for s in samples) / max(len(samples), 1),
        "zero_std_group_ratio": zero_std / max(len(groups), 1),
        "groups": float(len(groups)),
        "samples": float(len(samples)),
        "generated_tokens": float(tokens),
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "seconds": seconds,
    }
    reward_sum, scored = counts.pop("finished_reward_sum", None), counts.pop("finished_samples", 0)
    if reward_sum is not None:  # every finished group's reward, kept or dropped by the filter
        metrics["raw_reward_unfiltered"] = reward_sum / scored if scored else 0.0
    metrics.update({k: float(v) for k, v in counts.items()})
    metrics.update(_agent_metrics(samples))
    metrics.update(_reward_entries(samples))
    return metrics


def _reward_entries(samples: list[Sample]) -> dict[str, float]:
    """`reward/<key>`: the mean of each entry of dict rewards besides the trained `score`, over the
    samples whose reward has it (a control that reports `control_score` on some samples only gets
    its own curve)."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        if isinstance(sample.reward, dict):
            for key, value in sample.reward.items():
                if key != REWARD_KEY and isinstance(value, numbers.Real) and math.isfinite(value):
                    values.setdefault(f"reward/{key}", []).append(float(value))
    return {key: sum(v) / len(v) for key, v in values.items()}


def _agent_metrics(samples: list[Sample]) -> dict[str, float]:
    """Agent runs in these samples, the turns that started a new sample because they did not
    extend one (the agent edited its history: `metadata["agent"]["splits"]` says why), and the
    turns that opened a tool call the parser could not read."""
    runs = {s.metadata["agent"]["session"]: s.metadata["agent"] for s in samples if "agent" in s.metadata}
    if not runs:
        return {}
    splits = sum(len(info.get("splits", ())) for info in runs.values())
    turns = [t for s in samples for t in s.metadata.get("agent_sequence", {}).get("turns", ())]
    malformed = sum(bool(t.get("malformed_tool_call")) for t in turns)
    return {
        "agent_runs": float(len(runs)),
        "agent_splits": float(splits),
        "agent_malformed_tool_calls": float(malformed),
    }
