"""What a slimrl torch_dist checkpoint says about itself (`slimrl_model.json`: the HF config it was
made from and its layout), read without torch, so the converter's launcher can refuse a checkpoint
that is not ours, incomplete, or of another architecture than `--hf-config-dir` before any rank
starts."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from slimrl.megatron_bridge.archs import arch_from_hf_config
from slimrl.megatron_bridge.safetensors_index import BridgeError
from slimrl.model_arch import ModelArch

MODEL_META = "slimrl_model.json"


def read_model_meta(ckpt_dir: Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / MODEL_META
    if not (Path(ckpt_dir) / "metadata.json").is_file():
        raise BridgeError(f"{ckpt_dir}: not a Megatron torch_dist checkpoint (no metadata.json)")
    if not path.is_file():
        raise BridgeError(f"{ckpt_dir}: no {MODEL_META}; was it written by slimrl?")
    if not (Path(ckpt_dir) / ".metadata").is_file():
        raise BridgeError(f"{ckpt_dir}: incomplete torch_dist checkpoint (no .metadata, the tensor index)")
    return json.loads(path.read_text())


def check_same_architecture(saved: dict[str, Any], target: dict[str, Any], target_path: Path) -> None:
    """The checkpoint's own HF config against the one we are asked to write with."""
    a, b = arch_from_hf_config(saved, "checkpoint"), arch_from_hf_config(target, str(target_path))
    for field in fields(ModelArch):
        if field.name in ("extra", "hf_architecture"):
            continue
        left, right = getattr(a, field.name), getattr(b, field.name)
        if left != right:
            raise BridgeError(
                f"{target_path}: `{field.name}` is {right!r} but the checkpoint was made with {left!r}; "
                f"pass the --hf-config-dir the checkpoint came from"
            )
