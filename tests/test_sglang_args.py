"""SGLang launch command: exact argv for representative configs, passthrough rules, validation."""

from __future__ import annotations

import sys

import pytest

from slimrl.config.schema import SlimConfig
from slimrl.errors import ConfigError
from slimrl.rollout.sglang.server_args import (
    MANAGED_FLAGS,
    build_launch_command,
    sglang_env,
    validate_sglang_config,
)

LAUNCH = [sys.executable, "-m", "sglang.launch_server"]


def _build(config: SlimConfig, **overrides) -> list[str]:
    placement = {"model_path": "/ckpt/hf", "host": "10.0.0.5", "port": 30000, "engine_index": 0}
    return build_launch_command(config, **{"base_gpu_id": 0, **placement, **overrides})


def test_default_colocated_engine() -> None:
    config = SlimConfig()
    assert _build(config) == [
        *LAUNCH,
        "--model-path", "/ckpt/hf",
        "--host", "10.0.0.5",
        "--port", "30000",
        "--base-gpu-id", "0",
        "--tp-size", "1",
        "--ep-size", "1",
        "--mem-fraction-static", "0.8",
        "--random-seed", "1234",
        "--enable-memory-saver",
    ]  # fmt: skip


def test_moe_engine_with_dp_attention_fp8_and_api_key() -> None:
    config = SlimConfig()
    config.run.seed = 7
    config.cluster.colocate = False
    config.rollout.gpus_per_engine = 8
    config.rollout.api_key = "secret"
    sglang = config.rollout.sglang
    sglang.ep_size, sglang.dp_attention, sglang.quantization = 8, True, "fp8"
    sglang.mem_fraction_static, sglang.attention_backend = 0.7, "flashinfer"
    assert _build(config, engine_index=2, base_gpu_id=8, nccl_port=29600) == [
        *LAUNCH,
        "--model-path", "/ckpt/hf",
        "--host", "10.0.0.5",
        "--port", "30000",
        "--nccl-port", "29600",
        "--base-gpu-id", "8",
        "--tp-size", "8",
        "--ep-size", "8",
        "--enable-dp-attention",
        "--dp-size", "8",
        "--mem-fraction-static", "0.7",
        "--attention-backend", "flashinfer",
        "--quantization", "fp8",
        "--random-seed", "9",
        "--api-key", "secret",
    ]  # fmt: skip


def test_true_on_policy_picks_fa3_and_deterministic_inference() -> None:
    config = SlimConfig()
    config.cluster.colocate = False
    config.algorithm.true_on_policy = True
    argv = _build(config)
    assert argv[-5:] == [
        "--attention-backend", "fa3",
        "--random-seed", "1234",
        "--enable-deterministic-inference",
    ]  # fmt: skip
    assert "--rl-on-policy-target" not in argv  # targets an FSDP trainer, not Megatron
    config.rollout.sglang.attention_backend = "triton"  # the user's batch-invariant choice stays
    argv = _build(config)
    assert argv[argv.index("--attention-backend") + 1] == "triton" and "fa3" not in argv


def test_true_on_policy_rejects_a_batch_variant_backend() -> None:
    config = SlimConfig()
    config.algorithm.true_on_policy = True
    config.rollout.sglang.attention_backend = "torch_native"
    with pytest.raises(ConfigError, match=r"attention_backend=`torch_native` is not batch-invariant"):
        validate_sglang_config(config)


def test_extra_args_passthrough() -> None:
    config = SlimConfig()
    config.cluster.colocate = False
    config.rollout.sglang.extra_args = {
        "speculative_algorithm": "EAGLE",
        "cuda-graph-bs": [1, 2, 4],
        "enable_dp_lm_head": True,
        "disable_radix_cache": False,
        "chunked_prefill_size": None,
        "json_model_override_args": {"rope_scaling": {"factor": 2.0}},
    }
    assert _build(config)[-11:] == [
        "--random-seed", "1234",
        "--speculative-algorithm", "EAGLE",
        "--cuda-graph-bs", "1", "2", "4",
        "--enable-dp-lm-head",
        "--json-model-override-args", '{"rope_scaling":{"factor":2.0}}',
    ]  # fmt: skip


@pytest.mark.parametrize("key", ["tp_size", "--port", "enable-memory-saver", "api_key"])
def test_extra_args_may_not_override_managed_flags(key: str) -> None:
    config = SlimConfig()
    config.rollout.sglang.extra_args = {key: 2}
    with pytest.raises(ConfigError) as info:
        _build(config)
    message = str(info.value)
    assert message.startswith(
        f"rollout.sglang.extra_args.{key}: --{key.lstrip('-').replace('_', '-')} is set"
    )
    assert "--model-path, --host, --port" in message and "\n" not in message


def test_extra_args_refuses_fsdp_on_policy_target_and_empty_lists() -> None:
    config = SlimConfig()
    config.rollout.sglang.extra_args = {"rl_on_policy_target": "fsdp"}
    with pytest.raises(ConfigError, match=r"extra_args.rl_on_policy_target: .*FSDP trainer"):
        validate_sglang_config(config)
    config.rollout.sglang.extra_args = {"cuda_graph_bs": []}
    with pytest.raises(ConfigError, match=r"^rollout.sglang.extra_args.cuda_graph_bs: empty list"):
        validate_sglang_config(config)


@pytest.mark.parametrize(
    ("gpus_per_engine", "ep_size", "message"),
    [
        (4, 3, "rollout.sglang.ep_size=3 must divide the engine's TP size (rollout.gpus_per_engine=4)"),
        (4, 0, "rollout.sglang.ep_size=0 must divide"),
        (16, 1, "rollout.gpus_per_engine=16 exceeds cluster.gpus_per_node=8"),
    ],
)
def test_engine_layout_checks(gpus_per_engine: int, ep_size: int, message: str) -> None:
    config = SlimConfig()
    config.rollout.gpus_per_engine, config.rollout.sglang.ep_size = gpus_per_engine, ep_size
    with pytest.raises(ConfigError) as info:
        validate_sglang_config(config)
    assert message in str(info.value)
    with pytest.raises(ConfigError):
        _build(config)


def test_value_checks() -> None:
    config = SlimConfig()
    config.rollout.sglang.quantization = "int4"
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.quantization=`int4`"):
        validate_sglang_config(config)
    config = SlimConfig()
    config.rollout.sglang.mem_fraction_static = 1.2
    with pytest.raises(ConfigError, match=r"mem_fraction_static=1.2 must be in \(0, 1\)"):
        validate_sglang_config(config)


def test_managed_flags_are_listed() -> None:
    assert MANAGED_FLAGS == (
        "model-path", "host", "port", "nccl-port", "base-gpu-id", "tp-size", "ep-size",
        "enable-dp-attention", "dp-size", "mem-fraction-static", "attention-backend", "quantization",
        "trust-remote-code", "random-seed", "enable-memory-saver", "enable-weights-cpu-backup",
        "enable-deterministic-inference", "enable-return-routed-experts", "api-key", "admin-api-key",
        "device", "dtype", "max-total-tokens", "sleep-on-idle",
    )  # fmt: skip


def test_sglang_env() -> None:
    config = SlimConfig()
    assert sglang_env(config) == {}
    config.algorithm.true_on_policy = True
    assert sglang_env(config) == {"NCCL_ALGO": "allreduce:tree", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
