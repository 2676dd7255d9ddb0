"""The tensors one rank holds, under canonical names that rules can match.

Canonical = local-spec module names, *global* layer index, *global* expert id. Megatron's own
names differ by pipeline stage (layer indices restart at 0 per stage), by EP rank (local expert
ids) and by spec (Transformer Engine fuses norms into linears and groups expert weights).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# Transformer Engine spec name -> local spec name (TE fuses the pre-norm into the next linear).
TE_ALIASES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"\.self_attention\.linear_qkv\.layer_norm_weight$", ".input_layernorm.weight"),
        (r"\.mlp\.linear_fc1\.layer_norm_weight$", ".pre_mlp_layernorm.weight"),
        (r"\.self_attention\.linear_q_up_proj\.layer_norm_weight$", ".self_attention.q_layernorm.weight"),
        (r"\.self_attention\.linear_kv_up_proj\.layer_norm_weight$", ".self_attention.kv_layernorm.weight"),
        (
            r"\.mlp\.experts\.linear_fc([12])\.weight(\d+)$",
            r".mlp.experts.local_experts.\2.linear_fc\1.weight",
        ),
    )
)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
# Buffers that are model state (exported); all other buffers are runtime bookkeeping.
STATE_BUFFERS = re.compile(r"(^|\.)expert_bias$")


@dataclass
class LocalTensor:
    name: str
    """Canonical name."""
    local_name: str
    """Name inside the chunk's module (what `state_dict()` and `sharded_state_dict()` use)."""
    tensor: torch.Tensor
    partition_dim: int | None
    """Dimension split over (expert-)tensor-parallel ranks; None when replicated."""
    is_expert: bool


def is_expert_name(name: str) -> bool:
    """Whether a (local or canonical) tensor name belongs to a routed expert."""
    return ".mlp.experts." in name


def local_layer(local_name: str) -> int | None:
    """The chunk-local decoder layer a tensor belongs to (None outside the layers)."""
    found = _LAYER.match(local_name)
    return int(found.group(1)) if found else None


def canonical_name(local_name: str, layer_numbers: dict[int, int], expert_offset: int) -> str:
    name = local_name
    for pattern, replacement in TE_ALIASES:
        name = pattern.sub(replacement, name)
    found = _LAYER.match(name)
    if found:
        name = f"decoder.layers.{layer_numbers[int(found.group(1))]}." + name[found.end() :]
    return _EXPERT.sub(lambda m: f".mlp.experts.local_experts.{int(m.group(1)) + expert_offset}.", name)


def _partition_dim(module: Any, param_name: str, tensor: torch.Tensor) -> int | None:
    """Which dim TP splits, from the module type (Megatron only sets the tensor attributes when it
    initialises weights itself, which a conversion skips)."""
    kind = type(module).__name__
    if "layer_norm" in param_name:
        return None  # TE's fused pre-norm inside a parallel linear is replicated
    if kind == "VocabParallelEmbedding" or "ColumnParallel" in kind:
        return 0
    if "RowParallel" in kind:
        return 1 if param_name.startswith("weight") else None
    if getattr(tensor, "tensor_model_parallel", False):
        return int(tensor.partition_dim)
    return None


def local_tensors(chunk: Any, expert_offset: int) -> Iterator[LocalTensor]:
    """Parameters (and state buffers) of one model chunk, in module order, canonically named.

    `expert_offset` is the global id of this rank's first local expert (ep_rank * experts/ep).
    """
    module = getattr(chunk, "module", chunk)  # unwrap DDP
    layers = module.decoder.layers if hasattr(module, "decoder") else []
    layer_numbers = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    for owner_name, owner in module.named_modules():
        prefix = f"{owner_name}." if owner_name else ""
        items = [(n, p, _partition_dim(owner, n, p)) for n, p in owner.named_parameters(recurse=False)]
        items += [
            (n, b, None) for n, b in owner.named_buffers(recurse=False) if STATE_BUFFERS.search("." + n)
        ]
        for name, tensor, dim in items:
            canonical = canonical_name(prefix + name, layer_numbers, expert_offset)
            yield LocalTensor(
                name=canonical,
                local_name=prefix + name,
                tensor=tensor,
                partition_dim=dim,
                is_expert=is_expert_name(canonical),
            )
