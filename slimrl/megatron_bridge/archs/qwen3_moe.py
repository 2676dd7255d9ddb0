"""Qwen3-MoE: GQA with per-head q/k RMSNorm, softmax top-k router, no shared experts."""

from slimrl.megatron_bridge.archs.base import ArchSpec, MoEKeys, qwen_moe_layer

SPEC = ArchSpec(
    model_type="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    qk_norm=True,
    moe=MoEKeys(layer_rule=qwen_moe_layer),
)
