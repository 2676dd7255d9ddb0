"""Trainer side of the weight sync: the bridge's streaming export, pushed to every engine.

Every HF tensor has exactly one owner rank (see `megatron_bridge/export.py`). The export runs in
rounds, one model unit each, and the configured `WeightTransport` (`weight_sync/transports.py`)
exchanges each round's tensors between the ranks and the engines. Rank 0 opens the engines'
weight-update session before the first round and, after the last, closes it and flushes their
prefix caches (computed with the old weights).
SGLang refuses tensor and distributed updates outside a session.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from slimrl.errors import SlimError
from slimrl.megatron_bridge.bucketing import load_together
from slimrl.megatron_bridge.export import Exporter
from slimrl.trainer.numerics import weights_fingerprint
from slimrl.utils import faults
from slimrl.utils.net import free_port, node_address
from slimrl.weight_sync import collectives
from slimrl.weight_sync.engines import EngineAddress, EngineCalls
from slimrl.weight_sync.fp8 import fp8_bucket
from slimrl.weight_sync.transports import SyncTarget, make_transport

if TYPE_CHECKING:
    from slimrl.trainer.actor import MegatronActor


def sync_target(
    actor: MegatronActor, urls: list[str], version: str, sync_dir: str | None, calls: EngineCalls
) -> SyncTarget:
    """The same description of the sync on every rank (rank 0 picks the group's port)."""

    address: list[object] = [(node_address(), free_port()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(address, src=0)
    host, port = address[0]  # type: ignore[misc]
    # One payload entry per engine rank that reads one (the embedded engine is a single rank).
    rollout = actor.config.rollout
    tp_size = rollout.gpus_per_engine if rollout.engine == "sglang" else 1
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return SyncTarget(
        engines=[EngineAddress(url, tp_size) for url in urls], calls=calls, version=version,
        rank=dist.get_rank(), world_size=dist.get_world_size(), device=device,
        bucket_bytes=rollout.update_weight_buffer_bytes, together=load_together(actor.arch),
        directory=Path(sync_dir) if sync_dir else None, group_address=host, group_port=port,
        ledger=actor.ledger,
    )  # fmt: skip


def push_weights(
    actor: MegatronActor,
    urls: list[str],
    transport: str,
    version: str,
    sync_dir: str | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    trace_dir: str | None = None,
) -> dict[str, float]:
    """All training ranks call this together; returns bytes pushed by this rank, seconds, and the
    fingerprint of its weights (`numerics.weights_fingerprint`).

    The export runs in rounds, one per model unit (`Exporter.units`): the number of rounds is the
    most units any rank has, and every rank calls the transport's `exchange` in every round, with
    what it owns of its unit (nothing once its units are done)."""
    assert actor.state is not None
    start = time.perf_counter()
    fingerprint = weights_fingerprint(actor.state.model)  # every rank, before anything is sent
    target = sync_target(actor, urls, version, sync_dir, EngineCalls(api_key, admin_api_key))
    if target.directory is not None and target.rank == 0:
        target.directory.mkdir(parents=True, exist_ok=True)
    sender = make_transport(transport, target)
    pushed = 0
    fp8 = actor.config.rollout.sglang.quantization == "fp8"  # engines serve block FP8
    with (
        ThreadPoolExecutor(max_workers=max(len(urls), 1) + 1) as pool,
        collectives.Watchdog(Path(trace_dir) if trace_dir else None, target.rank),
    ):
        if target.rank == 0 and sender.session:
            target.calls.begin(pool, target.engines)
        collectives.barrier()
        try:
            exporter = Exporter(actor.state.model, actor.arch, actor.layout)
            units = exporter.units()
            for index in range(collectives.all_reduce_max(len(units))):
                faults.hang_sync(version, target.rank)  # a test's fault point
                collectives.set_round(index)
                unit = list(exporter.tensors(units[index])) if index < len(units) else []
                unit = faults.corrupt_update(unit, version)  # a test's fault point; else unit as is
                sender.exchange(pool, fp8_bucket(unit) if fp8 and unit else unit)
                pushed += sum(t.numel() * t.element_size() for _, t in unit)
            collectives.set_round(-1)
            sender.finish(pool)
        except BaseException:
            if target.rank == 0 and sender.session:  # leave no engine stuck in an open session
                _end_sessions(target, pool, quiet=True)
            raise
        collectives.barrier()
        if target.rank == 0:
            if sender.session:
                _end_sessions(target, pool)
            target.calls.each(pool, target.engines, lambda e: target.calls.post(e.url, "flush_cache"))
    collectives.barrier()
    seconds = time.perf_counter() - start
    return {"bytes": float(pushed), "seconds": seconds, "fingerprint": fingerprint}


def _end_sessions(target: SyncTarget, pool: ThreadPoolExecutor, quiet: bool = False) -> None:
    def end(engine: EngineAddress) -> None:
        try:
            target.calls.post(engine.url, "end_weight_update")
        except SlimError:
            if not quiet:
                raise

    target.calls.each(pool, target.engines, end)
