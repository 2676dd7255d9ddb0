"""Move a rank's training state out of device memory between phases, and back, byte for byte.

Colocated with rollout engines, the trainer must give the device memory back while the engines
generate. Every storage behind the parameters, gradient buffers and optimizer state is copied to
host memory (pinned on GPU) and then shrunk to zero bytes; `onload` regrows each storage and copies
the bytes back, so every tensor object (and every view into the DDP buffers) stays valid.
"""

from __future__ import annotations

from typing import Any

import torch


def _param_storages(model: list[Any]) -> set[int]:
    """Data pointers of the storages behind the model's parameters (the DDP param buffers)."""
    return {
        p.untyped_storage().data_ptr()
        for chunk in model
        for p in getattr(chunk, "module", chunk).parameters()
    }


def _storages(model: list[Any], optimizer: Any) -> list[torch.UntypedStorage]:
    tensors: list[torch.Tensor] = []
    for chunk in model:
        for buffer in [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]:
            tensors += [t for t in (getattr(buffer, "param_data", None), buffer.grad_data) if t is not None]
        tensors += [p for p in getattr(chunk, "module", chunk).parameters()]
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(inner, "optimizer", None)
        if torch_opt is None:
            continue
        for group in torch_opt.param_groups:
            tensors += list(group["params"])
        for state in torch_opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    unique: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0:
            unique.setdefault(storage.data_ptr(), storage)
    return list(unique.values())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


class Offloader:
    def __init__(self, model: list[Any], optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer
        self.saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def offloaded(self) -> bool:
        return bool(self.saved)

    def offload(self, keep_params: bool = False) -> int:
        """Returns the bytes freed on the device. `keep_params` leaves the parameters in place
        (the weight sync reads them after the engines got their memory back); a later call
        without it moves them too."""
        pin = torch.cuda.is_available()
        freed = 0
        kept = _param_storages(self.model) if keep_params else set()
        for storage in _storages(self.model, self.optimizer):  # already offloaded ones are empty
            if storage.data_ptr() in kept:
                continue
            host = _bytes_of(storage).to("cpu", copy=True)
            self.saved.append((storage, host.pin_memory() if pin else host))
            freed += storage.nbytes()
            storage.resize_(0)
        if pin:
            torch.cuda.empty_cache()
        return freed

    def onload(self) -> None:
        for storage, host in self.saved:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.saved = []
