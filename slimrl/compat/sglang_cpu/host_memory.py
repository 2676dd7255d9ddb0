"""Inside a CPU SGLang server process: host buffers without CUDA host registration.

SGLang 0.5.23 allocates its host-side buffers through `ALLOC_MEMORY_FUNCS[device]`
(`sglang.srt.mem_cache.pool_host.common`), whose default for "cpu" registers the memory with
`cudaHostRegister` when `pin_memory=True`. On a machine without a GPU driver that call fails ("Found
no NVIDIA driver") and kills the server at start-up; `--enable-return-routed-experts` is what
allocates such a buffer on a CPU server (the routed-experts host cache,
`state_capturer/base.py:BaseHostCache`). Pinning only speeds up copies to a GPU, and a CPU server
has none, so here "cpu" host buffers are plain allocations of the same allocator.

The `sgl_kernel` stand-in installs this when SGLang imports it (only CPU servers have the stand-in on
their PYTHONPATH); the patch is applied as soon as SGLang's module is loaded, whichever comes first.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any

import torch

TARGET = "sglang.srt.mem_cache.pool_host.common"


def alloc_unpinned(
    dims: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
    pin_memory: bool,
    allocator: Any,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:
    """`alloc_with_host_register` without the registration: the allocator's own memory."""
    del pin_memory, registration_granularity_bytes  # nothing to pin for: no GPU
    if allocator is None:
        return torch.empty(dims, dtype=dtype, device=device)
    return allocator.allocate(dims, dtype=dtype, device=device)


def patch(module: ModuleType) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unpinned


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of `name` so `then` runs once it has loaded."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one module, once; and the real finders must answer below
        spec = PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        load, then = spec.loader.exec_module, self.then

        def exec_then_patch(module: ModuleType) -> None:
            load(module)
            then(module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Patch SGLang's host allocation now if loaded, else right after it loads."""
    loaded = sys.modules.get(TARGET)
    if loaded is not None:
        patch(loaded)
    elif not any(isinstance(f, _PatchAfterLoad) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterLoad(TARGET, patch))
