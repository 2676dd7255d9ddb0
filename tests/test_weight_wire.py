"""Our weight-update payloads, decoded by SGLang 0.5.23's own code (the referee), in-process."""

from __future__ import annotations

import base64
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from slimrl.weight_sync import wire


def test_sglang_deserializer_accepts_our_tensor_payload_on_every_tp_rank() -> None:
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    named = [
        ("model.embed_tokens.weight", torch.randn(7, 5)),
        ("model.norm.weight", torch.randn(5, dtype=torch.bfloat16)),
        ("lm_head.weight", torch.randn(7, 5, dtype=torch.float64)),
    ]
    update = wire.tensor_update(named, "v3")
    body = update.body(4)
    entries = body["serialized_named_tensors"]
    assert len(entries) == 4 and body["load_format"] == "flattened_bucket"
    for entry in entries:  # what each TP rank's `deserialize_own_rank` does
        data = MultiprocessingSerializer.deserialize(entry)
        # ... and what `_update_weights_from_flattened_bucket` then does with it
        metadata = [
            FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel)
            for m in data["metadata"]
        ]
        rebuilt = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=metadata)
        got = rebuilt.reconstruct_tensors()
        assert [n for n, _ in got] == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
        for (_, a), (_, b) in zip(got, wire.aligned(named), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_broadcast_buffer_matches_sglang_receive_layout() -> None:
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    named = wire.aligned(
        [("a", torch.randn(3, dtype=torch.bfloat16)), ("b", torch.randn(2, 3)), ("c", torch.arange(5))]
    )
    buffer = wire.pack_for_broadcast([t for _, t in named], torch.device("cpu"))
    receive = FlattenedTensorBucket.empty(
        [n for n, _ in named], [str(t.dtype).removeprefix("torch.") for _, t in named],
        [list(t.shape) for _, t in named], "cpu",
    )  # fmt: skip
    assert receive.get_flattened_tensor().numel() == buffer.numel()
    receive.get_flattened_tensor().copy_(buffer)  # what the broadcast does
    for (name, got), (want_name, want) in zip(receive.reconstruct_tensors(), named, strict=True):
        assert name == want_name and torch.equal(got, want)


def test_reused_segment_carries_each_bucket_to_sglang_and_is_exclusive() -> None:
    """Buckets packed in turn into one reused segment each decode, by SGLang's deserializer, to
    their own bytes (not a later bucket's), while a second borrower gets a segment of its own."""
    from sglang.srt.utils.common import MultiprocessingSerializer

    segment = wire.SharedSegment()
    pointers = []
    for value in (1.0, 2.0):
        named = [("a", torch.full((64,), value)), ("b", torch.full((8,), value, dtype=torch.bfloat16))]
        with segment.borrow(wire.packed_nbytes(named)) as out:
            body = wire.tensor_update(named, "v", out=out).body(1)
            data = MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][0])
            assert torch.equal(data["flattened_tensor"], out)
            assert data["flattened_tensor"][:256].view(torch.float32).eq(value).all()
            pointers.append(out.data_ptr())
            with segment.borrow(16) as other:
                assert other.data_ptr() != out.data_ptr()
    assert pointers[0] == pointers[1]


def test_concurrent_bodies_all_carry_file_system_handles() -> None:
    """A sync posts one body per engine from a thread pool. torch's sharing strategy is
    process-global: every pickle must still name a `file_system` segment, never a file descriptor
    (an engine can only fetch one of those with the sender's multiprocessing authkey, and SGLang's
    scheduler dies on "digest sent was rejected")."""
    named = [("a", torch.randn(256))]
    update = wire.tensor_update(named, "v")
    threads, rounds = 8, 40
    # each round starts from a fresh process's default strategy, all threads at once
    barrier = threading.Barrier(
        threads, action=lambda: torch.multiprocessing.set_sharing_strategy("file_descriptor"), timeout=60
    )

    def bodies(_: int) -> list[bytes]:
        out = []
        for _ in range(rounds):
            barrier.wait()
            out.append(base64.b64decode(update.body(1)["serialized_named_tensors"][0]))
        return out

    previous, interval = torch.multiprocessing.get_sharing_strategy(), sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads interleave as they would on a loaded machine
    try:
        with ThreadPoolExecutor(threads) as pool:
            payloads = [p for batch in pool.map(bodies, range(threads)) for p in batch]
    finally:
        sys.setswitchinterval(interval)
        torch.multiprocessing.set_sharing_strategy(previous)
    assert len(payloads) == threads * rounds
    assert [p for p in payloads if b"rebuild_storage_filename" not in p] == []
    assert [p for p in payloads if b"rebuild_storage_fd" in p] == []


