"""Checks that span sections. They only check; derived values come from `finalize` helpers
(`resolve_device`, `train_world_size`, `ParallelLayout.resolve`), never from mutating the config."""

from __future__ import annotations

from pathlib import Path

from slimrl.config.schema import SlimConfig
from slimrl.errors import ConfigError

CHOICES: dict[str, tuple[object, ...]] = {
    "cluster.device": ("auto", "cuda", "cpu"),
    "model.dtype": ("auto", "bf16", "fp32"),
    "parallel.fp8": (None, "delayed", "tensorwise", "blockwise", "mxfp8"),
    "parallel.moe_token_dispatcher": ("alltoall", "allgather", "flex"),
    "parallel.recompute": (None, "selective", "full"),
    "rollout.engine": ("embedded", "sglang"),
    "rollout.reward_type": ("toy", "math", "remote", "none"),
    "rollout.weight_sync": ("auto", "tensor", "distributed", "disk"),
    "rollout.router.policy": ("round_robin", "cache_aware", "power_of_two", "random"),
    "algorithm.loss": ("policy", "sft"),
    "algorithm.advantage_estimator": (
        "grpo",
        "gspo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "ppo",
    ),
    "algorithm.loss_reduction": ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"),
    "algorithm.grpo_std": ("unbiased", "population"),
    "algorithm.kl_estimator": ("k1", "k2", "k3", "low_var_kl"),
    "algorithm.tis_level": ("token", "sequence"),
    "algorithm.mis_level": ("token", "sequence", "geometric"),
    "train.optimizer.name": ("adam", "sgd"),
    "train.lr_schedule.decay_style": ("constant", "linear", "cosine"),
    "logging.level": ("DEBUG", "INFO", "WARNING", "ERROR"),
}

POSITIVE: tuple[str, ...] = (
    "cluster.num_nodes",
    "rollout.num_engines",
    "rollout.gpus_per_engine",
    "rollout.rollout_batch_size",
    "rollout.n_samples_per_prompt",
    "rollout.max_concurrency",
    "rollout.sampling.max_new_tokens",
    "rollout.update_weight_buffer_bytes",
    "train.num_steps",
    "train.micro_batch_size",
    "train.steps_per_rollout",
    "train.max_seq_len",
    "train.logprob_chunk_tokens",
    "checkpoint.keep_last",
)


def _get(config: SlimConfig, dotted: str) -> object:
    value: object = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def resolve_device(config: SlimConfig) -> str:
    if config.cluster.device != "auto":
        return config.cluster.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def train_world_size(config: SlimConfig) -> int:
    """Training ranks: every device when colocated, else all but the rollout devices."""
    total = config.cluster.num_nodes * config.cluster.gpus_per_node
    return total if config.cluster.colocate else total - config.cluster.rollout_gpus


def engine_first_slot(config: SlimConfig) -> int:
    """Slot (in (node, device) order) of engine 0: the engines share the trainer's slots when
    colocated, else they take the ones after the training ranks."""
    return 0 if config.cluster.colocate else train_world_size(config)


def default_base_gpu_id(config: SlimConfig, index: int) -> int:
    """Engine `index`'s first GPU on a node laid out as the config says (devices 0..G-1)."""
    slot = engine_first_slot(config) + index * config.rollout.gpus_per_engine
    return slot % max(config.cluster.gpus_per_node, 1)


def weight_transport(config: SlimConfig) -> str:
    """The transport `rollout.weight_sync` resolves to; the loop and `--dry-run` both ask here.

    `auto` never picks one the layout cannot run: `tensor` passes references (shared memory on
    CPU, CUDA IPC on GPUs) that only mean something on the sender's host, so it needs everything
    on one node and colocated; `distributed` works everywhere (gloo on CPU, NCCL on GPUs); `disk`
    needs a directory every node shares, which cannot be checked from here, so it is never chosen.
    """
    choice = config.rollout.weight_sync
    if choice != "auto":
        return choice
    return "tensor" if config.cluster.colocate and config.cluster.num_nodes == 1 else "distributed"


