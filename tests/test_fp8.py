"""Block-wise FP8 quantisation for weight sync, checked against an exact float64 reference.

The reference quantises block by block with explicit Python loops:
  scale = amax(|block|) / 448 in float64 (1.0 for an all-zero block), stored as float32;
  q     = round-to-nearest-even of x / scale onto the e4m3 grid, saturating at 448.
It does *not* use torch's float->float8 cast: that cast goes through float32 even from float64, so it
double-rounds (see test_q_is_exactly_rounded_where_float32_double_rounds).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from safetensors.torch import load, save

from slimrl.megatron_bridge.fp8 import (
    BLOCK,
    FP8_MAX,
    dequantize_block_fp8,
    fp8_quantization_config,
    quantize_block_fp8,
    quantize_named_tensors,
    should_quantize,
)

SHAPES = [(256, 256), (300, 130), (1, 5), (129, 257)]
# one all-zero block per shape where the shape has room for it (rows, cols of the block grid)
ZERO_BLOCK = {(256, 256): (1, 0), (300, 130): (1, 1), (129, 257): (1, 2)}


def e4m3_grid() -> torch.Tensor:
    """All non-negative finite float8_e4m3fn values, ascending, from the format definition (float64)."""
    sub = [k * 2.0**-9 for k in range(8)]  # exponent field 0: subnormals k * 2**-9
    normal = [(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8)]
    grid = torch.tensor(sub + normal[:-1], dtype=torch.float64)  # e=8, m=7 is NaN in the "fn" variant
    assert grid[-1].item() == FP8_MAX
    return grid


GRID = e4m3_grid()


def ref_round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Exact round-to-nearest-even of float64 values onto the e4m3 grid, saturating at +/-448."""
    a = v.abs().clamp(max=FP8_MAX)
    hi_i = torch.searchsorted(GRID, a.contiguous()).clamp(
        max=len(GRID) - 1
    )  # GRID[hi_i - 1] < a <= GRID[hi_i]
    lo_i = (hi_i - 1).clamp(min=0)
    lo, hi = GRID[lo_i], GRID[hi_i]
    # 2a and lo + hi are exact in float64 (a, lo, hi are far from overflow; lo + hi has <= 6 bits)
    twice, mid2 = 2 * a, lo + hi
    # on a tie, the even mantissa wins; grid index parity == parity of the e4m3 code == mantissa LSB
    pick_hi = (twice > mid2) | ((twice == mid2) & (hi_i % 2 == 0))
    r = torch.where(pick_hi, hi, lo)
    r = torch.where(a == hi, hi, r)  # exact grid values (incl. 0)
    return r.copysign(v)


def ref_quantize(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 reference with Python loops over blocks: (exact scale, float32 scale, q values as float64)."""
    x = w.double()
    rows, cols = x.shape
    n_r, n_c = math.ceil(rows / block), math.ceil(cols / block)
    scale64 = torch.empty(n_r, n_c, dtype=torch.float64)
    q = torch.empty_like(x)
    for i in range(n_r):
        for j in range(n_c):
            blk = x[i * block : (i + 1) * block, j * block : (j + 1) * block]
            amax = blk.abs().max().item()
            scale64[i, j] = amax / 448.0 if amax > 0 else 1.0
            s32 = float(torch.tensor(scale64[i, j].item(), dtype=torch.float32))
            # x / s32 in float64 cannot land on an e4m3 midpoint unless it is exactly one: a midpoint m has
            # 5 significant bits, so x - m * s32 != 0 implies |x / s32 - m| >= 2**-29 m >> 2**-53 m.
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = ref_round_e4m3(blk / s32)
    return scale64, scale64.float(), q


def make_weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Gaussian weights with a different magnitude per block and per-element spread down to ~1e-6 of the
    block amax, so that e4m3 subnormals, underflow to zero and every binade are exercised."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    w *= 10.0 ** (torch.rand(rows, cols, generator=g, dtype=torch.float64) * -6)
    block_mag = 10.0 ** (torch.rand(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK), generator=g) * 6 - 4)
    for i in range(block_mag.shape[0]):
        for j in range(block_mag.shape[1]):
            w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] *= block_mag[i, j].item()
    if shape in ZERO_BLOCK:
        i, j = ZERO_BLOCK[shape]
        w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = 0
    return w.float()


def expand_blocks(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Per-element scale, the way SGLang's block_quant_dequant broadcasts weight_scale_inv."""
    rows, cols = shape
    return scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]


