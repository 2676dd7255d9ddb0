"""Run Megatron-Core without CUDA: the one place that knows what CPU needs.

`apply()` is called before Megatron-Core is imported, and only when no GPU is present; on a
GPU machine nothing here runs and Megatron uses its stock code paths (Transformer Engine spec,
NCCL). Each patch names the megatron-core 0.16.1 function it covers; re-check them on upgrade
(run the test suite: every patch is exercised by a multi-process layout test).

Patches, each with the megatron-core code it covers:
- device redirect: `device="cuda"` / `torch.cuda.current_device()` tensors in
  `pipeline_parallel/schedules.py`, `optimizer/*.py`, `distributed/param_and_grad_buffer.py`,
  `models/common/language_module/language_module.py`; also `Tensor.cuda()`, `Tensor.record_stream`.
- CUDA type names: `Tensor.type()` checks for `torch.cuda.FloatTensor` in
  `optimizer/clip_grads.py::get_grad_norm_fp32` and `optimizer/distrib_optimizer.py`.
- RNG tracker: `tensor_parallel/random.py::CudaRNGStatesTracker`, `_get_cuda_rng_state`,
  `_set_cuda_rng_state` use the CUDA generator; ours use the CPU one.
- all-to-all dispatcher: `transformer/moe/token_dispatcher.py::MoEAlltoAllTokenDispatcher.
  _maybe_dtoh_and_synchronize` copies split sizes on a CUDA side stream.
- `te_general_gemm`: `transformer/moe/moe_utils.py` names it, but it only exists with TE installed.
- synchronize: `pipeline_parallel/p2p_communication.py::_communicate` calls `torch.cuda.synchronize()`.
- norm + SP: `transformer/torch_norm.py::WrappedTorchNorm` refuses sequence parallelism, which
  MoE training with TP > 1 requires.
- uneven all_gather: `tensor_parallel/mappings.py::_gather_along_first_dim` gathers unequal sizes
  under expert-TP; gloo cannot.
- MLA core attention: `transformer/multi_latent_attention.py::MultiLatentAttention` passes
  `k_channels`/`v_channels` to its core attention, which the local `DotProductAttention` does not
  take (only `TEDotProductAttention` does); `mla_core_attention()` adapts it. The same module
  believes TE is present (its import of `extensions/transformer_engine.py` yields MagicMock
  placeholders without TE), so `HAVE_TE` is reset there.
- no compile at import: `jit.py` wraps ~40 functions in `torch.compile` at import (slow, no gain on CPU).
- CUDA-only extensions: `transformer/attention.py` imports `flash_mla` (installed with SGLang) and
  catches only `ImportError`; without a GPU driver the module raises `OSError` (libcuda.so.1), so
  it is marked absent before Megatron-Core is imported; so is `flashinfer` (see
  `_CUDA_ONLY_EXTENSIONS`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_APPLIED = False
_CPU = torch.device("cpu")
_CUDA_ONLY_EXTENSIONS = ("flash_mla", "flashinfer")
"""Modules marked absent before Megatron-Core is imported: `flash_mla` raises OSError (not
ImportError) without a GPU driver; `flashinfer` (installed with SGLang) is GPU kernels only, and
Megatron-Core imports it only for its inference engine's fused RoPE
(`inference/contexts/dynamic_context.py`), which the trainer never builds; importing it (and the
CUTLASS DSL it pulls in) cost every CPU trainer and converter rank ~3 s of CPU."""


def needs_cpu_compat() -> bool:
    """True when Megatron must run on CPU (no CUDA device visible)."""
    return not torch.cuda.is_available()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU for every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron asserts on CUDA type names; report the CUDA twin of the CPU type.
            return re.sub(r"^torch\.", "torch.cuda.", func(*args))
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _CpuRNGStatesTracker:
    """Mixin replacing CUDA generator states with CPU generator states."""

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    tracker = type("CpuRNGStatesTracker", (_CpuRNGStatesTracker, mrandom.CudaRNGStatesTracker), {})
    mrandom.CudaRNGStatesTracker = tracker


def _patch_moe() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.te_general_gemm = None
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    dispatcher.cuda_dtoh_stream = "cpu"  # any non-None value stops it creating a CUDA stream

    def maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if isinstance(value, torch.Tensor):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    dispatcher._maybe_dtoh_and_synchronize = maybe_dtoh_and_synchronize


def _patch_norm() -> None:
    import dataclasses

    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        # The norm itself is elementwise per token; SP only needs its grads all-reduced over
        # TP, which finalize_model_grads does for params marked `sequence_parallel`.
        norm = original_new(
            cls, dataclasses.replace(config, sequence_parallel=False), hidden_size, *args, **kwargs
        )
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def _patch_uneven_all_gather() -> None:
    original = dist.all_gather

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        shapes = {t.shape for t in tensor_list} | {tensor.shape}
        if len(shapes) == 1 or dist.get_backend(group) != "gloo":
            return original(tensor_list, tensor, group=group, async_op=async_op)
        # gloo requires equal sizes: pad along dim 0 to the largest, gather, trim.
        longest = max(t.shape[0] for t in tensor_list)
        pad = lambda t: torch.cat([t, t.new_zeros((longest - t.shape[0], *t.shape[1:]))])  # noqa: E731
        padded = [torch.empty_like(pad(t)) for t in tensor_list]
        original(padded, pad(tensor), group=group)
        for out, gathered in zip(tensor_list, padded, strict=True):
            out.copy_(gathered[: out.shape[0]])
        return None

    dist.all_gather = all_gather


def mla_core_attention() -> type:
    """Local `DotProductAttention` that accepts MLA's separate q/k and v head sizes."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(
            self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any
        ):
            super().__init__(*args, **kwargs)
            if v_channels is not None:  # the context has v_channels per head, not kv_channels
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def _patch_mla() -> None:
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


def _import_megatron_without_compile() -> None:
    real_compile = torch.compile
    torch.compile = lambda fn=None, *a, **k: fn if fn is not None else (lambda f: f)
    try:
        import megatron.core
        import megatron.core.jit  # noqa: F401
        from megatron.core.models.gpt import gpt_model  # noqa: F401
    finally:
        torch.compile = real_compile


def apply() -> None:
    """Install every CPU patch once; a no-op when CUDA is available."""
    global _APPLIED
    if _APPLIED or not needs_cpu_compat():
        return
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # Expected on CPU, printed once per rank per layer otherwise.
    warnings.filterwarnings("ignore", message="Apex is not installed")
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
    warnings.filterwarnings(
        "ignore", message=r"`torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)`"
    )
    torch.cuda.current_device = lambda: _CPU
    torch.cuda.synchronize = lambda *a, **k: None
    for module in _CUDA_ONLY_EXTENSIONS:
        sys.modules.setdefault(module, None)  # type: ignore[arg-type]  # `import` raises ImportError
    _import_megatron_without_compile()
    _patch_rng()
    _patch_moe()
    _patch_norm()
    _patch_uneven_all_gather()
    _patch_mla()
    _CudaToCpuMode().__enter__()  # global for the life of the process
    _APPLIED = True
