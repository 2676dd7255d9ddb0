"""What the step-time model needs, read from a slimrl config (or built for a published run).

`spec_from_config` turns a loaded config plus the workload flags into a `StepSpec`: the trainer's
layout and per-GPU state from the memory plan, each engine's weights and KV cache from the engine
plan (SGLang) or from the architecture (the embedded CPU engine). `engine_spec` and `state_bytes`
also build the specs of published runs (`step_time_anchors.py`), whose engines are vLLM's.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from typing import TYPE_CHECKING

from slimrl.config.schema import SlimConfig
from slimrl.errors import ConfigError
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.model_arch import ModelArch
from slimrl.parallel_layout import ParallelLayout
from slimrl.planning.engine_plan import EngineWidths, extra_flags, kv_bytes_per_token, plan_engine
from slimrl.planning.gpus import GpuSpec
from slimrl.planning.memory_plan import plan
from slimrl.planning.step_time import EngineSpec, ModelShape, StepSpec, TrainerSpec, Workload, model_shape

if TYPE_CHECKING:
    from slimrl.planning.memory_plan import MemoryPlan

GIB = 1024**3

VLLM_ACTIVATION_BYTES = 2 * GIB
"""What vLLM keeps out of its KV cache inside `gpu_memory_utilization` besides the weights (the
profiled activation peak and CUDA graphs; ~1-3 GiB on these models). An assumption."""

VLLM_MAX_RUNNING = 1024
"""vLLM's `max_num_seqs` default for the offline `LLM` class on GPUs of 70 GiB and more (vLLM V1
`EngineArgs._set_default_args`), which NeMo-RL's synchronous generation uses."""


