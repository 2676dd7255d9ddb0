"""The `python -m sglang.launch_server ...` command line of one engine, built from the config.

Every flag slimrl decides is one row of `_FLAGS`; `rollout.sglang.extra_args` passes anything
else through verbatim (speculative decoding, CUDA graph sizes, ...) but may not override a row,
because two sources for one flag would make the effective value depend on argparse order.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from slimrl.compat import sglang_cpu
from slimrl.config.schema import SlimConfig
from slimrl.errors import ConfigError

FlagValue = str | int | float | bool | None
"""None and False omit the flag, True makes it bare, anything else follows it as one value."""

QUANTIZATIONS = (None, "fp8")

BATCH_INVARIANT_ATTENTION = ("fa3", "fa4", "flashinfer", "triton")
"""CUDA attention backends SGLang accepts with `--enable-deterministic-inference` (SGLang 0.5.23)."""

# True on-policy without a user-chosen backend gets fa3: deterministic inference needs a
# batch-invariant attention kernel (the result of a row must not depend on what else is in the
# batch), fa3 is SGLang's batch-invariant choice on Hopper, and it keeps the radix cache on under
# deterministic inference (SGLang docs, see sglang_http_api.md section 10). fa3 does not run on
# Blackwell: set rollout.sglang.attention_backend (e.g. flashinfer) there.
DETERMINISTIC_ATTENTION_DEFAULT = "fa3"

REFUSED_EXTRA_ARGS: dict[str, str] = {
    # SGLang's "true on-policy" target reproduces the numerics of an FSDP trainer (its RMSNorm,
    # RoPE and log-softmax paths); slimrl trains with Megatron, so it would add a mismatch.
    "rl-on-policy-target": "it matches an FSDP trainer's numerics, not Megatron's",
}


@dataclass(frozen=True, slots=True)
class _Launch:
    """Everything a flag value may depend on: the config plus this engine's placement."""

    config: SlimConfig
    model_path: str
    host: str
    port: int
    engine_index: int
    base_gpu_id: int
    nccl_port: int | None
    on_cpu: bool


def _gpu_only(value_of: Callable[[_Launch], FlagValue]) -> Callable[[_Launch], FlagValue]:
    """A flag that only means something on GPUs (a CPU server has no GPU ids or GPU memory share)."""
    return lambda launch: None if launch.on_cpu else value_of(launch)


def _attention_backend(launch: _Launch) -> str | None:
    if launch.on_cpu:
        return sglang_cpu.CPU_ATTENTION_BACKEND
    chosen = launch.config.rollout.sglang.attention_backend
    if chosen is None and launch.config.algorithm.true_on_policy:
        return DETERMINISTIC_ATTENTION_DEFAULT
    return chosen


def _dp_attention(launch: _Launch) -> bool:
    return launch.config.rollout.sglang.dp_attention


# Declarative flag table, in command-line order. Only these flags are derived from the config.
_FLAGS: tuple[tuple[str, Callable[[_Launch], FlagValue]], ...] = (
    ("model-path", lambda launch: launch.model_path),
    ("host", lambda launch: launch.host),
    ("port", lambda launch: launch.port),
    ("nccl-port", lambda launch: launch.nccl_port),
    ("base-gpu-id", _gpu_only(lambda launch: launch.base_gpu_id)),
    ("tp-size", lambda launch: launch.config.rollout.gpus_per_engine),
    ("ep-size", lambda launch: launch.config.rollout.sglang.ep_size),
    ("enable-dp-attention", _dp_attention),
    # DP attention shards attention over every TP rank of the engine (DeepSeek-style serving).
    ("dp-size", lambda launch: launch.config.rollout.gpus_per_engine if _dp_attention(launch) else None),
    ("mem-fraction-static", _gpu_only(lambda launch: launch.config.rollout.sglang.mem_fraction_static)),
    ("attention-backend", _attention_backend),
    ("quantization", lambda launch: launch.config.rollout.sglang.quantization),
    # A checkpoint with its own tokenizer or model code (config.json / tokenizer_config.json
    # `auto_map`): SGLang's tokenizer manager and model config load it through transformers.
    ("trust-remote-code", lambda launch: launch.config.model.trust_remote_code),
    # Engines sample differently from each other but reproducibly across runs.
    ("random-seed", lambda launch: launch.config.run.seed + launch.engine_index),
    # Colocated engines must hand their GPU memory back while the trainer runs
    # (/release_memory_occupation needs torch_memory_saver, which this flag turns on). CPU servers
    # too: there slimrl/compat/sglang_cpu/memory_saver.py stands in, losing released memory as a
    # GPU does (weights come back as NaN unless backed up), so a missing reload shows on CPU.
    ("enable-memory-saver", lambda launch: launch.config.cluster.colocate),
    ("enable-weights-cpu-backup", lambda launch: launch.config.rollout.sglang.weights_cpu_backup),
    # `--rl-on-policy-target fsdp` is deliberately absent: it switches SGLang's layers to the
    # numerics of an FSDP trainer, and slimrl's trainer is Megatron (see REFUSED_EXTRA_ARGS).
    ("enable-deterministic-inference", _gpu_only(lambda launch: launch.config.algorithm.true_on_policy)),
    # MoE routing replay: /generate answers carry `meta_info.routed_experts` when asked (on CPU
    # its host buffer needs slimrl/compat/sglang_cpu/host_memory.py, installed by the stand-in).
    ("enable-return-routed-experts", lambda launch: launch.config.algorithm.routing_replay),
    ("api-key", lambda launch: launch.config.rollout.api_key),
    ("admin-api-key", lambda launch: launch.config.rollout.admin_api_key),
    # CPU servers (slimrl/compat/sglang_cpu): SGLang's torch code paths, float32, a small KV pool.
    ("device", lambda launch: "cpu" if launch.on_cpu else None),
    ("dtype", lambda launch: sglang_cpu.CPU_DTYPE if launch.on_cpu else None),
    ("max-total-tokens", lambda launch: sglang_cpu.CPU_MAX_TOTAL_TOKENS if launch.on_cpu else None),
    # An idle scheduler otherwise spins a whole core: on a CPU host that core is the trainer's.
    ("sleep-on-idle", lambda launch: launch.on_cpu),
)

