"""Per-GPU memory plan of a training layout, made before anything starts.

`plan(config)` reads only the HF config.json (no weights, no GPU; torch only to resolve
`cluster.device: auto`) and estimates what one training rank holds at its peak;
`check_fits(plan)` refuses a layout that cannot fit `cluster.gpu_memory_gb` with one line naming
the key to change. `slimrl plan CONFIG` prints it.

What is exact and what is estimated (docs/memory_plan.md has the formulas):
- exact: parameter elements per rank (the same tensors Megatron-Core builds, per pipeline stage,
  split over tp/ep/etp), parameter and DDP gradient-buffer bytes including the distributed
  optimizer's padding;
- an upper bound: optimizer state per rank (the distributed optimizer's shard including padding;
  the real shard holds only the parameter elements inside it, so ranks differ by a few percent);
- estimates: activations, the logits chunk and the fixed CUDA/NCCL allowance.
Every pipeline stage is planned and the most loaded one decides.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from slimrl.config.schema import SlimConfig
from slimrl.devices.device import resolve_device
from slimrl.errors import ConfigError
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.model_arch import ModelArch
from slimrl.parallel_layout import ParallelLayout

GIB = 1024**3

CUDA_ALLOWANCE_BYTES = 3 * GIB
"""Memory no formula here covers: the CUDA context with cuBLAS/cuDNN workspaces (~0.6-1 GiB),
NCCL communicator buffers of the tp/pp/dp/ep groups (~0.5-1 GiB), the pipeline's p2p buffers and
the caching allocator's fragmentation. A flat allowance, charged on GPU only."""

MOE_ROUTING_IMBALANCE = 1.25
"""Routing is dropless: a rank's experts receive `topk` copies of its share of the tokens only on
average. The planner charges 25% more routed tokens than the balanced share for the busiest rank."""

GRAD_BYTES = 4
"""DDP gradient buffers are fp32 (`grad_reduce_in_fp32=True` in `slimrl.trainer.model`)."""

MAIN_PARAM_BYTES = 4
"""fp32 master copy the optimizer keeps of every non-fp32 (bf16) parameter."""

OPTIMIZER_STATE_BYTES = {"adam": 8, "sgd": 4}
"""fp32 optimizer state per parameter: Adam's m and v; SGD's momentum buffer."""

LOGITS_BYTES = 4 * 2
"""fp32 logits of a chunk plus its fp32 softmax (exp) kept for the backward pass."""

DIST_OPT_PARAM_ALIGN = 64
"""The distributed optimizer starts every parameter in the DDP buffer at a multiple of 64 elements
(megatron-core `_ParamAndGradBuffer._pad_start_of_param_if_needed`)."""

DIST_OPT_BUCKET_ALIGN = 128
"""... and pads every bucket to a multiple of lcm(dp size, 128) so it shards evenly
(`_pad_end_of_bucket_if_needed`)."""


