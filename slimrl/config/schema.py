"""The typed configuration schema: one dataclass per section, each default in exactly one place.

YAML files under `configs/` and `key=value` overrides are merged onto these classes by
`slimrl.preflight.loader`; unknown keys and wrong types are rejected there. Every other check (the
range of each numeric field, choices, checks that span sections, hooks, data files) lives in
`slimrl.preflight.checks` and runs at load; `slimrl.preflight.finalize` derives the values the run uses.
Every field has a docstring and a reader (tests/test_config.py fails on one without either).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slimrl import estimators

# Sections are plain, kw-only, slotted dataclasses so OmegaConf can type-check them and a typo
# in a field name fails at class-definition time rather than at run time.
_section = dataclass(kw_only=True, slots=True)


@_section
class RunConfig:
    name: str = "run"
    """Run name; everything the run writes goes to `<runs_dir>/<name>/`."""
    runs_dir: str = "runs"
    """Parent directory of run directories."""
    seed: int = 1234
    """Seed for data order, initialisation and sampling."""


@_section
class RayConfig:
    address: str | None = None
    """Existing Ray cluster to join (`auto` or `host:port`); null starts a new local Ray of the run's
    own, even where RAY_ADDRESS or an earlier `ray start` on the machine names a cluster."""
    num_cpus: int | None = None
    """Logical CPUs for a local Ray (null: enough for every actor of the run)."""


@_section
class ClusterConfig:
    num_nodes: int = 1
    """Nodes in the job."""
    gpus_per_node: int = 8
    """Devices per node. On a CPU-only machine each device is one process slot."""
    colocate: bool = True
    """True: trainer and rollout engines share every device (offload switches on).
    False: `rollout_gpus` devices are set aside for the engines."""
    rollout_gpus: int = 0
    """Devices reserved for rollout engines when `colocate` is false."""
    device: str = "auto"
    """`auto` (cuda if visible, else cpu), `cuda` or `cpu`."""
    gpu_memory_gb: float = 80.0
    """Memory of one device in GiB: the budget `slimrl plan` checks a layout against before
    anything starts (an "80 GB" H100 reports 79.6 GiB; the planner's fixed allowance covers that)."""


@_section
class ModelConfig:
    hf_checkpoint: str = "???"
    """Hugging Face checkpoint directory: architecture, tokenizer and (unless `load` is set)
    initial weights."""
    load: str | None = None
    """Megatron distributed checkpoint to start from instead of the HF weights."""
    ref_load: str | None = None
    """Megatron checkpoint of the KL reference model (null: the initial policy); needs a KL term
    (`algorithm.kl_loss_coef` or `kl_coef` > 0)."""
    init_from_hf: bool = True
    """Load the HF weights at start; false keeps Megatron's random initialisation
    (useful for tiny tests)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """HF config.json keys to override before the Megatron model is built."""
    dtype: str = "auto"
    """Parameter dtype: `auto` (bf16 on GPU, fp32 on CPU), `bf16` or `fp32`."""
    trust_remote_code: bool = False
    """Let transformers and SGLang run Python code shipped in the checkpoint directory (its
    config.json or tokenizer_config.json `auto_map`, e.g. Moonlight's tiktoken tokenizer): passed to
    every `from_pretrained` slimrl calls and to SGLang as `--trust-remote-code`. A checkpoint whose
    tokenizer needs its own code is refused at load while this is false."""


@_section
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); null for none."""
    cp: int = 1
    """Context-parallel size (needs Transformer Engine attention, GPU only)."""
    ep: int = 1
    """Expert-parallel size."""
    etp: int | None = None
    """Expert tensor-parallel size (null: equal to tp, as in Megatron-LM)."""
    dp: int | None = None
    """Data-parallel size; null derives it as world / (tp*pp*cp)."""
    sequence_parallel: bool | None = None
    """Sequence parallelism; null turns it on whenever tp > 1."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks."""
    fp8: str | None = None
    """Transformer Engine FP8 recipe: `delayed`, `tensorwise`, `blockwise`, `mxfp8`; GPU only."""
    moe_token_dispatcher: str = "alltoall"
    """`alltoall` or `allgather` (`flex` with DeepEP on GPU)."""
    recompute: str | None = None
    """Activation recompute: null, `selective` or `full`."""
    pp_layout: list[int] | None = None
    """Layers per pipeline stage (uneven stages); null splits evenly."""


@_section
class SamplingConfig:
    temperature: float = 1.0
    """Softmax temperature (>= 0; 0 is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens holding this much probability, in (0, 1]."""
    top_k: int = -1
    """Sample from the k most likely tokens; -1 samples from the whole vocabulary."""
    max_new_tokens: int = 64
    """Longest response in tokens."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a response (non-empty)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response, besides EOS (within the model's vocabulary)."""


@_section
class SGLangConfig:
    mem_fraction_static: float = 0.8
    """Share of GPU memory SGLang reserves for weights and KV cache."""
    attention_backend: str | None = None
    """SGLang attention backend (null: SGLang's default; true_on_policy picks one)."""
    dp_attention: bool = False
    """Data-parallel attention inside each engine (DeepSeek-style MoE serving)."""
    ep_size: int = 1
    """Expert parallelism inside each engine."""
    quantization: str | None = None
    """`fp8` serves FP8 weights (block-quantised at weight sync)."""
    extra_args: dict[str, Any] = field(default_factory=dict)
    """Passed through to `sglang.launch_server` as `--key value` (e.g. speculative decoding)."""
    server_timeout_s: float = 600.0
    """How long a server may take to become healthy."""
    weights_cpu_backup: bool = False
    """Keep a host copy of the weights across a memory release (`--enable-weights-cpu-backup`); off:
    released weights are lost and must be pushed again after the resume."""


@_section
class RouterConfig:
    enabled: bool = True
    """Put the engines behind sglang-router; false routes from the client."""
    policy: str = "round_robin"
    """sglang-router policy: `round_robin`, `cache_aware`, `power_of_two`, `random`."""


@_section
class RolloutConfig:
    engine: str = "embedded"
    """`embedded` (in-repo CPU engine) or `sglang` (real SGLang servers, GPU)."""
    num_engines: int = 1
    """Inference servers in the fleet."""
    gpus_per_engine: int = 1
    """Devices per server (its TP size)."""
    rollout_batch_size: int = 8
    """Prompts per rollout step."""
    n_samples_per_prompt: int = 4
    """Responses per prompt (the GRPO group size)."""
    over_sampling_batch_size: int | None = None
    """Prompts drawn per refill with dynamic sampling (null: rollout_batch_size)."""
    max_concurrency: int = 64
    """In-flight generate requests across the fleet (a batched group counts each of its samples)."""
    group_requests: bool = True
    """The built-in generate sends a group's fresh samples as one batched `/generate` (SGLang's list
    form: the prompt, rid and sampling seed of each sample) to one engine, instead of one request
    per sample: a third of the engine's and the client's CPU per sample on the embedded engine,
    ~40% on real SGLang (bench/bench_group_requests.py). sglang-router refuses per-item sampling
    parameters, so these batches are routed by the client (least samples in flight). Custom
    generate functions, agents and continued partial samples send one request per sample.
    false: one request per sample, through the router."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters for training rollouts."""
    partial_rollout: bool = False
    """Keep aborted unfinished groups (with their partial tokens) for the next rollout."""
    request_timeout_s: float = 300.0
    """A request running longer becomes an aborted sample."""
    reward_type: str = "toy"
    """Built-in reward: `toy` (exact answer), `math` (boxed / final number)."""
    custom_generate_function_path: str | None = None
    """`module.func`: async generate(ctx, sample, sampling_params) -> Sample | list[Sample]."""
    rollout_function_path: str | None = None
    """`module.func` replacing the whole rollout loop."""
    custom_rm_path: str | None = None
    """`module.func`: async reward of one sample (or a group with `group_rm`)."""
    group_rm: bool = False
    """Call `custom_rm_path` once per group instead of per sample."""
    remote_rm_url: str | None = None
    """HTTP reward model endpoint (used when reward_type is `remote`)."""
    dynamic_sampling_filter_path: str | None = None
    """`module.func(config, group) -> bool` keeping a finished group."""
    dynamic_sampling_std_threshold: float = 0.0
    """For the built-in `slimrl.rollout.filters.nonzero_reward_std` (DAPO dynamic sampling): keep a
    group only if the population std of its rewards exceeds this (0: any two different rewards)."""
    buffer_filter_path: str | None = None
    """`module.func(config, buffer, n) -> list of groups` drawn from the partial-rollout buffer."""
    agent_function_path: str | None = None
    """`module.func`: `async def run_agent(base_url, api_key, task) -> float | dict`, an agent written
    against the OpenAI API, run `n_samples_per_prompt` times per prompt against an OpenAI-compatible
    endpoint of slimrl's (one session per run); its return value is the reward, and every completion
    it asked for becomes training tokens exactly as sampled (docs/agentic.md)."""
    agent_timeout_s: float = 600.0
    """An agent run longer than this becomes a failed sample (its session closes)."""
    agent_endpoint_host: str = "loopback"
    """Where the agent endpoint listens: `loopback` (127.0.0.1: agents in the rollout's process or
    on its node) or `node` (the node's cluster address as Ray sees it, loopback not included: an
    agent that hands `base_url` and the per-run key to a sandbox or service on another host)."""
    agent_tool_call_parser: str = "qwen25"
    """SGLang's tool-call parser for the model's output format (its `--tool-call-parser` names:
    `qwen25`, `hermes`, `llama3`, `deepseekv3`, `kimi_k2`, ...): turns `<tool_call>` text into OpenAI
    `tool_calls`. The tiny models of `slimrl make-tiny` use `qwen25`'s format."""
    update_weight_buffer_bytes: int = 512 * 1024**2
    """Bucket size of the streaming weight sync."""
    weight_sync: str = "auto"
    """`auto` (tensor when colocated, distributed otherwise), `tensor`, `distributed` or `disk`."""
    weight_sync_timeout_s: float = 1800.0
    """Longest a weight sync may take; past it the run stops in one line naming what every
    trainer rank waits in (a hung collective), resumable from the last checkpoint."""
    verify_updates: bool = True
    """After every weight sync, check each engine with SGLang's weight checker: it reports the
    pushed version, engines serving the same shards hold equal tensors (per-tensor checksums), and
    the update changed their weights. A failed check pushes once more, then stops the run in one
    line naming the engine and tensor (resumable: the step's checkpoint is saved before the sync)."""
    verify_logprob_tolerance: float | None = None
    """The update check's probe: a fixed 16-token sequence scored by every engine and by the trainer
    after each update; their mean absolute logprob difference must stay within this. Null: ten
    times what the first checked update measured (at least 1e-4), i.e. the engine's numerics
    against the trainer's (bf16 against fp32 near 1e-2, fp32 on both sides near 1e-7); corrupted
    weights move it by far more (one router's weights flipped in 64 places: 2e-3 against 3e-8)."""
    verify_first_update: bool = True
    """When the run starts from the engines' own HF weights: each engine snapshots and resets them
    to random values at start, and after the first push every tensor of every TP rank must equal
    the snapshot (within FP8's block error). Costs one host-memory copy of each engine's weights
    until that push, and makes the run push at step 0."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang server options (GPU fleet)."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """Router in front of the fleet."""
    api_key: str | None = None
    """Key for every endpoint of the engines, /generate included (SGLang `--api-key`); null leaves
    generation open to whoever reaches an engine (the control endpoints stay guarded)."""
    admin_api_key: str | None = None
    """Key for the engines' control endpoints: weight updates, memory, pause, abort, flush (SGLang
    `--admin-api-key`). Null: every `slimrl train` / `slimrl rollout` draws a fresh one, so no
    engine a run starts has them open on the network."""
    save_samples: bool = True
    """Append each rollout's samples to `rollout_samples.jsonl` in the run directory, one JSON object
    per sample (`slimrl train`: training rollouts; `slimrl rollout`: evals too), and the groups a
    rollout set aside unfinished (`split` `train/unfinished`). A resumed run drops the rollouts
    after its checkpoint, which it redoes."""


@_section
class DataConfig:
    prompt_data: str | None = None
    """Training prompts: a JSONL or Parquet file."""
    input_key: str = "prompt"
    """Field holding the prompt."""
    label_key: str = "label"
    """Field holding the reference answer."""
    metadata_key: str = "metadata"
    """Optional field copied into `Sample.metadata`."""
    tools_key: str = "tools"
    """Optional field holding OpenAI function tools, which the chat template renders with a row's
    messages (an SFT conversation with tool calls; docs/agentic.md)."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch (seeded)."""
    max_prompt_tokens: int | None = None
    """Drop prompts longer than this many tokens (as rendered, chat template included) when a data
    set is loaded, training and eval alike; the count dropped is logged (null: keep all)."""


@_section
class AlgorithmConfig:
    loss: str = "policy"
    """`policy` (RL policy-gradient loss) or `sft` (cross-entropy on loss-masked tokens)."""
    advantage_estimator: str = "grpo"
    """`grpo`, `gspo`, `rloo`, `reinforce_plus_plus`, `reinforce_plus_plus_baseline`, `ppo`
    (papers and what each test pins: docs/trainer.md)."""
    normalize_std: bool = True
    """Divide GRPO/GSPO advantages by the group std. False is Dr.GRPO's advantage (pair it with
    `loss_reduction: seq_mean_token_sum_norm` for Dr.GRPO's loss)."""
    grpo_std: str = "unbiased"
    """Group std of GRPO/GSPO: `unbiased` (divides by n-1) or `population` (by n). Unbiased is the
    default because the GRPO implementations hyperparameters are usually ported from (TRL, verl,
    OpenRLHF, slime) all use it; population gives advantages larger by sqrt(n/(n-1))."""
    policy_loss: str = "ppo_clip"
    """The per-token surrogate: `ppo_clip` (PPO's clipped ratio; sequence-level for gspo) or `cispo`
    (MiniMax-M1's clipped, detached importance weight times A log pi: clipped tokens keep their
    gradient); `slimrl/policy_losses.py` names them, docs/trainer.md gives the formulas."""
    eps_clip: float = 0.2
    """Lower clip range (of the ratio for `ppo_clip`, of the importance weight for `cispo`)."""
    eps_clip_high: float | None = None
    """Upper clip range (DAPO clip-higher); null uses eps_clip."""
    dual_clip_c: float | None = None
    """Dual-clip constant (> 1) for negative advantages (`ppo_clip` only); null disables."""
    loss_reduction: str = "token_mean"
    """How per-token losses (policy, KL loss, entropy) become the step loss: `token_mean` over all loss
    tokens of the step (DAPO's token-level loss), `seq_mean_token_mean` (mean over sequences of each
    sequence's token mean; required by gspo) or `seq_mean_token_sum_norm` (Dr.GRPO: each sequence's
    token sum divided by the constant `loss_norm_tokens`, averaged over sequences)."""
    loss_norm_tokens: int | None = None
    """The constant of `seq_mean_token_sum_norm` (null: `rollout.sampling.max_new_tokens`, the
    maximum response length, as in Dr.GRPO)."""
    kl_coef: float = 0.0
    """Reward-side KL penalty coefficient."""
    kl_loss_coef: float = 0.0
    """KL-loss coefficient (added to the loss)."""
    kl_estimator: str = "low_var_kl"
    """`k1`, `k2`, `k3` or `low_var_kl`."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    gamma: float = 1.0
    """Discount for PPO/GAE and REINFORCE++."""
    lambd: float = 1.0
    """GAE lambda."""
    tis: bool = False
    """Truncated importance sampling on the train/rollout mismatch."""
    tis_clip_low: float = 0.0
    """Truncated IS: weights below this are raised to it."""
    tis_clip_high: float = 2.0
    """Truncated IS: weights above this are cut to it (>= tis_clip_low)."""
    tis_level: str = "token"
    """`token` (each token's ratio) or `sequence` (every token weighted by the product of its
    sequence's token ratios) for truncated IS."""
    mis: bool = False
    """Masked importance sampling (rejection): drop tokens whose ratio leaves [mis_low, mis_high]."""
    mis_low: float = 0.5
    """Masked IS: tokens (or sequences) with a ratio below this are dropped."""
    mis_high: float = 2.0
    """Masked IS: tokens (or sequences) with a ratio above this are dropped (> mis_low)."""
    mis_level: str = "token"
    """`token`, `sequence` (the product of the sequence's token ratios decides for the whole sequence)
    or `geometric` (Geo-RS: their geometric mean decides) for masked IS."""
    overlong_buffer_len: int | None = None
    """DAPO soft overlong punishment: L_cache, the last tokens before `rollout.sampling.max_new_tokens`
    (L_max) over which a linear penalty from 0 to -1 is added to the reward (-1 beyond L_max);
    null disables."""
    overlong_penalty_factor: float = 1.0
    """Scale of the overlong penalty (1 in the DAPO paper)."""
    overlong_filtering: bool = False
    """DAPO overlong filtering: truncated samples (hit the length limit) get loss mask 0, i.e. are
    not trained on; their rewards still count in their group's statistics."""
    use_rollout_logprobs: bool = False
    """Use rollout logprobs as old logprobs instead of recomputing them."""
    true_on_policy: bool = False
    """Make trainer and engine compute identical logprobs (see docs/true_on_policy.md)."""
    routing_replay: bool = False
    """MoE routing replay (R3): the engines return the experts they routed every token to
    (`Sample.rollout_routed_experts`) and every trainer forward of the policy uses exactly those, so a
    tiny numeric difference cannot flip a token's experts between rollout and training (see
    docs/true_on_policy.md; storage and bytes: docs/rollout.md). MoE models and RL only."""
    routing_replay_counterfactual: bool = False
    """Diagnosis for `routing_replay`: every step also scores the batch once more with the routers
    choosing for themselves (one extra forward-only pass) and reports the train/rollout mismatch
    had the trainer not replayed, as `train/train_rollout_logprob_abs_diff_no_replay` (and the
    other mismatch metrics with `_no_replay`). Needs `routing_replay: true`."""
    async_staleness: int = 0
    """0: synchronous. 1: rollout of step k+1 overlaps training on step k (disaggregated)."""


@_section
class OptimizerConfig:
    name: str = "adam"
    """`adam` (AdamW) or `sgd`."""
    lr: float = 1e-5
    """Peak learning rate (> 0)."""
    min_lr: float = 0.0
    """Floor of a decaying schedule (0 <= min_lr <= lr)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay, in [0, 1)."""
    adam_beta2: float = 0.98
    """Adam's second-moment decay, in [0, 1)."""
    adam_eps: float = 1e-8
    """Adam's denominator epsilon (> 0)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    cpu_offload: bool = False
    """Keep optimizer state and step on CPU (Megatron hybrid-device optimizer, GPU only)."""


@_section
class LRScheduleConfig:
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to `lr`."""
    decay_style: str = "constant"
    """`constant`, `linear` or `cosine`."""
    decay_steps: int | None = None
    """Steps over which to decay (null: the run's total optimizer steps)."""


@_section
class TrainConfig:
    num_steps: int = 100
    """Rollout steps for RL, optimizer steps for SFT."""
    global_batch_size: int | None = None
    """Samples per optimizer step. SFT: null means 32; it must split evenly over the data-parallel
    ranks. RL: derived, rollout_batch_size * n_samples_per_prompt / steps_per_rollout; set it only to
    that value (a check), or leave it null."""
    micro_batch_size: int = 1
    """Samples per micro-batch when `max_tokens_per_gpu` is null."""
    max_tokens_per_gpu: int | None = None
    """Token budget per micro-batch per rank (dynamic batching, >= 1); null uses micro_batch_size.
    A single sequence longer than the budget stops the run, naming the length it needs."""
    steps_per_rollout: int = 1
    """Optimizer steps per rollout batch."""
    max_seq_len: int = 2048
    """Longest prompt+response the trainer accepts."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The policy's optimizer."""
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """The learning-rate schedule, in optimizer steps."""
    offload: bool | None = None
    """Move params/grads/optimizer state to CPU during rollout (null: on when colocated on GPU)."""
    frozen_params: list[str] = field(default_factory=list)
    """Glob patterns of Megatron parameter names that are not trained."""
    logprob_chunk_tokens: int = 4096
    """Tokens per chunk of the vocabulary-parallel log-softmax (bounds logits memory)."""
    oom_max_splits: int = 3
    """Times an out-of-memory step is retried with micro-batches half as big before it fails."""
    step_timeout_s: float = 7200.0
    """Longest one call on the trainer ranks may take (a training step, a checkpoint save); past
    it the run stops in one line naming the ranks still working, with every process's Python
    stacks under `<run dir>/hang/<time>/`, resumable from the last checkpoint."""
    max_nonfinite_steps: int = 3
    """An optimizer step whose gradients are not finite (NaN or inf on any rank) is skipped
    (`train/skipped_steps`); this many in a row stop the run in one line naming the first parameter
    whose gradient was not finite."""
    inject_oom_above_tokens: int | None = None
    """Testing only: raise an out-of-memory error for micro-batches above this many tokens."""


@_section
class CriticConfig:
    """The PPO value model: a second Megatron model with a scalar head, trained beside the policy on
    the same ranks and layout. Used only with `algorithm.advantage_estimator: ppo`, which needs `lr`."""

    lr: float | None = None
    """Learning rate of the critic's own optimizer; required with ppo, null otherwise. The other
    optimizer settings (Adam betas, weight decay, gradient clip) and the shape of the LR schedule are
    those of `train.optimizer` and `train.lr_schedule`."""
    min_lr: float = 0.0
    """Floor of the critic's learning rate under a decaying `train.lr_schedule`."""
    warmup_steps: int = 0
    """Rollout steps at the start in which only the critic trains; the policy updates after them."""
    value_clip: float = 0.2
    """Clip range of the value loss around the values the rollout was scored with."""
    load: str | None = None
    """Megatron checkpoint of a value model to start from (a run's `checkpoints/iter_N/critic`); null:
    the policy's initial weights with a fresh value head (zeros, so the first values are 0)."""


@_section
class CheckpointConfig:
    save_dir: str | None = None
    """Megatron checkpoint directory (null: `<run dir>/checkpoints`)."""
    save_interval: int | None = None
    """Save every N steps (null: only at the end)."""
    resume: bool = True
    """Resume from the latest checkpoint in save_dir when there is one."""
    keep_last: int = 2
    """Checkpoints to keep (>= 1): the most recently completed ones this directory's runs wrote."""
    overwrite: bool = False
    """With resume=false, replace an earlier run's checkpoints in the directory (removed once this
    run's first checkpoint is complete); without it such a start is refused."""
    save_hf: bool = False
    """Also write the policy as a Hugging Face checkpoint into each checkpoint's `hf/` directory
    (safetensors + index, config.json, tokenizer): loadable by transformers or SGLang as is."""


@_section
class LoggingConfig:
    tensorboard: bool = True
    """Write TensorBoard event files to the run directory."""
    log_interval: int = 1
    """Print a progress line every N steps (rollouts under `slimrl rollout`), and after the last;
    metrics.jsonl and TensorBoard still get every step."""
    level: str = "INFO"
    """Log level: `DEBUG`, `INFO`, `WARNING` or `ERROR`."""


@_section
class EvalConfig:
    interval: int | None = None
    """Evaluate every N rollout steps (null: never)."""
    datasets: dict[str, str] = field(default_factory=dict)
    """Name -> JSONL/Parquet prompt file."""
    n_samples_per_prompt: int = 1
    """Responses per eval prompt."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))
    """Sampling parameters for evals (greedy by default)."""


@_section
class SlimConfig:
    """The whole run: what `slimrl train CONFIG.yaml key=value ...` resolves to."""

    run: RunConfig = field(default_factory=RunConfig)
    """Name, output directory and seed."""
    ray: RayConfig = field(default_factory=RayConfig)
    """The Ray cluster the run uses."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Nodes, devices and how training and rollout share them."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy: HF checkpoint, starting weights, reference, dtype."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron parallel layout of the trainer."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prompt data set and how to read it."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Inference fleet, sampling, rewards and hooks."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Loss, advantage estimator and their corrections."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batching, optimizer and schedule."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The PPO value model."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Where and when checkpoints are written, and resume."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Progress lines, log level, TensorBoard."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation during RL."""

    # Derived from the config alone, so every floor may ask (the gate's derivations that need the
    # machine or the model, such as the device and the weight transport, are `finalize`'s).
    def train_world_size(self) -> int:
        """Training ranks: every device when colocated, else all but the rollout devices."""
        total = self.cluster.num_nodes * self.cluster.gpus_per_node
        return total if self.cluster.colocate else total - self.cluster.rollout_gpus

    def has_critic(self) -> bool:
        """A value model trains beside the policy: a policy run whose estimator needs one (PPO)."""
        found = estimators.TRAITS.get(self.algorithm.advantage_estimator)  # type: ignore[call-overload]
        return self.algorithm.loss == "policy" and found is not None and found.critic

    def engine_first_slot(self) -> int:
        """Slot (in (node, device) order) of engine 0: the engines share the trainer's slots when
        colocated, else they take the ones after the training ranks."""
        return 0 if self.cluster.colocate else self.train_world_size()

    def base_gpu_id(self, index: int) -> int:
        """Engine `index`'s first GPU on a node laid out as the config says (devices 0..G-1)."""
        slot = self.engine_first_slot() + index * self.rollout.gpus_per_engine
        return slot % max(self.cluster.gpus_per_node, 1)
