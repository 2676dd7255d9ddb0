"""Streaming export: a running sharded Megatron model -> HF-named full tensors, in buckets.

Used by the Megatron -> HF converter and by the weight sync to the rollout fleet. Tensor shards
are gathered over their (expert-)tensor-parallel group one tensor at a time, so no rank ever holds
more than one full tensor plus the bucket it is filling. Every HF tensor is produced by exactly
one *owner* rank: TP/ETP rank 0 of data-parallel replica 0, in the pipeline stage (and expert-
parallel rank) holding it; other ranks take part in the gathers and yield nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from slimrl.megatron_bridge.bucketing import bucketed, load_together
from slimrl.megatron_bridge.hf_io import BridgeError
from slimrl.megatron_bridge.loading import ShardContext, rules_for
from slimrl.megatron_bridge.model_arch import ModelArch
from slimrl.megatron_bridge.naming import LocalTensor, is_expert_name, local_layer, local_tensors
from slimrl.megatron_bridge.transforms import megatron_full_to_hf, unshard
from slimrl.trainer.parallel import ParallelLayout

NamedTensors = list[tuple[str, torch.Tensor]]


def _gather(local: LocalTensor, tensor: torch.Tensor, ctx: ShardContext) -> list[torch.Tensor]:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    _, size = ctx.group(local)
    if local.partition_dim is None or size == 1:
        return [tensor.detach()]
    group = (
        mpu.get_expert_tensor_parallel_group() if local.is_expert else mpu.get_tensor_model_parallel_group()
    )
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=group)
    return shards


def _replica(is_expert: bool) -> tuple[int, int]:
    """(index, count) of the data-parallel replicas holding identical copies of such a tensor."""
    from megatron.core import parallel_state as mpu

    if is_expert:
        return mpu.get_expert_data_parallel_rank(), mpu.get_expert_data_parallel_world_size()
    dp = mpu.get_data_parallel_rank(with_context_parallel=True)
    return dp, mpu.get_data_parallel_world_size(with_context_parallel=True)


class Ownership:
    """Which data-parallel replica produces each HF tensor.

    By default replica 0 speaks for all (the weight sync: other replicas are busy training). A
    conversion spreads the work instead: each replica takes a contiguous block of layers, the
    first also the embedding and the last the tensors after the layers. A whole TP/ETP group
    shares its replica index, so a group decides together and its gathers stay matched."""

    def __init__(self, chunks: list[Any], spread: bool) -> None:
        self.spread = spread
        self.layers = [len(getattr(getattr(c, "module", c).decoder, "layers", [])) for c in chunks]

    def owns(self, chunk_index: int, local_name: str) -> bool:
        index, count = _replica(is_expert_name(local_name))
        if not self.spread or count == 1:
            return index == 0
        layer = local_layer(local_name)
        if layer is None:
            return index == (0 if local_name.startswith("embedding.") else count - 1)
        return layer * count // max(self.layers[chunk_index], 1) == index


TensorSource = Callable[[int, LocalTensor], torch.Tensor | list[torch.Tensor]]


def iter_hf_tensors(
    chunks: list[Any],
    arch: ModelArch,
    layout: ParallelLayout,
    source: TensorSource | None = None,
    ownership: Ownership | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors owned by this rank, in model order.

    `source(chunk_index, local)` supplies a tensor's values (or its row blocks) when the chunks live
    on the meta device (the converter streams them from a checkpoint); by default the chunks' own
    tensors are used.
    `ownership` says which replica produces what (default: replica 0 produces everything)."""
    rules = rules_for(arch)
    ctx = ShardContext(arch, layout)
    ownership = ownership or Ownership(chunks, spread=False)
    for index, chunk in enumerate(chunks):
        for local in local_tensors(chunk, ctx.expert_offset):
            match = rules.match(local.name)
            if match is None:
                raise BridgeError(
                    f"no conversion rule for Megatron tensor `{local.name}` ({arch.model_type})"
                )
            rule, hf_names = match
            if not rule.export or not ownership.owns(index, local.local_name):
                continue
            tensor = local.tensor if source is None else source(index, local)
            if isinstance(tensor, list):  # row blocks: a GLU weight's halves are its HF tensors
                if rule.kind == "gate_up" and len(tensor) == 2 and ctx.group(local)[1] == 1:
                    yield from zip(hf_names, tensor, strict=True)
                    continue
                tensor = torch.cat(tensor)
            shards = _gather(local, tensor, ctx)
            rank, _ = ctx.group(local)
            if rank != 0:
                continue
            full = unshard(rule.kind, shards, local.partition_dim)
            yield from zip(hf_names, megatron_full_to_hf(rule.kind, full, arch), strict=True)


def export_hf_buckets(
    chunks: list[Any],
    arch: ModelArch,
    layout: ParallelLayout,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    fp8: bool = False,
) -> Iterator[NamedTensors]:
    """Buckets of HF-named tensors owned by this rank, optionally cast and FP8 block-quantised."""
    stream = iter_hf_tensors(chunks, arch, layout)
    if dtype is not None:
        stream = ((name, t.to(dtype)) for name, t in stream)
    if fp8:
        from slimrl.megatron_bridge.fp8 import quantize_named_tensors

        stream = quantize_named_tensors(stream)
    # One bucket is one `load_weights` call: tensors SGLang fuses must share one (bucketing.py).
    yield from bucketed(stream, bucket_bytes, together=load_together(arch))