_SGLANG_RANK_1 = """
import datetime, sys
import torch
from sglang.srt.utils.common import init_custom_process_group
port = int(sys.argv[1])
group = init_custom_process_group(
    backend="gloo", init_method=f"tcp://127.0.0.1:{port}", timeout=datetime.timedelta(seconds=60),
    world_size=2, rank=1, group_name="slimrl-bind-test",
)
buffer = torch.zeros(3)
torch.distributed.broadcast(buffer, group=group, group_src=0)
print(buffer.tolist())
"""


def test_group_store_listens_only_on_the_given_address_and_meets_sglang() -> None:
    """SGLang's own `init_custom_process_group` (the referee) joins our rank-0 store, and while the
    group is up this process listens on no wildcard address (torch's rendezvous would)."""
    import subprocess
    import sys

    import psutil
    import torch.distributed as dist

    from slimrl.utils.net import free_port

    port = free_port()
    before = {c.laddr for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"}
    joiner = subprocess.Popen(
        [sys.executable, "-c", _SGLANG_RANK_1, str(port)], stdout=subprocess.PIPE, text=True
    )
    group = wire.init_broadcast_group("127.0.0.1", port, 0, 2, "slimrl-bind-test", "gloo", 60)
    listening = {c.laddr for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"} - before
    dist.broadcast(torch.tensor([1.0, 2.0, 3.0]), group=group, group_src=0)
    out, _ = joiner.communicate(timeout=60)
    dist.destroy_process_group(group)
    assert joiner.returncode == 0 and out.strip() == "[1.0, 2.0, 3.0]"
    assert ("127.0.0.1", port) in listening
    assert all(addr.ip not in ("0.0.0.0", "::") for addr in listening), listening


def test_joining_a_dead_address_gives_up_at_its_timeout() -> None:
    """torch's TCP client alone retries for about twice its timeout (6 s for 3 s, measured)."""
    import time

    import pytest

    from slimrl.utils.net import free_port

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no weight-update group store at 127\.0\.0\.1:\d+"):
        wire.init_broadcast_group("127.0.0.1", free_port(), 1, 2, "slimrl-dead", "gloo", 2.0)
    assert 2.0 <= time.monotonic() - start < 3.0


def test_cuda_payloads_name_the_gpu_by_uuid_where_sglang_reads_it() -> None:
    """Under Ray every trainer rank sees its GPU as cuda:0, an engine rank the whole node: the
    ordinal would map every bucket onto the node's first GPU. The device travels as its UUID, in the
    argument of torch's `rebuild_cuda_tensor` that SGLang's patched rebuild turns back into its own
    ordinal."""
    import inspect

    from sglang.srt.utils.patch_torch import _REDUCE_TENSOR_ARG_DEVICE_INDEX

    parameters = list(inspect.signature(torch.multiprocessing.reductions.rebuild_cuda_tensor).parameters)
    assert parameters[wire.CUDA_DEVICE_ARG] == "storage_device"
    assert wire.CUDA_DEVICE_ARG == _REDUCE_TENSOR_ARG_DEVICE_INDEX
    args = tuple(range(12))  # the shape of torch's reduction: (rebuild, args)
    rebuild, out = wire.cuda_reduction_by_uuid(("rebuild", args), lambda ordinal: f"GPU-uuid-of-{ordinal}")
    assert rebuild == "rebuild" and out[wire.CUDA_DEVICE_ARG] == "GPU-uuid-of-6"
    assert out[: wire.CUDA_DEVICE_ARG] == args[: wire.CUDA_DEVICE_ARG]
    assert out[wire.CUDA_DEVICE_ARG + 1 :] == args[wire.CUDA_DEVICE_ARG + 1 :]
