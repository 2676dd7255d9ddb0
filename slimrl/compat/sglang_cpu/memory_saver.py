"""Inside a CPU SGLang server process: SGLang's memory saver, losing memory as a GPU loses it.

With `--enable-memory-saver`, SGLang 0.5.23 allocates its weights inside
`TorchMemorySaverAdapter.region("weights", enable_cpu_backup=--enable-weights-cpu-backup)`
(`load_model_utils.py`) and its KV cache inside `region("kv_cache")` (`mem_cache/memory_pool.py`);
`/release_memory_occupation` then `pause`s the tags and `/resume_memory_occupation` `resume`s them
(`scheduler_components/weight_updater.py`). On a GPU the torch_memory_saver package unmaps the
physical memory behind those allocations: after a resume the same addresses hold UNDEFINED bytes,
unless the region kept a host backup, which is copied back. The package needs CUDA (an LD_PRELOADed
allocator hook), so a CPU server gets `CpuMemorySaver` in its place, which keeps what a caller
can observe and nothing else:

- `region(tag, enable_cpu_backup)` records every storage first allocated inside it: a
  TorchDispatchMode sees each op's outputs, and a storage that is none of the op's inputs' is new.
  Storages, not tensors: a Parameter and its views share one, and weights loaded later (updates,
  `update_weights_from_*`) are copied into the same storages, as on a GPU into the same addresses.
  Like a CUDA mem pool, it sees the allocations of the thread that entered it; the innermost
  region (or `disable()`) decides.
- `pause(tag)` copies the bytes to host memory when the region asked for a backup, then overwrites
  them: NaN for floating dtypes, the dtype's maximum for integers (True for bool). "Undefined"
  made visible: a caller who reads released memory, or forgets to reload weights after a resume,
  gets obviously wrong numbers instead of the old ones by luck.
- `resume(tag)` copies the backups back; everything else stays garbage. The memory itself is not
  handed back (there is no device to give it to): only its contents are lost.

SGLang's adapter also calls things that have no CPU meaning; they become no-ops: the subprocess
preload configuration (`configure_subprocess`, the CUDA hook's LD_PRELOAD), pauseable CUDA-graph
capture (`cuda_graph`; a CPU server captures none) and the device synchronize after a release
(`torch.get_device_module()` is `torch.cuda` in a CUDA build of torch, whose `synchronize()` raises
"Found no NVIDIA driver" without one: with no CUDA device there is no CUDA work to wait for).

The `sgl_kernel` stand-in installs this (only CPU servers have it on their PYTHONPATH); the adapter
is patched as soon as SGLang's module is loaded. Without `--enable-memory-saver` SGLang uses its
no-op adapter and none of this runs (but a release no longer crashes on the synchronize).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from slimrl.compat.sglang_cpu.import_hook import patch_when_loaded

TARGET = "sglang.srt.utils.torch_memory_saver_adapter"
_QUANTIZED = (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)


@dataclass(frozen=True, eq=False)
class _Region:
    tag: str
    backup: bool


@dataclass(eq=False)
class _Allocation:
    """One storage allocated inside a region: what `pause` needs to lose (and maybe keep) it."""

    dtype: torch.dtype
    """Of the tensor that allocated it: what the bytes mean, so they become NaN, not noise."""
    region: _Region
    saved: torch.Tensor | None = None
    """The host backup while paused (backup regions only)."""
    paused: bool = False


def _storages(tree: Any) -> Iterator[torch.UntypedStorage]:
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" and leaf.layout == torch.strided:
            storage = leaf.untyped_storage()
            if storage.nbytes():
                yield storage


class _Recorder(TorchDispatchMode):
    """Records the storages each op allocates while its region is the innermost one."""

    def __init__(self, saver: CpuMemorySaver, region: _Region | None) -> None:
        super().__init__()
        self.saver, self.region = saver, region

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.region is None or self.saver._innermost() is not self.region:
            return out
        # lift_fresh wraps a tensor built outside the dispatcher (`torch.tensor(data)`): new memory.
        fresh = func is torch.ops.aten.lift_fresh.default
        inputs = set() if fresh else {s.data_ptr() for s in _storages((args, kwargs))}
        for storage in _storages(out):
            if storage.data_ptr() not in inputs:
                self.saver._record(storage, self.region, _dtype_of(out, storage))
        return out


def _dtype_of(out: Any, storage: torch.UntypedStorage) -> torch.dtype:
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() == storage.data_ptr():
            return leaf.dtype
    return torch.uint8


class CpuMemorySaver:
    """The part of torch_memory_saver's singleton that SGLang's adapter calls."""

    enabled = True

    def __init__(self) -> None:
        self._allocations: weakref.WeakKeyDictionary[torch.UntypedStorage, _Allocation] = (
            weakref.WeakKeyDictionary()
        )
        self._local = threading.local()

    # ------------------------------------------------------------------ allocation

    def _stack(self) -> list[_Region | None]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def _innermost(self) -> _Region | None:
        stack = self._stack()
        return stack[-1] if stack else None

    def _record(self, storage: torch.UntypedStorage, region: _Region, dtype: torch.dtype) -> None:
        self._allocations.setdefault(storage, _Allocation(dtype=dtype, region=region))

    @contextlib.contextmanager
    def _scope(self, region: _Region | None) -> Iterator[None]:
        stack = self._stack()
        stack.append(region)
        try:
            with _Recorder(self, region):
                yield
        finally:
            stack.pop()

    def region(self, tag: str = "default", enable_cpu_backup: bool = False, **_: Any):
        """Storages allocated inside belong to `tag` (disk backup and backends: CUDA-only)."""
        return self._scope(_Region(tag, bool(enable_cpu_backup)))

    def disable(self):
        """Allocations inside are not the region's (SGLang's temporary buffers)."""
        return self._scope(None)

    @contextlib.contextmanager
    def cuda_graph(self, **_: Any) -> Iterator[None]:
        """No CUDA graphs on CPU: nothing is captured, so nothing to make pauseable."""
        yield

    # ------------------------------------------------------------------ pause / resume

    def _of(self, tag: str | None) -> list[tuple[torch.UntypedStorage, _Allocation]]:
        return [(s, a) for s, a in list(self._allocations.items()) if tag is None or a.region.tag == tag]

    def pause(self, tag: str | None = None) -> None:
        """Lose the tag's memory (backing it up first where its region asked); None: all tags."""
        with torch.no_grad():
            for storage, allocation in self._of(tag):
                if allocation.paused:
                    continue
                if allocation.region.backup:
                    allocation.saved = _bytes(storage).clone()
                _lose(storage, allocation.dtype)
                allocation.paused = True

    def resume(self, tag: str | None = None) -> None:
        """Memory back at the same addresses: the backups' bytes, else garbage."""
        with torch.no_grad():
            for storage, allocation in self._of(tag):
                if allocation.saved is not None:
                    _bytes(storage).copy_(allocation.saved)
                allocation.saved, allocation.paused = None, False


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _lose(storage: torch.UntypedStorage, dtype: torch.dtype) -> None:
    raw = _bytes(storage)
    if raw.numel() % dtype.itemsize or dtype in _QUANTIZED:  # not plain elements: lose the bytes
        raw.fill_(0xFF)
    elif dtype.is_floating_point or dtype.is_complex:
        raw.view(dtype).fill_(float("nan"))
    elif dtype == torch.bool:
        raw.view(dtype).fill_(True)
    else:
        raw.view(dtype).fill_(torch.iinfo(dtype).max)


CPU_MEMORY_SAVER = CpuMemorySaver()
"""This process's memory saver (torch_memory_saver's is a singleton too)."""


def _no_preload(self: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def patch(module: ModuleType) -> None:
    """SGLang's adapter uses `CPU_MEMORY_SAVER` instead of torch_memory_saver's singleton."""
    module._memory_saver = CPU_MEMORY_SAVER
    module.import_error = None  # the CUDA package need not even be installed
    module._TorchMemorySaverAdapterReal.configure_subprocess = _no_preload


def _synchronize_nothing(device: Any = None) -> None:
    """`torch.cuda.synchronize` without a CUDA device: there is no CUDA work to wait for."""
    del device


def install() -> None:
    """Patch SGLang's memory-saver adapter now if loaded, else right after it loads."""
    if not torch.cuda.is_available():
        torch.cuda.synchronize = _synchronize_nothing
    patch_when_loaded(TARGET, patch)
