"""Reading and writing Hugging Face safetensors checkpoints, one tensor at a time.

The reader validates every shard before anything is converted (a missing or truncated shard is a
one-line error naming the file); the writer fills shards up to a byte limit and names them the HF
way (`model-00001-of-00003.safetensors` + `model.safetensors.index.json`).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from slimrl.megatron_bridge.safetensors_index import (
    DTYPE_NAMES,
    INDEX_NAME,
    BridgeError,
    read_index,
)
from slimrl.utils.mapped_files import MappedFiles
from slimrl.utils.serial_worker import SerialWorker

_TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
assert tuple(_TORCH_DTYPES) == DTYPE_NAMES


class HFCheckpointReader:
    """Lazy access to the tensors of an HF checkpoint directory (single file or sharded).

    Tensors are zero-copy views of the shards' private memory maps and are read-only by contract;
    every `RELEASE_BYTES` read, the maps' pages are dropped from the resident set."""

    RELEASE_BYTES = 256 * 1024**2

    def __init__(self, hf_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(hf_dir)
        self._entries = read_index(self.dir)
        self.location: dict[str, str] = {name: entry.file for name, entry in self._entries.items()}
        self._maps = MappedFiles()
        self._since_release = 0

    @property
    def names(self) -> list[str]:
        return list(self.location)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._entries:
            raise BridgeError(f"{self.dir}: tensor `{name}` is not in the checkpoint")
        found = self._entries[name]
        file, data_start, entry = found.file, found.data_start, found.entry
        begin, end = entry["data_offsets"]
        dtype = _TORCH_DTYPES[entry["dtype"]]
        if end == begin:
            return torch.empty(entry["shape"], dtype=dtype)
        if self._since_release > self.RELEASE_BYTES:
            self._maps.release()
            self._since_release = 0
        self._since_release += end - begin
        count = (end - begin) // dtype.itemsize
        offset = data_start + begin
        flat = torch.frombuffer(self._maps[self.dir / file], dtype=dtype, count=count, offset=offset)
        if offset % dtype.itemsize:  # the format does not promise alignment; kernels may assume it
            flat = flat.clone()
        return flat.reshape(entry["shape"])

    def nbytes(self, name: str) -> int:
        begin, end = self._entries[name].entry["data_offsets"]
        return end - begin

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name].entry["shape"])

    def total_bytes(self) -> int:
        return sum((self.dir / f).stat().st_size for f in set(self.location.values()))


_SAFETENSORS_DTYPES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}
_HEADER_RESERVE = 1 << 20  # bytes kept for the JSON header: room for ~5,000 tensor entries


class _StreamingSafetensors:
    """One safetensors file written tensor by tensor: the data goes straight to disk after a
    reserved header area, and the header (padded with spaces, as the format allows) is written
    last. Memory holds one tensor, not one shard."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle = path.open("wb")
        self.handle.seek(8 + _HEADER_RESERVE)
        self.entries: dict[str, dict[str, object]] = {}
        self.offset = 0
        self.header_bytes = 64

    def fits(self, name: str, nbytes: int, max_bytes: int) -> bool:
        room = self.header_bytes + len(name) + 120 <= _HEADER_RESERVE
        return room and (not self.entries or self.offset + nbytes <= max_bytes)

    def add(self, name: str, tensor: torch.Tensor) -> int:
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self.handle.write(memoryview(data))
        size = data.nbytes
        entry = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape)}
        entry["data_offsets"] = [self.offset, self.offset + size]
        self.entries[name] = entry
        self.offset += size
        self.header_bytes += len(json.dumps({name: entry})) + 1
        return size

    def close(self) -> None:
        entries = {"__metadata__": {"format": "pt"}, **self.entries}
        header = json.dumps(entries, separators=(",", ":")).encode()
        if len(header) > _HEADER_RESERVE:
            raise BridgeError(f"{self.path}: safetensors header overflow ({len(header)} bytes)")
        self.handle.seek(0)
        self.handle.write(struct.pack("<Q", _HEADER_RESERVE))
        self.handle.write(header.ljust(_HEADER_RESERVE, b" "))
        self.handle.close()


class ShardWriter:
    """Writes (name, tensor) pairs into shard files of at most `max_shard_bytes` each, streaming.

    Files are written under a rank-specific provisional name; `finalize_index` (on one rank)
    renames them to the HF convention once the total is known and writes the index. The writes
    run on a background thread, in order; a tensor must not change until `flush()` returns.
    """

    def __init__(self, out_dir: Path, rank: int = 0, max_shard_bytes: int = 2 * 1024**3) -> None:
        self.out_dir, self.rank, self.max_bytes = Path(out_dir), rank, max_shard_bytes
        self._current: _StreamingSafetensors | None = None
        self.files: list[tuple[str, list[str]]] = []
        self.bytes_written = 0
        self._worker = SerialWorker()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self._worker.submit(lambda: self._add_now(name, tensor, nbytes), nbytes)

    def _add_now(self, name: str, tensor: torch.Tensor, nbytes: int) -> None:
        if self._current is not None and not self._current.fits(name, nbytes, self.max_bytes):
            self._close_current()
        if self._current is None:
            file = f"part-r{self.rank:05d}-{len(self.files):05d}.safetensors"
            self._current = _StreamingSafetensors(self.out_dir / file)
        self.bytes_written += self._current.add(name, tensor)

    def flush(self) -> None:
        """Finish the open shard file and wait for every write (raising the first failure)."""
        self._worker.submit(self._close_current)
        self._worker.drain()

    def _close_current(self) -> None:
        if self._current is None:
            return
        self._current.close()
        self.files.append((self._current.path.name, list(self._current.entries)))
        self._current = None


def finalize_index(out_dir: Path, files: list[tuple[str, list[str]]], total_bytes: int) -> None:
    """Rename provisional shard files to `model-0000k-of-0000n.safetensors` and write the index."""
    count = len(files)
    weight_map: dict[str, str] = {}
    for k, (file, names) in enumerate(sorted(files), start=1):
        final = f"model-{k:05d}-of-{count:05d}.safetensors"
        os.replace(out_dir / file, out_dir / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
