"""Routed experts on the rollout side (routing replay): the engines' wire form into
`Sample.rollout_routed_experts`, the sample checks' one-line refusals, and what serialises samples.

The engines themselves (real SGLang 0.5.23 and the embedded engine, against Hugging Face's router)
are checked in test_engine_contract.py (`test_routed_experts_are_the_hf_routers_top_k`,
`test_multi_turn_and_continued_samples_hold_every_tokens_routing`).
"""

from __future__ import annotations

import base64
import json
import pickle

import numpy as np
import pytest

from slimrl.errors import SlimError
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.orchestration.sample_log import write_samples
from slimrl.rollout.generate import apply_response
from slimrl.rollout.routing import RoutingLayout, routing_dtype, routing_request
from slimrl.rollout.sample_checks import GENERATE_KEY, check_sample
from slimrl.sample import Sample, Status

TINY = RoutingLayout(num_layers=2, moe_layers=(0, 1), top_k=2, num_experts=4)
FIRST_DENSE = RoutingLayout(num_layers=3, moe_layers=(1, 2), top_k=2, num_experts=300)
"""DeepSeek-V3's shape: a dense first layer, more than 256 experts."""


def wire(array: np.ndarray | list) -> str:
    """SGLang's `meta_info.routed_experts`: base64 of little-endian int32 (by definition)."""
    return base64.b64encode(np.asarray(array, dtype="<i4").tobytes()).decode()


def turn(output_ids: list[int], routed: np.ndarray | list | None) -> dict:
    triples = [[-0.5, t, None] for t in output_ids]
    meta = {"output_token_logprobs": triples, "finish_reason": {"type": "length", "length": len(output_ids)}}
    if routed is not None:
        meta["routed_experts"] = wire(routed)
    return {"text": "", "output_ids": output_ids, "meta_info": meta}


def routed(rows: int, layers: int = 2, start: int = 0) -> np.ndarray:
    """Distinct, recognisable ids: row r of layer l picks experts (r + l) % 4 and (r + l + 1) % 4."""
    r = np.arange(start, start + rows)[:, None, None] + np.arange(layers)[None, :, None]
    return (r + np.arange(2)[None, None, :]) % 4


def test_dtype_is_the_smallest_unsigned_holding_the_experts_and_the_32k_figure() -> None:
    assert [routing_dtype(n) for n in (4, 256, 257, 65536, 65537)] == [
        np.uint8, np.uint8, np.uint16, np.uint16, np.uint32
    ]  # fmt: skip
    big = RoutingLayout(num_layers=94, moe_layers=tuple(range(94)), top_k=8, num_experts=128)
    assert big.bytes_per_token() == 94 * 8 == 752
    assert 32768 * big.bytes_per_token() == 24_641_536  # 24.6 MB per 32k-token sample


def test_layout_from_the_models_config(tiny_model) -> None:
    arch = read_model_arch(tiny_model("qwen3_moe"))
    assert RoutingLayout.of(arch) == RoutingLayout(
        num_layers=arch.num_layers, moe_layers=tuple(range(arch.num_layers)), top_k=2, num_experts=4
    )
    deepseek = RoutingLayout.of(read_model_arch(tiny_model("deepseek_v3")))
    assert deepseek.moe_layers == tuple(
        i for i, m in enumerate(read_model_arch(tiny_model("deepseek_v3")).moe_layer_pattern) if m
    )


def test_turns_stitch_one_row_per_token_but_the_last() -> None:
    """Two engine calls and tool tokens between them: each call asks for the rows the sample lacks
    and its answer fills exactly those, so the sample ends with rows 0..len(tokens)-2 in order."""
    full = routed(13)
    sample = Sample(index=5, group_index=2, tokens=[1, 2, 3])
    assert routing_request(sample) == {"return_routed_experts": True, "routed_experts_start_len": 0}
    apply_response(sample, turn([4, 5, 6], full[:5]), routing=TINY)  # 3 prompt + 3 new - 1 rows
    assert sample.rollout_routed_experts is not None and sample.rollout_routed_experts.dtype == np.uint8
    sample.tokens += [7, 8, 9]  # tool output, loss mask 0: fed by the next call
    sample.response_length += 3
    sample.loss_mask = [1, 1, 1, 0, 0, 0]
    sample.rollout_log_probs = [-0.5] * 3 + [0.0] * 3
    assert routing_request(sample)["routed_experts_start_len"] == 5
    apply_response(sample, turn([10, 11, 12, 13, 14], full[5:]), routing=TINY)
    np.testing.assert_array_equal(sample.rollout_routed_experts, full)
    assert len(sample.tokens) - 1 == len(full)
    check_sample(sample, GENERATE_KEY, 50, routing=TINY)


def test_an_aborted_turn_without_full_routing_is_asked_again_by_the_continuation() -> None:
    """Aborted before its prefill ran, a turn returns no rows for its tokens: the sample keeps what
    it had, and its continuation asks from there."""
    full = routed(6)
    sample = Sample(index=5, tokens=[1, 2, 3])
    aborted = turn([4], full[:0])
    aborted["meta_info"]["finish_reason"] = {"type": "abort"}
    apply_response(sample, aborted, routing=TINY)
    assert sample.rollout_routed_experts is None and sample.status is Status.ABORTED
    assert routing_request(sample)["routed_experts_start_len"] == 0
    apply_response(sample, turn([5, 6, 7], full), routing=TINY)
    np.testing.assert_array_equal(sample.rollout_routed_experts, full)


