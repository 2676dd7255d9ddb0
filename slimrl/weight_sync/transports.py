"""The `WeightTransport` seam: how exported tensors reach the engines. One class per transport,
registered by its config name (`rollout.weight_sync`).

The export runs in rounds (`megatron_bridge/export.py::ExportUnit`): in round k every rank gathers
its k-th unit (the embedding, a decoder layer, the head) with its tensor-parallel peers; then every
rank calls `exchange` with the HF tensors it owns of that unit (often none). `exchange` is a
collective over the trainer's world, entered in the same order on every rank, and nothing a rank
sends in it is still pending when the next round's gathers begin: on NCCL a pending send holds
every later operation on its rank's stream, so an owner that still owed a gather to rank 0 while
its send to rank 0 waited would deadlock both (`collectives.py` makes gloo as strict). `finish`
runs once after the last round. The caller (`trainer/weight_sync.py`) opens and closes the
engines' weight-update session around them.

Which rank talks to which engine rank comes from the device ledger (`slimrl/devices`), and every
group opened and reference sent is checked against it by the GPU's rules first.
"""

from __future__ import annotations

import contextlib
import shutil
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from slimrl.devices.ledger import Group, Ledger, Reference
from slimrl.devices.rules import check_group, check_reference
from slimrl.errors import SlimError
from slimrl.megatron_bridge.bucketing import Together, bucketed
from slimrl.megatron_bridge.hf_io import ShardWriter, finalize_index
from slimrl.utils.tensors import NamedTensors
from slimrl.weight_sync import collectives, wire
from slimrl.weight_sync.engines import EngineAddress, EngineCalls

Header = list[tuple[str, torch.dtype, tuple[int, ...]]]

GROUP_NAME = "slimrl_weight_update"
GROUP_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class SyncTarget:
    """What one weight sync needs to know, the same on every training rank."""

    engines: list[EngineAddress]
    calls: EngineCalls
    version: str
    rank: int
    world_size: int
    device: torch.device
    bucket_bytes: int = 1 << 30
    together: Together = ()
    directory: Path | None = None
    group_address: str = "127.0.0.1"
    group_port: int = 0
    ledger: Ledger | None = None
    """The run's device ledger; None for engines outside a run (tests, tools): rank 0 then serves
    every engine rank, which must be on its host."""


class WeightTransport(ABC):
    name: ClassVar[str]
    session: ClassVar[bool] = True
    """Whether updates must run inside `/begin_weight_update` ... `/end_weight_update`."""

    def __init__(self, target: SyncTarget) -> None:
        self.target = target

    @abstractmethod
    def exchange(self, pool: ThreadPoolExecutor, unit: NamedTensors) -> None:
        """Every rank, once per export round: the HF tensors this rank owns of its unit."""

    @abstractmethod
    def finish(self, pool: ThreadPoolExecutor) -> None:
        """Called once on every rank after the last round."""

    def buckets(self, header: Header) -> list[Header]:
        """A unit's buckets, cut from its header alone so that every rank cuts them alike: one
        bucket is one `load_weights` call of an engine (tensors it needs together stay together)."""
        metas = [(n, torch.empty(shape, dtype=dtype, device="meta")) for n, dtype, shape in header]
        cut = bucketed(metas, self.target.bucket_bytes, self.target.together)
        return [[(n, t.dtype, tuple(t.shape)) for n, t in wire.aligned(b)] for b in cut]


def header_of(unit: NamedTensors) -> Header:
    return [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in unit]


def _pick(unit: NamedTensors, bucket: Header) -> NamedTensors:
    """This owner's tensors of one bucket, in the bucket's (aligned) order."""
    by_name = dict(unit)
    return [(name, by_name[name]) for name, _, _ in bucket]


