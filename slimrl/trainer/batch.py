"""What a training rank receives (`TrainBatch`) and how it is cut into micro-batches.

Tensor names carry shape suffixes: B = sequences in the micro-batch, S = padded sequence length,
L = MoE layers, K = experts per token (top-k).
Per-token arrays are aligned with the *labels*: position t holds what is needed to score
token t+1 (the logits at t predict it), so a response token at absolute position p lives at p-1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Generic, TypeVar

import numpy as np
import torch

from slimrl.errors import SlimError
from slimrl.sampled import train_digest

T = TypeVar("T")
U = TypeVar("U")


@dataclass
class PerToken(Generic[T]):
    """What a step carries per response token beside the tokens, each None until something sets it.
    In a `TrainBatch` each is a list per sequence (its response tokens); in a `MicroBatch` a [B, S]
    tensor aligned with the labels. The driver sets `rollout_logp` and, by estimator, `advantages`
    (group estimators) or `scores` (token-level ones); the trainer's passes add the rest."""

    rollout_logp: T | None = None
    """The engine's logprob of each sampled token."""
    advantages: T | None = None
    """The advantage each token is trained with."""
    scores: T | None = None
    """Token-level estimators: the sample's score on every token (raw reward, or group-centred for
    REINFORCE++-baseline), from which the trainer computes `advantages`."""
    old_logp: T | None = None
    """The policy's logprobs before this rollout's first update (the ratio's denominator)."""
    ref_logp: T | None = None
    """The reference model's logprobs (KL terms)."""
    token_rewards: T | None = None
    """PPO: the score on the last loss token minus the KL penalty on each."""
    old_values: T | None = None
    """PPO: the critic's values before its update (the value clip's anchor)."""
    returns: T | None = None
    """PPO: GAE's returns (the value loss's target)."""

    def items(self) -> list[tuple[str, T]]:
        """The values that are set, by name, in declaration order."""
        return [(f.name, value) for f in fields(self) if (value := getattr(self, f.name)) is not None]

    def map(self, fn: Callable[[T], U]) -> PerToken[U]:
        """`fn` applied to every value that is set."""
        return PerToken(**{name: fn(value) for name, value in self.items()})


