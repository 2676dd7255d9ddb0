"""`run_rollout` against a real fleet (two `slimrl serve` engines behind sglang-router) on the tiny
Qwen3-MoE and the mod_sum toy data: batch shape, per-token bookkeeping, dynamic sampling, partial
rollout, eval, every hook kind, and the data source's checkpoint round trip.

One fleet serves the module; each test runs rollouts with its own copy of the config.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from transformers import AutoTokenizer

from slimrl.config.schema import SlimConfig
from slimrl.data.toy_tasks import make_data
from slimrl.errors import SlimError
from slimrl.preflight import load_config
from slimrl.rollout.client import FleetClient, FleetDown
from slimrl.rollout.data_source import DataSource
from slimrl.rollout.fleet import Fleet
from slimrl.rollout.generate import RolloutContext, apply_response
from slimrl.rollout.rewards import scalar_reward, toy_reward
from slimrl.rollout.rollout import RolloutResult, run_rollout
from slimrl.sample import Sample, Status
from tests.engines import hf_routing

pytestmark = pytest.mark.slow
FINISHED = (Status.COMPLETED, Status.TRUNCATED)
TOOL_HOOK = {
    "custom_generate_function_path": "examples.multi_turn_tool_generate.generate",
    "sampling.max_new_tokens": 40,
    "sampling.temperature": 1.0,
}


@pytest.fixture(scope="module")
def base_config(tiny_model, mod_sum_data, tmp_path_factory) -> SlimConfig:
    eval_data = tmp_path_factory.mktemp("eval") / "mod_sum_eval.jsonl"
    make_data("mod_sum", eval_data, num_samples=6, seed=1)
    return load_config(
        "configs/tiny_moe_cpu.yaml",
        [
            f"model.hf_checkpoint={tiny_model('qwen3_moe')}",
            f"data.prompt_data={mod_sum_data}",
            "algorithm.loss=policy",
            "rollout.num_engines=2",
            "rollout.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.sampling.max_new_tokens=8",
            "rollout.max_concurrency=32",
            f"eval.datasets.heldout={eval_data}",
        ],
    )


@pytest.fixture(scope="module")
def fleet(base_config, tmp_path_factory) -> Iterator[Fleet]:
    with Fleet(base_config, base_config.model.hf_checkpoint, tmp_path_factory.mktemp("logs")) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def tokenizer(base_config) -> Any:
    return AutoTokenizer.from_pretrained(base_config.model.hf_checkpoint)


def configure(base: SlimConfig, **sections: dict[str, Any]) -> SlimConfig:
    """A copy of the config with `section={"key": value}` (dotted keys for nested sections)."""
    config = copy.deepcopy(base)
    for section, values in sections.items():
        for dotted, value in values.items():
            target: Any = getattr(config, section)
            *parents, key = dotted.split(".")
            for parent in parents:
                target = getattr(target, parent)
            setattr(target, key, value)
    return config


def rollout(
    fleet: Fleet, config: SlimConfig, tokenizer: Any, source: DataSource, evaluation: bool = False, **ctx: Any
) -> RolloutResult:
    client = ctx.pop("client", fleet.client)
    assert client is not None
    context = RolloutContext(config, tokenizer, client, **ctx)

    async def main() -> RolloutResult:
        try:
            return await run_rollout(context, source, evaluation)
        finally:
            await client.close()

    return asyncio.run(main())


PARTIAL_TRIES = 5
"""Tries at stopping a group mid-generation. Each sample's tokens are fixed by its seed, but which
group fills the batch first and how far the others got is timing: on a loaded machine a try can
stop with every leftover group either finished or not yet started (CI saw it once; under load a
group finishing in the same wake-up as the first is common), and then nothing is partial. Such a
try is run again from a fresh source (the same prompts and seeds)."""


def rollout_stopping_a_group(
    fleet: Fleet, config: SlimConfig, tokenizer: Any
) -> tuple[DataSource, RolloutResult]:
    """Rollout 0 from a fresh source, run until it leaves some sample stopped mid-generation."""
    for _ in range(PARTIAL_TRIES):
        source = DataSource(config)
        first = rollout(fleet, config, tokenizer, source, rollout_id=0)
        if any(s.status == Status.PENDING and s.response_length > 0 for g in source.buffer for s in g):
            return source, first
    pytest.fail(f"no group was stopped mid-generation in {PARTIAL_TRIES} rollouts")


def check_sample(sample: Sample, tokenizer: Any, max_new_tokens: int) -> None:
    """The per-token bookkeeping every trained sample must satisfy."""
    n = sample.response_length
    assert 0 < n <= max_new_tokens
    assert len(sample.loss_mask or []) == len(sample.rollout_log_probs or []) == n
    assert sample.prompt_tokens == tokenizer.encode(sample.prompt, add_special_tokens=False)
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in sample.rollout_log_probs or [])
    assert sample.status in FINISHED
    assert sample.weight_versions and all(v == sample.weight_versions[0] for v in sample.weight_versions)


def test_prompts_are_tokenized_once_per_prompt(base_config, tokenizer, monkeypatch) -> None:
    """The samples of a group share a prompt: `RolloutContext.prompt_ids` encodes it once and hands
    each caller its own copy; the cache stays bounded."""
    from slimrl.rollout import generate as generate_module

    calls: list[str] = []
    real = generate_module.render_prompt
    monkeypatch.setattr(
        generate_module,
        "render_prompt",
        lambda tok, prompt, chat: calls.append(prompt) or real(tok, prompt, chat),
    )
    monkeypatch.setattr(generate_module, "PROMPT_CACHE_SIZE", 2)
    context = RolloutContext(base_config, tokenizer, client=None)  # type: ignore[arg-type]
    first = [context.prompt_ids("3+4=") for _ in range(4)]
    assert calls == ["3+4="] and all(
        ids == tokenizer.encode("3+4=", add_special_tokens=False) for ids in first
    )
    first[0].append(99)  # a caller's copy, not the cache's
    assert context.prompt_ids("3+4=") == first[1]
    for prompt in ("1+1=", "2+2=", "3+4="):  # "3+4=" was evicted by the two newer prompts
        context.prompt_ids(prompt)
    assert calls == ["3+4=", "1+1=", "2+2=", "3+4="]


def test_rollout_batch_shape_bookkeeping_and_toy_rewards(fleet, base_config, tokenizer) -> None:
    config = configure(base_config, rollout={"sampling.temperature": 1.0})
    result = rollout(fleet, config, tokenizer, DataSource(config))
    groups = result.groups
    assert len(groups) == 4 and all(len(g) == 4 for g in groups)
    assert len({g[0].group_index for g in groups}) == 4
    assert len({s.index for g in groups for s in g}) == 16
    for group in groups:
        assert len({s.group_index for s in group}) == 1 and len({s.prompt for s in group}) == 1
        for sample in group:
            check_sample(sample, tokenizer, 8)
            assert sample.loss_mask == [1] * sample.response_length
            assert sample.response == tokenizer.decode(sample.response_tokens)
            assert sample.status == (
                Status.COMPLETED if sample.tokens[-1] == tokenizer.eos_token_id else Status.TRUNCATED
            )
            assert sample.reward == toy_reward(sample.response, sample.label, "mod_sum")
            assert sample.metadata["task"] == "mod_sum"
    metrics = result.metrics
    assert metrics["samples"] == 16 and metrics["groups"] == 4 and metrics["timeouts"] == 0
    assert metrics["generated_tokens"] == sum(s.response_length for g in groups for s in g)


def by_index(result: RolloutResult) -> list[Sample]:
    """Every sample of a rollout, by index (groups come back in the order they finished)."""
    return sorted((s for group in result.groups for s in group), key=lambda s: s.index)


def test_a_group_is_one_batched_request_that_samples_what_single_requests_sample(
    fleet, base_config, tokenizer
) -> None:
    """`rollout.group_requests` (the default): each group's samples go to one engine as one batched
    `/generate`, and come back exactly as one request per sample (through the router) gives them:
    the same tokens, logprobs, rewards and rids, sample by sample (each sample keeps its seed)."""
    client = fleet.client
    assert client is not None
    results, requests_sent = {}, {}
    for grouped in (True, False):
        config = configure(base_config, rollout={"sampling.temperature": 1.0, "group_requests": grouped})
        via_router, direct = client.requests_via_router, client.requests_direct
        results[grouped] = rollout(fleet, config, tokenizer, DataSource(config))
        requests_sent[grouped] = (client.requests_via_router - via_router, client.requests_direct - direct)
    assert requests_sent == {True: (0, 4), False: (16, 0)}  # 4 groups of 4; batches skip the router
    batched, single = (by_index(results[grouped]) for grouped in (True, False))
    assert [s.index for s in batched] == [s.index for s in single] and len(batched) == 16

    def seen(sample: Sample) -> tuple:
        return sample.tokens, sample.status, sample.reward, sample.loss_mask

    assert [seen(s) for s in batched] == [seen(s) for s in single]
    # The engine batches whatever is queued: float32 sums over other batch shapes (measured <= 5e-7)
    for a, b in zip(batched, single, strict=True):
        assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs, abs=1e-6)
    assert len({s.metadata["rid"] for s in batched}) == 16
    for sample in batched:
        check_sample(sample, tokenizer, 8)


def test_dynamic_sampling_keeps_only_groups_with_reward_variance(fleet, base_config, tokenizer) -> None:
    # The untrained model answers at random: at a high temperature some samples of a group get the
    # (math-graded: final number) answer right and others not, and many groups are all wrong.
    config = configure(
        base_config,
        rollout={
            "rollout_batch_size": 2,
            "over_sampling_batch_size": 4,
            "reward_type": "math",
            "sampling.temperature": 1.5,
            "sampling.max_new_tokens": 6,
            "dynamic_sampling_filter_path": "slimrl.rollout.filters.nonzero_reward_std",
        },
    )
    result = rollout(fleet, config, tokenizer, DataSource(config))
    assert len(result.groups) == 2
    for group in result.groups:
        assert len({scalar_reward(s.reward) for s in group}) > 1
    metrics = result.metrics
    assert metrics["dropped_groups"] > 0, metrics
    assert metrics["zero_std_group_ratio"] == 0.0
    assert metrics["drawn_groups"] >= 2 + metrics["dropped_groups"]


def test_partial_rollout_buffers_unfinished_groups_and_continues_them(fleet, base_config, tokenizer) -> None:
    config = configure(
        base_config,
        rollout={
            "rollout_batch_size": 1,
            "over_sampling_batch_size": 4,
            "partial_rollout": True,
            "max_concurrency": 8,
            "sampling.max_new_tokens": 200,
            "sampling.temperature": 1.0,
        },
    )
    source, first = rollout_stopping_a_group(fleet, config, tokenizer)
    assert len(first.groups) == 1
    buffered = [s for g in source.buffer for s in g]
    assert first.metrics["buffered_groups"] == len(source.buffer) == 3
    partial = [s for s in buffered if s.status == Status.PENDING and s.response_length > 0]
    before = {s.index: copy.deepcopy(s) for s in buffered}
    for sample in partial:  # aborted mid-way: consistent partial tokens, marked for continuation
        assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length < 200
        assert sample.metadata["start_rollout_id"] == 0

    # The next rollout draws the buffered groups first and finishes them where they stopped.
    config_next = configure(config, rollout={"rollout_batch_size": 3, "over_sampling_batch_size": None})
    second = rollout(fleet, config_next, tokenizer, source, rollout_id=1)
    continued = {s.index: s for g in second.groups for s in g}
    assert set(continued) == set(before)
    for index, old in before.items():
        new = continued[index]
        check_sample(new, tokenizer, 200)
        assert new.tokens[: len(old.tokens)] == old.tokens
        assert new.rollout_log_probs[: old.response_length] == (old.rollout_log_probs or [])
        assert new.response_length >= old.response_length
        if old.status in FINISHED:  # finished before the abort: kept as it was, not regenerated
            assert new.tokens == old.tokens
    assert any(continued[s.index].response_length > before[s.index].response_length for s in partial)


def test_routing_replay_survives_partial_rollout_and_a_checkpoint(fleet, base_config, tokenizer) -> None:
    """With replay on, aborted samples are buffered with the routing they have, go through the
    checkpoint's JSON, and are continued; every trained sample ends with one row per token but the
    last, equal to Hugging Face's router over its whole sequence. Eval samples carry none."""
    config = configure(
        base_config,
        algorithm={"routing_replay": True},
        rollout={"rollout_batch_size": 1, "over_sampling_batch_size": 4, "partial_rollout": True,
                 "max_concurrency": 8, "sampling.max_new_tokens": 60, "sampling.temperature": 1.0},
    )  # fmt: skip
    source, first = rollout_stopping_a_group(fleet, config, tokenizer)
    partial = {s.index: s.response_length for g in source.buffer for s in g if s.status == Status.PENDING}
    restored = DataSource(config)
    restored.load_state_dict(json.loads(json.dumps(source.state_dict())))  # as driver_state.json holds it
    config_next = configure(config, rollout={"rollout_batch_size": 3, "over_sampling_batch_size": None})
    second = rollout(fleet, config_next, tokenizer, restored, rollout_id=1)
    samples = [s for result in (first, second) for g in result.groups for s in g]
    assert len(samples) == 16 and any(s.response_length > partial.get(s.index, 60) for s in samples)
    for sample in samples:
        routing = sample.rollout_routed_experts
        assert routing is not None and routing.dtype == np.uint8
        np.testing.assert_array_equal(routing, hf_routing(config.model.hf_checkpoint, sample.tokens))
    heldout = DataSource(config, config.eval.datasets["heldout"], shuffle=False)
    evaluated = rollout(fleet, config, tokenizer, heldout, evaluation=True)
    assert all(s.rollout_routed_experts is None for g in evaluated.groups for s in g)


