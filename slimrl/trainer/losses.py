"""Loss functions on one micro-batch. The global normaliser is an argument, never a local mean.

Megatron's schedule divides each micro-batch loss by the number of micro-batches and DDP averages
gradients over data-parallel ranks; `scale` undoes both so that the update equals the gradient
of (sum of per-token losses) / (global divisor), however the step is cut up.
"""

from __future__ import annotations

import torch


def loss_scale(num_microbatches: int, dp_size: int, global_divisor: int) -> float:
    return num_microbatches * dp_size / max(global_divisor, 1)


def sft_loss(
    token_nll_BS: torch.Tensor, loss_mask_BS: torch.Tensor, scale: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy on loss-masked tokens, token-mean over the whole optimizer step."""
    masked_sum = (token_nll_BS.float() * loss_mask_BS).sum()
    report = {"loss_sum": masked_sum.detach().clone(), "tokens": loss_mask_BS.sum().detach().clone()}
    return masked_sum * scale, report
