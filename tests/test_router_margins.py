"""The update check's router margins (`trainer/router_margins.py`): the gap of each top-k decision
by hand, megatron-core's own routing left unchanged by the probe standing in its replay slot, and
the merge of the ranks' answers. The margins of a real model under every parallel layout, against
Hugging Face's router probabilities, are in tests/test_routing_replay.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

from slimrl.trainer.rank_api import ProbeScore, merged_probe
from slimrl.trainer.router_margins import MarginProbe, RouterMargins, decision_margins


def test_margin_is_the_gap_at_the_top_k_boundary_relative_to_the_largest_score():
    scores = torch.tensor(
        [
            [0.4, 0.3, 0.2, 0.1],  # top-2 {0, 1}; 3rd is 0.2: (0.3 - 0.2) / 0.4
            [0.1, 0.35, 0.35, 0.2],  # 2nd and 3rd... top-2 {1, 2}, 3rd 0.2: (0.35 - 0.2) / 0.35
            [0.3, 0.3, 0.3, 0.1],  # a tie at the boundary: 0
        ]
    )
    margins = decision_margins(scores, 2, None, None)
    assert margins.tolist() == pytest.approx([0.25, 0.15 / 0.35, 0.0], abs=1e-7)
    assert decision_margins(scores, 4, None, None).tolist() == [float("inf")] * 3  # nothing left out


def test_group_limited_margin_takes_the_closer_of_the_group_and_the_expert_decision():
    # 2 groups of 3 experts, 1 group chosen by the sum of its top-2 (topk 2 / group_topk 1)
    scores = torch.tensor(
        [
            [0.40, 0.10, 0.05, 0.30, 0.25, 0.20],  # groups 0.50 vs 0.55: group 1; then 0.25 vs 0.20
            [0.50, 0.40, 0.00, 0.05, 0.04, 0.03],  # groups 0.90 vs 0.09; then 0.40 vs 0.00
        ]
    )
    margins = decision_margins(scores, 2, 2, 1)
    expected = [min(0.05, 0.25 - 0.20) / 0.40, min(0.81, 0.40 - 0.00) / 0.50]
    assert margins.tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    ("score_function", "pre_softmax", "groups", "bias"),
    [
        ("softmax", False, None, False),
        ("softmax", True, None, False),
        ("sigmoid", False, None, True),
        ("sigmoid", False, (4, 2), True),
    ],
)
def test_the_probe_leaves_megatron_cores_routing_as_it_is(score_function, pre_softmax, groups, bias):
    """megatron-core's routing with the probe in its replay slot equals its routing without, and
    the margins are those of the scores it ranks (softmax routers: probabilities)."""
    torch.manual_seed(0)
    logits = torch.randn(12, 8)
    expert_bias = torch.randn(8) * 0.1 if bias else None
    num_groups, group_topk = groups or (None, None)
    kwargs = dict(
        topk=2, use_pre_softmax=pre_softmax, num_groups=num_groups, group_topk=group_topk,
        score_function=score_function, expert_bias=expert_bias,
    )  # fmt: skip
    recorded: list[torch.Tensor] = []
    router = SimpleNamespace(
        config=SimpleNamespace(moe_router_pre_softmax=pre_softmax), score_function=score_function
    )
    probe = MarginProbe(router, recorded.append)  # type: ignore[arg-type]
    probs, routing_map = topk_routing_with_score_function(logits, router_replay=probe, **kwargs)
    own_probs, own_map = topk_routing_with_score_function(logits, **kwargs)
    assert torch.equal(routing_map, own_map) and torch.equal(probs, own_probs)
    if score_function == "softmax":
        ranked = torch.softmax(logits, dim=-1)
    else:
        ranked = torch.sigmoid(logits) + expert_bias
    (margins,) = recorded
    assert torch.equal(margins, decision_margins(ranked, 2, num_groups, group_topk))
    assert bool((margins > 0).all())


def test_ranks_merge_into_the_last_stages_logprobs_and_the_smallest_margins():
    first_stage = ProbeScore(None, {0: 0.2, 1: 0.5, 2: 3e-5}, tie_at=2)
    last_stage = ProbeScore([-1.0, -2.0, -3.0, -4.0], {0: 0.1, 1: 0.7, 2: 0.3})
    merged = merged_probe([first_stage, last_stage])
    assert merged.logprobs == [-1.0, -2.0, -3.0, -4.0]
    assert merged.margins == {0: 0.1, 1: 0.5, 2: 3e-5}
    assert merged.tie_at == 2
    # logprob j comes from positions 0..j: from the tie at position 2 on, none compare
    assert merged.compared == [-1.0, -2.0]
    assert merged_probe([last_stage]).compared == [-1.0, -2.0, -3.0, -4.0]


def test_a_router_that_saw_other_tokens_than_the_positions_leaves_the_margins_unknown():
    """A layout that splits tokens otherwise than the micro-batch says (context parallelism):
    no margin is attributed to a wrong position; the probe then compares every token."""
    margins = RouterMargins([], sequence_parallel=False)
    record = margins._recorder(0)
    margins.positions_N[0] = torch.tensor([0, 1, 2, -1])
    record(torch.tensor([0.5, 1e-6, 0.2, 0.0], dtype=torch.float64))
    assert margins.smallest == {0: 0.5, 1: 1e-6, 2: 0.2} and not margins.unmapped
    record(torch.tensor([0.5, 0.4], dtype=torch.float64))  # two rows for four positions
    assert margins.unmapped and margins.smallest == {0: 0.5, 1: 1e-6, 2: 0.2}
