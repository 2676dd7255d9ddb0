"""Build the Megatron-Core GPT model chunks, DDP wrappers, optimizer and LR schedule for one rank."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import torch

from slimrl.config.schema import OptimizerConfig as OptimizerSettings
from slimrl.config.schema import SlimConfig
from slimrl.errors import ConfigError
from slimrl.megatron_bridge.megatron_config import (
    BuildOptions,
    layer_spec,
    padded_vocab_size,
    transformer_config,
)
from slimrl.model_arch import ModelArch
from slimrl.parallel_layout import ParallelLayout


def build_options(config: SlimConfig, use_cuda: bool) -> BuildOptions:
    dtype = config.model.dtype
    if dtype == "auto":
        dtype = "bf16" if use_cuda else "fp32"
    return BuildOptions(
        use_te=use_cuda,
        params_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
        moe_token_dispatcher=config.parallel.moe_token_dispatcher,
        fp8_recipe=config.parallel.fp8,
        recompute=config.parallel.recompute,
        deterministic=config.algorithm.true_on_policy,
        # TODO(trainer): plain attribute once the engine slice adds `algorithm.routing_replay`.
        routing_replay=config.algorithm.routing_replay,
    )


def build_gpt_chunks(
    arch: ModelArch,
    layout: ParallelLayout,
    options: BuildOptions,
    max_seq_len: int,
    *,
    value_head: bool = False,
) -> list[Any]:
    """One GPTModel per virtual pipeline stage held by this rank (one without VPP).

    `value_head` builds the PPO critic: the same model with its LM head (on the last pipeline stage)
    replaced by a `ValueHead`, and word embeddings never tied to it.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    tconfig = transformer_config(arch, layout, options)
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        stage = vp_stage if layout.vpp else None
        post_process = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        chunk = GPTModel(
            config=tconfig,
            transformer_layer_spec=layer_spec(tconfig, options, vp_stage=stage),
            vocab_size=padded_vocab_size(arch.vocab_size, layout.tp),
            max_sequence_length=max(max_seq_len, arch.max_position_embeddings),
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=post_process,
            share_embeddings_and_output_weights=arch.tie_word_embeddings and not value_head,
            position_embedding_type="rope",
            rotary_base=int(arch.rope_theta),
            vp_stage=stage,
        )
        if value_head and post_process:
            # GPTModel calls `output_layer(hidden, weight=..., runtime_gather_output=...)` and
            # returns its output as [B, S, 1]: the head slots in where the vocabulary projection was.
            device = next(chunk.parameters()).device  # the GPU when Megatron builds there
            chunk.output_layer = ValueHead(
                arch.hidden_size, options.params_dtype, device, layout.sequence_parallel
            )
        chunks.append(chunk)
    return chunks


class ValueHead(torch.nn.Module):
    """The critic's output layer: one scalar per position, `hidden_SBH @ weight.T + bias`.

    Replicated over tensor-parallel ranks. Under sequence parallelism the hidden states are gathered
    first and the backward of the gather only splits (no reduce-scatter): every TP rank computes the
    same values from the same full sequence, so its input and weight gradients are already complete
    and identical, and nothing is all-reduced over TP (Megatron's grad norm counts the duplicate
    once). The head starts at zero, identical on every rank without communication.
    """

    def __init__(
        self, hidden_size: int, dtype: torch.dtype, device: torch.device, sequence_parallel: bool
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel

    def forward(
        self, hidden_SBH: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_SBH = gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_SBH, self.weight, self.bias), None

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """Replicated over TP and DP: one copy is written (Megatron's default for a plain module
        would mark every TP rank as the main replica)."""
        from megatron.core import parallel_state as mpu
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {},
            sharded_offsets,
            tp_group=mpu.get_tensor_model_parallel_group(),
            dp_cp_group=mpu.get_data_parallel_group(with_context_parallel=True),
        )


def freeze(chunks: list[Any], patterns: list[str]) -> int:
    """Stop training parameters whose Megatron name matches a glob; returns how many matched."""
    frozen = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
                param.requires_grad_(False)
                frozen += 1
    return frozen


def _wire_schedule_hooks(model: list[Any]) -> None:
    """The pipeline schedules call these at the end of backward: all-reduce grads over DP, SP norm
    grads over TP, tied embeddings over PP. Without them every DP replica would step on its own
    gradient."""
    from megatron.core.distributed import finalize_model_grads

    config = model[0].config
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [chunk.no_sync for chunk in model]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync


def optimizer_config_kwargs(
    config: SlimConfig, options: BuildOptions, use_cuda: bool, opt: OptimizerSettings | None = None
) -> dict[str, Any]:
    """Keyword arguments of megatron-core's `OptimizerConfig` for this run.

    `train.optimizer.cpu_offload` on GPU is Megatron-LM's `--optimizer-cpu-offload
    --optimizer-offload-fraction 1.0 --use-precision-aware-optimizer`: the HybridDeviceOptimizer
    keeps all fp32 master weights and Adam state in host memory and steps there. Without
    `optimizer_offload_fraction` (megatron-core's default is 0.0) it would offload nothing.
    Megatron-LM requires the precision-aware optimizer with CPU offload, and that one requires the
    distributed optimizer. On CPU the optimizer state already lives in host memory, and the hybrid
    optimizer moves tensors between CUDA streams: the setting is a no-op there.
    """
    opt = opt or config.train.optimizer
    use_dist_opt = config.parallel.use_distributed_optimizer
    kwargs: dict[str, Any] = dict(
        optimizer=opt.name,
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        bf16=options.params_dtype == torch.bfloat16,
        params_dtype=options.params_dtype,
        use_distributed_optimizer=use_dist_opt,
    )
    if opt.cpu_offload and use_cuda:
        if not use_dist_opt:
            raise ConfigError(
                "train.optimizer.cpu_offload=true needs parallel.use_distributed_optimizer=true "
                "(Megatron's CPU offload runs on the precision-aware distributed optimizer)"
            )
        kwargs.update(
            optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True
        )
    return kwargs


@dataclass
class TrainState:
    """What one rank trains: DDP-wrapped chunks, the Megatron optimizer and the LR schedule."""

    model: list[Any]
    optimizer: Any
    scheduler: Any


def build_train_state(
    config: SlimConfig,
    chunks: list[Any],
    options: BuildOptions,
    total_steps: int,
    opt: OptimizerSettings | None = None,
) -> TrainState:
    """DDP wrappers, Megatron optimizer and LR schedule for `chunks`; `opt` replaces
    `train.optimizer` (the critic's own learning rate), the schedule's shape stays `train.lr_schedule`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    use_dist_opt = config.parallel.use_distributed_optimizer
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=use_dist_opt,
        overlap_grad_reduce=False,
        check_for_nan_in_grad=False,  # trainer/numerics.py skips such a step instead of raising
    )
    model = [
        DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    _wire_schedule_hooks(model)
    opt = opt or config.train.optimizer
    optimizer = get_megatron_optimizer(
        OptimizerConfig(**optimizer_config_kwargs(config, options, torch.cuda.is_available(), opt)), model
    )
    schedule = config.train.lr_schedule
    decay_steps = max(schedule.decay_steps or total_steps, 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if schedule.warmup_steps else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr if schedule.decay_style != "constant" else opt.lr,
        lr_warmup_steps=schedule.warmup_steps,
        lr_decay_steps=max(decay_steps, schedule.warmup_steps + 1),
        lr_decay_style=schedule.decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler)