def check_config(config: SlimConfig) -> None:
    for key, valid in CHOICES.items():
        value = _get(config, key)
        if value not in valid:
            shown = ", ".join("null" if v is None else str(v) for v in valid)
            raise ConfigError(f"{key}={value}: not one of {shown}")
    for key in POSITIVE:
        value = _get(config, key)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value}: must be a positive integer")
    for key in ("checkpoint.save_interval", "eval.interval"):
        value = _get(config, key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{key}={value}: must be a positive number of steps, or null for never")
    _check_paths(config)
    if config.rollout.engine == "sglang":
        from slimrl.compat.sglang_cpu import check_sglang_version

        check_sglang_version()  # the pinned release, before anything starts
    _check_cluster(config)
    _check_engine_nodes(config)
    _check_weight_sync(config)
    _check_fp8_rollout(config)
    _check_parallel(config)
    _check_algorithm(config)
    _check_critic(config)


def _check_paths(config: SlimConfig) -> None:
    hf = Path(config.model.hf_checkpoint)
    if not hf.is_dir():
        raise ConfigError(f"model.hf_checkpoint={hf}: directory not found (make one with `slimrl make-tiny`)")
    for key in ("data.prompt_data", "model.load", "model.ref_load"):
        value = _get(config, key)
        if value is not None and not Path(str(value)).exists():
            raise ConfigError(f"{key}={value}: file not found")
    for name, path in config.eval.datasets.items():
        if not Path(path).exists():
            raise ConfigError(f"eval.datasets.{name}={path}: file not found")


def _check_cluster(config: SlimConfig) -> None:
    cluster = config.cluster
    if cluster.gpus_per_node < 1:
        raise ConfigError(
            f"cluster.gpus_per_node={cluster.gpus_per_node}: must be >= 1 (on CPU: process slots)"
        )
    total = cluster.num_nodes * cluster.gpus_per_node
    if not cluster.colocate and not 0 < cluster.rollout_gpus < total:
        raise ConfigError(
            f"cluster.rollout_gpus={cluster.rollout_gpus}: with colocate=false it must leave devices for "
            f"both sides (1..{total - 1})"
        )
    rollout_devices = total if cluster.colocate else cluster.rollout_gpus
    needed = config.rollout.num_engines * config.rollout.gpus_per_engine
    if needed > rollout_devices:
        raise ConfigError(
            f"rollout.num_engines={config.rollout.num_engines}: {needed} devices for engines "
            f"(num_engines * gpus_per_engine) but only {rollout_devices} are available to rollout"
        )


def _check_engine_nodes(config: SlimConfig) -> None:
    """An engine's devices must be on one node: SGLang addresses them as base id + TP rank."""
    per_node, per_engine = config.cluster.gpus_per_node, config.rollout.gpus_per_engine
    first = engine_first_slot(config)
    for index in range(config.rollout.num_engines):
        start = first + index * per_engine
        if start // per_node != (start + per_engine - 1) // per_node:
            raise ConfigError(
                f"rollout.gpus_per_engine={per_engine}: engine {index} would take devices "
                f"{start}..{start + per_engine - 1}, across two nodes of cluster.gpus_per_node={per_node} "
                "(engines must fit within one node: choose gpus_per_engine and cluster.rollout_gpus so "
                "they start at a node boundary)"
            )


def _check_fp8_rollout(config: SlimConfig) -> None:
    """FP8 serving needs SGLang on GPUs: a CPU SGLang server refuses FP8 for float32 and needs AMX
    kernels for bf16, and the embedded engine cannot load e4m3 weights with their scales."""
    if config.rollout.sglang.quantization != "fp8":
        return
    if config.rollout.engine != "sglang" or resolve_device(config) != "cuda":
        raise ConfigError(
            f"rollout.sglang.quantization=fp8: needs rollout.engine=sglang on GPUs (got engine "
            f"{config.rollout.engine} on {resolve_device(config)}); set it to null on CPU"
        )


def _check_weight_sync(config: SlimConfig) -> None:
    """`tensor` sends host-local references; with several nodes some engine cannot open them."""
    nodes = config.cluster.num_nodes
    if config.rollout.weight_sync == "tensor" and nodes > 1:
        raise ConfigError(
            f"rollout.weight_sync=tensor: needs the trainer and every engine on one host, but "
            f"cluster.num_nodes={nodes}; use auto, distributed or disk (disk: runs_dir shared by all nodes)"
        )


def _check_parallel(config: SlimConfig) -> None:
    from slimrl.megatron_bridge.model_arch import read_model_arch
    from slimrl.trainer.parallel import ParallelLayout

    device = resolve_device(config)
    if device == "cpu":
        if config.parallel.cp > 1:
            raise ConfigError(
                f"parallel.cp={config.parallel.cp}: context parallelism needs Transformer Engine attention "
                f"(GPU only); use cp=1 on CPU"
            )
        if config.parallel.fp8 is not None:
            raise ConfigError(
                f"parallel.fp8={config.parallel.fp8}: FP8 needs Transformer Engine on a GPU; unset it on CPU"
            )
        if config.parallel.moe_token_dispatcher == "flex":
            raise ConfigError("parallel.moe_token_dispatcher=flex: DeepEP needs GPUs; use alltoall on CPU")
    arch = read_model_arch(config.model.hf_checkpoint, config.model.overrides)
    layout = ParallelLayout.resolve(config.parallel, train_world_size(config), arch)
    rollout = config.rollout
    samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    if config.algorithm.loss == "policy" and samples % layout.dp:
        raise ConfigError(
            f"rollout.rollout_batch_size={rollout.rollout_batch_size}: rollout_batch_size * "
            f"n_samples_per_prompt = {samples} samples must split evenly over {layout.dp} data-parallel ranks"
        )


def _check_algorithm(config: SlimConfig) -> None:
    algo = config.algorithm
    if algo.eps_clip <= 0:
        raise ConfigError(f"algorithm.eps_clip={algo.eps_clip}: must be > 0")
    if algo.dual_clip_c is not None and algo.dual_clip_c <= 1:
        raise ConfigError(f"algorithm.dual_clip_c={algo.dual_clip_c}: must be > 1")
    if algo.async_staleness > 0 and config.cluster.colocate:
        raise ConfigError(
            "algorithm.async_staleness>0: overlapping rollout and training needs separate devices "
            "(cluster.colocate=false)"
        )
    if algo.loss == "policy":
        _check_estimator(config)


_GROUP_ESTIMATORS = ("grpo", "gspo", "rloo", "reinforce_plus_plus_baseline")
_TOKEN_LEVEL = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")


def _check_estimator(config: SlimConfig) -> None:
    """Estimator/loss combinations that have no definition are refused here, in one line naming the
    keys and what would be valid, instead of silently ignoring a setting."""
    algo, rollout = config.algorithm, config.rollout
    estimator = algo.advantage_estimator
    if estimator in _GROUP_ESTIMATORS and rollout.n_samples_per_prompt < 2:
        raise ConfigError(
            f"rollout.n_samples_per_prompt={rollout.n_samples_per_prompt}: "
            f"{estimator} needs groups of at least 2 samples"
        )
    if estimator == "gspo" and algo.loss_reduction != "seq_mean_token_mean":
        raise ConfigError(
            f"algorithm.loss_reduction={algo.loss_reduction}: advantage_estimator=gspo is the mean over "
            "sequences of the sequence-level objective; set algorithm.loss_reduction=seq_mean_token_mean"
        )
    if not algo.normalize_std and estimator not in ("grpo", "gspo"):
        raise ConfigError(
            f"algorithm.normalize_std=false: only grpo/gspo divide by the group std (Dr.GRPO drops it); "
            f"advantage_estimator={estimator} has none, remove the setting"
        )
    if estimator not in _TOKEN_LEVEL:
        token_level = ", ".join(_TOKEN_LEVEL)
        if algo.kl_coef != 0:
            raise ConfigError(
                f"algorithm.kl_coef={algo.kl_coef}: the KL reward penalty needs a token-level estimator "
                f"({token_level}); with advantage_estimator={estimator} use algorithm.kl_loss_coef"
            )
        if algo.gamma != 1.0:
            raise ConfigError(
                f"algorithm.gamma={algo.gamma}: discounts token-level returns ({token_level}); "
                f"advantage_estimator={estimator} has none, leave gamma at 1.0"
            )
    if algo.lambd != 1.0 and estimator != "ppo":
        raise ConfigError(
            f"algorithm.lambd={algo.lambd}: the GAE lambda applies to advantage_estimator=ppo only "
            f"(got {estimator}); leave lambd at 1.0"
        )
    if algo.loss_norm_tokens is not None and algo.loss_norm_tokens < 1:
        raise ConfigError(
            f"algorithm.loss_norm_tokens={algo.loss_norm_tokens}: must be a positive number of tokens, "
            "or null for rollout.sampling.max_new_tokens"
        )
    if not 0 <= algo.tis_clip_low <= algo.tis_clip_high:
        raise ConfigError(
            f"algorithm.tis_clip_low={algo.tis_clip_low}: must satisfy 0 <= tis_clip_low <= tis_clip_high "
            f"(tis_clip_high={algo.tis_clip_high})"
        )
    if not 0 <= algo.mis_low < algo.mis_high:
        raise ConfigError(
            f"algorithm.mis_low={algo.mis_low}: must satisfy 0 <= mis_low < mis_high "
            f"(mis_high={algo.mis_high})"
        )
    if algo.use_rollout_logprobs and (algo.tis or algo.mis):
        which = "algorithm.tis=true" if algo.tis else "algorithm.mis=true"
        raise ConfigError(
            f"{which}: corrects the trainer's old logprobs against the rollout's, which "
            "algorithm.use_rollout_logprobs=true makes identical (every ratio 1); unset one of them"
        )
    max_new = rollout.sampling.max_new_tokens
    if algo.overlong_buffer_len is not None and not 0 < algo.overlong_buffer_len <= max_new:
        raise ConfigError(
            f"algorithm.overlong_buffer_len={algo.overlong_buffer_len}: the soft overlong buffer must be "
            f"1..{max_new} tokens (rollout.sampling.max_new_tokens), or null to disable it"
        )
    if algo.overlong_penalty_factor < 0:
        raise ConfigError(f"algorithm.overlong_penalty_factor={algo.overlong_penalty_factor}: must be >= 0")
    threshold = rollout.dynamic_sampling_std_threshold
    if threshold < 0:
        raise ConfigError(f"rollout.dynamic_sampling_std_threshold={threshold}: must be >= 0")
    if threshold > 0 and rollout.dynamic_sampling_filter_path is None:
        raise ConfigError(
            f"rollout.dynamic_sampling_std_threshold={threshold}: read by the dynamic-sampling filter; set "
            "rollout.dynamic_sampling_filter_path=slimrl.rollout.filters.nonzero_reward_std"
        )


def _check_critic(config: SlimConfig) -> None:
    """PPO needs a value model and only PPO has one: `critic.*` is refused without it."""
    critic = config.critic
    ppo = config.algorithm.loss == "policy" and config.algorithm.advantage_estimator == "ppo"
    if not ppo:
        from slimrl.config.schema import CriticConfig

        default = CriticConfig()
        changed = [f"critic.{k}" for k in CriticConfig.__slots__ if getattr(critic, k) != getattr(default, k)]
        if changed:
            raise ConfigError(
                f"{', '.join(changed)}: a critic is trained only with algorithm.advantage_estimator=ppo "
                f"(got {config.algorithm.advantage_estimator} with loss {config.algorithm.loss}); "
                f"remove the critic settings or use ppo"
            )
        return
    if critic.lr is None or critic.lr <= 0:
        raise ConfigError(
            f"critic.lr={'null' if critic.lr is None else critic.lr}: algorithm.advantage_estimator=ppo "
            f"trains a value model and needs its learning rate (e.g. critic.lr=1e-5, > 0)"
        )
    if critic.value_clip <= 0:
        raise ConfigError(f"critic.value_clip={critic.value_clip}: must be > 0")
    steps = config.train.num_steps
    if not 0 <= critic.warmup_steps < steps:
        raise ConfigError(
            f"critic.warmup_steps={critic.warmup_steps}: must be in 0..{steps - 1} "
            f"(train.num_steps={steps}: the policy must update at least once)"
        )
    if critic.load is not None and not Path(critic.load).exists():
        raise ConfigError(f"critic.load={critic.load}: file not found")
