"""How close each MoE router came to choosing other experts, per input position: the update
check's probe excludes the positions where engine and trainer may rightly route differently.

Two experts whose scores are nearly equal at the top-k boundary (a near tie) are chosen by
rounding: the engine's kernels and the trainer's round differently, the engine picks the other
expert, and that token's logprob (and, through attention, every later token's) moves by far more
than rounding. That is not a wrong weight. So while the trainer scores the probe, every router of
the policy reports its decision margin per token: the gap between the k-th and the (k+1)-th
selection score (for group-limited routing also between the last chosen and the first dropped
group), relative to the row's largest score. Softmax routers are measured on probabilities
whether megatron-core ranks logits or probabilities (the same order), sigmoid routers on the
scores they rank (expert bias included).

A `MarginProbe` stands in each router's `router_replay` slot (megatron-core hands that object the
exact scores it ranks, `topk_routing_with_score_function`) and computes the same top-k; the
routing is the router's own. Positions come from the micro-batch, as routing replay's targets do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter

from slimrl.trainer.batch import MicroBatch
from slimrl.trainer.routing_replay import TopK, chunk_index, router_order, valid_positions

ROUTER_TIE = 1e-4
"""A margin under this is a near tie. The CPU engine and trainer (both fp32) differ by about 1e-7
in a router's scores: 1000x that. On GPUs (bf16) larger differences flip routes too; the probe's
limit there is set by the first update's difference, which already holds them."""


def decision_margins(scores_NE: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None):
    """[N] relative gap of each row's top-k decision (inf where nothing is left out)."""
    scores_NE = scores_NE.float()
    scale_N = scores_NE.abs().amax(dim=1).clamp(min=1e-30)
    gaps = []
    if group_topk and num_groups and group_topk < num_groups:
        per_group = topk // group_topk
        group_NG = scores_NE.view(len(scores_NE), num_groups, -1).topk(per_group, dim=-1).values.sum(-1)
        ranked_NG = group_NG.sort(dim=1, descending=True).values
        gaps.append(ranked_NG[:, group_topk - 1] - ranked_NG[:, group_topk])
        kept_NG = torch.zeros_like(group_NG, dtype=torch.bool)
        kept_NG.scatter_(1, group_NG.topk(group_topk, dim=1).indices, True)
        kept_NE = kept_NG.repeat_interleave(scores_NE.shape[1] // num_groups, dim=1)
        scores_NE = scores_NE.masked_fill(~kept_NE, float("-inf"))
    ranked_NE = scores_NE.sort(dim=1, descending=True).values
    if topk < ranked_NE.shape[1]:  # a masked (k+1)-th (-inf) leaves an infinite gap
        gaps.append(ranked_NE[:, topk - 1] - ranked_NE[:, topk])
    if not gaps:
        return torch.full_like(scale_N, float("inf"))
    return torch.stack(gaps).amin(dim=0) / scale_N


class MarginProbe:
    """One router's stand-in `router_replay`: the router's own top-k, and the margins recorded."""

    def __init__(self, router: TopKRouter, record: Callable[[torch.Tensor], None]) -> None:
        config = router.config
        self.to_probabilities = router.score_function == "softmax" and not config.moe_router_pre_softmax
        self.record = record

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        ranked = torch.softmax(scores.float(), dim=-1) if self.to_probabilities else scores
        self.record(decision_margins(ranked, topk, num_groups, group_topk))
        return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)


class RouterMargins:
    """The smallest decision margin per input position over this rank's routers of `chunks`.

    Usage: `with margins.recording():` around a forward-only pass whose schedule calls
    `set_batch(chunk, mb)` before each chunk's forward; then `smallest` maps each position (the
    token's index in its sequence) to its smallest margin on this rank.
    """

    def __init__(self, chunks: list[Any], sequence_parallel: bool) -> None:
        self.sequence_parallel = sequence_parallel
        self.routers = [[m for m in chunk.modules() if isinstance(m, TopKRouter)] for chunk in chunks]
        self._chunk_ids = [id(chunk) for chunk in chunks]
        self.positions_N: dict[int, torch.Tensor] = {}
        """Per chunk index: the position of each token in router order (-1: not a real input)."""
        self.smallest: dict[int, float] = {}
        self.unmapped = False
        """A router saw other tokens than the micro-batch's positions say: its margins are unknown,
        and the probe compares every token (as before margins existed) rather than guess."""

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Every router's `router_replay` slot holds a `MarginProbe` (routing replay's, if any, is
        put back afterwards: the probe's routing is the routers' own)."""
        self.smallest, self.unmapped = {}, False
        saved = []
        for index, routers in enumerate(self.routers):
            for router in routers:
                saved.append((router, router.router_replay))
                router.router_replay = MarginProbe(router, self._recorder(index))
        try:
            yield
        finally:
            for router, replay in saved:
                router.router_replay = replay
            self.positions_N = {}

    def set_batch(self, chunk: Any, mb: MicroBatch) -> None:
        position_BS = mb.position_ids_BS.masked_fill(~valid_positions(mb), -1)
        index = chunk_index(self._chunk_ids, chunk)
        self.positions_N[index] = router_order(position_BS, self.sequence_parallel)

    def _recorder(self, index: int) -> Callable[[torch.Tensor], None]:
        def record(margins_N: torch.Tensor) -> None:
            positions = self.positions_N[index].tolist()
            if len(positions) != len(margins_N):  # a layout that splits tokens another way (CP)
                self.unmapped = True
                return
            for position, margin in zip(positions, margins_N.tolist(), strict=True):
                if position >= 0:
                    self.smallest[position] = min(margin, self.smallest.get(position, float("inf")))

        return record