@dataclass(kw_only=True)
class TrainBatch:
    """One DP rank's share of an optimizer step. Lists have one entry per sequence."""

    tokens: list[list[int]]
    response_lengths: list[int]
    loss_masks: list[list[int]]
    """Per response token."""
    per_token: PerToken[list[list[float]]] = field(default_factory=PerToken)
    """Per response token: advantages, rollout and old/ref logprobs, ... (`PerToken`)."""
    global_num_tokens: int = 0
    """Loss-masked tokens of the whole optimizer step over all DP ranks (the token-mean divisor)."""
    global_num_seqs: int = 0
    """Sequences of the whole optimizer step over all DP ranks (the seq-mean divisor)."""
    ids: list[int] = field(default_factory=list)
    """Position of each sequence in the batch it was selected from (filled by `select`)."""
    routed_experts: list[np.ndarray] | None = None
    """MoE routing replay: per sequence the engine's expert ids, `(len(tokens) - 1, L, K)`, row i
    for input token i (`Sample.rollout_routed_experts`); None without replay."""
    sample_indices: list[int] = field(default_factory=list)
    """`Sample.index` of each sequence, to name it in messages (defaults to its position)."""
    digests: list[str] = field(default_factory=list)
    """Per sequence, `sampled.train_digest` of (tokens, loss mask, routing) as the driver built it;
    the trainer rank checks it before training (`check_digests`). Empty: not checked."""

    def __post_init__(self) -> None:
        if not self.ids:
            self.ids = list(range(len(self.tokens)))
        if not self.sample_indices:
            self.sample_indices = list(self.ids)

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, indices: list[int]) -> TrainBatch:
        return TrainBatch(
            tokens=[self.tokens[i] for i in indices],
            response_lengths=[self.response_lengths[i] for i in indices],
            loss_masks=[self.loss_masks[i] for i in indices],
            per_token=self.per_token.map(lambda values: [values[i] for i in indices]),
            global_num_tokens=self.global_num_tokens,
            global_num_seqs=self.global_num_seqs,
            ids=[self.ids[i] for i in indices],
            routed_experts=None if self.routed_experts is None else [self.routed_experts[i] for i in indices],
            sample_indices=[self.sample_indices[i] for i in indices],
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
    per_token_BS: PerToken[torch.Tensor]
    seq_index_BS: torch.Tensor
    """Index (within this micro-batch) of the sequence each position belongs to, -1 for padding."""
    sample_ids: list[int]
    """Rank-batch index of each sequence of the micro-batch."""
    attention_mask: torch.Tensor | None = None
    """Packed rows only: [1, 1, S, S] boolean, True where attention is forbidden."""
    routed_experts_BSLK: torch.Tensor | None = None
    """Routing replay: the engine's experts for each input position; positions without a routing
    (padding, a sequence's last token) hold experts 0..K-1, whose output reaches no logprob."""

    @property
    def num_seqs(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens_BS.numel())

    @property
    def real_tokens(self) -> int:
        return int((self.seq_index_BS >= 0).sum())

    def per_sequence(self, values_BS: torch.Tensor) -> dict[int, list[float]]:
        """Response-token values of each sequence, keyed by its rank-batch index."""
        out: dict[int, list[float]] = {}
        flat_values = values_BS.detach().reshape(-1).tolist()
        flat_seq = self.seq_index_BS.reshape(-1).tolist()
        flat_resp = self.response_mask_BS.reshape(-1).tolist()
        for value, seq, resp in zip(flat_values, flat_seq, flat_resp, strict=True):
            if seq >= 0 and resp > 0:
                out.setdefault(self.sample_ids[seq], []).append(value)
        return out


def _fill_row(batch: TrainBatch, j: int, offset: int, row: int, t: dict[str, torch.Tensor]) -> None:
    """Write sequence j of the batch into row `row` starting at column `offset`."""
    seq = batch.tokens[j]
    n, r = len(seq), batch.response_lengths[j]
    t["tokens"][row, offset : offset + n] = torch.tensor(seq)
    t["labels"][row, offset : offset + n - 1] = torch.tensor(seq[1:])
    t["seq_index"][row, offset : offset + n] = j
    t["positions"][row, offset : offset + n] = torch.arange(n)
    start = offset + n - r - 1  # logits at position `start` predict the first response token
    t["loss_mask"][row, start : start + r] = torch.tensor(batch.loss_masks[j], dtype=torch.float32)
    t["response_mask"][row, start : start + r] = 1.0
    for key, values in batch.per_token.items():
        t[key][row, start : start + r] = torch.tensor(values[j], dtype=torch.float32)


def _fill_rows(batch: TrainBatch, placements: list[tuple[int, int, int]], t: dict[str, torch.Tensor]) -> None:
    """`_fill_row(batch, j, offset, row, t)` for every (j, offset, row), with one indexed write
    per tensor instead of ten small writes per sequence (a rollout of thousands of short answers
    spent a quarter of the trainer's step in those). Sequences the fast path does not cover
    exactly (a response without a prompt token, ragged per-token lists) go through `_fill_row`."""
    width = t["tokens"].shape[1]
    tokens: list[int] = []
    token_at: list[int] = []
    labels: list[int] = []
    label_at: list[int] = []
    seq_index: list[int] = []
    positions: list[int] = []
    response_at: list[int] = []
    loss_mask: list[int] = []
    per_token: dict[str, list[float]] = {key: [] for key, _ in batch.per_token.items()}
    for j, offset, row in placements:
        seq = batch.tokens[j]
        n, r = len(seq), batch.response_lengths[j]
        regular = (
            n - r - 1 >= 0
            and offset + n <= width
            and len(batch.loss_masks[j]) == r
            and all(len(values[j]) == r for _, values in batch.per_token.items())
        )
        if not regular:
            _fill_row(batch, j, offset, row, t)
            continue
        first = row * width + offset
        start = first + n - r - 1  # logits at position `start` predict the first response token
        tokens += seq
        token_at += range(first, first + n)
        labels += seq[1:]
        label_at += range(first, first + n - 1)
        seq_index += [j] * n
        positions += range(n)
        response_at += range(start, start + r)
        loss_mask += batch.loss_masks[j]
        for key, values in batch.per_token.items():
            per_token[key] += values[j]
    at = torch.tensor(token_at, dtype=torch.long)
    t["tokens"].view(-1)[at] = torch.tensor(tokens, dtype=torch.long)
    t["labels"].view(-1)[torch.tensor(label_at, dtype=torch.long)] = torch.tensor(labels, dtype=torch.long)
    t["seq_index"].view(-1)[at] = torch.tensor(seq_index, dtype=torch.long)
    t["positions"].view(-1)[at] = torch.tensor(positions, dtype=torch.long)
    response = torch.tensor(response_at, dtype=torch.long)
    t["loss_mask"].view(-1)[response] = torch.tensor(loss_mask, dtype=torch.float32)
    t["response_mask"].view(-1)[response] = 1.0
    for key, values in per_token.items():
        t[key].view(-1)[response] = torch.tensor(values, dtype=torch.float32)


def _empty(rows: int, length: int, keys: list[str], pad_id: int) -> dict[str, torch.Tensor]:
    t = {
        "tokens": torch.full((rows, length), pad_id, dtype=torch.long),
        "labels": torch.full((rows, length), pad_id, dtype=torch.long),
        "seq_index": torch.full((rows, length), -1, dtype=torch.long),
        "positions": torch.zeros((rows, length), dtype=torch.long),
        "loss_mask": torch.zeros((rows, length), dtype=torch.float32),
        "response_mask": torch.zeros((rows, length), dtype=torch.float32),
    }
    t.update({k: torch.zeros((rows, length), dtype=torch.float32) for k in keys})
    return t


def _routing(
    batch: TrainBatch, placements: list[tuple[int, int, int]], rows: int, length: int
) -> torch.Tensor | None:
    """[rows, length, L, K] expert ids laid out like the tokens (see `MicroBatch.routed_experts_BSLK`)."""
    if batch.routed_experts is None:
        return None
    first = np.asarray(batch.routed_experts[0])
    num_layers, top_k = first.shape[1:]
    out = np.empty((rows, length, num_layers, top_k), dtype=first.dtype)
    out[...] = np.arange(top_k, dtype=first.dtype)  # distinct valid ids for unrouted positions
    for j, offset, row in placements:
        routed = np.asarray(batch.routed_experts[j])
        out[row, offset : offset + len(routed)] = routed
    # torch has no general uint16/32 ops: ids above 255 travel as int32.
    return torch.from_numpy(out if out.dtype == np.uint8 else out.astype(np.int32))


def _micro_batch(
    batch: TrainBatch,
    t: dict[str, torch.Tensor],
    mask: torch.Tensor | None,
    routing: torch.Tensor | None = None,
) -> MicroBatch:
    return MicroBatch(
        tokens_BS=t["tokens"],
        position_ids_BS=t["positions"],
        labels_BS=t["labels"],
        loss_mask_BS=t["loss_mask"],
        response_mask_BS=t["response_mask"],
        per_token_BS=PerToken(**{key: t[key] for key, _ in batch.per_token.items()}),
        seq_index_BS=t["seq_index"],
        sample_ids=list(batch.ids),
        attention_mask=mask,
        routed_experts_BSLK=routing,
    )


def collate(
    batch: TrainBatch, pad_id: int = 0, pad_to_multiple: int = 1, min_length: int = 0, min_rows: int = 0
) -> MicroBatch:
    """One sequence per row, right-padded: padding never reaches a real token's attention. Rows
    beyond the batch's sequences (`min_rows`) are all padding, with no loss and no sequence."""
    longest = max(max(len(t) for t in batch.tokens), min_length)
    length = -(-longest // pad_to_multiple) * pad_to_multiple
    rows = max(len(batch), min_rows)
    t = _empty(rows, length, [key for key, _ in batch.per_token.items()], pad_id)
    placements = [(row, 0, row) for row in range(len(batch))]
    _fill_rows(batch, placements, t)
    return _micro_batch(batch, t, None, _routing(batch, placements, rows, length))


def collate_packed(batch: TrainBatch, pad_id: int = 0, pad_to_multiple: int = 1) -> MicroBatch:
    """All sequences in one row, no padding between them, and a block-diagonal causal mask so
    each attends only to itself. RoPE is relative, so a sequence's logits do not depend on where
    in the row it starts."""
    total = sum(len(t) for t in batch.tokens)
    length = -(-total // pad_to_multiple) * pad_to_multiple
    t = _empty(1, length, [key for key, _ in batch.per_token.items()], pad_id)
    offsets, offset = [], 0
    for seq in batch.tokens:
        offsets.append(offset)
        offset += len(seq)
    placements = [(j, offset, 0) for j, offset in enumerate(offsets)]
    _fill_rows(batch, placements, t)
    segment = t["seq_index"][0]
    same = segment.unsqueeze(0) == segment.unsqueeze(1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = same & causal & (segment >= 0).unsqueeze(1)
    allowed |= torch.eye(length, dtype=torch.bool)  # padding rows attend to themselves (no NaN)
    routing = _routing(batch, placements, 1, length)
    return _micro_batch(batch, t, (~allowed).view(1, 1, length, length), routing)


def split_fixed(batch: TrainBatch, micro_batch_size: int) -> list[TrainBatch]:
    order = list(range(len(batch)))
    return [batch.select(order[i : i + micro_batch_size]) for i in range(0, len(batch), micro_batch_size)]


def split_by_tokens(batch: TrainBatch, max_tokens: int, packed: bool = False) -> list[TrainBatch]:
    """First-fit decreasing: the fewest micro-batches whose processed tokens stay within the
    budget (the sum of lengths when packed, longest x count when padded)."""
    lengths = [len(t) for t in batch.tokens]
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise SlimError(
                f"train.max_tokens_per_gpu={max_tokens}: sequence {i} has {n} tokens on its own; "
                f"raise the budget to at least {n} (or lower rollout.sampling.max_new_tokens)"
            )

    def cost(members: list[int]) -> int:
        return sum(lengths[m] for m in members) if packed else max(lengths[m] for m in members) * len(members)

    bins: list[list[int]] = []
    for i in sorted(range(len(batch)), key=lambda k: -lengths[k]):
        for members in bins:
            if cost([*members, i]) <= max_tokens:
                members.append(i)
                break
        else:
            bins.append([i])
    return [batch.select(members) for members in bins]


def pad_micro_batch_count(parts: list[TrainBatch], count: int) -> list[TrainBatch]:
    """Append loss-free copies of the shortest part until there are `count` parts: every rank of an
    expert-parallel group must run the same number of micro-batches (their all-to-alls pair up)."""
    if len(parts) >= count:
        return parts
    shortest = min(parts, key=lambda p: sum(len(t) for t in p.tokens)).select([0])
    filler = TrainBatch(
        tokens=shortest.tokens,
        response_lengths=shortest.response_lengths,
        loss_masks=[[0] * len(m) for m in shortest.loss_masks],
        per_token=shortest.per_token.map(lambda values: [[0.0] * len(values[0])]),
        global_num_tokens=shortest.global_num_tokens,
        global_num_seqs=shortest.global_num_seqs,
        ids=[-1],
        routed_experts=shortest.routed_experts,
        sample_indices=[-1],
    )
    return parts + [filler] * (count - len(parts))


def digest_problem(batch: TrainBatch) -> str | None:
    """The first sequence that did not arrive as the driver sent it (tokens, loss mask or routing
    rows changed on the way), named; None when every one did."""

    for k, expected in enumerate(batch.digests):
        routing = batch.routed_experts[k] if batch.routed_experts is not None else None
        if train_digest(batch.tokens[k], batch.loss_masks[k], routing) != expected:
            return (
                f"sample {batch.sample_indices[k]}: its tokens, loss mask or routing rows reached the "
                "trainer changed from the batch the driver built; refused, not trained on"
            )
    return None
