"""`checkpoint.save_hf`: each checkpoint also holds the policy as a Hugging Face checkpoint in its
`hf/` subdirectory (safetensors shards with an index, `config.json` with `model.overrides` applied,
the tokenizer and other side files of `model.hf_checkpoint`), loadable by transformers or SGLang
without `slimrl convert`. The same streaming export as the weight sync (`megatron_bridge/export.py`):
every HF tensor has one owner rank, which writes it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from slimrl.megatron_bridge.export import export_hf_buckets
from slimrl.megatron_bridge.hf_io import ShardWriter, finalize_index

if TYPE_CHECKING:
    from slimrl.trainer.actor import MegatronActor

HF_DIR = "hf"
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")


def save_hf(actor: MegatronActor, out_dir: Path, max_shard_bytes: int = 2 * 1024**3) -> None:
    """All ranks together: write the policy's current weights to `out_dir` as an HF checkpoint."""
    assert actor.state is not None
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    writer = ShardWriter(out_dir, rank=rank, max_shard_bytes=max_shard_bytes)
    bucket_bytes = actor.config.rollout.update_weight_buffer_bytes
    for bucket in export_hf_buckets(actor.state.model, actor.arch, actor.layout, bucket_bytes):
        for name, tensor in bucket:
            writer.add(name, tensor)
    writer.flush()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (writer.files, writer.bytes_written))
    if rank == 0:
        finalize_index(out_dir, [f for part in gathered for f in part[0]], sum(p[1] for p in gathered))
        copy_side_files(Path(actor.config.model.hf_checkpoint), out_dir, actor.config.model.overrides)
    dist.barrier()


def copy_side_files(source: Path, out_dir: Path, overrides: dict[str, Any]) -> None:
    """Everything of the source checkpoint but its weights (tokenizer, generation config, chat
    template, ...), and its config.json with the `model.overrides` the policy was built with."""
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, out_dir / path.name)
    if overrides:
        config = json.loads((source / "config.json").read_text())
        config.update(overrides)
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
