"""`ModelArch` + parallel layout -> Megatron-Core `TransformerConfig` and layer spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slimrl.compat.megatron_cpu import mla_core_attention
from slimrl.megatron_bridge.safetensors_index import BridgeError
from slimrl.model_arch import ModelArch
from slimrl.parallel_layout import ParallelLayout


@dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """How to build, as opposed to what: device-dependent and run-dependent choices."""

    use_te: bool
    """Transformer Engine layer spec (GPU) or Megatron-Core's local spec (CPU)."""
    params_dtype: torch.dtype = torch.float32
    moe_token_dispatcher: str = "alltoall"
    fp8_recipe: str | None = None
    recompute: str | None = None
    deterministic: bool = False
    init_weights: bool = True
    """False skips Megatron's random initialisation (weights are loaded right after)."""
    routing_replay: bool = False
    """MoE routers replay given experts (`moe_enable_routing_replay`, `trainer/routing_replay.py`)."""


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """VocabParallelEmbedding needs rows divisible by TP; the extra rows are masked out of every
    softmax and dropped again when exporting to HF."""
    return -(-vocab_size // tp) * tp


def uniform_shapes(layout: ParallelLayout, options: BuildOptions) -> bool:
    """Must every micro-batch have the same shape? The interleaved (VPP) schedule and the
    allgather MoE dispatcher cannot cope with varying sequence lengths."""
    return layout.vpp is not None or options.moe_token_dispatcher != "alltoall"


def _pp_layout_string(layers_per_stage: tuple[int, ...]) -> str:
    stages = [f"t*{n}" for n in layers_per_stage]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    return "|".join(stages)


def transformer_config(arch: ModelArch, layout: ParallelLayout, options: BuildOptions) -> Any:
    """Megatron-Core's `TransformerConfig` (`MLATransformerConfig` for MLA models)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    cls = MLATransformerConfig if arch.mla is not None else TransformerConfig
    return cls(**transformer_config_kwargs(arch, layout, options))


def transformer_config_kwargs(
    arch: ModelArch, layout: ParallelLayout, options: BuildOptions
) -> dict[str, Any]:
    """The constructor arguments, separate so they can be checked where the config cannot be built
    (megatron-core refuses FP8 configs without Transformer Engine installed)."""
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        # MLA always normalises its compressed q/kv (q_a_layernorm, kv_a_layernorm).
        qk_layernorm=arch.qk_norm or arch.mla is not None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # RL and SFT both compare logits against another implementation; keep the softmax in fp32.
        attention_softmax_in_fp32=True,
        params_dtype=options.params_dtype,
        pipeline_dtype=options.params_dtype,
        bf16=options.params_dtype == torch.bfloat16,
        fp16=False,
        use_cpu_initialization=not options.use_te,
        perform_initialization=options.init_weights,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.sequence_parallel,
        # Micro-batches of different lengths (dynamic batching) need shapes sent with the activations.
        variable_seq_lengths=not uniform_shapes(layout, options),
        # The interleaved (VPP) schedule sends activations forward and gradients backward in one
        # call; with pp=2 both go to the same peer, and batched isend/irecv (Megatron-Core's
        # default) is matched in posting order per peer (NCCL ignores tags, gloo's are all 0):
        # each rank's send-to-prev (a gradient) landed in the other's recv-from-prev (an
        # activation). Megatron's unbatched path orders the pairs (and uses a second group for
        # one direction), as Megatron-LM does for VPP by default.
        batch_p2p_comm=layout.vpp is None,
        moe_token_dispatcher_type=options.moe_token_dispatcher,
        deterministic_mode=options.deterministic,
    )
    if layout.pp_layout is not None:
        kwargs["pipeline_model_parallel_layout"] = _pp_layout_string(layout.pp_layout)
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_layer_freq=list(arch.moe_layer_pattern) or 1,
            moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size,
            moe_router_score_function=arch.router_score_function,
            moe_router_enable_expert_bias=arch.router_expert_bias,
            moe_router_topk_scaling_factor=arch.router_topk_scaling_factor,
            moe_router_num_groups=arch.router_num_groups,
            moe_router_group_topk=arch.router_group_topk,
            # softmax-then-topk without renormalising is "pre-softmax"; topk-then-softmax equals
            # softmax-topk-renormalise (Qwen's norm_topk_prob=true).
            moe_router_pre_softmax=arch.router_score_function == "softmax" and not arch.moe_norm_topk_prob,
            moe_router_dtype="fp32",
            # The expert bias moves only with optimizer steps, never by a load heuristic: RL updates
            # stay reproducible and resumable, and the engines see exactly the trained router.
            moe_router_bias_update_rate=0.0,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=options.use_te,
            moe_permute_fusion=False,
            moe_enable_routing_replay=options.routing_replay,
        )
    if options.fp8_recipe is not None:
        kwargs.update(fp8="e4m3", fp8_recipe=options.fp8_recipe)
    if options.recompute is not None:
        kwargs.update(recompute_granularity=options.recompute)
        if options.recompute == "full":
            kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    if arch.mla is not None:
        kwargs.update(_mla_kwargs(arch))
    elif arch.rope_scaling is not None:
        raise BridgeError(
            f"{arch.model_type}: RoPE scaling `{arch.rope_scaling['rope_type']}` is not supported yet"
        )
    return kwargs


def _mla_kwargs(arch: ModelArch) -> dict[str, Any]:
    mla = arch.mla
    assert mla is not None
    out: dict[str, Any] = dict(
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        rotary_base=arch.rope_theta,
        # Megatron's MLA de-interleaves rope dims itself (the flag is for non-MLA attention); the
        # rules permute `rope_interleave=false` checkpoints into that layout.
        rotary_interleaved=False,
        apply_rope_fusion=False,
        rope_type="rope",
    )
    scaling = arch.rope_scaling
    if scaling is not None:
        if scaling["rope_type"] != "yarn":
            raise BridgeError(
                f"{arch.model_type}: RoPE scaling `{scaling['rope_type']}` is not supported with MLA"
            )
        out.update(
            rope_type="yarn",
            rotary_scaling_factor=scaling["factor"],
            original_max_position_embeddings=scaling["original_max_position_embeddings"],
            beta_fast=scaling.get("beta_fast", 32.0),
            beta_slow=scaling.get("beta_slow", 1.0),
            mscale=scaling.get("mscale", 1.0),
            mscale_all_dim=scaling.get("mscale_all_dim", 0.0),
        )
    return out


def layer_spec(config: Any, options: BuildOptions, vp_stage: int | None = None) -> Any:
    """Per-layer spec: TE modules on GPU, Megatron-Core's local modules on CPU."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=options.use_te, normalization="RMSNorm", vp_stage=vp_stage
    )
    if getattr(config, "multi_latent_attention", False) and not options.use_te:
        core = mla_core_attention()
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = core
    return spec
