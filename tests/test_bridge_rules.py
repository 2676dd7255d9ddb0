"""Bridge rules without Megatron: layout transforms are exact inverses, every HF tensor has a rule."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from slimrl.data.tiny_models import TINY_ARCHS
from slimrl.megatron_bridge.archs import ARCH_SPECS, read_model_arch
from slimrl.megatron_bridge.naming import canonical_name
from slimrl.megatron_bridge.transforms import hf_to_megatron_full, megatron_full_to_hf, shard, unshard


@pytest.fixture(scope="module")
def gqa_arch(tiny_model):
    return read_model_arch(tiny_model("qwen3"))  # 4 heads, 2 query groups, head_dim 16


def test_qkv_interleave_is_per_query_group(gqa_arch):
    d, hidden = gqa_arch.head_dim, gqa_arch.hidden_size
    q = torch.arange(4 * d).float().unsqueeze(1).expand(-1, hidden) + 1000
    k = torch.arange(2 * d).float().unsqueeze(1).expand(-1, hidden) + 2000
    v = torch.arange(2 * d).float().unsqueeze(1).expand(-1, hidden) + 3000
    fused = hf_to_megatron_full("qkv", [q, k, v], gqa_arch, 0)
    rows = fused[:, 0].tolist()
    # group 0 = [q heads 0,1 ; k head 0 ; v head 0], then group 1
    assert rows[: 2 * d] == list(range(1000, 1000 + 2 * d))
    assert rows[2 * d : 3 * d] == list(range(2000, 2000 + d))
    assert rows[3 * d : 4 * d] == list(range(3000, 3000 + d))
    assert rows[4 * d : 6 * d] == list(range(1000 + 2 * d, 1000 + 4 * d))
    back = megatron_full_to_hf("qkv", fused, gqa_arch)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v], strict=True))
    # TP2 splits whole query groups: rank 1 holds exactly group 1.
    assert torch.equal(shard("qkv", fused, 0, 1, 2), fused[4 * d :])


def test_qkv_bias_round_trips(gqa_arch):
    parts = [torch.randn(4 * 16), torch.randn(2 * 16), torch.randn(2 * 16)]
    fused = hf_to_megatron_full("qkv", parts, gqa_arch, 0)
    assert all(
        torch.equal(a, b) for a, b in zip(megatron_full_to_hf("qkv", fused, gqa_arch), parts, strict=True)
    )


@pytest.mark.parametrize("size", [1, 2, 4])
def test_gate_up_shards_hold_matching_halves(gqa_arch, size):
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    full = hf_to_megatron_full("gate_up", [gate, up], gqa_arch, 0)
    shards = [shard("gate_up", full, 0, r, size) for r in range(size)]
    for r, piece in enumerate(shards):  # each rank: [its gate rows; its up rows]
        assert torch.equal(piece, torch.cat([gate.chunk(size)[r], up.chunk(size)[r]]))
    assert torch.equal(unshard("gate_up", shards, 0), full)


def test_vocab_padding_is_zero_and_dropped_on_export(gqa_arch):
    weight = torch.randn(gqa_arch.vocab_size, 4)
    padded = hf_to_megatron_full("vocab", [weight], gqa_arch, gqa_arch.vocab_size + 3)
    assert padded.shape[0] == gqa_arch.vocab_size + 3 and padded[-3:].abs().sum() == 0
    assert torch.equal(megatron_full_to_hf("vocab", padded, gqa_arch)[0], weight)


@pytest.mark.parametrize("interleave", [True, False])
def test_mla_rope_rows_round_trip(tiny_model, interleave):
    arch = read_model_arch(tiny_model("deepseek_v3", rope_interleave=interleave))
    q = torch.randn(arch.num_attention_heads * (arch.mla.qk_nope_head_dim + arch.mla.qk_rope_head_dim), 8)
    for kind in ("mla_q", "mla_kv"):
        full = hf_to_megatron_full(kind, [q], arch, 0)
        assert torch.equal(megatron_full_to_hf(kind, full, arch)[0], q)
        if kind == "mla_q":  # nope rows stay, rope rows move
            assert torch.equal(full[: arch.mla.qk_nope_head_dim], q[: arch.mla.qk_nope_head_dim])
            assert not torch.equal(full, q)


@pytest.mark.parametrize("arch_name", TINY_ARCHS)
def test_every_hf_tensor_has_exactly_one_rule(tiny_model, arch_name):
    """Silent drops are impossible: enumerate the rules over all layers/experts and cover the file."""
    path = tiny_model(arch_name)
    arch = read_model_arch(path)
    rules = ARCH_SPECS[arch.model_type].rules(arch)
    with safe_open(str(path / "model.safetensors"), "pt") as handle:
        hf_names = set(handle.keys())
    produced: list[str] = []
    for rule in rules.rules:
        for layer in range(arch.num_layers):
            for expert in range(arch.num_experts or 1):
                fields = {"layer": str(layer), "expert": str(expert)}
                names = rule.hf_names(fields)
                if all(n in hf_names for n in names):
                    produced.extend(names)
    assert set(produced) == hf_names


def test_canonical_names_cover_stage_offsets_experts_and_te_aliases():
    layers = {0: 6, 1: 7}  # a pipeline stage holding global layers 6 and 7
    assert (
        canonical_name("decoder.layers.1.mlp.linear_fc2.weight", layers, 0)
        == "decoder.layers.7.mlp.linear_fc2.weight"
    )
    assert (
        canonical_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", layers, 4)
        == "decoder.layers.6.mlp.experts.local_experts.5.linear_fc1.weight"
    )
    te = {
        "0.self_attention.linear_qkv.layer_norm_weight": "6.input_layernorm.weight",
        "0.mlp.linear_fc1.layer_norm_weight": "6.pre_mlp_layernorm.weight",
        "1.mlp.experts.linear_fc2.weight3": "7.mlp.experts.local_experts.11.linear_fc2.weight",
    }
    for te_name, canonical in te.items():
        assert canonical_name("decoder.layers." + te_name, layers, 8) == "decoder.layers." + canonical
