"""Llama: GQA, SwiGLU; q/k/v bias only when `attention_bias` is set."""

from slimrl.megatron_bridge.archs.base import ArchSpec

SPEC = ArchSpec(model_type="llama", hf_architecture="LlamaForCausalLM", qkv_bias="attention_bias")
