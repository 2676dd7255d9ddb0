"""Time of one RL step, phase by phase, predicted before anything starts.

The sibling of `memory_plan.py`: `predict(spec)` models each phase of a step from first principles
on a GPU of `gpus.py`, and `spec_from_config(config, ...)` reads the spec from a slimrl config
(`slimrl plan CONFIG --time`). docs/step_time.md has the formulas, every constant's origin and
the published step times the model is checked against (`step_time_anchors.py`).

The phases, on the busiest GPU (the slowest rank or engine sets the pace):
- **generation**: prefill as compute; decode as a roofline per engine and step: the weights the
  step reads (dense ones always, routed experts only where one of the step's tokens went) plus the
  KV cache of every running sequence, against the FLOPs of the step, plus the tensor-parallel
  all-reduces. The engine's sequences run at once (or as many as its KV cache and request cap
  allow); the step ends when the longest response is done (the long tail). Response lengths follow
  an exponential of the given mean truncated at the cap, and the longest runs to the cap (among
  thousands some always do); `Workload.longest_response` overrides that.
- **rollout_logprobs**: the embedded engine's true-on-policy re-scoring, a forward per response.
- **policy_logprobs / reference_logprobs**: forward-only passes over every token; the reference
  pass also swaps the reference weights in from host memory and back.
- **training**: forward and backward (plus recompute) from FLOPs per micro-batch and pipeline
  stage, each GEMM as a roofline against its weight reads; tensor-, context- and expert-parallel
  traffic per layer over NVLink or the network; the pipeline bubble; the data-parallel gradient
  reduce-scatter and parameter all-gather of the distributed optimizer; the optimizer step.
- **weight_sync**: the bytes the transport moves over which link, then each engine GPU's load of
  its shard, tensor by tensor (a software rate, calibrated).
- **offload / onload**: the trainer's state over the host link (colocated on GPUs).
- **overlap_hidden** (negative): with `algorithm.async_staleness: 1` the next rollout runs beside
  training, hiding the shorter of the two.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from slimrl.errors import ConfigError
from slimrl.model_arch import ModelArch
from slimrl.parallel_layout import ParallelLayout
from slimrl.planning.engine_plan import EngineWidths, hf_tensors
from slimrl.planning.gpus import GpuSpec
from slimrl.planning.memory_plan import Chunk, chunk_tensors

# ----------------------------------------------------------------------------- constants
MATMUL_EFFICIENCY = 0.41
"""Achieved fraction of the dense matmul peak in GEMM-bound work (training, logprob passes,
prefill, decode compute). Fitted on NeMo-RL v0.3's Llama-3.1-8B training phase (28 s: DP 8 on
8 H100, 1.9 M tokens, four optimizer steps)."""

HBM_EFFICIENCY = 0.73
"""Achieved fraction of peak HBM bandwidth when a kernel streams weights (decode, memory-bound
GEMMs, the optimizer step). Fitted, with `DECODE_STEP_OVERHEAD_S`, on NeMo-RL v0.3's Llama-3.1-8B
(58 s) and Llama-3.1-70B (84 s) generation phases: a small and a large model separate the
per-byte cost from the per-step one."""

KV_READ_EFFICIENCY = 0.5
"""Achieved fraction of peak HBM bandwidth when decode attention reads the paged KV cache (pages
of a few KiB gathered per sequence, below the streaming rate of weight reads). Assumed."""

DECODE_STEP_OVERHEAD_S = 4.5e-3
"""Seconds every decode step of an engine adds beyond its roofline and all-reduces: the
scheduler, sampling and detokenisation on the host, the gaps between kernels. Fitted with
`HBM_EFFICIENCY` (see there)."""

MOE_LAYER_OVERHEAD_S = 6.6e-3
"""Seconds each MoE layer adds per micro-batch and pass (forward, backward, recompute) in
Megatron training beyond its FLOPs and bytes: the token dispatcher's host synchronisation (tokens
per expert), the permutations and the launches around them. Fitted on NeMo-RL v0.3's
Qwen3-30B-A3B training phase (50 s, where FLOPs alone give 8 s)."""

WEIGHT_LOAD_BYTES_PER_S = 3.4e9
"""Rate at which an engine GPU takes in its shard of updated weights (bucket unpacking, the
loader's slicing and copies): a software rate, far below HBM bandwidth. Fitted, with
`WEIGHT_LOAD_S_PER_TENSOR`, on NeMo-RL v0.3's Llama-3.1-70B refit phase (14 s: 35 GB per vLLM GPU,
of which 2.6 s is the PP broadcast of the whole model across nodes)."""

WEIGHT_LOAD_S_PER_TENSOR = 3.7e-4
"""Per checkpoint tensor an engine GPU loads: the loader's Python dispatch. Fitted on NeMo-RL
v0.3's Qwen3-30B-A3B refit phase (12 s: 18,867 tensors, 128 experts x 3 per layer)."""

