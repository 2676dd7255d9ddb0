"""HF checkpoint -> the Megatron model chunks of this rank, tensor by tensor.

Each rank reads only the HF tensors its own shards are made of. Nothing is silently dropped:
a Megatron tensor without a rule, an HF tensor no rank consumed, or a shape that does not fit
is an error naming the tensor.

The source is a checkpoint directory or anything with `.names` and `.get(name)` (an `HFSource`),
e.g. the live weights of an inference engine that keeps a Megatron twin of its model in sync.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from slimrl.megatron_bridge.archs import ARCH_SPECS
from slimrl.megatron_bridge.hf_io import HFCheckpointReader
from slimrl.megatron_bridge.naming import LocalTensor, local_tensors
from slimrl.megatron_bridge.rules import RuleSet
from slimrl.megatron_bridge.safetensors_index import BridgeError
from slimrl.megatron_bridge.transforms import hf_to_megatron_full, shard
from slimrl.model_arch import ModelArch
from slimrl.parallel_layout import ParallelLayout


class HFSource(Protocol):
    """HF-named tensors: a checkpoint reader, or an in-memory copy of one."""

    @property
    def names(self) -> Iterable[str]: ...

    def get(self, name: str) -> torch.Tensor: ...


def _nbytes(source: HFSource, name: str) -> int:
    """Bytes of one source tensor (from the file header when the source can tell without reading)."""
    nbytes = getattr(source, "nbytes", None)
    if nbytes is not None:
        return int(nbytes(name))
    tensor = source.get(name)
    return tensor.numel() * tensor.element_size()


class ShardContext:
    """This rank's coordinates, as the bridge needs them (read once from megatron's mpu)."""

    def __init__(self, arch: ModelArch, layout: ParallelLayout) -> None:
        from megatron.core import parallel_state as mpu

        self.tp_rank, self.tp_size = mpu.get_tensor_model_parallel_rank(), layout.tp
        self.etp_rank, self.etp_size = mpu.get_expert_tensor_parallel_rank(), layout.etp
        self.ep_rank, self.ep_size = mpu.get_expert_model_parallel_rank(), layout.ep
        self.expert_offset = self.ep_rank * (arch.num_experts or 0) // layout.ep

    def group(self, tensor: LocalTensor) -> tuple[int, int]:
        """(rank, size) of the tensor-parallel group this tensor is split over."""
        return (self.etp_rank, self.etp_size) if tensor.is_expert else (self.tp_rank, self.tp_size)


def rules_for(arch: ModelArch) -> RuleSet:
    return ARCH_SPECS[arch.model_type].rules(arch)


def load_hf_into_megatron(
    chunks: list[Any],
    arch: ModelArch,
    layout: ParallelLayout,
    hf_dir: str | os.PathLike[str] | HFSource,
    check_complete: bool = True,
    progress: Callable[[int], object] | None = None,
) -> set[str]:
    """Copy HF weights into this rank's chunks; returns the HF names this rank consumed.

    `hf_dir` is a checkpoint directory or an `HFSource`; `progress` is called with the bytes of
    each HF tensor read."""
    on_disk = isinstance(hf_dir, str | os.PathLike)
    reader: HFSource = HFCheckpointReader(hf_dir) if on_disk else hf_dir
    where = str(hf_dir) if on_disk else type(hf_dir).__name__
    rules = rules_for(arch)
    ctx = ShardContext(arch, layout)
    consumed: set[str] = set()
    with torch.no_grad():
        for chunk in chunks:
            for local in local_tensors(chunk, ctx.expert_offset):
                names = _load_one(local, rules, reader, arch, ctx)
                consumed.update(names)
                if progress is not None:
                    progress(sum(_nbytes(reader, n) for n in names))
    if check_complete:
        check_everything_consumed(consumed, set(reader.names), where)
    return consumed


def hf_shard_blocks(
    local: LocalTensor, rules: RuleSet, reader: HFSource, arch: ModelArch, ctx: ShardContext
) -> tuple[list[torch.Tensor], list[str]]:
    """This rank's shard of one Megatron tensor as row blocks that stack (dim 0) into it.

    A fused gate/up shard stays two blocks, [gate shard] and [up shard]: Megatron's checkpoint
    stores the two halves as separate tensors anyway, so fusing them here would be a wasted copy."""
    match = rules.match(local.name)
    if match is None:
        raise BridgeError(f"no conversion rule for Megatron tensor `{local.name}` ({arch.model_type})")
    rule, hf_names = match
    rank, size = ctx.group(local)
    parts = [reader.get(name).to(local.tensor.dtype) for name in hf_names]
    if rule.kind == "gate_up" and parts[0].shape == parts[1].shape:
        blocks = [shard("copy", p, local.partition_dim, rank, size) for p in parts]
    else:
        padded_rows = local.tensor.shape[0] * (size if local.partition_dim == 0 else 1)
        full = hf_to_megatron_full(rule.kind, parts, arch, padded_rows)
        blocks = [shard(rule.kind, full, local.partition_dim, rank, size)]
    rows = sum(b.shape[0] for b in blocks)
    if any(b.shape[1:] != local.tensor.shape[1:] for b in blocks) or rows != local.tensor.shape[0]:
        shapes = ", ".join(f"{n} {tuple(p.shape)}" for n, p in zip(hf_names, parts, strict=True))
        got = (rows, *blocks[0].shape[1:])
        raise BridgeError(
            f"shape mismatch for `{local.name}`: Megatron shard {tuple(local.tensor.shape)} but the HF "
            f"tensors give {got} ({shapes}); does config.json match the weights?"
        )
    return [b.contiguous() for b in blocks], hf_names


def _load_one(
    local: LocalTensor, rules: RuleSet, reader: HFSource, arch: ModelArch, ctx: ShardContext
) -> list[str]:
    blocks, hf_names = hf_shard_blocks(local, rules, reader, arch, ctx)
    row = 0
    for block in blocks:
        local.tensor.data[row : row + block.shape[0]].copy_(block)
        row += block.shape[0]
    return hf_names


def check_everything_consumed(consumed: set[str], available: set[str], hf_dir: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[set[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, consumed)
        consumed = set().union(*(g or set() for g in gathered))
    unused = sorted(available - consumed)
    if unused:
        raise BridgeError(
            f"{hf_dir}: {len(unused)} HF tensors have no place in the Megatron model, e.g. `{unused[0]}` "
            f"(unsupported variant of the architecture?)"
        )