MANAGED_FLAGS: tuple[str, ...] = tuple(name for name, _ in _FLAGS)


def build_launch_command(
    config: SlimConfig,
    *,
    model_path: str,
    host: str,
    port: int,
    engine_index: int,
    base_gpu_id: int,
    nccl_port: int | None = None,
    on_cpu: bool = False,
) -> list[str]:
    """argv of one SGLang server. The interpreter is this one: engines run in the launcher's env.

    Note that `--api-key` appears in the process list of the node, as with any SGLang launch.
    """
    validate_sglang_config(config)
    launch = _Launch(config, model_path, host, port, engine_index, base_gpu_id, nccl_port, on_cpu)
    argv = [sys.executable, "-m", "sglang.launch_server"]
    for name, value_of in _FLAGS:
        argv += _render(name, value_of(launch))
    for key, value in config.rollout.sglang.extra_args.items():
        argv += _render(_flag_name(key), value)
    return argv


def validate_sglang_config(config: SlimConfig) -> None:
    """The checks `build_launch_command` relies on, without building (for start-up validation)."""
    rollout, sglang = config.rollout, config.rollout.sglang
    tp_size = rollout.gpus_per_engine
    gpus_per_node = config.cluster.gpus_per_node
    if tp_size > gpus_per_node:
        raise ConfigError(
            f"rollout.gpus_per_engine={tp_size} exceeds cluster.gpus_per_node={gpus_per_node}: "
            "engines spanning nodes are not supported"
        )
    if sglang.ep_size < 1 or tp_size % sglang.ep_size:
        raise ConfigError(
            f"rollout.sglang.ep_size={sglang.ep_size} must divide the engine's TP size "
            f"(rollout.gpus_per_engine={tp_size})"
        )
    if not 0.0 < sglang.mem_fraction_static < 1.0:
        raise ConfigError(
            f"rollout.sglang.mem_fraction_static={sglang.mem_fraction_static} must be in (0, 1)"
        )
    if sglang.quantization not in QUANTIZATIONS:
        raise ConfigError(
            f"rollout.sglang.quantization=`{sglang.quantization}`: supported values are null and `fp8`"
        )
    _check_deterministic_backend(config)
    for key, value in sglang.extra_args.items():
        _check_extra_arg(key, value)


def _check_deterministic_backend(config: SlimConfig) -> None:
    backend = config.rollout.sglang.attention_backend
    if config.algorithm.true_on_policy and backend is not None and backend not in BATCH_INVARIANT_ATTENTION:
        raise ConfigError(
            f"rollout.sglang.attention_backend=`{backend}` is not batch-invariant, which "
            f"algorithm.true_on_policy needs (use one of: {', '.join(BATCH_INVARIANT_ATTENTION)})"
        )


def _check_extra_arg(key: str, value: Any) -> None:
    name = _flag_name(key)
    where = f"rollout.sglang.extra_args.{key}"
    if name in MANAGED_FLAGS:
        raise ConfigError(
            f"{where}: --{name} is set by slimrl from the config; flags it manages: "
            + ", ".join(f"--{flag}" for flag in MANAGED_FLAGS)
        )
    if name in REFUSED_EXTRA_ARGS:
        raise ConfigError(f"{where}: --{name} is not supported: {REFUSED_EXTRA_ARGS[name]}")
    if not name:
        raise ConfigError(f"{where}: empty flag name")
    if isinstance(value, list | tuple) and not value:
        raise ConfigError(f"{where}: empty list (omit the key, or set it to false, to drop the flag)")


def _flag_name(key: str) -> str:
    """`speculative_algorithm`, `speculative-algorithm` and `--speculative-algorithm` are one flag."""
    return str(key).lstrip("-").replace("_", "-")


def _render(name: str, value: Any) -> list[str]:
    if value is None or value is False:
        return []
    if value is True:
        return [f"--{name}"]
    if isinstance(value, list | tuple):
        return [f"--{name}", *(_value_text(v) for v in value)]
    return [f"--{name}", _value_text(value)]


def _value_text(value: Any) -> str:
    # SGLang takes JSON for its structured options (e.g. --json-model-override-args).
    if isinstance(value, Mapping):
        return json.dumps(dict(value), separators=(",", ":"))
    return str(value)


def sglang_env(config: SlimConfig, on_cpu: bool = False) -> dict[str, str]:
    """Extra environment of an SGLang server: the CPU engine's, or true on-policy's GPU numerics."""
    if on_cpu:
        return sglang_cpu.cpu_env()
    if not config.algorithm.true_on_policy:
        return {}
    return {
        # Same all-reduce algorithm on every call, so TP reductions are reproducible; this is the
        # value SGLang itself picks for deterministic inference with TP > 1.
        "NCCL_ALGO": "allreduce:tree",
        # Deterministic cuBLAS workspaces (required for reproducible GEMMs on CUDA >= 10.2).
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }
