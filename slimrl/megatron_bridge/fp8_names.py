"""Which HF tensors an FP8 rollout serves as block-FP8, by name alone (no torch).

`fp8.should_quantize` applies these patterns to tensors (2-D floating-point ones only); the engine
memory plan (`slimrl/planning/engine_plan.py`) applies them to the tensors it counts, so both agree
on what an FP8 engine holds without importing torch at config load.
"""

from __future__ import annotations

import re

# Weights streamed as FP8: 2-D linear weights inside decoder layers.  Everything else (embeddings, lm_head,
# norms, router gates `mlp.gate.weight`, Qwen2-MoE's `shared_expert_gate`, biases, `e_score_correction_bias`,
# DeepSeek's MTP `eh_proj`, which SGLang builds as an unquantised nn.Linear) stays in its training dtype.
QUANTIZED_WEIGHT_PATTERNS: tuple[re.Pattern[str], ...] = (
    # attention: standard q/k/v/o and DeepSeek MLA projections
    re.compile(
        r"^model\.layers\.\d+\.self_attn\."
        r"(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight$"
    ),
    # MLP: dense, routed experts, shared experts (DeepSeek `shared_experts`, Qwen2-MoE `shared_expert`)
    re.compile(
        r"^model\.layers\.\d+\.mlp\.(experts\.\d+\.|shared_experts?\.)?(gate_proj|up_proj|down_proj)\.weight$"
    ),
)


def is_quantized_name(name: str) -> bool:
    """True if an FP8 server expects the HF tensor `name` (when 2-D) as FP8 with block scales."""
    return any(p.match(name) for p in QUANTIZED_WEIGHT_PATTERNS)
