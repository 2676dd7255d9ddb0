"""Block-wise FP8 (e4m3) weight quantisation for syncing weights to FP8 SGLang servers.

Layout (DeepSeek-V3 FP8 checkpoints, as SGLang's block-quantised ``Fp8LinearMethod`` loads them):
a 2-D linear weight ``<prefix>.weight`` of shape ``[rows, cols]`` (= ``[out, in]``) is stored as
``torch.float8_e4m3fn`` next to ``<prefix>.weight_scale_inv``, a float32 tensor of shape
``[ceil(rows / 128), ceil(cols / 128)]`` with one scale per 128x128 block (edge blocks may be
partial).  Despite its name the scale *multiplies*: ``w ~= q.float() * weight_scale_inv[i // 128, j // 128]``.

``scale = amax(|block|) / 448`` and ``q = round_to_nearest_even(w / scale)``, computed in float32.  The
rounding is exact: the float32 quotient can, rarely, land exactly on a midpoint between two e4m3 values
when the exact quotient does not (double rounding); those elements are detected and re-rounded with an
exact float64 comparison, so ``q`` equals e4m3 round-to-nearest-even of the exact ``w / scale``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from slimrl.megatron_bridge.fp8_names import QUANTIZED_WEIGHT_PATTERNS, is_quantized_name

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "QUANTIZED_WEIGHT_PATTERNS",
    "dequantize_block_fp8",
    "fp8_quantization_config",
    "quantize_block_fp8",
    "quantize_named_tensors",
    "scale_name",
    "should_quantize",
]

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
FP8_DTYPE = torch.float8_e4m3fn
_F32_TINY = torch.finfo(torch.float32).tiny  # scales are kept >= this, i.e. normal float32 numbers

# Which names are streamed as FP8 lives in `fp8_names` (torch-free, shared with the engine memory plan).


def should_quantize(name: str, tensor: torch.Tensor) -> bool:
    """True if the HF-named ``tensor`` is a 2-D decoder-layer linear weight that FP8 servers expect as FP8."""
    if tensor.ndim != 2 or not tensor.is_floating_point() or tensor.element_size() == 1:
        return False
    return is_quantized_name(name)


def scale_name(weight_name: str) -> str:
    """``<prefix>.weight`` -> ``<prefix>.weight_scale_inv``."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"not a weight name: {weight_name!r}")
    return weight_name + "_scale_inv"


