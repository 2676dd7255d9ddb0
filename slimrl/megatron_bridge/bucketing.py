"""Cutting the export's tensor stream into buckets: each bucket is one `load_weights` call of an engine.

SGLang loads every bucket of a weight update with one call of the model's `load_weights`, and some
of its loaders fuse sibling checkpoint tensors only when all of them arrive in the same call:
SGLang 0.5.23's DeepSeek-V2/V3 loader (`deepseek_weight_loader.py`, `cached_a_proj`) concatenates
a layer's `q_a_proj` and `kv_a_proj_with_mqa` into `fused_qkv_a_proj_with_mqa` once it has seen
both, and a call holding only one of them leaves the layer's old weights in place, silently.
An architecture declares such sets (`ArchSpec.load_together`); `bucketed` never splits one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from slimrl.megatron_bridge.archs import ARCH_SPECS
from slimrl.model_arch import ModelArch
from slimrl.utils.tensors import NamedTensors

Together = tuple[tuple[str, ...], ...]
"""Sets of dotted name components: tensors whose names differ only in that component, which is one
of a set's members, form a group (e.g. `("q_a_proj", "kv_a_proj_with_mqa")` pairs
`model.layers.3.self_attn.q_a_proj.weight` with `...kv_a_proj_with_mqa.weight`, and each
`weight_scale_inv` with the other's, exactly as SGLang pairs them by name)."""


def load_together(arch: ModelArch) -> Together:

    return ARCH_SPECS[arch.model_type].load_together_for(arch)


def _group(name: str, together: Together) -> tuple[tuple[int, str], str] | None:
    """((set index, name with the member replaced by `*`), member) of a group member, else None."""
    parts = name.split(".")
    for index, members in enumerate(together):
        for i, part in enumerate(parts):
            if part in members:
                return (index, ".".join([*parts[:i], "*", *parts[i + 1 :]])), part
    return None


def _nbytes(unit: NamedTensors) -> int:
    return sum(t.numel() * t.element_size() for _, t in unit)


def bucketed(
    items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, together: Together = ()
) -> Iterator[NamedTensors]:
    """Cut a tensor stream into buckets of about `bucket_bytes` (a bigger tensor is its own).

    A group's members are held back until its last member arrives, then placed together at that
    point of the stream; every other tensor keeps its place. A bucket exceeds `bucket_bytes` only
    when one tensor or one group alone does. A group still incomplete at the end of the stream (a
    member this rank does not own) goes out as it is."""
    bucket: NamedTensors = []
    size = 0
    held: dict[tuple[int, str], tuple[set[str], NamedTensors]] = {}

    def units() -> Iterator[NamedTensors]:
        for name, tensor in items:
            found = _group(name, together)
            if found is None:
                yield [(name, tensor)]
                continue
            key, member = found
            seen, tensors = held.setdefault(key, (set(), []))
            seen.add(member)
            tensors.append((name, tensor))
            if seen == set(together[key[0]]):
                yield held.pop(key)[1]
        for _, tensors in held.values():
            yield tensors

    for unit in units():
        nbytes = _nbytes(unit)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += unit
        size += nbytes
    if bucket:
        yield bucket
