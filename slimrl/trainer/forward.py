"""Forward-only passes through the pipeline schedule (any TP/PP/EP layout)."""

from __future__ import annotations

from typing import Any

import torch


def forward_logits(chunks: list[Any], tokens_BS: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [B, S, V_padded] on last-stage ranks, None elsewhere.

    Gathers the vocabulary shards over TP: for checks and small models only. Training and logprob
    paths use vocabulary-parallel ops and never build the full logits.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, length = tokens_BS.shape
    positions = torch.arange(length).unsqueeze(0).expand(batch, length)
    captured: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        output = model(tokens, positions, None)

        def keep(output_tensor):
            captured.append(gather_from_tensor_model_parallel_region(output_tensor).detach())
            return output_tensor.sum() * 0.0, {}

        return output, keep

    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter([tokens_BS]) for _ in chunks] if len(chunks) > 1 else iter([tokens_BS]),
            model=chunks,
            num_microbatches=1,
            seq_length=length,
            micro_batch_size=batch,
            forward_only=True,
        )
    for chunk in chunks:
        chunk.train()
    if not mpu.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return captured[0]
