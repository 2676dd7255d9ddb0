"""A synthetic Qwen3-MoE Hugging Face checkpoint of a chosen size, written straight to safetensors.

No transformers model is built (that would need the memory we are measuring); tensors are random
bf16, sharded like hub checkpoints, with an index and a config.json that `slimrl` reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from slimrl.megatron_bridge.hf_io import ShardWriter, finalize_index


def qwen3_moe_config(num_layers: int, hidden: int, experts: int, moe_ffn: int, vocab: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": hidden // 16,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "num_experts": experts,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": moe_ffn,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "dtype": "bfloat16",
    }


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, d, v = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    q, kv, e, f = (
        cfg["num_attention_heads"] * d,
        cfg["num_key_value_heads"] * d,
        cfg["num_experts"],
        cfg["moe_intermediate_size"],
    )
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate.weight": (e, h),
        }
        for expert in range(e):
            x = f"{p}mlp.experts.{expert}."
            shapes |= {
                x + "gate_proj.weight": (f, h),
                x + "up_proj.weight": (f, h),
                x + "down_proj.weight": (h, f),
            }
    return shapes


def write_checkpoint(out: Path, target_gb: float = 1.1, shard_gb: float = 0.5, seed: int = 0) -> Path:
    """Scale the layer count to reach about `target_gb` of bf16 weights."""
    per_layer = qwen3_moe_config(1, 1024, 32, 640, 32000)
    layer_bytes = (
        sum(torch.Size(s).numel() for n, s in tensor_shapes(per_layer).items() if ".layers." in n) * 2
    )
    fixed = 2 * 32000 * 1024 * 2
    layers = max(1, round((target_gb * 1024**3 - fixed) / layer_bytes))
    cfg = qwen3_moe_config(layers, 1024, 32, 640, 32000)
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out, max_shard_bytes=int(shard_gb * 1024**3))
    generator = torch.Generator().manual_seed(seed)
    for name, shape in tensor_shapes(cfg).items():
        writer.add(name, (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16))
    writer.flush()
    finalize_index(out, writer.files, writer.bytes_written)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


if __name__ == "__main__":
    import sys

    print(write_checkpoint(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 1.1))
    _ = save_file  # re-exported for callers that write single files
