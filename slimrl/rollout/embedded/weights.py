"""Copy HF-checkpoint-named tensors into a live transformers model, in place.

Trainers send weights under the names of the HF safetensors checkpoint, which are not always the
model's parameter names: transformers 5 fuses each MoE layer's experts into two 3-D parameters
(`mlp.experts.gate_up_proj` [E, 2*ffn, H], gate rows first, and `mlp.experts.down_proj`
[E, H, ffn]) while checkpoints keep one `mlp.experts.<e>.{gate,up,down}_proj.weight` per expert.
`WeightTargets` maps every accepted name to a view of the parameter memory it lives in, found by
inspecting the model (not a per-architecture table), so the fused names are accepted as well.

Copies are in place (`Tensor.copy_`), so tied embeddings (Qwen2's `lm_head.weight` is
`model.embed_tokens.weight`) stay one tensor whichever of the two names is loaded. A batch is
validated completely (every name known, every shape equal) before the first copy, so a bad update
leaves the model untouched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


class WeightUpdateError(ValueError):
    """A tensor that cannot be loaded: unknown name, wrong shape, unreadable checkpoint."""


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: a view of a parameter (or buffer)."""

    view: Callable[[], torch.Tensor]
    shape: tuple[int, ...]


class WeightTargets:
    """Checkpoint name -> parameter memory, for one model instance."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._targets: dict[str, _Target] = {}
        tensors = dict(model.named_parameters(remove_duplicate=False))
        persistent = set(model.state_dict(keep_vars=True))
        tensors.update(
            (n, b)
            for n, b in model.named_buffers(remove_duplicate=False)
            if n in persistent and n not in tensors
        )
        for name, tensor in tensors.items():
            self._add(name, lambda t=tensor: t, tuple(tensor.shape))
            match = _FUSED_EXPERTS.match(name)
            if match and tensor.dim() == 3:
                self._add_experts(match["prefix"], match["kind"], tensor)

    def _add(self, name: str, view: Callable[[], torch.Tensor], shape: tuple[int, ...]) -> None:
        self._targets[name] = _Target(view=view, shape=shape)

    def _add_experts(self, prefix: str, kind: str, fused: torch.Tensor) -> None:
        num_experts, rows, cols = fused.shape
        for e in range(num_experts):
            if kind == "down_proj":
                self._add(f"{prefix}.{e}.down_proj.weight", lambda e=e: fused[e], (rows, cols))
                continue
            half = rows // 2
            self._add(f"{prefix}.{e}.gate_proj.weight", lambda e=e, h=half: fused[e, :h], (half, cols))
            self._add(f"{prefix}.{e}.up_proj.weight", lambda e=e, h=half: fused[e, h:], (half, cols))

    def __contains__(self, name: str) -> bool:
        return name in self._targets

    def names(self) -> list[str]:
        return sorted(self._targets)

    def check(self, name: str, shape: Iterable[int]) -> None:
        """Raise `WeightUpdateError` naming the tensor if it cannot be loaded."""
        target = self._targets.get(name)
        if target is None:
            raise WeightUpdateError(f"unknown tensor `{name}`: the model has no parameter of that name")
        shape = tuple(int(s) for s in shape)
        if shape != target.shape:
            raise WeightUpdateError(
                f"shape mismatch for `{name}`: got {list(shape)}, the model expects {list(target.shape)}"
            )

    def get(self, name: str) -> torch.Tensor:
        """The live memory behind `name` (a view; do not keep it across weight updates)."""
        if name not in self._targets:
            raise WeightUpdateError(f"unknown tensor `{name}`: the model has no parameter of that name")
        return self._targets[name].view()

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Validate all, then copy all (dtype converted to the model's). Returns the number loaded."""
        items = list(named_tensors)
        for name, tensor in items:
            if not isinstance(tensor, torch.Tensor):
                raise WeightUpdateError(f"tensor `{name}` is a {type(tensor).__name__}, not a tensor")
            if tensor.is_complex():
                raise WeightUpdateError(f"tensor `{name}` has unsupported dtype {tensor.dtype}")
            self.check(name, tensor.shape)
        return self.copy_checked(items)

    def copy_checked(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors whose names and shapes were already checked (streams: nothing is kept)."""
        count = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                self._targets[name].view().copy_(tensor)
                count += 1
        return count


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The safetensors files of an HF checkpoint directory (sharded or not)."""
    root = Path(model_path)
    if not root.is_dir():
        raise WeightUpdateError(f"model_path `{model_path}` is not a directory")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise WeightUpdateError(f"{index}: unreadable index ({exc})") from None
        files = sorted({root / f for f in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"model_path `{model_path}` has no *.safetensors files")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WeightUpdateError(f"model_path `{model_path}`: missing shard {missing[0]}")
    return files


def iter_checkpoint(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, one file at a time."""
    from safetensors import safe_open

    for path in checkpoint_files(model_path):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, handle.get_tensor(name)


def load_checkpoint(targets: WeightTargets, model_path: str | Path) -> int:
    """Load a whole HF checkpoint directory: shapes are checked from the headers before any copy."""
    from safetensors import SafetensorError, safe_open

    try:
        for path in checkpoint_files(model_path):
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118
                    targets.check(name, handle.get_slice(name).get_shape())
        return targets.copy_checked(iter_checkpoint(model_path))
    except (SafetensorError, OSError) as exc:
        raise WeightUpdateError(
            f"cannot read checkpoint `{model_path}`: {' '.join(str(exc).split())}"
        ) from None
