"""The files of a Megatron torch_dist checkpoint, written and read directly by the converter.

A torch_dist checkpoint is torch DCP's layout: `.distcp` files that hold one `torch.save` zip
archive per tensor chunk, a pickled DCP `Metadata` (`.metadata`) that says where each chunk of each
key sits and which part of the global tensor it covers, and Megatron's `metadata.json` and
`common.pt`. Going through DCP costs about 1 ms per chunk (torch ShardedTensor wrappers, planning,
a pickler per record on save, the weights-only unpickler per record on load); an MoE checkpoint
has a chunk per expert per layer, so that was most of a conversion. Here the same bytes are
written and read with a struct and a restricted unpickler. Megatron loads what we write under any
layout, and we read what Megatron wrote (`torch.load` takes over for any record we do not know).
"""

from __future__ import annotations

import collections
import io
import math
import mmap
import os
import pickle
import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.storage import _dtype_to_storage_type_map, _storage_type_to_dtype_map

from slimrl.megatron_bridge.safetensors_index import BridgeError
from slimrl.utils.mapped_files import MappedFiles
from slimrl.utils.serial_worker import SerialWorker

INDEX_FILE = ".metadata"
_ALIGN = 64  # where torch.save puts every record's data (`.storage_alignment`)
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # zip local file header
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # zip central directory entry
_END = struct.Struct("<IHHHHIIH")  # zip end of central directory
_LOCAL_SIG, _CENTRAL_SIG, _END_SIG = 0x04034B50, 0x02014B50, 0x06054B50
_UTF8_NAMES = 0x800
_ZIP32_LIMIT = 0xFFFFFFFF - (1 << 20)  # beyond this a record needs zip64: torch.save writes it


# ------------------------------------------------------------------------------ records
class _StorageRef:
    """Stands in for the tensor's storage in the pickle, as torch.save's persistent id does."""


class _TensorPickler(pickle.Pickler):
    def __init__(self, buffer: BinaryIO, storage: _StorageRef, storage_class: type, numel: int) -> None:
        super().__init__(buffer, protocol=2)
        self._storage, self._pid = storage, ("storage", storage_class, "0", "cpu", numel)

    def persistent_id(self, obj: Any) -> Any:
        return self._pid if obj is self._storage else None