def engine_spec(
    arch: ModelArch,
    shape: ModelShape,
    *,
    gpus: int,
    count: int,
    kv_room_bytes: float,
    max_running: int,
    fp8: bool = False,
    dtype_bytes: int = 2,
    kv_dtype_bytes: int | None = None,
) -> EngineSpec:
    """One engine of `gpus` GPUs (tensor parallel, experts split over all of them) from the
    architecture: what a decode step reads on one GPU, and the KV cache `kv_room_bytes` holds."""

    weight = 1.0 if fp8 else float(dtype_bytes)
    head = shape.output_params * dtype_bytes  # the LM head stays unquantised
    dense = (shape.dense_params * weight + head) / gpus
    experts = shape.expert_params * weight / gpus
    widths = EngineWidths(
        tp=gpus, attn_dp=1, attn_tp=gpus, moe_ep=1, moe_tp=gpus, embed_tp=gpus, head_tp=gpus
    )
    kv = kv_bytes_per_token(arch, widths, kv_dtype_bytes or dtype_bytes)
    served = (shape.dense_params + shape.expert_params) * weight + (
        shape.embedding_params + shape.output_params
    ) * dtype_bytes
    return EngineSpec(
        count=count,
        gpus=gpus,
        dense_bytes=dense,
        expert_bytes=experts,
        served_bytes=served,
        weight_bytes_per_param=weight,
        kv_bytes_per_token=kv,
        kv_tokens=max(0, int(kv_room_bytes // kv)) if kv else 1 << 40,
        max_running=max_running,
        fp8=fp8,
    )


def vllm_kv_room(
    shape: ModelShape, gpus: int, gpu_memory_bytes: float, utilization: float, fp8: bool = False
) -> float:
    """KV bytes one vLLM GPU holds: `gpu_memory_utilization` of its memory minus the weights and
    the activation allowance."""
    weights = (shape.total_params * (1 if fp8 else 2)) / gpus
    return max(0.0, utilization * gpu_memory_bytes - weights - VLLM_ACTIVATION_BYTES)


def state_bytes(
    shape: ModelShape,
    layout: ParallelLayout,
    layers_per_stage: int,
    *,
    grad_bytes: int,
    distributed: bool,
    dtype_bytes: int = 2,
) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) bytes of one GPU of the most loaded stage, from
    counts (the memory plan's exact tensors are used for slimrl configs): bf16 weights, fp32 main
    copy and Adam m, v sharded over the data-parallel group with the distributed optimizer."""
    share = layers_per_stage / shape.layers
    dense = (shape.dense_params * share + max(shape.embedding_params, shape.output_params)) / layout.tp
    experts = shape.expert_params * share / (layout.ep * layout.etp)
    params = (dense + experts) * dtype_bytes
    grads = (dense + experts) * grad_bytes
    dp, edp = (layout.dp * layout.cp, layout.expert_dp) if distributed else (1, 1)
    optimizer = (dense / dp + experts / edp) * 12
    return params, grads, optimizer


def layers_per_stage(layout: ParallelLayout, layers: int) -> int:
    if layout.pp_layout:
        per_rank = [0] * layout.pp
        for stage, count in enumerate(layout.pp_layout):
            per_rank[stage % layout.pp] += count
        return max(per_rank)
    return math.ceil(layers / layout.pp)


def transport_of(config: SlimConfig) -> str:
    """`rollout.weight_sync` as the run resolves it (`preflight/checks.py::weight_transport`, which
    sits above this floor; a test holds the two equal)."""
    choice = config.rollout.weight_sync
    if choice != "auto":
        return choice
    return "tensor" if config.cluster.colocate else "distributed"


def separate_old_logprobs(config: SlimConfig) -> bool:
    """Whether the trainer runs a forward-only pass for the old logprobs: not when the rollout's
    logprobs serve, nor when one optimizer step per rollout lets the training forward supply them
    (`trainer/rl.py::fused_old_logprobs`; a test holds the two equal)."""
    algo = config.algorithm
    if algo.use_rollout_logprobs:
        return False
    return not (config.train.steps_per_rollout == 1 and algo.kl_coef == 0)


def _engines(
    config: SlimConfig, arch: ModelArch, shape: ModelShape, device: str, dtype_bytes: int
) -> EngineSpec:
    rollout = config.rollout
    cap = math.ceil(rollout.max_concurrency / rollout.num_engines)
    if rollout.engine == "sglang" and device == "cuda":
        engine = plan_engine(config)
        running = extra_flags(config).get("max-running-requests")
        if running is not None:
            cap = min(cap, int(running))  # type: ignore[call-overload]
        spec = engine_spec(
            arch, shape, gpus=rollout.gpus_per_engine, count=rollout.num_engines,
            kv_room_bytes=max(engine.kv_room, 0), max_running=cap,
            fp8=rollout.sglang.quantization == "fp8", dtype_bytes=dtype_bytes,
        )  # fmt: skip
        return spec
    # The embedded engine: no KV budget of its own beyond host memory.
    return engine_spec(
        arch, shape, gpus=rollout.gpus_per_engine, count=rollout.num_engines,
        kv_room_bytes=float(1 << 50), max_running=cap, dtype_bytes=dtype_bytes,
    )  # fmt: skip


@functools.cache
def _arch_and_shape(checkpoint: str, overrides: str) -> tuple[ModelArch, ModelShape]:

    arch = read_model_arch(checkpoint, json.loads(overrides))
    return arch, model_shape(arch)


def arch_and_shape(config: SlimConfig) -> tuple[ModelArch, ModelShape]:
    """The config's architecture and its counts (cached: a search asks for them per layout)."""
    return _arch_and_shape(config.model.hf_checkpoint, json.dumps(config.model.overrides, sort_keys=True))


def spec_from_config(
    config: SlimConfig,
    gpu: GpuSpec,
    prompt_tokens: float,
    response_tokens: float,
    longest_response: float | None = None,
    memory: MemoryPlan | None = None,
    *,
    from_counts: bool = False,
    engines: EngineSpec | None = None,
) -> StepSpec:
    """The spec of `config` on `gpu`: the trainer's per-GPU state from its memory plan (pass one
    already made as `memory`; `from_counts` estimates it from parameter counts instead, as a search
    does before it plans the fastest layouts), its engines as the engine plan (SGLang) or the
    architecture (embedded) sees them (`engines`: reuse one)."""

    device = "cpu" if config.cluster.device == "cpu" else "cuda"
    arch, shape = arch_and_shape(config)
    if memory is None and not from_counts:
        memory = plan(config, device=device)
    if gpu.nvlink_domain <= 8:  # a node's NVLink joins the GPUs the config puts on one node
        gpu = replace(gpu, nvlink_domain=min(gpu.nvlink_domain, config.cluster.gpus_per_node))
    rollout, train, algo = config.rollout, config.train, config.algorithm
    if memory is not None:
        layout = memory.layout
        stage_layers = max(len(s.layers) for s in memory.stages)
        dtype_bytes = 2 if memory.dtype == "bf16" else 4
        params, state = float(memory.params), float(memory.params + memory.grads + memory.optimizer)
        distributed = memory.distributed_optimizer
        host_optimizer = memory.optimizer_host * 6 / 20 if memory.cpu_offload else 0.0
    else:
        layout = ParallelLayout.resolve(config.parallel, config.train_world_size(), arch)
        stage_layers = layers_per_stage(layout, arch.num_layers)
        dtype_bytes = 2 if device == "cuda" and config.model.dtype != "fp32" else 4
        distributed = config.parallel.use_distributed_optimizer
        p, g, o = state_bytes(
            shape, layout, stage_layers, grad_bytes=4, distributed=distributed, dtype_bytes=dtype_bytes
        )
        params, state = p, p + g + o
        host_optimizer = (o + g / layout.dp) * 6 / 20 if train.optimizer.cpu_offload else 0.0
        if train.optimizer.cpu_offload:
            state = p + g
    samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    cap = rollout.sampling.max_new_tokens
    if config.data.max_prompt_tokens is None:
        cap = min(cap, max(1, train.max_seq_len - math.ceil(prompt_tokens)))
    padded = None
    if train.max_tokens_per_gpu:
        micro = train.max_tokens_per_gpu * layout.cp
        micro_note = f"train.max_tokens_per_gpu={train.max_tokens_per_gpu} tokens per micro-batch, packed"
    else:
        micro, padded = train.micro_batch_size * train.max_seq_len, train.micro_batch_size
        micro_note = (
            f"train.micro_batch_size={train.micro_batch_size} samples per micro-batch, padded to the longest"
        )
    offload = train.offload if train.offload is not None else config.cluster.colocate and device == "cuda"
    trainer = TrainerSpec(
        layout=layout,
        recompute=config.parallel.recompute,
        micro_batch_tokens=micro,
        logprob_micro_batch_tokens=micro,
        micro_batch_samples=padded,
        logprob_micro_batch_samples=padded,
        optimizer_steps=train.steps_per_rollout,
        layers_per_stage=stage_layers,
        grad_bytes=4,
        distributed_optimizer=distributed,
        overlap_grad_reduce=False,
        offload_bytes=state,
        params_bytes=params,
        cpu_optimizer_bytes=host_optimizer,
        dtype_bytes=dtype_bytes,
    )
    if config.has_critic():
        raise ConfigError(
            f"algorithm.advantage_estimator={algo.advantage_estimator}: --time does not model the PPO "
            "critic yet; use a critic-free estimator (grpo, reinforce_plus_plus, ...)"
        )
    return StepSpec(
        model=shape,
        gpu=gpu,
        gpus_per_node=config.cluster.gpus_per_node,
        trainer=trainer,
        engines=engines or _engines(config, arch, shape, device, dtype_bytes),
        workload=Workload(
            samples=samples,
            prompt_tokens=prompt_tokens,
            response_tokens=min(response_tokens, cap),
            max_response_tokens=cap,
            longest_response=longest_response,
        ),
        colocate=config.cluster.colocate,
        async_staleness=algo.async_staleness,
        policy_logprobs=separate_old_logprobs(config),
        reference_logprobs=algo.kl_loss_coef > 0 or algo.kl_coef > 0,
        rollout_rescoring=algo.true_on_policy and rollout.engine == "embedded",
        transport=transport_of(config),
        offload=bool(offload),
        notes=(f"micro_batches: {micro_note}",),
    )
