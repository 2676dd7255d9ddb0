"""Inside a CPU SGLang server process: SGLang's weight checker compares where the weights live.

SGLang 0.5.23's `/weights_checker` (`sglang.srt.utils.weight_checker`) snapshots, resets,
checksums and compares a server's weights; its comparator moves every chunk to the GPU first
(`RawComparable.iter_chunks`: `.cuda()`), which on a machine without a driver fails ("Found no
NVIDIA driver") so `compare` always answers `success: false`. A CPU server's weights are on the
CPU, and the comparison is the same element-wise one there: the chunks stay where they are.
Snapshot, reset and checksum run SGLang's own code unchanged; so does the comparison itself
(`compare_weights`, its tolerances and its message naming the tensor).

The `sgl_kernel` stand-in installs this with the other CPU patches.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from slimrl.compat.sglang_cpu.import_hook import patch_when_loaded

TARGET = "sglang.srt.utils.weight_checker_comparator"


def patch(module: ModuleType) -> None:
    chunk_numel = module.CHUNK_NUMEL

    def iter_chunks_in_place(self: Any) -> Iterator[tuple[torch.Tensor, None]]:
        """`RawComparable.iter_chunks` without the move to a GPU that is not there."""
        flat = self.tensor.reshape(-1)
        for start in range(0, flat.numel(), chunk_numel):
            yield flat[start : start + chunk_numel], None

    module.RawComparable.iter_chunks = iter_chunks_in_place


def install() -> None:
    """Patch SGLang's comparator now if loaded, else right after it loads (CPU servers only)."""
    if not torch.cuda.is_available():
        patch_when_loaded(TARGET, patch)
