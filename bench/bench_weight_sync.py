"""Weight sync throughput per transport vs. a plain memory copy of the same bytes, same run.

A synthetic Qwen3-MoE (bf16, `--size-gb`) is loaded into Megatron-Core in this process (TP1, gloo)
and pushed to one running embedded engine (`slimrl serve`, another process) with each transport:
`tensor` (shared memory, /update_weights_from_tensor), `distributed` (gloo broadcast group) and
`disk` (safetensors + /update_weights_from_disk). The baselines are a plain copy of every parameter
and the bridge's export alone (names and layouts, no transport).

    python bench/bench_weight_sync.py [--size-gb 1.0] [--bucket-mb 512]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_checkpoint import write_checkpoint


def add_tokenizer(hf_dir: Path, scratch: Path) -> None:
    """The engine needs a tokenizer: borrow the tiny one (its ids fit in any vocabulary)."""
    from slimrl.data.tiny_models import make_tiny

    tiny = make_tiny("qwen3_moe", scratch / "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, hf_dir / name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--bucket-mb", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    from slimrl.orchestration.placement import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    from slimrl.megatron_bridge.convert import LayoutArgs, _build, _init
    from slimrl.megatron_bridge.export import export_hf_buckets
    from slimrl.megatron_bridge.loading import load_hf_into_megatron
    from slimrl.megatron_bridge.model_arch import read_model_arch
    from slimrl.rollout.servers import ServerProcess
    from slimrl.trainer.weight_sync import push_weights

    bucket = args.bucket_mb * 1024**2
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        hf = write_checkpoint(scratch / "hf", args.size_gb)
        add_tokenizer(hf, scratch)
        arch = read_model_arch(hf)
        layout = _init(arch, LayoutArgs())
        chunks = _build(arch, layout, torch.bfloat16)
        load_hf_into_megatron(chunks, arch, layout, str(hf))
        actor = SimpleNamespace(state=SimpleNamespace(model=chunks), arch=arch, layout=layout)

        params = [p for chunk in chunks for p in chunk.parameters()]
        start = time.perf_counter()
        copies = [p.detach().clone() for p in params]
        copy_s = time.perf_counter() - start
        copied = sum(c.numel() * c.element_size() for c in copies)
        del copies

        start = time.perf_counter()
        exported = sum(
            t.numel() * t.element_size()
            for b in export_hf_buckets(chunks, arch, layout, bucket)
            for _, t in b
        )
        results["export_only_s"] = time.perf_counter() - start

        port = free_port()
        cmd = [sys.executable, "-m", "slimrl.cli", "serve", "--model", str(hf), "--port", str(port)]
        server = ServerProcess("engine0", cmd, "127.0.0.1", port, log_path=scratch / "engine.log")
        server.start()
        try:
            server.wait_healthy(600)
            for transport in ("tensor", "distributed", "disk"):
                sync_dir = str(scratch / "sync") if transport == "disk" else None
                push_weights(actor, [server.url], transport, "warm", bucket, sync_dir)  # first-touch costs
                stats = push_weights(actor, [server.url], transport, transport, bucket, sync_dir)
                results[f"{transport}_s"] = stats["seconds"]
                shutil.rmtree(scratch / "sync", ignore_errors=True)
        finally:
            server.stop()

    gb = exported / 1e9
    copy_gbps = copied / copy_s / 1e9
    report: dict[str, float | int] = {
        "bytes": exported,
        "plain_copy_gb_per_s": round(copy_gbps, 3),
        "export_only_gb_per_s": round(gb / results["export_only_s"], 3),
    }
    for transport in ("tensor", "distributed", "disk"):
        seconds = results[f"{transport}_s"]
        report[f"{transport}_gb_per_s"] = round(gb / seconds, 3)
        report[f"{transport}_vs_plain_copy"] = round(gb / seconds / copy_gbps, 3)
        report[f"{transport}_seconds_per_gb"] = round(seconds / gb, 2)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
