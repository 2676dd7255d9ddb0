"""What an architecture file declares: how its HF config reads into `ModelArch`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slimrl.megatron_bridge.model_arch import MLADims, ModelArch, rope_theta_of

LayerRule = Callable[[dict[str, Any], int], bool]


def every_layer_moe(cfg: dict[str, Any], layer: int) -> bool:
    return True


def qwen_moe_layer(cfg: dict[str, Any], layer: int) -> bool:
    """Qwen2/3-MoE: `mlp_only_layers` are dense; otherwise every `decoder_sparse_step`-th layer is MoE."""
    if layer in (cfg.get("mlp_only_layers") or []):
        return False
    step = cfg.get("decoder_sparse_step", 1)
    return step > 0 and (layer + 1) % step == 0


def deepseek_moe_layer(cfg: dict[str, Any], layer: int) -> bool:
    """DeepSeek-V3: the first `first_k_dense_replace` layers are dense."""
    return layer >= cfg.get("first_k_dense_replace", 0) and layer % cfg.get("moe_layer_freq", 1) == 0


@dataclass(frozen=True, kw_only=True)
class MoEKeys:
    num_experts: str = "num_experts"
    ffn_hidden_size: str = "moe_intermediate_size"
    layer_rule: LayerRule = every_layer_moe
    shared_experts: str | None = None
    """Key of the shared-expert count (its width is count * moe ffn)."""
    router_score_function: str = "softmax"
    router_expert_bias: bool = False


@dataclass(frozen=True, kw_only=True)
class ArchSpec:
    model_type: str
    hf_architecture: str
    qk_norm: bool = False
    qkv_bias: bool | str = False
    """A constant, or the HF key that says whether q/k/v projections have a bias."""
    moe: MoEKeys | None = None
    mla: bool = False

    def read_arch(self, cfg: dict[str, Any]) -> ModelArch:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        layers = cfg["num_hidden_layers"]
        qkv_bias = bool(cfg.get(self.qkv_bias, False)) if isinstance(self.qkv_bias, str) else self.qkv_bias
        moe_fields: dict[str, Any] = {}
        if self.moe is not None and cfg.get(self.moe.num_experts, cfg.get("num_local_experts")):
            moe_ffn = cfg[self.moe.ffn_hidden_size]
            shared = cfg.get(self.moe.shared_experts) if self.moe.shared_experts else None
            moe_fields = dict(
                num_experts=cfg.get(self.moe.num_experts, cfg.get("num_local_experts")),
                moe_topk=cfg["num_experts_per_tok"],
                moe_ffn_hidden_size=moe_ffn,
                moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                moe_layer_pattern=tuple(int(self.moe.layer_rule(cfg, i)) for i in range(layers)),
                shared_expert_ffn_hidden_size=shared * moe_ffn if shared else None,
                router_score_function=cfg.get("scoring_func", self.moe.router_score_function),
                router_expert_bias=self.moe.router_expert_bias,
                router_topk_scaling_factor=cfg.get("routed_scaling_factor"),
                router_num_groups=cfg.get("n_group"),
                router_group_topk=cfg.get("topk_group"),
            )
        mla = None
        if self.mla:
            mla = MLADims(
                q_lora_rank=cfg.get("q_lora_rank"),
                kv_lora_rank=cfg["kv_lora_rank"],
                qk_nope_head_dim=cfg["qk_nope_head_dim"],
                qk_rope_head_dim=cfg["qk_rope_head_dim"],
                v_head_dim=cfg["v_head_dim"],
            )
        return ModelArch(
            model_type=self.model_type,
            hf_architecture=self.hf_architecture,
            num_layers=layers,
            hidden_size=hidden,
            ffn_hidden_size=cfg["intermediate_size"],
            num_attention_heads=heads,
            num_query_groups=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_theta=rope_theta_of(cfg),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=self.qk_norm,
            qkv_bias=qkv_bias,
            mla=mla,
            **moe_fields,
        )
