"""Trained tokens are sampled tokens (`slimrl/sampled.py`): a hook that rewrites what an engine
sampled, or trains on tokens no engine sampled, is refused in one line naming the stage; a routing
table with repeated experts (all zeros) is refused; a batch changed between driver and trainer is
refused on the trainer rank. Engine turns are SGLang 0.5.23's `/generate` reply shape."""

from __future__ import annotations

import numpy as np
import pytest

from slimrl.errors import SlimError
from slimrl.orchestration.rl_loop import AFTER_GENERATION, train_batches
from slimrl.preflight import load_config
from slimrl.rollout.generate import apply_response
from slimrl.sample import Sample, Status
from slimrl.sampled import check_routing_rows, check_sampled
from slimrl.trainer.batch import digest_problem


def turn(ids: list[int], version: str = "3") -> dict:
    """One engine turn as SGLang answers it (logprob, token id, text) per output token."""
    triples = [[-0.5, t, None] for t in ids]
    meta = {"output_token_logprobs": triples, "finish_reason": {"type": "stop"}, "weight_version": version}
    return {"text": "x", "output_ids": ids, "meta_info": meta}


def sampled(index: int = 0) -> Sample:
    sample = Sample(index=index, tokens=[5, 6, 7], reward=1.0)
    apply_response(sample, turn([11, 12, 13]))
    sample.tokens += [90, 91]  # a tool's output, not trained on
    sample.response_length += 2
    sample.loss_mask = [*sample.loss_mask, 0, 0]
    apply_response(sample, turn([14, 15], version="4"))
    return sample


def test_engine_turns_are_recorded_and_pass_where_nothing_changed() -> None:
    sample = sampled()
    assert [(s["start"], s["end"], s["versions"]) for s in sample.sampled_spans] == [
        (0, 3, ["3"]),
        (5, 7, ["4"]),
    ]
    check_sampled(sample, "generate")
    assert Sample.from_dict(sample.to_dict()).sampled_spans == sample.sampled_spans  # buffered too


def test_a_rewritten_or_foreign_trained_token_is_refused_naming_the_stage() -> None:
    rewritten = sampled()
    rewritten.tokens[-1] = 16
    with pytest.raises(
        SlimError, match=r"^my.hook: sample 0 \(group 0\): response tokens 5-7 are not the ones"
    ):
        check_sampled(rewritten, "my.hook")
    foreign = sampled()
    foreign.loss_mask[3] = 1  # the tool's output, trained on
    with pytest.raises(
        SlimError,
        match="1 token\\(s\\) trained on were not sampled by an engine \\(first at response position 3\\)",
    ):
        check_sampled(foreign, "my.hook")
    appended = sampled()
    appended.tokens.append(2)  # an EOS forced in by a hook, trained on
    appended.response_length += 1
    appended.loss_mask.append(1)
    with pytest.raises(SlimError, match="first at response position 7"):
        check_sampled(appended, "my.hook")


def test_the_driver_refuses_a_batch_a_reward_hook_rewrote(tmp_path, tiny_model) -> None:
    config = load_config(None, [f"model.hf_checkpoint={tiny_model('qwen3_moe')}"])
    groups = [[sampled(0), sampled(1)]]
    for s in groups[0]:
        s.status = Status.COMPLETED
    assert len(train_batches(config, groups, 1)) == 1
    groups[0][1].tokens[4] = 99  # a hook after generation edits the sampled tokens
    with pytest.raises(SlimError) as refused:
        train_batches(config, groups, 1)
    assert str(refused.value).startswith(f"{AFTER_GENERATION}: sample 1 (group 0): response tokens 0-3")


def test_a_routing_table_with_repeated_experts_is_refused() -> None:
    routing = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    check_routing_rows(routing, "sample 3")
    zeros = np.zeros_like(routing)
    with pytest.raises(
        SlimError, match=r"^sample 3: routing row 0 repeats an expert in MoE layer 0 \(\[0, 0\]\)"
    ):
        check_routing_rows(zeros, "sample 3")


def test_the_trainer_rank_finds_a_sequence_changed_on_the_way(tiny_model) -> None:
    from slimrl.orchestration.train_data import split_for_dp

    samples = [sampled(0), sampled(1)]
    (batch,) = split_for_dp(samples, 1)
    assert digest_problem(batch) is None
    batch.loss_masks[1] = [1] * len(batch.loss_masks[1])
    assert digest_problem(batch).startswith(
        "sample 1: its tokens, loss mask or routing rows reached the trainer changed"
    )
