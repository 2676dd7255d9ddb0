"""Weight sync throughput per (engine x transport) vs. a plain memory copy of the same bytes, one run.

A synthetic Qwen3-MoE (`--size-gb` of float32 weights: CPU trainers and CPU engines both hold
float32, so no engine converts dtypes on load) is loaded into Megatron-Core in this process (TP1,
gloo) and pushed with `push_weights` into one engine at a time, first the real SGLang server (the
referee), then the embedded engine, both started by slimrl's own launch code with the synthetic
checkpoint as their model. Transports: `tensor` (shared memory, /update_weights_from_tensor),
`distributed` (gloo broadcast group) and `disk` (safetensors + /update_weights_from_disk). The
baselines are a plain copy of every parameter into fresh memory, timed between the pushes while
the same engine runs (so both see the same machine), and the bridge's export alone (no transport).

Each figure is the best of `--repeats` pushes after one warm-up push (first-touch costs), so a
busy machine disturbs it less. After every push the engine side of the update check runs
(`orchestration/update_check.py`: weight version, per-tensor checksums, the probe's prefill) and is
reported as a fraction of that push (issue 22's goal: at most 3%); the trainer's side of the probe
is one 16-token forward. Issue 11's goal: real SGLang's tensor path >= 0.5x the plain copy.
0.5x is also the ceiling of any push through memory: the bytes are copied twice, into the shared
segment by the trainer and from it into SGLang's parameters by SGLang's weight loaders.

    python bench/bench_weight_sync.py [--size-gb 0.5] [--bucket-mb 512] [--engines sglang,embedded]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from gate import record

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_checkpoint import write_checkpoint

TRANSPORTS = ("tensor", "distributed", "disk")
ENGINES = ("sglang", "embedded")
GOAL_VERIFY_SHARE = 0.03
"""Issue 22: the update check costs at most 3% of the sync it checks."""
GOAL_TENSOR_VS_COPY = 0.5
"""Issue 11: real SGLang's tensor path at least half as fast as copying the bytes in memory."""


def add_tokenizer(hf_dir: Path, scratch: Path) -> None:
    """Engines need a tokenizer and generation config: borrow the tiny model's (its ids fit in
    any vocabulary); everything but its config and weights."""
    from slimrl.data.tiny_models import make_tiny

    tiny = make_tiny("qwen3_moe", scratch / "tiny")
    for path in tiny.iterdir():
        if path.name != "config.json" and not path.name.endswith(".safetensors"):
            shutil.copy(path, hf_dir / path.name)


def best_of(repeats: int, run: Callable[[], float]) -> float:
    """Fewest seconds of `repeats` runs: the machine's noise only ever adds time."""
    return min(run() for _ in range(repeats))


def copy_seconds(params: list[torch.Tensor]) -> float:
    """The issue's baseline: a plain copy of every parameter into fresh memory (anonymous pages
    mapped for the copy, so every run pays the same first-touch faults; an allocator reusing
    freed memory would make it a warm copy on some runs and not others)."""
    nbytes = [p.numel() * p.element_size() for p in params]
    with mmap.mmap(-1, sum(nbytes)) as fresh:
        flat = torch.frombuffer(fresh, dtype=torch.uint8)
        start, offset = time.perf_counter(), 0
        for n, src in zip(nbytes, params, strict=True):
            flat[offset : offset + n].view(src.dtype).view(src.shape).copy_(src)
            offset += n
        seconds = time.perf_counter() - start
        del flat
    return seconds


def warm_copy_seconds(params: list[torch.Tensor]) -> float:
    """The hardware limit: the same copy into memory already touched."""
    destinations = [torch.empty_like(p).fill_(0) for p in params]
    start = time.perf_counter()
    for dst, src in zip(destinations, params, strict=True):
        dst.copy_(src)
    return time.perf_counter() - start


def engine_config(kind: str, model: Path, *overrides: str) -> Any:
    """The run config of one engine kind: the server launch and `push_weights` both read it."""
    from slimrl.preflight import load_config

    return load_config(None, [f"model.hf_checkpoint={model}", f"rollout.engine={kind}", *overrides])


def start_server(kind: str, model: Path, log_dir: Path, *overrides: str) -> Any:
    """One engine started exactly as a run starts it (`rollout.engine=<kind>` + `overrides`)."""
    from slimrl.rollout.servers import start_server as start

    return start(engine_config(kind, model, *overrides), str(model), log_dir / f"{kind}.log")