@dataclass(frozen=True)
class _RebuildTensor:
    storage: _StorageRef
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def __reduce__(self) -> Any:
        args = (self.storage, 0, self.shape, self.stride, False, collections.OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


def _tensor_pickle(tensor: torch.Tensor) -> bytes | None:
    """The `data.pkl` torch.save writes for a contiguous CPU tensor (None: a dtype that torch
    serialises another way, such as FP8)."""
    storage_name = _dtype_to_storage_type_map().get(tensor.dtype)
    if storage_name is None:
        return None
    buffer, storage = io.BytesIO(), _StorageRef()
    _TensorPickler(buffer, storage, getattr(torch, storage_name), tensor.numel()).dump(
        _RebuildTensor(storage, tuple(tensor.shape), tensor.stride())
    )
    return buffer.getvalue()


def write_tensor_record(out: BinaryIO, tensor: torch.Tensor) -> int:
    """Append what `torch.save(tensor)` would write (the same zip records, data 64-byte aligned);
    returns the bytes written. The tensor data gets no CRC32: it would halve the write speed and
    torch.load never checks it."""
    tensor = tensor.detach().contiguous()
    start = out.tell()
    pickled = _tensor_pickle(tensor)
    nbytes = tensor.numel() * tensor.element_size()
    if pickled is None or nbytes > _ZIP32_LIMIT:
        torch.save(tensor, out)
        return out.tell() - start
    data = tensor.reshape(-1).view(torch.uint8).numpy() if nbytes else b""
    records = [
        ("archive/data.pkl", pickled),
        ("archive/.format_version", b"1"),
        ("archive/.storage_alignment", b"64"),
        ("archive/byteorder", b"little"),
        ("archive/data/0", data),
        ("archive/version", b"3\n"),
        ("archive/.data/serialization_id", str(uuid.uuid4().int).zfill(40).encode()),
    ]
    directory = []
    for name, payload in records:
        encoded, size = name.encode(), len(memoryview(payload))
        offset = out.tell() - start
        padding = -(offset + _LOCAL.size + len(encoded) + 4) % _ALIGN
        extra = b"FB" + struct.pack("<H", padding) + b"Z" * padding
        crc = 0 if payload is data else zlib.crc32(payload)  # the bulk goes unchecksummed, as above
        header = (_LOCAL_SIG, 20, _UTF8_NAMES, 0, 0, 0, crc, size, size, len(encoded), len(extra))
        out.write(_LOCAL.pack(*header) + encoded + extra)
        out.write(payload)
        entry = (_CENTRAL_SIG, 20, 20, _UTF8_NAMES, 0, 0, 0, crc, size, size, len(encoded), 0, 0, 0, 0, 0)
        directory.append(_CENTRAL.pack(*entry, offset) + encoded)
    listing = b"".join(directory)
    directory_offset = out.tell() - start
    out.write(listing)
    out.write(_END.pack(_END_SIG, 0, 0, len(records), len(records), len(listing), directory_offset, 0))
    return out.tell() - start


@dataclass(frozen=True)
class _TensorRef:
    dtype: torch.dtype
    key: str
    numel: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _Unusual(Exception):
    """A record this reader does not handle; torch.load does."""


def _rebuild(storage: tuple, storage_offset: int, shape: tuple, stride: tuple, *_: Any) -> _TensorRef:
    dtype, key, numel = storage
    return _TensorRef(dtype, key, numel, storage_offset, tuple(shape), tuple(stride))


class _TensorUnpickler(pickle.Unpickler):
    """Accepts exactly what torch.save writes for one plain tensor; anything else is `_Unusual`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _storage_type_to_dtype_map():
            return _storage_type_to_dtype_map()[name]
        raise _Unusual(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _Unusual(str(pid))
        _, dtype, key, _, numel = pid
        if not isinstance(dtype, torch.dtype):
            raise _Unusual(str(pid))
        return dtype, key, numel


def _zip_members(buf: Any, start: int, length: int) -> dict[str, tuple[int, int]]:
    """Record name (without the archive folder) -> (absolute data offset, size)."""
    end = start + length
    sig, _, _, _, count, _, listing_offset, _ = _END.unpack_from(buf, end - _END.size)
    if sig != _END_SIG or listing_offset == 0xFFFFFFFF:
        raise _Unusual("no plain zip end record")
    members, pos = {}, start + listing_offset
    for _ in range(count):
        fields = _CENTRAL.unpack_from(buf, pos)
        name_len, extra_len, comment_len = fields[10], fields[11], fields[12]
        method, size, local = fields[4], fields[9], fields[16]
        if fields[0] != _CENTRAL_SIG or method != 0 or 0xFFFFFFFF in (size, local):
            raise _Unusual("compressed or zip64 member")
        name = bytes(buf[pos + _CENTRAL.size : pos + _CENTRAL.size + name_len]).decode()
        local_fields = _LOCAL.unpack_from(buf, start + local)
        if local_fields[0] != _LOCAL_SIG:
            raise _Unusual("bad local header")
        data = start + local + _LOCAL.size + local_fields[9] + local_fields[10]
        members[name.split("/", 1)[-1]] = (data, size)
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    return members


def read_tensor_record(buf: Any, start: int, length: int) -> torch.Tensor:
    """The tensor saved at `buf[start:start + length]`, as a zero-copy view when it is a plain
    tensor record (a writable buffer, such as a private memory map)."""
    try:
        members = _zip_members(buf, start, length)
        data, size = members["data.pkl"]
        ref = _TensorUnpickler(io.BytesIO(buf[data : data + size])).load()
        if not isinstance(ref, _TensorRef) or f"data/{ref.key}" not in members:
            raise _Unusual("not a single tensor")
        storage_at, storage_size = members[f"data/{ref.key}"]
        if storage_size != ref.numel * ref.dtype.itemsize:
            raise _Unusual("storage size")
    except (_Unusual, KeyError, struct.error, pickle.UnpicklingError, UnicodeDecodeError):
        loaded = torch.load(io.BytesIO(buf[start : start + length]), map_location="cpu", weights_only=True)
        if not isinstance(loaded, torch.Tensor):
            kind = type(loaded).__name__
            raise BridgeError(f"record at byte {start} holds a {kind}, not a tensor") from None
        return loaded
    if ref.numel == 0:
        return torch.empty(ref.shape, dtype=ref.dtype)
    flat = torch.frombuffer(buf, dtype=ref.dtype, count=ref.numel, offset=storage_at)
    return flat.as_strided(ref.shape, ref.stride, ref.storage_offset)


# ------------------------------------------------------------------------------ writing
@dataclass(frozen=True)
class Chunk:
    """One written piece of a checkpoint: a tensor chunk (`offsets` into `global_shape`) or, with
    `dtype` None, a pickled object."""

    key: str
    file: str
    start: int
    length: int
    global_shape: tuple[int, ...] = ()
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] = ()
    dtype: torch.dtype | None = None


class ChunkFileWriter:
    """One rank's `.distcp` files (`__<rank>_<n>.distcp`), each closed at about `file_bytes`.

    Records are written by a background thread in the order they were added, so the caller can
    produce the next tensor meanwhile; a tensor must not change until `close()` returns."""

    def __init__(self, out_dir: Path, rank: int, file_bytes: int) -> None:
        self.out_dir, self.rank, self.file_bytes = Path(out_dir), rank, file_bytes
        self.chunks: list[Chunk] = []
        self._handle: BinaryIO | None = None
        self._count = 0
        self._saved_objects: dict[bytes, bytes] = {}
        self._worker = SerialWorker()

    def _stream(self) -> tuple[str, BinaryIO]:
        if self._handle is not None and self._handle.tell() >= self.file_bytes:
            self._handle.close()
            self._handle = None
        if self._handle is None:
            name = f"__{self.rank}_{self._count}.distcp"
            self._handle = open(self.out_dir / name, "wb")  # noqa: SIM115 (kept open across calls)
            self._count += 1
        return Path(self._handle.name).name, self._handle

    def add_tensor(self, key: str, global_shape: tuple, offsets: tuple, tensor: torch.Tensor) -> None:
        """`tensor` is the chunk itself, with one leading axis of size 1 per prepended axis."""
        where = (tuple(global_shape), tuple(offsets), tuple(tensor.shape))

        def write() -> None:
            name, handle = self._stream()
            start = handle.tell()
            length = write_tensor_record(handle, tensor)
            self.chunks.append(Chunk(key, name, start, length, *where, tensor.dtype))

        self._worker.submit(write, tensor.numel() * tensor.element_size())

    def add_object(self, key: str, obj: Any) -> None:
        """`obj` torch.saved; equal objects (every layer's empty `_extra_state`) are saved once
        and their bytes reused."""
        identity = pickle.dumps(obj)
        if identity not in self._saved_objects:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            self._saved_objects[identity] = buffer.getvalue()
        saved = self._saved_objects[identity]

        def write() -> None:
            name, handle = self._stream()
            start = handle.tell()
            handle.write(saved)
            self.chunks.append(Chunk(key, name, start, len(saved)))

        self._worker.submit(write)

    def close(self) -> list[Chunk]:
        """Wait for the writes (raising the first failure) and close the last file."""
        try:
            self._worker.drain()
        finally:
            if self._handle is not None:
                self._handle.close()
                self._handle = None
        return self.chunks


def check_coverage(chunks: list[Chunk]) -> None:
    """Every key's chunks must tile its global tensor: in bounds, no chunk twice, volumes adding
    up (each key comes from one regular grid, so this rules out gaps and overlaps)."""
    seen: dict[str, set[tuple[int, ...]]] = {}
    volume: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for c in chunks:
        if c.offsets is None:
            continue
        if shapes.setdefault(c.key, c.global_shape) != c.global_shape:
            raise BridgeError(f"checkpoint key `{c.key}` is saved with two global shapes")
        if any(o + s > g for o, s, g in zip(c.offsets, c.sizes, c.global_shape, strict=True)):
            raise BridgeError(f"checkpoint key `{c.key}`: chunk at {c.offsets} leaves {c.global_shape}")
        if c.offsets in seen.setdefault(c.key, set()):
            raise BridgeError(f"checkpoint key `{c.key}`: chunk at {c.offsets} written twice")
        seen[c.key].add(c.offsets)
        volume[c.key] = volume.get(c.key, 0) + math.prod(c.sizes)
    for key, shape in shapes.items():
        if volume[key] != math.prod(shape):
            total = math.prod(shape)
            raise BridgeError(f"checkpoint key `{key}`: chunks cover {volume[key]} of {total} elements")


def write_index(out_dir: Path, chunks: list[Chunk]) -> None:
    """DCP's `.metadata` for every rank's chunks (written last: its presence marks the data
    complete), through a temporary file."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    check_coverage(chunks)
    tensors: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for c in chunks:
        info = _StorageInfo(c.file, c.start, c.length)
        if c.offsets is None:
            tensors[c.key] = BytesStorageMetadata()
            storage[MetadataIndex(c.key)] = info
            continue
        if c.key not in tensors:
            properties = TensorProperties(dtype=c.dtype)
            tensors[c.key] = TensorStorageMetadata(properties, torch.Size(c.global_shape), [])
        entry = tensors[c.key]
        entry.chunks.append(ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)))
        storage[MetadataIndex(c.key, c.offsets, len(entry.chunks) - 1)] = info
    meta = Metadata(
        state_dict_metadata=tensors,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=str(out_dir), save_id=uuid.uuid4().hex),
        version=CURRENT_DCP_VERSION,
    )
    tmp = Path(out_dir) / f"{INDEX_FILE}.tmp"
    with tmp.open("wb") as handle:
        pickle.dump(meta, handle)
    os.replace(tmp, Path(out_dir) / INDEX_FILE)


