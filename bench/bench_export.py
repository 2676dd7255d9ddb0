"""Streaming export throughput (HF tensors produced per second) vs. a plain copy of the same bytes.

The model is the synthetic Qwen3-MoE (bf16) loaded into Megatron-Core in one process (TP1); the
export converts names and layouts (fused QKV and gate/up split back) and yields buckets, the
baseline clones every parameter once. Both measured in this run.

    python bench/bench_export.py [--size-gb 0.5] [--bucket-mb 512]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from gate import record

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_checkpoint import write_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gb", type=float, default=0.5)
    parser.add_argument("--bucket-mb", type=int, default=512)
    args = parser.parse_args()
    from slimrl.utils.net import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    from slimrl.conversion.convert import LayoutArgs, _build, _init
    from slimrl.megatron_bridge.archs import read_model_arch
    from slimrl.megatron_bridge.export import export_hf_buckets
    from slimrl.megatron_bridge.loading import load_hf_into_megatron

    with tempfile.TemporaryDirectory() as tmp:
        hf = write_checkpoint(Path(tmp) / "hf", args.size_gb)
        arch = read_model_arch(hf)
        layout = _init(arch, LayoutArgs())
        chunks = _build(arch, layout, torch.bfloat16)
        load_hf_into_megatron(chunks, arch, layout, str(hf))

    params = [p for chunk in chunks for p in chunk.parameters()]
    start = time.perf_counter()
    copied = sum(p.detach().clone().numel() * p.element_size() for p in params)
    copy_s = time.perf_counter() - start

    start = time.perf_counter()
    exported = 0
    for bucket in export_hf_buckets(chunks, arch, layout, args.bucket_mb * 1024**2):
        exported += sum(t.numel() * t.element_size() for _, t in bucket)
    export_s = time.perf_counter() - start
    ratio = (exported / export_s) / (copied / copy_s)
    print(
        json.dumps(
            {
                "bytes": exported,
                "plain_copy_gb_per_s": round(copied / copy_s / 1e9, 3),
                "export_gb_per_s": round(exported / export_s / 1e9, 3),
                "export_ratio_to_copy": round(ratio, 3),
            },
            indent=2,
        )
    )
    record("export", {"export_vs_copy": ratio})


if __name__ == "__main__":
    main()
