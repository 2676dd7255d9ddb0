"""MoE routing replay (R3): the policy's forwards use the experts the rollout engine chose.

A tiny numeric difference between engine and trainer flips top-k expert choices, and a flipped
expert moves a token's logprob by far more than rounding. With `algorithm.routing_replay` every
policy forward (reference, old-logprob and training, and the backward recompute under activation
recompute) routes each token to the engine's experts, through megatron-core's own mechanism
(`TransformerConfig.moe_enable_routing_replay`, `transformer/moe/router_replay.py`): the router
still computes its scores and gathers the replayed experts' weights from them, so gradients flow
through the router as usual.

Each router of the policy gets an `EngineRouting` (megatron-core's `RouterReplay`, which also
counts how often its own top-k set would have differed). Targets are set per micro-batch and per
model chunk, never through megatron-core's process-wide instance list: a critic built in the same
process (which does not replay: its routing is its own) cannot mix its routers in.

Shapes: B = rows, S = positions, L = MoE layers, K = top-k, N = tokens in router order.
megatron-core routes `[S, B, H]` hidden states flattened sequence-major (token (s, b) is row
s * B + b), and under sequence parallelism each TP rank routes only its contiguous slice of S.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from slimrl.errors import SlimError
from slimrl.model_arch import ModelArch
from slimrl.sample import invalid_expert_id
from slimrl.trainer.batch import MicroBatch, TrainBatch

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class EngineRouting(RouterReplay):
    """One router's replay: megatron-core's, plus a count of tokens whose own top-k set (computed
    from the same scores the replay gathers from) differs from the replayed one.

    Under activation recompute the router runs twice per micro-batch in a training pass: in the
    forward (inside the checkpoint, gradients off) and again in the backward (gradients on); the
    second call takes the micro-batch's targets from megatron-core's backward queue, in order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.valid_N: torch.Tensor | None = None
        self.recompute_in_backward = False
        self.disagree: torch.Tensor | int = 0
        self.counted: torch.Tensor | int = 0
        """Sums on the scores' device: read once per step, no device sync per layer."""

    def set_target_indices(self, topk_indices: torch.Tensor) -> None:
        """The next forward's experts; queued for the backward only under recompute (otherwise every
        micro-batch's targets of a pass would stay alive until its end)."""
        if self.recompute_in_backward:
            super().set_target_indices(topk_indices)
        else:
            self.target_topk_idx = topk_indices

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        forward = self.router_replay_action == RouterReplayAction.REPLAY_FORWARD
        if forward and self.recompute_in_backward and torch.is_grad_enabled():
            self.router_replay_action = RouterReplayAction.REPLAY_BACKWARD
            try:
                return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            finally:
                self.router_replay_action = RouterReplayAction.REPLAY_FORWARD
        if forward and self.valid_N is not None and default_compute_topk is not None:
            self.count_disagreement(scores, topk, num_groups, group_topk, default_compute_topk)
        return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)

    def count_disagreement(
        self, scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None, own_topk: TopK
    ) -> None:
        """Add the valid tokens whose own top-k set (from `scores`) differs from the target's."""
        assert self.target_topk_idx is not None and self.valid_N is not None
        with torch.no_grad():
            _, own = own_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            target = self.target_topk_idx.to(own.device)
            differs = (own.sort(dim=1).values != target.sort(dim=1).values).any(dim=1)
            valid = self.valid_N.to(own.device)
            self.disagree = self.disagree + (differs & valid).sum()
            self.counted = self.counted + valid.sum()

    def reset(self) -> None:
        self.clear_indices()
        self.clear_router_replay_action()
        self.valid_N = None


@dataclass(frozen=True)
class Disagreement:
    """Token x layer pairs whose engine top-k set differs from the trainer's own, and how many were
    compared (real input tokens only: no padding, no last token, no filler micro-batch)."""

    disagree: int
    counted: int


def moe_layer_numbers(arch: ModelArch) -> list[int]:
    """1-based global numbers of the MoE layers: index i of a routing's L axis is the i-th of them."""
    pattern = arch.moe_layer_pattern or (1,) * arch.num_layers
    return [layer + 1 for layer, is_moe in enumerate(pattern) if is_moe]


def check_routing(batch: TrainBatch, arch: ModelArch) -> None:
    """Every sequence has a routing of shape (len(tokens) - 1, MoE layers, top-k) with distinct valid
    ids: anything else would silently route tokens to other experts than the engine's."""
    assert arch.num_experts is not None
    expected_tail = (len(moe_layer_numbers(arch)), arch.moe_topk)
    if batch.routed_experts is None:
        raise SlimError(
            f"sample {batch.sample_indices[0]}: algorithm.routing_replay=true but the batch has no "
            f"rollout_routed_experts (the engine must return routed experts)"
        )
    for k, routed in enumerate(batch.routed_experts):
        array = np.asarray(routed)
        expected = (len(batch.tokens[k]) - 1, *expected_tail)
        if array.shape != expected:
            raise SlimError(
                f"sample {batch.sample_indices[k]}: rollout_routed_experts has shape {array.shape}, "
                f"expected {expected} (tokens - 1, MoE layers, top-k) for this model"
            )
        if not array.size:
            continue
        if (bad := invalid_expert_id(array, arch.num_experts)) is not None:
            raise SlimError(
                f"sample {batch.sample_indices[k]}: rollout_routed_experts holds expert id "
                f"{bad}, valid ids are 0..{arch.num_experts - 1}"
            )
        ordered = np.sort(array, axis=-1)
        repeated = np.argwhere(ordered[..., 1:] == ordered[..., :-1])
        if len(repeated):
            token, layer, _ = repeated[0]
            raise SlimError(
                f"sample {batch.sample_indices[k]}: rollout_routed_experts names an expert twice for "
                f"token {token} in MoE layer {layer}: {array[token, layer].tolist()} (top-k must be distinct)"
            )


def router_order(values_BS: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """[B, S, ...] -> this rank's tokens in router order [N, ...]."""
    from megatron.core import parallel_state as mpu

    values_SB = values_BS.transpose(0, 1)
    if sequence_parallel:
        size = mpu.get_tensor_model_parallel_world_size()
        rank = mpu.get_tensor_model_parallel_rank()
        share = values_SB.shape[0] // size
        values_SB = values_SB[rank * share : (rank + 1) * share]
    return values_SB.reshape(-1, *values_SB.shape[2:])


def valid_positions(mb: MicroBatch) -> torch.Tensor:
    """[B, S] True at a real sequence's input tokens that have a routing (all but its last)."""
    seq = mb.seq_index_BS
    following = torch.full_like(seq, -1)
    following[:, :-1] = seq[:, 1:]
    valid = (seq >= 0) & (following == seq)
    ids = torch.tensor([*mb.sample_ids, -1], dtype=torch.long)
    return valid & (ids[seq.clamp(min=-1)] >= 0)  # filler micro-batches (id -1) are not counted


class RoutingReplay:
    """Replay of the engine's routing in one model's chunks (the policy's).

    Usage per pass: `start(recompute)`, then `set_targets(chunk, mb)` in every forward step before
    the chunk's forward, `finish()` after the schedule. Disagreement is counted in the passes after
    `measure_next = True` (each such pass starts the count afresh: an OOM retry counts once), and
    `take_disagreement()` returns it and stops counting. `enabled = False` lets the routers choose
    for themselves (the counterfactual diagnosis).
    """

    def __init__(self, chunks: list[Any], arch: ModelArch, sequence_parallel: bool) -> None:
        if not arch.is_moe:
            raise SlimError(f"algorithm.routing_replay=true needs an MoE model; {arch.model_type} is dense")
        self.sequence_parallel = sequence_parallel
        index_of = {number: i for i, number in enumerate(moe_layer_numbers(arch))}
        self.routers: list[list[tuple[int, EngineRouting]]] = []
        """Per chunk: (index on the routing's L axis, replay) of each of its MoE layers."""
        for chunk in chunks:
            layers = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter) and module.router_replay is not None:
                    layers.append((index_of[module.layer_number], _upgrade(module)))
            self.routers.append(layers)
        self._chunk_ids = [id(chunk) for chunk in chunks]
        self.measure_next = False
        self.enabled = True

    def __len__(self) -> int:
        return sum(len(layers) for layers in self.routers)

    def start(self, recompute_in_backward: bool) -> None:
        """Before a pass: empty queues (a retried pass must not see the failed one's targets)."""
        for _, replay in self._all():
            replay.reset()
            replay.recompute_in_backward = recompute_in_backward
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            if self.measure_next:
                replay.disagree = replay.counted = 0

    def set_targets(self, chunk: Any, mb: MicroBatch) -> None:
        """Targets of `mb` for the routers of `chunk` (one of the chunks this was built on, or a
        wrapper of it)."""
        layers = self.routers[self._chunk_index(chunk)]
        if not layers:
            return
        if mb.routed_experts_BSLK is None:
            raise SlimError("algorithm.routing_replay=true: a micro-batch arrived without routing")
        routed_NLK = router_order(mb.routed_experts_BSLK, self.sequence_parallel)
        valid_N = router_order(valid_positions(mb), self.sequence_parallel) if self.measure_next else None
        for index, replay in layers:
            replay.set_target_indices(routed_NLK[:, index].long())
            replay.valid_N = valid_N

    def finish(self) -> None:
        """After a pass: routers compute their own top-k again, queues are freed."""
        for _, replay in self._all():
            replay.reset()

    def take_disagreement(self) -> Disagreement:
        """This rank's counts of the measured pass (sum over ranks for the step's figure)."""
        self.measure_next = False
        disagree = counted = 0
        for _, replay in self._all():
            disagree += int(replay.disagree)
            counted += int(replay.counted)
            replay.disagree = replay.counted = 0
        return Disagreement(disagree=disagree, counted=counted)

    def _all(self) -> list[tuple[int, EngineRouting]]:
        return [item for layers in self.routers for item in layers]

    def _chunk_index(self, chunk: Any) -> int:
        return chunk_index(self._chunk_ids, chunk)


def chunk_index(chunk_ids: list[int], chunk: Any) -> int:
    """Which of the chunks (by id) `chunk` is, or wraps (DDP / Float16Module)."""
    inner = chunk
    while id(inner) not in chunk_ids and hasattr(inner, "module"):
        inner = inner.module
    return chunk_ids.index(id(inner))


def _upgrade(router: TopKRouter) -> EngineRouting:
    """Replace the router's megatron-core `RouterReplay` by an `EngineRouting`, also in
    megatron-core's instance list (same position: its construction order stays intact)."""
    old = router.router_replay
    if isinstance(old, EngineRouting):
        return old
    replay = EngineRouting()  # appended to the instance list by RouterReplay.__init__
    instances = RouterReplay.global_router_replay_instances
    instances.remove(replay)
    instances[instances.index(old)] = replay
    router.router_replay = replay
    return replay