LINK_EFFICIENCY = 0.8
"""Achieved fraction of NVLink or NIC bandwidth by NCCL collectives at large messages (nccl-tests
bus bandwidth on DGX H100 is about 80% of the link for all-gather/reduce-scatter). Not fitted."""

COLLECTIVE_LATENCY_S = 10e-6
"""Latency of one small collective inside an NVLink domain (nccl-tests, 8 H100 GPUs: ~10 us).
Not fitted."""

NETWORK_LATENCY_S = 50e-6
"""Latency of one small collective across nodes over InfiniBand (nccl-tests all-reduce of a few
hundred KiB over 2-8 nodes of 8 GPUs: tens of microseconds). Not fitted."""

HOST_EFFICIENCY = 0.5
"""Achieved fraction of the host link for the trainer's offload/onload and the reference-weight
swap: pinned copies reach ~80% of PCIe, but the copies go tensor by tensor and the host side
allocates and pins as it goes. Not fitted: half the link is the stated assumption."""

REALLOCATING_OFFLOAD_BYTES_PER_S = 1.1e9
"""Rate per GPU of an offload that copies into fresh pageable memory and then into pinned memory
on every call (`.cpu().pin_memory()`: verl's `offload_megatron_model_to_cpu`), with every GPU of
the node doing it at once. Megatron's own `offload_to_cpu` pays this once and then copies into the
pinned buffer it keeps. Fitted on verl's Qwen3-30B-A3B `old_log_prob` (7.5 s beyond the forward
pass that its `ref` timer also holds, for 8.5 GB per GPU); the same row's `update_actor` pays it
again and is the check."""

DISK_BYTES_PER_S = 2e9
"""Shared-filesystem bandwidth per writer and reader for the `disk` transport (assumption)."""

MOE_ROUTING_IMBALANCE = 1.25
"""Tokens the busiest expert-parallel rank receives over the balanced share (the memory plan's
factor, `memory_plan.MOE_ROUTING_IMBALANCE`): it sets the pace of every MoE layer in training."""


