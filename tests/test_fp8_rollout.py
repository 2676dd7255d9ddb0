"""FP8 rollout: what we send an FP8 SGLang server, loaded and dequantised by SGLang 0.5.23's own code.

SGLang's own pieces, run in-process on CPU: `Fp8Config.from_config` (parses our config.json),
its `QKVParallelLinear` / `MergedColumnParallelLinear` / `RowParallelLinear` built with that config
(so `Fp8LinearMethod.create_weights` makes the e4m3 `weight` and float32 `weight_scale_inv`
parameters), their `weight_loader`s fed with the shard ids Qwen3's `load_weights` uses, and
`fp8_utils.block_quant_dequant`.  `process_weights_after_loading` is not run: on CPU it needs AMX
(see docs/rollout.md, "FP8 rollout"); on GPUs its 128x128 path rewrites the data in place.

Error bound (from the e4m3 format, not from our code): in a block with scale ``s`` every element
is stored as ``q * s`` with ``q = w / s`` rounded to nearest on the e4m3 grid, ``|w / s| <= 448``.
e4m3 has 3 mantissa bits, so for a normal ``|w / s| >= 2**-6`` the rounding error is at most half
an ulp, ``<= 2**-4 * |w / s|``; below 2**-6 the grid is uniform with spacing 2**-9, error
``<= 2**-10``.  Hence ``|w - q * s| <= 2**-4 * |w| + 2**-10 * s`` per element, plus float32
rounding of the product (``<= 2**-24`` relative, covered by ``EPS`` below).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from slimrl.megatron_bridge.hf_io import HFCheckpointReader
from slimrl.weight_sync import wire
from slimrl.weight_sync.fp8 import fp8_bucket, fp8_hf_config, write_fp8_checkpoint

BLOCK = 128
EPS = 2.0**-20  # float32 slack, relative to the block's largest magnitude


def e4m3_bound(w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Per-element bound on |w - dequant(quant(w))| from the e4m3 format (module docstring);
    the scale is the block's amax / 448, as the DeepSeek-V3 FP8 recipe defines it."""
    w = w.float()
    rows, cols = w.shape
    amax = torch.zeros(math.ceil(rows / block), math.ceil(cols / block))
    for i in range(amax.shape[0]):
        for j in range(amax.shape[1]):
            amax[i, j] = w[i * block : (i + 1) * block, j * block : (j + 1) * block].abs().max()
    per_elem = amax.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return 2.0**-4 * w.abs() + 2.0**-10 * per_elem / 448.0 + EPS * per_elem


def sglang_fp8_config():
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    return Fp8Config.from_config(fp8_hf_config({"model_type": "qwen3"})["quantization_config"])


def sglang_dequant(layer: torch.nn.Module) -> torch.Tensor:
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.dtype == torch.float32
    return block_quant_dequant(layer.weight.data, layer.weight_scale_inv.data, [BLOCK, BLOCK], torch.float32)


def load_into(layer: torch.nn.Module, sent: dict[str, torch.Tensor], prefix: str, shard_id=None) -> None:
    """What a model's `load_weights` does for one HF tensor pair: each parameter's own loader."""
    for suffix in ("weight", "weight_scale_inv"):
        param = getattr(layer, suffix)
        args = () if shard_id is None else (shard_id,)
        param.weight_loader(param, sent[f"{prefix}.{suffix}"], *args)


def assert_within_e4m3(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got - want.float()).abs()
    bound = e4m3_bound(want)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    assert err.max().item() > 0  # e4m3 is lossy: an exact match would mean we sent something else