def _metas(bucket: Header) -> NamedTensors:
    return [(n, torch.empty(shape, dtype=dtype, device="meta")) for n, dtype, shape in bucket]


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
    """Tensors by reference: each engine rank maps the memory of the trainer rank on its own GPU
    (CUDA IPC by GPU UUID; shared memory on CPU), so it works on any number of nodes. Every bucket
    is broadcast from its owner to all ranks; the ranks of an engine's GPUs gather their references
    to the one on its first GPU, which posts them (SGLang reads entry t on TP rank t)."""

    name = "tensor"

    def __init__(self, target: SyncTarget) -> None:
        super().__init__(target)
        self.senders = [[self._sender(i, t) for t in range(e.tp_size)] for i, e in enumerate(target.engines)]
        """For each engine, the trainer rank whose memory each of its TP ranks maps."""
        kind = "cuda_ipc" if target.device.type == "cuda" else "shared_memory"
        if target.ledger is not None:
            for index, senders in enumerate(self.senders):
                for t, sender in enumerate(senders):
                    reference = Reference(f"trainer/{sender}", f"engine/{index}/tp{t}", kind)
                    check_reference(target.ledger, reference)
        self.groups = _engine_groups(self.senders) if target.world_size > 1 else {}

    def _sender(self, index: int, tp_rank: int) -> int:
        """The ledger's sender for engine `index`'s rank `tp_rank`; rank 0 without a ledger."""
        ledger = self.target.ledger
        if ledger is None:
            return 0
        receiver = f"engine/{index}/tp{tp_rank}"
        senders = [r.sender for r in ledger.references if r.receiver == receiver]
        if not senders:
            raise SlimError(f"rollout.weight_sync=tensor: the device ledger has no references for {receiver}")
        return int(senders[0].removeprefix("trainer/"))

    def exchange(self, pool: ThreadPoolExecutor, unit: NamedTensors) -> None:
        target = self.target
        headers = (
            [header_of(unit)] if target.world_size == 1 else collectives.all_gather_object(header_of(unit))
        )
        for owner, header in enumerate(headers):
            for bucket in self.buckets(header):
                self._share(pool, owner, bucket, unit if owner == target.rank else [])

    def _share(self, pool: ThreadPoolExecutor, owner: int, bucket: Header, unit: NamedTensors) -> None:
        target, nbytes = self.target, wire.packed_nbytes(_metas(bucket))
        with self._buffer(nbytes) as buffer:
            if target.rank == owner:
                wire.flattened_bucket(_pick(unit, bucket), out=buffer)
            if target.world_size > 1:
                collectives.broadcast(buffer, src=owner)
            metadata = wire.bucket_metadata(_metas(bucket))
            mine = [(i, t) for i, ss in enumerate(self.senders) for t, s in enumerate(ss) if s == target.rank]
            # one pickle per engine rank that maps the buffer: each gives its reference back
            payloads = {
                (i, t): wire.serialize({"flattened_tensor": buffer, "metadata": metadata}) for i, t in mine
            }
            posts = []
            for index, senders in enumerate(self.senders):
                entries = self._gather(index, senders, payloads)
                if entries is not None:
                    posts.append(pool.submit(self._post, index, entries))
            for post in posts:
                post.result()  # every engine has loaded the bucket: only now may the buffer change
            for index, group in self.groups.items():
                if target.rank in self.senders[index]:
                    with collectives.waiting_in("barrier", f"engine {index}'s senders"):
                        dist.barrier(group=group)

    def _buffer(self, nbytes: int) -> Any:
        if self.target.device.type == "cuda":  # CUDA IPC: a fresh buffer per bucket, freed after
            return _Owned(torch.empty(nbytes, dtype=torch.uint8, device=self.target.device))
        return wire.SHARED_SEGMENT.borrow(nbytes)

    def _gather(self, index: int, senders: list[int], payloads: dict) -> list[str] | None:
        """Engine `index`'s entries, one per TP rank, on its poster (the sender of its rank 0)."""
        rank = self.target.rank
        if index not in self.groups:  # one sender for every rank of this engine
            return [payloads[(index, t)] for t in range(len(senders))] if senders[0] == rank else None
        if rank not in senders:
            return None
        group, poster = self.groups[index], senders[0]
        mine = {t: payloads[(index, t)] for t, s in enumerate(senders) if s == rank}
        gathered: list[Any] | None = [None] * dist.get_world_size(group) if rank == poster else None
        with collectives.waiting_in("gather_object", f"engine {index}'s senders", root=poster):
            dist.gather_object(mine, gathered, dst=poster, group=group)
        if gathered is None:
            return None
        entries = {t: p for part in gathered for t, p in part.items()}
        return [entries[t] for t in range(len(senders))]

    def _post(self, index: int, entries: list[str]) -> None:
        target = self.target
        body = {
            "serialized_named_tensors": entries, "load_format": "flattened_bucket", "flush_cache": False,
            "weight_version": target.version,
        }  # fmt: skip
        target.calls.post(target.engines[index].url, "update_weights_from_tensor", body)

    def finish(self, pool: ThreadPoolExecutor) -> None:
        pass  # every bucket was loaded when its round ended


