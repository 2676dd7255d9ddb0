"""Streaming export: a running sharded Megatron model -> HF-named full tensors, in buckets.

Used by the Megatron -> HF converter and by the weight sync to the rollout fleet. Tensor shards
are gathered over their (expert-)tensor-parallel group one tensor at a time, so no rank ever holds
more than one full tensor plus the bucket it is filling. Every HF tensor is produced by exactly
one *owner* rank: TP/ETP rank 0 of data-parallel replica 0, in the pipeline stage (and expert-
parallel rank) holding it; other ranks take part in the gathers and yield nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from slimrl.megatron_bridge.bucketing import bucketed, load_together
from slimrl.megatron_bridge.fp8 import quantize_named_tensors
from slimrl.megatron_bridge.loading import ShardContext, rules_for
from slimrl.megatron_bridge.naming import LocalTensor, is_expert_name, local_layer, local_tensors
from slimrl.megatron_bridge.safetensors_index import BridgeError
from slimrl.megatron_bridge.transforms import megatron_full_to_hf, unshard
from slimrl.model_arch import ModelArch
from slimrl.parallel_layout import ParallelLayout
from slimrl.utils.tensors import NamedTensors


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


@dataclass(frozen=True, slots=True)
class ExportUnit:
    """The tensors of one unit of a chunk, in model order: what comes before the decoder layers
    (the embedding), one decoder layer, or what comes after them (final norm, output layer). Ranks
    of one (expert-)tensor-parallel group have the same units, so their gathers of a unit match;
    the weight sync exchanges what the owners produced once per unit (`trainer/weight_sync.py`)."""

    chunk: int
    layer: int | None
    locals: tuple[LocalTensor, ...]


class Exporter:
    """Full HF tensors owned by this rank, unit by unit.

    `source(chunk_index, local)` supplies a tensor's values (or its row blocks) when the chunks live
    on the meta device (the converter streams them from a checkpoint); by default the chunks' own
    tensors are used. `ownership` says which replica produces what (default: replica 0 produces
    everything)."""

    def __init__(
        self,
        chunks: list[Any],
        arch: ModelArch,
        layout: ParallelLayout,
        source: TensorSource | None = None,
        ownership: Ownership | None = None,
    ) -> None:
        self.chunks, self.arch, self.source = chunks, arch, source
        self.rules = rules_for(arch)
        self.ctx = ShardContext(arch, layout)
        self.ownership = ownership or Ownership(chunks, spread=False)

    def units(self) -> list[ExportUnit]:
        units: list[ExportUnit] = []
        for index, chunk in enumerate(self.chunks):
            current: list[LocalTensor] = []
            for local in local_tensors(chunk, self.ctx.expert_offset):
                if current and local_layer(local.local_name) != local_layer(current[-1].local_name):
                    units.append(ExportUnit(index, local_layer(current[-1].local_name), tuple(current)))
                    current = []
                current.append(local)
            if current:
                units.append(ExportUnit(index, local_layer(current[-1].local_name), tuple(current)))
        return units

    def tensors(self, unit: ExportUnit) -> Iterator[tuple[str, torch.Tensor]]:
        """The unit's HF tensors this rank owns; every rank of a tensor's group takes part in its
        gather, owner or not."""
        arch, ctx = self.arch, self.ctx
        for local in unit.locals:
            match = self.rules.match(local.name)
            if match is None:
                raise BridgeError(
                    f"no conversion rule for Megatron tensor `{local.name}` ({arch.model_type})"
                )
            rule, hf_names = match
            if not rule.export or not self.ownership.owns(unit.chunk, local.local_name):
                continue
            tensor = local.tensor if self.source is None else self.source(unit.chunk, local)
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


def iter_hf_tensors(
    chunks: list[Any],
    arch: ModelArch,
    layout: ParallelLayout,
    source: TensorSource | None = None,
    ownership: Ownership | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors owned by this rank, in model order (`Exporter`, every unit in turn)."""
    exporter = Exporter(chunks, arch, layout, source, ownership)
    for unit in exporter.units():
        yield from exporter.tensors(unit)


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
        stream = quantize_named_tensors(stream)
    # One bucket is one `load_weights` call: tensors SGLang fuses must share one (bucketing.py).
    yield from bucketed(stream, bucket_bytes, together=load_together(arch))