def test_eval_rollout_is_greedy_over_every_prompt_once(fleet, base_config, tokenizer) -> None:
    config = configure(base_config, eval={"n_samples_per_prompt": 2})
    path = base_config.eval.datasets["heldout"]
    prompts = [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines()]
    source = DataSource(config, path, shuffle=False)
    first = rollout(fleet, config, tokenizer, source, evaluation=True)
    again = rollout(fleet, config, tokenizer, source, evaluation=True)
    assert [g[0].prompt for g in first.groups] == prompts  # all prompts, once, in file order
    assert all(len(g) == 2 for g in first.groups)
    for group, repeat in zip(first.groups, again.groups, strict=True):
        assert group[0].tokens == group[1].tokens == repeat[0].tokens  # greedy
        for sample in group:
            check_sample(sample, tokenizer, config.eval.sampling.max_new_tokens)
            assert sample.reward is not None
    assert first.metrics["samples"] == 2 * len(prompts)


def test_timed_out_requests_become_aborted_samples(fleet, base_config, tokenizer) -> None:
    assert fleet.client is not None
    config = configure(base_config, eval={"sampling.max_new_tokens": 400})
    source = DataSource(config, base_config.eval.datasets["heldout"], shuffle=False)
    impatient = FleetClient(fleet.client.engines, request_timeout_s=0.2)
    result = rollout(fleet, config, tokenizer, source, evaluation=True, client=impatient)
    samples = [s for g in result.groups for s in g]
    aborted = [s for s in samples if s.status == Status.ABORTED]
    assert len(samples) == 6 and aborted  # greedy answers that hit EOS early may still finish
    assert all(s.status in FINISHED for s in samples if s not in aborted)
    assert result.metrics["timeouts"] == len(aborted)
    for group in result.groups:  # a group with an aborted sample is not scored
        assert all(s.reward is None for s in group) == any(s.status == Status.ABORTED for s in group)


