"""Moving weights from a trainer process into an engine process on the same CPU host.

Two transports, both with SGLang's wire formats so one trainer-side client serves SGLang and the
embedded engine alike:

* **Shared memory** (`/update_weights_from_tensor`, SGLang's CUDA-IPC path on GPUs). The payload
  is a pickle in which every CPU tensor is replaced by the name of a file in `/dev/shm` holding its
  bytes (CUDA tensors keep torch's IPC reduction, which is what SGLang expects), so no weight bytes
  go through HTTP. We do not use torch's own CPU sharing: its "file_system" strategy starts a
  `torch_shm_manager` daemon that outlives the trainer while any engine still maps a segment,
  holding the trainer's stdout open (a parent waiting on that pipe hangs). The producer owns the
  files and unlinks them once every engine has answered (`SharedFiles.release`).
* **A gloo group** (`/init_weights_update_group` + `/update_weights_from_distributed`, SGLang's NCCL
  path). The group is built from a `TCPStore` + `ProcessGroupGloo` directly, never the default
  process group, so it can coexist with the trainer's own `torch.distributed` world.

Payloads are decoded with an allow-listed unpickler (like SGLang 0.5.23's `SafeUnpickler`): only
our shared-file rebuild, dtypes, sizes and `FlattenedTensorMetadata` may appear.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import io
import os
import pickle
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass
class FlattenedTensorMetadata:
    """One tensor inside a flattened bucket; offsets and `numel` are in bytes (as SGLang's)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


# --------------------------------------------------------------------------- flattened buckets


def flatten_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """SGLang's `FlattenedTensorBucket` payload: one uint8 buffer plus per-tensor byte ranges.

    Mixed dtypes are allowed. An empty input gives an empty bucket (SGLang uses those as padding).
    """
    parts: list[torch.Tensor] = []
    metadata: list[FlattenedTensorMetadata] = []
    offset = 0
    for name, tensor in named_tensors:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(
            FlattenedTensorMetadata(
                name=name,
                shape=torch.Size(tensor.shape),
                dtype=tensor.dtype,
                start_idx=offset,
                end_idx=offset + flat.numel(),
                numel=flat.numel(),
            )
        )
        parts.append(flat)
        offset += flat.numel()
    flat_all = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return {"flattened_tensor": flat_all, "metadata": metadata}


def unflatten_bucket(bucket: dict[str, Any]) -> NamedTensors:
    """Views into the bucket's buffer, one per metadata entry (a copy only where misaligned)."""
    if not isinstance(bucket, dict) or set(bucket) != {"flattened_tensor", "metadata"}:
        raise ValueError("flattened_bucket payload must be a dict with flattened_tensor and metadata")
    flat = bucket["flattened_tensor"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("flattened_bucket: flattened_tensor must be a 1-D uint8 tensor")
    out: NamedTensors = []
    for meta in bucket["metadata"]:
        if not isinstance(meta, FlattenedTensorMetadata):
            raise ValueError("flattened_bucket: metadata entries must be FlattenedTensorMetadata")
        nbytes = meta.dtype.itemsize * torch.Size(meta.shape).numel()
        if meta.end_idx - meta.start_idx != nbytes or meta.start_idx < 0 or meta.end_idx > flat.numel():
            raise ValueError(f"flattened_bucket: bad byte range for tensor `{meta.name}`")
        chunk = flat[meta.start_idx : meta.end_idx]
        if meta.start_idx % meta.dtype.itemsize:  # SGLang's layout does not align: copy to view
            chunk = chunk.clone()
        out.append((meta.name, chunk.view(meta.dtype).reshape(meta.shape)))
    return out


def flattened_layout(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """Byte offsets of tensors packed back to back, each aligned to its dtype size; and the total.

    The layout of SGLang's `flattened_bucket` broadcast in `/update_weights_from_distributed`.
    """
    offsets: list[int] = []
    offset = 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        align = dtype.itemsize
        offset = -(-offset // align) * align
        offsets.append(offset)
        offset += dtype.itemsize * torch.Size(shape).numel()
    return offsets, offset


def split_flat_buffer(
    flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> NamedTensors:
    """The inverse of packing with `flattened_layout` (views into `flat`)."""
    offsets, _ = flattened_layout(dtypes, shapes)
    out: NamedTensors = []
    for name, dtype, shape, start in zip(names, dtypes, shapes, offsets, strict=True):
        nbytes = dtype.itemsize * torch.Size(shape).numel()
        out.append((name, flat[start : start + nbytes].view(dtype).reshape(tuple(shape))))
    return out


def pack_flat_buffer(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 buffer holding `tensors` at `flattened_layout` offsets (trainer side of a broadcast)."""
    offsets, total = flattened_layout([t.dtype for t in tensors], [t.shape for t in tensors])
    flat = torch.zeros(total, dtype=torch.uint8)
    for tensor, start in zip(tensors, offsets, strict=True):
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[start : start + raw.numel()] = raw
    return flat


# --------------------------------------------------------------------------- (de)serialization


SHARED_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
_FILE_PREFIX = "slimrl-weights-"


@dataclass
class SharedFiles:
    """The shared-memory files behind one payload: keep them until every engine has answered."""

    paths: list[Path] = field(default_factory=list)

    def add(self, nbytes: int) -> Path:
        path = SHARED_DIR / f"{_FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self.paths.append(path)
        return path

    def release(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)
        self.paths.clear()

    def __del__(self) -> None:  # a failed call must not leave weights in /dev/shm
        self.release()


def rebuild_shared_file(name: str, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """Map a tensor the producer left in `SHARED_DIR` (a private mapping: it outlives the unlink)."""
    if os.path.basename(name) != name or not name.startswith(_FILE_PREFIX):
        raise ValueError(f"shared tensor file `{name}` is not one of ours")
    numel = torch.Size(shape).numel()
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_file(str(SHARED_DIR / name), shared=False, size=numel, dtype=dtype).reshape(shape)


class _SharedFilePickler(pickle.Pickler):
    def __init__(self, buf: io.BytesIO, files: SharedFiles) -> None:
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.files = files

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        if obj.is_cuda:  # SGLang's path: CUDA IPC handles
            from torch.multiprocessing.reductions import reduce_tensor

            return reduce_tensor(obj)
        tensor = obj.detach()
        nbytes = tensor.numel() * tensor.element_size()
        path = self.files.add(nbytes)
        if nbytes:
            target = torch.from_file(str(path), shared=True, size=tensor.numel(), dtype=tensor.dtype)
            target.copy_(tensor.reshape(-1))
        return rebuild_shared_file, (path.name, tensor.dtype, torch.Size(tensor.shape))


def serialize(obj: Any) -> tuple[str, SharedFiles]:
    """Pickled `obj` as base64 text (SGLang's `MultiprocessingSerializer(output_str=True)` shape),
    with its CPU tensors moved to shared-memory files that the caller releases after the call."""
    files = SharedFiles()
    buf = io.BytesIO()
    _SharedFilePickler(buf, files).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii"), files


def serialize_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, SharedFiles]:
    """A `load_format: null` entry of `serialized_named_tensors`: a pickled list of (name, tensor)."""
    return serialize([(name, tensor) for name, tensor in named_tensors])


def serialize_flattened_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, SharedFiles]:
    """A `load_format: "flattened_bucket"` entry."""
    return serialize(flatten_named_tensors(named_tensors))


_METADATA_ALIASES = frozenset(
    {
        (__name__, "FlattenedTensorMetadata"),
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
        ("sglang.srt.model_executor.model_runner", "FlattenedTensorMetadata"),
    }
)


class _SafeUnpickler(pickle.Unpickler):
    """Only what a shared-memory tensor payload needs; anything else is refused by name."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_ALIASES:
            return FlattenedTensorMetadata
        if (module, name) == (__name__, "rebuild_shared_file"):
            return rebuild_shared_file
        if (module, name) == ("torch", "Size"):
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"blocked unsafe global {module}.{name}")


def deserialize(data: str | bytes) -> Any:
    """Decode one `serialized_named_tensors` entry (base64 text, or raw bytes from in-process callers)."""
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"not valid base64 ({exc})") from None
    try:
        return _SafeUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, RuntimeError, OSError) as exc:
        raise ValueError(f"cannot decode tensor payload: {' '.join(str(exc).split())}") from None


def decode_update_payload(data: str | bytes, load_format: str | None) -> NamedTensors:
    """Named tensors from one `/update_weights_from_tensor` entry in either SGLang load format."""
    obj = deserialize(data)
    if load_format == "flattened_bucket":
        return unflatten_bucket(obj)
    if load_format not in (None, "direct"):
        raise ValueError(f"load_format `{load_format}` is not supported (use null or flattened_bucket)")
    if not isinstance(obj, list | tuple):
        raise ValueError("payload must be a list of (name, tensor) pairs")
    out: NamedTensors = []
    for item in obj:
        if (
            not isinstance(item, list | tuple)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], torch.Tensor)
        ):
            raise ValueError("payload must be a list of (name, tensor) pairs")
        out.append((item[0], item[1]))
    return out


# --------------------------------------------------------------------------- gloo weight-update group


@dataclass
class WeightUpdateGroup:
    """A standalone gloo group: rank 0 is the trainer, the engines are the other ranks."""

    name: str
    rank: int
    world_size: int
    store: Any
    group: Any

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast in place from `src` (every rank calls this in the same order)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([tensor], opts).wait()
        return tensor

    def destroy(self) -> None:
        """Drop the references; gloo closes its connections when the group is collected."""
        self.group = None
        self.store = None


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    timeout_s: float = 120.0,
) -> WeightUpdateGroup:
    """Join (rank > 0) or host (rank 0) the group; blocks until all `world_size` ranks have joined."""
    import torch.distributed as dist

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address, int(master_port), world_size, rank == 0, timeout, wait_for_workers=False
    )
    prefixed = dist.PrefixStore(f"slimrl_weight_update/{group_name}/", store)
    group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return WeightUpdateGroup(name=group_name, rank=rank, world_size=world_size, store=store, group=group)