class _Owned:
    """A context that holds a buffer (what `SharedSegment.borrow` is for shared memory)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer

    def __enter__(self) -> torch.Tensor:
        return self.buffer

    def __exit__(self, *exc: object) -> None:
        del self.buffer


_GROUPS: dict[tuple[int, ...], Any] = {}


def _engine_groups(senders: list[list[int]]) -> dict[int, Any]:
    """A process group per engine served by several trainer ranks, made once per process (every
    rank creates every group, in engine order, as torch requires) and kept across syncs."""
    groups = {}
    for index, ranks in enumerate(senders):
        members = tuple(sorted(set(ranks)))
        if len(members) < 2:
            continue
        if members not in _GROUPS:
            _GROUPS[members] = dist.new_group(list(members))
        groups[index] = _GROUPS[members]
    return groups


@dataclass
class _OpenGroup:
    key: tuple[str, ...]
    group: Any


_BROADCAST_GROUP: list[_OpenGroup] = []
"""Trainer rank 0's weight-update group, kept across syncs while the engines stay the same."""


@register
class DistributedTransport(WeightTransport):
    """A broadcast group between trainer rank 0 and every engine GPU (NCCL on GPU, gloo on CPU),
    which the device ledger requires to have one device per member (not so when colocated).

    Group ranks as SGLang computes them: the trainer is rank 0, engine i's TP rank t is
    `rank_offset_i + t` with offsets counting the GPUs of the engines before it. Every round, the
    owners' buckets go to rank 0 (rendezvous sends, in rank order) and rank 0 broadcasts each to
    the engines; one group for all keeps two engines from waiting in different owners'
    broadcasts. The group is opened at the first sync and kept while the engines stay the same.
    """

    name = "distributed"

    def __init__(self, target: SyncTarget) -> None:
        super().__init__(target)
        if target.ledger is not None:  # on every rank, before anything opens
            backend = "nccl" if target.device.type == "cuda" else "gloo"
            ranks = [f"engine/{i}/tp{t}" for i, e in enumerate(target.engines) for t in range(e.tp_size)]
            check_group(target.ledger, Group("weight_sync", backend, ("trainer/0", *ranks)))

    def _group(self, pool: ThreadPoolExecutor) -> Any:
        target = self.target
        key = tuple(e.url for e in target.engines)
        if _BROADCAST_GROUP and _BROADCAST_GROUP[0].key == key:
            return _BROADCAST_GROUP[0].group
        if _BROADCAST_GROUP:  # engines changed (one restarted): the old group is gone with it
            self._close(pool, _BROADCAST_GROUP.pop())
        offsets, world = [], 1
        for engine in target.engines:
            offsets.append(world)
            world += engine.tp_size
        backend = "nccl" if target.device.type == "cuda" else "gloo"

        def join(item: tuple[EngineAddress, int]) -> Any:
            engine, offset = item
            body = {
                "master_address": target.group_address, "master_port": target.group_port,
                "rank_offset": offset, "world_size": world, "group_name": GROUP_NAME, "backend": backend,
            }  # fmt: skip
            return target.calls.post(engine.url, "init_weights_update_group", body)

        joins = [pool.submit(join, item) for item in zip(target.engines, offsets, strict=True)]
        try:
            with collectives.waiting_in("init_process_group", "weight_sync"):
                group = wire.init_broadcast_group(
                    target.group_address, target.group_port, 0, world, GROUP_NAME, backend, GROUP_TIMEOUT_S
                )
        finally:
            for call in joins:
                call.result()  # an engine's refusal names itself, rather than a rendezvous timeout
        _BROADCAST_GROUP.append(_OpenGroup(key, group))
        return group

    def _close(self, pool: ThreadPoolExecutor, opened: _OpenGroup) -> None:
        body = {"group_name": GROUP_NAME}
        calls = self.target.calls

        def destroy(url: str) -> None:
            with contextlib.suppress(SlimError):  # that engine died, and its group with it
                calls.post(url, "destroy_weights_update_group", body)

        list(pool.map(destroy, [u for u in opened.key if u in {e.url for e in self.target.engines}]))
        dist.destroy_process_group(opened.group)

    def _broadcast(self, pool: ThreadPoolExecutor, bucket: Header, buffer: torch.Tensor) -> None:
        target = self.target
        group = self._group(pool)
        body = {
            "names": [n for n, _, _ in bucket],
            "dtypes": [str(dtype).removeprefix("torch.") for _, dtype, _ in bucket],
            "shapes": [list(shape) for _, _, shape in bucket],
            "group_name": GROUP_NAME, "load_format": "flattened_bucket", "flush_cache": False,
            "weight_version": target.version,
        }  # fmt: skip
        receiving = [
            pool.submit(target.calls.post, e.url, "update_weights_from_distributed", body)
            for e in target.engines
        ]
        with collectives.waiting_in("broadcast", "weight_sync", root=0):
            dist.broadcast(buffer, group=group, group_src=0)
        for call in receiving:
            call.result()

    def exchange(self, pool: ThreadPoolExecutor, unit: NamedTensors) -> None:
        target = self.target
        header = header_of(unit)
        headers = [header] if target.world_size == 1 else collectives.gather_object(header, dst=0)
        if target.rank != 0:
            for bucket in self.buckets(header):
                collectives.send(self._pack(unit, bucket), dst=0)
            return
        assert headers is not None
        for owner, owner_header in enumerate(headers):
            for bucket in self.buckets(owner_header):
                if owner == 0:
                    buffer = self._pack(unit, bucket)
                else:
                    buffer = torch.empty(
                        wire.packed_nbytes(_metas(bucket)), dtype=torch.uint8, device=target.device
                    )
                    collectives.recv(buffer, src=owner)
                self._broadcast(pool, bucket, buffer)

    def _pack(self, unit: NamedTensors, bucket: Header) -> torch.Tensor:
        named = [(n, t.to(self.target.device)) for n, t in _pick(unit, bucket)]
        return wire.flattened_bucket(named)["flattened_tensor"]

    def finish(self, pool: ThreadPoolExecutor) -> None:
        pass  # the group stays open for the next sync


