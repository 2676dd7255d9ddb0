"""Per-token log-probabilities and entropy from vocabulary-parallel logits.

Under tensor parallelism each rank holds logits for a slice of the vocabulary; the full
[tokens, vocab] logits are never gathered. The log-softmax needs only two reductions over the TP
group (max and sum of exponentials), done here with Megatron's vocab-parallel cross entropy for the
label term and differentiable all-reduces for the entropy. Work is chunked over tokens so the
fp32 temporaries stay bounded by `chunk_tokens` x vocab/TP.

Shapes: B = sequences, S = positions, V = this rank's vocabulary slice.
"""

from __future__ import annotations

import torch


def _tp() -> tuple[int, int, object | None]:
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        return 0, 1, None
    return (
        mpu.get_tensor_model_parallel_rank(),
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_tensor_model_parallel_group(),
    )


def mask_padded_vocab(logits_BSV: torch.Tensor, true_vocab: int) -> torch.Tensor:
    """-inf for the rows added to make the vocabulary divisible by TP: they are not tokens."""
    rank, _, _ = _tp()
    width = logits_BSV.shape[-1]
    start = rank * width
    if start + width <= true_vocab:
        return logits_BSV
    columns = torch.arange(start, start + width, device=logits_BSV.device)
    return logits_BSV.masked_fill(columns >= true_vocab, float("-inf"))


def _entropy(logits_NV: torch.Tensor, tp_size: int, group: object | None) -> torch.Tensor:
    import torch.distributed as dist

    local_max = logits_NV.max(dim=-1, keepdim=True).values.detach()
    if tp_size > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits_NV - local_max
    exp = shifted.exp()
    sum_exp = exp.sum(-1)
    weighted = (exp * shifted.masked_fill(torch.isinf(shifted), 0.0)).sum(-1)
    if tp_size > 1:
        from torch.distributed.nn.functional import all_reduce

        sum_exp = all_reduce(sum_exp, group=group)
        weighted = all_reduce(weighted, group=group)
    # H = log Z - E[x] with x shifted by the max: log(sum e^x) - sum(e^x x)/sum(e^x)
    return sum_exp.log() - weighted / sum_exp


def token_logprobs(
    logits_BSV: torch.Tensor,
    labels_BS: torch.Tensor,
    *,
    true_vocab: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) at every position (and the entropy of the distribution), shape [B, S].

    `temperature` divides the logits: the trainer scores tokens under the distribution the
    rollout sampled them from.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    _, tp_size, group = _tp()
    batch, seq, width = logits_BSV.shape
    logits_NV = logits_BSV.reshape(batch * seq, width).float()
    labels_N = labels_BS.reshape(-1)
    logprob_parts, entropy_parts = [], []
    for start in range(0, logits_NV.shape[0], max(chunk_tokens, 1)):
        chunk = logits_NV[start : start + chunk_tokens]
        if temperature != 1.0:
            chunk = chunk / temperature
        chunk = mask_padded_vocab(chunk, true_vocab)
        if with_entropy:
            entropy_parts.append(_entropy(chunk, tp_size, group))
        # Megatron's op wants [S, B, V] and subtracts the max in place: give it its own copy, as
        # [N, 1, V] so every token stays independent.
        targets = labels_N[start : start + chunk_tokens].unsqueeze(1)
        nll = vocab_parallel_cross_entropy(chunk.unsqueeze(1).clone(), targets)
        logprob_parts.append(-nll.squeeze(1))
    logprobs = torch.cat(logprob_parts).view(batch, seq)
    entropy = torch.cat(entropy_parts).view(batch, seq) if with_entropy else None
    return logprobs, entropy