# ------------------------------------------------------------------------------------------ tensors
@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor of this rank, as Megatron-Core allocates it."""

    name: str
    numel: int
    expert: bool = False
    """In the expert-parallel DDP buffer (routed experts with ep > 1): reduced and sharded over
    the expert-data-parallel group instead of the data-parallel group."""
    fp32: bool = False
    """Created in fp32 whatever the model dtype (the router: megatron-core `TopKRouter`)."""
    own_bucket: bool = False
    """A tied embedding/output weight with pp > 1: DDP gives it a bucket of its own."""


def _padded_vocab(arch: ModelArch, layout: ParallelLayout) -> int:
    """Rows of the vocab-parallel embedding (same rule as `megatron_config.padded_vocab_size`,
    repeated here so planning never imports torch)."""
    return -(-arch.vocab_size // layout.tp) * layout.tp


def _attention_tensors(arch: ModelArch, layout: ParallelLayout, use_te: bool) -> list[ParamTensor]:
    """GQA: fused qkv (column-parallel), output projection (row-parallel), per-head q/k norms.
    MLA: down projections (duplicated over TP with TE, column-parallel in the local CPU spec),
    their norms, the column-parallel up projections and the output projection."""
    h, t = arch.hidden_size, layout.tp
    heads = arch.num_attention_heads // t
    out = [ParamTensor("input_layernorm", h)]
    mla = arch.mla
    if mla is None:
        rows = (heads + 2 * arch.num_query_groups // t) * arch.head_dim
        out.append(ParamTensor("linear_qkv", rows * h))
        if arch.qkv_bias:
            out.append(ParamTensor("linear_qkv.bias", rows))
        if arch.qk_norm:
            out += [ParamTensor("q_layernorm", arch.head_dim), ParamTensor("k_layernorm", arch.head_dim)]
        return [*out, ParamTensor("linear_proj", h * heads * arch.head_dim)]
    down_split = 1 if use_te else t
    q_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if mla.q_lora_rank is None:
        out.append(ParamTensor("linear_q_proj", heads * q_head * h))
    else:
        out += [
            ParamTensor("linear_q_down_proj", mla.q_lora_rank // down_split * h),
            ParamTensor("q_layernorm", mla.q_lora_rank),
            ParamTensor("linear_q_up_proj", heads * q_head * mla.q_lora_rank),
        ]
    kv_down_rows = (mla.kv_lora_rank + mla.qk_rope_head_dim) // down_split
    return [
        *out,
        ParamTensor("linear_kv_down_proj", kv_down_rows * h),
        ParamTensor("kv_layernorm", mla.kv_lora_rank),
        ParamTensor("linear_kv_up_proj", heads * (mla.qk_nope_head_dim + mla.v_head_dim) * mla.kv_lora_rank),
        ParamTensor("linear_proj", h * heads * mla.v_head_dim),
    ]


def _mlp_tensors(name: str, hidden: int, ffn: int, split: int, expert: bool = False) -> list[ParamTensor]:
    """SwiGLU MLP: fc1 holds gate and up (column-parallel), fc2 is row-parallel."""
    return [
        ParamTensor(f"{name}.linear_fc1", 2 * (ffn // split) * hidden, expert=expert),
        ParamTensor(f"{name}.linear_fc2", hidden * (ffn // split), expert=expert),
    ]


def _moe_tensors(arch: ModelArch, layout: ParallelLayout) -> list[ParamTensor]:
    """Router (replicated, fp32), this rank's experts/ep split over etp, shared experts over tp."""
    h, experts = arch.hidden_size, arch.num_experts or 0
    assert arch.moe_ffn_hidden_size is not None
    out = [ParamTensor("pre_mlp_layernorm", h), ParamTensor("router", experts * h, fp32=True)]
    for index in range(experts // layout.ep):
        out += _mlp_tensors(f"experts.{index}", h, arch.moe_ffn_hidden_size, layout.etp, expert=layout.ep > 1)
    if arch.shared_expert_ffn_hidden_size:
        out += _mlp_tensors("shared_experts", h, arch.shared_expert_ffn_hidden_size, layout.tp)
    return out


def _is_moe_layer(arch: ModelArch, layer: int) -> bool:
    if not arch.is_moe:
        return False
    return not arch.moe_layer_pattern or bool(arch.moe_layer_pattern[layer])


def _layer_tensors(arch: ModelArch, layout: ParallelLayout, layer: int, use_te: bool) -> list[ParamTensor]:
    out = _attention_tensors(arch, layout, use_te)
    if _is_moe_layer(arch, layer):
        return out + _moe_tensors(arch, layout)
    dense = _mlp_tensors("mlp", arch.hidden_size, arch.ffn_hidden_size, layout.tp)
    return [*out, ParamTensor("pre_mlp_layernorm", arch.hidden_size), *dense]


@dataclass(frozen=True)
class Chunk:
    """One model chunk (a virtual pipeline stage) of a pipeline rank."""

    layers: tuple[int, ...]
    pre_process: bool
    """Holds the embedding (the very first virtual stage)."""
    post_process: bool
    """Holds the final norm and output layer (the very last virtual stage)."""


def pipeline_chunks(arch: ModelArch, layout: ParallelLayout) -> list[list[Chunk]]:
    """[pp_rank][vp_stage] -> the layers Megatron puts there: virtual stage vp * pp + pp_rank owns
    the next block of layers (`pp_layout` entries, or an even split)."""
    pp, vpp = layout.pp, layout.vpp or 1
    stages = pp * vpp
    counts = list(layout.pp_layout) if layout.pp_layout else [arch.num_layers // stages] * stages
    starts = [sum(counts[:s]) for s in range(stages)]
    return [
        [
            Chunk(
                layers=tuple(range(starts[vp * pp + rank], starts[vp * pp + rank] + counts[vp * pp + rank])),
                pre_process=rank == 0 and vp == 0,
                post_process=rank == pp - 1 and vp == vpp - 1,
            )
            for vp in range(vpp)
        ]
        for rank in range(pp)
    ]


def chunk_tensors(arch: ModelArch, layout: ParallelLayout, chunk: Chunk, use_te: bool) -> list[ParamTensor]:
    """Every parameter of one chunk. Tied embeddings: one weight when pp == 1; with pp > 1 the last
    stage keeps its own copy of it as output layer (kept equal by an all-reduce)."""
    h, vocab_rows = arch.hidden_size, _padded_vocab(arch, layout) // layout.tp
    shared = arch.tie_word_embeddings and layout.pp > 1
    out: list[ParamTensor] = []
    if chunk.pre_process:
        out.append(ParamTensor("embedding", vocab_rows * h, own_bucket=shared))
    for layer in chunk.layers:
        out += _layer_tensors(arch, layout, layer, use_te)
    if chunk.post_process:
        out.append(ParamTensor("final_layernorm", h))
        if not arch.tie_word_embeddings or not chunk.pre_process:
            out.append(ParamTensor("output_layer", vocab_rows * h, own_bucket=shared))
    return out


# ----------------------------------------------------------------------- model state (bytes)
@dataclass(frozen=True)
class Buffer:
    """One DDP param/grad buffer of one chunk: tensors sharing a dtype and a data-parallel group."""

    numel: int
    """Parameter elements (unpadded)."""
    padded: int
    """Elements allocated (padding for the distributed optimizer included)."""
    fp32: bool
    dp_size: int
    """Ranks its optimizer state is sharded over (with the distributed optimizer)."""


def _bucket_numel(sizes: Iterable[int], dp_size: int, distributed: bool) -> int:
    """Elements of one DDP bucket. With the distributed optimizer every parameter starts 64-aligned
    and the bucket end is padded to lcm(dp, 128); the sum does not depend on parameter order."""
    sizes = list(sizes)
    if not distributed:
        return sum(sizes)
    aligned = sum(math.ceil(n / DIST_OPT_PARAM_ALIGN) * DIST_OPT_PARAM_ALIGN for n in sizes)
    divisor = math.lcm(dp_size, DIST_OPT_BUCKET_ALIGN)
    return math.ceil(aligned / divisor) * divisor


def ddp_buffers(tensors: list[ParamTensor], layout: ParallelLayout, distributed: bool) -> list[Buffer]:
    """Megatron's DDP groups a chunk's parameters by (param dtype, expert-parallel or not) into one
    buffer each, all in a single bucket (no overlap_grad_reduce), except that a tied embedding/output
    weight with pp > 1 gets a bucket of its own."""
    groups: dict[tuple[bool, bool], list[ParamTensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.expert, tensor.fp32), []).append(tensor)
    buffers = []
    for (expert, fp32), members in sorted(groups.items()):
        dp_size = layout.expert_dp if expert else layout.dp * layout.cp
        buckets = [[t.numel] for t in members if t.own_bucket]
        rest = [t.numel for t in members if not t.own_bucket]
        padded = sum(_bucket_numel(b, dp_size, distributed) for b in [*buckets, rest] if b)
        numel = sum(t.numel for t in members)
        buffers.append(Buffer(numel=numel, padded=padded, fp32=fp32, dp_size=dp_size))
    return buffers


def param_bytes(buffers: list[Buffer], dtype_bytes: int, distributed: bool) -> int:
    """Parameters: bf16 (2 B) on GPU or fp32 (4 B) on CPU, the router always fp32. With the
    distributed optimizer they live in the padded DDP param buffer."""
    return sum((b.padded if distributed else b.numel) * (4 if b.fp32 else dtype_bytes) for b in buffers)


def grad_bytes(buffers: list[Buffer]) -> int:
    """Gradients: the fp32 DDP grad buffer, 4 B per (padded) element."""
    return sum(b.padded * GRAD_BYTES for b in buffers)


def optimizer_shard_elements(buffers: list[Buffer], distributed: bool) -> int:
    """Elements this rank's optimizer steps: a 1/dp shard of each padded buffer with the distributed
    optimizer (dense params over dp*cp, expert params over the expert-dp group), else all of them."""
    return sum(b.padded // b.dp_size if distributed else b.numel for b in buffers)


def optimizer_bytes(buffers: list[Buffer], optimizer: str, distributed: bool, dtype_bytes: int) -> int:
    """Optimizer state over the shard: fp32 main params (4 B, only for bf16 params: fp32 ones, all
    of them on CPU and the router everywhere, are stepped in place) + Adam m and v (8 B)."""
    total = 0
    for b in buffers:
        main = 0 if b.fp32 or dtype_bytes == 4 else MAIN_PARAM_BYTES
        total += optimizer_shard_elements([b], distributed) * (OPTIMIZER_STATE_BYTES[optimizer] + main)
    return total


def host_optimizer_bytes(optimizer_state: int, shard_elements: int) -> int:
    """`train.optimizer.cpu_offload` (Megatron's HybridDeviceOptimizer, everything offloaded): the
    optimizer state moves to the host, which also keeps a pinned fp32 copy of the shard's gradients
    to step on; the GPU keeps no optimizer state."""
    return optimizer_state + GRAD_BYTES * shard_elements


# ------------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class ActivationShape:
    """What the per-token activation formulas need besides the architecture."""

    act_bytes: int
    """Activation dtype: 2 (bf16) on GPU, 4 (fp32) on CPU."""
    tp: int
    sp: int
    """Sequence-parallel split of the norm/residual regions: tp with SP, else 1."""
    etp: int


def attention_bytes_per_token(arch: ModelArch, s: ActivationShape, recompute: str | None) -> float:
    """Saved for backward by one attention block, per token (flash attention: no S^2 scores).
    GQA: norm input and qkv input (h/sp each; the linear keeps its SP-local input), q/k/v for the
    attention kernel ((heads + 2 groups) * head_dim / tp), q/k before their norms ((heads + groups)
    * head_dim / tp, qk_norm only), the attention output (heads * head_dim / tp, also linear_proj's
    input) and the fp32 softmax log-sum-exp (4 B * heads / tp).
    MLA: norm input, down-projection input, the q/kv latents before and after their norms (/sp),
    the shared rope key (rope_dim, gathered), query and key (2 * heads * (nope + rope) / tp), value
    and output (2 * heads * v_dim / tp), and the log-sum-exp.
    Selective recompute re-runs the core attention: its internal state (the log-sum-exp) is dropped;
    its q/k/v inputs and its output stay (the checkpoint and linear_proj keep them)."""
    h, a, t, sp, b = arch.hidden_size, arch.num_attention_heads, s.tp, s.sp, s.act_bytes
    lse = 0.0 if recompute == "selective" else 4 * a / t
    mla = arch.mla
    if mla is None:
        d, g = arch.head_dim, arch.num_query_groups
        elems = 2 * h / sp + (a + 2 * g) * d / t + a * d / t
        if arch.qk_norm:
            elems += (a + g) * d / t
        return b * elems + lse
    latents = 2 * mla.kv_lora_rank + (2 * mla.q_lora_rank if mla.q_lora_rank else 0)
    q_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    elems = 2 * h / sp + latents / sp + mla.qk_rope_head_dim + 2 * a * q_head / t + 2 * a * mla.v_head_dim / t
    return b * elems + lse


def mlp_bytes_per_token(arch: ModelArch, s: ActivationShape) -> float:
    """Dense SwiGLU block, per token: norm input and fc1 input (h/sp each), fc1 output (gate and up,
    2 * ffn / tp, kept by SwiGLU) and the activation output (ffn / tp, fc2's input)."""
    return s.act_bytes * (2 * arch.hidden_size / s.sp + 3 * arch.ffn_hidden_size / s.tp)


def moe_bytes_per_token(arch: ModelArch, s: ActivationShape) -> float:
    """MoE block (alltoall dispatcher), per token of the micro-batch: norm input and router/dispatch
    input (h/sp each); fp32 router logits and scores (8 B * experts / sp); the routed copies: each
    SP-local token goes to topk experts and expert-TP all-gathers them, so a rank computes
    topk * etp / sp rows per token (times MOE_ROUTING_IMBALANCE), each keeping the permuted input
    (h), fc1's output (2 * moe_ffn / etp), the activation and its probability-weighted copy
    (2 * moe_ffn / etp); shared experts like a dense MLP of their width over tp."""
    assert arch.moe_ffn_hidden_size is not None
    h, b, experts = arch.hidden_size, s.act_bytes, arch.num_experts or 0
    rows = arch.moe_topk * s.etp / s.sp * MOE_ROUTING_IMBALANCE
    routed = rows * b * (h + 4 * arch.moe_ffn_hidden_size / s.etp)
    shared = b * 3 * (arch.shared_expert_ffn_hidden_size or 0) / s.tp
    return b * 2 * h / s.sp + 8 * experts / s.sp + routed + shared


def layer_bytes_per_token(arch: ModelArch, s: ActivationShape, layer: int, recompute: str | None) -> float:
    """One transformer layer without full recompute: attention block + dense or MoE block."""
    attention = attention_bytes_per_token(arch, s, recompute)
    if _is_moe_layer(arch, layer):
        return attention + moe_bytes_per_token(arch, s)
    return attention + mlp_bytes_per_token(arch, s)


def layer_input_bytes_per_token(arch: ModelArch, s: ActivationShape) -> float:
    """Full recompute keeps only each layer's input (h/sp per token) and re-runs the layer."""
    return s.act_bytes * arch.hidden_size / s.sp


def final_norm_bytes_per_token(arch: ModelArch, s: ActivationShape) -> float:
    """Last stage: the final norm's input and the output layer's input (h/sp each)."""
    return s.act_bytes * 2 * arch.hidden_size / s.sp


def logits_bytes(arch: ModelArch, layout: ParallelLayout, tokens: int) -> int:
    """The vocab-parallel log-softmax of one chunk of tokens: fp32 logits + fp32 softmax over this
    rank's vocab/tp columns."""
    return tokens * (_padded_vocab(arch, layout) // layout.tp) * LOGITS_BYTES


def in_flight_microbatches(layout: ParallelLayout, pp_rank: int) -> list[int]:
    """Micro-batches whose activations a pipeline rank holds at its peak, per model chunk.
    1F1B: pp - rank (assuming at least pp micro-batches). Interleaved: Megatron runs
    (pp - rank - 1) * 2 + (vpp - 1) * pp warm-up forwards and one more before the first backward;
    forward k runs on chunk (k mod pp*vpp) // pp."""
    pp, vpp = layout.pp, layout.vpp or 1
    if vpp == 1:
        return [pp - pp_rank]
    counts = [0] * vpp
    for k in range((pp - pp_rank - 1) * 2 + (vpp - 1) * pp + 1):
        counts[(k % (pp * vpp)) // pp] += 1
    return counts


# --------------------------------------------------------------------------------- per stage
@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """Peak memory of one pipeline rank (every tp/ep/dp rank of a stage holds the same, up to the
    optimizer shard's padding)."""

    pp_rank: int
    layers: tuple[int, ...]
    num_params: int
    """Parameter elements of this rank (unpadded)."""
    num_expert_params: int
    params: int
    grads: int
    optimizer: int
    """Optimizer state on the GPU (0 with `train.optimizer.cpu_offload`)."""
    optimizer_host: int
    """Host memory of the offloaded optimizer (with `train.optimizer.cpu_offload`): its state and a
    fp32 copy of the gradient shard."""
    critic: int
    """PPO's value model on the same ranks: its parameters, gradients and optimizer state (counted
    with the policy's shapes, LM head included: an upper bound); its activations come and go before
    the policy's, so they add nothing to the peak."""
    activations: int
    logits: int
    allowance: int
    in_flight: tuple[int, ...]
    """Micro-batches in flight at the peak, per model chunk."""

    @property
    def total(self) -> int:
        return (
            self.params + self.grads + self.optimizer + self.critic + self.activations + self.logits
            + self.allowance
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class _Inputs:
    """Everything a stage plan depends on besides its chunks, resolved once from the config."""

    arch: ModelArch
    layout: ParallelLayout
    use_te: bool
    dtype_bytes: int
    distributed: bool
    optimizer: str
    cpu_offload: bool
    recompute: str | None
    tokens: int
    logits_tokens: int
    critic: bool
    """`advantage_estimator: ppo`: a second model of the same shape trains on every rank."""


def _model_state(inp: _Inputs, chunks: list[Chunk]) -> dict[str, int]:
    """Parameter counts and parameter/gradient/optimizer bytes of one pipeline rank: one DDP (and
    its buffers) per model chunk, as `slimrl.trainer.model.build_train_state` wraps them."""
    out = dict(num_params=0, num_expert_params=0, params=0, grads=0, optimizer=0, shard=0)
    for chunk in chunks:
        tensors = chunk_tensors(inp.arch, inp.layout, chunk, inp.use_te)
        buffers = ddp_buffers(tensors, inp.layout, inp.distributed)
        out["num_params"] += sum(t.numel for t in tensors)
        out["num_expert_params"] += sum(t.numel for t in tensors if t.name.startswith("experts."))
        out["params"] += param_bytes(buffers, inp.dtype_bytes, inp.distributed)
        out["grads"] += grad_bytes(buffers)
        out["optimizer"] += optimizer_bytes(buffers, inp.optimizer, inp.distributed, inp.dtype_bytes)
        out["shard"] += optimizer_shard_elements(buffers, inp.distributed)
    return out


def _activations(inp: _Inputs, chunks: list[Chunk], in_flight: list[int]) -> int:
    """Activations of one pipeline rank at its peak: each in-flight micro-batch keeps its chunk's
    layer activations (only layer inputs with full recompute, plus the one layer being recomputed)."""
    arch, shape = inp.arch, _shape(inp)
    per_token = 0.0
    for count, chunk in zip(in_flight, chunks, strict=True):
        if inp.recompute == "full":
            kept = len(chunk.layers) * layer_input_bytes_per_token(arch, shape)
        else:
            kept = sum(layer_bytes_per_token(arch, shape, i, inp.recompute) for i in chunk.layers)
        if chunk.post_process:
            kept += final_norm_bytes_per_token(arch, shape)
        per_token += count * kept
    layers = [i for chunk in chunks for i in chunk.layers]
    if inp.recompute == "full" and layers:
        per_token += max(layer_bytes_per_token(arch, shape, i, None) for i in layers)
    return math.ceil(per_token * inp.tokens)


def _shape(inp: _Inputs) -> ActivationShape:
    lay = inp.layout
    sp = lay.tp if lay.sequence_parallel else 1
    return ActivationShape(act_bytes=inp.dtype_bytes, tp=lay.tp, sp=sp, etp=lay.etp)


def _stage_plan(inp: _Inputs, chunks: list[Chunk], pp_rank: int) -> StagePlan:
    state = _model_state(inp, chunks)
    in_flight = in_flight_microbatches(inp.layout, pp_rank)
    optimizer, shard = state.pop("optimizer"), state.pop("shard")
    host = host_optimizer_bytes(optimizer, shard) if inp.cpu_offload else 0
    critic = 0
    if inp.critic:  # the LM head's bytes are counted too: an upper bound (its head is a scalar)
        critic = state["params"] + state["grads"] + (0 if inp.cpu_offload else optimizer)
        host *= 2
    has_output = any(chunk.post_process for chunk in chunks)
    return StagePlan(
        pp_rank=pp_rank,
        layers=tuple(i for chunk in chunks for i in chunk.layers),
        **state,
        optimizer=0 if inp.cpu_offload else optimizer,
        optimizer_host=host,
        critic=critic,
        activations=_activations(inp, chunks, in_flight),
        logits=logits_bytes(inp.arch, inp.layout, inp.logits_tokens) if has_output else 0,
        allowance=CUDA_ALLOWANCE_BYTES if inp.use_te else 0,
        in_flight=tuple(in_flight),
    )


# ------------------------------------------------------------------------------------- plan
@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Peak per-GPU memory of a training config: the terms (bytes) of its most loaded pipeline stage,
    the budget, and every stage's plan for reference."""

    model: str
    device: str
    dtype: str
    layout: ParallelLayout
    recompute: str | None
    distributed_optimizer: bool
    cpu_offload: bool
    tokens: int
    """Tokens per micro-batch per rank the activations are planned for."""
    tokens_setting: str
    """The `key=value` that sets `tokens` (named in messages)."""
    logits_tokens: int
    logits_setting: str
    total_params: int
    """Parameters of the whole model (unsharded, unpadded vocabulary)."""
    moe_layers: frozenset[int]
    gpus_per_node: int
    stages: tuple[StagePlan, ...]
    stage: int
    """The pipeline rank planned for: the largest total."""
    num_params: int
    """Parameter elements of one rank of that stage."""
    num_expert_params: int
    params: int
    grads: int
    optimizer: int
    optimizer_host: int
    critic: int
    activations: int
    logits: int
    allowance: int
    total: int
    budget: int
    """`cluster.gpu_memory_gb` in bytes."""

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def stage_role(self) -> str:
        pp = self.layout.pp
        if pp == 1:
            return "the only pipeline stage"
        first, last = self.stage == 0, self.stage == pp - 1
        role = "first: embedding" if first else "last: output layer" if last else "middle"
        return f"pipeline stage {self.stage} of {pp} ({role})"

    def terms(self) -> dict[str, int]:
        """Name -> bytes, in table order."""
        return {
            "parameters": self.params,
            "gradients": self.grads,
            "optimizer state": self.optimizer,
            "critic (PPO)": self.critic,
            "activations": self.activations,
            "logits chunk": self.logits,
            "CUDA/NCCL allowance": self.allowance,
        }

    def render(self) -> str:
        """A readable table in GiB."""
        return "\n".join(_render_lines(self))


def _tokens(config: SlimConfig, layout: ParallelLayout) -> tuple[int, str]:
    """Tokens per micro-batch per rank: the dynamic-batching budget, else micro_batch_size full-length
    sequences split over context-parallel ranks."""
    train = config.train
    if train.max_tokens_per_gpu:
        return train.max_tokens_per_gpu, f"train.max_tokens_per_gpu={train.max_tokens_per_gpu}"
    tokens = -(-train.micro_batch_size * train.max_seq_len // layout.cp)
    return tokens, f"train.micro_batch_size={train.micro_batch_size}"


def _logits_tokens(config: SlimConfig, tokens: int, tokens_setting: str) -> tuple[int, str]:
    """The SFT loss goes through Megatron's fused cross-entropy over the whole micro-batch; the RL
    losses take log-probs `train.logprob_chunk_tokens` at a time."""
    if config.algorithm.loss == "sft":
        return tokens, tokens_setting
    chunk = config.train.logprob_chunk_tokens
    return min(chunk, tokens), f"train.logprob_chunk_tokens={chunk}"


def total_parameters(arch: ModelArch) -> int:
    """Parameters of the whole model (tp = pp = ep = 1, unpadded vocabulary)."""
    single = ParallelLayout(
        world_size=1, tp=1, pp=1, cp=1, ep=1, etp=1, dp=1, vpp=None, sequence_parallel=False
    )
    chunk = Chunk(layers=tuple(range(arch.num_layers)), pre_process=True, post_process=True)
    return sum(t.numel for t in chunk_tensors(arch, single, chunk, use_te=True))


def plan(config: SlimConfig, device: str | None = None) -> MemoryPlan:
    """Plan the peak per-GPU memory of training `config` on `device` (default: `cluster.device`,
    `auto` resolved on this machine). Reads only the checkpoint's config.json."""
    device = device or resolve_device(config)
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"--device {device}: must be cuda or cpu")
    if config.cluster.gpu_memory_gb <= 0:
        raise ConfigError(f"cluster.gpu_memory_gb={config.cluster.gpu_memory_gb}: must be > 0")
    arch = read_model_arch(config.model.hf_checkpoint, config.model.overrides)
    layout = ParallelLayout.resolve(config.parallel, config.train_world_size(), arch)
    dtype = config.model.dtype if config.model.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    tokens, tokens_setting = _tokens(config, layout)
    logits_tokens, logits_setting = _logits_tokens(config, tokens, tokens_setting)
    inp = _Inputs(
        arch=arch,
        layout=layout,
        use_te=device == "cuda",
        dtype_bytes=2 if dtype == "bf16" else 4,
        distributed=config.parallel.use_distributed_optimizer,
        optimizer=config.train.optimizer.name,
        cpu_offload=config.train.optimizer.cpu_offload,
        recompute=config.parallel.recompute,
        tokens=tokens,
        logits_tokens=logits_tokens,
        critic=config.has_critic(),
    )
    stages = tuple(
        _stage_plan(inp, chunks, rank) for rank, chunks in enumerate(pipeline_chunks(arch, layout))
    )
    worst = max(stages, key=lambda s: (s.total, -s.pp_rank))
    return MemoryPlan(
        model=f"{arch.model_type} ({config.model.hf_checkpoint})",
        device=device,
        dtype=dtype,
        layout=layout,
        recompute=config.parallel.recompute,
        distributed_optimizer=inp.distributed,
        cpu_offload=inp.cpu_offload,
        tokens=tokens,
        tokens_setting=tokens_setting,
        logits_tokens=logits_tokens,
        logits_setting=logits_setting,
        total_params=total_parameters(arch),
        moe_layers=frozenset(i for i in range(arch.num_layers) if _is_moe_layer(arch, i)),
        gpus_per_node=config.cluster.gpus_per_node,
        stages=stages,
        stage=worst.pp_rank,
        num_params=worst.num_params,
        num_expert_params=worst.num_expert_params,
        params=worst.params,
        grads=worst.grads,
        optimizer=worst.optimizer,
        optimizer_host=worst.optimizer_host,
        critic=worst.critic,
        activations=worst.activations,
        logits=worst.logits,
        allowance=worst.allowance,
        total=worst.total,
        budget=int(config.cluster.gpu_memory_gb * GIB),
    )


# ----------------------------------------------------------------------------------- render
def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _count(n: int) -> str:
    """Parameter counts at a readable scale (billions for real models, thousands for tiny ones)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def _describe_layout(plan: MemoryPlan) -> str:
    lay = plan.layout
    sizes = [f"tp={lay.tp}", f"pp={lay.pp}", *([f"vpp={lay.vpp}"] if lay.vpp else [])]
    sizes += [f"cp={lay.cp}", f"ep={lay.ep}", f"etp={lay.etp}", f"dp={lay.dp}", f"expert-dp={lay.expert_dp}"]
    extras = [
        "SP" if lay.sequence_parallel else "no SP",
        f"recompute={plan.recompute or 'none'}",
        "distributed optimizer" if plan.distributed_optimizer else "replicated optimizer",
        *(["optimizer on host"] if plan.cpu_offload else []),
    ]
    return f"{' '.join(sizes)} ({', '.join(extras)})"


def _notes(plan: MemoryPlan) -> dict[str, str]:
    """The right-hand column: where each term's bytes come from."""
    lay, stage = plan.layout, plan.stages[plan.stage]
    state = "fp32 main + Adam" if plan.dtype == "bf16" else "Adam m, v (fp32 params step in place)"
    if plan.cpu_offload:
        optimizer = "on the host (train.optimizer.cpu_offload)"
    elif plan.distributed_optimizer:
        optimizer = f"{state}, sharded over dp*cp={lay.dp * lay.cp}, expert-dp={lay.expert_dp}"
    else:
        optimizer = f"{state}, whole on every dp rank"
    in_flight = "+".join(map(str, stage.in_flight))
    return {
        "parameters": f"{plan.dtype}, {_count(plan.num_params)} elements "
        f"({_count(plan.num_expert_params)} in routed experts)",
        "gradients": "fp32 DDP grad buffer",
        "optimizer state": optimizer,
        "critic (PPO)": "value model: parameters + gradients + optimizer again" if plan.critic else "none",
        "activations": f"{plan.tokens} tokens/micro-batch x {in_flight} in flight",
        "logits chunk": f"{plan.logits_tokens} tokens x vocab/tp x fp32 x 2" if plan.logits else "not here",
        "CUDA/NCCL allowance": "context, NCCL buffers, fragmentation" if plan.allowance else "none on CPU",
    }


def _render_lines(plan: MemoryPlan) -> list[str]:
    layers = plan.stages[plan.stage].layers
    moe = sum(1 for i in layers if i in plan.moe_layers)
    span = f"layers {layers[0]}-{layers[-1]}" if layers and not plan.layout.vpp else "layers"
    notes = _notes(plan)
    lines = [
        f"model: {plan.model}, {_count(plan.total_params)} parameters",
        f"ranks: {plan.layout.world_size} x {plan.device} ({plan.dtype}), {_describe_layout(plan)}",
        f"planned: {plan.stage_role()}, {span}: {len(layers) - moe} dense + {moe} MoE",
        "",
        f"{'term':<22}{'GiB':>9}  from",
        f"{'-' * 22}{'-' * 9}  {'-' * 44}",
        *(f"{name:<22}{_gib(value):>9}  {notes[name]}" for name, value in plan.terms().items()),
        f"{'-' * 22}{'-' * 9}",
        f"{'total':<22}{_gib(plan.total):>9}  of {_gib(plan.budget)} GiB per GPU "
        f"({100 * plan.total / plan.budget:.0f}%): {'fits' if plan.fits else 'DOES NOT FIT'}",
    ]
    if plan.cpu_offload:
        per_node = _gib(plan.optimizer_host * plan.gpus_per_node)
        lines.append(
            f"{'host memory':<22}{_gib(plan.optimizer_host):>9}  optimizer + fp32 grads, {per_node} GiB/node"
        )
    if len(plan.stages) > 1:
        lines.append(
            "per-stage totals (GiB): " + "  ".join(f"{s.pp_rank}:{_gib(s.total)}" for s in plan.stages)
        )
    return lines


# ------------------------------------------------------------------------------------ check
def check_fits(plan: MemoryPlan) -> None:
    """Refuse a plan over budget with one line: the key behind the biggest term, the numbers, and
    what to change."""
    if plan.fits:
        return
    terms = plan.terms()
    allowance = terms.pop("CUDA/NCCL allowance")
    name = max(terms, key=lambda n: terms[n])
    value = terms[name]
    if value < allowance:
        name, value = "CUDA/NCCL allowance", allowance
    setting, advice = _advice(plan, name)
    raise ConfigError(
        f"{setting}: {name} {_gib(value)} GiB, total {_gib(plan.total)} of {_gib(plan.budget)} GiB per GPU "
        f"on {plan.stage_role()}: {advice}"
    )


def _advice(plan: MemoryPlan, term: str) -> tuple[str, str]:
    """(the `key=value` responsible for `term`, what to change)."""
    if term == "activations":
        steps = [f"lower {plan.tokens_setting.split('=')[0]}"]
        if plan.recompute != "full":
            steps.append("set parallel.recompute=full")
        return plan.tokens_setting, ", ".join(steps) + " or raise parallel.tp"
    if term == "logits chunk":
        return plan.logits_setting, f"lower {plan.logits_setting.split('=')[0]} or raise parallel.tp"
    if term == "optimizer state":
        if not plan.distributed_optimizer:
            return (
                "parallel.use_distributed_optimizer=false",
                "set parallel.use_distributed_optimizer=true, train.optimizer.cpu_offload=true or raise dp",
            )
        return (
            "train.optimizer.cpu_offload=false",
            "set train.optimizer.cpu_offload=true or raise dp / expert-dp (more GPUs per model replica)",
        )
    if term in ("parameters", "gradients", "critic (PPO)"):
        keys = ["ep", "tp", "pp"] if plan.moe_layers else ["tp", "pp"]
        setting = ", ".join(f"parallel.{k}={getattr(plan.layout, k)}" for k in keys)
        return setting, "raise " + "/".join(f"parallel.{k}" for k in keys) + " (or use more GPUs)"
    return f"cluster.gpu_memory_gb={plan.budget / GIB:g}", "the fixed CUDA/NCCL allowance alone does not fit"
