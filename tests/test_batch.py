"""Trainer batching: label alignment, token-budget packing, DP split, epoch sampling."""

from __future__ import annotations

import pytest
import torch

from slimrl.data.prompts import EpochSampler
from slimrl.errors import SlimError
from slimrl.orchestration.train_data import split_for_dp
from slimrl.sample import Sample
from slimrl.trainer import batch as batch_module
from slimrl.trainer.batch import PerToken, TrainBatch, collate, collate_packed, split_by_tokens


def _batch(lengths, response=2):
    tokens = [list(range(10, 10 + n)) for n in lengths]
    return TrainBatch(
        tokens=tokens,
        response_lengths=[response] * len(lengths),
        loss_masks=[[1, 0] if response == 2 else [1] * response for _ in lengths],
        per_token=PerToken(advantages=[[0.5, -1.5] for _ in lengths]),
        global_num_tokens=len(lengths),
    )


def test_collate_aligns_response_values_with_labels():
    mb = collate(_batch([5, 3]), pad_to_multiple=4)
    assert mb.tokens_BS.shape == (2, 8)
    # Sequence 0 = [10..14], response = [13, 14]: predicted by the logits at positions 2 and 3.
    assert mb.labels_BS[0, 2:4].tolist() == [13, 14]
    assert mb.loss_mask_BS[0].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    assert mb.response_mask_BS[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert mb.per_token_BS.advantages[1].tolist() == [0.5, -1.5, 0, 0, 0, 0, 0, 0]  # response starts at 1
    assert mb.seq_index_BS[1].tolist() == [1, 1, 1, -1, -1, -1, -1, -1]


def test_collate_pads_rows_with_loss_free_padding():
    # Uniform-shape layouts (VPP): every micro-batch gets the same [rows, length].
    mb = collate(_batch([5, 3]), min_length=6, min_rows=3)
    assert mb.tokens_BS.shape == (3, 6) and mb.num_seqs == 2
    assert mb.tokens_BS[2].tolist() == [0] * 6 and mb.seq_index_BS[2].tolist() == [-1] * 6
    assert mb.loss_mask_BS[2].sum() == 0 and mb.response_mask_BS[2].sum() == 0
    assert mb.per_token_BS.advantages[2].tolist() == [0.0] * 6
    assert set(mb.per_sequence(torch.ones(3, 6))) == {0, 1}


@pytest.mark.parametrize("packed", [False, True])
def test_collate_writes_what_the_row_by_row_reference_writes(monkeypatch, packed):
    """The one-write-per-tensor collation equals `_fill_row` applied sequence by sequence, on
    random batches (prompts of 1..6 tokens, responses of 0..7, padding multiples)."""
    import random

    rng = random.Random(0)
    for _ in range(60):
        lengths = [(rng.randint(1, 6), rng.randint(0, 7)) for _ in range(rng.randint(1, 10))]
        batch = TrainBatch(
            tokens=[[rng.randint(0, 99) for _ in range(p + r)] for p, r in lengths],
            response_lengths=[r for _, r in lengths],
            loss_masks=[[rng.randint(0, 1) for _ in range(r)] for _, r in lengths],
            per_token=PerToken(advantages=[[rng.uniform(-3, 3) for _ in range(r)] for _, r in lengths]),
        )
        multiple = rng.choice([1, 2, 4])
        fast = collate_packed(batch, pad_to_multiple=multiple) if packed else collate(batch, multiple)
        with monkeypatch.context() as patch:
            patch.setattr(
                batch_module, "_fill_rows",
                lambda b, places, t: [batch_module._fill_row(b, *place, t) for place in places],
            )  # fmt: skip
            slow = collate_packed(batch, pad_to_multiple=multiple) if packed else collate(batch, multiple)
        for name in ("tokens_BS", "position_ids_BS", "labels_BS", "loss_mask_BS", "response_mask_BS",
                     "seq_index_BS"):  # fmt: skip
            assert torch.equal(getattr(fast, name), getattr(slow, name)), name
            assert getattr(fast, name).dtype == getattr(slow, name).dtype, name
        assert torch.equal(fast.per_token_BS.advantages, slow.per_token_BS.advantages)
        assert (fast.attention_mask is None) == (slow.attention_mask is None)
        if packed:
            assert torch.equal(fast.attention_mask, slow.attention_mask)


def test_split_by_tokens_respects_budget_and_keeps_every_sequence():
    lengths = [30, 7, 12, 25, 3, 16, 9, 9]
    parts = split_by_tokens(_batch(lengths), max_tokens=40)
    for part in parts:
        assert max(len(t) for t in part.tokens) * len(part) <= 40
    assert sorted(len(t) for p in parts for t in p.tokens) == sorted(lengths)
    assert len(parts) <= 5


def test_split_by_tokens_names_the_budget_when_one_sequence_is_too_long():
    with pytest.raises(SlimError, match=r"train.max_tokens_per_gpu=16: sequence 0 has 30 tokens"):
        split_by_tokens(_batch([30, 4]), max_tokens=16)


def test_split_for_dp_equal_counts_and_balanced_tokens():
    samples = [
        Sample(tokens=[1] * n, response_length=1, loss_mask=[1]) for n in (40, 1, 30, 10, 20, 20, 5, 34)
    ]
    parts = split_for_dp(samples, 2)
    assert [len(p) for p in parts] == [4, 4]
    loads = [sum(len(t) for t in p.tokens) for p in parts]
    assert abs(loads[0] - loads[1]) <= 10
    assert all(p.global_num_tokens == 8 and p.global_num_seqs == 8 for p in parts)
    with pytest.raises(SlimError, match="cannot be split evenly"):
        split_for_dp(samples[:3], 2)


def test_epoch_sampler_is_seeded_and_resumable():
    a = EpochSampler(10, seed=3)
    first = a.take(7)
    state = a.state_dict()
    rest = a.take(8)
    b = EpochSampler(10, seed=3)
    b.load_state_dict(state)
    assert b.take(8) == rest
    assert sorted(first + rest[:3]) == list(range(10))  # first epoch covers everything once
    assert torch.tensor(EpochSampler(10, seed=4).take(10)).tolist() != first + rest[:3]
