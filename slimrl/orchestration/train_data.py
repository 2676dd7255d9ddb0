"""Driver side of the trainer contract: `Sample`s -> one `TrainBatch` per data-parallel rank."""

from __future__ import annotations

import numpy as np

from slimrl.errors import SlimError
from slimrl.sample import Sample
from slimrl.sampled import train_digest
from slimrl.trainer.batch import PerToken, TrainBatch


def split_for_dp(
    samples: list[Sample],
    dp_size: int,
    per_token: PerToken[list[list[float]]] | None = None,
    routing: bool = False,
) -> list[TrainBatch]:
    """Equal sample counts per rank (every rank runs the same number of micro-batches, which
    expert-parallel all-to-alls need), balancing token counts greedily, longest first. With
    `routing` each sequence carries the engine's routed experts (MoE routing replay)."""
    if len(samples) % dp_size:
        raise SlimError(f"{len(samples)} samples cannot be split evenly over {dp_size} data-parallel ranks")
    per_rank = len(samples) // dp_size
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].tokens))
    members: list[list[int]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for i in order:
        rank = min((r for r in range(dp_size) if len(members[r]) < per_rank), key=lambda r: load[r])
        members[rank].append(i)
        load[rank] += len(samples[i].tokens)
    global_tokens = sum(sum(s.train_loss_mask()) for s in samples)  # removed samples: all zeros
    extra = per_token or PerToken()
    return [
        TrainBatch(
            tokens=[samples[i].tokens for i in idx],
            response_lengths=[samples[i].response_length for i in idx],
            loss_masks=[samples[i].train_loss_mask() for i in idx],
            per_token=extra.map(lambda values, idx=idx: [values[i] for i in idx]),
            global_num_tokens=global_tokens,
            global_num_seqs=len(samples),
            routed_experts=[_routing(samples[i]) for i in idx] if routing else None,
            sample_indices=[samples[i].index for i in idx],
            digests=[_digest(samples[i], routing) for i in idx],
        )
        for idx in members
    ]


def _digest(sample: Sample, routing: bool) -> str:
    """What the trainer rank must receive: it recomputes this before training (`TrainBatch`)."""
    return train_digest(sample.tokens, sample.train_loss_mask(), _routing(sample) if routing else None)


def _routing(sample: Sample) -> np.ndarray:
    if sample.rollout_routed_experts is None:
        raise SlimError(
            f"sample {sample.index}: algorithm.routing_replay=true but the engine returned no routed "
            f"experts (SGLang needs --enable-return-routed-experts)"
        )
    return np.asarray(sample.rollout_routed_experts)
