"""DeepSeek-V3: MLA attention, first-k dense layers, shared experts, sigmoid router with bias."""

from slimrl.megatron_bridge.archs.base import ArchSpec, MoEKeys, deepseek_moe_layer

SPEC = ArchSpec(
    model_type="deepseek_v3",
    hf_architecture="DeepseekV3ForCausalLM",
    mla=True,
    moe=MoEKeys(
        num_experts="n_routed_experts",
        layer_rule=deepseek_moe_layer,
        shared_experts="n_shared_experts",
        router_score_function="sigmoid",
        router_expert_bias=True,
    ),
    # SGLang fuses these two into `fused_qkv_a_proj_with_mqa` when `q_lora_rank` is set, and only
    # when one `load_weights` call holds both (`deepseek_weight_loader.py`, `cached_a_proj`).
    load_together=(("q_a_proj", "kv_a_proj_with_mqa"),),
)
