"""A model's architecture in one canonical form, read from a Hugging Face config.json.

Each supported `model_type` registers an `ArchSpec` (see `archs/`); the spec says how its HF
config keys map onto `ModelArch` and how its tensors map onto Megatron-Core's. Everything else
(parallel checks, TransformerConfig, conversion, weight sync) reads `ModelArch` only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimrl.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class MLADims:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, kw_only=True)
class ModelArch:
    model_type: str
    hf_architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    norm_eps: float
    tie_word_embeddings: bool
    qk_norm: bool = False
    qkv_bias: bool = False
    num_experts: int | None = None
    moe_topk: int = 0
    moe_ffn_hidden_size: int | None = None
    moe_norm_topk_prob: bool = True
    moe_layer_pattern: tuple[int, ...] = ()
    """Per layer: 1 if the MLP is an MoE layer, 0 if dense (empty: all dense)."""
    shared_expert_ffn_hidden_size: int | None = None
    router_score_function: str = "softmax"
    router_expert_bias: bool = False
    router_topk_scaling_factor: float | None = None
    router_num_groups: int | None = None
    router_group_topk: int | None = None
    mla: MLADims | None = None
    rope_interleaved: bool = False
    """RoPE on interleaved pairs (DeepSeek's layout) instead of rotate-half."""
    rope_scaling: dict[str, Any] | None = None
    """YaRN parameters (`factor`, `original_max_position_embeddings`, `beta_fast`, ...), if any."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)


def rope_theta_of(cfg: dict[str, Any]) -> float:
    """transformers 5 nests RoPE settings in `rope_parameters`; older configs keep `rope_theta`."""
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def rope_scaling_of(cfg: dict[str, Any]) -> dict[str, Any] | None:
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    return {**params, "rope_type": kind}


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"model.hf_checkpoint: no config.json in {hf_dir}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
