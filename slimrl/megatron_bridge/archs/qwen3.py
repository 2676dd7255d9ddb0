"""Qwen3 dense: GQA with per-head q/k RMSNorm, SwiGLU MLP."""

from slimrl.megatron_bridge.archs.base import ArchSpec

SPEC = ArchSpec(model_type="qwen3", hf_architecture="Qwen3ForCausalLM", qk_norm=True)
