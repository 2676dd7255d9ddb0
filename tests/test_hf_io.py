"""The HF checkpoint reader and writer: every dtype round-trips, at any byte offset, and the
reader's released pages come back when a tensor is used again."""

from __future__ import annotations

import torch

from slimrl.megatron_bridge.hf_io import HFCheckpointReader, ShardWriter, finalize_index


def _write(tmp_path, tensors: dict[str, torch.Tensor], max_shard_bytes: int = 1 << 30) -> None:
    writer = ShardWriter(tmp_path, max_shard_bytes=max_shard_bytes)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.flush()
    finalize_index(tmp_path, writer.files, writer.bytes_written)


def test_every_dtype_round_trips_even_when_misaligned(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {  # a 3-byte bool tensor first puts everything after it at an odd offset
        "flags": torch.tensor([True, False, True]),
        "bf16": torch.randn(5, 3, generator=generator).to(torch.bfloat16),
        "f64": torch.randn(7, generator=generator, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "i64": torch.arange(9).reshape(3, 3),
        "fp8": torch.randn(6, generator=generator).to(torch.float8_e4m3fn),
    }
    _write(tmp_path, tensors)
    reader = HFCheckpointReader(tmp_path)
    assert sorted(reader.names) == sorted(tensors)
    for name, expected in tensors.items():
        got = reader.get(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name
        assert got.data_ptr() % got.element_size() == 0, name  # aligned for the kernels
        assert reader.nbytes(name) == expected.numel() * expected.element_size()


def test_released_pages_fault_back_in(tmp_path):
    tensors = {f"w{i}": torch.full((256, 256), float(i)) for i in range(8)}  # 256 KiB each
    _write(tmp_path, tensors, max_shard_bytes=600 * 1024)  # several shard files
    reader = HFCheckpointReader(tmp_path)
    reader.RELEASE_BYTES = 300 * 1024  # release the maps every other tensor
    held = {name: reader.get(name) for name in tensors}
    for name, expected in tensors.items():
        assert torch.equal(held[name], expected), name
