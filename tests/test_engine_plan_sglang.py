"""The engine memory plan against SGLang 0.5.23's own code, on CPU: our launch argv for every
shipped GPU config (and variants) parsed by SGLang's parser and resolved by its own pipeline
(`ServerArgs.resolve_once`) with the GPU's capacity patched in. SGLang then decides:

- its runtime reserve: with `--mem-fraction-static` left out, SGLang picks
  `round((gpu - reserve) / gpu, 3)` (`arg_groups/memory_hook.py`), so `gpu * (1 - fraction)` is its
  reserve to within the rounding; and the decode CUDA-graph batch it sizes that reserve for;
- the parallel widths the model is built with (`runtime_context.parallel_widths_of`);
- the KV cache per token (`ModelConfig.get_num_kv_heads`, `calculate_mla_kv_cache_dim`, its dtype).

About 15 s to import SGLang once, then a second or so per resolution.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from slimrl.orchestration.dry_run import engine_launches
from slimrl.planning.engine_plan import EngineWidths, kv_bytes_per_token, plan_engine
from slimrl.preflight import load_config
from tests.conftest import REPO
from tests.test_launch_plan import GPU_CONFIGS

pytestmark = pytest.mark.sglang

VARIANTS = {
    "as shipped": [],
    "true on-policy": ["algorithm.true_on_policy=true"],
    "chunk 4096, decode graphs to 160": [
        "rollout.sglang.extra_args={chunked_prefill_size: 4096, cuda_graph_max_bs_decode: 160}"
    ],
    "at most 64 requests": ["rollout.sglang.extra_args={max_running_requests: 64}"],
    "no CUDA graphs": ["rollout.sglang.extra_args={disable_cuda_graph: true}"],
}
GPUS_GIB = [24, 40, 80, 141, 192]


@pytest.fixture(scope="module")
def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def _resolved(parser: argparse.ArgumentParser, config: Any, gpu_mib: float, runs: Path) -> Any:
    """SGLang's ServerArgs for engine 0's argv as a run launches it, minus `--mem-fraction-static`
    (so SGLang picks it), resolved as on a CUDA GPU of `gpu_mib`. An FP8 fleet's `--model-path` is
    its start checkpoint, whose config.json (with its quantization_config) is written under `runs`."""
    import sglang.srt.arg_groups.memory_hook as memory_hook
    from sglang.srt.server_args import ServerArgs

    from slimrl.orchestration.fp8_start import serving_path
    from slimrl.weight_sync.fp8 import fp8_hf_config

    config.run.runs_dir = str(runs)
    if config.rollout.sglang.quantization == "fp8":
        start = Path(serving_path(config))
        start.mkdir(parents=True, exist_ok=True)
        source = json.loads((Path(config.model.hf_checkpoint) / "config.json").read_text())
        (start / "config.json").write_text(json.dumps(fp8_hf_config(source)))
    argv = engine_launches(config, "cuda")[0].command[3:]
    at = argv.index("--mem-fraction-static")
    del argv[at : at + 2]
    args = ServerArgs.from_cli_args(parser.parse_args([*argv, "--device", "cuda"]))
    with mock.patch.object(memory_hook, "get_device_memory_capacity", lambda device=None: gpu_mib):
        args.resolve_once()
    return args


@pytest.mark.parametrize("gpu_gib", GPUS_GIB)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_reserve_is_sglangs_own(path, variant, gpu_gib, sglang_parser, monkeypatch, tmp_path):
    from sglang.srt.arg_groups.overrides import resolved_view

    monkeypatch.chdir(REPO)
    config = load_config(path, VARIANTS[variant])
    config.cluster.gpu_memory_gb = gpu_gib  # planned as given: the load-time check is not the point here
    plan = plan_engine(config)
    view = resolved_view(_resolved(sglang_parser, config, gpu_gib * 1024, tmp_path))
    gpu_mib = gpu_gib * 1024
    sglang_reserve_mib = gpu_mib * (1 - view.mem_fraction_static)
    assert abs(plan.reserve / 1024**2 - sglang_reserve_mib) <= 0.0005 * gpu_mib + 1, (plan.reserve_detail,)
    decode = view.cuda_graph_config.decode
    if "no CUDA graphs" not in variant:
        assert f"decode graphs to batch {decode.max_bs}," in plan.reserve_detail


@pytest.mark.parametrize("variant", ["as shipped", "true on-policy"])
@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_widths_and_kv_per_token_are_sglangs_own(path, variant, sglang_parser, monkeypatch, tmp_path):
    import torch
    from sglang.srt.arg_groups.overrides import model_config_of, resolved_view
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim
    from sglang.srt.runtime_context import parallel_widths_of

    from slimrl.megatron_bridge.archs import read_model_arch

    monkeypatch.chdir(REPO)
    config = load_config(path, VARIANTS[variant])
    args = _resolved(sglang_parser, config, config.cluster.gpu_memory_gb * 1024, tmp_path)
    view = resolved_view(args)
    widths = parallel_widths_of(view)
    ours = EngineWidths.of(config)
    assert (ours.attn_dp, ours.attn_tp, ours.moe_ep, ours.moe_tp) == (
        widths["attn_dp_size"], widths["attn_tp_size"], widths["moe_ep_size"], widths["moe_tp_size"]
    )  # fmt: skip
    assert view.kv_cache_dtype == "auto"
    model = model_config_of(args)
    assert model.dtype == torch.bfloat16  # KV and unquantised weights: 2 bytes
    layers = model.num_hidden_layers
    if model.attention_arch.name == "MLA":
        per_token = calculate_mla_kv_cache_dim(model_config=model, kv_cache_dtype=torch.bfloat16) * layers * 2
    else:
        per_token = 2 * layers * model.get_num_kv_heads(widths["attn_tp_size"]) * model.head_dim * 2
    arch = read_model_arch(config.model.hf_checkpoint)
    assert kv_bytes_per_token(arch, ours, 2) == per_token == plan_engine(config).kv_per_token