# ----------------------------------------------------------------------------- the model's shape
@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Parameter counts and per-token costs of a model, whole (no parallel split)."""

    name: str
    layers: int
    moe_layers: int
    hidden: int
    vocab: int
    total_params: int
    dense_params: int
    """Matmul weights of the decoder layers outside the routed experts (attention, dense and shared
    MLPs, routers), all layers."""
    expert_params: int
    """Every routed expert of every layer."""
    experts: int
    topk: int
    embedding_params: int
    output_params: int
    attention_flops_per_context: float
    """Forward FLOPs one token spends per earlier token of its sequence, all layers (QK and AV)."""
    kv_elements_per_token: int
    """KV cache elements of one token, all layers (GQA keys and values; MLA's latent and rope key)."""
    hf_tensors: int
    """Checkpoint tensors (what a weight update loads one by one)."""

    @property
    def active_params(self) -> float:
        """Matmul parameters one token goes through (its top-k experts, the LM head)."""
        routed = self.expert_params * self.topk / self.experts if self.experts else 0.0
        return self.dense_params + routed + self.output_params


def model_shape(arch: ModelArch) -> ModelShape:
    """Counts from the same tensors the memory and engine plans build (no weights read)."""

    single = ParallelLayout(
        world_size=1, tp=1, pp=1, cp=1, ep=1, etp=1, dp=1, vpp=None, sequence_parallel=False
    )
    chunk = Chunk(layers=tuple(range(arch.num_layers)), pre_process=True, post_process=True)
    tensors = chunk_tensors(arch, single, chunk, use_te=True)
    expert = sum(t.numel for t in tensors if t.name.startswith("experts."))
    embedding = sum(t.numel for t in tensors if t.name == "embedding")
    output = sum(t.numel for t in tensors if t.name == "output_layer") or embedding
    total = sum(t.numel for t in tensors)
    dense = total - expert - embedding - (0 if arch.tie_word_embeddings else output)
    heads = arch.num_attention_heads
    if arch.mla is None:
        qk = v = arch.head_dim
        kv = 2 * arch.num_query_groups * arch.head_dim * arch.num_layers
    else:
        qk, v = arch.mla.qk_nope_head_dim + arch.mla.qk_rope_head_dim, arch.mla.v_head_dim
        kv = (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim) * arch.num_layers
    one = EngineWidths(tp=1, attn_dp=1, attn_tp=1, moe_ep=1, moe_tp=1, embed_tp=1, head_tp=1)
    moe = sum(
        1
        for i in range(arch.num_layers)
        if arch.is_moe and (not arch.moe_layer_pattern or arch.moe_layer_pattern[i])
    )
    return ModelShape(
        name=arch.model_type,
        layers=arch.num_layers,
        moe_layers=moe,
        hidden=arch.hidden_size,
        vocab=arch.vocab_size,
        total_params=total,
        dense_params=dense,
        expert_params=expert,
        experts=arch.num_experts or 0,
        topk=arch.moe_topk if arch.is_moe else 0,
        embedding_params=embedding,
        output_params=output,
        attention_flops_per_context=2.0 * heads * (qk + v) * arch.num_layers,
        kv_elements_per_token=kv,
        hf_tensors=len(hf_tensors(arch, one)) + (0 if arch.tie_word_embeddings else 1),
    )


# ----------------------------------------------------------------------------- the workload
@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one step generates and trains on; no config holds the lengths (`--prompt-tokens`,
    `--response-tokens`)."""

    samples: int
    """Responses per step (prompts x samples per prompt)."""
    prompt_tokens: float
    response_tokens: float
    """Mean generated tokens per response."""
    max_response_tokens: int
    """The cap (`rollout.sampling.max_new_tokens`, or what the engine's context leaves)."""
    longest_response: float | None = None
    """The longest response of the step when known; else the assumption of `longest()`."""

    def scale(self) -> float:
        """Mean of the exponential that, truncated at the cap, has mean `response_tokens`
        (infinite when the mean is the cap: every response runs to it)."""
        mean, cap = self.response_tokens, self.max_response_tokens
        if mean >= cap:
            return math.inf
        low, high = mean, mean * 1e6
        for _ in range(200):
            mid = (low + high) / 2
            if mid * -math.expm1(-cap / mid) < mean:
                low = mid
            else:
                high = mid
        return (low + high) / 2

    def longest(self) -> float:
        """Given, else the cap: among thousands of responses some run to the cap (RL runs report
        truncated samples every step), and the step waits for them."""
        if self.longest_response is not None:
            return min(self.longest_response, self.max_response_tokens)
        return float(self.max_response_tokens)

    def lengths(self, n: int) -> list[float]:
        """`n` response lengths at the distribution's quantiles, sorted; the last is `longest()`."""
        mu, cap = self.scale(), self.max_response_tokens
        out = []
        for i in range(n):
            q = (i + 0.5) / n
            out.append(cap if math.isinf(mu) else min(cap, -mu * math.log1p(-q)))
        out = sorted(out)
        out[-1] = max(out[-1], self.longest())
        return out

    def expected_longest(self, n: int) -> float:
        """Mean of the longest of `n` responses (what `n` samples padded together take)."""
        mu, cap = self.scale(), self.max_response_tokens
        if math.isinf(mu) or n <= 1:
            return cap if math.isinf(mu) else self.response_tokens
        steps = 256
        width = cap / steps
        return sum(width * (1 - (-math.expm1(-(i + 0.5) * width / mu)) ** n) for i in range(steps))

    def sequence_square(self) -> float:
        """E[(prompt + response)^2]: what causal attention over packed sequences scales with."""
        mu, cap, p = self.scale(), self.max_response_tokens, self.prompt_tokens
        if math.isinf(mu):
            second = float(cap * cap)
        else:
            tail = math.exp(-cap / mu)
            second = 2 * mu * mu - tail * (2 * mu * cap + 2 * mu * mu)
        return p * p + 2 * p * self.response_tokens + second

    @property
    def tokens(self) -> float:
        return self.samples * (self.prompt_tokens + self.response_tokens)


# ----------------------------------------------------------------------------- the spec
@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """One rollout engine as one of its GPUs sees it."""

    count: int
    gpus: int
    """GPUs per engine (its TP size)."""
    dense_bytes: float
    """Weights every decode step reads on one GPU: attention, dense/shared MLPs, routers, LM head."""
    expert_bytes: float
    """Routed-expert weights on one GPU (read only where a token was routed)."""
    served_bytes: float
    """The whole model as served (bf16, or FP8 where quantised): what a weight update delivers."""
    weight_bytes_per_param: float
    kv_bytes_per_token: float
    """KV bytes one token takes on one GPU."""
    kv_tokens: int
    """Tokens the KV cache holds on one engine."""
    max_running: int
    """Requests the engine runs at once at most (its scheduler's cap)."""
    fp8: bool = False


@dataclass(frozen=True, kw_only=True)
class TrainerSpec:
    """The training side: layout and how a step is batched."""

    layout: ParallelLayout
    recompute: str | None
    micro_batch_tokens: int
    """Tokens per micro-batch of one data-parallel rank (before the context-parallel split)."""
    logprob_micro_batch_tokens: int
    micro_batch_samples: int | None = None
    """Unpacked: each micro-batch holds this many whole samples padded to the longest of them (the
    token budgets above are then unused)."""
    logprob_micro_batch_samples: int | None = None
    optimizer_steps: int
    """Optimizer steps per rollout (`train.steps_per_rollout`)."""
    layers_per_stage: int
    """Decoder layers of the most loaded pipeline stage (all its virtual stages)."""
    grad_bytes: int = 4
    """Bytes per gradient element in the data-parallel reduction (fp32 in slimrl)."""
    distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False
    """Gradient reduction hidden behind the backward pass (off in slimrl)."""
    offload_bytes: float = 0.0
    """Bytes per GPU the trainer moves to host and back when colocated (params, grads, optimizer)."""
    params_bytes: float = 0.0
    """Parameter bytes per GPU (the reference-weight swap moves them)."""
    cpu_optimizer_bytes: float = 0.0
    """Bytes per GPU crossing the host link per optimizer step with `train.optimizer.cpu_offload`."""
    offload_reallocates: bool = False
    """Each offload copies into fresh host memory (`REALLOCATING_OFFLOAD_BYTES_PER_S`) instead of
    a kept pinned buffer (slimrl's `TrainerState.offload`)."""
    dtype_bytes: int = 2


@dataclass(frozen=True, kw_only=True)
class StepSpec:
    model: ModelShape
    gpu: GpuSpec
    gpus_per_node: int
    trainer: TrainerSpec
    engines: EngineSpec
    workload: Workload
    colocate: bool = True
    async_staleness: int = 0
    policy_logprobs: bool = True
    """A forward-only pass for the old policy's logprobs (slimrl skips it when the training
    forward can supply them: `trainer/rl.py::fused_old_logprobs`)."""
    reference_logprobs: bool = False
    rollout_rescoring: bool = False
    """The engine scores every finished response again with the trainer's own model (true
    on-policy on the embedded engine: docs/true_on_policy.md)."""
    transport: str = "tensor"
    """slimrl's `rollout.weight_sync` (`tensor`, `distributed`, `disk`), or a published run's
    (`gather`: NeMo-RL v0.3; `export`: NeMo-RL v0.5 on, Megatron-Bridge)."""
    offload: bool = True
    """Colocated on GPUs: the trainer's state leaves the device while the engines generate."""
    notes: tuple[str, ...] = ()


@dataclass
class StepTime:
    phases: dict[str, float]
    step: float
    assumptions: dict[str, str] = field(default_factory=dict)
    detail: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict:
        return {"phases": dict(self.phases), "step": self.step, "assumptions": dict(self.assumptions)}


# ----------------------------------------------------------------------------- primitives
def _roofline(flops: float, nbytes: float, gpu: GpuSpec) -> float:
    return max(
        flops / (gpu.matmul_flops * MATMUL_EFFICIENCY), nbytes / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY)
    )


def _link(gpu: GpuSpec, span: int) -> tuple[float, float]:
    """(bandwidth, latency) of a group spanning `span` consecutive GPUs: NVLink inside a domain,
    the network beyond it."""
    if span <= gpu.nvlink_domain and gpu.nvlink_bytes_per_s > 0:
        return gpu.nvlink_bytes_per_s * LINK_EFFICIENCY, COLLECTIVE_LATENCY_S
    return gpu.network_bytes_per_s * LINK_EFFICIENCY, NETWORK_LATENCY_S


def _collective(nbytes: float, members: int, span: int, gpu: GpuSpec, kind: str) -> float:
    """One ring collective of `nbytes` (the full buffer) over `members` GPUs spanning `span`:
    all-gather / reduce-scatter / all-to-all move (n-1)/n of it per GPU, all-reduce twice that."""
    if members <= 1:
        return 0.0
    bandwidth, latency = _link(gpu, span)
    factor = 2.0 if kind == "all_reduce" else 1.0
    return latency + factor * nbytes * (members - 1) / members / bandwidth


# ----------------------------------------------------------------------------- generation
def _decode_step(spec: StepSpec, running: int, context: float) -> float:
    """One decode step of an engine with `running` sequences holding `context` tokens of KV."""
    e, m, gpu = spec.engines, spec.model, spec.gpu
    touched = 1.0
    if m.experts:
        touched = 1.0 - (1.0 - 1.0 / m.experts) ** (running * m.topk)
    weights = e.dense_bytes + e.expert_bytes * touched
    flops = (running * 2 * m.active_params + context * m.attention_flops_per_context) / e.gpus
    peak = gpu.fp8_flops if e.fp8 else gpu.matmul_flops
    compute = flops / (peak * MATMUL_EFFICIENCY)
    memory = weights / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY)
    memory += context * e.kv_bytes_per_token / (gpu.hbm_bytes_per_s * KV_READ_EFFICIENCY)
    all_reduce = _collective(running * m.hidden * 2, e.gpus, e.gpus, gpu, "all_reduce")
    return max(compute, memory) + 2 * m.layers * all_reduce + DECODE_STEP_OVERHEAD_S