# ------------------------------------------------------------------------------ reading
class ChunkFileReader:
    """Reads any part of any key of a torch_dist checkpoint, assembled from the chunks that
    cover it (so a checkpoint saved under one layout reads under another)."""

    def __init__(self, ckpt_dir: Path) -> None:
        self.dir = Path(ckpt_dir)
        path = self.dir / INDEX_FILE
        if not path.is_file():
            raise BridgeError(
                f"{self.dir}: incomplete torch_dist checkpoint (no {INDEX_FILE}, the chunk index)"
            )
        try:
            with path.open("rb") as handle:
                self.meta = pickle.load(handle)
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
            raise BridgeError(f"{path}: unreadable tensor index ({exc})") from None
        self._maps = MappedFiles()
        self._by_offsets: dict[str, dict[tuple[int, ...], int]] = {}

    def _map(self, file: str) -> mmap.mmap:
        try:
            return self._maps[self.dir / file]
        except FileNotFoundError:
            raise BridgeError(f"{self.dir / file}: data file listed in {INDEX_FILE} is missing") from None

    def _chunk_tensor(self, key: str, chunk: Any, index: int) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.meta.storage_data[MetadataIndex(key, chunk.offsets, index)]
        if info.transform_descriptors:
            where = self.dir / info.relative_path
            raise BridgeError(f"{where}: `{key}` is stored transformed (compressed?); not supported")
        buf = self._map(info.relative_path)
        if info.offset + info.length > len(buf):
            raise BridgeError(
                f"{self.dir / info.relative_path}: truncated .distcp data file ({len(buf)} bytes, "
                f"`{key}` needs bytes up to {info.offset + info.length})"
            )
        tensor = read_tensor_record(buf, info.offset, info.length)
        if tuple(tensor.shape) != tuple(chunk.sizes):
            shape = tuple(tensor.shape)
            raise BridgeError(f"{self.dir}: `{key}` chunk at {tuple(chunk.offsets)} holds shape {shape}")
        return tensor

    def exact(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor | None:
        """The saved chunk that is exactly this part of `key`, as a zero-copy view (pages that
        `release` drops fault back in from the file); None when the layouts differ."""
        entry = self.meta.state_dict_metadata.get(key)
        if entry is None or not hasattr(entry, "chunks"):
            return None
        if key not in self._by_offsets:
            self._by_offsets[key] = {tuple(c.offsets): i for i, c in enumerate(entry.chunks)}
        index = self._by_offsets[key].get(tuple(offsets))
        if index is None or tuple(entry.chunks[index].sizes) != tuple(shape):
            return None
        return self._chunk_tensor(key, entry.chunks[index], index)

    def read_into(
        self, key: str, offsets: tuple[int, ...], out: torch.Tensor, allow_shape_mismatch: bool = False
    ) -> None:
        """Fill `out` with the part of `key` that starts at `offsets` (out has the full rank).

        With `allow_shape_mismatch` (Megatron's flag for vocab-padded embeddings, whose padding
        depends on the TP size) what lies beyond the saved tensor is zero-filled."""
        entry = self.meta.state_dict_metadata.get(key)
        if entry is None or not hasattr(entry, "chunks"):
            raise BridgeError(f"{self.dir}: checkpoint has no tensor `{key}`")
        saved = tuple(entry.size)
        if len(saved) != out.dim():
            raise BridgeError(
                f"{self.dir}: `{key}` is {saved} in the checkpoint; the model wants rank {out.dim()}"
            )
        inside = _overlap(offsets, tuple(out.shape), (0,) * len(saved), saved)
        if allow_shape_mismatch and inside is not None and inside[1] != tuple(out.shape):
            out.zero_()
            out = out[tuple(slice(0, size) for size in inside[1])]
        elif inside is None or inside[1] != tuple(out.shape):
            raise BridgeError(
                f"{self.dir}: `{key}` is {saved} in the checkpoint; the model wants {tuple(out.shape)} "
                f"at {tuple(offsets)}"
            )
        whole = self.exact(key, offsets, tuple(out.shape))
        if whole is not None:  # the common case: saved and wanted layouts agree on this tensor
            out.copy_(whole)
            return
        filled = 0
        for index, chunk in enumerate(entry.chunks):
            common = _overlap(offsets, tuple(out.shape), tuple(chunk.offsets), tuple(chunk.sizes))
            if common is None:
                continue
            start, sizes = common
            source = self._chunk_tensor(key, chunk, index)
            src = tuple(slice(a - c, a - c + n) for a, c, n in zip(start, chunk.offsets, sizes, strict=True))
            dst = tuple(slice(a - o, a - o + n) for a, o, n in zip(start, offsets, sizes, strict=True))
            out[dst].copy_(source[src])
            filled += math.prod(sizes)
        if filled != out.numel():
            raise BridgeError(
                f"{self.dir}: chunks of `{key}` cover {filled} of the {out.numel()} elements wanted"
            )

    def release(self) -> None:
        """Drop the maps' pages from the resident set (views of them stay valid)."""
        self._maps.release()


def _overlap(
    a_start: tuple[int, ...], a_sizes: tuple[int, ...], b_start: tuple[int, ...], b_sizes: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Where two boxes meet (start, sizes), or None."""
    lows = tuple(max(a, b) for a, b in zip(a_start, b_start, strict=True))
    highs = tuple(min(a + m, b + n) for a, m, b, n in zip(a_start, a_sizes, b_start, b_sizes, strict=True))
    if any(low >= high for low, high in zip(lows, highs, strict=True)):
        return None
    return lows, tuple(high - low for low, high in zip(lows, highs, strict=True))