def test_reference_rounding_agrees_with_torch_where_there_is_no_double_rounding():
    # float32 inputs need one rounding only, so torch's cast is a valid cross-check of the reference
    v = torch.cat([torch.linspace(-460, 460, 200_001), (GRID[1:] + GRID[:-1]).float() / 2, GRID.float()])
    assert torch.equal(ref_round_e4m3(v.double()), v.clamp(-448, 448).to(torch.float8_e4m3fn).double())
    codes = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    assert torch.equal(codes, GRID)


@pytest.mark.parametrize("shape", SHAPES)
def test_scales_match_float64_reference(shape):
    w = make_weight(shape, seed=sum(shape))
    q, s = quantize_block_fp8(w)
    scale64, scale32, _ = ref_quantize(w)
    assert q.shape == w.shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)) and s.dtype == torch.float32
    # amax is exact in float32 and the float32 division is correctly rounded, so s must be exactly the
    # float32 rounding of the float64 quotient (448 = 7 * 2**6 and amax / 7 has a period-3 binary
    # expansion, so rounding float64 -> float32 cannot double-round here)
    assert torch.equal(s, scale32)
    assert ((s.double() - scale64).abs() <= scale64 * 2.0**-24).all()
    if shape in ZERO_BLOCK:
        i, j = ZERO_BLOCK[shape]
        assert s[i, j].item() == 1.0