def close_weight_sync_group(calls: EngineCalls, urls: list[str]) -> None:
    """Rank 0: destroy the kept broadcast group on both sides (tests; a run's engines go with it)."""
    if _BROADCAST_GROUP:
        opened = _BROADCAST_GROUP.pop()
        for url in urls:
            with contextlib.suppress(SlimError):
                calls.post(url, "destroy_weights_update_group", {"group_name": GROUP_NAME})
        dist.destroy_process_group(opened.group)


@register
class DiskTransport(WeightTransport):
    """Safetensors shards + index in a directory every engine can read; older versions pruned."""

    name = "disk"
    session = False  # SGLang's disk loader restores and post-processes the weights itself

    def __init__(self, target: SyncTarget) -> None:

        super().__init__(target)
        if target.directory is None:
            raise SlimError("rollout.weight_sync=disk needs a directory shared by the trainer and engines")
        self.writer = ShardWriter(target.directory, rank=target.rank, max_shard_bytes=1 << 30)

    def exchange(self, pool: ThreadPoolExecutor, unit: NamedTensors) -> None:
        for name, tensor in unit:  # nothing crosses ranks until `finish`
            self.writer.add(name, tensor)

    def finish(self, pool: ThreadPoolExecutor) -> None:

        self.writer.flush()
        gathered = collectives.all_gather_object((self.writer.files, self.writer.bytes_written))
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
