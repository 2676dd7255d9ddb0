"""The launch argv we build, read back by SGLang 0.5.23's own parser (`ServerArgs.add_cli_args`
then `ServerArgs.from_cli_args`), for every shipped config on GPU and on CPU: an unknown flag or a
bad value fails argparse, and every parsed field must be what the config says.

Only parsing and record construction run (no resolution pipeline): they need no GPU and no model.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from slimrl.compat import sglang_cpu
from slimrl.config.schema import SlimConfig
from slimrl.devices.launch_plan import engine_seats, simulated_layout
from slimrl.preflight import load_config
from slimrl.rollout.sglang.server_args import DETERMINISTIC_ATTENTION_DEFAULT, build_launch_command
from tests.conftest import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
VARIANTS = {
    "as shipped": [],
    "true on-policy + keys + replay + weights backup": [
        "algorithm.true_on_policy=true",
        "rollout.api_key=k",
        "rollout.admin_api_key=a",
        "algorithm.routing_replay=true",
        "rollout.sglang.weights_cpu_backup=true",
    ],
}


@pytest.fixture(scope="module")
def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def _load(path: Path, extra: list[str], tiny_model, mod_sum_data, monkeypatch) -> SlimConfig:
    monkeypatch.chdir(REPO)
    if "configs/models/" in path.read_text():
        return load_config(path, extra)
    local = [f"model.hf_checkpoint={tiny_model('qwen3_moe')}", f"data.prompt_data={mod_sum_data}"]
    return load_config(path, [*local, *extra])


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> Any:
    from sglang.srt.server_args import ServerArgs

    assert argv[1:3] == ["-m", "sglang.launch_server"]
    return ServerArgs.from_cli_args(parser.parse_args(argv[3:]))


def _expected(config: SlimConfig, index: int, base: int, on_cpu: bool) -> dict[str, Any]:
    rollout, sglang = config.rollout, config.rollout.sglang
    backend = sglang.attention_backend
    if on_cpu:
        backend = sglang_cpu.CPU_ATTENTION_BACKEND
    elif backend is None and config.algorithm.true_on_policy:
        backend = DETERMINISTIC_ATTENTION_DEFAULT
    expected = {
        "model_path": config.model.hf_checkpoint, "host": "10.0.0.7", "port": 30000 + index,
        "tp_size": rollout.gpus_per_engine, "ep_size": sglang.ep_size,
        "enable_dp_attention": sglang.dp_attention, "attention_backend": backend,
        "quantization": sglang.quantization, "random_seed": config.run.seed + index,
        "api_key": rollout.api_key, "admin_api_key": rollout.admin_api_key,
        "enable_memory_saver": config.cluster.colocate,  # on CPU: sglang_cpu/memory_saver.py
        "enable_weights_cpu_backup": sglang.weights_cpu_backup,
        "enable_deterministic_inference": config.algorithm.true_on_policy and not on_cpu,
        "enable_return_routed_experts": config.algorithm.routing_replay,
        "trust_remote_code": config.model.trust_remote_code,
    }  # fmt: skip
    if sglang.dp_attention:
        expected["dp_size"] = rollout.gpus_per_engine
    if on_cpu:
        expected |= {
            "device": "cpu",
            "dtype": sglang_cpu.CPU_DTYPE,
            "max_total_tokens": sglang_cpu.CPU_MAX_TOTAL_TOKENS,
        }
    else:
        expected |= {"base_gpu_id": base, "mem_fraction_static": sglang.mem_fraction_static}
    return expected


@pytest.mark.parametrize("on_cpu", [False, True], ids=["gpu", "cpu"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_sglang_parses_our_argv_to_the_configured_values(
    path, variant, on_cpu, sglang_parser, tiny_model, mod_sum_data, monkeypatch
):
    sft = "loss: sft" in path.read_text()  # replay is refused for SFT: there is no engine routing
    extra = [o for o in VARIANTS[variant] if not (sft and o.startswith("algorithm.routing_replay"))]
    config = _load(path, extra, tiny_model, mod_sum_data, monkeypatch)
    device = "cpu" if on_cpu else "cuda"
    for seat in engine_seats(config, simulated_layout(config), device):
        base = seat.base_gpu_id()
        argv = build_launch_command(
            config, model_path=config.model.hf_checkpoint, host="10.0.0.7", port=30000 + seat.index,
            engine_index=seat.index, base_gpu_id=base, nccl_port=29500, on_cpu=on_cpu,
        )  # fmt: skip
        parsed = _parse(sglang_parser, argv)
        for field, value in _expected(config, seat.index, base, on_cpu).items():
            assert getattr(parsed, field) == value, (path.stem, seat.index, field)
        assert parsed.nccl_port == 29500


def test_sglang_parser_rejects_a_flag_it_does_not_know(sglang_parser):
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        sglang_parser.parse_args(["--model-path", "/m", "--not-an-sglang-flag", "1"])
