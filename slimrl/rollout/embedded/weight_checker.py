"""SGLang 0.5.23's weight checker (`/weights_checker`) for the embedded engine, same contract.

Actions, as SGLang's `sglang/srt/utils/weight_checker.py` defines them over the served model's
parameters and buffers (non-persistent buffers such as rotary caches skipped):
* `snapshot`: keep a copy of every tensor;
* `reset_tensors`: overwrite every tensor with random values (floats uniform in [0, 1));
* `compare`: every tensor bitwise equal to the snapshot, else an error naming each one that is not
  with its largest and mean absolute difference; the snapshot is dropped only on success;
* `checksum`: a 16-hex-digit hash of each tensor's bytes (the first 8 bytes of its SHA-256, as
  SGLang hashes CPU tensors) and their SHA-256 over sorted names (`per_gpu_checksum`).
NaN is never equal to anything (released weights never compare equal). Names are the embedded
model's (transformers'), SGLang's are its own fused ones: only a server's answers are compared with
each other, never across engine kinds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch

from slimrl.rollout.embedded.weights import WeightUpdateError

NON_PERSISTENT_PATTERNS = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis")
ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")


def tensor_checksum(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).digest()[:8].hex()


def overall_checksum(checksums: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(checksums):
        digest.update(name.encode())
        digest.update(checksums[name].encode())
    return digest.hexdigest()


class WeightChecker:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.snapshot: dict[str, torch.Tensor] | None = None

    def tensors(self, skip: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        persistent = set(self.model.state_dict(keep_vars=True))
        named = [*self.model.named_parameters(), *self.model.named_buffers()]
        for name, tensor in named:
            hidden = name not in persistent or any(p in name for p in NON_PERSISTENT_PATTERNS)
            if not hidden and not any(p in name for p in skip or ()):
                yield name, tensor

    def handle(self, action: str, skip: list[str] | None = None) -> dict[str, Any] | None:
        if action not in ACTIONS:
            raise WeightUpdateError(f"Unsupported action={action!r}; valid: {', '.join(ACTIONS)}")
        with torch.no_grad():
            return getattr(self, f"_{action}")(skip)

    def _snapshot(self, skip: list[str] | None) -> None:
        del skip  # SGLang snapshots every tensor; compare skips
        self.snapshot = {name: t.detach().clone() for name, t in self.tensors()}

    def _reset_tensors(self, skip: list[str] | None) -> None:
        for _, tensor in self.tensors(skip):
            if tensor.dtype.is_floating_point:
                tensor.copy_(torch.rand(tensor.shape, dtype=torch.float32).to(tensor.dtype))
            elif tensor.dtype == torch.bool:
                tensor.copy_(torch.rand(tensor.shape) > 0.5)
            else:
                info = torch.iinfo(tensor.dtype)
                tensor.copy_(torch.randint(int(info.min), int(info.max), tensor.shape, dtype=tensor.dtype))

    def _compare(self, skip: list[str] | None) -> None:
        if self.snapshot is None:
            raise WeightUpdateError("compare needs a snapshot first (action snapshot)")
        errors = []
        for name, tensor in self.tensors(skip):
            expect = self.snapshot[name]
            diff = (tensor.float() - expect.float()).abs()
            exceed = int((~(diff == 0)).sum())  # NaN counts as differing
            if exceed:
                errors.append(
                    f"name={name} max_abs_err={diff.max().item()} mean_abs_err={diff.mean().item()} "
                    f"num_exceed={exceed}"
                )
        if errors:
            raise WeightUpdateError("check tensor equality failed: " + " ".join(errors))
        self.snapshot = None

    def _checksum(self, skip: list[str] | None) -> dict[str, Any]:
        checksums = {name: tensor_checksum(t) for name, t in self.tensors(skip)}
        info = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1}
        info |= {"pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}
        overall = overall_checksum(checksums)
        return {"checksums": checksums, "per_gpu_checksum": overall, "parallelism_info": [info]}
