"""Megatron-Core distributed checkpoints (`torch_dist`) of model chunks, written atomically.

The sharded state dict carries global shapes and offsets, so a checkpoint saved under one parallel
layout loads under any other: resharding is Megatron's job. Next to Megatron's files we keep
`slimrl_model.json` (the HF config the weights belong to and the saving layout) so a later
conversion can refuse a mismatched `--hf-config-dir` instead of producing garbage.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from slimrl.megatron_bridge.checkpoint_meta import MODEL_META
from slimrl.megatron_bridge.naming import LocalTensor, local_layer, local_tensors
from slimrl.megatron_bridge.safetensors_index import BridgeError
from slimrl.megatron_bridge.torch_dist_files import ChunkFileReader, ChunkFileWriter, write_index
from slimrl.parallel_layout import ParallelLayout
from slimrl.utils.fs import replace_directory, temp_sibling

FILE_BYTES = 64 * 1024**2
LOAD_BYTES = 128 * 1024**2
# Megatron's torch_dist strategy still builds torch ShardedTensors; the warning is not ours to fix.
warnings.filterwarnings("ignore", message="Please use DTensor instead")


def _state_key(index: int, num_chunks: int) -> str:
    return "model" if num_chunks == 1 else f"model{index}"


def sharded_model_state(chunks: list[Any]) -> dict[str, Any]:
    modules = [getattr(c, "module", c) for c in chunks]
    return {_state_key(i, len(modules)): m.sharded_state_dict() for i, m in enumerate(modules)}


def shared_tmp_dir(final: Path) -> Path:
    """A temporary sibling of `final`, created by rank 0 and agreed on by every rank (what a killed
    earlier run left for the same `final` is removed first, see `utils.fs.clear_dead_writers`)."""
    import torch.distributed as dist

    name = [None]
    if dist.get_rank() == 0:
        name = [str(temp_sibling(final))]
    dist.broadcast_object_list(name, src=0)
    return Path(str(name[0]))


def publish(tmp: Path, final: Path, overwrite: bool) -> None:
    """Rank 0 renames the finished temporary directory into place (after a barrier)."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        try:
            replace_directory(tmp, final, overwrite=overwrite)
        except FileExistsError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise BridgeError(f"{final}: output exists; pass --force to replace it") from None
    dist.barrier()


def sync_save_strategy() -> Any:
    """Megatron's torch_dist format, written synchronously by torch's own DCP writer (the trainer's
    checkpoints and `--verify`).

    Megatron's default writer stages every tensor into worker processes through pipes (made for
    asynchronous GPU saves); on a host it copies the whole model twice and takes ~2x longer.
    """
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class SyncTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            planner = MCoreSavePlanner(
                dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
            )
            with fast_torch_save():
                dcp.save(
                    mcore_to_pyt_state_dict(state, False),
                    storage_writer=dcp.FileSystemWriter(
                        str(checkpoint_dir), thread_count=1, sync_files=False
                    ),
                    planner=planner,
                )

    return SyncTorchDistSave("torch_dist", 1)


def save_model(chunks: list[Any], out_dir: Path, hf_config: dict[str, Any], layout: ParallelLayout) -> None:
    """Write the chunks as one torch_dist checkpoint directly into `out_dir` (all ranks call)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded_model_state(chunks), str(out_dir), sharded_strategy=sync_save_strategy())
    if dist.get_rank() == 0:
        meta = {"hf_config": hf_config, "layout": asdict(layout)}
        (out_dir / MODEL_META).write_text(json.dumps(meta, indent=2, default=list) + "\n")


def _load_errors() -> tuple[type[BaseException], ...]:
    from torch.distributed.checkpoint.api import CheckpointException

    # Megatron raises many types; torch wraps a rank's error in a BaseException subclass.
    return (Exception, CheckpointException)


LOAD_ERRORS = _load_errors()


def _cause(exc: BaseException) -> str:
    """The first line of what actually failed, unwrapped from torch's CheckpointException."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))[0]
    if isinstance(exc, EOFError):
        return "a data file ends early (truncated .distcp file?)"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_model(chunks: list[Any], ckpt_dir: Path) -> None:
    """Load a torch_dist checkpoint (saved under any layout) into this rank's chunks."""
    from megatron.core import dist_checkpointing

    modules = [getattr(c, "module", c) for c in chunks]
    try:
        loaded = dist_checkpointing.load(sharded_model_state(chunks), str(ckpt_dir))
    except LOAD_ERRORS as exc:
        raise BridgeError(f"{ckpt_dir}: cannot load torch_dist checkpoint: {_cause(exc)}") from exc
    for i, module in enumerate(modules):
        module.load_state_dict(loaded[_state_key(i, len(modules))], strict=True)


# ------------------------------------------------------------------------------ streaming
def _storage_key(tensor: Any) -> int:
    return tensor.untyped_storage()._cdata


@contextmanager
def fast_torch_save() -> Iterator[None]:
    """torch.save without the zip CRC32 of every record: it halves the write speed, and torch.load
    never checks it (the files stay valid zip archives for torch; `unzip -t` would complain)."""
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