def test_multi_turn_tool_generate_hook(fleet, base_config, tokenizer) -> None:
    config = configure(base_config, rollout={**TOOL_HOOK, "rollout_batch_size": 2})
    result = rollout(fleet, config, tokenizer, DataSource(config))
    samples = [s for g in result.groups for s in g]
    assert len(samples) == 8
    with_tools = [s for s in samples if s.metadata.get("tool_turns")]
    assert with_tools, "no sample reached a tool turn"
    for sample in samples:
        check_sample(sample, tokenizer, 40)
        assert sample.response == tokenizer.decode(sample.response_tokens)
        assert sample.loss_mask[-1] == 1  # ends with a model turn, not an unanswered observation
        assert sample.reward is not None
    assert fleet.client is not None
    for sample in with_tools[:3]:
        mask, logprobs, response = sample.loss_mask, sample.rollout_log_probs, sample.response_tokens
        tool_text = tokenizer.decode([t for t, m in zip(response, mask, strict=True) if m == 0])
        assert tool_text.startswith(("<result>", "<hint>"))
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0)
        # Model tokens carry the engine's logprobs: a prefill of the whole sequence agrees.
        scored = prefill_logprobs(fleet.client, sample.tokens, temperature=1.0)[-sample.response_length :]
        for lp, ref, m in zip(logprobs, scored, mask, strict=True):
            if m == 1:
                assert lp == pytest.approx(ref, abs=1e-4)


