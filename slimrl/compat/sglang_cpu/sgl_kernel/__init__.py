"""A pure-torch stand-in for the `sgl_kernel` package inside a CPU SGLang server process.

SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`) imports a few `*_cpu` helpers from `sgl_kernel`
at module load, but the PyPI `sglang-kernel` wheel is CUDA-only (it needs libcuda.so.1). This
directory goes first on the server's PYTHONPATH (and only the server's), so the import finds
these two helpers; on CPUs without AMX SGLang then computes every layer with its torch code.
Any other name imports (SGLang imports speculative-decoding kernels at module load) but raises
NotImplementedError, naming the kernel, if it is ever called.

Importing it also installs the process's other CPU patches, this import being the first of ours to
run in every server process: `slimrl.compat.sglang_cpu.host_memory` (host buffers allocated
without CUDA host registration) and `slimrl.compat.sglang_cpu.memory_saver` (SGLang's memory saver
on host memory: `--enable-memory-saver` releases lose their contents as on a GPU) and
`slimrl.compat.sglang_cpu.weight_checker` (SGLang's `/weights_checker` compares on the CPU).
"""

from __future__ import annotations

import ctypes

import torch

from slimrl.compat.sglang_cpu import host_memory, memory_saver, weight_checker

host_memory.install()
memory_saver.install()
weight_checker.install()


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[row_i, start_i:end_i] = the i-th run of out_cache_loc (runs back to back)."""
    del pool_len  # the row width; req_to_token knows it
    taken = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        length = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + length].to(req_to_token.dtype)
        taken += length


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every KV buffer (one base pointer and row stride in bytes each): row src -> row tgt."""
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for tgt, src in zip(tgt_loc.tolist(), src_loc.tolist(), strict=True):
            ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU stand-in (slimrl/compat/sglang_cpu/sgl_kernel): "
            "this SGLang feature needs the CUDA kernels"
        )

    missing.__name__ = name
    return missing