@pytest.mark.parametrize("shape", SHAPES)
def test_quantized_values_match_exact_reference_and_error_bound(shape):
    w = make_weight(shape, seed=sum(shape))
    q, s = quantize_block_fp8(w)
    _, _, q_ref = ref_quantize(w)
    q64 = q.double()
    assert torch.equal(q64, q_ref)

    # Error bound.  With v = x / s and |v| <= 448, round-to-nearest on e4m3 (3 mantissa bits) errs by at
    # most half an ulp: for a normal v in [2**e, 2**(e+1)), e >= -6, the ulp is 2**(e-3), so the error is
    # <= 2**(e-4) <= 2**-4 |v|; below 2**-6 (subnormals) the spacing is 2**-9, so the error is <= 2**-10.
    # Hence |q - v| <= 2**-4 |v| + 2**-10, and multiplying by s: |q s - x| <= 2**-4 |x| + 2**-10 s.
    # (Saturating v = amax / fl32(amax / 448) ~= 448 (1 +- 2**-24) to 448 stays inside the same bound.)
    # q * s is exact in float64 (4 + 24 significant bits), so this is checked with no extra slack.
    x64 = w.double()
    s_full = expand_blocks(s.double(), shape)
    err = (q64 * s_full - x64).abs()
    assert (err <= 2.0**-4 * x64.abs() + 2.0**-10 * s_full).all()

    # dequantisation is q * s rounded once to float32, broadcast exactly like SGLang's block_quant_dequant
    dq = dequantize_block_fp8(q, s)
    assert dq.dtype == torch.float32 and dq.shape == w.shape
    assert torch.equal(dq, (q64 * s_full).float())

    # no NaN / inf anywhere, scales strictly positive
    assert torch.isfinite(q.float()).all() and torch.isfinite(s).all() and (s > 0).all()
    assert torch.isfinite(dq).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_block_amax_maps_to_448_and_zero_blocks_stay_zero(shape):
    w = make_weight(shape, seed=7 * sum(shape))
    w[0, 0] = -w.abs().max()  # a negative amax in the first block
    q, s = quantize_block_fp8(w)
    qf = q.float()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            qb = qf[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            amax = blk.abs().max()
            if amax == 0:
                assert s[i, j].item() == 1.0
                dq = dequantize_block_fp8(q, s)[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
                assert (qb == 0).all() and (dq == 0).all()
                continue
            at_max = blk.abs() == amax
            assert at_max.any()
            assert torch.equal(qb[at_max], torch.sign(blk[at_max]) * 448.0)
            assert (qb.abs() <= 448).all()
    assert qf[0, 0].item() == -448.0


def test_all_zero_tensor():
    q, s = quantize_block_fp8(torch.zeros(130, 3))
    assert torch.equal(s, torch.ones(2, 1))
    assert (q.float() == 0).all()
    assert torch.equal(dequantize_block_fp8(q, s), torch.zeros(130, 3))


def test_non_contiguous_input_and_tiny_blocks():
    w = make_weight((129, 300), seed=11).t()  # a transposed view
    assert not w.is_contiguous()
    q, s = quantize_block_fp8(w)
    _, scale32, q_ref = ref_quantize(w)
    assert torch.equal(s, scale32) and torch.equal(q.double(), q_ref)
    # a block whose amax / 448 would be a float32 subnormal gets the smallest normal scale instead
    tiny = torch.finfo(torch.float32).tiny
    w = torch.tensor([[3e-38, -1e-39, 0.0, 5e-45]])
    q, s = quantize_block_fp8(w)
    assert s.item() == tiny
    assert torch.isfinite(q.float()).all() and (q.float().abs() <= 448).all()
    x64, q64 = w.double(), q.double()
    assert torch.equal(q64, ref_round_e4m3(x64 / tiny))
    assert ((q64 * tiny - x64).abs() <= 2.0**-4 * x64.abs() + 2.0**-10 * tiny).all()


def test_bf16_input():
    w = make_weight((300, 130), seed=3).to(torch.bfloat16)
    q, s = quantize_block_fp8(w)
    q32, s32 = quantize_block_fp8(w.float())  # bf16 -> float32 is exact, so results must be identical
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(s, s32)
    _, scale32, q_ref = ref_quantize(w)
    assert torch.equal(s, scale32) and torch.equal(q.double(), q_ref)
    assert torch.isfinite(dequantize_block_fp8(q, s)).all()


def test_q_is_exactly_rounded_where_float32_double_rounds():
    """Find x with fl32(x / s) exactly on an e4m3 midpoint while the exact quotient is not, on the side
    where ties-to-even picks the wrong neighbour; the quantiser must still round the exact quotient."""
    amax = 447.3
    s = torch.tensor(amax, dtype=torch.float32) / 448.0
    s_frac = Fraction(s.item())
    mids = (GRID[1:] + GRID[:-1]) / 2
    case = None
    for m in mids.tolist():
        base = (torch.tensor(m, dtype=torch.float32) * s).view(torch.int32).item()
        for k in range(-4, 5):
            x = torch.tensor(base + k, dtype=torch.int32).view(torch.float32)
            if (x / s).item() != m or Fraction(x.item()) / s_frac == Fraction(m):
                continue
            exact = Fraction(x.item()) / s_frac
            naive = (x / s).to(torch.float8_e4m3fn).item()
            correct = ref_round_e4m3(torch.tensor([float(exact)], dtype=torch.float64)).item()
            if naive != correct:
                case = (x.item(), correct, naive)
                break
        if case:
            break
    assert case is not None, "no double-rounding case found"
    x, correct, naive = case
    q, scale = quantize_block_fp8(torch.tensor([[amax, x]], dtype=torch.float32))
    assert scale.item() == s.item()
    assert q.float()[0, 1].item() == correct != naive
    assert q.float()[0, 0].item() == 448.0


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_block_fp8(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_block_fp8(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="2-D"):
        quantize_block_fp8(torch.ones(4))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight"):
        list(
            quantize_named_tensors([("model.layers.0.self_attn.o_proj.weight", torch.full((2, 2), math.inf))])
        )


# (name, shape, expected) from Qwen3-MoE (Qwen3-30B-A3B), Qwen2-MoE and DeepSeek-V3 HF checkpoints (shapes
# shrunk); for DeepSeek-V3 the expectation is whether the official FP8 checkpoint carries a weight_scale_inv.
NAMES = [
    # Qwen3-MoE
    ("model.embed_tokens.weight", (64, 16), False),
    ("model.layers.0.input_layernorm.weight", (16,), False),
    ("model.layers.0.post_attention_layernorm.weight", (16,), False),
    ("model.layers.0.self_attn.q_proj.weight", (32, 16), True),
    ("model.layers.0.self_attn.k_proj.weight", (8, 16), True),
    ("model.layers.0.self_attn.v_proj.weight", (8, 16), True),
    ("model.layers.0.self_attn.o_proj.weight", (16, 32), True),
    ("model.layers.0.self_attn.q_norm.weight", (8,), False),
    ("model.layers.0.self_attn.k_norm.weight", (8,), False),
    ("model.layers.0.mlp.gate.weight", (4, 16), False),  # router: 2-D but never FP8
    ("model.layers.0.mlp.experts.0.gate_proj.weight", (12, 16), True),
    ("model.layers.0.mlp.experts.0.up_proj.weight", (12, 16), True),
    ("model.layers.47.mlp.experts.127.down_proj.weight", (16, 12), True),
    ("model.norm.weight", (16,), False),
    ("lm_head.weight", (64, 16), False),
    # Qwen2-style biases and Qwen2-MoE shared expert
    ("model.layers.0.self_attn.q_proj.bias", (32,), False),
    ("model.layers.0.mlp.shared_expert.gate_proj.weight", (12, 16), True),
    ("model.layers.0.mlp.shared_expert_gate.weight", (1, 16), False),
    # DeepSeek-V3: MLA, dense first layers, routed + shared experts, sigmoid router bias, MTP layer 61
    ("model.layers.0.self_attn.q_a_proj.weight", (24, 16), True),
    ("model.layers.0.self_attn.q_a_layernorm.weight", (24,), False),
    ("model.layers.0.self_attn.q_b_proj.weight", (48, 24), True),
    ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (18, 16), True),
    ("model.layers.0.self_attn.kv_a_layernorm.weight", (16,), False),
    ("model.layers.0.self_attn.kv_b_proj.weight", (64, 16), True),
    ("model.layers.0.mlp.gate_proj.weight", (40, 16), True),
    ("model.layers.0.mlp.up_proj.weight", (40, 16), True),
    ("model.layers.0.mlp.down_proj.weight", (16, 40), True),
    ("model.layers.3.mlp.gate.weight", (8, 16), False),
    ("model.layers.3.mlp.gate.e_score_correction_bias", (8,), False),
    ("model.layers.3.mlp.experts.255.gate_proj.weight", (12, 16), True),
    ("model.layers.3.mlp.shared_experts.down_proj.weight", (16, 12), True),
    ("model.layers.61.enorm.weight", (16,), False),
    ("model.layers.61.hnorm.weight", (16,), False),
    ("model.layers.61.eh_proj.weight", (16, 32), False),
    ("model.layers.61.embed_tokens.weight", (64, 16), False),
    ("model.layers.61.shared_head.norm.weight", (16,), False),
    ("model.layers.61.shared_head.head.weight", (64, 16), False),
    ("model.layers.61.self_attn.kv_b_proj.weight", (64, 16), True),
    ("model.layers.61.mlp.experts.0.down_proj.weight", (16, 12), True),
    # not something to quantise again / not a per-expert 2-D weight
    ("model.layers.0.self_attn.o_proj.weight_scale_inv", (1, 1), False),
    ("model.layers.0.mlp.experts.gate_up_proj", (4, 24, 16), False),
]


@pytest.mark.parametrize(("name", "shape", "expected"), NAMES, ids=[n for n, _, _ in NAMES])
def test_should_quantize(name, shape, expected):
    assert should_quantize(name, torch.zeros(shape)) is expected
    assert should_quantize(name, torch.zeros(shape, dtype=torch.bfloat16)) is expected


def test_should_quantize_rejects_fp8_and_non_2d():
    assert not should_quantize(
        "model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    )
    assert not should_quantize("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 4, 4))
    assert not should_quantize("model.layers.0.self_attn.q_proj.weight", torch.zeros(16))


def test_fp8_quantization_config():
    cfg = fp8_quantization_config()
    assert cfg == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    cfg["weight_block_size"].append(1)  # callers get a fresh dict
    assert fp8_quantization_config()["weight_block_size"] == [128, 128]


def test_quantize_named_tensors_streams_in_order_and_round_trips_safetensors():
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (50, 40),
        "model.layers.0.input_layernorm.weight": (40,),
        "model.layers.0.self_attn.q_proj.weight": (130, 40),
        "model.layers.0.self_attn.q_norm.weight": (8,),
        "model.layers.0.mlp.gate.weight": (4, 40),
        "model.layers.0.mlp.experts.0.gate_proj.weight": (24, 40),
        "model.layers.0.mlp.experts.0.down_proj.weight": (40, 24),
        "model.norm.weight": (40,),
        "lm_head.weight": (50, 40),
    }
    items = [(n, torch.randn(shape, generator=g).to(torch.bfloat16)) for n, shape in shapes.items()]

    pulled: list[str] = []

    def source():
        for name, t in items:
            pulled.append(name)
            yield name, t

    stream = quantize_named_tensors(source())
    assert pulled == []  # lazy
    first = next(stream)
    assert first[0] == "model.embed_tokens.weight" and first[1] is items[0][1] and pulled == [first[0]]
    out = [first, *stream]
    assert pulled == list(shapes)

    expected_names = []
    for name, t in items:
        expected_names.append(name)
        if should_quantize(name, t):
            expected_names.append(name.removesuffix(".weight") + ".weight_scale_inv")
    assert [n for n, _ in out] == expected_names
    assert sum(n.endswith("weight_scale_inv") for n in expected_names) == 3

    original = dict(items)
    produced = dict(out)
    for name, t in produced.items():
        if name.endswith(".weight_scale_inv"):
            continue
        src = original[name]
        if should_quantize(name, src):
            scale = produced[name + "_scale_inv"]
            q_ref, s_ref = quantize_block_fp8(src)
            assert t.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
            assert torch.equal(t.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, s_ref)
            assert scale.shape == (math.ceil(src.shape[0] / 128), math.ceil(src.shape[1] / 128))
        else:
            assert t is src

    blob = save(produced)
    loaded = load(blob)
    assert set(loaded) == set(produced)
    for name, t in produced.items():
        back = loaded[name]
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert save(loaded) == blob
