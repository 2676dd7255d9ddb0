"""Registry of supported architectures, keyed by HF `model_type` (never by substring)."""

from slimrl.megatron_bridge.archs import deepseek_v3, llama, qwen2, qwen3, qwen3_moe
from slimrl.megatron_bridge.archs.base import ArchSpec

ARCH_SPECS: dict[str, ArchSpec] = {
    module.SPEC.model_type: module.SPEC for module in (qwen3_moe, qwen3, qwen2, llama, deepseek_v3)
}
