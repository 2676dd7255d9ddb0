"""What an HF safetensors checkpoint holds, from its headers alone (no torch): each tensor's shard,
offsets and dtype, with every shard checked to hold the bytes its header promises. The converter's
launcher runs it before any rank starts, so a missing or truncated shard is one line in a second
rather than after every rank imported torch and Megatron-Core; `hf_io.HFCheckpointReader` reads
tensors through the same index."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from slimrl.errors import SlimError

INDEX_NAME = "model.safetensors.index.json"
DTYPE_NAMES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2")
"""The safetensors dtypes the bridge reads and writes (`hf_io` maps each to its torch dtype)."""


class BridgeError(SlimError):
    """A checkpoint (or a flag naming one) that cannot be converted as it is: the input is at fault,
    so the command exits 2 like every refused input."""

    exit_code = 2


@dataclass(frozen=True)
class TensorEntry:
    file: str
    data_start: int
    """Where the shard's tensor data begins (after its 8-byte length and JSON header)."""
    entry: dict
    """The header's entry: `dtype`, `shape`, `data_offsets` (relative to `data_start`)."""


def check_shard(path: Path) -> tuple[dict[str, dict], int]:
    """Parse the safetensors header and check the file holds every byte it promises.

    Returns the header's tensor entries and where the tensor data starts."""
    if not path.is_file():
        raise BridgeError(f"{path}: safetensors shard listed in the checkpoint is missing")
    size = path.stat().st_size
    with path.open("rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise BridgeError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise BridgeError(
                f"{path}: truncated safetensors file (header wants {header_len} bytes, file has {size})"
            )
        try:
            header = json.loads(handle.read(header_len))
        except json.JSONDecodeError:
            raise BridgeError(f"{path}: corrupt safetensors header") from None
    header.pop("__metadata__", None)
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + header_len + end > size:
        raise BridgeError(
            f"{path}: truncated safetensors file ({size} bytes, tensors need {8 + header_len + end})"
        )
    unknown = sorted({info["dtype"] for info in header.values()} - set(DTYPE_NAMES))
    if unknown:
        valid = ", ".join(sorted(DTYPE_NAMES))
        raise BridgeError(f"{path}: unsupported safetensors dtype {unknown[0]} (valid: {valid})")
    return header, 8 + header_len


def read_index(hf_dir: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint in `hf_dir` (one file or sharded with an index), each shard
    checked; a tensor the index lists but its shard lacks is refused."""
    index = hf_dir / INDEX_NAME
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
        if not files:
            raise BridgeError(f"{hf_dir}: no *.safetensors files (and no {INDEX_NAME})")
        weight_map = {}
    entries: dict[str, TensorEntry] = {}
    for file in files:
        header, data_start = check_shard(hf_dir / file)
        for name, entry in header.items():
            entries[name] = TensorEntry(file, data_start, entry)
    missing = sorted(n for n, f in weight_map.items() if n not in entries or entries[n].file != f)
    if missing:
        raise BridgeError(f"{index}: {len(missing)} tensors listed but not in their shard, e.g. {missing[0]}")
    return entries