def push_seconds(actor: Any, kind: str, scratch: Path, bucket: int, repeats: int) -> dict[str, float]:
    """Seconds of the best push per transport into one freshly started engine of `kind`, and of
    the best plain copy timed between those pushes (same machine load, engine running)."""
    from slimrl.orchestration.update_check import UpdateCheck
    from slimrl.trainer.weight_sync import push_weights

    params = [p for chunk in actor.state.model for p in chunk.parameters()]
    actor.config = engine_config(kind, actor.hf_dir, f"rollout.update_weight_buffer_bytes={bucket}")
    server = start_server(kind, actor.hf_dir, scratch)
    check = UpdateCheck(actor.config)
    seconds = {"plain_copy": copy_seconds(params), "warm_copy": warm_copy_seconds(params)}
    try:
        for transport in TRANSPORTS:
            sync_dir = scratch / "sync" / "v1"

            def push(transport: str = transport, sync_dir: Path = sync_dir) -> float:
                seconds["plain_copy"] = min(seconds["plain_copy"], copy_seconds(params))
                seconds["warm_copy"] = min(seconds["warm_copy"], warm_copy_seconds(params))
                directory = str(sync_dir) if transport == "disk" else None
                stats = push_weights(actor, [server.url], transport, transport, directory)
                start = time.perf_counter()
                check.verify([server.url], transport, expect_change=False, expected=None)
                check.engine_logprobs([server.url])
                checked = time.perf_counter() - start
                seconds[f"{transport}_verify"] = min(seconds.get(f"{transport}_verify", checked), checked)
                shutil.rmtree(sync_dir.parent, ignore_errors=True)
                return stats["seconds"]

            push()  # warm-up: first-touch of shared memory, group set-up paths, page cache
            seconds[transport] = best_of(repeats, push)
    finally:
        server.stop()
    return seconds


def load_actor(scratch: Path, size_gb: float, dtype: torch.dtype) -> Any:
    """The synthetic checkpoint in Megatron-Core, wrapped as much of an actor as a push reads."""
    from slimrl.conversion.convert import LayoutArgs, _build, _init
    from slimrl.megatron_bridge.archs import read_model_arch
    from slimrl.megatron_bridge.loading import load_hf_into_megatron

    stored_gb = size_gb * 2 / dtype.itemsize  # the checkpoint on disk is bf16
    hf = write_checkpoint(scratch / "hf", stored_gb)
    add_tokenizer(hf, scratch)
    arch = read_model_arch(hf)
    layout = _init(arch, LayoutArgs())
    chunks = _build(arch, layout, dtype)
    load_hf_into_megatron(chunks, arch, layout, str(hf))
    state = SimpleNamespace(model=chunks)
    return SimpleNamespace(state=state, arch=arch, layout=layout, hf_dir=hf, ledger=None)


def export_seconds(actor: Any, bucket: int) -> tuple[float, int]:
    from slimrl.megatron_bridge.export import export_hf_buckets

    start = time.perf_counter()
    exported = sum(
        t.numel() * t.element_size()
        for b in export_hf_buckets(actor.state.model, actor.arch, actor.layout, bucket)
        for _, t in b
    )
    return time.perf_counter() - start, exported


def report(nbytes: int, export_s: float, pushes: dict[str, dict[str, float]]) -> dict:
    """GB/s per (engine x transport) and its ratio to the plain copy timed beside it."""
    gb = nbytes / 1e9
    rows = [
        {"engine": kind, "transport": transport, "seconds": round(seconds[transport], 3),
         "gb_per_s": round(gb / seconds[transport], 3),
         "plain_copy_gb_per_s": round(gb / seconds["plain_copy"], 3),
         "vs_plain_copy": round(seconds["plain_copy"] / seconds[transport], 3),
         "vs_warm_copy": round(seconds["warm_copy"] / seconds[transport], 3),
         "verify_seconds": round(seconds[f"{transport}_verify"], 4),
         "verify_share_of_sync": round(seconds[f"{transport}_verify"] / seconds[transport], 4),
         "verify_goal_met": seconds[f"{transport}_verify"] / seconds[transport] <= GOAL_VERIFY_SHARE}
        for kind, seconds in pushes.items()
        for transport in TRANSPORTS
    ]  # fmt: skip
    table: dict[str, Any] = {"bytes": nbytes, "export_only_gb_per_s": round(gb / export_s, 3), "rows": rows}
    if "sglang" in pushes:
        ratio = pushes["sglang"]["plain_copy"] / pushes["sglang"]["tensor"]
        table["sglang_tensor_vs_plain_copy"] = round(ratio, 3)
        table["sglang_tensor_goal_met"] = ratio >= GOAL_TENSOR_VS_COPY
    if "sglang" in pushes and "embedded" in pushes:
        table["embedded_speedup_over_sglang"] = {
            t: round(pushes["sglang"][t] / pushes["embedded"][t], 3) for t in TRANSPORTS
        }
    return table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gb", type=float, default=0.5, help="float32 bytes pushed")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    from slimrl.utils.net import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    bucket = args.bucket_mb * 1024**2
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        actor = load_actor(scratch, args.size_gb, getattr(torch, args.dtype))
        export_s, nbytes = min(export_seconds(actor, bucket) for _ in range(args.repeats))
        pushes = {
            kind: push_seconds(actor, kind, scratch, bucket, args.repeats) for kind in args.engines.split(",")
        }
    table = report(nbytes, export_s, pushes)
    print(json.dumps(table, indent=1))
    # Gated against the copy into fresh memory: the warm copy (the hardware limit the table quotes)
    # takes ~0.03 s, so its best-of-N spread is ~30% between runs, the fresh copy's ~3%.
    record(
        "weight_sync",
        {f"{r['engine']}_{r['transport']}_vs_plain_copy": r["vs_plain_copy"] for r in table["rows"]},
    )


if __name__ == "__main__":
    main()