@pytest.fixture(scope="module")
def trainer_weights() -> dict[str, torch.Tensor]:
    """bf16 weights of one Qwen3-style layer (q: 2 heads x 128, k/v: 1 head, MLP 256), a partial-block
    matrix and the tensors that must stay bf16; magnitudes spread over decades, as real weights."""
    g = torch.Generator().manual_seed(0)

    def w(rows: int, cols: int) -> torch.Tensor:
        scale = torch.logspace(-4, 0, cols)[torch.randperm(cols, generator=g)]
        return (torch.randn(rows, cols, generator=g) * scale).to(torch.bfloat16)

    p = "model.layers.0."
    return {
        f"{p}self_attn.q_proj.weight": w(256, 256), f"{p}self_attn.k_proj.weight": w(128, 256),
        f"{p}self_attn.v_proj.weight": w(128, 256), f"{p}self_attn.o_proj.weight": w(256, 256),
        f"{p}mlp.gate_proj.weight": w(384, 256), f"{p}mlp.up_proj.weight": w(384, 256),
        f"{p}mlp.down_proj.weight": w(200, 300),  # partial edge blocks in both dimensions
        f"{p}input_layernorm.weight": w(1, 256)[0], f"{p}mlp.gate.weight": w(8, 256),
        "model.embed_tokens.weight": w(100, 256), "lm_head.weight": w(100, 256),
    }  # fmt: skip


def test_bucket_layout_names_dtypes_and_scale_shapes(trainer_weights) -> None:
    sent = fp8_bucket(trainer_weights.items())
    names = [n for n, _ in sent]
    sent_by_name = dict(sent)
    for name, tensor in trainer_weights.items():
        if ".self_attn." in name or name.endswith("_proj.weight"):
            q, s = sent_by_name[name], sent_by_name[name + "_scale_inv"]
            assert q.dtype == torch.float8_e4m3fn and q.shape == tensor.shape
            rows, cols = tensor.shape
            assert s.dtype == torch.float32
            assert tuple(s.shape) == (math.ceil(rows / 128), math.ceil(cols / 128))
            assert names.index(name + "_scale_inv") == names.index(name) + 1
        else:  # norms, router gate, embeddings, lm_head: bf16 as in DeepSeek-V3 / Qwen3 FP8 checkpoints
            assert sent_by_name[name] is tensor and name + "_scale_inv" not in sent_by_name
    assert len(sent) == len(trainer_weights) + 7


def test_sglang_loaders_and_dequant_give_back_trainer_weights(trainer_weights) -> None:
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    cfg, p = sglang_fp8_config(), "model.layers.0."
    sent = dict(fp8_bucket(trainer_weights.items()))
    kw = {"bias": False, "params_dtype": torch.bfloat16, "quant_config": cfg, "parallel_group": "replicated"}
    qkv = QKVParallelLinear(256, 128, 2, 1, prefix=f"{p}self_attn.qkv_proj", **kw)
    gate_up = MergedColumnParallelLinear(256, [384, 384], prefix=f"{p}mlp.gate_up_proj", **kw)
    o_proj = RowParallelLinear(256, 256, prefix=f"{p}self_attn.o_proj", **kw)
    down = RowParallelLinear(300, 200, prefix=f"{p}mlp.down_proj", **kw)
    for shard in ("q", "k", "v"):  # Qwen3ForCausalLM.load_weights' stacked_params_mapping
        load_into(qkv, sent, f"{p}self_attn.{shard}_proj", shard)
    for shard, proj in enumerate(("gate_proj", "up_proj")):
        load_into(gate_up, sent, f"{p}mlp.{proj}", shard)
    load_into(o_proj, sent, f"{p}self_attn.o_proj")
    load_into(down, sent, f"{p}mlp.down_proj")

    qkv_w = sglang_dequant(qkv)
    for (start, end), proj in zip(((0, 256), (256, 384), (384, 512)), ("q", "k", "v"), strict=True):
        assert_within_e4m3(qkv_w[start:end], trainer_weights[f"{p}self_attn.{proj}_proj.weight"])
    gate_up_w = sglang_dequant(gate_up)
    assert_within_e4m3(gate_up_w[:384], trainer_weights[f"{p}mlp.gate_proj.weight"])
    assert_within_e4m3(gate_up_w[384:], trainer_weights[f"{p}mlp.up_proj.weight"])
    assert_within_e4m3(sglang_dequant(o_proj), trainer_weights[f"{p}self_attn.o_proj.weight"])
    assert_within_e4m3(sglang_dequant(down), trainer_weights[f"{p}mlp.down_proj.weight"])


