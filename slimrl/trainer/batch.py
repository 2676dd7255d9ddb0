"""What a training rank receives (`TrainBatch`) and how it is cut into micro-batches.

Tensor names carry shape suffixes: B = sequences in the micro-batch, S = padded sequence length.
Per-token arrays are aligned with the *labels*: position t holds what is needed to score
token t+1 (the logits at t predict it), so a response token at absolute position p lives at p-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slimrl.errors import SlimError


@dataclass(kw_only=True)
class TrainBatch:
    """One DP rank's share of an optimizer step. Lists have one entry per sequence."""

    tokens: list[list[int]]
    response_lengths: list[int]
    loss_masks: list[list[int]]
    """Per response token."""
    per_token: dict[str, list[list[float]]] = field(default_factory=dict)
    """Extra per-response-token values: advantages, rollout_log_probs, old/ref logprobs..."""
    global_num_tokens: int = 0
    """Loss-masked tokens of the whole optimizer step over all DP ranks (the token-mean divisor)."""
    global_num_seqs: int = 0
    """Sequences of the whole optimizer step over all DP ranks (the seq-mean divisor)."""

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, indices: list[int]) -> TrainBatch:
        return TrainBatch(
            tokens=[self.tokens[i] for i in indices],
            response_lengths=[self.response_lengths[i] for i in indices],
            loss_masks=[self.loss_masks[i] for i in indices],
            per_token={k: [v[i] for i in indices] for k, v in self.per_token.items()},
            global_num_tokens=self.global_num_tokens,
            global_num_seqs=self.global_num_seqs,
        )


@dataclass(kw_only=True)
class MicroBatch:
    tokens_BS: torch.Tensor
    position_ids_BS: torch.Tensor
    labels_BS: torch.Tensor
    loss_mask_BS: torch.Tensor
    """1.0 where the label is a trained response token."""
    response_mask_BS: torch.Tensor
    """1.0 where the label is any response token (trained or not)."""
    per_token_BS: dict[str, torch.Tensor]
    seq_index_BS: torch.Tensor
    """Index of the sequence (within the micro-batch) each position belongs to, -1 for padding."""
    num_seqs: int

    @property
    def num_tokens(self) -> int:
        return int(self.tokens_BS.numel())


def collate(batch: TrainBatch, pad_id: int = 0, pad_to_multiple: int = 1, min_length: int = 0) -> MicroBatch:
    """Right-pad sequences to a common length; padding never reaches a real token's attention."""
    longest = max(max(len(t) for t in batch.tokens), min_length)
    length = -(-longest // pad_to_multiple) * pad_to_multiple
    size = len(batch.tokens)
    tokens = torch.full((size, length), pad_id, dtype=torch.long)
    labels = torch.full((size, length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((size, length), dtype=torch.float32)
    response_mask = torch.zeros((size, length), dtype=torch.float32)
    seq_index = torch.full((size, length), -1, dtype=torch.long)
    per_token = {k: torch.zeros((size, length), dtype=torch.float32) for k in batch.per_token}
    for row, seq in enumerate(batch.tokens):
        n, r = len(seq), batch.response_lengths[row]
        tokens[row, :n] = torch.tensor(seq)
        labels[row, : n - 1] = tokens[row, 1:n]
        seq_index[row, :n] = row
        start = n - r - 1  # logits at position start predict the first response token
        loss_mask[row, start : start + r] = torch.tensor(batch.loss_masks[row], dtype=torch.float32)
        response_mask[row, start : start + r] = 1.0
        for key, values in batch.per_token.items():
            per_token[key][row, start : start + r] = torch.tensor(values[row], dtype=torch.float32)
    positions = torch.arange(length).unsqueeze(0).expand(size, length).contiguous()
    return MicroBatch(
        tokens_BS=tokens,
        position_ids_BS=positions,
        labels_BS=labels,
        loss_mask_BS=loss_mask,
        response_mask_BS=response_mask,
        per_token_BS=per_token,
        seq_index_BS=seq_index,
        num_seqs=size,
    )


def split_fixed(batch: TrainBatch, micro_batch_size: int) -> list[TrainBatch]:
    order = list(range(len(batch)))
    return [batch.select(order[i : i + micro_batch_size]) for i in range(0, len(batch), micro_batch_size)]


def split_by_tokens(batch: TrainBatch, max_tokens: int) -> list[TrainBatch]:
    """First-fit decreasing: fewest micro-batches whose padded size stays within the budget."""
    lengths = [len(t) for t in batch.tokens]
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise SlimError(
                f"train.max_tokens_per_gpu={max_tokens}: sequence {i} has {n} tokens on its own; "
                f"raise the budget to at least {n} (or lower rollout.sampling.max_new_tokens)"
            )
    bins: list[list[int]] = []
    for i in sorted(range(len(batch)), key=lambda k: -lengths[k]):
        for members in bins:
            if max(lengths[m] for m in [*members, i]) * (len(members) + 1) <= max_tokens:
                members.append(i)
                break
        else:
            bins.append([i])
    return [batch.select(members) for members in bins]
