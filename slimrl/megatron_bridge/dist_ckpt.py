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
from dataclasses import asdict
from pathlib import Path
from typing import Any

from slimrl.megatron_bridge.hf_io import BridgeError
from slimrl.trainer.parallel import ParallelLayout

MODEL_META = "slimrl_model.json"
# Megatron's torch_dist strategy still builds torch ShardedTensors; the warning is not ours to fix.
warnings.filterwarnings("ignore", message="Please use DTensor instead")


def _state_key(index: int, num_chunks: int) -> str:
    return "model" if num_chunks == 1 else f"model{index}"


def sharded_model_state(chunks: list[Any]) -> dict[str, Any]:
    modules = [getattr(c, "module", c) for c in chunks]
    return {_state_key(i, len(modules)): m.sharded_state_dict() for i, m in enumerate(modules)}


def shared_tmp_dir(final: Path) -> Path:
    """A temporary sibling of `final`, created by rank 0 and agreed on by every rank."""
    import tempfile

    import torch.distributed as dist

    name = [None]
    if dist.get_rank() == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        name = [tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")]
    dist.broadcast_object_list(name, src=0)
    return Path(str(name[0]))


def publish(tmp: Path, final: Path, overwrite: bool) -> None:
    """Rank 0 renames the finished temporary directory into place (after a barrier)."""
    import os

    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        if final.exists():
            if not overwrite:
                shutil.rmtree(tmp, ignore_errors=True)
                raise BridgeError(f"{final}: output exists; pass --force to replace it")
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    dist.barrier()


def save_model(chunks: list[Any], out_dir: Path, hf_config: dict[str, Any], layout: ParallelLayout) -> None:
    """Write the chunks as one torch_dist checkpoint directly into `out_dir` (all ranks call)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded_model_state(chunks), str(out_dir))
    if dist.get_rank() == 0:
        meta = {"hf_config": hf_config, "layout": asdict(layout)}
        (out_dir / MODEL_META).write_text(json.dumps(meta, indent=2, default=list) + "\n")


def read_model_meta(ckpt_dir: Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / MODEL_META
    if not (Path(ckpt_dir) / "metadata.json").is_file():
        raise BridgeError(f"{ckpt_dir}: not a Megatron torch_dist checkpoint (no metadata.json)")
    if not path.is_file():
        raise BridgeError(f"{ckpt_dir}: no {MODEL_META}; was it written by slimrl?")
    return json.loads(path.read_text())


def load_model(chunks: list[Any], ckpt_dir: Path) -> None:
    """Load a torch_dist checkpoint (saved under any layout) into this rank's chunks."""
    from megatron.core import dist_checkpointing

    modules = [getattr(c, "module", c) for c in chunks]
    try:
        loaded = dist_checkpointing.load(sharded_model_state(chunks), str(ckpt_dir))
    except Exception as exc:  # Megatron raises many types; the first line names what failed
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BridgeError(f"{ckpt_dir}: cannot load torch_dist checkpoint: {first}") from exc
    for i, module in enumerate(modules):
        module.load_state_dict(loaded[_state_key(i, len(modules))], strict=True)
