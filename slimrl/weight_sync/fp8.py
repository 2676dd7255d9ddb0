"""FP8 rollout: what an SGLang server serving 128x128 block-FP8 weights is started from and sent.

Why not `--quantization fp8` on the bf16 checkpoint: SGLang then quantises on load
(`Fp8LinearMethod.process_weights_after_loading` with `is_checkpoint_fp8_serialized=False`), which
*replaces* `layer.weight` by a new, transposed `Parameter` without the `weight_loader` attribute,
so a later `load_weights` of a weight update no longer reaches the layer's loader; and the update
would be bf16 anyway.  Started from a block-FP8 checkpoint instead (`config.json` carrying
`quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], ...}`), SGLang
builds `weight` (e4m3) and `weight_scale_inv` (float32, one per block) with the layers' own
loaders and, on GPUs, post-processes them in place (`layer.weight.data = ...`), so every update
in that same format goes through the same loaders, between `/begin_weight_update` and
`/end_weight_update` (which re-runs `process_weights_after_loading`).

`fp8_bucket` turns one bf16 export bucket into that format; `write_fp8_checkpoint` writes the
start checkpoint once, from the HF checkpoint the run starts from, in parallel: the source's
safetensors files are split into groups (`split_source_files`), each group written by one worker
(`write_fp8_part`: a Ray task, a pool process, or this process) into shards of its own, then one
index names them all. Each tensor is quantised alone, so the tensors are the same bytes whatever
the split.  Which tensors are quantised is
`slimrl.megatron_bridge.fp8.should_quantize` (decoder-layer linear weights; norms, embeddings,
`lm_head`, router gates and biases stay in their dtype, as in DeepSeek-V3 / Qwen3 FP8 checkpoints,
and as SGLang builds those modules without a quant method).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from slimrl.megatron_bridge.fp8 import (
    BLOCK,
    fp8_quantization_config,
    quantize_block_fp8,
    scale_name,
    should_quantize,
)
from slimrl.megatron_bridge.hf_io import (
    INDEX_NAME,
    HFCheckpointReader,
    ShardWriter,
    finalize_index,
)
from slimrl.utils.tensors import NamedTensors

__all__ = ["fp8_bucket", "fp8_hf_config", "split_source_files", "write_fp8_checkpoint", "write_fp8_part"]


PartWritten = tuple[list[tuple[str, list[str]]], int]
"""What one worker wrote: its shard files (provisional names) with their tensor names, and bytes."""

MapParts = Callable[[Callable[..., PartWritten], Sequence[tuple[Any, ...]]], list[PartWritten]]
"""Runs `write_fp8_part` once per argument tuple, in parallel or not, and returns the results in
order (a Ray map, a process pool's map, or the serial default)."""


def fp8_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]], block: int = BLOCK) -> NamedTensors:
    """One export bucket as an FP8 server loads it: each quantisable ``<p>.weight`` becomes the pair
    ``(<p>.weight, e4m3)``, ``(<p>.weight_scale_inv, float32 [ceil(rows/block), ceil(cols/block)])``;
    other tensors pass through unchanged (same objects, same order)."""
    out: NamedTensors = []
    for name, tensor in named_tensors:
        if not should_quantize(name, tensor):
            out.append((name, tensor))
            continue
        try:
            q, scale_inv = quantize_block_fp8(tensor, block)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
        out += [(name, q), (scale_name(name), scale_inv)]
    return out


def fp8_hf_config(hf_config: dict, block: int = BLOCK) -> dict:
    """``config.json`` of the FP8 checkpoint: the bf16 one plus a block-FP8 ``quantization_config``
    (SGLang reads it and builds `Fp8LinearMethod` / `Fp8MoEMethod` with ``weight_block_size``)."""
    if "quantization_config" in hf_config:
        raise ValueError(f"checkpoint is already quantised: {hf_config['quantization_config']}")
    quant = fp8_quantization_config()
    quant["weight_block_size"] = [block, block]
    return {**hf_config, "quantization_config": quant}


def split_source_files(src: str | Path, parts: int) -> list[list[str]]:
    """The source checkpoint's safetensors files in at most `parts` groups of about equal bytes
    (largest file first to the lightest group), each group in file order, groups in the order of
    their first file: worker k writes `part-r{k}-*`, so the index numbers shards in source order."""
    src = Path(src)
    files = sorted(set(HFCheckpointReader(src).location.values()))
    groups: list[list[str]] = [[] for _ in range(max(1, min(parts, len(files))))]
    loads = [0] * len(groups)
    for file in sorted(files, key=lambda f: (-(src / f).stat().st_size, f)):
        lightest = loads.index(min(loads))
        groups[lightest].append(file)
        loads[lightest] += (src / file).stat().st_size
    return sorted((sorted(group) for group in groups if group), key=lambda group: group[0])


def write_fp8_part(src: str, dst: str, files: list[str], part: int, block: int = BLOCK) -> PartWritten:
    """One worker's share: the block-FP8 copy of every tensor stored in `files` of `src`, in the
    checkpoint's order, written to shards `part-r{part:05d}-*.safetensors` of `dst` (which exists).
    Runs anywhere `src` and `dst` are visible (the run directory is on a filesystem every node shares)."""
    reader = HFCheckpointReader(src)
    writer = ShardWriter(Path(dst), rank=part)
    wanted = set(files)
    for name in reader.names:
        if reader.location[name] in wanted:
            for out_name, tensor in fp8_bucket([(name, reader.get(name))], block):
                writer.add(out_name, tensor)
    writer.flush()
    return writer.files, writer.bytes_written


def _serial(write: Callable[..., PartWritten], calls: Sequence[tuple[Any, ...]]) -> list[PartWritten]:
    return [write(*call) for call in calls]


def write_fp8_checkpoint(
    src: str | Path, dst: str | Path, block: int = BLOCK, parts: int = 1, map_parts: MapParts | None = None
) -> Path:
    """Write the block-FP8 copy of the HF checkpoint ``src`` into ``dst`` (created; must be empty
    or absent) and return ``dst``.  Non-weight files (tokenizer, generation config) are copied;
    the tensors are split by source file into at most `parts` groups, each written by one call of
    `write_fp8_part` through `map_parts` (default: here, one after the other), streaming, so each
    worker holds about one tensor at a time; the index then names every worker's shards."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    _copy_side_files(src, dst)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(fp8_hf_config(config, block), indent=2) + "\n")
    calls = [(str(src), str(dst), files, k, block) for k, files in enumerate(split_source_files(src, parts))]
    written = (map_parts or _serial)(write_fp8_part, calls)
    finalize_index(dst, [f for files, _ in written for f in files], sum(size for _, size in written))
    return dst


def _copy_side_files(src: Path, dst: Path) -> None:
    """Everything but the weights and config.json: SGLang needs the tokenizer next to the model."""
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (INDEX_NAME, "config.json"):
            shutil.copy2(path, dst / path.name)
