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

from types import ModuleType
from typing import Any

import torch

from slimrl.compat.sglang_cpu.import_hook import patch_when_loaded

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


def install() -> None:
    """Patch SGLang's host allocation now if loaded, else right after it loads."""
    patch_when_loaded(TARGET, patch)
