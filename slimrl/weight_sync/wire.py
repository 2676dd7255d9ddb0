"""SGLang 0.5.23's weight-update wire formats, built without importing SGLang.

Importing `sglang` takes ~5 s and patches transformers process-wide, so trainer processes build
the payloads from torch and the standard library alone, in exactly the shapes SGLang's own
decoders accept (tests decode them with SGLang's code and load them into a real server):

- `/update_weights_from_tensor`, `load_format: "flattened_bucket"`: one entry per engine TP rank
  in `serialized_named_tensors`, each a base64 `ForkingPickler` pickle (SGLang's
  `MultiprocessingSerializer`) of `{"flattened_tensor": uint8 buffer, "metadata": [...]}`. The
  metadata entries are `types.SimpleNamespace`s with the fields of SGLang's
  `FlattenedTensorMetadata` (SGLang reads them by attribute; both are on its unpickler's
  allow-list). Tensors travel as torch's own reductions: CUDA IPC handles on GPUs, and on CPU
  torch's `file_system` shared memory (the `file_descriptor` strategy needs a shared authkey).
- `/update_weights_from_distributed`: a process group built like SGLang's
  `init_custom_process_group` (TCP rendezvous, `PrefixStore(group_name)`, then torch's own group
  prefixes), so the two sides meet; buffers laid out like SGLang's `FlattenedTensorBucket`.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import io
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
import torch.multiprocessing.reductions

from slimrl.utils.net import bound_tcp_store
from slimrl.utils.tensors import NamedTensors


def aligned(named: Sequence[tuple[str, torch.Tensor]]) -> NamedTensors:
    """Widest dtypes first: packed back to back, every tensor then starts at a multiple of its
    element size, which SGLang needs to view the bytes as the tensor (and its receive buffer
    for a broadcast refuses otherwise)."""
    return sorted(named, key=lambda item: -item[1].element_size())


def flattened_bucket(
    named: Sequence[tuple[str, torch.Tensor]], shared: bool = False, out: torch.Tensor | None = None
) -> dict[str, Any]:
    """SGLang's `FlattenedTensorBucket` fields: tensors back to back as bytes, and their metadata.

    `shared` packs straight into a new CPU shared-memory segment (see `shared_uint8`), so pickling
    it costs no second copy of the bytes; `out` (uint8, `packed_nbytes(named)` long) packs into a
    buffer the caller keeps, e.g. a reused segment from `SharedSegment`.
    """
    flats, metadata, offset = [], [], 0
    for name, tensor in named:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(
            SimpleNamespace(
                name=name, shape=torch.Size(tensor.shape), dtype=tensor.dtype,
                start_idx=offset, end_idx=offset + flat.numel(), numel=flat.numel(),
            )
        )  # fmt: skip
        flats.append(flat)
        offset += flat.numel()
    if out is not None:
        buffer = torch.cat(flats, out=out) if flats else out
    elif shared and offset:
        buffer = torch.cat(flats, out=shared_uint8(offset))
    else:
        buffer = torch.cat(flats) if flats else torch.empty(0, dtype=torch.uint8)
    return {"flattened_tensor": buffer, "metadata": metadata}


def bucket_metadata(named: Sequence[tuple[str, torch.Tensor]]) -> list[SimpleNamespace]:
    """The metadata `flattened_bucket` writes for `named`, from shapes and dtypes alone (meta
    tensors will do): ranks that receive a bucket build it without its bytes."""
    metadata, offset = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        metadata.append(
            SimpleNamespace(
                name=name, shape=torch.Size(tensor.shape), dtype=tensor.dtype,
                start_idx=offset, end_idx=offset + nbytes, numel=nbytes,
            )
        )  # fmt: skip
        offset += nbytes
    return metadata


def packed_nbytes(named: Sequence[tuple[str, torch.Tensor]]) -> int:
    return sum(tensor.numel() * tensor.element_size() for _, tensor in named)


# --------------------------------------------------------------------------- CPU shared memory

_SHM_LOCK = threading.Lock()
_shm_manager_started = False


def _start_shm_manager_detached() -> None:
    """Start torch's `torch_shm_manager` with our stdin/stderr pointed at /dev/null.

    The manager is forked on the first `file_system` share and lives until the last process that
    mapped one of its segments exits, i.e. as long as the engines. Forked plainly it would inherit
    our stderr and keep a parent's pipe open (a test or launcher reading our output would hang).
    """
    global _shm_manager_started
    with _SHM_LOCK:
        if _shm_manager_started:
            return
        saved = [os.dup(0), os.dup(2)]
        null = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(null, 0)
            os.dup2(null, 2)
            with file_system_sharing():
                torch.zeros(1).share_memory_()  # forks the manager now, with quiet fds
        finally:
            os.dup2(saved[0], 0)
            os.dup2(saved[1], 2)
            for fd in (*saved, null):
                os.close(fd)
        _shm_manager_started = True


def shared_uint8(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor whose storage is a `file_system` shared-memory segment
    from birth. Pickling a storage that is not shared yet (`_share_filename_cpu_`) copies it into
    a new segment first: at 0.5 GB that second copy took as long as packing the bucket itself.
    A storage born shared is pickled as its existing handle, so the bucket is copied once."""
    _start_shm_manager_detached()
    with file_system_sharing():
        storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class SharedSegment:
    """One shared-memory segment a process packs every CPU tensor-update bucket into, in turn.

    A fresh segment per bucket costs a page fault per 4 KiB on first touch (measured: packing
    0.5 GB into a new segment took 3-4x a plain copy, the most of a push into real SGLang). Reused,
    its pages stay resident, in the engines too, which map the same segment each time. Costs one
    bucket of shared memory per sending process for its life. `borrow` is exclusive: a second
    borrower while one holds it (never the case in a sync, which sends one bucket at a time) gets
    a fresh segment rather than waiting or sharing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._storage: torch.UntypedStorage | None = None

    @contextlib.contextmanager
    def borrow(self, nbytes: int) -> Iterator[torch.Tensor]:
        if not self._lock.acquire(blocking=False):
            yield shared_uint8(nbytes)
            return
        try:
            if self._storage is None or self._storage.nbytes() < nbytes:
                self._storage = None  # unlink the smaller one before mapping the larger
                self._storage = shared_uint8(nbytes).untyped_storage()
            yield torch.empty(0, dtype=torch.uint8).set_(self._storage, 0, (nbytes,))
        finally:
            self._lock.release()


SHARED_SEGMENT = SharedSegment()


_STRATEGY_LOCK = threading.RLock()


@contextlib.contextmanager
def file_system_sharing() -> Iterator[None]:
    """torch's `file_system` CPU sharing strategy for the duration. The strategy is process-global
    and a sync pickles one body per engine from a thread pool: unlocked, one thread's restore
    could land inside another's pickle, which then carries a file descriptor that only a process
    with our multiprocessing authkey may fetch (SGLang's scheduler dies on it)."""
    with _STRATEGY_LOCK:
        previous = torch_mp.get_sharing_strategy()
        torch_mp.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            torch_mp.set_sharing_strategy(previous)


# Position of the storage's device in the arguments of torch's `rebuild_cuda_tensor` (SGLang 0.5.23
# `patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX`; tests/test_weight_wire.py checks both).
CUDA_DEVICE_ARG = 6


def cuda_reduction_by_uuid(reduced: tuple[Any, tuple[Any, ...]], uuid_of: Any) -> tuple[Any, tuple[Any, ...]]:
    """torch's reduction of a CUDA tensor with the device ordinal replaced by the GPU's UUID, as
    SGLang's own `_reduce_tensor_modified` sends it. Under Ray every trainer rank sees its one GPU
    as `cuda:0`; an engine rank sees the whole node, so an ordinal would map every bucket onto the
    node's first GPU. SGLang's scheduler rebuilds with `_rebuild_cuda_tensor_modified`, which finds
    the local ordinal of the UUID."""
    rebuild, args = reduced
    return rebuild, (*args[:CUDA_DEVICE_ARG], uuid_of(args[CUDA_DEVICE_ARG]), *args[CUDA_DEVICE_ARG + 1 :])


def _gpu_uuid(ordinal: int) -> str:
    return str(torch.cuda.get_device_properties(ordinal).uuid)


class _UuidPickler(ForkingPickler):
    """ForkingPickler whose CUDA tensors carry their GPU's UUID (its CPU tensors: torch's own)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            return cuda_reduction_by_uuid(torch.multiprocessing.reductions.reduce_tensor(obj), _gpu_uuid)
        return NotImplemented


def serialize(obj: Any) -> str:
    """`MultiprocessingSerializer.serialize(obj, output_str=True)` as SGLang's scheduler decodes it:
    base64 of a ForkingPickler pickle, CUDA tensors by GPU UUID (SGLang's patched reductions)."""
    buf = io.BytesIO()
    if _has_cpu_tensor(obj):
        _start_shm_manager_detached()
        with file_system_sharing():
            ForkingPickler(buf).dump(obj)
    else:
        _UuidPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _has_cpu_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return not obj.is_cuda
    if isinstance(obj, dict):
        return any(_has_cpu_tensor(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has_cpu_tensor(v) for v in obj)
    return False


@dataclass(frozen=True, slots=True)
class TensorUpdate:
    """One packed bucket for `/update_weights_from_tensor`, and the bodies that point to it.

    Keep it alive until every engine has answered: the shared segment is freed with the last
    reference, and an engine that maps it after that fails inside SGLang's scheduler (fatal).
    On CPU `buffer` is itself the shared segment the engines map (packed there directly, see
    `shared_uint8`); on GPUs it is the CUDA buffer whose IPC handles the bodies carry.
    """

    bucket: dict[str, Any]
    version: str

    @property
    def buffer(self) -> torch.Tensor:
        return self.bucket["flattened_tensor"]

    def body(self, tp_size: int) -> dict[str, Any]:
        """The request for one engine with `tp_size` ranks.

        Every TP rank reads its own entry (SGLang: `serialized_named_tensors[tp_rank]`) and loads
        the full HF tensors through its weight loaders, which take the rank's shard. Each entry is
        its own pickle, also on CPU: torch counts one reference to the shared segment per pickle
        and the rank that maps it gives that reference back, so the segment is unlinked exactly
        when the last rank is done (one pickle read by several ranks leaks or frees it early).
        """
        return {
            "serialized_named_tensors": [serialize(self.bucket) for _ in range(tp_size)],
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "weight_version": self.version,
        }


def tensor_update(
    named: Sequence[tuple[str, torch.Tensor]], version: str, out: torch.Tensor | None = None
) -> TensorUpdate:
    """Pack one bucket once for every engine: on CPU straight into shared memory (`out` if given,
    `packed_nbytes(named)` bytes of a segment the caller keeps alive, else a new segment)."""
    on_cpu = not any(tensor.is_cuda for _, tensor in named)
    return TensorUpdate(flattened_bucket(aligned(named), shared=on_cpu, out=out if on_cpu else None), version)


# --------------------------------------------------------------------------- broadcast group


def init_broadcast_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
) -> Any:
    """Join the group an engine builds in `/init_weights_update_group` (same store-key chain as
    SGLang's `init_custom_process_group`); rank 0 hosts the TCP store. Returns the process group.

    The whole join is bounded by `timeout_s`, and rank 0's store listens on `master_address`
    only (torch's own rendezvous listens on every interface, and a client retries its connect
    for up to twice its timeout)."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    deadline = time.monotonic() + timeout_s
    store = _group_store(master_address, master_port, rank, world_size, deadline)
    store.set_timeout(_remaining(deadline))
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), dist.PrefixStore(group_name, store),
        group_name=group_name, backend_options=None, timeout=_remaining(deadline),
    )  # fmt: skip
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _remaining(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.1))


def _group_store(address: str, port: int, rank: int, world_size: int, deadline: float) -> dist.TCPStore:
    if rank != 0:
        _wait_until_listening(address, port, deadline)
    return bound_tcp_store(address, port, world_size, rank == 0, _remaining(deadline))


def _wait_until_listening(address: str, port: int, deadline: float) -> None:
    """Connect attempts until the store answers or the deadline passes (torch's client alone
    retries for up to twice its timeout against an address nobody listens on)."""
    while True:
        try:
            socket.create_connection((address, port), timeout=max(deadline - time.monotonic(), 0.1)).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no weight-update group store at {address}:{port}: {exc}") from None
            time.sleep(0.2)


def pack_for_broadcast(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One uint8 buffer with the tensors back to back (SGLang's `FlattenedTensorBucket.empty`)."""
    return flattened_bucket([(str(i), t.to(device)) for i, t in enumerate(tensors)])["flattened_tensor"]