def _schedule(lengths: list[float], slots: int) -> list[tuple[float, float]]:
    """(start, length) of each sequence on `slots` slots, first come first served (the longest
    starts first)."""
    if slots >= len(lengths):
        return [(0.0, n) for n in lengths]
    order = [lengths[-1], *lengths[:-1]]
    free = [0.0] * slots
    out = []
    for n in order:
        start = min(free)
        free[free.index(start)] = start + n
        out.append((start, n))
    return out


def generation(spec: StepSpec) -> tuple[float, dict[str, str]]:
    """Prefill plus decode of the busiest engine, which holds the step's longest response."""
    w, e, m, gpu = spec.workload, spec.engines, spec.model, spec.gpu
    per_engine = math.ceil(w.samples / e.count)
    lengths = w.lengths(per_engine)
    fits = max(1, int(e.kv_tokens // max(w.prompt_tokens + w.response_tokens, 1)))
    slots = max(1, min(per_engine, e.max_running, fits))
    sequences = _schedule(lengths, slots)
    end = max(s + n for s, n in sequences)
    starts = sorted(s for s, _ in sequences)
    ends = sorted(s + n for s, n in sequences)
    points = 96
    decode = 0.0
    width = end / points
    for i in range(points):
        t = (i + 0.5) * width
        running = bisect.bisect_right(starts, t) - bisect.bisect_right(ends, t)
        if running <= 0:
            continue
        context = sum(w.prompt_tokens + t - s for s, n in sequences if s <= t < s + n)
        decode += width * _decode_step(spec, running, context)
    prompt = per_engine * w.prompt_tokens
    flops = prompt * 2 * m.active_params + per_engine * w.prompt_tokens**2 / 2 * m.attention_flops_per_context
    prefill = flops / e.gpus / (gpu.matmul_flops * MATMUL_EFFICIENCY)
    notes = {
        "per_engine": f"{per_engine} responses per engine, {slots} at once "
        f"(request cap {e.max_running}, KV cache {e.kv_tokens} tokens)",
        "longest": f"longest response {w.longest():.0f} tokens of cap {w.max_response_tokens}",
    }
    return prefill + decode, notes


# ----------------------------------------------------------------------------- trainer passes
def _stage_fraction(spec: StepSpec) -> float:
    return spec.trainer.layers_per_stage / spec.model.layers


def _micro_batch(spec: StepSpec, tokens: float, train: bool) -> float:
    """Seconds one pipeline stage spends on one micro-batch of `tokens` (forward only, or forward,
    backward and recompute), on each GPU of its tensor/context-parallel group. Backward is twice
    the forward's FLOPs and as many collectives; full recompute runs the forward once more."""
    t, m, gpu, w = spec.trainer, spec.model, spec.gpu, spec.workload
    lay = t.layout
    share = _stage_fraction(spec)
    local = tokens / lay.cp  # tokens of this context-parallel rank; tensor-parallel ranks share them
    recompute = 1.0 if train and t.recompute == "full" else 0.0
    flop_passes = 3.0 + recompute if train else 1.0
    comm_passes = 2.0 + recompute if train else 1.0
    time = _roofline(
        2 * local * m.dense_params * share / lay.tp, m.dense_params * share / lay.tp * t.dtype_bytes, gpu
    )
    time *= flop_passes
    sequences = local / (w.prompt_tokens + w.response_tokens)
    attention = sequences * w.sequence_square() / 2 * m.attention_flops_per_context * share / lay.tp
    attention_passes = flop_passes + (1.0 if train and t.recompute == "selective" else 0.0)
    time += attention * attention_passes / (gpu.matmul_flops * MATMUL_EFFICIENCY)
    # The LM head sits on the last stage; a pipeline is as slow as its slowest stage, which is that
    # one (or the first, whose embedding costs no FLOPs): charge it to the stage modelled.
    head = _roofline(2 * local * m.output_params / lay.tp, m.output_params / lay.tp * t.dtype_bytes, gpu)
    time += head * (3.0 if train else 1.0)
    moe_layers = m.moe_layers * share
    if moe_layers:
        per_expert = m.expert_params / m.experts / m.moe_layers
        routed = local / lay.tp * m.topk * lay.etp * MOE_ROUTING_IMBALANCE  # rows of this GPU's experts
        flops = routed * 2 * per_expert / lay.etp * moe_layers
        weights = m.expert_params / (lay.ep * lay.etp) * t.dtype_bytes * moe_layers / m.moe_layers
        time += _roofline(flops, weights, gpu) * (1.0 + recompute)
        if train:  # data and weight gradients: twice the FLOPs, weights read and fp32 grads accumulated
            time += _roofline(2 * flops, 5 * weights, gpu)
        dispatch = local / lay.tp * m.topk * m.hidden * t.dtype_bytes
        all_to_all = _collective(dispatch, lay.ep, lay.ep * lay.etp, gpu, "all_to_all")
        time += moe_layers * (2 * all_to_all + MOE_LAYER_OVERHEAD_S) * comm_passes
    layers = m.layers * share
    activations = local * m.hidden * t.dtype_bytes
    if lay.tp > 1:
        if lay.sequence_parallel:  # all-gather before qkv and fc1, reduce-scatter after proj and fc2
            tp_time = 4 * _collective(activations, lay.tp, lay.tp, gpu, "all_gather")
        else:
            tp_time = 2 * _collective(activations, lay.tp, lay.tp, gpu, "all_reduce")
        time += layers * tp_time * comm_passes
    if lay.cp > 1:  # ring attention: every rank's keys and values visit every other rank
        kv = local * m.kv_elements_per_token / m.layers * t.dtype_bytes * lay.cp
        time += layers * _collective(kv, lay.cp, lay.tp * lay.cp, gpu, "all_gather") * comm_passes
    if lay.pp > 1:  # activations to the next stage (its gradient back), across nodes in general
        bandwidth, latency = _link(gpu, lay.world_size // lay.pp + 1)
        time += (latency + activations / lay.tp / bandwidth) * (2.0 if train else 1.0)
    return time


def _pipeline(spec: StepSpec, micro_batches: int, per_micro_batch: float) -> float:
    """Micro-batches through the pipeline: (m + (pp - 1) / vpp) slots of the slowest stage."""
    lay = spec.trainer.layout
    return (micro_batches + (lay.pp - 1) / (lay.vpp or 1)) * per_micro_batch


def _tokens_per_rank(spec: StepSpec) -> float:
    return spec.workload.tokens / spec.trainer.layout.dp


def _micro_batches(spec: StepSpec, tokens: float, budget: int, samples: int | None) -> tuple[int, float]:
    """(count, tokens computed per micro-batch) for `tokens` of one rank: packed up to `budget`
    tokens, or `samples` whole samples padded to the longest of them."""
    w = spec.workload
    if samples:
        count = math.ceil(tokens / (w.prompt_tokens + w.response_tokens) / samples)
        return count, samples * (w.prompt_tokens + w.expected_longest(samples))
    micro = min(budget, tokens)
    return math.ceil(tokens / micro), micro


def forward_pass(spec: StepSpec) -> float:
    """One forward-only pass over every token of the step (a logprob pass)."""
    t = spec.trainer
    count, micro = _micro_batches(
        spec, _tokens_per_rank(spec), t.logprob_micro_batch_tokens, t.logprob_micro_batch_samples
    )
    return _pipeline(spec, count, _micro_batch(spec, micro, train=False))


def reference_swap(spec: StepSpec) -> float:
    """Swapping the reference weights in from host memory and the live ones back
    (`trainer/weight_store.py`: save live, load reference, load live)."""
    return 3 * spec.trainer.params_bytes / (spec.gpu.host_bytes_per_s * HOST_EFFICIENCY)


def _gradient_sync(spec: StepSpec) -> float:
    """Distributed optimizer: reduce-scatter of the gradients, all-gather of the parameters, over
    the data-parallel group (dense weights: dp * cp ranks; routed experts: the expert-dp group)."""
    t, m, gpu = spec.trainer, spec.model, spec.gpu
    lay = t.layout
    share = _stage_fraction(spec)
    dense = (m.dense_params * share + (m.embedding_params + m.output_params) / lay.pp) / lay.tp
    experts = m.expert_params * share / (lay.ep * lay.etp)
    time = 0.0
    groups = ((dense, lay.dp * lay.cp, lay.tp), (experts, lay.expert_dp, lay.ep * lay.etp))
    for params, members, stride in groups:
        if members <= 1 or params == 0:
            continue
        span = members * stride
        if t.distributed_optimizer:
            time += _collective(params * t.grad_bytes, members, span, gpu, "reduce_scatter")
            time += _collective(params * t.dtype_bytes, members, span, gpu, "all_gather")
        else:
            time += _collective(params * t.grad_bytes, members, span, gpu, "all_reduce")
    return time


def _optimizer_step(spec: StepSpec) -> float:
    """Adam over this rank's shard: reads and writes fp32 main weights, m, v and the gradient."""
    t, gpu = spec.trainer, spec.gpu
    if t.cpu_optimizer_bytes:
        return t.cpu_optimizer_bytes / (gpu.host_bytes_per_s * HOST_EFFICIENCY)
    shard = t.params_bytes / t.dtype_bytes / (t.layout.dp if t.distributed_optimizer else 1)
    return shard * 16 * 2 / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY)


def training(spec: StepSpec) -> float:
    """Every optimizer step of the rollout: micro-batches through the pipeline, then the
    gradient reduction (hidden when it overlaps the backward) and the optimizer step."""
    t = spec.trainer
    per_step = _tokens_per_rank(spec) / t.optimizer_steps
    count, micro = _micro_batches(spec, per_step, t.micro_batch_tokens, t.micro_batch_samples)
    compute = _pipeline(spec, count, _micro_batch(spec, micro, train=True))
    sync = _gradient_sync(spec)
    if t.overlap_grad_reduce:
        sync = max(0.0, sync - compute)
    return t.optimizer_steps * (compute + sync + _optimizer_step(spec))


# ----------------------------------------------------------------------------- weight sync
def weight_sync(spec: StepSpec) -> tuple[float, str]:
    """Bytes each transport moves over which link, then every engine GPU's load of its shard
    (the loader still walks every checkpoint tensor)."""
    e, m, gpu, t = spec.engines, spec.model, spec.gpu, spec.trainer
    served, world = e.served_bytes, t.layout.world_size
    load = served / e.gpus / WEIGHT_LOAD_BYTES_PER_S + m.hf_tensors * WEIGHT_LOAD_S_PER_TENSOR
    quantize = 0.0
    if e.fp8:  # the owners read bf16 and write fp8 of every tensor
        quantize = 3 * m.total_params / world / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY)
    gather = _collective(t.params_bytes * t.layout.tp, t.layout.tp, t.layout.tp, gpu, "all_gather")
    network = gpu.network_bytes_per_s * LINK_EFFICIENCY
    if spec.transport == "tensor":
        bandwidth, _ = _link(gpu, world)
        move = served / bandwidth if world > 1 else 0.0
        how = f"every bucket broadcast to all {world} trainer ranks, mapped by the engine rank on each GPU"
    elif spec.transport == "gather":
        # Megatron orders ranks tp-cp-ep-dp-pp: a PP group spans the world (one rank per stage,
        # `world / pp` apart), an EP group is `ep x etp` consecutive ranks of the expert layout.
        lay = t.layout
        move = 0.0
        if lay.pp > 1:
            bandwidth, _ = _link(gpu, world)
            move += served * (lay.pp - 1) / lay.pp / bandwidth
        if lay.ep > 1:
            bandwidth, _ = _link(gpu, lay.ep * lay.etp)
            move += served * m.expert_params / m.total_params * (lay.ep - 1) / lay.ep / bandwidth
        how = (
            "every trainer GPU gathers the whole model (TP all-gather, a broadcast from the owning PP "
            "stage, EP all-gather) and its colocated engine rank loads its shard by CUDA IPC "
            "(NeMo-RL v0.3's `gather_params`)"
        )
    elif spec.transport == "export":
        span = t.layout.ep * t.layout.pp
        bandwidth, _ = _link(gpu, span)
        move = served / bandwidth if span > 1 else 0.0
        how = (
            "every trainer GPU receives the whole model (broadcast over PP, all-gathered over EP) "
            "and hands its colocated engine rank its shard (NeMo-RL v0.6's Megatron-Bridge export)"
        )
    elif spec.transport == "distributed":
        move = 2 * served / network
        how = "owners -> trainer rank 0 -> NCCL broadcast to every engine GPU"
    else:
        move = served / world / DISK_BYTES_PER_S + served / DISK_BYTES_PER_S
        how = "owners write safetensors, every engine reads them all"
    return gather + quantize + move + load, how


# ----------------------------------------------------------------------------- the step
def predict(spec: StepSpec) -> StepTime:
    """Every phase of one step of `spec`, and the step."""
    gen, gen_notes = generation(spec)
    phases: dict[str, float] = {"generation": gen, "rollout_logprobs": 0.0}
    if spec.rollout_rescoring:  # one forward per finished response, on the busiest engine
        w, m, e = spec.workload, spec.model, spec.engines
        flops = math.ceil(w.samples / e.count) * (w.prompt_tokens + w.response_tokens) * 2 * m.active_params
        phases["rollout_logprobs"] = flops / e.gpus / (spec.gpu.matmul_flops * MATMUL_EFFICIENCY)
    forward = forward_pass(spec)
    phases["policy_logprobs"] = forward if spec.policy_logprobs else 0.0
    phases["reference_logprobs"] = forward + reference_swap(spec) if spec.reference_logprobs else 0.0
    phases["training"] = training(spec)
    sync, how = weight_sync(spec)
    phases["weight_sync"] = sync
    moves = spec.colocate and spec.offload and spec.trainer.offload_bytes > 0
    host = spec.gpu.host_bytes_per_s * HOST_EFFICIENCY
    out = REALLOCATING_OFFLOAD_BYTES_PER_S if spec.trainer.offload_reallocates else host
    phases["offload"] = spec.trainer.offload_bytes / out if moves else 0.0
    phases["onload"] = spec.trainer.offload_bytes / host if moves else 0.0
    hidden = 0.0
    if spec.async_staleness and not spec.colocate:
        trainer_side = sum(v for k, v in phases.items() if k != "generation")
        hidden = min(phases["generation"], trainer_side)
    phases["overlap_hidden"] = -hidden if hidden else 0.0
    w = spec.workload
    assumptions = {
        "gpu": f"{spec.gpu.name}: {spec.gpu.source}",
        "workload": f"{w.samples} responses of {w.prompt_tokens:g} prompt + {w.response_tokens:g} "
        f"generated tokens on average",
        "lengths": "response lengths exponential with the given mean, truncated at the cap; "
        + gen_notes["longest"]
        + ("" if w.longest_response is None else " (given)"),
        "engines": f"{spec.engines.count} x {spec.engines.gpus} GPUs, " + gen_notes["per_engine"],
        "weight_sync": f"{spec.transport}: {how}",
        "efficiency": f"matmul {MATMUL_EFFICIENCY:g}, HBM {HBM_EFFICIENCY:g}, links {LINK_EFFICIENCY:g}, "
        f"host {HOST_EFFICIENCY:g} of peak",
    }
    for note in spec.notes:
        key, _, text = note.partition(": ")
        assumptions[key] = text
    return StepTime(phases=phases, step=sum(phases.values()), assumptions=assumptions)


def check_workload(prompt_tokens: float | None, response_tokens: float | None) -> tuple[float, float]:
    """The lengths no config holds: a one-line error naming the flag when one is missing."""
    for flag, value in (("--prompt-tokens", prompt_tokens), ("--response-tokens", response_tokens)):
        if value is None:
            raise ConfigError(
                f"{flag}: --time needs the mean {flag.split('-')[2]} tokens per sample, which no config "
                f"holds; give {flag} N"
            )
    assert prompt_tokens is not None and response_tokens is not None
    return prompt_tokens, response_tokens
