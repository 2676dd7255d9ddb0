"""Trainer side of the weight sync: the bridge's streaming export, pushed to every engine.

Every HF tensor has exactly one owner rank (see `megatron_bridge/export.py`); owners push their
buckets, all other ranks only take part in the gathers. Three transports, one wire format each,
shared with SGLang:

- `tensor` (colocated on one host): buckets travel through shared memory (CUDA IPC on GPUs) to
  `/update_weights_from_tensor`.
- `distributed`: each owner opens a broadcast group with the engines (gloo on CPU, NCCL on GPU)
  via `/init_weights_update_group` and streams buckets with `/update_weights_from_distributed`.
- `disk` (universal fallback): owners write safetensors shards into a shared directory, rank 0
  writes the index and asks every engine to `/update_weights_from_disk`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests
import torch

from slimrl.errors import SlimError
from slimrl.megatron_bridge.export import NamedTensors, export_hf_buckets

if TYPE_CHECKING:
    from slimrl.trainer.actor import MegatronActor

REQUEST_TIMEOUT_S = 600.0


def _post(url: str, endpoint: str, payload: dict[str, Any], api_key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = requests.post(f"{url}/{endpoint}", json=payload, headers=headers, timeout=REQUEST_TIMEOUT_S)
    body = response.json() if response.content else {}
    if response.status_code != 200 or body.get("success") is False:
        message = body.get("message") or body.get("error") or response.text[:200]
        raise SlimError(f"weight sync: /{endpoint} failed on {url}: {message}")
    return body


def _all_engines(pool: ThreadPoolExecutor, urls: list[str], call: Callable[[str], Any]) -> list[Any]:
    return list(pool.map(call, urls))


class _TensorTransport:
    def __init__(self, urls: list[str], version: str, api_key: str | None) -> None:
        self.urls, self.version, self.api_key = urls, version, api_key

    def send(self, pool: ThreadPoolExecutor, bucket: NamedTensors) -> None:
        from slimrl.rollout.embedded.tensor_transport import serialize_flattened_bucket

        payload, files = serialize_flattened_bucket(bucket)
        body = {
            "serialized_named_tensors": [payload],
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "weight_version": self.version,
        }
        try:
            _all_engines(
                pool, self.urls, lambda u: _post(u, "update_weights_from_tensor", body, self.api_key)
            )
        finally:
            files.release()  # the engines have copied the bytes out of shared memory

    def finish(self, pool: ThreadPoolExecutor) -> None:
        pass


class _DistributedTransport:
    """One broadcast group between global rank 0 and the engines (engine i is group rank 1 + i).

    Other owner ranks funnel their buckets to rank 0 over the trainer's own process group, one
    owner after another in rank order. Letting every owner open its own group looks simpler but
    deadlocks: two engines can each wait inside a different owner's broadcast.
    """

    def __init__(self, urls: list[str], version: str, api_key: str | None, rank: int) -> None:
        self.urls, self.version, self.api_key, self.rank = urls, version, api_key, rank
        self.name = "slimrl-weights"
        self.group: Any = None

    def _open(self, pool: ThreadPoolExecutor) -> None:
        from slimrl.orchestration.placement import free_port, node_address
        from slimrl.rollout.embedded.tensor_transport import init_weight_update_group

        if torch.cuda.is_available():
            raise SlimError(
                "rollout.weight_sync=distributed to SGLang over NCCL is not wired yet; "
                "use rollout.weight_sync=tensor (one node) or disk"
            )
        address, port = node_address(), free_port()
        world = 1 + len(self.urls)
        joins = [
            pool.submit(
                _post,
                url,
                "init_weights_update_group",
                {
                    "master_address": address,
                    "master_port": port,
                    "rank_offset": 1 + i,
                    "world_size": world,
                    "group_name": self.name,
                    "backend": "gloo",
                },
                self.api_key,
            )
            for i, url in enumerate(self.urls)
        ]
        self.group = init_weight_update_group(address, port, 0, world, self.name)
        for join in joins:
            join.result()

    def _broadcast(self, pool: ThreadPoolExecutor, names: list[str], tensors: list[torch.Tensor]) -> None:
        from slimrl.rollout.embedded.tensor_transport import pack_flat_buffer

        if self.group is None:
            self._open(pool)
        body = {
            "names": names,
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": self.name,
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "weight_version": self.version,
        }
        receiving = [
            pool.submit(_post, u, "update_weights_from_distributed", body, self.api_key) for u in self.urls
        ]
        self.group.broadcast(pack_flat_buffer(tensors), src=0)
        for call in receiving:
            call.result()

    def send(self, pool: ThreadPoolExecutor, bucket: NamedTensors) -> None:
        import torch.distributed as dist

        names, tensors = [n for n, _ in bucket], [t.detach().contiguous() for _, t in bucket]
        if self.rank == 0:
            self._broadcast(pool, names, tensors)
            return
        dist.send_object_list([(names, [t.dtype for t in tensors], [tuple(t.shape) for t in tensors])], dst=0)
        for tensor in tensors:
            dist.send(tensor, dst=0)

    def finish(self, pool: ThreadPoolExecutor) -> None:
        import torch.distributed as dist

        if self.rank != 0:
            dist.send_object_list([None], dst=0)  # this rank has nothing more
            return
        for source in range(1, dist.get_world_size()):
            while True:
                header: list[Any] = [None]
                dist.recv_object_list(header, src=source)
                if header[0] is None:
                    break
                names, dtypes, shapes = header[0]
                tensors = [
                    torch.empty(shape, dtype=dtype) for dtype, shape in zip(dtypes, shapes, strict=True)
                ]
                for tensor in tensors:
                    dist.recv(tensor, src=source)
                self._broadcast(pool, names, tensors)
        if self.group is not None:
            body = {"group_name": self.name}
            _all_engines(
                pool, self.urls, lambda u: _post(u, "destroy_weights_update_group", body, self.api_key)
            )
            self.group.destroy()


class _DiskTransport:
    def __init__(self, directory: Path, rank: int) -> None:
        from slimrl.megatron_bridge.hf_io import ShardWriter

        self.directory = directory
        self.writer = ShardWriter(directory, rank=rank, max_shard_bytes=1 << 30)

    def send(self, pool: ThreadPoolExecutor, bucket: NamedTensors) -> None:
        for name, tensor in bucket:
            self.writer.add(name, tensor)

    def finish(self, pool: ThreadPoolExecutor) -> None:
        self.writer.flush()


def push_weights(
    actor: MegatronActor,
    urls: list[str],
    transport: str,
    version: str,
    bucket_bytes: int,
    sync_dir: str | None = None,
    api_key: str | None = None,
) -> dict[str, float]:
    """All training ranks call this together; returns bytes pushed by this rank and seconds."""
    import torch.distributed as dist

    assert actor.state is not None
    start = time.perf_counter()
    rank = dist.get_rank()
    if transport == "disk":
        if sync_dir is None:
            raise SlimError("weight sync over disk needs a directory shared by trainer and engines")
        directory = Path(sync_dir)
        if rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        sender: Any = _DiskTransport(directory, rank)
    elif transport == "tensor":
        sender = _TensorTransport(urls, version, api_key)
    elif transport == "distributed":
        sender = _DistributedTransport(urls, version, api_key, rank)
    else:
        raise SlimError(f"rollout.weight_sync={transport}: not one of tensor, distributed, disk")
    pushed = 0
    with ThreadPoolExecutor(max_workers=max(len(urls), 1) + 1) as pool:
        for bucket in export_hf_buckets(actor.state.model, actor.arch, actor.layout, bucket_bytes):
            sender.send(pool, bucket)
            pushed += sum(t.numel() * t.element_size() for _, t in bucket)
        sender.finish(pool)
        if transport == "disk":
            _publish_disk_update(actor, sender, urls, version, api_key, pool)
    dist.barrier()
    return {"bytes": float(pushed), "seconds": time.perf_counter() - start}


def _publish_disk_update(
    actor: MegatronActor, sender: _DiskTransport, urls: list[str], version: str, api_key: str | None, pool
) -> None:
    import torch.distributed as dist

    from slimrl.megatron_bridge.hf_io import finalize_index

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (sender.writer.files, sender.writer.bytes_written))
    if dist.get_rank() == 0:
        files = [f for part in gathered for f in part[0]]
        finalize_index(sender.directory, files, sum(part[1] for part in gathered))
        body = {"model_path": str(sender.directory), "weight_version": version}
        _all_engines(pool, urls, lambda u: _post(u, "update_weights_from_disk", body, api_key))