def _view_of_blocks(view: Any, owner: Any, blocks: list[Any]) -> Any:
    """The real tensor behind `view` (a meta view of `owner`), given owner's data as row blocks.

    A view that is exactly one block is that block itself: the writer then saves it without the
    defensive copy it makes of views into a larger storage."""
    offset = view.storage_offset() - owner.storage_offset()
    if len(blocks) > 1 and view.is_contiguous():
        start = 0
        for block in blocks:
            if start == offset and block.numel() == view.numel():
                return block.view(view.shape)
            start += block.numel()
    import torch

    real = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return real.as_strided(view.size(), view.stride(), real.storage_offset() + offset)


def _all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    if dist.get_world_size() == 1:  # the pickling round trip alone costs ~0.1 s per call
        return [obj]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def _chunk_shape(entry: Any) -> tuple[int, ...]:
    """A sharded tensor's local shape as stored: one leading 1 per axis Megatron prepends."""
    return (1,) * entry.prepend_axis_num + tuple(entry.data.shape)


def _assign_writers(items: list[Any]) -> list[bool]:
    """Whether this rank writes each item. A shard held by several ranks (data-parallel replicas)
    is written by one of them, chosen so every rank writes about the same bytes, as Megatron's
    fully-parallel save does; every rank computes the same answer from the gathered lists."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    def ident(item: Any) -> tuple:
        return (item.unique_key,) if isinstance(item, ShardedObject) else (item.key, *item.global_offset)

    def nbytes(item: Any) -> int:
        return 0 if isinstance(item, ShardedObject) else item.data.numel() * item.data.element_size()

    mine = [(ident(item), nbytes(item)) for item in items]
    everyone = _all_gather(mine)
    holders: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    for rank, listing in enumerate(everyone):
        for key, size in listing:
            holders.setdefault(key, []).append(rank)
            sizes[key] = size
    load = [0] * len(everyone)
    writer: dict[tuple, int] = {}
    for key in sorted(holders, key=lambda k: (-sizes[k], k)):
        writer[key] = min(holders[key], key=lambda r: (load[r], r))
        load[writer[key]] += sizes[key]
    rank = dist.get_rank()
    return [writer[key] == rank for key, _ in mine]


def save_model_streaming(
    meta_chunks: list[Any],
    out_dir: Path,
    hf_config: dict[str, Any],
    layout: ParallelLayout,
    produce: Callable[[LocalTensor], list[Any]],
    expert_offset: int,
) -> None:
    """Save a checkpoint of a model that only exists on the meta device: each tensor is produced
    (`produce(local) -> this rank's shard as row blocks`) when the writer reaches it and dropped
    once written, so memory holds about one tensor instead of the model.

    Megatron's sharded state dict defines the keys, global shapes and offsets; the files are
    written by `torch_dist_files` (the same format, without DCP's per-tensor machinery)."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy

    owners = {
        _storage_key(lt.tensor): lt for chunk in meta_chunks for lt in local_tensors(chunk, expert_offset)
    }
    sharded, common = save_preprocess(sharded_model_state(meta_chunks), validate_access_integrity=False)
    items = list(nested_values(sharded))
    # The last tensors produced: a GLU weight is saved as two views of one produced tensor.
    recent: dict[int, list[Any]] = {}

    def real(view: Any) -> Any:
        key = _storage_key(view)
        if key not in recent:
            recent[key] = produce(owners[key])
            while len(recent) > 2:
                recent.pop(next(iter(recent)))
        return _view_of_blocks(view, owners[key].tensor, recent[key])

    writer = ChunkFileWriter(out_dir, dist.get_rank(), FILE_BYTES)
    error = None
    try:
        for item, write in zip(items, _assign_writers(items), strict=True):
            if not write:
                continue
            if isinstance(item, ShardedObject):
                writer.add_object(item.unique_key, [item.data])  # as Megatron stores objects
                continue
            if item.flattened_range is not None:
                raise BridgeError(f"`{item.key}`: flattened (optimizer-style) shards are not model weights")
            data = real(item.data) if item.data.is_meta else item.data
            chunk = data.reshape(_chunk_shape(item))
            writer.add_tensor(item.key, item.global_shape, item.global_offset, chunk)
    except BridgeError as exc:
        error = str(exc)
    finally:
        chunks = writer.close()
    # Every rank learns of any rank's failure (and raises it), instead of waiting for it forever.
    gathered = _all_gather((chunks, error))
    failures = [failure for _, failure in gathered if failure]
    if failures:
        raise BridgeError(failures[0])
    if dist.get_rank() == 0:
        write_index(out_dir, [chunk for part, _ in gathered for chunk in part])
        TorchCommonSaveStrategy("torch", 1).save_common(common, out_dir)
        save_config(CheckpointingConfig("torch_dist", 1), str(out_dir))
        meta = {"hf_config": hf_config, "layout": asdict(layout)}
        (out_dir / MODEL_META).write_text(json.dumps(meta, indent=2, default=list) + "\n")
    dist.barrier()


class LayerwiseCheckpointReader:
    """The tensors of a torch_dist checkpoint for model chunks that live on the meta device, read
    a few decoder layers at a time (`reader(chunk_index, local) -> this rank's shard`).

    Memory holds about `LOAD_BYTES` of layers plus the tensors outside the layers (embedding, final
    norm, output layer), never the model. Each group of layers is one DCP read of just its shards,
    planned from Megatron's sharded state dict, so a checkpoint saved under any layout still loads
    under this one."""

    def __init__(
        self, meta_chunks: list[Any], ckpt_dir: Path, wanted: Callable[[int, str], bool] | None = None
    ) -> None:
        """`wanted(chunk_index, local_name)`: whether this rank will ask for a tensor (default: all)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        self.ckpt_dir = Path(ckpt_dir)
        modules = [getattr(c, "module", c) for c in meta_chunks]
        self._sharded = [
            {
                name: entry
                for name, entry in m.sharded_state_dict().items()
                if isinstance(entry, ShardedTensor | ShardedTensorFactory)
                and (wanted is None or wanted(index, name))
            }
            for index, m in enumerate(modules)
        ]
        self._group: dict[tuple[int, int | None], tuple[int, int]] = {}  # (chunk, layer) -> group
        for index, sharded in enumerate(self._sharded):
            sizes: dict[int | None, int] = {}
            for name, entry in sharded.items():
                layer = local_layer(name)
                sizes[layer] = sizes.get(layer, 0) + entry.data.numel() * entry.data.element_size()
            group, filled = 0, 0
            for layer, nbytes in sizes.items():
                if layer is None:
                    self._group[(index, None)] = (index, -1)
                    continue
                if filled and filled + nbytes > LOAD_BYTES:
                    group, filled = group + 1, 0
                self._group[(index, layer)] = (index, group)
                filled += nbytes
        self._loaded: dict[tuple[int, int], dict[str, Any]] = {}
        self._files: Any = None

    def __call__(self, chunk_index: int, local: LocalTensor) -> Any:
        """This rank's shard of `local`: a tensor, or its row blocks when the checkpoint holds it
        in pieces (a GLU weight's two halves) that can be handed out without concatenating."""
        group = self._group[(chunk_index, local_layer(local.local_name))]
        if group not in self._loaded:
            # Keep the chunk's non-layer tensors (the output layer comes after the last layer).
            self._loaded = {g: v for g, v in self._loaded.items() if g == (chunk_index, -1)}
            self._loaded[group] = self._load(group)
        return self._loaded[group][local.local_name]

    def _load(self, group: tuple[int, int]) -> dict[str, Any]:
        """The group's tensors: views of the checkpoint's chunks where the saving layout cut them
        the same way (no copy at all), else buffers that the chunks are copied into.

        Factories (the GLU weight saved as two halves) are applied to views of one buffer, so the
        halves land where they belong instead of being concatenated after the load."""
        import dataclasses

        import torch
        from megatron.core.dist_checkpointing.mapping import apply_factories

        if self._files is None:
            self._files = ChunkFileReader(self.ckpt_dir)
        chunk_index = group[0]
        buffers: dict[str, Any] = {}
        wanted: dict[str, Any] = {}
        for name, entry in self._sharded[chunk_index].items():
            if self._group.get((chunk_index, local_layer(name))) != group:
                continue
            saved = self._saved_as_is(entry)
            if saved is not None:
                buffers[name] = saved
                continue
            buffers[name] = torch.empty_like(entry.data, device="cpu")
            wanted[name] = dataclasses.replace(entry, data=buffers[name])
        apply_factories(wanted)
        self._read_into(wanted)
        return buffers

    def _saved_as_is(self, entry: Any) -> Any:
        """The entry's values as zero-copy views of saved chunks (a tensor, or row blocks for a
        factory's parts), or None when the saved chunks are cut differently or typed differently."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        parts = [entry] if isinstance(entry, ShardedTensor) else list(nested_values(entry.build()))
        if not all(isinstance(p, ShardedTensor) and p.flattened_range is None for p in parts):
            return None
        parts.sort(key=lambda p: p.data.storage_offset())
        blocks, covered = [], 0
        for part in parts:
            if part.data.storage_offset() - entry.data.storage_offset() != covered:
                return None  # not consecutive rows of the local tensor
            if not part.data.is_contiguous():
                return None
            saved = self._files.exact(part.key, part.global_offset, _chunk_shape(part))
            if saved is None or saved.dtype != entry.data.dtype:
                return None
            blocks.append(saved.view(part.data.shape))
            covered += part.data.numel()
        if covered != entry.data.numel():
            return None
        return blocks[0].view(entry.data.shape) if len(blocks) == 1 else blocks

    def _read_into(self, sharded: dict[str, Any]) -> None:
        """This rank reads its shards in place, without collectives (ranks hold different layers
        and read different numbers of groups), then lets go of the files' pages."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values

        for entry in nested_values(sharded):
            if entry.flattened_range is not None:
                raise BridgeError(f"`{entry.key}`: flattened (optimizer-style) shards are not model weights")
            target = entry.data.view(_chunk_shape(entry))
            self._files.read_into(entry.key, entry.global_offset, target, entry.allow_shape_mismatch)
        self._files.release()
