"""The layout transforms of the weight rules (`rules.py`): HF <-> Megatron full tensors, and a
full tensor <-> its tensor-parallel shards. Kinds are documented in `rules.py`."""

from __future__ import annotations

import torch

from slimrl.megatron_bridge.rules import Kind
from slimrl.model_arch import ModelArch


def _rope_rows(kind: Kind, rows: int, arch: ModelArch, to_megatron: bool) -> torch.Tensor:
    """Row permutation interleaving (to Megatron) or de-interleaving the rope part of MLA rows."""
    assert arch.mla is not None
    rope = arch.mla.qk_rope_head_dim
    deinterleave = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    within = torch.argsort(deinterleave) if to_megatron else deinterleave
    if kind == "mla_kv":  # [kv_lora_rank + rope]: the rope part is last
        return torch.cat([torch.arange(rows - rope), rows - rope + within])
    head = arch.mla.qk_nope_head_dim + rope  # mla_q: per head [nope, rope]
    per_head = torch.cat([torch.arange(arch.mla.qk_nope_head_dim), arch.mla.qk_nope_head_dim + within])
    return torch.cat([h * head + per_head for h in range(rows // head)])


def hf_to_megatron_full(
    kind: Kind, parts: list[torch.Tensor], arch: ModelArch, padded_rows: int
) -> torch.Tensor:
    """HF tensor(s) -> the full (unsharded) Megatron tensor."""
    if kind == "copy":
        return parts[0]
    if kind in ("mla_q", "mla_kv"):
        return parts[0][_rope_rows(kind, parts[0].shape[0], arch, to_megatron=True)]
    if kind == "gate_up":
        return torch.cat(parts, dim=0)
    if kind == "vocab":
        (weight,) = parts
        if padded_rows == weight.shape[0]:
            return weight
        return torch.cat([weight, weight.new_zeros((padded_rows - weight.shape[0], *weight.shape[1:]))])
    q, k, v = parts
    groups = arch.num_query_groups
    trailing = q.shape[1:]
    fused = torch.cat(
        [
            q.reshape(groups, -1, *trailing),
            k.reshape(groups, -1, *trailing),
            v.reshape(groups, -1, *trailing),
        ],
        dim=1,
    )
    return fused.reshape(-1, *trailing)


def megatron_full_to_hf(kind: Kind, full: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    """The full Megatron tensor -> HF tensor(s); exact inverse of `hf_to_megatron_full`."""
    if kind == "copy":
        return [full]
    if kind in ("mla_q", "mla_kv"):
        return [full[_rope_rows(kind, full.shape[0], arch, to_megatron=False)]]
    if kind == "gate_up":
        return list(full.chunk(2, dim=0))
    if kind == "vocab":
        return [full[: arch.vocab_size]]
    groups, head_dim = arch.num_query_groups, arch.head_dim
    q_per_group = arch.num_attention_heads // groups * head_dim
    trailing = full.shape[1:]
    grouped = full.reshape(groups, q_per_group + 2 * head_dim, *trailing)
    q, k, v = grouped.split([q_per_group, head_dim, head_dim], dim=1)
    return [t.reshape(-1, *trailing) for t in (q, k, v)]


def shard(kind: Kind, full: torch.Tensor, partition_dim: int | None, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of the full Megatron tensor."""
    if partition_dim is None or size == 1:
        return full
    if kind == "gate_up":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=partition_dim)[rank]


def unshard(kind: Kind, shards: list[torch.Tensor], partition_dim: int | None) -> torch.Tensor:
    """Inverse of `shard` given every rank's slice, in rank order."""
    if partition_dim is None or len(shards) == 1:
        return shards[0]
    if kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=partition_dim)
