"""Checks that span sections. They only check; derived values come from `finalize` helpers
(`resolve_device`, `SlimConfig.train_world_size`, `ParallelLayout.resolve`), never from mutating
the config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from slimrl import estimators, policy_losses
from slimrl.compat.sglang_cpu import check_sglang_version
from slimrl.config.schema import CriticConfig, SlimConfig
from slimrl.data.prompts import check_prompt_file
from slimrl.devices.device import resolve_device
from slimrl.devices.launch_plan import simulated_layout
from slimrl.devices.ledger import build_ledger
from slimrl.devices.rank_groups import Sizes
from slimrl.devices.rules import check_ledger
from slimrl.errors import ConfigError
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.parallel_layout import ParallelLayout
from slimrl.planning.engine_plan import check_config_engines
from slimrl.policy_losses import PolicyLoss
from slimrl.preflight.finalize import sft_batch_size, weight_transport
from slimrl.rollout.agent.chat import tool_call_parsers
from slimrl.rollout.hooks import check_hooks
from slimrl.rollout.sglang.server_args import validate_sglang_config
from slimrl.utils.cli_args import is_plain_name

if TYPE_CHECKING:
    from slimrl.model_arch import ModelArch

CHOICES: dict[str, tuple[object, ...]] = {
    "cluster.device": ("auto", "cuda", "cpu"),
    "model.dtype": ("auto", "bf16", "fp32"),
    "parallel.fp8": (None, "delayed", "tensorwise", "blockwise", "mxfp8"),
    "parallel.moe_token_dispatcher": ("alltoall", "allgather", "flex"),
    "parallel.recompute": (None, "selective", "full"),
    "rollout.engine": ("embedded", "sglang"),
    "rollout.reward_type": ("toy", "math", "remote", "none"),
    "rollout.weight_sync": ("auto", "tensor", "distributed", "disk"),
    "rollout.agent_endpoint_host": ("loopback", "node"),
    "rollout.router.policy": ("round_robin", "cache_aware", "power_of_two", "random"),
    "algorithm.loss": ("policy", "sft"),
    "algorithm.advantage_estimator": estimators.names(),
    "algorithm.policy_loss": policy_losses.names(),
    "algorithm.loss_reduction": ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"),
    "algorithm.grpo_std": ("unbiased", "population"),
    "algorithm.kl_estimator": ("k1", "k2", "k3", "low_var_kl"),
    "algorithm.tis_level": ("token", "sequence"),
    "algorithm.mis_level": ("token", "sequence", "geometric"),
    "train.optimizer.name": ("adam", "sgd"),
    "train.lr_schedule.decay_style": ("constant", "linear", "cosine"),
    "logging.level": ("DEBUG", "INFO", "WARNING", "ERROR"),
}


@dataclass(frozen=True, slots=True)
class Range:
    """The valid values of one numeric field: `low`/`high` bounds (None: unbounded), inclusive
    unless `*_open`; `also` admits one special value outside them (`top_k`'s -1); `why` replaces the
    generic "must be ..." when a field needs its own words. Null passes wherever the schema allows it
    (the loader refuses null for a non-optional field)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[float, str] | None = None
    why: str | None = None

    def admits(self, value: float) -> bool:
        if self.also is not None and value == self.also[0]:
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        low = None if self.low is None else _num(self.low)
        high = None if self.high is None else _num(self.high)
        if low is not None and high is not None:
            text = f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        elif low is not None:
            text = f"{'>' if self.low_open else '>='} {low}"
        else:
            text = f"{'<' if self.high_open else '<='} {high}"
        return f"{_num(self.also[0])} ({self.also[1]}) or {text}" if self.also else text


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


_AT_LEAST_1 = Range(low=1)
_AT_LEAST_0 = Range(low=0)
_ABOVE_0 = Range(low=0, low_open=True)
_FRACTION = Range(low=0, high=1)
_BETA = Range(low=0, high=1, high_open=True)
_SAMPLING: dict[str, Range] = {
    "temperature": _AT_LEAST_0,
    "top_p": Range(low=0, high=1, low_open=True),
    "top_k": Range(low=1, also=(-1, "the whole vocabulary")),
    "max_new_tokens": _AT_LEAST_1,
}

RANGES: dict[str, Range] = {
    "run.seed": Range(low=0, high=2**31 - 1),
    "ray.num_cpus": _AT_LEAST_1,
    "cluster.num_nodes": _AT_LEAST_1,
    "cluster.gpus_per_node": Range(low=1, why="must be >= 1 (on CPU: process slots)"),
    "cluster.rollout_gpus": _AT_LEAST_0,
    "cluster.gpu_memory_gb": _ABOVE_0,
    "parallel.tp": _AT_LEAST_1,
    "parallel.pp": _AT_LEAST_1,
    "parallel.vpp": _AT_LEAST_1,
    "parallel.cp": _AT_LEAST_1,
    "parallel.ep": _AT_LEAST_1,
    "parallel.etp": _AT_LEAST_1,
    "parallel.dp": _AT_LEAST_1,
    **{f"rollout.sampling.{key}": value for key, value in _SAMPLING.items()},
    **{f"eval.sampling.{key}": value for key, value in _SAMPLING.items()},
    "rollout.num_engines": _AT_LEAST_1,
    "rollout.gpus_per_engine": _AT_LEAST_1,
    "rollout.rollout_batch_size": _AT_LEAST_1,
    "rollout.n_samples_per_prompt": _AT_LEAST_1,
    "rollout.over_sampling_batch_size": _AT_LEAST_1,
    "rollout.max_concurrency": _AT_LEAST_1,
    "rollout.request_timeout_s": _ABOVE_0,
    "rollout.agent_timeout_s": _ABOVE_0,
    "rollout.dynamic_sampling_std_threshold": _AT_LEAST_0,
    "rollout.update_weight_buffer_bytes": _AT_LEAST_1,
    "rollout.weight_sync_timeout_s": _ABOVE_0,
    "rollout.verify_logprob_tolerance": _AT_LEAST_0,
    "rollout.sglang.mem_fraction_static": Range(low=0, high=1, low_open=True, high_open=True),
    "rollout.sglang.ep_size": _AT_LEAST_1,
    "rollout.sglang.server_timeout_s": _ABOVE_0,
    "data.max_prompt_tokens": _AT_LEAST_1,
    "algorithm.eps_clip": _ABOVE_0,
    "algorithm.eps_clip_high": _ABOVE_0,
    "algorithm.dual_clip_c": Range(low=1, low_open=True),
    "algorithm.loss_norm_tokens": Range(
        low=1, why="must be a positive number of tokens, or null for rollout.sampling.max_new_tokens"
    ),
    "algorithm.kl_coef": _AT_LEAST_0,
    "algorithm.kl_loss_coef": _AT_LEAST_0,
    "algorithm.entropy_coef": _AT_LEAST_0,
    "algorithm.gamma": _FRACTION,
    "algorithm.lambd": _FRACTION,
    "algorithm.tis_clip_low": _AT_LEAST_0,
    "algorithm.tis_clip_high": _ABOVE_0,
    "algorithm.mis_low": _AT_LEAST_0,
    "algorithm.mis_high": _ABOVE_0,
    "algorithm.overlong_buffer_len": _AT_LEAST_1,
    "algorithm.overlong_penalty_factor": _AT_LEAST_0,
    "algorithm.async_staleness": _AT_LEAST_0,
    "train.num_steps": _AT_LEAST_1,
    "train.global_batch_size": _AT_LEAST_1,
    "train.micro_batch_size": _AT_LEAST_1,
    "train.max_tokens_per_gpu": Range(low=1, why="must be >= 1 tokens, or null for micro_batch_size"),
    "train.steps_per_rollout": _AT_LEAST_1,
    "train.max_seq_len": _AT_LEAST_1,
    "train.logprob_chunk_tokens": _AT_LEAST_1,
    "train.oom_max_splits": _AT_LEAST_0,
    "train.max_nonfinite_steps": _AT_LEAST_1,
    "train.step_timeout_s": _ABOVE_0,
    "train.inject_oom_above_tokens": _AT_LEAST_1,
    "train.optimizer.lr": _ABOVE_0,
    "train.optimizer.min_lr": _AT_LEAST_0,
    "train.optimizer.weight_decay": _AT_LEAST_0,
    "train.optimizer.adam_beta1": _BETA,
    "train.optimizer.adam_beta2": _BETA,
    "train.optimizer.adam_eps": _ABOVE_0,
    "train.optimizer.clip_grad": _AT_LEAST_0,
    "train.lr_schedule.warmup_steps": _AT_LEAST_0,
    "train.lr_schedule.decay_steps": _AT_LEAST_1,
    "critic.lr": Range(
        low=0, low_open=True, why="algorithm.advantage_estimator=ppo trains a value model at this rate (> 0)"
    ),
    "critic.min_lr": _AT_LEAST_0,
    "critic.warmup_steps": _AT_LEAST_0,
    "critic.value_clip": _ABOVE_0,
    "checkpoint.save_interval": Range(low=1, why="must be a positive number of steps, or null for never"),
    "checkpoint.keep_last": Range(low=1, why="must be >= 1 (0 would delete every checkpoint)"),
    "logging.log_interval": _AT_LEAST_1,
    "eval.interval": Range(low=1, why="must be a positive number of steps, or null for never"),
    "eval.n_samples_per_prompt": _AT_LEAST_1,
}
"""Every numeric field of the schema (tests/test_config.py fails on one missing here)."""


def _get(config: SlimConfig, dotted: str) -> object:
    value: object = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def check_config(config: SlimConfig) -> None:
    for key, valid in CHOICES.items():
        value = _get(config, key)
        if value not in valid:
            shown = ", ".join("null" if v is None else str(v) for v in valid)
            raise ConfigError(f"{key}={value}: not one of {shown}")
    _check_ranges(config)
    _check_paths(config)
    _check_remote_code(config)
    if config.rollout.engine == "sglang":
        check_sglang_version()  # the pinned release, before anything starts
        validate_sglang_config(config)
    _check_cluster(config)
    _check_engine_nodes(config)
    _check_weight_sync(config)
    _check_fp8_rollout(config)
    _check_parallel(config)
    _check_engine_memory(config)
    _check_algorithm(config)
    _check_critic(config)
    _check_training(config)
    _check_rewards(config)
    _check_agent(config)
    _check_hooks(config)
    _check_data(config)


def check_run_inputs(config: SlimConfig) -> None:
    """What only a real run needs, checked before it creates anything (`slimrl train` and `slimrl
    rollout`; `--dry-run` and `slimrl plan` work from a config alone, as the shipped GPU configs
    with a config.json-only model directory do): a prompt data set, and weights to load."""
    if config.data.prompt_data is None:
        needs = "SFT trains on" if config.algorithm.loss == "sft" else "rollouts draw from"
        raise ConfigError(f"data.prompt_data=null: {needs} a prompt data set (JSONL or Parquet); set it")
    hf = Path(config.model.hf_checkpoint)
    weights = [*hf.glob("*.safetensors"), *hf.glob("*.safetensors.index.json")]
    engines = config.algorithm.loss == "policy"  # the engines serve the HF weights in any case
    if not weights and (engines or (config.model.init_from_hf and config.model.load is None)):
        raise ConfigError(
            f"model.hf_checkpoint={hf}: no *.safetensors weights (config.json only?); point it at a "
            "downloaded checkpoint"
            + ("" if engines else ", or set model.init_from_hf=false to start from random weights")
        )


def _check_ranges(config: SlimConfig) -> None:
    for key, valid in RANGES.items():
        value = _get(config, key)
        if value is not None and not valid.admits(value):  # type: ignore[arg-type]
            finite = "" if not isinstance(value, float) or math.isfinite(value) else "a finite number, "
            raise ConfigError(f"{key}={value}: {valid.why or f'must be {finite}{valid.describe()}'}")
    for section in ("rollout.sampling", "eval.sampling"):
        for token in _get(config, f"{section}.stop_token_ids"):  # type: ignore[union-attr]
            if token < 0:
                raise ConfigError(f"{section}.stop_token_ids: holds {token}; token ids are >= 0")
        if any(stop == "" for stop in _get(config, f"{section}.stop")):  # type: ignore[union-attr]
            raise ConfigError(f"{section}.stop: holds an empty string, which would stop at once")


def _check_names(config: SlimConfig) -> None:
    """Names that become one directory or file name inside the run's directories."""

    named = {"run.name": (config.run.name, f"{config.run.runs_dir}/<name>")}
    named |= {f"eval.datasets.{n}": (n, "the run directory's eval files") for n in config.eval.datasets}
    for key, (name, where) in named.items():
        if not is_plain_name(str(name)):
            raise ConfigError(
                f"{key}: {name!r} is not a plain name (letters, digits, `_`, `.`, `-`, not starting "
                f"with `.` or `-`); it names a directory or file in {where}"
            )


def _check_paths(config: SlimConfig) -> None:
    _check_names(config)
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


def remote_tokenizer_code(hf_dir: str | Path) -> tuple[str, str] | None:
    """(file, class) when the checkpoint's tokenizer is code shipped with it: an `auto_map` entry
    for AutoTokenizer in tokenizer_config.json or config.json (transformers' two places for it)."""
    import json

    for name in ("tokenizer_config.json", "config.json"):
        path = Path(hf_dir) / name
        try:
            auto_map = json.loads(path.read_text()).get("auto_map") if path.is_file() else None
        except (json.JSONDecodeError, AttributeError):
            continue  # a broken config.json is refused by the model checks, a tokenizer file by transformers
        entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
        if entry:
            classes = [c for c in (entry if isinstance(entry, list) else [entry]) if c]
            return name, ", ".join(map(str, classes))
    return None


def _check_remote_code(config: SlimConfig) -> None:
    """A tokenizer that is code in the checkpoint (Moonlight's tiktoken one) loads only with
    `trust_remote_code`; without it transformers raises deep inside the rollout manager, and SGLang's
    tokenizer manager only after the engines loaded their weights."""
    if config.model.trust_remote_code:
        return
    found = remote_tokenizer_code(config.model.hf_checkpoint)
    if found is not None:
        file, classes = found
        raise ConfigError(
            f"model.trust_remote_code=false: {Path(config.model.hf_checkpoint) / file} maps AutoTokenizer to "
            f"{classes}, code shipped with the checkpoint that transformers and SGLang run only with "
            "model.trust_remote_code=true; set it if you trust the checkpoint"
        )


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
    first = config.engine_first_slot()
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


def engines_planned(config: SlimConfig) -> bool:
    """SGLang engines on GPUs serve this run (RL): what the engine memory plan is for."""
    rollout = config.rollout
    return (
        rollout.engine == "sglang" and resolve_device(config) == "cuda" and config.algorithm.loss == "policy"
    )


def _check_engine_memory(config: SlimConfig) -> None:
    """Every engine's weights, one full sequence's KV cache and SGLang's CUDA-graph reserve fit one
    GPU (`planning/engine_plan.py`): an engine that does not fit dies while loading, after the start
    checkpoint was written, not here. CPU engines have no such budget."""
    if not engines_planned(config):
        return

    check_config_engines(config)


def _check_weight_sync(config: SlimConfig) -> None:
    """From GPU trainers, `tensor` and `distributed` need GPU engines (CUDA IPC, NCCL). Which
    layouts each transport can serve is the device ledger's business (`_check_device_rules`)."""
    transport = weight_transport(config)
    if (
        config.algorithm.loss == "policy"
        and config.rollout.engine == "embedded"
        and transport != "disk"
        and resolve_device(config) == "cuda"
    ):
        auto = " (auto)" if config.rollout.weight_sync == "auto" else ""
        how = "CUDA IPC handles" if transport == "tensor" else "an NCCL broadcast group"
        raise ConfigError(
            f"rollout.weight_sync={transport}{auto}: a GPU trainer would send {how}, which the embedded "
            "engine (CPU) cannot receive; use rollout.engine=sglang on GPUs, or rollout.weight_sync=disk"
        )


def _check_parallel(config: SlimConfig) -> None:

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
    layout = ParallelLayout.resolve(config.parallel, config.train_world_size(), arch)
    for section in ("rollout.sampling", "eval.sampling"):
        for token in _get(config, f"{section}.stop_token_ids"):  # type: ignore[union-attr]
            if token >= arch.vocab_size:
                raise ConfigError(
                    f"{section}.stop_token_ids: holds {token}, outside the model's vocabulary "
                    f"[0, {arch.vocab_size})"
                )
    _check_batches(config, layout.dp)
    _check_routing_replay(config, arch)
    _check_device_rules(config, layout, device)


def _check_device_rules(config: SlimConfig, layout: object, device: str) -> None:
    """The GPU's rules on the config's own layout (nodes of `cluster.gpus_per_node` devices), on
    CPU too: gloo would accept two members of a group on one device, NCCL does not."""

    transport = weight_transport(config) if config.algorithm.loss == "policy" else None
    check_ledger(build_ledger(config, simulated_layout(config), device, Sizes.of(layout), transport))


def _check_routing_replay(config: SlimConfig, arch: ModelArch) -> None:
    """Replay needs routed experts to replay: an MoE model, and engines that sample (not SFT)."""
    if not config.algorithm.routing_replay:
        if config.algorithm.routing_replay_counterfactual:
            raise ConfigError(
                "algorithm.routing_replay_counterfactual=true: it scores the batch without routing "
                "replay for comparison, which needs algorithm.routing_replay=true; set that to true "
                "or this to false"
            )
        return
    if config.algorithm.loss == "sft":
        raise ConfigError(
            "algorithm.routing_replay=true: SFT (algorithm.loss=sft) has no engine routing to replay; "
            "set it to false"
        )
    if not arch.is_moe:
        raise ConfigError(
            f"algorithm.routing_replay=true needs an MoE model; {arch.model_type} in "
            f"model.hf_checkpoint={config.model.hf_checkpoint} is dense (no routed experts in its "
            "config.json); set it to false"
        )


def _check_batches(config: SlimConfig, dp: int) -> None:
    """Every optimizer step gets the same number of samples on every data-parallel rank.

    SFT: `train.global_batch_size` samples per step (null: DEFAULT_SFT_BATCH). RL: a rollout of
    rollout_batch_size * n_samples_per_prompt samples is cut into `train.steps_per_rollout` equal
    steps; `train.global_batch_size`, derived, may be set only to that value (a check, not a knob)."""

    train, rollout = config.train, config.rollout
    if config.algorithm.loss == "sft":
        batch = sft_batch_size(config)
        if batch % dp:
            raise ConfigError(
                f"train.global_batch_size={batch}: SFT steps of {batch} samples must split evenly over "
                f"{dp} data-parallel ranks" + (" (null means 32)" if train.global_batch_size is None else "")
            )
        return
    samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    steps = train.steps_per_rollout
    if samples % (dp * steps):
        per = f"{dp} data-parallel ranks" + (
            f" x {steps} optimizer steps (train.steps_per_rollout)" if steps > 1 else ""
        )
        raise ConfigError(
            f"rollout.rollout_batch_size={rollout.rollout_batch_size}: rollout_batch_size * "
            f"n_samples_per_prompt = {samples} samples must split evenly over {per}"
        )
    if train.global_batch_size is not None and train.global_batch_size != samples // steps:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size}: in RL each optimizer step takes "
            f"rollout_batch_size * n_samples_per_prompt / steps_per_rollout = {samples // steps} samples; "
            "set it to that or leave it null (change the rollout size or train.steps_per_rollout instead)"
        )


