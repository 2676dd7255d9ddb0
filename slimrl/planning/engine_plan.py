"""Per-GPU memory plan of one SGLang rollout engine, made before anything starts.

The sibling of `memory_plan.py` (the trainer's plan) for the engines: `plan_engine(config)` reads
only the checkpoint's config.json and works out what one GPU of a `rollout.gpus_per_engine`-GPU
SGLang 0.5.23 engine holds, the way SGLang builds it:

- **weights**: every checkpoint tensor as SGLang shards it (`hf_tensors`): attention over the
  attention-TP group (`tp / dp` with DP attention: replicated per DP rank when dp = tp, the
  `fused_qkv_a_proj_with_mqa` / `kv_a_proj_with_mqa` of MLA always replicated), routed experts
  `E / ep` per GPU each split over `tp / ep`, dense and shared-expert MLPs over the full TP group,
  the embedding over attention TP and `lm_head` over TP (vocab padded to a multiple of 64, or of
  64 x tp); with `rollout.sglang.quantization: fp8` the tensors `megatron_bridge/fp8_names.py`
  names are 1 byte per element plus one float32 scale per 128x128 block, the rest bf16; MLA keeps a
  bf16 copy of `kv_b_proj` split into `w_kc`/`w_vc` (its absorbed decode path);
- **KV cache** of one full sequence (`data.max_prompt_tokens + rollout.sampling.max_new_tokens`):
  GQA `2 * layers * max(1, kv_heads / attention tp) * head_dim * 2 B`, MLA
  `(kv_lora_rank + qk_rope_head_dim) * layers * 2 B` (the latent is whole on every GPU);
- **CUDA graphs + activations**: SGLang's own reserve (`arg_groups/memory_hook.py`, the estimate it
  derives its default `mem_fraction_static` from), `sglang_reserve_mib`.

It fits when weights + one sequence's KV fit `mem_fraction_static * cluster.gpu_memory_gb` (SGLang's
static pool) and SGLang's reserve fits the rest; `check_engine_fits` refuses it otherwise in one
line, naming the key and the numbers. Runs at load for SGLang engines on GPUs (`preflight/checks.py`);
`slimrl plan` prints it after the trainer's plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slimrl.config.schema import SlimConfig
from slimrl.errors import ConfigError
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.megatron_bridge.fp8_names import is_quantized_name
from slimrl.model_arch import ModelArch

GIB = 1024**3
MIB = 1024**2

FP8_BLOCK = 128
"""Block of the FP8 checkpoint's float32 scales (`weight_block_size` [128, 128]); SGLang also needs
every split dimension of a block-quantised linear to be a multiple of it (`Fp8LinearMethod`)."""

SERVED_BYTES = 2
"""SGLang serves the unquantised tensors in bf16 (`--dtype auto` on these bf16 checkpoints)."""

VOCAB_PADDING = 64
"""`DEFAULT_VOCAB_PADDING_SIZE` of SGLang's `VocabParallelEmbedding`."""

KV_CACHE_BYTES = {"auto": 2, "bf16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
"""Bytes per KV element for `--kv-cache-dtype` (`auto`: the model dtype, bf16)."""


def extra_flags(config: SlimConfig) -> dict[str, object]:
    """`rollout.sglang.extra_args` by SGLang flag name (`cuda_graph_max_bs_decode` and
    `--cuda-graph-max-bs-decode` are one flag, as in `server_args.py`)."""
    return {str(k).lstrip("-").replace("_", "-"): v for k, v in config.rollout.sglang.extra_args.items()}


# ------------------------------------------------------------------------------- widths
@dataclass(frozen=True, slots=True)
class EngineWidths:
    """How SGLang splits one engine over its GPUs (`runtime_context.derive_parallel_widths`)."""

    tp: int
    attn_dp: int
    """Data-parallel attention ranks (`--dp-size` with `--enable-dp-attention`, else 1)."""
    attn_tp: int
    moe_ep: int
    moe_tp: int
    embed_tp: int
    """The input embedding: over the attention-TP group with DP attention (`get_embedding_tp_kwargs`)."""
    head_tp: int
    """`lm_head`: over the whole TP group (attention TP only with `--enable-dp-lm-head`)."""

    @classmethod
    def of(cls, config: SlimConfig) -> EngineWidths:
        sglang, tp = config.rollout.sglang, config.rollout.gpus_per_engine
        extra = extra_flags(config)
        attn_dp = tp if sglang.dp_attention else 1
        attn_tp = tp // attn_dp
        head_tp = attn_tp if extra.get("enable-dp-lm-head") else tp
        return cls(
            tp=tp,
            attn_dp=attn_dp,
            attn_tp=attn_tp,
            moe_ep=sglang.ep_size,
            moe_tp=tp // sglang.ep_size,
            embed_tp=attn_tp if sglang.dp_attention else tp,
            head_tp=head_tp,
        )


# ------------------------------------------------------------------------------ tensors
@dataclass(frozen=True, slots=True)
class EngineTensor:
    """One checkpoint tensor as one GPU of the engine holds it."""

    name: str
    shape: tuple[int, ...]
    term: str
    """The plan's row it counts in."""
    split: str | None = None
    """`rows`/`cols` when SGLang splits it over a group of more than one GPU (column/row parallel),
    `merged` for a part of a fused linear (gate_up, qkv): the dimensions SGLang's FP8 blocks must divide."""
    fp32: bool = False
    """Kept in float32 whatever the model dtype (DeepSeek's `e_score_correction_bias`)."""


def _vocab_rows(vocab: int, tp: int) -> int:
    """Rows per GPU of SGLang's `VocabParallelEmbedding`: the vocabulary padded to 64, or to
    64 * tp when that does not split evenly, then divided over tp."""
    padding = VOCAB_PADDING
    if -(-vocab // padding) * padding % tp:
        padding *= tp
    return -(-vocab // padding) * padding // tp


def _split(size: int, parts: int) -> tuple[int, str | None]:
    return size // parts, ("rows" if parts > 1 else None)


def _attention(arch: ModelArch, w: EngineWidths, prefix: str) -> list[EngineTensor]:
    h, heads = arch.hidden_size, arch.num_attention_heads // w.attn_tp
    out: list[EngineTensor] = []
    t = "attention"
    split = "rows" if w.attn_tp > 1 else None
    cols = "cols" if w.attn_tp > 1 else None
    mla = arch.mla
    if mla is None:
        d = arch.head_dim
        kv = max(1, arch.num_query_groups // w.attn_tp) * d  # fewer kv heads than ranks: replicated
        for proj, rows in (("q_proj", heads * d), ("k_proj", kv), ("v_proj", kv)):
            out.append(EngineTensor(f"{prefix}self_attn.{proj}.weight", (rows, h), t, "merged"))
            if arch.qkv_bias:
                out.append(EngineTensor(f"{prefix}self_attn.{proj}.bias", (rows,), t))
        if arch.qk_norm:
            out += [EngineTensor(f"{prefix}self_attn.{n}.weight", (d,), t) for n in ("q_norm", "k_norm")]
        return [*out, EngineTensor(f"{prefix}self_attn.o_proj.weight", (h, heads * d), t, cols)]
    q_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if mla.q_lora_rank is None:
        out.append(EngineTensor(f"{prefix}self_attn.q_proj.weight", (heads * q_head, h), t, split))
    else:
        out += [
            EngineTensor(f"{prefix}self_attn.q_a_proj.weight", (mla.q_lora_rank, h), t),  # replicated
            EngineTensor(f"{prefix}self_attn.q_a_layernorm.weight", (mla.q_lora_rank,), t),
            EngineTensor(f"{prefix}self_attn.q_b_proj.weight", (heads * q_head, mla.q_lora_rank), t, split),
        ]
    kv_up = (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
    return [
        *out,
        EngineTensor(
            f"{prefix}self_attn.kv_a_proj_with_mqa.weight", (mla.kv_lora_rank + mla.qk_rope_head_dim, h), t
        ),  # replicated on every GPU (SGLang's ReplicatedLinear)
        EngineTensor(f"{prefix}self_attn.kv_a_layernorm.weight", (mla.kv_lora_rank,), t),
        EngineTensor(f"{prefix}self_attn.kv_b_proj.weight", kv_up, t, split),
        EngineTensor(f"{prefix}self_attn.o_proj.weight", (h, heads * mla.v_head_dim), t, cols),
    ]


def _mlp(prefix: str, hidden: int, ffn: int, parts: int, term: str) -> list[EngineTensor]:
    """SwiGLU: gate and up fused (merged, column-parallel), down row-parallel, over `parts` GPUs."""
    local = ffn // parts
    return [
        EngineTensor(f"{prefix}gate_proj.weight", (local, hidden), term, "merged"),
        EngineTensor(f"{prefix}up_proj.weight", (local, hidden), term, "merged"),
        EngineTensor(f"{prefix}down_proj.weight", (hidden, local), term, "cols" if parts > 1 else None),
    ]


def _moe(arch: ModelArch, w: EngineWidths, prefix: str) -> list[EngineTensor]:
    """Router (replicated), this GPU's `E / ep` experts split over `tp / ep`, shared experts over tp
    (SGLang fuses DeepSeek's shared expert into the routed ones only without expert parallelism on
    AMD; on NVIDIA GPUs it stays a separate TP-split MLP)."""
    h, experts = arch.hidden_size, arch.num_experts or 0
    assert arch.moe_ffn_hidden_size is not None
    out = [EngineTensor(f"{prefix}mlp.gate.weight", (experts, h), "norms, routers")]
    if arch.router_expert_bias:
        out.append(
            EngineTensor(f"{prefix}mlp.gate.e_score_correction_bias", (experts,), "norms, routers", fp32=True)
        )
    for index in range(experts // w.moe_ep):
        out += _mlp(f"{prefix}mlp.experts.{index}.", h, arch.moe_ffn_hidden_size, w.moe_tp, "routed experts")
    if arch.shared_expert_ffn_hidden_size:
        out += _mlp(
            f"{prefix}mlp.shared_experts.", h, arch.shared_expert_ffn_hidden_size, w.tp, "dense + shared MLP"
        )
    return out


def hf_tensors(arch: ModelArch, w: EngineWidths) -> list[EngineTensor]:
    """Every checkpoint tensor of GPU 0 of the engine (every GPU holds the same sizes), by HF name,
    before FP8 quantisation (its scales are derived from these by `tensor_bytes`)."""
    h = arch.hidden_size
    out = [
        EngineTensor(
            "model.embed_tokens.weight", (_vocab_rows(arch.vocab_size, w.embed_tp), h), "embedding, lm_head"
        )
    ]
    for layer in range(arch.num_layers):
        prefix = f"model.layers.{layer}."
        out += [
            EngineTensor(f"{prefix}input_layernorm.weight", (h,), "norms, routers"),
            EngineTensor(f"{prefix}post_attention_layernorm.weight", (h,), "norms, routers"),
        ]
        out += _attention(arch, w, prefix)
        moe = arch.is_moe and (not arch.moe_layer_pattern or arch.moe_layer_pattern[layer])
        if moe:
            out += _moe(arch, w, prefix)
        else:
            out += _mlp(f"{prefix}mlp.", h, arch.ffn_hidden_size, w.tp, "dense + shared MLP")
    out.append(EngineTensor("model.norm.weight", (h,), "norms, routers"))
    if not arch.tie_word_embeddings:
        out.append(
            EngineTensor("lm_head.weight", (_vocab_rows(arch.vocab_size, w.head_tp), h), "embedding, lm_head")
        )
    return out


def tensor_bytes(tensor: EngineTensor, fp8: bool) -> int:
    """Bytes of one tensor as served: FP8 weights are 1 byte per element plus a float32 scale per
    128x128 block (`weight_scale_inv`, counted per checkpoint tensor), everything else bf16."""
    numel = math.prod(tensor.shape)
    if tensor.fp32:
        return 4 * numel
    if fp8 and is_quantized_name(tensor.name) and len(tensor.shape) == 2:
        rows, cols = tensor.shape
        return numel + 4 * -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK)
    return SERVED_BYTES * numel


def mla_absorbed_bytes(arch: ModelArch, w: EngineWidths) -> int:
    """SGLang's DeepSeek loader keeps `kv_b_proj` split into `w_kc`/`w_vc` for the absorbed MLA
    decode (`deepseek_weight_loader.post_load_weights`), in bf16 (FP8 blocks are dequantised
    first): one more copy of every layer's kv_b_proj."""
    mla = arch.mla
    if mla is None:
        return 0
    heads = arch.num_attention_heads // w.attn_tp
    return SERVED_BYTES * heads * (mla.qk_nope_head_dim + mla.v_head_dim) * mla.kv_lora_rank * arch.num_layers


def fp8_misalignment(tensors: list[EngineTensor]) -> EngineTensor | None:
    """The first quantised tensor SGLang's block FP8 refuses: a merged or split dimension that is
    not a multiple of 128 (`Fp8LinearMethod` / `Fp8MoEMethod.create_weights`)."""
    for tensor in tensors:
        if not is_quantized_name(tensor.name) or tensor.split is None:
            continue
        size = tensor.shape[1] if tensor.split == "cols" else tensor.shape[0]
        if size % FP8_BLOCK:
            return tensor
    return None


# --------------------------------------------------------------------------- KV cache
def kv_bytes_per_token(arch: ModelArch, w: EngineWidths, dtype_bytes: int) -> int:
    """KV bytes one token takes on one GPU: GQA keys and values of this GPU's kv heads
    (`ModelConfig.get_num_kv_heads`: at least one), MLA its whole compressed latent plus rope key."""
    if arch.mla is not None:
        return (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim) * arch.num_layers * dtype_bytes
    kv_heads = max(1, arch.num_query_groups // w.attn_tp)
    return 2 * arch.num_layers * kv_heads * arch.head_dim * dtype_bytes


# --------------------------------------------------------------- SGLang's reserve (CUDA graphs)
@dataclass(frozen=True, slots=True)
class ReserveInputs:
    """What SGLang 0.5.23's `handle_gpu_memory_settings` reads to size its runtime reserve."""

    gpu_mib: float
    tp: int
    attn_dp: int
    chunked_prefill_size: int | None = None
    decode_max_bs: int | None = None
    max_running_requests: int | None = None
    decode_graphs: bool = True


def sglang_defaults(gpu_mib: float, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, decode CUDA-graph max batch) SGLang picks for a GPU of `gpu_mib`."""
    if gpu_mib < 20 * 1024:
        return 2048, 8
    if gpu_mib < 35 * 1024:
        return 4096, 48 if tp < 4 else 160
    if gpu_mib < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if gpu_mib < 160 * 1024:  # H100 / A100 80 GB (< 90 GiB) and H20 / H200 alike
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def sglang_reserve_mib(inp: ReserveInputs) -> tuple[float, int, int]:
    """SGLang's estimate of a GPU's memory outside the static pool (MiB): activations of one chunked
    prefill (1.5 MiB per token), CUDA graphs of decode batches up to max_bs (2 MiB per batch slot, 3
    and 4.5 more per DP-attention rank), 512 MiB of metadata and 128 MiB per TP rank, at least 10 GiB
    on GPUs above 60 GiB. Prefill graphs are off by default in 0.5.23. Returns (MiB, chunk, max_bs)."""
    chunk, max_bs = sglang_defaults(inp.gpu_mib, inp.tp)
    chunk = inp.chunked_prefill_size or chunk
    if inp.decode_max_bs is not None:
        max_bs = inp.decode_max_bs
    elif inp.max_running_requests is not None:
        max_bs = min(max_bs, inp.max_running_requests)
    graph = max_bs * 2.0 if inp.decode_graphs else 0.0
    if inp.attn_dp > 1:  # DP attention pads every rank's batch to the graph's
        graph += max_bs * inp.attn_dp * 3
        if max_bs > 300:
            graph += max_bs * inp.attn_dp * 1.5
    reserve = 512 + max(chunk, 2048) * 1.5 + inp.tp / 8 * 1024 + graph
    if inp.gpu_mib > 60 * 1024:
        reserve = max(reserve, 10 * 1024)
    return reserve, chunk, max_bs


def _reserve_inputs(config: SlimConfig, w: EngineWidths) -> ReserveInputs:
    """The reserve's inputs: the GPU and engine widths, and the `extra_args` SGLang sizes it by."""
    extra = extra_flags(config)

    def number(flag: str) -> int | None:
        value = extra.get(flag)
        return None if value is None else int(value)  # type: ignore[call-overload]

    return ReserveInputs(
        gpu_mib=config.cluster.gpu_memory_gb * 1024,
        tp=w.tp,
        attn_dp=w.attn_dp,
        chunked_prefill_size=number("chunked-prefill-size"),
        decode_max_bs=number("cuda-graph-max-bs-decode"),
        max_running_requests=number("max-running-requests"),
        decode_graphs=not (extra.get("disable-cuda-graph") or extra.get("disable-decode-cuda-graph")),
    )


# ------------------------------------------------------------------------------------ plan
@dataclass(frozen=True, kw_only=True)
class EnginePlan:
    """One GPU of one engine: weights by term, KV of one sequence, the static pool and SGLang's
    reserve, all in bytes."""

    model: str
    widths: EngineWidths
    quantization: str | None
    gpus_per_node: int
    num_experts: int
    moe_layers: int
    weights: dict[str, int]
    """Term -> bytes on one GPU (`hf_tensors` grouped, plus the MLA copies)."""
    kv_per_token: int
    sequence_tokens: int
    sequence_setting: str
    mem_fraction_static: float
    gpu_memory: int
    reserve: int
    """SGLang's CUDA-graph + activation estimate."""
    reserve_detail: str

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def sequence_kv(self) -> int:
        return self.kv_per_token * self.sequence_tokens

    @property
    def static_pool(self) -> int:
        return int(self.mem_fraction_static * self.gpu_memory)

    @property
    def kv_room(self) -> int:
        return self.static_pool - self.weight_bytes

    @property
    def headroom(self) -> int:
        return self.gpu_memory - self.static_pool

    @property
    def needed(self) -> int:
        """What one GPU needs at the least: weights, one sequence's KV and SGLang's reserve."""
        return self.weight_bytes + self.sequence_kv + self.reserve

    @property
    def fits(self) -> bool:
        return self.kv_room >= self.sequence_kv and self.headroom >= self.reserve

    def render(self) -> str:
        return "\n".join(_render_lines(self))


def sequence_tokens(config: SlimConfig) -> tuple[int, str]:
    """The longest sequence an engine must hold: prompt bound + response bound, else the trainer's
    `train.max_seq_len` (what a longer one would be refused by anyway)."""
    prompt, new = config.data.max_prompt_tokens, config.rollout.sampling.max_new_tokens
    if prompt is None:
        return config.train.max_seq_len, f"train.max_seq_len={config.train.max_seq_len}"
    return prompt + new, f"data.max_prompt_tokens={prompt} + rollout.sampling.max_new_tokens={new}"


def plan_engine(config: SlimConfig) -> EnginePlan:
    """Plan one GPU of one SGLang engine of `config` (reads only config.json)."""
    arch = read_model_arch(config.model.hf_checkpoint, config.model.overrides)
    widths = EngineWidths.of(config)
    _check_splits(config, arch, widths)
    fp8 = config.rollout.sglang.quantization == "fp8"
    tensors = hf_tensors(arch, widths)
    if fp8 and (bad := fp8_misalignment(tensors)) is not None:
        dim, what = (bad.shape[1], "columns") if bad.split == "cols" else (bad.shape[0], "rows")
        raise ConfigError(
            f"rollout.sglang.quantization=fp8: {bad.name} has {dim} {what} per GPU (tp {widths.tp}, ep "
            f"{widths.moe_ep}), not a multiple of SGLang's {FP8_BLOCK}-wide FP8 blocks; change "
            "rollout.gpus_per_engine / rollout.sglang.ep_size, or serve bf16 (quantization=null)"
        )
    weights: dict[str, int] = {}
    for tensor in tensors:
        weights[tensor.term] = weights.get(tensor.term, 0) + tensor_bytes(tensor, fp8)
    if arch.mla is not None:
        weights["MLA w_kc/w_vc copies"] = mla_absorbed_bytes(arch, widths)
    extra = extra_flags(config)
    kv_dtype = str(extra.get("kv-cache-dtype", "auto"))
    if kv_dtype not in KV_CACHE_BYTES:
        raise ConfigError(
            f"rollout.sglang.extra_args.kv_cache_dtype={kv_dtype}: the engine plan knows "
            + ", ".join(KV_CACHE_BYTES)
        )
    reserve_mib, chunk, max_bs = sglang_reserve_mib(_reserve_inputs(config, widths))
    dp = f", DP attention x{widths.attn_dp}" if widths.attn_dp > 1 else ""
    tokens, setting = sequence_tokens(config)
    return EnginePlan(
        model=f"{arch.model_type} ({config.model.hf_checkpoint})",
        widths=widths,
        quantization=config.rollout.sglang.quantization,
        gpus_per_node=config.cluster.gpus_per_node,
        num_experts=arch.num_experts or 0,
        moe_layers=sum(arch.moe_layer_pattern) if arch.moe_layer_pattern else arch.num_layers * arch.is_moe,
        weights=weights,
        kv_per_token=kv_bytes_per_token(arch, widths, KV_CACHE_BYTES[kv_dtype]),
        sequence_tokens=tokens,
        sequence_setting=setting,
        mem_fraction_static=config.rollout.sglang.mem_fraction_static,
        gpu_memory=int(config.cluster.gpu_memory_gb * GIB),
        reserve=int(reserve_mib * MIB),
        reserve_detail=f"prefill chunk {chunk}, decode graphs to batch {max_bs}, tp {widths.tp}{dp}",
    )


def _check_splits(config: SlimConfig, arch: ModelArch, w: EngineWidths) -> None:
    """What SGLang asserts while building the model: heads over attention TP, experts over EP."""
    heads, kv = arch.num_attention_heads, arch.num_query_groups
    if heads % w.attn_tp or (arch.mla is None and (kv % w.attn_tp if kv >= w.attn_tp else w.attn_tp % kv)):
        raise ConfigError(
            f"rollout.gpus_per_engine={w.tp}: SGLang splits the model's {heads} attention heads "
            f"({kv} kv heads) over {w.attn_tp} GPUs of attention TP, which does not divide them"
        )
    if arch.is_moe and (arch.num_experts or 0) % w.moe_ep:
        raise ConfigError(
            f"rollout.sglang.ep_size={w.moe_ep}: must divide the model's {arch.num_experts} routed experts"
        )


# ----------------------------------------------------------------------------------- check
def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def node_engine_plan(config: SlimConfig) -> EnginePlan | None:
    """The plan of an engine of a whole node (`rollout.gpus_per_engine = cluster.gpus_per_node`,
    expert parallelism scaled with it), the most one engine may have; None if SGLang could not
    build that layout or it is the config's own."""
    import copy

    node, tp = config.cluster.gpus_per_node, config.rollout.gpus_per_engine
    if tp >= node or node % tp:
        return None
    whole = copy.deepcopy(config)
    whole.rollout.gpus_per_engine = node
    whole.rollout.sglang.ep_size = config.rollout.sglang.ep_size * (node // tp)
    try:
        return plan_engine(whole)
    except ConfigError:
        return None


def check_config_engines(config: SlimConfig) -> None:
    """`check_engine_fits` for the config's engines, with a whole node's plan to compare with when
    they do not fit a GPU at all."""
    plan = plan_engine(config)
    if not plan.fits:
        check_engine_fits(plan, node_engine_plan(config) if plan.needed > plan.gpu_memory else None)


def check_engine_fits(plan: EnginePlan, node: EnginePlan | None = None) -> None:
    """Refuse an engine whose weights, one sequence's KV and SGLang's reserve do not fit a GPU, in
    one line: the key, the numbers (GiB per GPU), and what to change. `node`: the same model on a
    whole node's engine (`node_engine_plan`), to say whether more GPUs per engine would do."""
    if plan.fits:
        return
    w = plan.widths
    numbers = (
        f"weights {_gib(plan.weight_bytes)} GiB + KV of one {plan.sequence_tokens}-token sequence "
        f"{_gib(plan.sequence_kv)} GiB + CUDA graphs/activations {_gib(plan.reserve)} GiB (SGLang's "
        f"estimate) = {_gib(plan.needed)} GiB per GPU"
    )
    if plan.needed > plan.gpu_memory:
        fp8 = "" if plan.quantization == "fp8" else "rollout.sglang.quantization=fp8, "
        limit = f"{numbers}, above the {_gib(plan.gpu_memory)} GiB of one GPU (cluster.gpu_memory_gb)"
        if w.tp >= plan.gpus_per_node or (node is not None and node.needed > node.gpu_memory):
            whole = (
                ""
                if node is None
                else f" (all {plan.gpus_per_node} in one engine: {_gib(node.needed)} GiB per GPU)"
            )
            raise ConfigError(
                f"rollout.gpus_per_engine={w.tp}: {limit}; an engine does not fit one node of "
                f"{plan.gpus_per_node} GPUs{whole}, and slimrl's launcher does not start engines spanning "
                f"nodes: use {fp8}GPUs with more memory (e.g. 141 GB H200: cluster.gpu_memory_gb=141) or "
                "shorter sequences"
            )
        more = "more GPUs per engine (rollout.gpus_per_engine"
        more += f"={node.widths.tp}: {_gib(node.needed)} GiB per GPU), " if node is not None else "), "
        raise ConfigError(
            f"rollout.gpus_per_engine={w.tp}: {limit}: use {more}{fp8}GPUs with more memory or shorter "
            "sequences"
        )
    low = (plan.weight_bytes + plan.sequence_kv) / plan.gpu_memory
    high = 1 - plan.reserve / plan.gpu_memory
    fraction = f"rollout.sglang.mem_fraction_static={plan.mem_fraction_static:g}"
    if plan.kv_room < plan.sequence_kv:
        raise ConfigError(
            f"{fraction}: SGLang's static pool of {_gib(plan.static_pool)} GiB per GPU must hold weights "
            f"{_gib(plan.weight_bytes)} GiB and the KV cache of one {plan.sequence_tokens}-token sequence, "
            f"{_gib(plan.sequence_kv)} GiB; raise it into "
            f"{math.ceil(low * 1000) / 1000:.3f}..{math.floor(high * 1000) / 1000:.3f}"
        )
    raise ConfigError(
        f"{fraction}: leaves {_gib(plan.headroom)} GiB per GPU outside SGLang's static pool, below the "
        f"{_gib(plan.reserve)} GiB SGLang reserves for CUDA graphs and activations ({plan.reserve_detail}); "
        f"lower it into {math.ceil(low * 1000) / 1000:.3f}..{math.floor(high * 1000) / 1000:.3f}"
    )


# ---------------------------------------------------------------------------------- render
def _notes(plan: EnginePlan) -> dict[str, str]:
    """The right-hand column: how each weight term is split."""
    w = plan.widths
    replicated = " (whole on every GPU: DP attention)" if w.attn_tp == 1 and w.attn_dp > 1 else ""
    return {
        "routed experts": f"{plan.num_experts // w.moe_ep} of {plan.num_experts} experts x {plan.moe_layers} "
        f"MoE layers (ep {w.moe_ep}, expert tp {w.moe_tp})",
        "attention": f"over attention tp {w.attn_tp}{replicated}"
        + ("; MLA down projections whole" if "MLA w_kc/w_vc copies" in plan.weights else ""),
        "dense + shared MLP": f"over tp {w.tp}",
        "embedding, lm_head": f"embedding over tp {w.embed_tp}, lm_head over tp {w.head_tp} (vocab padded)",
        "norms, routers": "bf16 (an expert-score bias fp32), whole on every GPU",
        "MLA w_kc/w_vc copies": "bf16 copy of kv_b_proj for the absorbed MLA decode",
    }


def _render_lines(plan: EnginePlan) -> list[str]:
    w = plan.widths
    notes = _notes(plan)
    q = "fp8 (e4m3 + fp32 128x128 block scales), the rest bf16" if plan.quantization == "fp8" else "bf16"
    dp = f", DP attention {w.attn_dp}" if w.attn_dp > 1 else ""
    lines = [
        f"engine: {plan.model}, {w.tp} GPUs (tp {w.tp}, ep {w.moe_ep}{dp}), weights {q}",
        "",
        f"{'engine term, per GPU':<28}{'GiB':>9}  from",
        f"{'-' * 28}{'-' * 9}  {'-' * 44}",
    ]
    for name, value in plan.weights.items():
        lines.append(f"{name:<28}{_gib(value):>9}  {notes[name]}")
    kib = plan.kv_per_token / 1024
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines += [
        f"{'-' * 28}{'-' * 9}",
        f"{'weights':<28}{_gib(plan.weight_bytes):>9}",
        f"{'KV, one sequence':<28}{_gib(plan.sequence_kv):>9}  {plan.sequence_tokens} tokens x {kib:.1f} KiB "
        f"({plan.sequence_setting})",
        f"{'static pool':<28}{_gib(plan.static_pool):>9}  mem_fraction_static {plan.mem_fraction_static:g} x "
        f"{_gib(plan.gpu_memory)} GiB: KV room {_gib(plan.kv_room)} GiB = "
        f"{max(plan.kv_room, 0) // max(plan.kv_per_token, 1)} tokens",
        f"{'CUDA graphs + activations':<28}{_gib(plan.reserve):>9}  SGLang's reserve "
        f"({plan.reserve_detail}); outside the pool: {_gib(plan.headroom)} GiB",
        f"{'total needed':<28}{_gib(plan.needed):>9}  of {_gib(plan.gpu_memory)} GiB per GPU: {verdict}",
    ]
    return lines