def fp8_quantization_config() -> dict:
    """The ``quantization_config`` block of a DeepSeek-V3-style FP8 ``config.json``."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }


def _padded_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor to multiples of ``block`` and view it as ``[R, block, C, block]``."""
    rows, cols = x.shape
    n_r, n_c = -(-rows // block), -(-cols // block)
    pad_r, pad_c = n_r * block - rows, n_c * block - cols
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    return x.reshape(n_r, block, n_c, block)


_F32_E4M3_MIN_NORMAL_BITS = 0x3C800000  # float32 bit pattern of 2**-6
_F32_BELOW_E4M3_MANTISSA = 0x000FFFFF  # float32 fraction bits that e4m3 drops (all but the top 3)
_F32_E4M3_HALF_ULP_BIT = 0x00080000  # the highest dropped bit: set alone <=> exactly halfway
_F32_BELOW_HALF_ULP = 0x0007FFFF  # zero in every e4m3 midpoint (normal or subnormal), whatever the sign


def _e4m3_midpoints(a: torch.Tensor) -> torch.Tensor:
    """Mask of the non-negative float32 values that lie exactly halfway between two e4m3 values."""
    bits = a.view(torch.int32)
    normal = (bits & _F32_BELOW_E4M3_MANTISSA) == _F32_E4M3_HALF_ULP_BIT
    normal &= bits >= _F32_E4M3_MIN_NORMAL_BITS
    # subnormal e4m3 values are k * 2**-9, so the midpoints below 2**-6 are the odd multiples of 2**-10
    sub = torch.fmod(a * 1024.0, 2.0) == 1.0
    sub &= bits < _F32_E4M3_MIN_NORMAL_BITS
    return normal | sub


def _fix_double_rounding(y: torch.Tensor, q: torch.Tensor, x: torch.Tensor, s: torch.Tensor) -> None:
    """Re-round, in place in ``q``, the elements whose float32 quotient ``y`` is an exact e4m3 midpoint.

    ``y = fl32(x / s)`` (then clamped); e4m3 rounding of ``y`` equals e4m3 rounding of the exact ``x / s``
    unless ``y`` sits exactly halfway between two e4m3 values, where ties-to-even may pick the wrong side
    (classic double rounding).  For those few elements decide the side exactly: the midpoint ``m`` has 5
    significant bits and ``s`` 24, so ``m * s`` is exact in float64, and so is ``|x| - m * s`` (Sterbenz),
    whose sign says whether the exact quotient is above, below or on ``m``.  ``s`` may be a broadcastable
    view of the per-block scales.
    """
    # cheap one-pass prefilter on the raw bits (sign-agnostic); the exact test runs on the few candidates
    idx = ((y.view(torch.int32) & _F32_BELOW_HALF_ULP) == 0).nonzero(as_tuple=True)
    a = y[idx].abs()
    mid = _e4m3_midpoints(a)
    if not bool(mid.any()):
        return
    idx = tuple(i[mid] for i in idx)
    m = a[mid].double()
    _, exp = torch.frexp(m)  # m = mant * 2**exp, mant in [0.5, 1) => e4m3 ulp is 2**(exp - 1 - 3)
    half_ulp = torch.ldexp(torch.ones_like(m), (exp - 5).clamp(min=-10))
    diff = x[idx].double().abs() - m * s.expand_as(y)[idx].double()
    exact = torch.where(diff > 0, m + half_ulp, torch.where(diff < 0, m - half_ulp, q[idx].double().abs()))
    q.view(torch.uint8)[idx] = exact.copysign(y[idx].double()).float().to(FP8_DTYPE).view(torch.uint8)


def quantize_block_fp8(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D float tensor to float8_e4m3fn with one float32 scale per ``block x block`` block.

    Returns ``(q, scale_inv)``: ``q`` has the shape of ``weight``; ``scale_inv`` is
    ``[ceil(rows / block), ceil(cols / block)]`` float32 with ``scale = amax(|block|) / 448`` (1.0 for an
    all-zero block), so ``dequantize_block_fp8(q, scale_inv) ~= weight``.  Raises ``ValueError`` on
    non-finite input.
    """
    if weight.ndim != 2 or not weight.is_floating_point():
        raise ValueError(
            f"expected a 2-D floating-point tensor, got {weight.dtype} of shape {tuple(weight.shape)}"
        )
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    rows, cols = weight.shape
    with torch.no_grad():
        x = _padded_blocks(weight.detach().to(torch.float32), block)  # [R, b, C, b]
        amax = x.abs().amax(dim=(1, 3), keepdim=True)  # [R, 1, C, 1]; propagates NaN
        if not bool(torch.isfinite(amax).all()):
            raise ValueError("cannot quantise a tensor with NaN or inf values to FP8")
        # An all-zero block gets scale 1.0 (exact zeros, no 0/0).  A block with amax < 448 * tiny (never
        # seen in real weights) gets the smallest normal scale instead of a subnormal / underflowed one, so
        # the scale stays exact-enough and |w / scale| <= 448 still holds.
        scale = torch.where(amax > 0, (amax / FP8_MAX).clamp_(min=_F32_TINY), 1.0)
        y = (x / scale).clamp_(-FP8_MAX, FP8_MAX)
        q = y.to(FP8_DTYPE)
        _fix_double_rounding(y, q, x, scale)
        del y
        n_r, _, n_c, _ = x.shape
        q = q.reshape(n_r * block, n_c * block)[:rows, :cols].contiguous()
    return q, scale.view(scale.shape[0], scale.shape[2]).contiguous()


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Inverse of :func:`quantize_block_fp8`: ``q.float() * scale_inv`` broadcast over blocks (float32)."""
    if q.ndim != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(q.shape)}")
    rows, cols = q.shape
    expected = (-(-rows // block), -(-cols // block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} != {expected} for weight {rows}x{cols}")
    x = _padded_blocks(q.float(), block) * scale_inv.float()[:, None, :, None]
    return x.reshape(expected[0] * block, expected[1] * block)[:rows, :cols].contiguous()


def quantize_named_tensors(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream HF-named tensors, replacing each quantisable weight by ``(name, q)`` + ``(name_scale_inv, s)``.

    Other tensors pass through unchanged (same object).  Items are pulled one at a time and no reference
    is kept to a tensor once it has been yielded.
    """
    for name, tensor in items:
        if not should_quantize(name, tensor):
            yield name, tensor
            continue
        try:
            q, s = quantize_block_fp8(tensor)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
        del tensor
        yield name, q
        del q
        yield scale_name(name), s
