"""torch_dist files written and read by the converter: the records are what torch.save writes,
the index is what torch DCP reads, and chunks reassemble under any grid."""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from slimrl.megatron_bridge.safetensors_index import BridgeError
from slimrl.megatron_bridge.torch_dist_files import (
    ChunkFileReader,
    ChunkFileWriter,
    read_tensor_record,
    write_index,
    write_tensor_record,
)

DTYPES = [
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn,
]  # fmt: skip


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 50).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_bytes = [t.reshape(-1).view(torch.uint8) for t in (a, b)]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*as_bytes)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 5), (0, 4), ()], ids=str)
def test_records_are_what_torch_save_writes(dtype, shape):
    tensor = sample(dtype, shape)
    stream = io.BytesIO(b"prefix")
    stream.seek(0, io.SEEK_END)
    length = write_tensor_record(stream, tensor)
    record = stream.getvalue()[6:]
    assert len(record) == length
    assert same_bytes(torch.load(io.BytesIO(record), weights_only=True), tensor)
    # Our reader, at an offset inside a larger buffer, and on torch's own record.
    assert same_bytes(read_tensor_record(bytearray(stream.getvalue()), 6, length), tensor)
    theirs = io.BytesIO()
    torch.save(tensor, theirs)
    assert same_bytes(read_tensor_record(bytearray(theirs.getvalue()), 0, len(theirs.getvalue())), tensor)
    if dtype != torch.float8_e4m3fn:  # FP8 is saved by torch.save itself (another pickle layout)
        ours, reference = zipfile.ZipFile(io.BytesIO(record)), zipfile.ZipFile(theirs)
        assert ours.namelist() == reference.namelist()
        assert ours.read("archive/data.pkl") == reference.read("archive/data.pkl")
        at = ours.getinfo("archive/data/0").header_offset
        name_len, extra_len = struct.unpack_from("<HH", record, at + 26)  # from the local header
        assert (at + 30 + name_len + extra_len) % 64 == 0  # aligned like torch's, for mmap loads


def test_records_are_zero_copy_views_and_odd_records_go_to_torch_load():
    tensor = sample(torch.float32, (4, 4))
    stream = io.BytesIO()
    length = write_tensor_record(stream, tensor)
    buffer = bytearray(stream.getvalue())
    view = read_tensor_record(buffer, 0, length)
    view.zero_()  # writes through to the buffer: no copy was made
    assert not read_tensor_record(buffer, 0, length).any()
    strided = io.BytesIO()
    torch.save(tensor.t(), strided)  # a transposed view: torch.save keeps its strides
    back = read_tensor_record(bytearray(strided.getvalue()), 0, len(strided.getvalue()))
    assert torch.equal(back, tensor.t())
    other = io.BytesIO()
    torch.save({"not": "a tensor"}, other)
    with pytest.raises(BridgeError, match="holds a dict, not a tensor"):
        read_tensor_record(bytearray(other.getvalue()), 0, len(other.getvalue()))


def write_grid(out: Path, full: torch.Tensor, rows: int, cols: int, key: str = "w") -> None:
    """`full` saved as a rows x cols grid of chunks, spread over two 'ranks'."""
    writers = [ChunkFileWriter(out, rank, file_bytes=64) for rank in range(2)]
    height, width = full.shape[0] // rows, full.shape[1] // cols
    for r in range(rows):
        for c in range(cols):
            chunk = full[r * height : (r + 1) * height, c * width : (c + 1) * width]
            writers[(r + c) % 2].add_tensor(key, tuple(full.shape), (r * height, c * width), chunk)
    write_index(out, [chunk for w in writers for chunk in w.close()])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_chunks_reassemble_for_any_wanted_box(tmp_path):
    full = sample(torch.float32, (6, 8))
    write_grid(tmp_path, full, rows=2, cols=2)
    assert len(list(tmp_path.glob("__*_*.distcp"))) > 2  # small file limit: several files per rank
    reader = ChunkFileReader(tmp_path)
    for offsets, shape in [((0, 0), (6, 8)), ((1, 3), (4, 5)), ((5, 7), (1, 1)), ((0, 4), (3, 4))]:
        out = torch.full(shape, float("nan"))
        reader.read_into("w", offsets, out)
        assert torch.equal(out, full[offsets[0] :][: shape[0], offsets[1] :][:, : shape[1]])
    # torch's own DCP loader reads the same files (Megatron's loader is built on it).
    loaded = {"w": torch.zeros(6, 8)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    assert torch.equal(loaded["w"], full)


def test_padded_reads_zero_fill_only_when_allowed(tmp_path):
    full = sample(torch.bfloat16, (6, 4))
    write_grid(tmp_path, full, rows=3, cols=1)
    reader = ChunkFileReader(tmp_path)
    padded = torch.full((8, 4), 7.0, dtype=torch.bfloat16)
    reader.read_into("w", (0, 0), padded, allow_shape_mismatch=True)
    assert torch.equal(padded[:6], full) and not padded[6:].any()
    with pytest.raises(BridgeError, match=r"`w` is \(6, 4\) in the checkpoint; the model wants \(8, 4\)"):
        reader.read_into("w", (0, 0), padded)
    with pytest.raises(BridgeError, match="checkpoint has no tensor `v`"):
        reader.read_into("v", (0, 0), padded)


def test_index_refuses_gaps_and_twice_written_chunks(tmp_path):
    writer = ChunkFileWriter(tmp_path, 0, file_bytes=1 << 20)
    writer.add_tensor("w", (4, 2), (0, 0), torch.zeros(2, 2))
    writer.add_tensor("w", (4, 2), (0, 0), torch.zeros(2, 2))
    with pytest.raises(BridgeError, match=r"chunk at \(0, 0\) written twice"):
        write_index(tmp_path, writer.close())
    writer = ChunkFileWriter(tmp_path, 0, file_bytes=1 << 20)
    writer.add_tensor("w", (4, 2), (0, 0), torch.zeros(2, 2))
    with pytest.raises(BridgeError, match="chunks cover 4 of 8 elements"):
        write_index(tmp_path, writer.close())
    assert not (tmp_path / ".metadata").exists()


def test_damaged_files_are_one_line_errors(tmp_path):
    write_grid(tmp_path, sample(torch.float32, (4, 4)), rows=2, cols=1)
    victim = tmp_path / "__1_0.distcp"
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(BridgeError, match=r"__1_0.distcp: truncated .distcp data file \(100 bytes"):
        ChunkFileReader(tmp_path).read_into("w", (0, 0), torch.empty(4, 4))
    victim.unlink()
    with pytest.raises(BridgeError, match=r"__1_0\.distcp: data file listed in \.metadata is missing"):
        ChunkFileReader(tmp_path).read_into("w", (0, 0), torch.empty(4, 4))
    (tmp_path / ".metadata").write_bytes(b"garbage")
    with pytest.raises(BridgeError, match="unreadable"):
        ChunkFileReader(tmp_path)