async def one_long_turn(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """A generate hook that knows nothing of rids: one 300-token turn (EOS ignored)."""
    if not sample.tokens:
        sample.tokens = ctx.tokenizer.encode(sample.prompt, add_special_tokens=False)
    params = {**sampling_params, "max_new_tokens": 300 - sample.response_length, "ignore_eos": True}
    apply_response(
        sample,
        await ctx.client.generate(input_ids=sample.tokens, sampling_params=params, return_logprob=True),
    )
    return sample


async def forgets_status(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """A generate hook that fills in the response but never sets `sample.status`."""
    sample.tokens = ctx.tokenizer.encode(sample.prompt, add_special_tokens=False)
    response = await ctx.client.generate(input_ids=sample.tokens, sampling_params=sampling_params)
    sample.tokens += response["output_ids"]
    sample.response_length = len(response["output_ids"])
    return sample


def test_a_hook_that_forgets_status_is_named_not_silently_dropped(fleet, base_config, tokenizer) -> None:
    """Before: every sample was dropped by dynamic sampling and nothing named the hook."""
    config = configure(base_config, rollout={"custom_generate_function_path": "test_rollout.forgets_status"})
    with pytest.raises(SlimError) as err:
        rollout(fleet, config, tokenizer, DataSource(config))
    assert str(err.value).startswith("rollout.custom_generate_function_path: sample ")
    assert "status is still pending: the hook must set it" in str(err.value)


def test_a_hook_sample_longer_than_max_seq_len_is_named(fleet, base_config, tokenizer) -> None:
    """Multi-turn hooks and prompts without data.max_prompt_tokens escape the load-time length
    check; the first finished sample that does not fit stops the rollout in one line."""
    config = configure(
        base_config,
        rollout={"custom_generate_function_path": "test_rollout.one_long_turn", "rollout_batch_size": 1},
        train={"max_seq_len": 64},
    )
    with pytest.raises(SlimError) as err:
        rollout(fleet, config, tokenizer, DataSource(config))
    message = str(err.value)
    assert message.startswith("rollout.custom_generate_function_path: sample ") and "\n" not in message
    assert "response), more than train.max_seq_len=64; raise train.max_seq_len or make the hook" in message


def test_rollout_abort_reaches_the_requests_of_a_generate_hook(fleet, base_config, tokenizer) -> None:
    """The hook never passes a rid; its requests still carry the rollout's prefix and get aborted.

    Six slots for four groups of four equal-length samples: group 0 and half of group 1 start
    together, so when group 0 fills the batch the rest of group 1 has just started."""
    config = configure(
        base_config,
        rollout={
            "custom_generate_function_path": "test_rollout.one_long_turn",
            "rollout_batch_size": 1,
            "over_sampling_batch_size": 4,
            "partial_rollout": True,
            "max_concurrency": 6,
        },
        train={"max_seq_len": 512},  # the hook's 300-token turns are trained on
    )
    source = DataSource(config)
    rollout(fleet, config, tokenizer, source)
    buffered = [s for g in source.buffer for s in g]
    # Answered by an engine (it has a weight version) yet unfinished: aborted, not run to the end.
    assert any(s.status == Status.PENDING and s.weight_versions for s in buffered)
    for sample in buffered:
        assert len(sample.loss_mask or []) == len(sample.rollout_log_probs or []) == sample.response_length


def prefill_logprobs(client: FleetClient, tokens: list[int], temperature: float) -> list[float]:
    """Logprob of every token after the first under the engine's model (SGLang prefill scoring)."""

    async def main() -> dict[str, Any]:
        try:
            return await client.generate(
                input_ids=tokens,
                sampling_params={"max_new_tokens": 0, "temperature": temperature},
                return_logprob=True,
                logprob_start_len=0,
            )
        finally:
            await client.close()

    return [t[0] for t in asyncio.run(main())["meta_info"]["input_token_logprobs"][1:]]


def test_custom_reward_and_group_rm(fleet, base_config, tokenizer) -> None:
    config = configure(
        base_config,
        rollout={"custom_rm_path": "examples.custom_reward.reward", "rollout_batch_size": 2},
    )
    result = rollout(fleet, config, tokenizer, DataSource(config))
    for sample in (s for g in result.groups for s in g):
        assert set(sample.reward) == {"score", "correct", "clean_ending"}
        assert sample.reward["score"] == sample.reward["correct"] + 0.1 * sample.reward["clean_ending"]
    group_config = configure(
        base_config,
        rollout={
            "custom_rm_path": "test_rollout.longest_in_group",
            "group_rm": True,
            "rollout_batch_size": 2,
        },
    )
    for group in rollout(fleet, group_config, tokenizer, DataSource(group_config)).groups:
        longest = max(s.response_length for s in group)
        assert [s.reward for s in group] == [float(s.response_length == longest) for s in group]


async def longest_in_group(config: SlimConfig, samples: list[Sample]) -> list[float]:
    """Group reward hook: 1 for the longest responses of the group."""
    longest = max(s.response_length for s in samples)
    return [float(s.response_length == longest) for s in samples]


def test_custom_rollout_function_and_shipped_filters(fleet, base_config, tokenizer) -> None:
    config = configure(base_config, rollout={"rollout_function_path": "examples.custom_rollout.rollout"})
    result = rollout(fleet, config, tokenizer, DataSource(config))
    assert len(result.groups) == 4 and all(len(g) == 4 for g in result.groups)
    for sample in (s for g in result.groups for s in g):
        check_sample(sample, tokenizer, 8)
        assert sample.reward == toy_reward(sample.response, sample.label, "mod_sum")
    evaluated = rollout(
        fleet, config, tokenizer, DataSource(config, base_config.eval.datasets["heldout"]), True
    )
    assert len(evaluated.groups) == 6 and all(len(g) == 1 for g in evaluated.groups)

    # The shipped dynamic-sampling and buffer filters in the built-in loop.
    config = configure(
        base_config,
        rollout={
            "rollout_batch_size": 1,
            "over_sampling_batch_size": 4,
            "partial_rollout": True,
            "reward_type": "math",
            "sampling.temperature": 1.5,
            "dynamic_sampling_filter_path": "examples.filters.informative_group",
            "buffer_filter_path": "examples.filters.oldest_first",
        },
    )
    source = DataSource(config)
    result = rollout(fleet, config, tokenizer, source)
    assert len(result.groups) == 1 and len({scalar_reward(s.reward) for s in result.groups[0]}) > 1
    if source.buffer:  # the buffer filter picks the groups to continue; they come back first
        waiting = {s.index for g in source.buffer for s in g}
        again = source.get_groups(len(source.buffer))
        assert {s.index for g in again for s in g} == waiting


def test_engine_death_mid_rollout_is_survived_and_healed(fleet, base_config, tokenizer) -> None:
    """Kill an engine while a rollout runs: its requests finish on the other engine, the batch is
    complete, and the fleet's watcher restarts the engine (as `slimrl rollout` runs it)."""
    client = fleet.client
    assert client is not None
    config = configure(base_config, rollout={"sampling.max_new_tokens": 120, "sampling.temperature": 1.0})
    context = RolloutContext(config, tokenizer, client)
    victim, restarts, failovers = fleet.servers[1], fleet.restarts, client.failovers

    def both_busy() -> bool:
        return all(
            requests.get(f"{s.url}/get_load", timeout=5).json()[0]["num_reqs"] > 0 for s in fleet.servers
        )

    async def main() -> RolloutResult:
        watcher = asyncio.create_task(fleet.watch(interval_s=0.2))
        try:
            rollout_task = asyncio.create_task(run_rollout(context, DataSource(config)))
            await asyncio.to_thread(_wait, both_busy, 30.0)
            victim.kill()
            result = await rollout_task
            await asyncio.to_thread(_wait, lambda: fleet.restarts > restarts, 120.0)
            await asyncio.sleep(0.5)  # the watcher swaps the new engine into the client on the loop
            return result
        finally:
            watcher.cancel()
            await client.close()

    result = asyncio.run(main())
    samples = [s for g in result.groups for s in g]
    assert len(result.groups) == 4 and len(samples) == 16
    for sample in samples:
        check_sample(sample, tokenizer, 120)
    assert client.failovers > failovers and result.metrics["failed_samples"] == 0
    assert victim.url not in client.engines and fleet.servers[1].url in client.engines and not client.down
    assert fleet.servers[1].alive() and fleet.servers[1].restarts == victim.restarts + 1


def test_a_rollout_that_finds_every_engine_down_stops_then_runs_once_healed(
    fleet, base_config, tokenizer
) -> None:
    """Both engines killed mid-rollout: the rollout stops at the first request that finds none
    (not sample by sample); `slimrl rollout` runs it again once the watcher restarted them."""
    from slimrl.orchestration.rollout_only import healed_rollout

    client = fleet.client
    assert client is not None
    config = configure(base_config, rollout={"sampling.max_new_tokens": 120, "sampling.temperature": 1.0})
    context = RolloutContext(config, tokenizer, client)
    victims, restarts = list(fleet.servers), fleet.restarts

    async def stopped() -> BaseException:
        rollout_task = asyncio.create_task(run_rollout(context, DataSource(config)))
        await asyncio.to_thread(_wait, lambda: all(load(s.url) > 0 for s in victims), 30.0)
        for victim in victims:
            victim.kill()
        try:
            await rollout_task
        except FleetDown as exc:
            return exc
        finally:
            await client.close()
        raise AssertionError("the rollout completed with every engine dead")

    async def healed() -> RolloutResult:
        watcher = asyncio.create_task(fleet.watch(interval_s=0.2))
        try:
            return await healed_rollout(context, DataSource(config), fleet)
        finally:
            watcher.cancel()
            await client.close()

    error = asyncio.run(stopped())
    assert "every engine is down" in str(error) and set(client.down) == {v.url for v in victims}
    result = asyncio.run(healed())
    assert fleet.restarts == restarts + 2 and not client.down
    samples = [s for g in result.groups for s in g]
    assert len(result.groups) == 4 and len(samples) == 16 and result.metrics["failed_samples"] == 0
    for sample in samples:
        check_sample(sample, tokenizer, 120)


def load(url: str) -> int:
    return requests.get(f"{url}/get_load", timeout=5).json()[0]["num_reqs"]


def _wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_data_source_state_round_trip_reproduces_the_next_groups(base_config) -> None:
    config = configure(base_config, rollout={"partial_rollout": True})
    source = DataSource(config)
    source.get_groups(5)
    leftover = source.get_groups(1)
    leftover[0][0].tokens, leftover[0][0].response_length = [1, 2, 3], 1
    source.add_to_buffer(leftover)
    state = json.loads(json.dumps(source.state_dict()))  # what a checkpoint stores
    expected = source.get_groups(3)
    restored = DataSource(config)
    restored.load_state_dict(state)
    assert [[s.to_dict() for s in g] for g in restored.get_groups(3)] == [
        [s.to_dict() for s in g] for g in expected
    ]
    assert expected[0][0].tokens == [1, 2, 3]  # the buffered group comes first
