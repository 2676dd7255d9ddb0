"""What an architecture file declares: how its HF config reads into `ModelArch`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slimrl.megatron_bridge.rules import RuleSet, WeightRule
from slimrl.model_arch import MLADims, ModelArch, rope_scaling_of, rope_theta_of

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
    hf_renames: tuple[tuple[str, str], ...] = ()
    """(standard HF template, this architecture's template) pairs, for checkpoints whose tensor
    names differ from the Llama/Qwen convention, e.g. Mixtral's `block_sparse_moe.experts.{expert}.w1`."""
    load_together: tuple[tuple[str, ...], ...] = ()
    """Sibling HF tensors SGLang's loader fuses only when one `load_weights` call brings all of
    them, as sets of the name component that differs (`bucketing.Together`); the weight sync never
    splits such a set across buckets."""

    def load_together_for(self, arch: ModelArch) -> tuple[tuple[str, ...], ...]:
        """The `load_together` sets this variant has: a set with a member no rule produces (MLA
        without `q_lora_rank` has no `q_a_proj`) would wait for it in vain."""
        parts = {part for rule in self.rules(arch).rules for hf in rule.hf for part in hf.split(".")}
        return tuple(members for members in self.load_together if set(members) <= parts)

    def rules(self, arch: ModelArch) -> RuleSet:
        renames = dict(self.hf_renames)
        rules = [
            WeightRule(r.megatron, tuple(renames.get(h, h) for h in r.hf), r.kind, r.export)
            for r in standard_rules(self, arch)
        ]
        return RuleSet(rules)

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
            rope_interleaved=self.mla and bool(cfg.get("rope_interleave", True)),
            rope_scaling=rope_scaling_of(cfg),
            **moe_fields,
        )


L = "decoder.layers.{layer}."
H = "model.layers.{layer}."


def standard_rules(spec: ArchSpec, arch: ModelArch) -> list[WeightRule]:
    """The Llama/Qwen/DeepSeek tensor layout, switched by what the architecture has."""
    out_source = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    rules = [
        WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
        WeightRule("output_layer.weight", (out_source,), "vocab", export=not arch.tie_word_embeddings),
        WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
        WeightRule(L + "input_layernorm.weight", (H + "input_layernorm.weight",)),
        WeightRule(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",)),
        WeightRule(L + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",)),
        # Dense MLP (every layer of a dense model; the first-k / `mlp_only_layers` of an MoE).
        WeightRule(
            L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), "gate_up"
        ),
        WeightRule(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",)),
    ]
    rules += _mla_rules(arch) if spec.mla else _gqa_rules(arch, spec.qk_norm)
    if arch.is_moe:
        rules += _moe_rules(arch)
    return rules


def _gqa_rules(arch: ModelArch, qk_norm: bool) -> list[WeightRule]:
    qkv = tuple(H + f"self_attn.{p}_proj.weight" for p in "qkv")
    rules = [WeightRule(L + "self_attention.linear_qkv.weight", qkv, "qkv")]
    if arch.qkv_bias:
        bias = tuple(H + f"self_attn.{p}_proj.bias" for p in "qkv")
        rules.append(WeightRule(L + "self_attention.linear_qkv.bias", bias, "qkv"))
    if qk_norm:
        rules += [
            WeightRule(L + "self_attention.q_layernorm.weight", (H + "self_attn.q_norm.weight",)),
            WeightRule(L + "self_attention.k_layernorm.weight", (H + "self_attn.k_norm.weight",)),
        ]
    return rules


def _mla_rules(arch: ModelArch) -> list[WeightRule]:
    attn = L + "self_attention."
    q_kind, kv_kind = ("copy", "copy") if arch.rope_interleaved else ("mla_q", "mla_kv")
    rules = [
        WeightRule(
            attn + "linear_kv_down_proj.weight", (H + "self_attn.kv_a_proj_with_mqa.weight",), kv_kind
        ),
        WeightRule(attn + "kv_layernorm.weight", (H + "self_attn.kv_a_layernorm.weight",)),
        WeightRule(attn + "linear_kv_up_proj.weight", (H + "self_attn.kv_b_proj.weight",)),
    ]
    if arch.mla is not None and arch.mla.q_lora_rank is not None:
        rules += [
            WeightRule(attn + "linear_q_down_proj.weight", (H + "self_attn.q_a_proj.weight",)),
            WeightRule(attn + "q_layernorm.weight", (H + "self_attn.q_a_layernorm.weight",)),
            WeightRule(attn + "linear_q_up_proj.weight", (H + "self_attn.q_b_proj.weight",), q_kind),
        ]
    else:
        rules.append(WeightRule(attn + "linear_q_proj.weight", (H + "self_attn.q_proj.weight",), q_kind))
    return rules


def _moe_rules(arch: ModelArch) -> list[WeightRule]:
    expert, hf_expert = L + "mlp.experts.local_experts.{expert}.", H + "mlp.experts.{expert}."
    rules = [
        WeightRule(L + "mlp.router.weight", (H + "mlp.gate.weight",)),
        WeightRule(
            expert + "linear_fc1.weight",
            (hf_expert + "gate_proj.weight", hf_expert + "up_proj.weight"),
            "gate_up",
        ),
        WeightRule(expert + "linear_fc2.weight", (hf_expert + "down_proj.weight",)),
    ]
    if arch.router_expert_bias:
        rules.append(WeightRule(L + "mlp.router.expert_bias", (H + "mlp.gate.e_score_correction_bias",)))
    if arch.shared_expert_ffn_hidden_size:
        shared, hf_shared = L + "mlp.shared_experts.", H + "mlp.shared_experts."
        rules += [
            WeightRule(
                shared + "linear_fc1.weight",
                (hf_shared + "gate_proj.weight", hf_shared + "up_proj.weight"),
                "gate_up",
            ),
            WeightRule(shared + "linear_fc2.weight", (hf_shared + "down_proj.weight",)),
        ]
    return rules