def test_fp8_bucket_survives_sglang_wire_decode(trainer_weights) -> None:
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    sent = fp8_bucket(trainer_weights.items())
    update = wire.tensor_update(sent, "v1")  # alive until decoded: it holds the shared segment
    entry = update.body(1)["serialized_named_tensors"][0]
    data = MultiprocessingSerializer.deserialize(entry)
    metadata = [
        FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel)
        for m in data["metadata"]
    ]
    bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=metadata)
    got = dict(bucket.reconstruct_tensors())
    assert got.keys() == dict(sent).keys()
    for name, tensor in sent:
        assert got[name].dtype == tensor.dtype
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8))


def test_start_checkpoint_parsed_and_read_by_sglang(tiny_model, tmp_path: Path) -> None:
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    src = tiny_model("qwen3", hidden_size=128, head_dim=64, num_attention_heads=2,
                     num_key_value_heads=2, intermediate_size=256)  # fmt: skip
    dst = write_fp8_checkpoint(src, tmp_path / "fp8")
    config = json.loads((dst / "config.json").read_text())
    cfg = Fp8Config.from_config(config["quantization_config"])
    assert cfg.is_checkpoint_fp8_serialized and cfg.weight_block_size == [128, 128]
    assert cfg.activation_scheme == "dynamic" and cfg.get_name() == "fp8"
    assert {p.name for p in src.iterdir()} - {p.name for p in dst.iterdir()} == {"model.safetensors"}

    original = HFCheckpointReader(src)
    files = sorted(str(f) for f in dst.glob("*.safetensors"))
    loaded = dict(safetensors_weights_iterator(files))
    quantised = [n for n in original.names if n.endswith("_proj.weight")]
    assert len(quantised) == 7 * config["num_hidden_layers"]
    assert set(loaded) == set(original.names) | {n + "_scale_inv" for n in quantised}
    for name in original.names:
        want = original.get(name)
        if name in quantised:
            got = block_quant_dequant(loaded[name], loaded[name + "_scale_inv"], [128, 128], torch.float32)
            assert_within_e4m3(got, want)
        else:
            assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want)


def test_start_checkpoint_refuses_quantised_source() -> None:
    with pytest.raises(ValueError, match="already quantised"):
        fp8_hf_config({"quantization_config": {"quant_method": "fp8"}})


def test_fp8_fleet_starts_from_one_block_fp8_copy_per_run(tiny_model, tmp_path) -> None:
    from slimrl.config.schema import SlimConfig
    from slimrl.orchestration.rl_loop import serving_checkpoint

    config = SlimConfig()
    config.model.hf_checkpoint = str(tiny_model("qwen3_moe"))
    assert serving_checkpoint(config, tmp_path) == config.model.hf_checkpoint  # bf16 fleet: as is
    config.rollout.sglang.quantization = "fp8"
    start = Path(serving_checkpoint(config, tmp_path))
    assert start == tmp_path / "fp8_start" and not (tmp_path / "fp8_start.partial").exists()
    quant = json.loads((start / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
    written = (start / "config.json").stat().st_mtime_ns
    assert serving_checkpoint(config, tmp_path) == str(start)  # a restarted engine reuses it
    assert (start / "config.json").stat().st_mtime_ns == written


def test_fp8_rollout_on_cpu_is_refused_at_load(tiny_model) -> None:
    from slimrl.errors import ConfigError
    from slimrl.preflight import load_config

    overrides = [f"model.hf_checkpoint={tiny_model('qwen3_moe')}", "rollout.sglang.quantization=fp8"]
    for engine in ("embedded", "sglang"):
        with pytest.raises(
            ConfigError, match=r"rollout.sglang.quantization=fp8: needs rollout.engine=sglang on GPUs"
        ):
            load_config(None, [*overrides, f"rollout.engine={engine}", "cluster.device=cpu"])