def test_sglang_columns_for_dense_layers_are_dropped_and_ids_above_255_kept() -> None:
    """SGLang sends one column per decoder layer; the sample keeps the MoE layers only."""
    all_layers = np.stack([np.full((4, 2), 0), np.full((4, 2), 299), np.full((4, 2), 7)], axis=1)
    all_layers[:, 1, 1] = 298
    sample = Sample(tokens=[1, 2], index=1)
    apply_response(sample, turn([3, 4, 5], all_layers), routing=FIRST_DENSE)
    assert sample.rollout_routed_experts is not None and sample.rollout_routed_experts.dtype == np.uint16
    np.testing.assert_array_equal(sample.rollout_routed_experts, all_layers[:, 1:])


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        (
            routed(3).tolist(),
            "the engine returned 12 routed-expert ids for 4 new tokens; expected 4 x 2 MoE layers x top-2 "
            "= 16 (routing from another model?)",
        ),
        (
            (routed(4) + 4).tolist(),
            "the engine returned expert id 7; the model has 4 experts (routing from another model?)",
        ),
    ],
)
def test_an_answer_that_does_not_fit_is_one_line(values: list, needle: str) -> None:
    sample = Sample(tokens=[1, 2], index=9, group_index=3)
    with pytest.raises(SlimError) as info:
        apply_response(sample, turn([3, 4, 5], values), routing=TINY)
    assert str(info.value) == f"sample 9 (group 3): {needle}"


def finished(**fields) -> Sample:
    base = {"index": 7, "group_index": 2, "tokens": [1, 2, 3, 4, 5], "response_length": 2,
            "status": Status.COMPLETED, "rollout_routed_experts": routed(4).astype(np.uint8)}  # fmt: skip
    return Sample(**{**base, **fields})


WHO = f"{GENERATE_KEY}: sample 7 (group 2): rollout_routed_experts"


@pytest.mark.parametrize(
    ("routing", "message"),
    [
        (
            routed(3).tolist(),
            f"{WHO} has shape (3, 2, 2) (int64); expected (4, 2, 2) integers (len(tokens) - 1 = 4, MoE "
            "layers = 2, top_k = 2)",
        ),
        (routed(4, layers=3).tolist(), f"{WHO} has shape (4, 3, 2) (int64); expected (4, 2, 2)"),
        (routed(4)[:, :, :1].tolist(), f"{WHO} has shape (4, 2, 1) (int64); expected (4, 2, 2)"),
        ((routed(4) + 2).tolist(), f"{WHO} holds expert id 5; the model has 4 experts (ids 0..3)"),
        (
            None,
            f"{WHO} is missing but algorithm.routing_replay=true: the engine returned no routed experts (an "
            "SGLang launched without --enable-return-routed-experts or too old to return them",
        ),
    ],
    ids=["rows", "layers", "top_k", "expert id", "missing"],
)
def test_a_finished_sample_with_wrong_or_no_routing_is_one_line(routing, message) -> None:
    with pytest.raises(SlimError) as info:
        check_sample(finished(rollout_routed_experts=routing), GENERATE_KEY, 50, routing=TINY)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_checks_normalise_a_hooks_list_and_leave_unfinished_or_replay_off_samples_alone() -> None:
    one = finished(rollout_routed_experts=routed(4).tolist())
    check_sample(one, GENERATE_KEY, 50, routing=TINY)
    assert isinstance(one.rollout_routed_experts, np.ndarray) and one.rollout_routed_experts.dtype == np.uint8
    check_sample(finished(rollout_routed_experts=None, status=Status.ABORTED), GENERATE_KEY, 50, routing=TINY)
    check_sample(finished(rollout_routed_experts=None), GENERATE_KEY, 50)


def test_serialised_samples_keep_the_array_compact(tmp_path) -> None:
    """Checkpoint buffer (`to_dict`, JSON): base64 of the array, restored exactly; sample log: dtype
    and shape only; Ray (pickle): the array's own bytes."""
    routing = (np.arange(2 * 94 * 8).reshape(2, 94, 8) % 128).astype(np.uint8)
    sample = finished(tokens=[1, 2, 3], rollout_routed_experts=routing)
    data = json.loads(json.dumps(sample.to_dict()))
    assert data["rollout_routed_experts"]["dtype"] == "uint8" and data["rollout_routed_experts"]["shape"] == [
        2,
        94,
        8,
    ]
    back = Sample.from_dict(data)
    assert back.rollout_routed_experts is not None and back.rollout_routed_experts.dtype == np.uint8
    np.testing.assert_array_equal(back.rollout_routed_experts, routing)
    assert back.to_dict() == data and sample.rollout_routed_experts is routing
    assert len(pickle.dumps(sample)) < routing.nbytes + 1024
    write_samples(tmp_path / "s.jsonl", 0, [[sample]], "train")
    logged = json.loads((tmp_path / "s.jsonl").read_text())
    assert logged["rollout_routed_experts"] == {"dtype": "uint8", "shape": [2, 94, 8]}
