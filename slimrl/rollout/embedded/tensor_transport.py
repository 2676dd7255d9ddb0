"""The embedded engine's side of SGLang's weight-update wire formats (the trainer builds them in
`slimrl/weight_sync/wire.py`).

* `/update_weights_from_tensor`: each `serialized_named_tensors` entry is base64 of a
  `ForkingPickler` pickle (SGLang's `MultiprocessingSerializer`); CPU tensors arrive through
  torch's `file_system` shared memory. They are decoded with an allow-list that is a subset of
  SGLang 0.5.23's `SafeUnpickler`: torch's own rebuild functions, dtypes and sizes, the bucket's
  metadata records (`FlattenedTensorMetadata` or a `SimpleNamespace` with its fields) and nothing
  that runs code.
* `/update_weights_from_distributed`: the group is joined like SGLang's `init_custom_process_group`
  (the same store keys, so one trainer-side group serves both engines), and a flattened bucket is
  packed back to back as SGLang's `FlattenedTensorBucket.empty` lays it out.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing.reductions as torch_reductions

from slimrl.utils.tensors import NamedTensors
from slimrl.weight_sync.wire import init_broadcast_group


@dataclass
class FlattenedTensorMetadata:
    """One tensor inside a flattened bucket; offsets and `numel` are in bytes (as SGLang's)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_METADATA_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")

_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): torch_reductions.rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): torch_reductions.rebuild_typed_storage,
    (
        "torch.multiprocessing.reductions",
        "rebuild_storage_filename",
    ): torch_reductions.rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): torch_reductions.rebuild_storage_empty,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch", "Size"): torch.Size,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("builtins", "list"): list,
    ("builtins", "tuple"): tuple,
    ("builtins", "dict"): dict,
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"blocked unsafe global {module}.{name}")


def deserialize(data: str | bytes) -> Any:
    """Decode one `serialized_named_tensors` entry (base64 text, or raw bytes)."""
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"not valid base64 ({exc})") from None
    try:
        return _SafeUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, RuntimeError, OSError) as exc:
        raise ValueError(f"cannot decode tensor payload: {' '.join(str(exc).split())}") from None


def unflatten_bucket(bucket: Any) -> NamedTensors:
    """Views into the bucket's buffer, one per metadata record, each range checked."""
    if not isinstance(bucket, dict) or set(bucket) != {"flattened_tensor", "metadata"}:
        raise ValueError("flattened_bucket payload must be a dict with flattened_tensor and metadata")
    flat = bucket["flattened_tensor"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("flattened_bucket: flattened_tensor must be a 1-D uint8 tensor")
    out: NamedTensors = []
    for meta in bucket["metadata"]:
        if not all(hasattr(meta, f) for f in _METADATA_FIELDS) or not isinstance(meta.dtype, torch.dtype):
            raise ValueError(
                f"flattened_bucket: metadata records need the fields {', '.join(_METADATA_FIELDS)}"
            )
        nbytes = meta.dtype.itemsize * torch.Size(meta.shape).numel()
        if meta.end_idx - meta.start_idx != nbytes or meta.start_idx < 0 or meta.end_idx > flat.numel():
            raise ValueError(f"flattened_bucket: bad byte range for tensor `{meta.name}`")
        chunk = flat[meta.start_idx : meta.end_idx]
        if meta.start_idx % meta.dtype.itemsize:
            chunk = chunk.clone()  # a view needs an aligned start
        out.append((meta.name, chunk.view(meta.dtype).reshape(meta.shape)))
    return out


def decode_update_payload(data: str | bytes, load_format: str | None) -> NamedTensors:
    """Named tensors from one `/update_weights_from_tensor` entry in either SGLang load format."""
    obj = deserialize(data)
    if load_format == "flattened_bucket":
        return unflatten_bucket(obj)
    if load_format not in (None, "direct"):
        raise ValueError(f"load_format `{load_format}` is not supported (use null or flattened_bucket)")
    if not isinstance(obj, list | tuple) or not all(
        isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor) for item in obj
    ):  # fmt: skip
        raise ValueError("payload must be a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in obj]


# --------------------------------------------------------------------------- broadcast group


def flattened_layout(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """Byte offsets of tensors packed back to back, and the total (SGLang's receive layout, which
    refuses a tensor that would start at an offset not a multiple of its element size)."""
    offsets: list[int] = []
    offset = 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        if offset % dtype.itemsize:
            raise ValueError(f"unaligned tensor in flattened bucket: byte offset {offset}, dtype {dtype}")
        offsets.append(offset)
        offset += dtype.itemsize * torch.Size(shape).numel()
    return offsets, offset


def split_flat_buffer(
    flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> NamedTensors:
    """Views into a received flattened bucket."""
    offsets, _ = flattened_layout(dtypes, shapes)
    out: NamedTensors = []
    for name, dtype, shape, start in zip(names, dtypes, shapes, offsets, strict=True):
        nbytes = dtype.itemsize * torch.Size(shape).numel()
        out.append((name, flat[start : start + nbytes].view(dtype).reshape(tuple(shape))))
    return out


@dataclass
class WeightUpdateGroup:
    """The engine's membership of a trainer's broadcast group."""

    name: str
    rank: int
    world_size: int
    group: Any

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        import torch.distributed as dist

        dist.broadcast(tensor, group=self.group, group_src=src)
        return tensor

    def destroy(self) -> None:
        import torch.distributed as dist

        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    timeout_s: float = 120.0,
) -> WeightUpdateGroup:
    """Join the group as SGLang's `init_custom_process_group` does; blocks until all ranks joined."""

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    group = init_broadcast_group(master_address, master_port, rank, world_size, group_name, "gloo", timeout_s)
    return WeightUpdateGroup(name=group_name, rank=rank, world_size=world_size, group=group)