def _check_algorithm(config: SlimConfig) -> None:
    algo = config.algorithm
    if algo.async_staleness > 0 and config.cluster.colocate:
        raise ConfigError(
            "algorithm.async_staleness>0: overlapping rollout and training needs separate devices "
            "(cluster.colocate=false)"
        )
    if algo.loss == "policy":
        _check_estimator(config)


def _check_estimator(config: SlimConfig) -> None:
    """Estimator/loss combinations that have no definition are refused here, in one line naming the
    keys and what would be valid, instead of silently ignoring a setting."""
    algo, rollout = config.algorithm, config.rollout
    estimator = algo.advantage_estimator
    traits = estimators.traits(estimator)
    if traits.group_baseline and rollout.n_samples_per_prompt < 2:
        raise ConfigError(
            f"rollout.n_samples_per_prompt={rollout.n_samples_per_prompt}: "
            f"{estimator} needs groups of at least 2 samples"
        )
    if traits.sequence_ratio and algo.loss_reduction != "seq_mean_token_mean":
        raise ConfigError(
            f"algorithm.loss_reduction={algo.loss_reduction}: advantage_estimator=gspo is the mean over "
            "sequences of the sequence-level objective; set algorithm.loss_reduction=seq_mean_token_mean"
        )
    if algo.policy_loss == PolicyLoss.CISPO and traits.sequence_ratio:
        raise ConfigError(
            f"algorithm.policy_loss=cispo: CISPO weights each token; advantage_estimator={estimator} has a "
            "sequence-level ratio, which only policy_loss=ppo_clip defines"
        )
    if algo.policy_loss == PolicyLoss.CISPO and algo.dual_clip_c is not None:
        raise ConfigError(
            f"algorithm.dual_clip_c={algo.dual_clip_c}: the dual clip bounds PPO's clipped ratio; "
            "policy_loss=cispo has none, set dual_clip_c to null"
        )
    if not algo.normalize_std and not traits.std_choice:
        with_std = "/".join(estimators.names(lambda t: t.std_choice))
        raise ConfigError(
            f"algorithm.normalize_std=false: only {with_std} divide by the group std (Dr.GRPO drops it); "
            f"advantage_estimator={estimator} has none, remove the setting"
        )
    if not traits.token_level:
        token_level = ", ".join(estimators.names(lambda t: t.token_level))
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
    if algo.lambd != 1.0 and not traits.critic:
        raise ConfigError(
            f"algorithm.lambd={algo.lambd}: the GAE lambda applies to advantage_estimator=ppo only "
            f"(got {estimator}); leave lambd at 1.0"
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
    threshold = rollout.dynamic_sampling_std_threshold
    if threshold > 0 and rollout.dynamic_sampling_filter_path is None:
        raise ConfigError(
            f"rollout.dynamic_sampling_std_threshold={threshold}: read by the dynamic-sampling filter; set "
            "rollout.dynamic_sampling_filter_path=slimrl.rollout.filters.nonzero_reward_std"
        )


def _check_critic(config: SlimConfig) -> None:
    """PPO needs a value model and only PPO has one: `critic.*` is refused without it."""
    critic = config.critic
    if not config.has_critic():
        default = CriticConfig()
        changed = [f"critic.{k}" for k in CriticConfig.__slots__ if getattr(critic, k) != getattr(default, k)]
        if changed:
            raise ConfigError(
                f"{', '.join(changed)}: a critic is trained only with algorithm.advantage_estimator=ppo "
                f"(got {config.algorithm.advantage_estimator} with loss {config.algorithm.loss}); "
                f"remove the critic settings or use ppo"
            )
        return
    if critic.lr is None:
        raise ConfigError(
            f"critic.lr={'null' if critic.lr is None else critic.lr}: algorithm.advantage_estimator=ppo "
            f"trains a value model and needs its learning rate (e.g. critic.lr=1e-5, > 0)"
        )
    steps = config.train.num_steps
    if not 0 <= critic.warmup_steps < steps:
        raise ConfigError(
            f"critic.warmup_steps={critic.warmup_steps}: must be in 0..{steps - 1} "
            f"(train.num_steps={steps}: the policy must update at least once)"
        )
    if critic.load is not None and not Path(critic.load).exists():
        raise ConfigError(f"critic.load={critic.load}: file not found")


def _check_training(config: SlimConfig) -> None:
    opt = config.train.optimizer
    if opt.min_lr > opt.lr:
        raise ConfigError(f"train.optimizer.min_lr={opt.min_lr}: must not exceed train.optimizer.lr={opt.lr}")
    if opt.cpu_offload and not config.parallel.use_distributed_optimizer:
        raise ConfigError(
            "train.optimizer.cpu_offload=true: needs parallel.use_distributed_optimizer=true (Megatron's "
            "CPU offload runs on the precision-aware distributed optimizer)"
        )
    _check_lr_schedule(config)
    _check_sequence_length(config)
    if config.model.ref_load is not None and not _needs_reference(config):
        raise ConfigError(
            f"model.ref_load={config.model.ref_load}: the reference model is used only by a KL term "
            "(algorithm.kl_loss_coef or algorithm.kl_coef > 0, RL); set one or remove model.ref_load"
        )


def _check_lr_schedule(config: SlimConfig) -> None:
    """Megatron's scheduler needs warm-up to end before decay does; it is never adjusted silently."""
    schedule, train = config.train.lr_schedule, config.train
    if schedule.decay_style == "constant" or schedule.warmup_steps == 0:
        return
    per_step = 1 if config.algorithm.loss == "sft" else train.steps_per_rollout
    decay = schedule.decay_steps or train.num_steps * per_step
    if schedule.warmup_steps >= decay:
        source = "train.lr_schedule.decay_steps" if schedule.decay_steps else "the run's optimizer steps"
        raise ConfigError(
            f"train.lr_schedule.warmup_steps={schedule.warmup_steps}: must be below {source} ({decay}) "
            f"for decay_style={schedule.decay_style}; shorten the warm-up or use decay_style=constant"
        )


def _check_sequence_length(config: SlimConfig) -> None:
    """The longest sequence a rollout can make fits `train.max_seq_len` (RL; checked per sample too)."""
    prompt, response = config.data.max_prompt_tokens, config.rollout.sampling.max_new_tokens
    if config.algorithm.loss == "sft" or prompt is None:
        return
    if prompt + response > config.train.max_seq_len:
        raise ConfigError(
            f"train.max_seq_len={config.train.max_seq_len}: below data.max_prompt_tokens={prompt} + "
            f"rollout.sampling.max_new_tokens={response}; raise it to at least {prompt + response}"
        )


def _needs_reference(config: SlimConfig) -> bool:
    algo = config.algorithm
    return algo.loss == "policy" and (algo.kl_loss_coef > 0 or algo.kl_coef > 0)


def _check_rewards(config: SlimConfig) -> None:
    rollout = config.rollout
    remote = rollout.custom_rm_path is None and rollout.reward_type == "remote"
    url = rollout.remote_rm_url
    if url is not None and not remote:
        how = f"rollout.custom_rm_path={rollout.custom_rm_path}" if rollout.custom_rm_path else None
        raise ConfigError(
            f"rollout.remote_rm_url={url}: read only with rollout.reward_type=remote (rewards come from "
            f"{how or 'reward_type ' + rollout.reward_type}); remove it or set reward_type=remote"
        )
    if remote:
        if not url:
            raise ConfigError(
                "rollout.reward_type=remote: set rollout.remote_rm_url to the reward model's endpoint "
                "(http://host:port/path)"
            )
        parts = urlsplit(url)
        try:
            port_ok = parts.port is None or parts.port > 0
        except ValueError:
            port_ok = False
        if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
            raise ConfigError(
                f"rollout.remote_rm_url={url}: not an http(s) URL; expected http://host:port/path"
            )
    if rollout.group_rm and rollout.custom_rm_path is None:
        raise ConfigError(
            "rollout.group_rm=true: applies to the reward hook rollout.custom_rm_path, which is not set"
        )


def _check_agent(config: SlimConfig) -> None:
    """An agent (`rollout.agent_function_path`) is the sample's generate and its reward: it cannot be
    combined with another generate or reward hook; its tool-call parser must be one SGLang has.
    (Partial rollout composes with it: runs are parked between rollouts, `rollout/agent/runner.py`.)"""
    rollout = config.rollout
    path = rollout.agent_function_path
    if path is None:
        return
    key = f"rollout.agent_function_path={path}"
    for other in ("custom_generate_function_path", "custom_rm_path"):
        if getattr(rollout, other) is not None:
            what = "generates the samples" if other.startswith("custom_generate") else "returns the reward"
            raise ConfigError(f"{key}: the agent {what}; remove rollout.{other}")
    try:
        parsers = tool_call_parsers()
    except ImportError as exc:
        raise ConfigError(f"{key}: parsing tool calls needs SGLang (slimrl[sglang]): {exc}") from None
    if rollout.agent_tool_call_parser not in parsers:
        raise ConfigError(
            f"rollout.agent_tool_call_parser={rollout.agent_tool_call_parser}: not one of SGLang's "
            f"tool-call parsers ({', '.join(sorted(parsers))})"
        )


_HOOK_KEYS = (
    "custom_generate_function_path",
    "rollout_function_path",
    "custom_rm_path",
    "dynamic_sampling_filter_path",
    "buffer_filter_path",
    "agent_function_path",
)


def _check_hooks(config: SlimConfig) -> None:
    """Import every configured hook and check its signature now (`slimrl rollout` did this first;
    `slimrl train` only found a bad one once its rollout manager ran, tens of seconds in)."""
    if not any(getattr(config.rollout, key) for key in _HOOK_KEYS):
        return

    check_hooks(config)


def _check_data(config: SlimConfig) -> None:
    """The first records of every data file: readable, of the right shape, with the keys the run
    reads (a bad record further in still fails when the data is loaded, naming its line)."""

    data, rollout = config.data, config.rollout
    sft = config.algorithm.loss == "sft"
    builtin_reward = (
        rollout.custom_rm_path is None
        and rollout.agent_function_path is None
        and rollout.reward_type in ("toy", "math")
    )
    need_label = sft or builtin_reward
    why = "SFT trains on it" if sft else f"the built-in `{rollout.reward_type}` reward scores against it"
    files = [("data.prompt_data", data.prompt_data)]
    files += [(f"eval.datasets.{name}", path) for name, path in config.eval.datasets.items()]
    for key, path in files:
        if path is not None:
            check_prompt_file(
                path,
                key,
                data.input_key,
                data.label_key if need_label else None,
                why,
                data.apply_chat_template,
                tools_key=data.tools_key,
                sft=sft,
            )
