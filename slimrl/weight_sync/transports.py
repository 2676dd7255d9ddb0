"""The `WeightTransport` seam: how export buckets reach the engines. One class per transport,
registered by its config name (`rollout.weight_sync`).

All training ranks call `send` for the buckets they own and then `finish`, together; the caller
(`trainer/weight_sync.py`) opens and closes the engines' weight-update session around them.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from slimrl.errors import SlimError
from slimrl.weight_sync import wire
from slimrl.weight_sync.engines import Engine, EngineCalls

NamedTensors = list[tuple[str, torch.Tensor]]

GROUP_NAME = "slimrl_weight_update"
GROUP_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class SyncTarget:
    """What one weight sync needs to know, the same on every training rank."""

    engines: list[Engine]
    calls: EngineCalls
    version: str
    rank: int
    world_size: int
    device: torch.device
    directory: Path | None = None
    group_address: str = "127.0.0.1"
    group_port: int = 0


class WeightTransport(ABC):
    name: ClassVar[str]
    session: ClassVar[bool] = True
    """Whether updates must run inside `/begin_weight_update` ... `/end_weight_update`."""

    def __init__(self, target: SyncTarget) -> None:
        self.target = target

    @abstractmethod
    def send(self, pool: ThreadPoolExecutor, bucket: NamedTensors) -> None:
        """Push one bucket of HF-named tensors this rank owns."""

    @abstractmethod
    def finish(self, pool: ThreadPoolExecutor) -> None:
        """Called once on every rank after its last bucket."""


TRANSPORTS: dict[str, type[WeightTransport]] = {}


def register(cls: type[WeightTransport]) -> type[WeightTransport]:
    TRANSPORTS[cls.name] = cls
    return cls


def make_transport(name: str, target: SyncTarget) -> WeightTransport:
    if name not in TRANSPORTS:
        raise SlimError(f"rollout.weight_sync={name}: not one of {', '.join(sorted(TRANSPORTS))}")
    return TRANSPORTS[name](target)


@register
class TensorTransport(WeightTransport):
    """Colocated: tensors by reference (shared memory on CPU, CUDA IPC on GPUs)."""

    name = "tensor"

    def send(self, pool: ThreadPoolExecutor, bucket: NamedTensors) -> None:
        target = self.target
        if target.device.type == "cuda":  # CUDA IPC: the bucket lives until every engine answered
            self._post(pool, wire.tensor_update(bucket, target.version))
            return
        with wire.SHARED_SEGMENT.borrow(wire.packed_nbytes(bucket)) as segment:
            self._post(pool, wire.tensor_update(bucket, target.version, out=segment))

    def _post(self, pool: ThreadPoolExecutor, update: wire.TensorUpdate) -> None:
        # Every engine has loaded the bucket when this returns; only then may the buffer be reused.
        target = self.target
        target.calls.each(
            pool,
            target.engines,
            lambda e: target.calls.post(e.url, "update_weights_from_tensor", update.body(e.tp_size)),
        )

    def finish(self, pool: ThreadPoolExecutor) -> None:
        pass  # every bucket was loaded when its call returned


@register
class DistributedTransport(WeightTransport):
    """A broadcast group between global rank 0 and every engine GPU (gloo on CPU, NCCL on GPU).

    Group ranks as SGLang computes them: the trainer is rank 0, engine i's TP rank t is
    `rank_offset_i + t` with offsets counting the GPUs of the engines before it. Other owner ranks
    funnel their buckets to rank 0 over the trainer's own group, one after another: letting every
    owner open its own group deadlocks when two engines wait in different owners' broadcasts.
    """

    name = "distributed"

    def __init__(self, target: SyncTarget) -> None:
        super().__init__(target)
        self.group: Any = None

    def _open(self, pool: ThreadPoolExecutor) -> None:
        target = self.target
        offsets, world = [], 1
        for engine in target.engines:
            offsets.append(world)
            world += engine.tp_size
        backend = "nccl" if target.device.type == "cuda" else "gloo"

        def join(item: tuple[Engine, int]) -> Any:
            engine, offset = item
            body = {
                "master_address": target.group_address, "master_port": target.group_port,
                "rank_offset": offset, "world_size": world, "group_name": GROUP_NAME, "backend": backend,
            }  # fmt: skip
            return target.calls.post(engine.url, "init_weights_update_group", body)

        joins = [pool.submit(join, item) for item in zip(target.engines, offsets, strict=True)]
        try:
            self.group = wire.init_broadcast_group(
                target.group_address, target.group_port, 0, world, GROUP_NAME, backend, GROUP_TIMEOUT_S
            )
        finally:
            for call in joins:
                call.result()  # an engine's refusal names itself, rather than a rendezvous timeout

    def _broadcast(self, pool: ThreadPoolExecutor, bucket: NamedTensors) -> None:
        target = self.target
        if self.group is None:
            self._open(pool)
        bucket = wire.aligned(bucket)
        body = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": GROUP_NAME, "load_format": "flattened_bucket", "flush_cache": False,
            "weight_version": target.version,
        }  # fmt: skip
        receiving = [
            pool.submit(target.calls.post, e.url, "update_weights_from_distributed", body)
            for e in target.engines
        ]
        buffer = wire.pack_for_broadcast([t for _, t in bucket], target.device)
        dist.broadcast(buffer, group=self.group, group_src=0)
        for call in receiving:
            call.result()

    def send(self, pool: ThreadPoolExecutor, bucket: NamedTensors) -> None:
        if self.target.rank == 0:
            self._broadcast(pool, bucket)
            return
        header = [(n, t.dtype, tuple(t.shape)) for n, t in bucket]
        dist.send_object_list([header], dst=0)
        for _, tensor in bucket:
            dist.send(tensor.detach().contiguous(), dst=0)

    def finish(self, pool: ThreadPoolExecutor) -> None:
        if self.target.rank != 0:
            dist.send_object_list([None], dst=0)  # this rank has nothing more
            return
        for source in range(1, self.target.world_size):
            while (bucket := _receive_bucket(source, self.target.device)) is not None:
                self._broadcast(pool, bucket)
        if self.group is not None:
            body = {"group_name": GROUP_NAME}
            self.target.calls.each(
                pool, self.target.engines,
                lambda e: self.target.calls.post(e.url, "destroy_weights_update_group", body),
            )  # fmt: skip
            dist.destroy_process_group(self.group)
            self.group = None


def _receive_bucket(source: int, device: torch.device) -> NamedTensors | None:
    header: list[Any] = [None]
    dist.recv_object_list(header, src=source)
    if header[0] is None:
        return None
    bucket = [(name, torch.empty(shape, dtype=dtype, device=device)) for name, dtype, shape in header[0]]
    for _, tensor in bucket:
        dist.recv(tensor, src=source)
    return bucket


@register
class DiskTransport(WeightTransport):
    """Safetensors shards + index in a directory every engine can read; older versions pruned."""

    name = "disk"
    session = False  # SGLang's disk loader restores and post-processes the weights itself

    def __init__(self, target: SyncTarget) -> None:
        from slimrl.megatron_bridge.hf_io import ShardWriter

        super().__init__(target)
        if target.directory is None:
            raise SlimError("rollout.weight_sync=disk needs a directory shared by the trainer and engines")
        self.writer = ShardWriter(target.directory, rank=target.rank, max_shard_bytes=1 << 30)

    def send(self, pool: ThreadPoolExecutor, bucket: NamedTensors) -> None:
        for name, tensor in bucket:
            self.writer.add(name, tensor)

    def finish(self, pool: ThreadPoolExecutor) -> None:
        from slimrl.megatron_bridge.hf_io import finalize_index

        self.writer.flush()
        gathered: list[Any] = [None] * self.target.world_size
        dist.all_gather_object(gathered, (self.writer.files, self.writer.bytes_written))
        if self.target.rank != 0:
            return
        directory = self.target.directory
        assert directory is not None
        finalize_index(directory, [f for part in gathered for f in part[0]], sum(p[1] for p in gathered))
        body = {"model_path": str(directory), "weight_version": self.target.version, "flush_cache": False}
        calls = self.target.calls
        calls.each(pool, self.target.engines, lambda e: calls.post(e.url, "update_weights_from_disk", body))
        prune_versions(directory)


def prune_versions(current: Path) -> list[Path]:
    """Delete the older version directories (`v<N>`) beside `current`: the engines now read
    `current`, and at 235B each version is ~470 GB."""
    removed = []
    for sibling in current.parent.glob("v*"):
        if sibling != current and sibling.is_dir() and sibling.name[1:].isdigit():
            shutil.rmtree(sibling, ignore_errors=True)
            removed.append(sibling)
    return removed
