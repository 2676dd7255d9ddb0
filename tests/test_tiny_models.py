"""Tiny random checkpoints: loadable offline, deterministic by seed, readable by read_model_arch."""

import json
import os
from pathlib import Path

import pytest
from safetensors import safe_open

from slimrl.data.tiny_models import TINY_ARCHS, make_tiny, padded_vocab_size
from slimrl.data.tokenizer import EOS_TOKEN_ID, PAD_TOKEN_ID, VOCAB_SIZE
from slimrl.errors import SlimError
from slimrl.megatron_bridge.archs import read_model_arch

os.environ["HF_HUB_OFFLINE"] = "1"  # none of the imports above loads huggingface_hub

VOCAB = 104  # 99 tokenizer ids padded up to a multiple of 8


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(arch, root / arch) for arch in TINY_ARCHS}


def _tensor_names(ckpt: Path) -> set[str]:
    with safe_open(ckpt / "model.safetensors", "pt") as handle:
        return set(handle.keys())


def test_vocab_padding() -> None:
    assert padded_vocab_size() == VOCAB and VOCAB % 8 == 0 and VOCAB >= VOCAB_SIZE


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_loads_offline_and_forwards(arch: str, tiny_dirs: dict[str, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = tiny_dirs[arch]
    assert {p.name for p in ckpt.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(".")], "temp dirs left behind"
    model, info = AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.float32
    assert type(model).__name__ == json.loads((ckpt / "config.json").read_text())["architectures"][0]
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    ids = torch.tensor([tokenizer.encode("12+34=")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 6, VOCAB)
    assert torch.isfinite(logits).all()
    generation = json.loads((ckpt / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOS_TOKEN_ID and generation["pad_token_id"] == PAD_TOKEN_ID


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_seed_determines_bytes(arch: str, tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    same = make_tiny(arch, tmp_path / "same", seed=0)
    other = make_tiny(arch, tmp_path / "other", seed=1)
    reference = (tiny_dirs[arch] / "model.safetensors").read_bytes()
    assert (same / "model.safetensors").read_bytes() == reference
    assert (same / "config.json").read_bytes() == (tiny_dirs[arch] / "config.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != reference


def test_no_constant_tensors(tiny_dirs: dict[str, Path]) -> None:
    """Norm weights and biases are perturbed, so a conversion that swaps or drops them is detectable."""
    for arch, ckpt in tiny_dirs.items():
        with safe_open(ckpt / "model.safetensors", "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                tensor = handle.get_tensor(name)
                assert tensor.unique().numel() > 1, f"{arch}: {name} is constant"


EXPECTED = {
    # arch: (layers, query groups, tied, qkv bias, qk norm, experts, topk, moe ffn, layer pattern)
    "qwen3_moe": (2, 2, False, False, True, 4, 2, 32, (1, 1)),
    "qwen3": (2, 2, False, False, True, None, 0, None, ()),
    "qwen2": (2, 2, True, True, False, None, 0, None, ()),
    "llama": (2, 2, False, False, False, None, 0, None, ()),
    "deepseek_v3": (3, 4, False, False, False, 4, 2, 32, (0, 1, 1)),
}


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_read_model_arch(arch: str, tiny_dirs: dict[str, Path]) -> None:
    layers, groups, tied, bias, qk_norm, experts, topk, moe_ffn, pattern = EXPECTED[arch]
    got = read_model_arch(tiny_dirs[arch])
    assert got.model_type == arch
    assert (got.num_layers, got.hidden_size, got.ffn_hidden_size, got.num_attention_heads) == (
        layers,
        64,
        128,
        4,
    )
    assert got.num_query_groups == groups
    assert got.tie_word_embeddings is tied and got.qkv_bias is bias and got.qk_norm is qk_norm
    assert (got.num_experts, got.moe_topk, got.moe_ffn_hidden_size, got.moe_layer_pattern) == (
        experts,
        topk,
        moe_ffn,
        pattern,
    )
    assert got.vocab_size == VOCAB and got.max_position_embeddings == 512
    assert got.rope_theta == 10000.0 and got.norm_eps == 1e-6
    if arch != "deepseek_v3":
        assert got.head_dim == 16 and got.mla is None
    tensors = _tensor_names(tiny_dirs[arch])
    assert ("lm_head.weight" in tensors) is not tied


def test_qwen3_moe_details(tiny_dirs: dict[str, Path]) -> None:
    cfg = json.loads((tiny_dirs["qwen3_moe"] / "config.json").read_text())
    assert cfg["num_experts"] == 4 and "num_local_experts" not in cfg
    assert cfg["norm_topk_prob"] is True and cfg["decoder_sparse_step"] == 1
    assert read_model_arch(tiny_dirs["qwen3_moe"]).shared_expert_ffn_hidden_size is None


def test_deepseek_v3_details(tiny_dirs: dict[str, Path]) -> None:
    got = read_model_arch(tiny_dirs["deepseek_v3"])
    assert got.mla is not None
    assert (got.mla.q_lora_rank, got.mla.kv_lora_rank) == (None, 32)
    assert (got.mla.qk_nope_head_dim, got.mla.qk_rope_head_dim, got.mla.v_head_dim) == (16, 8, 16)
    assert got.shared_expert_ffn_hidden_size == 32
    assert got.router_score_function == "sigmoid" and got.router_expert_bias
    assert (got.router_topk_scaling_factor, got.router_num_groups, got.router_group_topk) == (1.0, 1, 1)
    cfg = json.loads((tiny_dirs["deepseek_v3"] / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "default"
    tensors = _tensor_names(tiny_dirs["deepseek_v3"])
    assert "model.layers.0.mlp.gate_proj.weight" in tensors  # first layer dense
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in tensors
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in tensors


def test_override_num_experts(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = make_tiny("qwen3_moe", tmp_path / "m", overrides={"num_experts": 3})
    assert json.loads((ckpt / "config.json").read_text())["num_experts"] == 3
    assert read_model_arch(ckpt).num_experts == 3
    tensors = _tensor_names(ckpt)
    assert "model.layers.0.mlp.experts.2.up_proj.weight" in tensors
    assert "model.layers.0.mlp.experts.3.up_proj.weight" not in tensors
    with safe_open(ckpt / "model.safetensors", "pt") as handle:
        assert handle.get_slice("model.layers.1.mlp.gate.weight").get_shape() == [3, 64]
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, VOCAB)


def test_override_tie_heads_and_rope(tmp_path: Path) -> None:
    ckpt = make_tiny(
        "qwen3",
        tmp_path / "m",
        overrides={"tie_word_embeddings": True, "num_key_value_heads": 4, "rope_theta": 1e6},
    )
    got = read_model_arch(ckpt)
    assert got.tie_word_embeddings and got.num_query_groups == 4 and got.rope_theta == 1e6
    assert "lm_head.weight" not in _tensor_names(ckpt)


def test_existing_dir_needs_force(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SlimError, match=r"exists; pass --force"):
        make_tiny("qwen3", out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    make_tiny("qwen3", out, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_bad_override_key(tmp_path: Path) -> None:
    with pytest.raises(SlimError, match="num_expertz") as excinfo:
        make_tiny("qwen3_moe", tmp_path / "m", overrides={"num_expertz": 3})
    assert "\n" not in str(excinfo.value)
    with pytest.raises(SlimError, match="model_type"):
        make_tiny("qwen3", tmp_path / "m", overrides={"model_type": "llama"})
    assert not list(tmp_path.iterdir())


def test_bad_values_and_arch(tmp_path: Path) -> None:
    with pytest.raises(SlimError, match="vocab_size"):
        make_tiny("llama", tmp_path / "m", overrides={"vocab_size": 50})
    with pytest.raises(SlimError, match="qwen3_moe"):
        make_tiny("mixtral", tmp_path / "m")
    with pytest.raises(SlimError, match="hidden_size") as excinfo:
        make_tiny("llama", tmp_path / "m", overrides={"hidden_size": "wide"})
    assert "\n" not in str(excinfo.value)
    assert not list(tmp_path.iterdir())
