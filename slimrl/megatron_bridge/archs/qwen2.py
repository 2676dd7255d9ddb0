"""Qwen2: GQA with a bias on the q/k/v projections; small sizes tie embeddings."""

from slimrl.megatron_bridge.archs.base import ArchSpec

SPEC = ArchSpec(model_type="qwen2", hf_architecture="Qwen2ForCausalLM", qkv_bias=True)
